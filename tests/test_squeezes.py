"""Squeezes as model code writes them: a column taken as ``x[:, k:k+1].squeeze(1)`` (the slice's
width is one only for sizes above ``k``), a declared size-one axis squeezed after element-wise
math, squeezes of transposed slices (box coordinates against ``y[:, k:k+1].T``). The automatic
path moves each squeeze to the inputs (through element-wise ops and permutes), where it is a
view of the input or a one-wide read of the slice: one kernel, checked against NumPy in
float64. A slice that is not one wide for the given sizes is a KilnError naming the squeezed
tensor and axis, raised when the inputs are bound."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError

UNARY: Dict[str, Tuple[Callable[[Any, Any], Any], Callable[[np.ndarray], np.ndarray]]] = {
    "sigmoid": (lambda fd, t: fd.ops.sigmoid(t), lambda a: 1.0 / (1.0 + np.exp(-a))),
    "abs": (lambda fd, t: fd.ops.abs(t), np.abs),
    "relu": (lambda fd, t: fd.ops.relu(t), lambda a: np.maximum(a, 0.0)),
    "neg": (lambda fd, t: fd.ops.neg(t), np.negative),
    "tanh": (lambda fd, t: fd.ops.tanh(t), np.tanh),
    "twice": (lambda fd, t: fd.ops.mul(t, 2.0), lambda a: 2.0 * a),
}
BINARY: Dict[str, Tuple[Callable[[Any, Any, Any], Any], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "add": (lambda fd, a, b: fd.ops.add(a, b), np.add),
    "mul": (lambda fd, a, b: fd.ops.mul(a, b), np.multiply),
    "max": (lambda fd, a, b: fd.ops.maximum(a, b), np.maximum),
}


@st.composite
def programs(draw: Any) -> Dict[str, Any]:
    rank = draw(st.integers(2, 3))
    sizes = [draw(st.integers(2, 7)) for _ in range(rank)]
    axis = draw(st.integers(0, rank - 1))
    # How the squeezed axis gets its size one: a declared size-one input axis, or a one-wide
    # slice of a runtime size at column k.
    source = draw(st.sampled_from(["declared", "slice"]))
    k = draw(st.integers(0, sizes[axis] - 1))
    names = sorted(UNARY) + sorted(BINARY)
    ops = draw(st.lists(st.tuples(st.sampled_from(names), st.booleans()), max_size=4))
    perm = draw(st.permutations(range(rank))) if draw(st.booleans()) else None
    epilogue = draw(st.sampled_from([None, *sorted(BINARY)]))
    return dict(rank=rank, sizes=sizes, axis=axis, source=source, k=k, ops=ops, perm=perm, epilogue=epilogue)


def build(p: Dict[str, Any]) -> Tuple[FusionDefinition, List[np.ndarray], np.ndarray, List[int]]:
    """The fusion, its inputs, the float64 reference and a shape whose slice is empty."""
    rank, sizes, axis, k = p["rank"], p["sizes"], p["axis"], p["k"]
    rng = np.random.default_rng(sum(sizes) * 31 + axis * 7 + k)
    declared = [-1] * rank
    if p["source"] == "declared":
        declared[axis] = 1
        shape = [1 if a == axis else n for a, n in enumerate(sizes)]
    else:
        shape = list(sizes)
    x = rng.standard_normal(shape).astype(np.float32)
    # A second input of the one-wide shape (size one along the axis) for binary ops.
    narrow = [1 if a == axis else n for a, n in enumerate(sizes)]
    y = rng.standard_normal(narrow).astype(np.float32)
    inputs = [x, y]
    with FusionDefinition() as fd:
        tx = fd.define_tensor(declared, DataType.Float)
        ty = fd.define_tensor([1 if a == axis else -1 for a in range(rank)], DataType.Float)
        if p["source"] == "slice":
            start = [k if a == axis else 0 for a in range(rank)]
            stop = [k + 1 if a == axis else fd.ops.size(tx, a) for a in range(rank)]
            t = fd.ops.slice(tx, start, stop)
            ref = np.take(x.astype(np.float64), [k], axis=axis)
        else:
            t = tx
            ref = x.astype(np.float64)
        yref = y.astype(np.float64)
        for name, with_y in p["ops"]:
            if name in UNARY:
                t = UNARY[name][0](fd, t)
                ref = UNARY[name][1](ref)
            else:
                other, oref = (ty, yref) if with_y else (t, ref)
                t = BINARY[name][0](fd, t, other)
                ref = BINARY[name][1](ref, oref)
        squeeze_at = axis
        if p["perm"] is not None:
            t = fd.ops.permute(t, list(p["perm"]))
            ref = np.transpose(ref, p["perm"])
            squeeze_at = list(p["perm"]).index(axis)
        t = fd.ops.squeeze(t, [squeeze_at])
        ref = np.squeeze(ref, squeeze_at)
        if p["epilogue"] is not None:
            rest = list(ref.shape)
            z = rng.standard_normal(rest).astype(np.float32)
            tz = fd.define_tensor([-1] * len(rest), DataType.Float)
            inputs.append(z)
            t = BINARY[p["epilogue"]][0](fd, t, tz)
            ref = BINARY[p["epilogue"]][1](ref, z.astype(np.float64))
        fd.add_output(t)
    empty = list(shape)
    empty[axis] = k  # columns 0..k-1 only: the slice k:k+1 is empty
    p["squeezed_axis"] = squeeze_at
    return fd, inputs, ref, empty


@settings(max_examples=60, deadline=None)
@given(programs())
def test_squeezes_sink_to_the_inputs_and_match_numpy(p: Dict[str, Any]) -> None:
    fd, inputs, ref, empty = build(p)
    (got,) = fd.execute([a.copy() for a in inputs])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert len(fd.lower(inputs).kernels) == 1, p
    if p["source"] == "slice":
        bad = [np.zeros(empty, np.float32), *inputs[1:]]
        axis = p["squeezed_axis"]
        with pytest.raises(KilnError, match=rf"squeeze: axis {axis} of T\d+ must have size one"):
            fd.execute(bad)


def test_box_overlap_of_column_slices_is_one_kernel() -> None:
    # torchvision's box_iou style: columns as one-wide slices, one set transposed.
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1], DataType.Float)
        b = fd.define_tensor([-1, -1], DataType.Float)

        def col(t: Any, c: int) -> Any:
            return fd.ops.slice(t, [0, c], [fd.ops.size(t, 0), c + 1])

        lo = fd.ops.maximum(col(a, 0), fd.ops.permute(col(b, 0), [1, 0]))
        hi = fd.ops.minimum(col(a, 2), fd.ops.permute(col(b, 2), [1, 0]))
        fd.add_output(fd.ops.relu(fd.ops.sub(hi, lo)))
    rng = np.random.default_rng(3)
    x, y = rng.random((9, 4)).astype(np.float32), rng.random((5, 4)).astype(np.float32)
    (got,) = fd.execute([x, y])
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    want = np.maximum(np.minimum(xd[:, 2:3], yd[:, 2:3].T) - np.maximum(xd[:, 0:1], yd[:, 0:1].T), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert len(fd.lower([x, y]).kernels) == 1


@pytest.mark.parametrize("op", ["cast", "neg", "exp"])
@pytest.mark.parametrize("dtype", [DataType.Half, DataType.Float])
def test_squeezed_column_slices_of_a_computed_tensor_are_one_kernel(op: str, dtype: DataType) -> None:
    # torchvision's box_iou on fp16 boxes: the columns are squeezed one-wide slices of the boxes
    # cast to float; the slice moves through the cast to the input, and the squeeze after it
    # sinks to it too, so the per-box areas and the pairwise terms share one kernel.
    n, m = 20, 15
    with FusionDefinition() as fd:
        o = fd.ops
        b1, b2 = fd.define_tensor([-1, -1], dtype), fd.define_tensor([-1, -1], dtype)

        def pre(t: Any) -> Any:
            t = o.cast(t, DataType.Float)
            return t if op == "cast" else getattr(o, op)(t)

        b1, b2 = pre(b1), pre(b2)

        def col(t: Any, c: int) -> Any:
            return o.squeeze(o.slice(t, [0, c], [o.size(t, 0), c + 1]), [1])

        def area(t: Any) -> Any:
            return o.mul(o.sub(col(t, 2), col(t, 0)), o.sub(col(t, 3), col(t, 1)))

        big1 = o.broadcast_in_dim(b1, [n, m, 4], [0, 2])
        big2 = o.broadcast_in_dim(b2, [n, m, 4], [1, 2])
        lo = o.select(o.maximum(big1, big2), 2, 0)
        s = o.add(o.broadcast_in_dim(area(b1), [n, m], [0]), o.broadcast_in_dim(area(b2), [n, m], [1]))
        fd.add_output(o.div(lo, s))
    np_dt = np.float16 if dtype == DataType.Half else np.float32
    rng = np.random.default_rng(11)

    def boxes(k: int) -> np.ndarray:
        # corners (x0, y0, x0 + w, y0 + h): the areas stay positive through every op here
        xy = rng.random((k, 2))
        return np.concatenate([xy, xy + rng.random((k, 2)) + 0.1], 1).astype(np_dt)

    x, y = boxes(n), boxes(m)
    (got,) = fd.execute([x, y])
    f = {"cast": lambda t: t, "neg": np.negative, "exp": np.exp}[op]
    xd, yd = f(x.astype(np.float64)), f(y.astype(np.float64))

    def area_np(t: np.ndarray) -> np.ndarray:
        return (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])

    want = np.maximum(xd[:, None, 0], yd[None, :, 0]) / (area_np(xd)[:, None] + area_np(yd)[None, :])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(fd.lower([x, y]).kernels) == 1


@pytest.mark.parametrize("cols", [7, 1000])
def test_squeezed_statistics_of_a_layernorm_stay_in_its_kernel(cols: int) -> None:
    # Apex-style LayerNorm returning its mean and inverse deviation squeezed: the squeezes of
    # values computed from the reductions stay (the statistic is read as such), where sinking
    # them left lower-rank copies of `1 / cast(N)` beside the rows, a kernel of their own.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        n = fd.ops.cast(fd.ops.size(x, 1), DataType.Float)
        mean = fd.ops.div(fd.ops.sum(x, dims=[1], keepdim=True), n)
        ex2 = fd.ops.div(fd.ops.sum(fd.ops.mul(x, x), dims=[1], keepdim=True), n)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.sub(ex2, fd.ops.mul(mean, mean)), 1e-5))
        fd.add_output(fd.ops.mul(fd.ops.sub(x, mean), rstd))
        fd.add_output(fd.ops.squeeze(mean, [1]))
        fd.add_output(fd.ops.squeeze(rstd, [1]))
    a = (np.random.default_rng(cols).standard_normal((37, cols)) + 0.5).astype(np.float32)
    y, m, r = fd.execute([a])
    ad = a.astype(np.float64)
    md = ad.mean(1)
    rd = 1.0 / np.sqrt((ad * ad).mean(1) - md * md + 1e-5)
    np.testing.assert_allclose(y, (ad - md[:, None]) * rd[:, None], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(m, md, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r, rd, rtol=1e-4)
    assert len(fd.lower([a]).kernels) == 1
