"""var, var_mean, welford and prod against NumPy float64: numerically stable statistics
(a float32 input with mean 1e4 and standard deviation 1e-2), corrections, keepdim, several
axes, full reductions; ``-m gpu`` checks the GPU against the interpreter."""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError


def _var_mean_fd(rank: int, dims: Sequence[int], correction: int, keepdim: bool,
                 dtype: DataType = DataType.Float) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank, dtype)
        var, mean = fd.ops.var_mean(x, dims, correction=correction, keepdim=keepdim)
        fd.add_output(var)
        fd.add_output(mean)
    return fd


def test_var_mean_is_stable_for_a_large_mean_in_float32() -> None:
    rng = np.random.default_rng(0)
    x = (1e4 + 1e-2 * rng.normal(size=(16, 4096))).astype(np.float32)
    var, mean = _var_mean_fd(2, [1], 1, False).execute([x])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(var, x64.var(axis=1, ddof=1), rtol=1e-5)
    np.testing.assert_allclose(mean, x64.mean(axis=1), rtol=1e-7)
    assert len(_var_mean_fd(2, [1], 1, False).lower([x]).kernels) == 1


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Double])
@pytest.mark.parametrize(("shape", "dims", "mean", "std"), [
    ((8, 3, 5, 5), [0, 2, 3], 1e4, 1e-2),  # BatchNorm's statistics: a streamed column reduction
    ((8, 3, 5, 5), [0, 2, 3], 1e4, 1e-3),
    ((2, 1), [0], 1e8, 1.0),
    ((5, 7), [0], 1e6, 1e-2),
    ((2, 40000), [1], 1e5, 1e-3),  # a double row past what the chip holds: streamed
    ((3, 70001), [1], 1e4, 1e-2),  # a float row past it
    ((2, 3, 64, 700), [2, 3], 1e6, 1e-1),  # GroupNorm-like rows over two axes
])
@pytest.mark.parametrize("outlier", [False, True])
def test_var_mean_is_as_accurate_as_two_passes_where_rows_stream(
        dtype: DataType, shape: Any, dims: List[int], mean: float, std: float, outlier: bool) -> None:
    # var_mean promises a two-pass variance's accuracy in double. Rows a schedule streams
    # from memory take one-pass sums: of `x` and `x * x` in double for float sums, and for
    # double ones (var_mean's own) of `x - k`, `k` the row's first element: unshifted
    # double sums cancel (a mean of 1e8 with variance 2.3 came out 4.0). Each row has its
    # own mean, so a shift taken from another row would show; `outlier` puts the first
    # element of every row 1000 standard deviations away.
    rng = np.random.default_rng(len(shape) + int(mean))
    npd = np.float32 if dtype == DataType.Float else np.float64
    kept = [a for a in range(len(shape)) if a not in dims]
    offsets = np.zeros(shape)
    for i, a in enumerate(kept):
        sh = [1] * len(shape)
        sh[a] = shape[a]
        offsets = offsets + (np.arange(shape[a]) * (i + 1) * 37.0 * std).reshape(sh)
    x = mean + offsets + std * rng.standard_normal(shape)
    if outlier:
        first = tuple(slice(None) if a in kept else 0 for a in range(len(shape)))
        x[first] += 1000 * std
    x = x.astype(npd)
    var, mu = _var_mean_fd(len(shape), dims, 1, False, dtype).execute([x])
    x64 = x.astype(np.float64)
    ax = tuple(dims)
    np.testing.assert_allclose(var, x64.var(axis=ax, ddof=1), rtol=1e-9 if dtype == DataType.Double else 1e-6)
    np.testing.assert_allclose(mu, x64.mean(axis=ax), rtol=1e-12 if dtype == DataType.Double else 1e-7)


@pytest.mark.parametrize(("shape", "dims"), [((6, 5, 4), [0, 2]), ((2, 40000), [1])])
def test_a_double_variance_written_out_stays_accurate(shape: Any, dims: List[int]) -> None:
    # sum((x - mean)^2) in double over streamed rows: no wider type for one-pass sums, so
    # they are shifted by each row's first element.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), DataType.Double)
        n = float(np.prod([shape[d] for d in dims]))
        m = fd.ops.mul(fd.ops.sum(x, dims=dims, keepdim=True), 1.0 / n)
        xc = fd.ops.sub(x, m)
        fd.add_output(fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=dims), 1.0 / n))
    a = 1e7 + 1e-2 * np.random.default_rng(5).standard_normal(shape)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a.var(axis=tuple(dims)), rtol=1e-8)


@pytest.mark.parametrize(("shape", "dims", "correction", "keepdim"), [
    ((6, 33), [1], 1, False), ((6, 33), [0], 0, True), ((4, 5, 7), [0, 2], 1, False),
    ((4, 5, 7), [-1], 2, True), ((3, 8), [0, 1], 0, False), ((2, 3, 4, 5), [0, 2, 3], 1, False),
])
def test_var_mean_matches_numpy(shape: Any, dims: List[int], correction: int, keepdim: bool) -> None:
    x = np.random.default_rng(len(shape)).normal(2.0, 3.0, size=shape).astype(np.float32)
    var, mean = _var_mean_fd(len(shape), dims, correction, keepdim).execute([x])
    ax = tuple(d % len(shape) for d in dims)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(var, x64.var(axis=ax, ddof=correction, keepdims=keepdim), rtol=1e-5)
    np.testing.assert_allclose(mean, x64.mean(axis=ax, keepdims=keepdim), rtol=1e-5, atol=1e-6)


def test_var_of_half_rounds_once() -> None:
    x = np.random.default_rng(5).normal(size=(8, 300)).astype(np.float16)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1], DataType.Half)
        fd.add_output(fd.ops.var(t, [1]))
    (got,) = fd.execute([x])
    assert got.dtype == np.float16
    want = x.astype(np.float64).var(axis=1, ddof=1).astype(np.float16)
    np.testing.assert_array_equal(got, want)


def test_welford_gives_mean_var_sum_and_count() -> None:
    x = np.random.default_rng(6).normal(size=(5, 40)).astype(np.float32)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        for out in fd.ops.welford(t, [1]):
            fd.add_output(out)
    avg, var_sum, n = fd.execute([x])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(avg, x64.mean(1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(var_sum, ((x64 - x64.mean(1, keepdims=True)) ** 2).sum(1), rtol=1e-5)
    np.testing.assert_array_equal(n, np.full(5, 40))
    assert n.dtype == np.int64


def test_var_mean_refuses_integers() -> None:
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], DataType.Int)
        with pytest.raises(KilnError, match="var_mean: T0 has dtype Int; expected a floating type"):
            fd.ops.var_mean(t, [0])
        fd.add_output(t)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32], ids=str)
def test_prod_matches_numpy(dtype: Any) -> None:
    rng = np.random.default_rng(7)
    x = (rng.uniform(0.5, 1.5, size=(9, 13)) if np.dtype(dtype).kind == "f"
         else rng.integers(-3, 4, size=(9, 13))).astype(dtype)
    dt = {np.dtype(np.float32): DataType.Float, np.dtype(np.float64): DataType.Double,
          np.dtype(np.int64): DataType.Int, np.dtype(np.int32): DataType.Int32}[np.dtype(dtype)]
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1], dt)
        fd.add_output(fd.ops.prod(t, [1]))
        fd.add_output(fd.ops.prod(t, [0, 1]))
    rows, total = fd.execute([x])
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(rows, x.astype(np.float64).prod(1), rtol=1e-5)
        np.testing.assert_allclose(total, x.astype(np.float64).prod(), rtol=1e-4)
    else:
        assert rows.dtype == np.int64  # integer products widen to Int, as torch.prod
        np.testing.assert_array_equal(rows, x.astype(np.int64).prod(1))
        np.testing.assert_array_equal(total, x.astype(np.int64).prod())


@pytest.mark.gpu
def test_statistics_on_gpu() -> None:
    cp = cupy_or_skip()
    rng = np.random.default_rng(8)
    x = (1e4 + 1e-2 * rng.normal(size=(1024, 2048))).astype(np.float32)
    fd = _var_mean_fd(2, [1], 1, False)
    var, mean = (cp.asnumpy(o) for o in fd.execute([cp.asarray(x)]))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(var, x64.var(axis=1, ddof=1), rtol=1e-5)
    np.testing.assert_allclose(mean, x64.mean(axis=1), rtol=1e-7)
    y = rng.uniform(0.9, 1.1, size=(256, 300)).astype(np.float32)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.prod(t, [1]))
    (rows,) = fd.execute([cp.asarray(y)])
    np.testing.assert_allclose(cp.asnumpy(rows), y.astype(np.float64).prod(1), rtol=1e-4)


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([DataType.Float, DataType.Double]), st.booleans())
def test_random_statistics_over_streamed_rows_match_numpy(seed: int, dtype: DataType,
                                                          transposed: bool) -> None:
    # Rows long enough to be streamed (the one-pass rewrites apply), over random axes of a
    # random rank, with per-position means far from zero and a non-row-major layout at times.
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(2, 5))
    dims = sorted(rng.choice(rank, size=int(rng.integers(1, rank)), replace=False).tolist())
    # Few rows (the interpreter runs every element): at most three positions kept.
    shape = [1] * rank
    kept = [a for a in range(rank) if a not in dims]
    if kept:
        shape[int(rng.choice(kept))] = int(rng.integers(1, 4))
    want_row = 33000
    per = max(1, int(round(want_row ** (1 / len(dims)))))
    for d in dims:
        shape[d] = per
    mean, std = float(10.0 ** rng.integers(0, 6)), float(10.0 ** -rng.integers(0, 3))
    npd = np.float32 if dtype == DataType.Float else np.float64
    x = (mean + std * rng.standard_normal(shape[::-1] if transposed else shape)).astype(npd)
    if transposed:
        x = x.transpose(*range(rank - 1, -1, -1))
    correction = int(rng.integers(0, 2))
    var, mu = _var_mean_fd(rank, dims, correction, False, dtype).execute([x])
    x64 = x.astype(np.float64)
    n = int(np.prod([shape[d] for d in dims]))
    want_var = x64.var(axis=tuple(dims), ddof=correction) if n > correction else None
    if want_var is not None:
        np.testing.assert_allclose(var, want_var, rtol=1e-8 if dtype == DataType.Double else 2e-6,
                                   atol=1e-12 * mean * mean)
    np.testing.assert_allclose(mu, x64.mean(axis=tuple(dims)),
                               rtol=1e-12 if dtype == DataType.Double else 1e-7)
