"""Reductions of a broadcast tensor that keep its size-one axes, read beside a sibling reduction
of the same axes that iterates there: masked mean pooling ``sum(x * m[..., None], 1) /
sum(m[..., None], 1)`` over any axis, masked maxima and variances. The mask's sum is computed at
the size its readers give it (``canonical::widen_broadcast_reductions``), so both reductions run
in one kernel. Checked against NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

F32 = DataType.Float


def _bc(fd: FusionDefinition, t: Any, rank: int, dims: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=[-1] * rank, broadcast_dims=list(dims))


def _mask(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> np.ndarray:
    m = rng.random(tuple(shape)) < 0.6
    m.flat[0] = True
    return m.astype({"float": np.float32, "int": np.int64, "bool": np.bool_}[dtype])


def _mask_dtype(dtype: str) -> DataType:
    return {"float": F32, "int": DataType.Int, "bool": DataType.Bool}[dtype]


def _masked_mean(shape: Sequence[int], mask_axes: Sequence[int], red: int, keepdim: bool, mask_dtype: str,
                 clamp: bool) -> Tuple[FusionDefinition, List[np.ndarray], np.ndarray]:
    """``sum(x * m, red) / clamp(sum(m, red), 1e-9)`` with the mask over ``mask_axes`` of x."""
    rank = len(shape)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank, F32)
        m = fd.define_tensor([-1] * len(mask_axes), _mask_dtype(mask_dtype))
        mf = _bc(fd, fd.ops.cast(m, F32), rank, mask_axes)
        num = fd.ops.sum(fd.ops.mul(x, mf), dims=[red], keepdim=keepdim)
        den = fd.ops.sum(mf, dims=[red], keepdim=keepdim)
        if clamp:
            den = fd.ops.clamp(den, min=1e-9)
        fd.add_output(fd.ops.div(num, den))
    rng = np.random.default_rng(len(shape) * 101 + red * 7 + sum(shape))
    xs = rng.standard_normal(tuple(shape)).astype(np.float32)
    ms = _mask(rng, [shape[a] for a in mask_axes], mask_dtype)
    view = [1] * rank
    for a in mask_axes:
        view[a] = shape[a]
    m64 = ms.astype(np.float64).reshape(view)
    den64 = np.broadcast_to(m64, tuple(shape)).sum(red, keepdims=keepdim)
    if clamp:
        den64 = np.maximum(den64, 1e-9)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (xs.astype(np.float64) * m64).sum(red, keepdims=keepdim) / den64
    return fd, [xs, ms], want


def _check(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


CASES = [
    # (x shape, mask axes, reduced axis): tokens as the outer, inner and a middle axis.
    ((8, 128, 64), (0, 1), 1),
    ((4, 33, 17), (0, 1), 1),
    ((8, 64, 128), (0, 2), 2),
    ((3, 5, 7), (0, 2), 2),
    ((4, 32, 4, 16), (0, 1), 1),
    ((2, 3, 40, 8), (0, 2), 2),
    ((6, 9, 2), (1,), 1),
    ((1, 7, 5), (0, 1), 1),
]


@pytest.mark.parametrize("shape,mask_axes,red", CASES)
@pytest.mark.parametrize("keepdim", [False, True])
def test_masked_mean_is_one_kernel(shape: Tuple[int, ...], mask_axes: Tuple[int, ...], red: int,
                                   keepdim: bool) -> None:
    fd, ins, want = _masked_mean(shape, mask_axes, red, keepdim, "float", clamp=True)
    assert len(fd.lower(ins).kernels) == 1
    _check(fd.execute(ins)[0], want)


@pytest.mark.parametrize("mask_dtype", ["int", "bool"])
def test_masked_mean_of_integer_and_bool_masks(mask_dtype: str) -> None:
    fd, ins, want = _masked_mean((5, 19, 12), (0, 1), 1, False, mask_dtype, clamp=True)
    assert len(fd.lower(ins).kernels) == 1
    _check(fd.execute(ins)[0], want)


def test_empty_rows_divide_like_numpy() -> None:
    """A sequence with no tokens: 0 / 0 without the clamp gives NaN, as in NumPy."""
    fd, ins, want = _masked_mean((3, 6, 4), (0, 1), 1, False, "float", clamp=False)
    ins[1][1] = 0
    m64 = ins[1].astype(np.float64)[:, :, None]
    with np.errstate(invalid="ignore"):
        want = (ins[0].astype(np.float64) * m64).sum(1) / np.broadcast_to(m64, ins[0].shape).sum(1)
    assert np.isnan(want[1]).all()
    _check(fd.execute(ins)[0], want)


def test_mask_count_as_an_output_keeps_its_shape() -> None:
    """The mask's count is also an output: it keeps its size-one axis ([B, 1]), and the pooled
    mean is right either way."""
    with FusionDefinition() as fd:
        x, m = fd.define_tensor([-1, -1, -1], F32), fd.define_tensor([-1, -1], F32)
        mf = _bc(fd, m, 3, [0, 1])
        den = fd.ops.sum(mf, dims=[1])
        fd.add_output(fd.ops.div(fd.ops.sum(fd.ops.mul(x, mf), dims=[1]), den))
        fd.add_output(den)
    rng = np.random.default_rng(3)
    xs, ms = rng.standard_normal((4, 9, 6)).astype(np.float32), _mask(rng, (4, 9), "float")
    m64 = ms.astype(np.float64)[:, :, None]
    outs = fd.execute([xs, ms])
    _check(outs[0], (xs * m64).sum(1) / m64.sum(1))
    _check(outs[1], m64.sum(1))


def test_reduction_without_a_sibling_is_not_widened() -> None:
    """``y / sum(m[:, :, None], 1)`` with no reduction of the [B, S, D] size beside it: the
    count is not computed D times over; the result is still right."""
    with FusionDefinition() as fd:
        y, m = fd.define_tensor([-1, -1], F32), fd.define_tensor([-1, -1], F32)
        den = fd.ops.sum(_bc(fd, m, 3, [0, 1]), dims=[1])
        fd.add_output(fd.ops.div(y, den))
    rng = np.random.default_rng(4)
    ys, ms = rng.standard_normal((4, 6)).astype(np.float32), _mask(rng, (4, 9), "float")
    _check(fd.execute([ys, ms])[0], ys / ms.astype(np.float64).sum(1, keepdims=True))


def test_masked_max_and_masked_variance() -> None:
    """Masked max pooling and a masked variance (mean of squares minus the squared mean), each
    dividing by the mask's count: every reduction reads [B, S, D]."""
    with FusionDefinition() as fd:
        x, m = fd.define_tensor([-1, -1, -1], F32), fd.define_tensor([-1, -1], DataType.Bool)
        mb = _bc(fd, m, 3, [0, 1])
        mf = fd.ops.cast(mb, F32)
        cnt = fd.ops.clamp(fd.ops.sum(mf, dims=[1]), min=1.0)
        mean = fd.ops.div(fd.ops.sum(fd.ops.mul(x, mf), dims=[1]), cnt)
        sq = fd.ops.div(fd.ops.sum(fd.ops.mul(fd.ops.mul(x, x), mf), dims=[1]), cnt)
        fd.add_output(fd.ops.max(fd.ops.where(mb, x, float("-inf")), dims=[1]))
        fd.add_output(fd.ops.sub(sq, fd.ops.mul(mean, mean)))
    rng = np.random.default_rng(5)
    xs, ms = rng.standard_normal((6, 21, 10)).astype(np.float32), _mask(rng, (6, 21), "bool")
    ms[:, 0] = True
    x64, m64 = xs.astype(np.float64), ms[:, :, None]
    cnt = np.maximum(np.broadcast_to(m64, xs.shape).sum(1), 1.0)
    mean, sq = (x64 * m64).sum(1) / cnt, (x64 * x64 * m64).sum(1) / cnt
    assert len(fd.lower([xs, ms]).kernels) == 1
    outs = fd.execute([xs, ms])
    _check(outs[0], np.where(m64, x64, -np.inf).max(1))
    np.testing.assert_allclose(np.asarray(outs[1], np.float64), sq - mean * mean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,red", [((6, 21, 10), 1), ((33, 5, 4), 0), ((7, 9), 0), ((2, 3, 4, 5), 2)])
def test_sibling_reduction_output_beside_an_epilogue(shape: Tuple[int, ...], red: int) -> None:
    """A reduction that is only an output (``x.max(red)``) beside a sibling read by an epilogue
    (``x.sum(red) * 2``): one kernel over any reduced axis, the max stored where it completes."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), F32)
        fd.add_output(fd.ops.max(x, dims=[red]))
        fd.add_output(fd.ops.mul(fd.ops.sum(x, dims=[red]), 2.0))
    xs = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    assert len(fd.lower([xs]).kernels) == 1
    outs = fd.execute([xs])
    _check(outs[0], xs.astype(np.float64).max(red))
    _check(outs[1], xs.astype(np.float64).sum(red) * 2)


@settings(max_examples=40, deadline=None)
@given(
    rank=st.integers(2, 4),
    data=st.data(),
    keepdim=st.booleans(),
    mask_dtype=st.sampled_from(["float", "int", "bool"]),
    clamp=st.booleans(),
)
def test_random_masked_means_match_numpy(rank: int, data: st.DataObject, keepdim: bool, mask_dtype: str,
                                         clamp: bool) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    red = data.draw(st.integers(0, rank - 1))
    others = [a for a in range(rank) if a != red]
    extra = []
    if others:
        extra = data.draw(st.lists(st.sampled_from(others), unique=True, max_size=len(others) - 1))
    mask_axes = tuple(sorted([red, *extra]))
    fd, ins, want = _masked_mean(shape, mask_axes, red, keepdim, mask_dtype, clamp)
    _check(fd.execute(ins)[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mask_axes,red", [((32, 512, 768), (0, 1), 1), ((16, 256, 300), (0, 2), 2),
                                                 ((4, 128, 12, 64), (0, 1), 1), ((3, 1000, 7), (0, 1), 1)])
def test_masked_mean_on_the_gpu(shape: Tuple[int, ...], mask_axes: Tuple[int, ...], red: int) -> None:
    cp = cupy_or_skip()
    fd, ins, want = _masked_mean(shape, mask_axes, red, False, "int", clamp=True)
    assert len(fd.lower(ins).kernels) == 1
    _check(cp.asnumpy(fd.execute([cp.asarray(a) for a in ins])[0]), want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,red", [((64, 1024, 256), 1), ((4096, 300), 0), ((8, 64, 33, 40), 2)])
def test_sibling_output_reduction_on_the_gpu(shape: Tuple[int, ...], red: int) -> None:
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), F32)
        fd.add_output(fd.ops.max(x, dims=[red]))
        fd.add_output(fd.ops.mul(fd.ops.sum(x, dims=[red]), 2.0))
    xs = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    outs = fd.execute([cp.asarray(xs)])
    _check(cp.asnumpy(outs[0]), xs.astype(np.float64).max(red))
    np.testing.assert_allclose(cp.asnumpy(outs[1]), xs.astype(np.float64).sum(red) * 2, rtol=1e-4, atol=1e-4)
