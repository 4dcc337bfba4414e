"""Rules of the automatic schedules that random fusions once broke, each as a family of
fusions over several shapes (size-one axes included), checked against float64 NumPy.

- A tensor whose axes do not line up with a reduction's (another rank, unrelated inputs)
  gets a kernel of its own instead of the reduction's loops.
- An input with a size-one broadcast axis (a keepdim statistic) is read in place, never
  cached and vectorized along loops that cover more elements than it has.
- Reducing a broadcast axis reduces one element, even when the loop runs the extent of the
  axis it is broadcast against.
- A broadcast that one reader concretizes and another (or the output) keeps gets a private
  copy for the concretizing reader.
- An output that other threads read back (a per-row value after a block reduction) is read
  from a register copy, not from Global memory while another thread stores it.
- Sibling reductions (the same axes of tensors of one shape, neither reading the other)
  share one kernel, also when they read different inputs.
- A schedule whose launch the inputs at hand make invalid (a thread dimension sized by an
  axis its heuristic did not size it by) is refused, and the next scheduler or a split
  of the fusion runs it.

Every fusion runs the automatic schedule in the interpreter (``fd.execute`` on NumPy), whose
race and initialization checks fail the test on a wrong schedule; the GPU variant runs the
same fusions through CuPy."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition

Build = Callable[[Tuple[int, ...]], Tuple[FusionDefinition, List[np.ndarray], List[np.ndarray]]]

SHAPES_3D = [(1, 7, 5), (2, 1, 3), (3, 5, 1), (4, 6, 33), (1, 1, 1)]
SHAPES_2D = [(2, 4), (1, 13), (5, 1), (7, 129), (1, 1)]
SHAPES_4D = [(1, 1, 3, 9), (2, 3, 4, 5), (1, 2, 13, 4), (3, 1, 1, 7)]


def _rand(shape: Sequence[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


def unrelated_output_beside_reduction(shape: Tuple[int, ...]):
    """A keepdim min over the leading axes beside a rank-4 broadcast of an unrelated [1]."""
    x, w = _rand(shape, 1), _rand((1,), 2)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1, -1])
        t1 = fd.define_tensor([-1])
        b3 = fd.ops.broadcast_in_dim(t1, shape=[-1, -1, -1], broadcast_dims=[0])
        fd.add_output(fd.ops.broadcast_in_dim(b3, shape=[-1, -1, -1, -1], broadcast_dims=[0, 1, 2]))
        m = fd.ops.min(fd.ops.sub(t0, -1.25), dims=[0, 1], keepdim=True)
        fd.add_output(fd.ops.broadcast_in_dim(m, shape=[-1, -1, -1], broadcast_dims=[0, 1, 2]))
    xd = x.astype(np.float64)
    return fd, [x, w], [w.astype(np.float64).reshape(1, 1, 1, 1), (xd + 1.25).min(axis=(0, 1), keepdims=True)]


def keepdim_statistic_into_full_reduction(shape: Tuple[int, ...]):
    """``max(x + min(x, 1, keepdim))`` over every axis: the row minimum crosses a kernel
    boundary as a [M, 1] tensor that the full reduction reads."""
    x = _rand(shape, 3)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1])
        t1 = fd.ops.min(t0, dims=[1], keepdim=True)
        t2 = fd.ops.add(t0, t1)
        t3 = fd.ops.max(t2, dims=[0, 1])
        fd.add_output(fd.ops.broadcast_in_dim(t3, shape=[-1, -1], broadcast_dims=[]))
        fd.add_output(t1)
    xd = x.astype(np.float64)
    mn = xd.min(axis=1, keepdims=True)
    return fd, [x], [(xd + mn).max().reshape(1, 1), mn]


def reduction_of_a_broadcast(shape: Tuple[int, ...]):
    """``x - sum(bcast(s), 1, keepdim)`` and ``min(x, bcast(s) - sum(bcast(s), 1))``: a sum
    over a size-one broadcast axis that the loops run at x's width."""
    x, s = _rand(shape, 4), np.array(0.375, dtype=np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1])
        t1 = fd.define_tensor([])
        b = fd.ops.broadcast_in_dim(t1, shape=[-1, -1], broadcast_dims=[])
        r = fd.ops.sum(b, dims=[1], keepdim=True)
        fd.add_output(fd.ops.minimum(t0, fd.ops.sub(b, r)))
        fd.add_output(fd.ops.add(t0, fd.ops.neg(r)))
    xd = x.astype(np.float64)
    return fd, [x, s], [np.minimum(xd, 0.0), xd - 0.375]


def shared_broadcast_output(shape: Tuple[int, ...]):
    """A weight broadcast to [1, 1, 1, N] is an output and is compared with x [A, B, C, N];
    beside them a sum over axis 1 added back."""
    x, w = _rand(shape, 5), _rand(shape[-1:], 6)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1, -1, -1])
        t1 = fd.define_tensor([-1])
        wb = fd.ops.broadcast_in_dim(t1, shape=[-1, -1, -1, -1], broadcast_dims=[3])
        fd.add_output(wb)
        fd.add_output(fd.ops.cast(fd.ops.gt(t0, wb), DataType.Float))
        s = fd.ops.sum(t0, dims=[1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1, -1, -1], broadcast_dims=[0, 2, 3])
        fd.add_output(fd.ops.add(t0, sb))
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    want = [wd.reshape(1, 1, 1, -1), (xd > wd).astype(np.float64), xd + xd.sum(axis=1, keepdims=True)]
    return fd, [x, w], want


def per_row_output_read_back(shape: Tuple[int, ...]):
    """``m = max(x, -1)``; ``flag = m > 0.25`` is an output and is read again (``eq(flag, m)``)."""
    x = _rand(shape, 7)
    rank = len(shape)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1] * rank)
        m = fd.ops.max(t0, dims=[rank - 1])
        flag = fd.ops.gt(m, 0.25)
        fd.add_output(flag)
        fd.add_output(fd.ops.cast(fd.ops.eq(fd.ops.cast(flag, DataType.Float), m), DataType.Float))
    md = x.astype(np.float64).max(axis=-1)
    return fd, [x], [md > 0.25, ((md > 0.25).astype(np.float64) == md).astype(np.float64)]


def sibling_reductions(shape: Tuple[int, ...]):
    """A masked sum and a count over the same axes of two inputs (``sum(where(m, x, 0))``,
    ``sum(cast(m))``) and a max of ``y``: every output reduces the axes given by ``shape``'s
    leading entry (0: the first axis, 1: the last, 2: all)."""
    which, dims = shape[0], shape[1:]
    axes = {0: [0], 1: [len(dims) - 1], 2: list(range(len(dims)))}[which]
    x, y = _rand(dims, 8), _rand(dims, 9)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1] * len(dims))
        t1 = fd.define_tensor([-1] * len(dims))
        m = fd.ops.gt(t1, 0.0)
        fd.add_output(fd.ops.sum(fd.ops.where(m, t0, 0.0), dims=axes))
        fd.add_output(fd.ops.sum(fd.ops.cast(m, DataType.Float), dims=axes))
        fd.add_output(fd.ops.max(t1, dims=axes))
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    ax = tuple(axes)
    return fd, [x, y], [np.where(yd > 0, xd, 0.0).sum(axis=ax), (yd > 0).sum(axis=ax).astype(np.float64),
                        yd.max(axis=ax)]


SIBLINGS = [(w, *d) for w in (0, 1, 2) for d in [(5, 3), (1, 7), (33, 129), (4, 1)]] + [(2, 37), (2, 1)]


CASES: List[Tuple[Build, Tuple[int, ...]]] = (
    [(unrelated_output_beside_reduction, s) for s in SHAPES_3D]
    + [(keepdim_statistic_into_full_reduction, s) for s in SHAPES_2D]
    + [(reduction_of_a_broadcast, s) for s in SHAPES_2D]
    + [(shared_broadcast_output, s) for s in SHAPES_4D]
    + [(per_row_output_read_back, s) for s in SHAPES_4D + SHAPES_2D]
    + [(sibling_reductions, s) for s in SIBLINGS]
)


def _ids(case: Tuple[Build, Tuple[int, ...]]) -> str:
    return f"{case[0].__name__}-{'x'.join(map(str, case[1]))}"


def _check(outs: Sequence[Any], want: Sequence[np.ndarray]) -> None:
    assert len(outs) == len(want)
    for got, w in zip(outs, want):
        got = np.asarray(got)
        assert got.shape == w.shape
        np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rule_holds_in_the_interpreter(case: Tuple[Build, Tuple[int, ...]]) -> None:
    build, shape = case
    fd, inputs, want = build(shape)
    _check(fd.execute(inputs), want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rule_holds_on_gpu(case: Tuple[Build, Tuple[int, ...]]) -> None:
    cp = cupy_or_skip()
    build, shape = case
    fd, inputs, want = build(shape)
    outs = fd.execute([cp.asarray(a) for a in inputs])
    _check([cp.asnumpy(o) for o in outs], want)


@pytest.mark.parametrize("shape", SIBLINGS, ids=lambda s: "x".join(map(str, s)))
def test_sibling_reductions_share_one_kernel(shape: Tuple[int, ...]) -> None:
    fd, inputs, _ = sibling_reductions(shape)
    assert len(fd.lower(inputs).kernels) == 1


# -- loop fusion of unswitched tiles ---------------------------------------------------------
def _repeated_tile(source: str) -> str:
    """The bounds test of an unswitched tile that opens twice in one block of ``source``'s
    kernel (two tiles of the same iterations that loop fusion left apart), or ''."""
    body = source[source.index("#endif  // KILN_RUNTIME_CUH"):]
    seen: dict = {}  # indentation -> bounds tests of the tiles opened in the current block there
    for line in body.split("\n"):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        for deeper in [k for k in seen if k > indent]:
            del seen[deeper]  # that block closed
        if "// unswitched" in line:
            test = line.strip().split("  // ")[0]
            if test in seen.get(indent, set()):
                return test
            seen.setdefault(indent, set()).add(test)
    return ""


def _spec_ids() -> List[Any]:
    from families import SPECS

    return [pytest.param(s, id=s.name) for s in SPECS]


@pytest.mark.parametrize("spec", _spec_ids())
def test_sibling_tiles_of_one_loop_are_fused(spec: Any):
    # Cross-entropy over 32000 columns streamed its row with four reductions (max, logsumexp
    # and two sums), each in its own one-trip unswitched tile: four bounds tests, four
    # rounds of loads of the same row, and the reductions' math apart from the loads (0.53x
    # torch.compile on the H200; 1.04x fused). Tiles with the same bounds in one block fuse.
    from kiln.execute import lowered_for

    fam = spec.build(spec.bench)
    if "BFloat16" in fam.dtypes:
        pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 arrays need ml_dtypes")
    low = lowered_for(fam.fd, fam.stand_ins())
    for k, kernel in enumerate(low.kernels):
        repeated = _repeated_tile(kernel.cuda_source_for(False))
        assert not repeated, f"{spec.name} kernel {k}: two unswitched tiles of {repeated[:120]}"


@pytest.mark.parametrize("shape", [[3, 1], [-1, 1], [2, 1, 5]])
def test_statistics_over_a_static_size_one_axis_stay_in_one_kernel(shape: List[int]) -> None:
    """A keepdim max or sum over an axis declared with size one is the element itself (a
    squeeze), broadcast straight back: the squeezed tensor is read as it is, in one kernel
    with the rest (two softmaxes over the size-one axis took 8 kernels)."""
    from kiln.execute import lowered_for

    with FusionDefinition() as fd:
        t = fd.define_tensor(shape)
        p = t
        for _ in range(2):
            e = fd.ops.exp(fd.ops.sub(p, fd.ops.max(p, dims=[1], keepdim=True)))
            p = fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True))
        fd.add_output(fd.ops.mul(p, t))
    sizes = [4 if n == -1 else n for n in shape]
    x = np.random.default_rng(11).standard_normal(sizes).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, x.astype(np.float64), rtol=1e-6)
    assert len(lowered_for(fd, [x]).kernels) == 1


@pytest.mark.parametrize("two_step", [False, True])
@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Int])
def test_a_value_of_a_runtime_size_broadcast_with_a_ramp_stays_in_one_kernel(two_step: bool, dtype) -> None:
    """xPos' centred positions ``iota(S) - S`` broadcast over [B, S, D]: the size's cast has
    no tensor operand, so a broadcast sunk through it is made at the broadcast's rank (it was
    a rank-0 tensor in a kernel of its own), and a broadcast sunk through the difference
    gives the size's value every axis (two broadcasts in a row failed internally)."""
    from kiln.execute import lowered_for

    with FusionDefinition() as fd:
        q = fd.define_tensor([-1, -1, -1])
        s = fd.ops.size(q, 1)
        t = fd.ops.sub(fd.ops.iota(s, dtype=dtype), fd.ops.cast(s, dtype))
        if two_step:
            t = fd.ops.broadcast_in_dim(fd.ops.broadcast_in_dim(t, [-1, -1], [0]), [-1, -1, -1], [1, 2])
        else:
            t = fd.ops.broadcast_in_dim(t, [-1, -1, -1], [1])
        fd.add_output(fd.ops.mul(q, t))
    x = np.random.default_rng(13).standard_normal((2, 21, 8)).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, x * (np.arange(21.0) - 21.0)[None, :, None], rtol=1e-6)
    assert len(lowered_for(fd, [x]).kernels) == 1


@pytest.mark.parametrize("shape", [(7, 33), (1, 5), (130, 1000)])
def test_a_squeezed_epilogue_of_a_keepdim_statistic_stays_in_the_rows_kernel(shape) -> None:
    """Flash-attention style ``(probs, lse)`` with ``lse = log(sum(exp(x), keepdim)).squeeze(1)``:
    the keepdim ``log`` runs its size-one axis on the row's threads, each computing the one
    value in its registers, and the squeezed output reads it there (it took a second kernel)."""
    from kiln.execute import lowered_for

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(fd.ops.exp(x), dims=[1], keepdim=True)
        fd.add_output(fd.ops.div(fd.ops.exp(x), s))
        fd.add_output(fd.ops.squeeze(fd.ops.log(s), [1]))
    x_ = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
    p, lse = fd.execute([x_])
    e = np.exp(x_.astype(np.float64))
    np.testing.assert_allclose(p, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse, np.log(e.sum(1)), rtol=1e-5, atol=1e-6)
    assert len(lowered_for(fd, [x_]).kernels) == 1


def test_a_broadcast_of_a_broadcast_is_one_broadcast() -> None:
    """Mamba's discretisation: ``delta = softplus(dt + dt_bias)`` over [B, L, D] (the bias
    broadcast), then ``exp(delta[..., None] * A)`` over [B, L, D, N]. The two broadcasts of
    the bias compose into one, so no rank-3 tensor is left between it and the output."""
    from kiln.execute import lowered_for

    rng = np.random.default_rng(12)
    with FusionDefinition() as fd:
        dt, dtb, a = fd.define_tensor([-1] * 3), fd.define_tensor([-1]), fd.define_tensor([-1] * 2)
        u = fd.ops.add(dt, fd.ops.broadcast_in_dim(dtb, [-1] * 3, [2]))
        delta = fd.ops.where(fd.ops.gt(u, 20.0), u, fd.ops.log1p(fd.ops.exp(u)))
        d4 = fd.ops.broadcast_in_dim(delta, [-1] * 4, [0, 1, 2])
        fd.add_output(fd.ops.exp(fd.ops.mul(d4, fd.ops.broadcast_in_dim(a, [-1] * 4, [2, 3]))))
    ins = [rng.standard_normal((2, 5, 6)).astype(np.float32) * 10, rng.standard_normal(6).astype(np.float32),
           -np.exp(rng.standard_normal((6, 4))).astype(np.float32)]
    u0 = ins[0].astype(np.float64) + ins[1]
    delta0 = np.where(u0 > 20, u0, np.log1p(np.exp(u0)))
    (got,) = fd.execute(ins)
    np.testing.assert_allclose(got, np.exp(delta0[..., None] * ins[2]), rtol=1e-5, atol=1e-6)
    assert len(lowered_for(fd, ins).kernels) == 1


@pytest.mark.parametrize("rows", [1025, 1031, 4099])
def test_a_schedule_launching_too_many_threads_for_these_sizes_is_passed_over(rows: int) -> None:
    # A [1, 1, 1] statistic reduced over its size-one axes beside a [rows, 1, 1] element-wise
    # output: the looped normalization sized its thread dimension by the statistic's rows
    # and ran the output's rows on it (more than 1024 threads per block).
    rng = np.random.default_rng(rows)
    a = rng.uniform(-1, 1, (rows, 1, 1)).astype(np.float32)
    b = rng.uniform(-1, 1, (1, 1, 1)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        y = fd.define_tensor([1, -1, -1])
        fd.add_output(fd.ops.where(fd.ops.ne(x, y), 0.5, y))
        s = fd.ops.sum(y, [0, 1], keepdim=True)
        fd.add_output(fd.ops.mul(y, fd.ops.broadcast_in_dim(s, [-1, -1, -1], [0, 1, 2])))
    got = fd.execute([a, b])
    np.testing.assert_array_equal(got[0], np.where(a != b, np.float32(0.5), b))
    np.testing.assert_allclose(got[1], b.astype(np.float64) * b.astype(np.float64), rtol=1e-6)
