"""Row fusions over inputs with static size-one axes that every tensor keeps size one (a batch
of one, ``define_tensor([1, S, H])``): the row schedules cache and vectorize such an input like a
full-size one (one wide load per element group, not element loads per reader), and an input
broadcast along a size-one axis that other tensors run is still read in place. Checked against
NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

import re
from typing import Callable, List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def _layernorm(fd: FusionDefinition, x, n: int):  # noqa: ANN001 - definition handles
    last = len(fd_shape(x)) - 1
    mean = fd.ops.mul(fd.ops.sum(x, dims=[last], keepdim=True), 1.0 / n)
    d = fd.ops.sub(x, mean)
    var = fd.ops.mul(fd.ops.sum(fd.ops.mul(d, d), dims=[last], keepdim=True), 1.0 / n)
    return fd.ops.mul(d, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))


def fd_shape(t) -> List[int]:  # noqa: ANN001
    return list(t.shape)


def _np_layernorm(x: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5)


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softmax(fd: FusionDefinition, x, n: int):  # noqa: ANN001
    last = len(fd_shape(x)) - 1
    m = fd.ops.max(x, dims=[last], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(x, m))
    return fd.ops.div(e, fd.ops.sum(e, dims=[last], keepdim=True))


CASES = [
    ([1, 64, 768], _layernorm, _np_layernorm),
    ([1, 33, 1000], _softmax, _np_softmax),
    ([4, 1, 256], _layernorm, _np_layernorm),
    ([1, 1, 2048], _softmax, _np_softmax),
    ([1, 8, 1, 4096], _layernorm, _np_layernorm),
]


@pytest.mark.parametrize("shape,build,ref", CASES)
def test_kept_size_one_axes_are_cached_and_match_numpy(shape: List[int], build: Callable,
                                                       ref: Callable) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        fd.add_output(build(fd, x, shape[-1]))
    xs = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape).astype(np.float32)
    low = fd.lower([xs])
    assert len(low.kernels) == 1, low.program.segmentation()
    ir = low.kernels[0].kernel_ir
    # x (T0) is read once, by a wide copy into a register cache.
    reads = re.findall(r"(VECTOR x\d+ )?T\d+ = [a-z_]+\([^)]*\bT0\b", ir)
    assert reads and all(v for v in reads), ir
    out = fd.execute([xs])[0]
    np.testing.assert_allclose(out, ref(xs.astype(np.float64)), rtol=1e-5, atol=1e-5)


def test_an_input_broadcast_along_a_size_one_axis_is_read_in_place() -> None:
    # w [1, C, 1] scales x [N, C, H] after a normalization over H: w's size-one axes are run
    # by x, so w is not a full-size input (and the result is still right).
    n, c, h = 3, 5, 256
    with FusionDefinition() as fd:
        x = fd.define_tensor([n, c, h])
        w = fd.define_tensor([1, c, 1])
        y = _layernorm(fd, x, h)
        fd.add_output(fd.ops.mul(y, w))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, c, h)).astype(np.float32)
    ws = rng.standard_normal((1, c, 1)).astype(np.float32)
    out = fd.execute([xs, ws])[0]
    np.testing.assert_allclose(out, _np_layernorm(xs.astype(np.float64)) * ws, rtol=1e-5, atol=1e-5)


def test_a_reduction_over_a_size_one_axis_of_a_segment_input_runs() -> None:
    # max over [1, 1, 8, 42] along a size-one axis and a real one, added back: the reduced
    # size-one axis is not one that every tensor keeps, so the reduction's input is read in
    # place (caching it as full-size made the schedule unplaceable).
    a0 = np.random.default_rng(43368).uniform(-1, 1, (8, 42)).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1])
        t1 = fd.ops.broadcast_in_dim(t0, shape=[-1, -1, -1, -1], broadcast_dims=[2, 3])
        t4 = fd.ops.max(t1, dims=[1, 3], keepdim=True)
        t5 = fd.ops.broadcast_in_dim(t4, shape=[-1, -1, -1, -1], broadcast_dims=[0, 1, 2, 3])
        fd.add_output(fd.ops.add(t1, t5))
    out = fd.execute([a0])[0]
    want = a0[None, None] + a0.max(axis=1)[None, None, :, None]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def _rmsnorm(fd: FusionDefinition, x, n: int):  # noqa: ANN001
    """RMSNorm: one reduction (the mean square), read back by the unreduced input."""
    last = len(fd_shape(x)) - 1
    ms = fd.ops.mul(fd.ops.sum(fd.ops.mul(x, x), dims=[last], keepdim=True), 1.0 / n)
    return fd.ops.mul(x, fd.ops.rsqrt(fd.ops.add(ms, 1e-6)))


def _var_mean_norm(fd: FusionDefinition, x, n: int):  # noqa: ANN001
    """LayerNorm through one ``var_mean`` (a single Welford reduction)."""
    last = len(fd_shape(x)) - 1
    var, mean = fd.ops.var_mean(x, dims=[last], correction=0, keepdim=True)
    return fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))


def _np_rmsnorm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("shape", [[1, 33, 512], [1, 1, 4096], [1, 7, 1, 96], [2, 1, 300]])
@pytest.mark.parametrize("build,ref", [(_rmsnorm, _np_rmsnorm), (_var_mean_norm, _np_layernorm)],
                         ids=["rmsnorm", "var_mean"])
def test_single_reduction_normalizations_over_a_batch_of_one_take_one_kernel(
        shape: List[int], build: Callable, ref: Callable) -> None:
    """A normalization with one reduction (RMSNorm, a ``var_mean`` LayerNorm) over inputs with
    static size-one axes is one kernel: the unreduced input shares the reduction input's
    size-one axes (it was taken for a broadcast operand, and the fusion ran as two kernels)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        fd.add_output(build(fd, x, shape[-1]))
    xs = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    low = fd.lower([xs])
    assert len(low.kernels) == 1, low.program.segmentation()
    out = fd.execute([xs])[0]
    np.testing.assert_allclose(out, ref(xs.astype(np.float64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,c,h,w", [(1, 64, 8, 8), (1, 8, 5, 7), (2, 8, 5, 7)])
def test_group_norm_over_a_batch_of_one_takes_one_kernel(n: int, c: int, h: int, w: int) -> None:
    """GroupNorm(4) as torch traces it, with the batch of one a static size-one axis."""
    g = 4
    with FusionDefinition() as fd:
        x = fd.define_tensor([n, c, h, w])
        xr = fd.ops.reshape(x, [n, g, c // g, h, w])
        var, mean = fd.ops.var_mean(xr, dims=[2, 3, 4], correction=0)
        y = fd.ops.mul(fd.ops.sub(xr, fd.ops.broadcast_in_dim(mean, [-1] * 5, [0, 1])),
                       fd.ops.rsqrt(fd.ops.broadcast_in_dim(fd.ops.add(var, 1e-5), [-1] * 5, [0, 1])))
        fd.add_output(fd.ops.reshape(y, [n, c, h, w]))
    xs = np.random.default_rng(c * h).standard_normal((n, c, h, w)).astype(np.float32)
    low = fd.lower([xs])
    assert len(low.kernels) == 1, low.program.segmentation()
    xr64 = xs.astype(np.float64).reshape(n, g, -1)
    want = (xr64 - xr64.mean(-1, keepdims=True)) / np.sqrt(xr64.var(-1, keepdims=True) + 1e-5)
    want = want.reshape(xs.shape)
    np.testing.assert_allclose(fd.execute([xs])[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, perm", [((500, 1, 1), [0, 2, 1]), ((70, 1), [1, 0]),
                                         ((3, 7, 1, 1), [0, 3, 2, 1]), ((1, 5, 1, 9), [2, 3, 0, 1])])
def test_a_permute_of_runtime_ones_is_a_copy(shape, perm) -> None:
    """A permute whose axes of a runtime size other than one keep their order moves no
    element at those sizes: the pointwise schedule copies it (a 64x64 transpose tile held
    one valid element), while the same fusion at sizes it does transpose gets the tiles."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.permute(fd.ops.exp(x), perm))
    for sizes in (shape, tuple(n if n != 1 else 33 for n in shape)):
        a = np.random.default_rng(5).standard_normal(sizes).astype(np.float32)
        (out,) = fd.execute([a])
        np.testing.assert_allclose(out, np.exp(a.astype(np.float64)).transpose(perm), rtol=1e-6)
        plan = fd._core.auto_program([list(sizes)])
        moved = [a for a in perm if sizes[a] != 1] != sorted(a for a in perm if sizes[a] != 1)
        assert plan.heuristic == ("transpose" if moved else "pointwise"), (sizes, plan.heuristic)


@pytest.mark.parametrize("shape,perm", [((4, 1), (1, 0)), ((3, 1, 5), (1, 2, 0)), ((1, 3, 5), (2, 0, 1)),
                                        ((3, 5, 1), (2, 1, 0))])
@pytest.mark.parametrize("readers", [2, 3])
def test_a_permuted_broadcast_read_by_several_readers_that_expand_it(shape: tuple, perm: tuple,
                                                                     readers: int) -> None:
    # Each reader that expands the permuted size-one axis gets its own copy of the permute.
    out_shape = [shape[a] for a in perm]
    wide = [s if s != 1 else 2 for s in out_shape]
    with FusionDefinition() as fd:
        x = fd.define_tensor([1 if s == 1 else -1 for s in shape])
        y = fd.define_tensor([-1] * len(shape))
        p = fd.ops.permute(x, list(perm))
        ops = [fd.ops.add, fd.ops.mul, fd.ops.sub][:readers]
        for op in ops:
            fd.add_output(op(p, y))
    rng = np.random.default_rng(len(shape) + readers)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(wide).astype(np.float32)
    got = fd.execute([a, b])
    pa = a.astype(np.float64).transpose(perm)
    wants = [pa + b, pa * b, pa - b][:readers]
    for g, w in zip(got, wants):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [[1, 1], [1, 1, 1], [3, 1], [1, 4]])
def test_a_broadcast_scalar_expression_summed_twice(shape: List[int]) -> None:
    # `s + 1.0` (math on a runtime scalar alone) broadcast to `shape`, its row sums read by
    # their total and by the difference: each reader's copy of the scalar math keeps the
    # rank it was made at.
    rank = len(shape)
    with FusionDefinition() as fd:
        o = fd.ops
        s = fd.define_scalar(dtype=DataType.Double)
        b = o.broadcast_in_dim(o.add(s, 1.0), shape, [])
        r = o.sum(b, dims=[rank - 1])
        fd.add_output(o.sub(r, o.sum(r, dims=[0], keepdim=True)))
        fd.add_output(o.mul(r, 2.0))
    got_d, got_2 = fd.execute([0.5])
    r_np = np.full(shape, 1.5).sum(rank - 1)
    np.testing.assert_allclose(got_d, r_np - r_np.sum(0, keepdims=True))
    np.testing.assert_allclose(got_2, 2 * r_np)
