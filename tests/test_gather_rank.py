"""Gathers made at their reader's rank.

Models gather rows from a table and then broadcast or reshape them: ATen's embedding is
``index_select(w, ids.reshape(-1), 0).view(B, S, H)``, positions are added over the batch
(``x + wpe[pos]``), a per-class weight scales each row (``x * w[labels][:, None]``). The
automatic path moves the broadcast or the reshape to the gather's table (read as a view of
the input) and its index, so the rows are gathered in the output's loops: one kernel, where
the gathered rows used to be stored whole by a kernel of their own. Every case is checked
against NumPy in float64, automatically scheduled and as written, with its kernel count; a
property test draws tables, gathered axes, index forms and readers at random.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError
from kiln.execute import lowered_for
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

Build = Callable[[], FusionDefinition]
Inputs = Callable[[np.random.Generator], List[np.ndarray]]
Ref = Callable[..., List[np.ndarray]]

B, S, V, H = 3, 7, 50, 33


def _embedding(flat: str, positions: bool, fixed: bool) -> Build:
    """ATen's embedding of a [B, S] batch of ids, optionally plus the first S rows of a
    position table; ``flat``: how the ids are flattened (-1, B*S, or runtime sizes)."""
    def build() -> FusionDefinition:
        with FusionDefinition() as fd:
            w = fd.define_tensor([V, H] if fixed else [-1, -1])
            ids = fd.define_tensor([B, S] if fixed else [-1, -1], dtype=DataType.Int)
            if flat == "sizes":
                b, s, h = fd.ops.size(ids, 0), fd.ops.size(ids, 1), fd.ops.size(w, 1)
                g = fd.ops.index_select(w, fd.ops.reshape(ids, [fd.ops.mul(b, s)]), 0)
                e = fd.ops.reshape(g, [b, s, h])
            else:
                g = fd.ops.index_select(w, fd.ops.reshape(ids, [-1] if flat == "-1" else [B * S]), 0)
                e = fd.ops.reshape(g, [B, S, H])
            if positions:
                p = fd.define_tensor([S + 4, H] if fixed else [-1, -1])
                e = fd.ops.add(e, fd.ops.broadcast_in_dim(fd.ops.slice(p, [0, 0], [S, H]), [B, S, H], [1, 2]))
            fd.add_output(e)
        return fd
    return build


def _embedding_inputs(positions: bool) -> Inputs:
    def make(rng: np.random.Generator) -> List[np.ndarray]:
        a = [rng.standard_normal((V, H)).astype(np.float32), rng.integers(0, V, (B, S))]
        return a + ([rng.standard_normal((S + 4, H)).astype(np.float32)] if positions else [])
    return make


def _embedding_ref(w: np.ndarray, ids: np.ndarray, p: Any = None) -> List[np.ndarray]:
    e = w.astype(np.float64)[ids]
    return [e if p is None else e + p[:S]]


def _positions_added() -> FusionDefinition:
    """``x + wpe[pos]`` over the batch: the gathered [S, H] rows broadcast to [B, S, H]."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        wpe = fd.define_tensor([-1, -1])
        pos = fd.define_tensor([-1], dtype=DataType.Int)
        g = fd.ops.index_select(wpe, pos, 0)
        fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(g, [B, S, H], [1, 2])))
    return fd


def _positions_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((B, S, H)).astype(np.float32),
            rng.standard_normal((S + 4, H)).astype(np.float32),
            rng.integers(0, S + 4, S)]


def _class_weights() -> FusionDefinition:
    """``x * w[labels][:, None]`` in half with Int32 labels: one weight per row."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Half)
        w = fd.define_tensor([-1], dtype=DataType.Half)
        labels = fd.define_tensor([-1], dtype=DataType.Int32)
        g = fd.ops.index_select(w, labels, 0)
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(g, [-1, -1], [0])))
    return fd


def _class_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((9, 17)).astype(np.float16), rng.standard_normal(40).astype(np.float16),
            rng.integers(0, 40, 9).astype(np.int32)]


def _class_ref(x: np.ndarray, w: np.ndarray, labels: np.ndarray) -> List[np.ndarray]:
    return [(x.astype(np.float64) * w.astype(np.float64)[labels][:, None]).astype(np.float16)]


def _split_middle() -> FusionDefinition:
    """Rows of a [5, 40, 6] table picked along axis 1 (12 ids), the picked axis viewed as
    [3, 4]; the ids' length is a runtime size."""
    with FusionDefinition() as fd:
        t = fd.define_tensor([5, 40, 6])
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        fd.add_output(fd.ops.mul(fd.ops.reshape(fd.ops.index_select(t, idx, 1), [5, 3, 4, 6]), 2.0))
    return fd


def _split_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((5, 40, 6)).astype(np.float32), rng.integers(0, 40, 12)]


def _split_ref(t: np.ndarray, idx: np.ndarray) -> List[np.ndarray]:
    return [t.astype(np.float64)[:, idx, :].reshape(5, 3, 4, 6) * 2]


def _flat_too() -> FusionDefinition:
    """A [2, 3, 4] batch of ids gathered, handed back both flat and at the batch's shape."""
    with FusionDefinition() as fd:
        w = fd.define_tensor([30, 8])
        ids = fd.define_tensor([2, 3, 4], dtype=DataType.Int)
        g = fd.ops.index_select(w, fd.ops.reshape(ids, [24]), 0)
        fd.add_output(fd.ops.reshape(g, [2, 3, 4, 8]))
        fd.add_output(g)
    return fd


def _flat_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((30, 8)).astype(np.float32), rng.integers(0, 30, (2, 3, 4))]


def _flat_ref(w: np.ndarray, ids: np.ndarray) -> List[np.ndarray]:
    return [w.astype(np.float64)[ids], w.astype(np.float64)[ids.reshape(-1)]]


def _along_split() -> FusionDefinition:
    """take_along_axis with a [5, 8, 1] index (broadcast along the last axis), its picked
    axis viewed as [2, 4], plus another input."""
    with FusionDefinition() as fd:
        t = fd.define_tensor([5, 40, 6])
        idx = fd.define_tensor([5, 8, 1], dtype=DataType.Int)
        x = fd.define_tensor([5, 2, 4, 6])
        fd.add_output(fd.ops.add(fd.ops.reshape(fd.ops.take_along_axis(t, idx, 1), [5, 2, 4, 6]), x))
    return fd


def _along_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((5, 40, 6)).astype(np.float32), rng.integers(0, 40, (5, 8, 1)),
            rng.standard_normal((5, 2, 4, 6)).astype(np.float32)]


def _along_ref(t: np.ndarray, idx: np.ndarray, x: np.ndarray) -> List[np.ndarray]:
    g = np.take_along_axis(t.astype(np.float64), np.broadcast_to(idx, (5, 8, 6)), 1)
    return [g.reshape(5, 2, 4, 6) + x]


# name: (build, inputs, float64 reference, kernels of the automatic path)
_EMB, _EMB_POS = _embedding_inputs(False), _embedding_inputs(True)
CASES: dict = {
    "embedding_flat_minus_one_fixed": (_embedding("-1", False, True), _EMB, _embedding_ref, 1),
    "embedding_flat_minus_one": (_embedding("-1", False, False), _EMB, _embedding_ref, 1),
    "embedding_flat_product": (_embedding("BS", False, False), _EMB, _embedding_ref, 1),
    "embedding_runtime_sizes": (_embedding("sizes", False, False), _EMB, _embedding_ref, 1),
    "embedding_plus_positions": (_embedding("-1", True, True), _EMB_POS, _embedding_ref, 1),
    "embedding_plus_positions_runtime_sizes": (_embedding("sizes", True, False), _EMB_POS, _embedding_ref, 1),
    "positions_added": (_positions_added, _positions_inputs,
                        lambda x, w, p: [x + w.astype(np.float64)[p]], 1),
    "class_weights_half": (_class_weights, _class_inputs, _class_ref, 1),
    "split_middle_axis": (_split_middle, _split_inputs, _split_ref, 1),
    "flat_and_batched": (_flat_too, _flat_inputs, _flat_ref, 1),
    "along_split": (_along_split, _along_inputs, _along_ref, 1),
}


def _check(got: List[Any], want: List[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape
        if w.dtype == np.float16:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3, atol=1e-3)
        else:
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy(name: str) -> None:
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(1))
    _check(build().execute(a), ref(*a))


# (Unscheduled, a fusion of fixed sizes holds whole tensors in one thread's registers: its
# kernel is for the interpreter, and spills where compiled.)
@pytest.mark.may_spill
@pytest.mark.parametrize("name", sorted(CASES))
def test_as_written_matches_numpy(name: str) -> None:
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(1))
    _check(build().execute(a, as_written=True), ref(*a))


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_kernel(name: str) -> None:
    build, inputs, _, kernels = CASES[name]
    low = lowered_for(build(), inputs(np.random.default_rng(2)))
    assert len(low.kernels) == kernels, low.host_program


def test_a_strided_table_is_gathered_in_place() -> None:
    """A table that is not row-major has no row-major view at the broadcast shape: it is read
    through its own strides (`view_strided_gather_tables`), in the output's kernel."""
    a = _embedding_inputs(False)(np.random.default_rng(3))
    a[0] = np.asfortranarray(a[0])
    fd = _embedding("-1", False, True)()
    _check(fd.execute(a), _embedding_ref(*a))
    assert len(lowered_for(fd, a).kernels) == 1


@pytest.mark.parametrize(("name", "pos", "bad", "names"), [
    # (the flattened ids, T2, are the index the user's gather reads)
    ("embedding_flat_minus_one_fixed", 1, V, r"index tensor T2 holds 50 at element 20; T0 has 50 entries"),
    ("class_weights_half", 2, -1, r"index tensor T2 holds -1 at element 8; T1 has 40 entries"),
])
def test_out_of_range_ids_name_the_users_tensors(name: str, pos: int, bad: int, names: str) -> None:
    build, inputs, _, _ = CASES[name]
    a = inputs(np.random.default_rng(4))
    a[pos].reshape(-1)[-1] = bad
    with pytest.raises(KilnError, match=names):
        build().execute(a)


@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC wheels (see DEVELOPERS.md)")
def test_every_kernel_compiles() -> None:
    for name in sorted(CASES):
        build, inputs, _, _ = CASES[name]
        for k in build().lower(inputs(np.random.default_rng(5))).kernels:
            compile_cubin(k.cuda_source, k.kernel_name, arch="sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_numpy(name: str) -> None:
    cp = cupy_or_skip()
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(6))
    got = build().execute([cp.asarray(x) for x in a])
    _check([cp.asnumpy(g) for g in got], ref(*a))


# --- random gathers and readers ------------------------------------------------------------

N_EXAMPLES = int(os.environ.get("KILN_GATHER_EXAMPLES", "40"))

Drawn = Tuple[FusionDefinition, List[np.ndarray], List[np.ndarray], bool]


@st.composite
def gathers(draw: Any) -> Drawn:
    """A table of rank 1-3 gathered along a random axis by a rank-1 index (index_select) or
    a full-rank one (take_along_axis, size one on random axes), then read through a
    broadcast to a higher rank (added to an input) or a reshape splitting the gathered axis.
    Returns the fusion, inputs, the float64 reference and whether one kernel is expected."""
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 6)) for _ in range(rank)]
    dim = draw(st.integers(0, rank - 1))
    shape[dim] = draw(st.integers(1, 12))
    along = rank > 1 and draw(st.booleans())
    split = draw(st.booleans())
    factors = [draw(st.integers(1, 4)) for _ in range(draw(st.integers(2, 3)))] if split else []
    n = int(np.prod(factors)) if split else draw(st.integers(1, 10))
    fixed = draw(st.booleans())
    half = draw(st.booleans())
    int32 = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    dt, npdt = (DataType.Half, np.float16) if half else (DataType.Float, np.float32)
    table = rng.standard_normal(shape).astype(npdt)
    if along:
        ishape = [1 if draw(st.booleans()) else s for s in shape]
        ishape[dim] = n
    else:
        ishape = [n]
    index = rng.integers(0, shape[dim], ishape).astype(np.int32 if int32 else np.int64)
    if along:
        picked = np.take_along_axis(table.astype(np.float64), np.broadcast_to(
            index, [n if a == dim else s for a, s in enumerate(shape)]), dim)
    else:
        picked = np.take(table.astype(np.float64), index, axis=dim)
    gshape = list(picked.shape)
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape if fixed else [-1] * rank, dtype=dt)
        idt = DataType.Int32 if int32 else DataType.Int
        i = fd.define_tensor(ishape if (fixed or along) else [-1], dtype=idt)
        g = fd.ops.take_along_axis(t, i, dim) if along else fd.ops.index_select(t, i, dim)
        if split:
            new = gshape[:dim] + factors + gshape[dim + 1:]
            fd.add_output(fd.ops.mul(fd.ops.reshape(g, new), 2.0))
            ref = [picked.reshape(new) * 2]
            ins = [table, index]
        else:
            extra = draw(st.integers(1, 2))
            out_rank = rank + extra
            kept = sorted(draw(st.permutations(range(out_rank)))[:rank])
            oshape = [draw(st.integers(1, 4)) for _ in range(out_rank)]
            for k, a in enumerate(kept):
                oshape[a] = gshape[k]
            x = fd.define_tensor([-1] * out_rank, dtype=dt)
            fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(g, oshape, kept)))
            xv = rng.standard_normal(oshape).astype(npdt)
            bshape = [1] * out_rank
            for k, a in enumerate(kept):
                bshape[a] = gshape[k]
            ref = [xv.astype(np.float64) + picked.reshape(bshape)]
            ins = [table, index, xv]
    if half:
        ref = [r.astype(np.float16) for r in ref]
    # One kernel where the sizes are known when the fusion is defined (a reshape of runtime
    # sizes to fixed ones may need the gathered rows whole) and no axis has size one (a
    # size-one axis of the table is a broadcast, which the index may be too).
    one = fixed and 1 not in shape and 1 not in gshape
    return fd, ins, ref, one


@pytest.mark.may_spill  # (the as-written kernels, see above)
@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(gathers())
def test_random_gathers_match_numpy(drawn: Drawn) -> None:
    fd, ins, ref, one = drawn
    _check(fd.execute(ins), ref)
    _check(fd.execute(ins, as_written=True), ref)
    if one:
        assert len(lowered_for(fd, ins).kernels) == 1, lowered_for(fd, ins).host_program


def test_take_along_axis_broadcasts_size_one_axes() -> None:
    """A table of size one where the index is not (and the reverse) broadcasts, as NumPy's
    take_along_axis does; the output takes the larger size."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, 6, 5])
        idx = fd.define_tensor([4, 3, 1], dtype=DataType.Int)
        fd.add_output(fd.ops.take_along_axis(x, idx, 1))
    rng = np.random.default_rng(7)
    x0, i0 = rng.standard_normal((1, 6, 5)).astype(np.float32), rng.integers(0, 6, (4, 3, 1))
    want = np.take_along_axis(x0.astype(np.float64), i0, 1)
    assert want.shape == (4, 3, 5)
    _check(fd.execute([x0, i0]), [want])
    _check(fd.execute([x0, i0], as_written=True), [want])


def test_fixed_views_of_runtime_sizes_are_planned_per_size() -> None:
    """A reshape of runtime sizes to fixed ones takes the sizes of the call where only they
    match its axes (the plan is then keyed by them): the same definition at other sizes with
    the same element count gets a plan of its own, and every answer is right."""
    rng = np.random.default_rng(8)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.reshape(fd.ops.exp(t), [2, 3, 35]))
    for shape in [(6, 35), (3, 70), (210, 1), (1, 210), (42, 5), (6, 35)]:
        x = rng.standard_normal(shape).astype(np.float32)
        _check(fd.execute([x]), [np.exp(x.astype(np.float64)).reshape(2, 3, 35)])
        assert len(lowered_for(fd, [x]).kernels) == 1
    with FusionDefinition() as fd:
        w = fd.define_tensor([-1, -1])
        ids = fd.define_tensor([-1, -1], dtype=DataType.Int)
        fd.add_output(fd.ops.reshape(fd.ops.index_select(w, fd.ops.reshape(ids, [-1]), 0), [B, S, H]))
    for ishape, rows in [((B, S), V), ((S, B), V), ((B * S, 1), V), ((1, B * S), 9), ((B, S), V)]:
        i0 = rng.integers(0, rows, ishape)
        w0 = rng.standard_normal((rows, H)).astype(np.float32)
        _check(fd.execute([w0, i0]), [w0.astype(np.float64)[i0.reshape(-1)].reshape(B, S, H)])
        # One kernel: with the call's sizes the view's axes match ([21, 33] to [3, 7, 33]).
        assert len(lowered_for(fd, [w0, i0]).kernels) == 1


@pytest.mark.parametrize("table", ["x*2", "exp(x)", "cast_double(x)"])
@pytest.mark.parametrize("index", ["sum", "max", "argmax_like"])
def test_index_select_of_a_computed_table_at_a_reduced_index(table: str, index: str) -> None:
    # `normalized[argmax(sim)]` (DINOv2's KoLeo, VQ lookups, hardest-negative mining): the
    # index is a reduction's result, whose reduced axis stays in the IR's logical domain, so
    # moving the gather through the element-wise op took the rank-1 index for a full-rank one
    # and refused the fusion ("take_along_axis: index ... has rank 1").
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 9)).astype(np.float32)
    m = rng.integers(0, 2, (6, 5)).astype(np.int64)
    s = rng.standard_normal((6, 24)).astype(np.float32)
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, -1], DataType.Float)
        tm = fd.define_tensor([-1, -1], DataType.Int)
        ts = fd.define_tensor([-1, -1], DataType.Float)
        tab = {"x*2": lambda: fd.ops.mul(tx, 2.0), "exp(x)": lambda: fd.ops.exp(tx),
               "cast_double(x)": lambda: fd.ops.cast(tx, DataType.Double)}[table]()
        if index == "sum":
            idx = fd.ops.sum(tm, dims=[1])
        elif index == "max":
            idx = fd.ops.max(tm, dims=[1])
        else:  # the column of each row's largest score, as an argmax written with max
            mx = fd.ops.max(ts, dims=[1], keepdim=True)
            cols = fd.ops.broadcast_in_dim(fd.ops.iota(24, dtype=DataType.Int), [6, 24], [1])
            hit = fd.ops.where(fd.ops.eq(ts, mx), cols, 0)
            idx = fd.ops.max(hit, dims=[1])
        fd.add_output(fd.ops.index_select(tab, idx, 0))
    xd = x.astype(np.float64)
    ref_t = {"x*2": 2 * xd, "exp(x)": np.exp(xd), "cast_double(x)": xd}[table]
    ref_i = {"sum": m.sum(1), "max": m.max(1), "argmax_like": s.argmax(1)}[index]
    (got,) = fd.execute([x, m, s])
    np.testing.assert_allclose(got, ref_t[ref_i], rtol=1e-6, atol=1e-7)
