"""The CPU interpreter of kernel IR: the allocation scenarios run against float64 NumPy
references, and planted bugs that each memory checker must catch."""

from __future__ import annotations

import numpy as np
import pytest
import scenarios
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType
from kiln import _core as core

F32 = np.float32
RNG = np.random.default_rng(0)


def rand(*shape: int, dtype=F32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def run(fd: FusionDefinition, inputs: list) -> list:
    return core.execute_cpu(fd._core.lower(), inputs)


def check(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)


# a) pointwise 2D, merge+split, BIDx/TIDx, inlined ----------------------------------------
@pytest.mark.parametrize("shape", [(5, 7), (1, 1), (13, 131), (128, 4)])
def test_a_pointwise(shape):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        b = fd.ops.mul(a, 2.0)
        c = fd.ops.relu(b)
        fd.add_output(c)
    for t in (a, b, c):
        t.merge(0)
        t.split(0, 128)
        t.split(1, 4)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(2)
    b.inline_at(-1)
    x_ = rand(*shape)
    (out,) = run(fd, [x_])
    assert out.dtype == F32
    check(out, np.maximum(np.exp(x_.astype(np.float64)) * 2.0, 0.0))


# b) Shared / Local caches ------------------------------------------------------------------
@pytest.mark.parametrize("mem", [MemoryType.Shared, MemoryType.Local])
def test_b_caches(mem):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(mem)
    for t in (c, y):
        t.split(1, 128)
        t.reorder({2: 1})
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    x_ = rand(3, 300)
    (out,) = run(fd, [x_])
    check(out, np.exp(x_.astype(np.float64)))


# c) broadcast + inline + Unroll ------------------------------------------------------------
def test_c_inlined_unroll_with_broadcast():
    fd = scenarios.c_inlined_unroll(symbolic=True).fd
    a, b = rand(6), rand(6, 5)
    (out,) = run(fd, [a, b])
    check(out, np.exp(a.astype(np.float64))[:, None] + b)


# d) non-contiguous Global input ------------------------------------------------------------
def test_d_non_contiguous_input_view():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, False])
        y = fd.ops.neg(x)
        fd.add_output(y)
    base = rand(4, 12)
    view = base[:, ::2]  # strides (12, 2) elements
    assert not view.flags.c_contiguous
    (out,) = run(fd, [view])
    check(out, -view.astype(np.float64))


# e) NHWC output + vectorized cache_before ------------------------------------------------
def test_e_nhwc_output():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1])
        y = fd.ops.relu(x)
        fd.add_output(y)
    y.set_allocation_domain([0, 2, 3, 1], [True, True, True, True])
    c = y.cache_before()
    y.reorder({1: 3})
    y.split(3, 4)
    y.axis(4).parallelize(ParallelType.Vectorize)
    c.split(1, 4)
    c.reorder({2: 4})
    c.axis(4).parallelize(ParallelType.Vectorize)
    x_ = rand(2, 8, 3, 5)
    (out,) = run(fd, [x_])
    check(out, np.maximum(x_.astype(np.float64), 0))
    # Returned in logical (NCHW) order, laid out NHWC in memory.
    assert out.shape == (2, 8, 3, 5)
    assert np.transpose(out, (0, 2, 3, 1)).flags.c_contiguous


# f) transpose through Shared -------------------------------------------------------------
def test_f_transpose_through_shared():
    # The sync pass puts one __syncthreads() between the tile's writes and its transposed
    # reads; with it the interpreter sees no race and the result is the transpose.
    fd = scenarios.f_transpose().fd  # the schedule the GPU tests run
    assert fd._core.lower().kernel_ir().count("__syncthreads()") == 1
    for shape in [(64, 96), (50, 70)]:
        x_ = rand(*shape)
        (out,) = run(fd, [x_])
        np.testing.assert_array_equal(out, x_.T)


# g) index_select ---------------------------------------------------------------------------
def test_g_index_select():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        t1 = fd.ops.exp(x)
        t2 = fd.ops.index_select(t1, idx, 0)
        fd.add_output(t2)
    t1.reorder({0: 1})
    t1.split(1, 4)
    t2.reorder({0: 1})
    t2.axis(0).parallelize(ParallelType.BIDx)
    t1.inline_at(1)
    x_ = rand(10, 3)
    i_ = np.array([3, 0, 9, 3], np.int64)
    (out,) = run(fd, [x_, i_])
    check(out, np.exp(x_.astype(np.float64))[i_])
    # A bad index is reported against the index tensor, before any read of the table.
    want = rf"index tensor {idx.name} holds 10 at element 0; {t1.name} has 10 entries"
    with pytest.raises(KilnError, match=want):
        run(fd, [x_, np.array([10], np.int64)])


# h) reductions -----------------------------------------------------------------------------
def test_h_block_row_reduction():
    fd = scenarios.h_block_row_sum().fd
    x_ = rand(4, 1000)
    (out,) = run(fd, [x_])
    check(out, x_.astype(np.float64).sum(1), rtol=1e-4, atol=1e-4)


def _column_sum(serial: bool):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(s)
    s.split(0, 4)
    s.split(2, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.BIDy)
    s.axis(3).parallelize(ParallelType.TIDx)
    if serial:
        s.set_serial_grid_reduction()
    return fd, s


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("shape", [(64, 300), (7, 5), (1, 129)])
def test_h_grid_column_reduction(serial, shape):
    fd, _ = _column_sum(serial)
    x_ = rand(*shape)
    (out,) = run(fd, [x_])
    check(out, x_.astype(np.float64).sum(0), rtol=1e-4, atol=1e-4)


# dtypes, scalars, reductions of every kind -----------------------------------------------
def test_dtypes_and_scalar_inputs():
    with FusionDefinition() as fd:
        h = fd.define_tensor([-1], dtype=DataType.Half)
        i = fd.define_tensor([-1], dtype=DataType.Int32)
        s = fd.define_scalar(dtype=DataType.Double)
        a = fd.ops.mul(h, s)  # Half
        b = fd.ops.truediv(i, 2)  # Int32 / int -> Float (div would truncate)
        c = fd.ops.gt(fd.ops.cast(a, DataType.Float), b)
        d = fd.ops.where(c, i, fd.ops.neg(i))
        e = fd.ops.max(fd.ops.cast(h, DataType.Double), dims=[0])
        fd.add_output(a)
        fd.add_output(b)
        fd.add_output(c)
        fd.add_output(d)
        fd.add_output(e)
    h_ = rand(17).astype(np.float16)
    i_ = np.arange(-8, 9, dtype=np.int32)
    a, b, c, d, e = run(fd, [h_, i_, 1.5])
    assert (a.dtype, b.dtype, c.dtype, d.dtype, e.dtype) == (np.float16, F32, np.bool_, np.int32, np.float64)
    want_a = (h_.astype(np.float32) * np.float16(1.5).astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(a, want_a)
    check(b, i_ / 2)
    np.testing.assert_array_equal(c, a.astype(F32) > b)
    np.testing.assert_array_equal(d, np.where(c, i_, -i_))
    assert e.shape == () and e == h_.astype(np.float64).max()


def test_full_and_min_reduction():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        f = fd.ops.full([3, 4], 2.5, DataType.Float)
        y = fd.ops.add(x, f)
        m = fd.ops.min(y, dims=[0, 1])
        fd.add_output(m)
    x_ = rand(3, 4)
    (out,) = run(fd, [x_])
    check(out, (x_.astype(np.float64) + 2.5).min())


# planted bugs --------------------------------------------------------------------------------
def test_wrong_input_dtype_and_count():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.exp(x))
    k = fd._core.lower()
    with pytest.raises(KilnError, match="takes 1 inputs"):
        core.execute_cpu(k, [])
    with pytest.raises(KilnError, match="dtype Double does not match"):
        core.execute_cpu(k, [np.zeros(3)])


# lowering bugs the interpreter found (reproducers; see the interp branch report) ------------
def test_nested_non_divisible_split_is_predicated():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.ops.abs(x)
        b = fd.ops.neg(a)
        fd.add_output(b)
    for t in (a, b):
        t.split(0, 2, inner_split=False)  # [2 (BIDx), ceilDiv(i0, 2)]
        t.split(1, 2, inner_split=False)  # [2, 2, ceilDiv(i0, 4)]: covers 2 * ceilDiv(i0, 2) >= i0
        t.axis(0).parallelize(ParallelType.BIDx)
    a.inline_at(-1)
    x_ = np.array([1.0, 2.0], F32)
    (out,) = run(fd, [x_])
    np.testing.assert_array_equal(out, -np.abs(x_))


def test_local_producer_read_by_other_blocks_is_rejected():
    # A Local producer partitioned by BIDx outside its inline position, read by a consumer
    # from a serial loop: lowering rejects the schedule before anything runs.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.abs(x)
        b = fd.ops.tanh(a)
        c = fd.ops.exp(b)
        fd.add_output(c)
    for t in (a, b, c):
        t.split(1, 2, inner_split=False)
    # b is scheduled (serial), so it does not take c's BIDx
    for t in (a, c):
        t.axis(1).parallelize(ParallelType.BIDx)
    a.inline_at(1)
    msg = rf"{a.name} is in Local memory but its axis 1 .* is parallelized on BIDx outside"
    with pytest.raises(KilnError, match=msg):
        run(fd, [np.ones((1, 1), F32)])


def test_producer_inlined_into_two_separate_consumers():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.neg(x)
        b = fd.ops.mul(a, 0.5)
        c = fd.ops.le(a, x)
        d = fd.ops.where(c, b, x)
        fd.add_output(d)
    a.inline_at(1)
    x_ = rand(3, 4)
    (out,) = run(fd, [x_])
    np.testing.assert_allclose(out, np.where(-x_ <= x_, -x_ * 0.5, x_))


def test_double_to_half_rounds_once_as_numpy_does():
    """A Double cast to Half rounds straight from the double (the GPU's ``__double2half``,
    NumPy's ``astype(float16)``); rounding through float first is one unit off here."""
    x = np.array([-9.127807567677662e-2, 5.449295232317457e-3, -12.964843363322565, 65519.99, 1e-9],
                 dtype=np.float64)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], dtype=DataType.Double)
        fd.add_output(fd.ops.cast(t, DataType.Half))
    (out,) = fd.execute([x])
    np.testing.assert_array_equal(out.view(np.uint16), x.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("n", [100_000, 1_000_000])
def test_block_and_grid_reductions_combine_threads_pairwise(n: int) -> None:
    # 53,760 threads' partial sums of 0.3: a chain in float drifts by 1e-4 relative, the
    # GPU's trees (and the interpreter's, which mirrors them) stay within a few ulps.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.sum(x, dims=[0]))
    a = np.full((n,), 0.3, np.float32)
    np.testing.assert_allclose(float(fd.execute([a])[0]), a.astype(np.float64).sum(), rtol=2e-6)
