"""squeeze, broadcast (nvFuser's is_broadcast_dim form) and expand, automatically scheduled
on the CPU interpreter against NumPy, with their errors; ``-m gpu`` runs them on the GPU."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError


def _squeeze_after_keepdim_sum() -> FusionDefinition:
    # mean over the last axis with keepdim, squeezed back: x.sum(-1, keepdim=True).squeeze(-1)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        s = fd.ops.sum(x, [2], keepdim=True)
        fd.add_output(fd.ops.mul(fd.ops.squeeze(s, [2]), 0.5))
    return fd


def _squeeze_input_then_bias() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 1, -1, 1])
        b = fd.define_tensor([-1])
        y = fd.ops.squeeze(x, [1, -1])
        fd.add_output(fd.ops.add(fd.ops.tanh(y), fd.ops.broadcast(b, [True, False])))
    return fd


def _expand_column() -> FusionDefinition:
    with FusionDefinition() as fd:
        b = fd.define_tensor([-1])
        col = fd.ops.broadcast(b, [False, True])
        fd.add_output(fd.ops.sub(fd.ops.expand(col, [-1, 6]), 1.0))
    return fd


def _inputs(name: str, xp: Any) -> List[Any]:
    rng = np.random.default_rng(0)
    if name == "keepdim":
        return [xp.asarray(rng.normal(size=(3, 5, 7)).astype(np.float32))]
    if name == "input":
        return [xp.asarray(rng.normal(size=(4, 1, 9, 1)).astype(np.float32)),
                xp.asarray(rng.normal(size=9).astype(np.float32))]
    return [xp.asarray(rng.normal(size=5).astype(np.float32))]


def _want(name: str, a: List[np.ndarray]) -> np.ndarray:
    if name == "keepdim":
        return 0.5 * a[0].astype(np.float64).sum(-1)
    if name == "input":
        return np.tanh(a[0][:, 0, :, 0].astype(np.float64)) + a[1]
    return np.broadcast_to(a[0][:, None], (5, 6)) - 1.0


CASES = {"keepdim": _squeeze_after_keepdim_sum, "input": _squeeze_input_then_bias, "expand": _expand_column}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shape_ops_match_numpy(name: str) -> None:
    fd = CASES[name]()
    a = _inputs(name, np)
    (got,) = fd.execute(a)
    want = _want(name, a)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_shape_ops_on_gpu(name: str) -> None:
    cp = cupy_or_skip()
    fd = CASES[name]()
    a = _inputs(name, cp)
    (got,) = fd.execute(a)
    want = _want(name, [cp.asnumpy(x) for x in a])
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)


def test_squeeze_of_a_sized_axis_is_an_error() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 3])
        with pytest.raises(KilnError, match="squeeze: axis 1 of T0 has size 3; only size-one axes"):
            fd.ops.squeeze(x, [1])
        fd.add_output(x)


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("then", ["exp", "row_sum", "softmax"])
def test_squeeze_of_a_runtime_size_is_checked_when_it_runs(axis: int, then: str) -> None:
    # nvFuser (and Thunder, which defines every size as -1) squeezes an input's runtime size:
    # it must be one when the fusion runs, and another size is refused before any kernel.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        s = fd.ops.squeeze(x, [axis])
        if then == "exp":
            y = fd.ops.exp(s)
        elif then == "row_sum":
            y = fd.ops.sum(s, [1])
        else:
            m = fd.ops.broadcast(fd.ops.max(s, [1]), [False, True])
            e = fd.ops.exp(fd.ops.sub(s, m))
            y = fd.ops.div(e, fd.ops.broadcast(fd.ops.sum(e, [1]), [False, True]))
        fd.add_output(y)
    shape = [5, 7, 6]
    shape[axis] = 1
    a = np.random.default_rng(axis).standard_normal(shape).astype(np.float32)
    s64 = np.squeeze(a.astype(np.float64), axis)
    if then == "exp":
        want = np.exp(s64)
    elif then == "row_sum":
        want = s64.sum(1)
    else:
        e = np.exp(s64 - s64.max(1, keepdims=True))
        want = e / e.sum(1, keepdims=True)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    shape[axis] = 3
    with pytest.raises(KilnError, match=rf"squeeze: axis {axis} of T0 must have size one"):
        fd.execute([np.ones(shape, np.float32)])


def test_broadcast_and_expand_check_their_ranks() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        with pytest.raises(KilnError, match="broadcast: T0 has rank 2 .* keeps 1 axes"):
            fd.ops.broadcast(x, [True, False])
        with pytest.raises(KilnError, match="expand: T0 has rank 2 but shape"):
            fd.ops.expand(x, [4])
        fd.add_output(x)


def test_squeeze_input_with_wrong_size_is_refused_before_running() -> None:
    fd = _squeeze_input_then_bias()
    bad = [np.ones((4, 2, 9, 1), np.float32), np.ones(9, np.float32)]
    with pytest.raises(KilnError, match="input 0 .*axis 1"):
        fd.execute(bad)


@pytest.mark.parametrize(("shape", "start", "end", "strides"), [
    ((6, 8), [1, 0], [None, 7], [2, 3]),
    ((5, 9), [0, 4], [5, 100], [1, 1]),  # an end past the size is clamped
    ((4, 10), [2, 3], [3, 3], [1, 1]),  # an empty slice
    ((3, 4, 7), [0, 1, 2], [3, 4, 7], [1, 2, 4]),
])
def test_slice_matches_numpy(shape: Any, start: List[int], end: List[Any], strides: List[int]) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.mul(fd.ops.slice(x, start, end, strides), 2.0))
    a = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    (got,) = fd.execute([a])
    want = 2.0 * a[tuple(slice(s, e, st) for s, e, st in zip(start, end, strides))]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_select_drops_the_axis() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        i = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.select(x, 1, i))
        fd.add_output(fd.ops.select(x, -1, 0))
    a = np.random.default_rng(2).normal(size=(2, 5, 3)).astype(np.float32)
    mid, last = fd.execute([a, 3])
    np.testing.assert_array_equal(mid, a[:, 3, :])
    np.testing.assert_array_equal(last, a[:, :, 0])


def test_slice_refusals() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match="slice: T0 has rank 2"):
            fd.ops.slice(x, [0], [1])
        with pytest.raises(KilnError, match="slice: axis 1 has stride 0"):
            fd.ops.slice(x, [0, 0], [1, 1], [1, 0])
        fd.add_output(x)


@pytest.mark.gpu
def test_slice_and_select_on_gpu() -> None:
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.slice(x, [1, 2], [None, 1000], [3, 2]))
        fd.add_output(fd.ops.select(x, 0, 5))
    a = np.random.default_rng(3).normal(size=(64, 999)).astype(np.float32)
    s, row = (cp.asnumpy(o) for o in fd.execute([cp.asarray(a)]))
    np.testing.assert_array_equal(s, a[1::3, 2:1000:2])
    np.testing.assert_array_equal(row, a[5])


# ----------------------------------------------------------------- Scalar sizes in shapes
def _scalar_sizes_fusion() -> FusionDefinition:
    """nvFuser's form: output sizes as integer Scalar inputs, and sizes read off a tensor."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.define_tensor([-1, 1])
        s0 = fd.define_scalar(dtype=DataType.Int)
        b = fd.ops.broadcast_in_dim(x, shape=[s0, fd.ops.size(x, 0)], broadcast_dims=[1])
        e = fd.ops.expand(y, [fd.ops.size(b, 0), fd.ops.size(x, 0)])
        fd.add_output(fd.ops.add(fd.ops.mul(b, 2.0), e))
        fd.add_output(fd.ops.sum(fd.ops.broadcast_in_dim(x, [fd.define_scalar(6), -1], [1]), dims=[0]))
    return fd


def _scalar_sizes_inputs() -> List[Any]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal(7).astype(np.float32), rng.standard_normal((3, 1)).astype(np.float32), 3]


def _scalar_sizes_ref(x: np.ndarray, y: np.ndarray, s0: int) -> List[np.ndarray]:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return [np.broadcast_to(2 * x64, (s0, len(x))) + np.broadcast_to(y64, (s0, len(x))), 6 * x64]


@pytest.mark.parametrize("as_written", [False, True])
def test_scalar_sizes_in_broadcast_and_expand(as_written: bool) -> None:
    a = _scalar_sizes_inputs()
    got = _scalar_sizes_fusion().execute(a, as_written=as_written)
    for g, w in zip(got, _scalar_sizes_ref(*a)):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_scalar_size_that_disagrees_with_the_input_is_an_error() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.broadcast_in_dim(x, [2, s], [1]))
    (out,) = fd.execute([np.ones(4, np.float32), 4])
    assert out.shape == (2, 4)
    with pytest.raises(KilnError, match=r"broadcast_in_dim: \[s0\] must be the shape of T0, axis 0 differs"):
        fd.execute([np.ones(4, np.float32), 5])


def test_float_scalar_size_is_refused() -> None:
    with pytest.raises(KilnError, match="integers"):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            fd.ops.broadcast_in_dim(x, [fd.define_scalar(2.0), -1], [1])


@pytest.mark.gpu
def test_scalar_sizes_on_gpu() -> None:
    cp = cupy_or_skip()
    a = _scalar_sizes_inputs()
    got = _scalar_sizes_fusion().execute([cp.asarray(v) if isinstance(v, np.ndarray) else v for v in a])
    for g, w in zip(got, _scalar_sizes_ref(*a)):
        np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-6, atol=1e-6)


# --------------------------------------------------- nvFuser's None contiguity: expanded axes
def _expanded_input_fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, None])
        y = fd.define_tensor([-1, -1, -1], contiguity=[None, True, True])
        fd.add_output(fd.ops.add(x, fd.ops.sum(y, dims=[0])))
    return fd


@pytest.mark.parametrize("expanded", [True, False])
@pytest.mark.parametrize("as_written", [False, True])
def test_none_contiguity_reads_expanded_arrays(expanded: bool, as_written: bool) -> None:
    """``None`` on an axis of any size marks an expanded (stride-0) axis, as in nvFuser; the
    layout then comes from the arrays given, expanded or not."""
    rng = np.random.default_rng(6)
    if expanded:
        x = np.broadcast_to(rng.standard_normal((4, 1)).astype(np.float32), (4, 5))
        y = np.broadcast_to(rng.standard_normal((1, 4, 5)).astype(np.float32), (3, 4, 5))
    else:
        x = rng.standard_normal((4, 5)).astype(np.float32)
        y = rng.standard_normal((3, 4, 5)).astype(np.float32)
    (got,) = _expanded_input_fusion().execute([x, y], as_written=as_written)
    np.testing.assert_allclose(got, x.astype(np.float64) + y.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_none_contiguity_on_gpu() -> None:
    cp = cupy_or_skip()
    rng = np.random.default_rng(7)
    x = np.broadcast_to(rng.standard_normal((4, 1)).astype(np.float32), (4, 5))
    y = np.broadcast_to(rng.standard_normal((1, 4, 5)).astype(np.float32), (3, 4, 5))
    xd = cp.broadcast_to(cp.asarray(np.ascontiguousarray(x[:, :1])), (4, 5))
    yd = cp.broadcast_to(cp.asarray(np.ascontiguousarray(y[:1])), (3, 4, 5))
    (got,) = _expanded_input_fusion().execute([xd, yd])
    np.testing.assert_allclose(cp.asnumpy(got), x.astype(np.float64) + y.astype(np.float64).sum(0), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_squeeze_of_a_one_wide_slice_of_a_runtime_size(k: int) -> None:
    # Thunder writes ``x[:, k]`` as a slice k:k+1 then a squeeze; with a runtime size the
    # slice's width is ``min(n, k+1) - min(n, k)``, one whenever k < n (checked before the
    # kernel runs, naming the axis).
    with FusionDefinition() as fd:
        w = fd.define_tensor([-1, -1], DataType.Float)
        col = fd.ops.squeeze(fd.ops.slice(w, [0, k], [fd.ops.size(w, 0), k + 1]), [1])
        fd.add_output(fd.ops.mul(col, 2.0))
        fd.add_output(fd.ops.sum(fd.ops.exp(col), dims=[0]))
    a = np.random.default_rng(k).standard_normal((7, 5)).astype(np.float32)
    got, total = fd.execute([a])
    np.testing.assert_allclose(got, 2.0 * a[:, k], rtol=1e-6)
    np.testing.assert_allclose(total, np.exp(a[:, k].astype(np.float64)).sum(), rtol=1e-5)
    with pytest.raises(KilnError, match=r"squeeze: axis 1 of T\d+ must have size one \(.* = 0 for these"):
        fd.execute([np.zeros((7, k), np.float32)])


@pytest.mark.parametrize("op", ["expand", "broadcast_in_dim"])
def test_a_scalar_size_that_disagrees_names_the_op_the_tensor_and_the_axis(op: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 1])
        s = fd.define_scalar(dtype=DataType.Int)
        if op == "expand":
            y = fd.ops.expand(x, [s, s])
        else:
            y = fd.ops.broadcast_in_dim(x, [s, s], [0, 1])
        fd.add_output(fd.ops.mul(y, 2.0))
    a = np.arange(5, dtype=np.float32).reshape(5, 1)
    (got,) = fd.execute([a, 5])
    np.testing.assert_array_equal(got, np.broadcast_to(2 * a, (5, 5)))
    with pytest.raises(KilnError, match=rf"{op}: \[s0, -1\] must be the shape of T0, axis 0 differs "
                                        r"\(i0 = 3, s0 = 5"):
        fd.execute([np.ones((3, 1), np.float32), 5])
