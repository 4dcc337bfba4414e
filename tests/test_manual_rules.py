"""Rules that manual schedules are validated by (nvFuser's), each with the schedule that used
to run wrongly, fault, fail internally or be refused without reason. Every accepted schedule
runs in the CPU interpreter (which checks bounds, uninitialized reads and races) against NumPy;
every refused one raises ``KilnError`` from ``fd.lower`` naming the tensor, the axis and what is
expected."""

from __future__ import annotations

import time
from typing import List

import numpy as np
import pytest
import scenarios
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType

F32 = np.float32
X5 = np.array([0.5, -0.9, 1.8, -1.9, 1.2], F32)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(F32)


def chain():
    """T0 (input) -> T1 = abs(T0) -> T2 = neg(T1) (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.ops.abs(x)
        o = fd.ops.neg(a)
        fd.add_output(o)
    return fd, a, o


# -- parallel types of shared loops -------------------------------------------------------
def test_parallel_producer_inlined_into_a_serial_consumer_loop_parallelizes_the_loop():
    # The loop a producer shares with its consumer is one loop: it takes the producer's
    # TIDx (nvFuser propagates the parallel type over the loop group), so each thread
    # computes and stores its own element.
    fd, a, o = chain()
    a.axis(0).parallelize(ParallelType.TIDx)
    a.inline_at(-1)
    k = fd.lower([X5]).kernels[0]
    assert k.kernel_ir.startswith("FOR threadIdx.x")
    # (At least one thread: a runtime size may be 0, and the loop guards it.)
    assert k.launch["block"][0] == "max(i0, 1)"
    np.testing.assert_array_equal(fd.execute([X5])[0], -np.abs(X5))


def test_a_tensor_uses_each_thread_dimension_once():
    # T1's axis 0 shares T2's TIDx loop and its axis 1 is TIDx itself: two loops on one
    # threadIdx.x (this wrote only the diagonal).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.mul(x, 2.0)
        o = fd.ops.tanh(a)
        fd.add_output(o)
    a.axis(1).parallelize(ParallelType.TIDx)
    o.axis(0).parallelize(ParallelType.TIDx)
    a.inline_at(1)
    with pytest.raises(KilnError, match=rf"{a.name}: axes 0 .* and 1 .* both run on TIDx"):
        fd.lower([rand(3, 4)])


# -- reads across threads and blocks --------------------------------------------------------
def test_shared_producer_read_by_other_threads_gets_a_block_sync():
    fd, a, o = chain()
    a.set_memory_type(MemoryType.Shared)
    o.axis(0).parallelize(ParallelType.TIDx)  # a is written by thread 0, read by every thread
    k = fd.lower([X5]).kernels[0]
    assert k.kernel_ir.count("__syncthreads()  // RAW") == 1
    np.testing.assert_array_equal(fd.execute([X5])[0], -np.abs(X5))


def test_shared_producer_without_a_block_axis_is_computed_by_every_block():
    # Shared memory is the block's own: a Shared tensor that does not use BIDx is written by
    # every block into its copy (nvFuser: an unused block dimension is not redundant for
    # Shared memory), so a consumer on BIDx reads its own block's copy.
    fd, a, o = chain()
    a.set_memory_type(MemoryType.Shared)
    o.axis(0).parallelize(ParallelType.BIDx)
    (got,) = fd.execute([X5])
    np.testing.assert_array_equal(got, -np.abs(X5))


def test_shared_producer_on_another_block_split_is_refused():
    fd, a, o = chain()
    a.set_memory_type(MemoryType.Shared)
    for t in (a, o):
        t.split(0, 2)
    a.axis(0).parallelize(ParallelType.BIDx)
    o.axis(1).parallelize(ParallelType.BIDx)
    msg = rf"{a.name} is in Shared memory but its axis 0 .* parallelized on BIDx"
    with pytest.raises(KilnError, match=msg):
        fd.lower([X5])


def test_local_producer_read_by_another_thread_is_refused():
    fd, a, o = chain()
    for t in (a, o):
        t.split(0, 2)
    a.axis(0).parallelize(ParallelType.TIDx)
    o.axis(1).parallelize(ParallelType.TIDx)
    msg = rf"{a.name} is in Local memory but its axis 0 .* parallelized on TIDx .*{o.name} would read it from"
    with pytest.raises(KilnError, match=msg):
        fd.lower([X5])


def test_local_producer_on_an_exactly_mapped_thread_axis_needs_no_inlining():
    # Each thread reads the element it wrote (nvFuser accepts this; kiln used to refuse it).
    # Inlined at 1: the shared serial loop is outside, the TIDx axis right of the inline
    # position, so the Local allocation is one element per thread (a constant size).
    fd, a, o = chain()
    for t in (a, o):
        t.split(0, 2)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(1)
    k = fd.lower([X5]).kernels[0]
    assert "__syncthreads" not in k.kernel_ir
    np.testing.assert_array_equal(fd.execute([X5])[0], -np.abs(X5))


def test_shared_producer_on_an_exactly_mapped_thread_axis_needs_no_sync():
    fd, a, o = chain()
    a.set_memory_type(MemoryType.Shared)
    for t in (a, o):
        t.axis(0).parallelize(ParallelType.TIDx)
    k = fd.lower([X5]).kernels[0]
    assert "__syncthreads" not in k.kernel_ir
    np.testing.assert_array_equal(fd.execute([X5])[0], -np.abs(X5))


def test_global_output_read_back_by_other_threads_gets_a_block_sync():
    with FusionDefinition() as fd:
        s = fd.define_tensor([])
        x = fd.define_tensor([-1])
        b = fd.ops.broadcast_in_dim(s, shape=[-1], broadcast_dims=[])
        y = fd.ops.add(b, x)
        fd.add_output(y)
        fd.add_output(b)
    y.axis(0).parallelize(ParallelType.TIDx)  # b (Global, one element) is read by every thread
    s_, x_ = np.array(0.25, F32), rand(7)
    k = fd.lower([s_, x_]).kernels[0]
    assert "__syncthreads()  // RAW" in k.kernel_ir
    got_y, got_b = fd.execute([s_, x_])
    np.testing.assert_allclose(got_y, x_ + 0.25)
    np.testing.assert_allclose(got_b, [0.25])


def test_global_output_read_back_by_other_blocks_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.ops.abs(x)
        b = fd.ops.neg(a)
        fd.add_output(a)
        fd.add_output(b)
    a.axis(0).parallelize(ParallelType.BIDx)  # b, serial, reads every block's element
    with pytest.raises(KilnError, match=rf"{a.name} is in Global memory but its axis 0 .* BIDx"):
        fd.lower([X5])


def test_shared_sync_inside_a_partial_thread_loop_is_refused():
    # a and o share a TIDy loop of 3 while another TIDy loop runs 4: a barrier inside the
    # first would be reached by 3 of 4 rows of threads.
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 5])
        w = fd.define_tensor([4])
        a = fd.ops.abs(x)
        o = fd.ops.neg(a)
        v = fd.ops.neg(w)
        fd.add_output(o)
        fd.add_output(v)
    a.set_memory_type(MemoryType.Shared)
    for t in (a, o):
        t.axis(0).parallelize(ParallelType.TIDy)
    o.axis(1).parallelize(ParallelType.TIDx)
    v.axis(0).parallelize(ParallelType.TIDy)
    a.inline_at(1)
    with pytest.raises(KilnError, match=rf"{a.name} .* needs a block sync inside the TIDy loop of axis 0"):
        fd.lower([rand(3, 5), rand(4)])


def test_shared_axis_merged_with_a_broadcast_is_read_across_threads():
    # The Shared tile stores the split broadcast's two copies at their own offsets; sin(T)
    # reads the copy its logical index names, which another thread stored: a block sync.
    with FusionDefinition() as fd:
        v = fd.define_tensor([-1])
        b = fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[1])
        s = fd.ops.sin(b)
        fd.add_output(s)
    b.set_memory_type(MemoryType.Shared)
    for t in (b, s):
        t.split(0, 2)  # [1, 2 (broadcast copies), i1]
        t.merge(1)
        t.axis(1).parallelize(ParallelType.TIDx)
    v_ = rand(10)
    k = fd.lower([v_]).kernels[0]
    assert "__syncthreads()  // RAW" in k.kernel_ir
    np.testing.assert_allclose(fd.execute([v_])[0], np.sin(v_)[None], rtol=1e-6)


def test_shared_broadcast_on_a_thread_loop_is_written_once():
    # The broadcast axis partitions nothing: every thread would store the same element.
    with FusionDefinition() as fd:
        s = fd.define_tensor([])
        x = fd.define_tensor([-1, -1])
        b = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[])
        y = fd.ops.mul(b, x)
        fd.add_output(y)
    b.set_memory_type(MemoryType.Shared)
    for t in (b, y):
        t.merge(0)
        t.axis(0).parallelize(ParallelType.TIDx)
    b.inline_at(-1)
    s_, x_ = np.array(-1.5, F32), rand(4, 3)
    np.testing.assert_allclose(fd.execute([s_, x_])[0], -1.5 * x_)


# -- inlining and broadcasts -----------------------------------------------------------------
@pytest.mark.parametrize("dims,shape", [([0], (5, 1)), ([1], (1, 5))])
def test_inline_into_broadcast_in_dim(dims, shape):
    # (static sizes: what stays allocated in Local memory has a constant size, as CUDA needs)
    with FusionDefinition() as fd:
        x = fd.define_tensor([5])
        a = fd.ops.abs(x)
        b = fd.ops.broadcast_in_dim(a, shape=[-1, -1], broadcast_dims=dims)
        fd.add_output(b)
    a.inline_at(-1)
    np.testing.assert_array_equal(fd.execute([X5])[0], np.abs(X5).reshape(shape))


def test_inline_through_broadcast_in_dim_into_a_concretizing_consumer():
    with FusionDefinition() as fd:
        x = fd.define_tensor([5])
        u = fd.define_tensor([-1, -1])
        a = fd.ops.abs(x)
        b = fd.ops.broadcast_in_dim(a, shape=[-1, -1], broadcast_dims=[0])
        c = fd.ops.add(b, u)
        fd.add_output(c)
    a.inline_at(-1)
    u_ = rand(5, 3)
    np.testing.assert_allclose(fd.execute([X5, u_])[0], np.abs(X5)[:, None] + u_)


def build_sibling_broadcast():
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 1])
        y = fd.define_tensor([-1, -1])
        a = fd.ops.neg(x)
        c1 = fd.ops.add(a, y)  # concretizes a's broadcast axis with y's
        c2 = fd.ops.mul(a, 2.0)  # keeps it
        fd.add_output(c1)
        fd.add_output(c2)
    for t in (a, c1, c2):
        t.merge(0)
    return fd, a, c1, c2


def test_merged_broadcast_concretized_by_one_of_two_consumers_is_not_inlined():
    # One loop over a's merged axis cannot run both c1's 5*3 and c2's 5*1 elements (c2 was
    # written past its end).
    fd, a, c1, c2 = build_sibling_broadcast()
    with pytest.raises(KilnError, match=rf"inline_at {a.name}: axis 0 .* comes from a broadcast that its "
                                        rf"consumers {c1.name} and {c2.name} iterate with different extents"):
        a.inline_at(1)
    a.inline_at(-1)
    assert a.inline_position == 0
    x_, y_ = rand(5, 1), rand(5, 3, seed=1)
    got1, got2 = fd.execute([x_, y_])
    np.testing.assert_allclose(got1, y_ - x_)
    np.testing.assert_allclose(got2, -2 * x_)


def test_reduction_consumer_inside_the_reduction_loop_is_refused():
    # a is inlined into the sum over axis 0 and into o, which makes r's reduction loop and o's
    # loop over axis 0 one loop; b, inlined into o, would read partial sums there.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.abs(x)
        r = fd.ops.sum(a, dims=[0])
        b = fd.ops.broadcast_in_dim(r, shape=[-1, -1], broadcast_dims=[1])
        o = fd.ops.add(b, a)
        fd.add_output(o)
    a.inline_at(2)
    b.inline_at(2)
    msg = rf"{b.name} reads the reduction {r.name} inside the loop of its reduced axis 0"
    with pytest.raises(KilnError, match=msg):
        fd.lower([rand(2, 3)])
    # inline_at(-1) stops a before the sum's serial loop, which o would otherwise share (a
    # then needs a buffer of the whole runtime-size input, refused by name).
    a.inline_at(-1)
    assert a.inline_position == 0
    with pytest.raises(KilnError, match=rf"{a.name} is in Local memory but its allocation \[i0, i1\]"):
        fd.execute([rand(2, 3)])


def test_inlined_tensors_no_output_needs_are_left_out():
    # (validation used to look them up in the kernel's loop graph and panic)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        dead = fd.ops.neg(x)
        dead2 = fd.ops.abs(dead)
        o = fd.ops.exp(x)
        fd.add_output(o)
    dead.inline_at(1)
    assert dead2.inline_position == 0
    x_ = rand(2, 3)
    np.testing.assert_allclose(fd.execute([x_])[0], np.exp(x_), rtol=1e-6)


# -- launch limits -------------------------------------------------------------------------------
def test_blocks_past_1024_threads_are_refused_in_the_interpreter_too():
    fd, a, o = chain()
    o.axis(0).parallelize(ParallelType.TIDx)
    with pytest.raises(KilnError, match="launches 2048 threads per block"):
        fd.execute([rand(2048)])


# -- the README hand schedule: untouched producers follow their consumer ---------------------------
def readme_fusion():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        y = fd.ops.add(x, fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1]))
        s = fd.ops.sum(fd.ops.relu(y), dims=[1])
        fd.add_output(s)
    return fd, y, s


def test_readme_hand_schedule_propagates_to_untouched_producers():
    fd, y, s = readme_fusion()
    s.split(1, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(-1).parallelize(ParallelType.TIDx)
    xs = [rand(256, 256), np.ones(256, F32)]
    k = fd.lower(xs).kernels[0]
    _ = k.cuda_source  # codegen accepts it: every Local intermediate is one register
    local = [a for a in k.allocations if a.memory_type == MemoryType.Local]
    assert local and all(a.extents == () for a in local), local
    t0 = time.time()
    (out,) = fd.execute(xs)
    assert time.time() - t0 < 20
    np.testing.assert_allclose(out, np.maximum(xs[0] + xs[1][None], 0).sum(1), rtol=1e-5)
    assert y.inline_position == 0  # the user's fusion is unchanged; lowering propagates on a copy


def test_propagation_leaves_a_tensor_alone_when_it_cannot_follow():
    # a has a second consumer scheduled otherwise: it cannot be inlined into both, so it is
    # left untouched (computed by every thread) rather than read from other threads.
    with FusionDefinition() as fd:
        x = fd.define_tensor([6])
        a = fd.ops.abs(x)
        o1 = fd.ops.neg(a)
        o2 = fd.ops.exp(a)
        fd.add_output(o1)
        fd.add_output(o2)
    o1.axis(0).parallelize(ParallelType.TIDx)
    o2.split(0, 2)
    x_ = rand(6)
    got1, got2 = fd.execute([x_])
    np.testing.assert_allclose(got1, -np.abs(x_))
    np.testing.assert_allclose(got2, np.exp(np.abs(x_)), rtol=1e-6)


@pytest.mark.parametrize("threads", [False, True])
def test_an_untouched_tensor_read_by_a_reduction_and_after_it_stops_before_the_serial_reduced_loop(
        threads: bool) -> None:
    # exp(x) read by its row sum and by the difference after it, only the output scheduled
    # (one row per block): inlined past the sum's serial loop, that loop would also be the
    # difference's, which would read the sum before it completes. exp(x) is placed before it
    # (computed once per row); with the row on TIDx the sum is a block reduction and exp(x)
    # is inlined fully.
    x_ = rand(3, 8, seed=4)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        e = fd.ops.exp(x)
        s = fd.ops.sum(e, dims=[1])
        y = fd.ops.sub(e, fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0]))
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.BIDx)
    if threads:
        y.axis(1).parallelize(ParallelType.TIDx)
        s.axis(0).parallelize(ParallelType.BIDx)
        s.axis(1).parallelize(ParallelType.TIDx)
    e0 = np.exp(x_.astype(np.float64))
    (got,) = fd.execute([x_])
    np.testing.assert_allclose(got, e0 - e0.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert e.inline_position == 0  # (lowering propagates on a copy)


def test_inline_most_waits_for_an_untouched_consumers_schedule() -> None:
    # bb's consumer (the add) is untouched when inline_at(-1) is asked: it takes the output's
    # schedule when the fusion is lowered, and the deepest position is found against that
    # schedule then (it resolved to 0 at the call, which lowering refused).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        y = fd.ops.sigmoid(fd.ops.add(x, bb))
        fd.add_output(y)
    for t in (bb, y):
        t.merge(0)
        t.split(0, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    bb.inline_at(-1)
    x_, b_ = rand(37, 129, seed=1), rand(129, seed=2)
    (got,) = fd.execute([x_, b_])
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-(x_.astype(np.float64) + b_))), rtol=1e-6)
    bb.inline_at(0)  # an explicit position replaces the deferred one
    with pytest.raises(KilnError, match=bb.name):
        fd.lower([x_, b_])


@pytest.mark.parametrize("shape", [(3, 8), (5, 37), (1, 1), (2, 0)])
def test_var_mean_with_only_its_outputs_on_blocks_recomputes_the_row_per_reader(shape) -> None:
    # var_mean's double cast of x is read by the mean's sum and by the deviations after it:
    # stopped before the sum's serial loop it would be a Local buffer of the whole symbolic
    # row, which no register array holds (and which the user cannot reach to schedule). Each
    # reader computes its own copy instead.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        v, m = fd.ops.var_mean(x, dims=[1])
        fd.add_output(v)
        fd.add_output(m)
    for t in (v, m):
        t.axis(0).parallelize(ParallelType.BIDx)
    x_ = rand(*shape, seed=3) + 3
    gv, gm = fd.execute([x_])
    xd = x_.astype(np.float64)
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(gm, xd.mean(1), rtol=1e-6)
        np.testing.assert_allclose(gv, xd.var(1, ddof=1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cols", [128, 200])
def test_var_mean_over_a_constant_row_recomputes_it_rather_than_holding_it(cols: int) -> None:
    # With the row's size a constant, the double cast of x fits a Local array, but one of
    # 128 doubles per thread is 256 registers (NVRTC spilled). Each reader computes its own
    # copy, as with a runtime size; the conftest compiles the kernel and fails on spills.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, cols])
        v, m = fd.ops.var_mean(x, dims=[1])
        fd.add_output(v)
        fd.add_output(m)
    for t in (v, m):
        t.split(0, 2)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDy)
    x_ = rand(5, cols, seed=4) + 3
    ir = fd.lower([x_]).kernels[0].kernel_ir
    assert f"double [{cols}]" not in ir
    gv, gm = fd.execute([x_])
    xd = x_.astype(np.float64)
    np.testing.assert_allclose(gm, xd.mean(1), rtol=1e-6)
    np.testing.assert_allclose(gv, xd.var(1, ddof=1), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_layernorm_with_its_statistics_scheduled_and_the_deviation_untouched(rows: int) -> None:
    # xm = x - mean is read by the variance's sum and by the output: it stops before the
    # variance's serial loop, a register array of the row's 4 steps whose TIDx axis every
    # reader runs on TIDx too (each thread reads what it wrote), so it follows the schedule
    # instead of being left for every thread to compute whole.
    n = 512
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, n])
        s = fd.ops.sum(x, dims=[1])
        mean = fd.ops.mul(s, 1.0 / n)
        xm = fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, shape=[-1, -1], broadcast_dims=[0]))
        v = fd.ops.sum(fd.ops.mul(xm, xm), dims=[1])
        rs = fd.ops.rsqrt(fd.ops.add(fd.ops.mul(v, 1.0 / n), 1e-5))
        y = fd.ops.mul(xm, fd.ops.broadcast_in_dim(rs, shape=[-1, -1], broadcast_dims=[0]))
        fd.add_output(y)
    xc = x.cache_after()
    xc.set_memory_type(MemoryType.Shared)
    for t in (xc, s, v, y):
        t.split(1, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    for t in (xc, s, v):
        t.inline_at(1)
    x_ = rand(rows, n, seed=5)
    (got,) = fd.execute([x_])
    xd = x_.astype(np.float64)
    d = xd - xd.mean(1, keepdims=True)
    np.testing.assert_allclose(got, d / np.sqrt((d * d).mean(1, keepdims=True) + 1e-5), rtol=1e-5, atol=1e-5)


def test_a_per_row_value_between_a_cluster_reduction_and_its_readers_stays_in_the_cluster_loops() -> None:
    # rsqrt(sum) sits between a reduction across the cluster's blocks and the output, which
    # reads the cached row inlined into the same [BIDy, TIDx] loops as the sum: it is computed
    # inside them (by every block and thread of the cluster) instead of closing them.
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 1000])
        sq = fd.ops.mul(x, x)
        s = fd.ops.sum(sq, [1])
        rb = fd.ops.broadcast_in_dim(fd.ops.rsqrt(s), shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.mul(x, rb)
        fd.add_output(y)
    xc = x.cache_after()
    for t in (xc, sq, s, rb, y):
        t.split(1, 4, inner_split=False)
        t.split(2, 64, inner_split=False)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.BIDy)
        t.axis(2).parallelize(ParallelType.TIDx)
    fd.set_cluster(ParallelType.BIDy, 4)
    xc.inline_at(3)
    sq.inline_at(-1)
    s.inline_at(1)
    rb.inline_at(-1)
    x_ = rand(4, 1000, seed=6)
    (got,) = fd.execute([x_])
    xd = x_.astype(np.float64)
    np.testing.assert_allclose(got, xd / np.sqrt((xd * xd).sum(1, keepdims=True)), rtol=1e-5)


@pytest.mark.parametrize("keepdim", [True, False])
@pytest.mark.parametrize("factor", [64, 32, 128, 1, None])
def test_a_local_broadcast_on_the_consumers_thread_axis_is_each_threads_own(keepdim: bool, factor):
    # The keepdim row sum parallelized like the row it divides: its broadcast axis runs on
    # TIDx, a loop no bound guards, so every thread computes the one element in its
    # registers and reads its own (nvFuser's block broadcast), whatever the split (None:
    # not split, the size-one axis itself on TIDx).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1], keepdim=keepdim)
        if not keepdim:
            s = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.div(x, s)
        fd.add_output(y)
    xc = x.cache_after()
    xc.set_memory_type(MemoryType.Shared)
    for t, f in ((xc, 64), (s, factor), (y, 64)):
        t.axis(0).parallelize(ParallelType.BIDx)
        if f is None:
            t.axis(1).parallelize(ParallelType.TIDx)
            continue
        t.split(1, f)
        t.axis(2).parallelize(ParallelType.TIDx)
    xc.inline_at(1)
    s.inline_at(1)
    x_ = rand(5, 200, seed=7) + 2
    (got,) = fd.execute([x_])
    np.testing.assert_allclose(got, x_ / x_.astype(np.float64).sum(1, keepdims=True), rtol=1e-6)


def test_inline_most_stops_before_a_reduction_loop_its_other_readers_would_share() -> None:
    # exp(x) is read by its row sum and by the difference with that sum: inline_at(-1) stops
    # before the sum's serial loop (nvFuser's inline_most does the same), where the full
    # position would put the difference inside the loop that completes the sum.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8])
        e = fd.ops.exp(x)
        s = fd.ops.sum(e, dims=[1])
        b = fd.ops.broadcast(s, [False, True])
        y = fd.ops.sub(e, b)
        fd.add_output(y)
    for t in (s, b, y):
        t.axis(0).parallelize(ParallelType.BIDx)
    e.inline_at(-1)
    b.inline_at(-1)
    assert (e.inline_position, b.inline_position) == (1, 2)
    x_ = rand(3, 8, seed=8)
    (got,) = fd.execute([x_])
    ee = np.exp(x_.astype(np.float64))
    np.testing.assert_allclose(got, ee - ee.sum(1, keepdims=True), rtol=1e-6)


def test_two_reductions_of_one_tensor_share_its_loop_under_inline_most() -> None:
    # sum(x2) and sum(x2 * x2) with nothing reading their results inside the row: x2 is
    # inlined into the loop both reductions share.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 16])
        x2 = fd.ops.mul(x, 2.0)
        s1 = fd.ops.sum(x2, dims=[1])
        s2 = fd.ops.sum(fd.ops.mul(x2, x2), dims=[1])
        fd.add_output(s1)
        fd.add_output(s2)
    for t in (s1, s2):
        t.axis(0).parallelize(ParallelType.BIDx)
    x2.inline_at(-1)
    assert x2.inline_position == 2
    x_ = rand(5, 16, seed=9)
    g1, g2 = fd.execute([x_])
    xd = 2 * x_.astype(np.float64)
    np.testing.assert_allclose(g1, xd.sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g2, (xd * xd).sum(1), rtol=1e-5)


def doubled_through_a_shared_cache():
    """``y = 2 * x`` read through a Shared cache ``c``, both split ``[M, N/32, 32]``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 32)
    return fd, c, y


def test_inline_most_stops_before_a_loop_parallelized_two_ways() -> None:
    # The cache's axis 1 is TIDx, the consumer's is Unroll: one loop has one parallel type,
    # so inline_at(-1) stops at 1 (nvFuser's inline_most too).
    fd, c, y = doubled_through_a_shared_cache()
    c.axis(0).parallelize(ParallelType.BIDx)
    c.axis(1).parallelize(ParallelType.TIDx)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.Unroll)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(-1)
    assert c.inline_position == 1
    x_ = rand(3, 100, seed=10)
    np.testing.assert_array_equal(fd.execute([x_])[0], 2 * x_)


@pytest.mark.parametrize("pos, want", [(-2, 2), (-3, 1), (-4, 0)])
def test_negative_inline_positions_count_from_the_end(pos: int, want: int) -> None:
    fd, c, y = doubled_through_a_shared_cache()
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(pos)
    assert c.inline_position == want
    with pytest.raises(KilnError, match=rf"inline_at {c.name}: position -5 is out of range; expected 0 to 3"):
        c.inline_at(-5)
    x_ = rand(3, 100, seed=11)
    np.testing.assert_array_equal(fd.execute([x_])[0], 2 * x_)


# -- the seed's transposed Shared staging, by hand ---------------------------------------------------
def test_transpose_staged_through_a_shared_tile_by_hand():
    # t0_g [N, M] -> t1_l = permute -> t2_s = t1_l -> t3_g = t2_s, all [M, N] tiled by 32x32:
    # [M/32 (BIDy), N/32 (BIDx), 32m, 32n]. The tile is written along m (coalesced reads of
    # t0: TIDx on 32m) and read along n (coalesced writes of t3: TIDx on 32n), so threads read
    # what others wrote: a block sync between, and the Shared tile is the whole [32, 32].
    n, m = 70, 45
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        t3 = fd.ops.permute(x, [1, 0])
        fd.add_output(t3)
    t1 = t3.cache_before()  # the permute, Local
    t2 = t3.cache_before()  # the staging copy
    t2.set_memory_type(MemoryType.Shared)
    for t in (t1, t2, t3):
        t.split(0, 32)
        t.split(2, 32)
        t.reorder({1: 2, 2: 1})  # [M/32, N/32, 32m, 32n]
        t.axis(0).parallelize(ParallelType.BIDy)
        t.axis(1).parallelize(ParallelType.BIDx)
    for t in (t1, t2):
        t.axis(2).parallelize(ParallelType.TIDx)
        t.axis(3).parallelize(ParallelType.TIDy)
    t3.axis(2).parallelize(ParallelType.TIDy)
    t3.axis(3).parallelize(ParallelType.TIDx)
    t1.inline_at(-1)
    t2.inline_at(2)
    x_ = rand(n, m)
    low = fd.lower([x_])
    k = low.kernels[0]
    (smem,) = [a for a in k.allocations if a.memory_type == MemoryType.Shared]
    assert smem.tensor == t2.name and smem.extents == ("32", "32"), smem
    assert k.kernel_ir.count("__syncthreads()  // RAW") == 1
    np.testing.assert_array_equal(fd.execute([x_])[0], x_.T)


# -- the accepted schedules above, on the GPU ---------------------------------------------------
def _gpu_cases():
    """(name, fd, numpy inputs, expected outputs) of accepted schedules above."""
    out = []
    fd, a, o = chain()
    a.axis(0).parallelize(ParallelType.TIDx)
    a.inline_at(-1)
    out.append(("parallel producer in a serial consumer loop", fd, [X5], [-np.abs(X5)]))
    fd, a, o = chain()
    a.set_memory_type(MemoryType.Shared)
    o.axis(0).parallelize(ParallelType.TIDx)
    out.append(("Shared producer read by other threads", fd, [X5], [-np.abs(X5)]))
    fd, a, o = chain()
    for t in (a, o):
        t.split(0, 2)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(1)
    out.append(("Local producer on a mapped thread axis", fd, [X5], [-np.abs(X5)]))
    fd, y, s = readme_fusion()
    s.split(1, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(-1).parallelize(ParallelType.TIDx)
    xs = [rand(4096, 4096), rand(4096, seed=1)]
    out.append(("README hand schedule", fd, xs, [np.maximum(xs[0] + xs[1][None], 0).sum(1)]))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        t3 = fd.ops.permute(x, [1, 0])
        fd.add_output(t3)
    t1 = t3.cache_before()
    t2 = t3.cache_before()
    t2.set_memory_type(MemoryType.Shared)
    for t in (t1, t2, t3):
        t.split(0, 32)
        t.split(2, 32)
        t.reorder({1: 2, 2: 1})
        t.axis(0).parallelize(ParallelType.BIDy)
        t.axis(1).parallelize(ParallelType.BIDx)
    for t in (t1, t2):
        t.axis(2).parallelize(ParallelType.TIDx)
        t.axis(3).parallelize(ParallelType.TIDy)
    t3.axis(2).parallelize(ParallelType.TIDy)
    t3.axis(3).parallelize(ParallelType.TIDx)
    t1.inline_at(-1)
    t2.inline_at(2)
    x_ = rand(1000, 333)
    out.append(("transpose through a Shared tile", fd, [x_], [x_.T]))
    return out


@pytest.mark.gpu
def test_accepted_manual_schedules_match_numpy_on_the_gpu():
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    for name, fd, xs, want in _gpu_cases():
        got = fd.execute([cp.asarray(a) for a in xs])
        for g, w in zip(got, want):
            np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-4, atol=1e-4, err_msg=name)


# -- a partly inlined broadcast whose shared loops its consumer concretizes -------------------------
def _rows_of_a_partial_broadcast():
    """o [B, S, D] = x * t[None] with t [S, D]; every tensor [B*S/2, 2, D/4, 4]: t's broadcast
    copy tb merges a broadcast B with S, which the loops it shares run as B*S."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        t = fd.define_tensor([-1, -1])
        tb = fd.ops.broadcast_in_dim(t, shape=[-1, -1, -1], broadcast_dims=[1, 2])
        o = fd.ops.mul(x, tb)
        fd.add_output(o)
    for v in (tb, o):
        v.merge(0)
        v.split(0, 2)
        v.split(2, 4)
        v.axis(0).parallelize(ParallelType.BIDx)
        v.axis(2).parallelize(ParallelType.TIDx)
    return fd, tb, o


def test_a_partly_inlined_broadcast_is_indexed_through_its_consumer():
    # tb keeps a private loop of 4 (its vector) and shares [B*S/2, 2, D/4] with o; it used
    # to be refused ("runs the concretized loop").
    fd, tb, o = _rows_of_a_partial_broadcast()
    tb.inline_at(3)
    tb.axis(3).parallelize(ParallelType.Vectorize)
    for b, s, d in [(3, 4, 8), (2, 5, 12), (1, 3, 4)]:
        x_, t_ = rand(b, s, d), rand(s, d, seed=1)
        (got,) = fd.execute([x_, t_])
        np.testing.assert_allclose(got, x_ * t_[None], rtol=1e-6)


def test_a_partly_inlined_broadcast_whose_consumer_loops_differ_is_refused():
    # o's inner axes are swapped: tb's private loop (axis 3) is not o's axis 3, so it cannot
    # stand in for it, and the shared loops still run the concretized space.
    fd, tb, o = _rows_of_a_partial_broadcast()
    o.reorder({2: 3, 3: 2})
    tb.inline_at(2)
    msg = rf"{tb.name}: inlined at position 2 but axis 0 .* runs the concretized loop"
    with pytest.raises(KilnError, match=msg):
        fd.lower([rand(3, 4, 8), rand(4, 8, seed=1)])


@pytest.mark.parametrize("mt", [MemoryType.Global, MemoryType.Shared])
def test_a_split_consumer_of_a_fully_inlined_broadcast_keeps_its_inner_index(mt: MemoryType):
    # t2 (a broadcast along axes 1 and 2) is fully inlined into t3, whose axis 1 is split
    # and which is itself inlined: t2 is indexed through t3, never through t3's own
    # consumer's loops alone (a rule for partly inlined tensors once applied here and
    # dropped the inner split's index: wrong values in Shared memory, unwritten reads in
    # Global).
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1, -1])
        t1 = fd.define_tensor([-1])
        t2 = fd.ops.broadcast_in_dim(t1, shape=[-1, -1, -1], broadcast_dims=[0])
        t3 = fd.ops.add(t2, t0)
        fd.add_output(fd.ops.add(t0, t3))
    t3.set_memory_type(mt)
    t3.split(1, 3)
    t2.inline_at(-1)
    t3.inline_at(-1)
    a0, a1 = rand(2, 13, 7), rand(2, seed=1)
    (got,) = fd.execute([a0, a1])
    np.testing.assert_allclose(got, 2 * a0 + a1[:, None, None], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["neg", "tanh"])
@pytest.mark.parametrize("pt", [ParallelType.BIDx, ParallelType.TIDx])
def test_a_computed_broadcast_operand_under_a_merged_output_reads_its_own_axis(op: str, pt: ParallelType):
    # o = broadcast(op(b)) + x with o's two axes merged: op(b) follows its consumer into the
    # merged loop and must read b at the merged index's column, not at the merged index.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        o = fd.ops.add(fd.ops.broadcast_in_dim(getattr(fd.ops, op)(b), shape=[-1, -1], broadcast_dims=[1]), x)
        fd.add_output(o)
    o.merge(0)
    o.axis(0).parallelize(pt)
    x_, b_ = rand(4, 5), rand(5, seed=1)
    (got,) = fd.execute([x_, b_])
    want = x_ + (-b_ if op == "neg" else np.tanh(b_))[None]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mt", [MemoryType.Shared, MemoryType.Global])
def test_an_outer_split_of_a_merged_broadcast_is_not_its_consumers_chunk(mt: MemoryType):
    # tb [M, 1] and o [M, N], both merged and split into 7 outer chunks: the loop extents
    # match (7) but chunk k of tb holds other rows than chunk k of o needs, so sharing that
    # loop is refused (it gave wrong values in Shared memory).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        tb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[0])
        o = fd.ops.add(tb, x)
        fd.add_output(o)
    tb.set_memory_type(mt)
    for t in (tb, o):
        t.merge(0)
        t.split(0, 7, inner_split=False)
    tb.inline_at(1)
    msg = rf"{tb.name}(:| is in {mt.name} memory but) inlined at position 1.* runs the concretized loop"
    with pytest.raises(KilnError, match=msg):
        fd.lower([rand(31, 64), rand(31, seed=1)])
    # (a Shared or Global buffer is refused under those loops at any position: registers,
    # fully inlined, are indexed through their consumer)
    tb.set_memory_type(MemoryType.Local)
    tb.inline_at(-1)
    x_, b_ = rand(31, 64), rand(31, seed=1)
    (got,) = fd.execute([x_, b_])
    np.testing.assert_allclose(got, x_ + b_[:, None], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mt", [MemoryType.Global, MemoryType.Shared])
def test_a_memory_buffer_under_a_concretized_merged_loop_is_refused(mt: MemoryType):
    # p = tanh(t1) [16, 3] feeds b = broadcast(p) [16, 31, 3], merged like its consumer: p's
    # loops run the merged [16 * 31] space, and a Shared or Global buffer laid out by them
    # was written at one layout and read at another (unwritten reads, races). A register
    # copy is indexed through its consumer instead.
    def build(memory: MemoryType):
        with FusionDefinition() as fd:
            t0 = fd.define_tensor([-1, -1, -1])
            t1 = fd.define_tensor([-1, -1])
            p = fd.ops.tanh(t1)
            b = fd.ops.broadcast_in_dim(p, shape=[-1, -1, -1], broadcast_dims=[0, 2])
            c = fd.ops.add(b, t0)
            fd.add_output(c)
        p.set_memory_type(memory)
        b.merge(0)
        c.merge(0)
        p.inline_at(-1)
        b.inline_at(-1)
        return fd, p
    a0, a1 = rand(16, 31, 3), rand(16, 3, seed=1)
    fd, p = build(mt)
    msg = rf"{p.name} is in {mt.name} memory but inlined at position .* runs the concretized loop .* Local"
    with pytest.raises(KilnError, match=msg):
        fd.lower([a0, a1])
    fd, p = build(MemoryType.Local)
    (got,) = fd.execute([a0, a1])
    np.testing.assert_allclose(got, a0 + np.tanh(a1)[:, None, :], rtol=1e-6, atol=1e-6)


def two_consumers_of_a_merged_broadcast(c2_memory: MemoryType):
    """b = broadcast(neg(t1)) [4, 1, 4] read by c1 = b + t0 (concretizes the broadcast) and
    c2 = sin(b) (keeps it); b, c1 and c2 merged to one axis and split twice."""
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[4, 3, 4], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[4, 4], dtype=DataType.Float)
        t2 = fd.define_tensor(shape=[4, 3, 4], dtype=DataType.Float)
        b = fd.ops.broadcast_in_dim(fd.ops.neg(t1), shape=[-1, -1, -1], broadcast_dims=[0, 2])
        c1 = fd.ops.add(b, t0)
        c2 = fd.ops.sin(b)
        fd.add_output(fd.ops.add(c1, fd.ops.mul(c2, t2)))
    c2.set_memory_type(c2_memory)
    for t in (b, c1, c2):
        t.merge(0)
        t.merge(0)
        t.split(0, 2)
        t.split(0, 64)
    return fd, b, c2


@pytest.mark.parametrize("mt", [MemoryType.Local, MemoryType.Shared, MemoryType.Global])
def test_a_consumer_pulled_into_loops_its_producer_shares_with_a_concretizing_one_is_refused(mt: MemoryType):
    # b inlined fully into c1 and c2 puts c2 in c1's loops, which run the [4, 3, 4] space;
    # c2 keeps its own [4, 1, 4] buffer, so its loop indices no longer name its elements
    # (it was written at the wrong places: max error 0.83).
    a0, a1, a2 = rand(4, 3, 4), rand(4, 4, seed=1), rand(4, 3, 4, seed=2)
    want = a0 - a1[:, None] + np.sin(-a1[:, None].astype(np.float64)) * a2
    fd, b, c2 = two_consumers_of_a_merged_broadcast(mt)
    b.inline_at(-1)
    msg = rf"{c2.name}: its axis 0 .* shares the loop .* with {b.name}, which is inlined"
    with pytest.raises(KilnError, match=msg):
        fd.lower([a0, a1, a2])
    # Left outside the shared loops, b is computed in its own and both consumers read it.
    fd, b, c2 = two_consumers_of_a_merged_broadcast(mt)
    (got,) = fd.execute([a0, a1, a2])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mt", [MemoryType.Local, MemoryType.Global])
def test_a_tensor_indexed_through_its_consumer_keeps_the_consumers_overrun_bound(mt: MemoryType):
    # b = tanh(t1) over a [1, N] row; c2 = tanh(b) (kept broadcast) inlined into c3 whose
    # rows concretize it. The split of 2 by 4 on BIDx overruns: blocks 2 and 3 alias the
    # next chunk's elements. c2 is indexed through c3 (from its logical indices, which stay
    # in range), so it needs c3's bound on the overrunning split too: without it c2 was
    # computed from a b never written there and stored over valid elements.
    a0, a1 = rand(3, 7), rand(1, 7, seed=1)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[1, -1], dtype=DataType.Float)
        b = fd.ops.tanh(t1)
        c1 = fd.ops.add(b, t0)
        c2 = fd.ops.tanh(b)
        c3 = fd.ops.mul(c1, c2)
        fd.add_output(c3)
    c2.set_memory_type(mt)
    for t in (b, c1, c2, c3):
        t.split(1, 2)
        t.split(2, 4)
        t.axis(-1).parallelize(ParallelType.BIDx)
    for t in (b, c1, c2):
        t.inline_at(-1)
    b.inline_at(2)
    (got,) = fd.execute([a0, a1])
    tb = np.tanh(a1.astype(np.float64))
    np.testing.assert_allclose(got, (a0 + tb) * np.tanh(tb), rtol=1e-5, atol=1e-6)


def test_a_fully_inlined_cache_under_a_merged_broadcast_is_read_where_it_was_written():
    # The cache of t1 [5, 10] runs the output's merged [5 * 14] loop. It was written at its
    # logical row (idx / 14) and read at the loop index (idx): unwritten registers.
    a0, a1 = rand(5, 14, 10), rand(5, 10, seed=1)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[5, 14, 10], dtype=DataType.Float)
        t1 = fd.define_tensor(shape=[5, 10], dtype=DataType.Float)
        b = fd.ops.broadcast_in_dim(t1, shape=[-1, -1, -1], broadcast_dims=[0, 2])
        o = fd.ops.add(b, t0)
        fd.add_output(o)
    t1.cache_after()
    o.merge(0)
    o.split(1, 4)
    o.merge(1)
    o.axis(-2).parallelize(ParallelType.Unroll)
    o.axis(1).parallelize(ParallelType.BIDy)
    (got,) = fd.execute([a0, a1])
    np.testing.assert_allclose(got, a0 + a1[:, None, :], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [2, 3, 7])
@pytest.mark.parametrize("through_broadcast", [False, True])
def test_a_split_broadcast_axis_runs_its_loop_once(factor: int, through_broadcast: bool) -> None:
    """Splitting a size-one axis leaves a broadcast inner axis of the factor's extent; a
    serial loop over it must not run the reduction inside it once per pass (it summed the
    row `factor` times)."""
    a = rand(8, seed=factor)
    with FusionDefinition() as fd:
        if through_broadcast:
            y = fd.define_tensor([8])
            t = fd.ops.broadcast_in_dim(y, shape=[1, 8], broadcast_dims=[1])
        else:
            t = fd.define_tensor([1, 8])
        s = fd.ops.sum(t, dims=[1])
        fd.add_output(s)
    s.split(0, factor)
    if through_broadcast:
        t.inline_at(-1)
    (got,) = fd.execute([a if through_broadcast else a.reshape(1, 8)])
    np.testing.assert_allclose(got, [a.astype(np.float64).sum()], rtol=1e-6)


def test_merging_two_splits_past_the_longest_loop_is_refused() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([10])
        y = fd.ops.exp(x)
        fd.add_output(y)
    y.split(0, 65536)
    y.split(0, 65536)
    with pytest.raises(KilnError, match=r"merge T1: axes 1 and 2 would make a loop of 4294967296 iterations"):
        y.merge(1)


def test_cache_before_a_reduction_inlined_past_its_new_axes() -> None:
    """inline_at on a full reduction, then cache_before: the copy has no axes left, and its
    inline position must not point past them (lowering indexed past its loop domain)."""
    a = rand(127)
    with FusionDefinition() as fd:
        x = fd.define_tensor([127])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(fd.ops.sub(x, fd.ops.broadcast_in_dim(s, shape=[127], broadcast_dims=[])))
    s.inline_at(1)
    s.cache_before()
    try:
        (got,) = fd.execute([a])
    except KilnError as e:  # a refusal is fine; an internal error is not
        assert "internal" not in type(e).__name__.lower(), e
        return
    np.testing.assert_allclose(got, a - a.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)


def test_unswitch_keeps_a_barrier_out_of_a_thread_dependent_branch() -> None:
    """An Unswitch loop whose fast-path test reads threadIdx and whose body holds a
    __syncthreads (a Shared producer) or a block reduction stays a checked loop: a branch
    some threads of the block skip would leave the rest waiting at the barrier."""
    a = rand(5)
    with FusionDefinition() as fd:
        x = fd.define_tensor([5])
        m = fd.ops.max(x, dims=[0])
        mb = fd.ops.broadcast_in_dim(m, shape=[-1], broadcast_dims=[])
        y = fd.ops.add(x, mb)
        fd.add_output(y)
    m.set_memory_type(MemoryType.Shared)
    mb.set_memory_type(MemoryType.Shared)
    for t in (m, mb, y):
        t.split(0, 3)
        t.axis(-1).parallelize(ParallelType.TIDx)
    mb.inline_at(-1)
    y.axis(-2).parallelize(ParallelType.Unswitch)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a + a.max(), rtol=1e-6)

    b = np.random.default_rng(0).uniform(-1, 1, [2, 5, 3]).astype(F32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 5, 3])
        s = fd.ops.sum(x, dims=[2])
        y = fd.ops.neg(s)
        fd.add_output(y)
    s.split(2, 2, inner_split=False)
    s.axis(-2).parallelize(ParallelType.TIDx)
    s.axis(0).parallelize(ParallelType.BIDx)
    y.axis(0).parallelize(ParallelType.BIDx)
    s.inline_at(-1)
    y.axis(-1).parallelize(ParallelType.Unswitch)
    (got,) = fd.execute([b])
    np.testing.assert_allclose(got, -b.astype(np.float64).sum(2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_cache", [False, True])
def test_a_grid_reduction_read_over_the_blocks_it_combined_is_refused(with_cache: bool) -> None:
    """Only the block that finishes a grid reduction holds its result; a copy of it
    (cache_after) used to hide the read and leave the other blocks' outputs unwritten."""
    a = rand(31, 7)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([31, 7])
        t1 = fd.ops.sum(t0, dims=[1])
        t2 = fd.ops.broadcast_in_dim(t1, shape=[-1, -1], broadcast_dims=[0])
        t3 = fd.ops.add(t0, t2)
        fd.add_output(t3)
        fd.add_output(t1)
    for t in (t1, t2, t3):
        t.split(1, 8)
        t.axis(-1).parallelize(ParallelType.TIDx)
        t.axis(-2).parallelize(ParallelType.BIDy)
        t.axis(0).parallelize(ParallelType.BIDx)
    t2.inline_at(-1)
    if with_cache:
        t1.cache_after()
    with pytest.raises(KilnError, match=r"T1|BIDy"):
        fd.lower([a])


def test_circular_buffering_a_computed_value_without_loops_is_refused() -> None:
    a = rand(8)
    with FusionDefinition() as fd:
        x = fd.define_tensor([8])
        m = fd.ops.max(x, dims=[0])
        s = fd.ops.sigmoid(m)
        fd.add_output(fd.ops.abs(fd.ops.tanh(s)))
    s.set_memory_type(MemoryType.Shared)
    m.split(0, 4)
    m.axis(-1).parallelize(ParallelType.TIDx)
    m.inline_at(-1)
    s.circular_buffer(3)
    with pytest.raises(KilnError, match=r"circular_buffer T2 .*only a copy of a fusion input"):
        fd.lower([a])



def test_a_broadcast_output_under_a_concretized_merged_loop_is_refused() -> None:
    """An output buffer is laid out by its own loops like any Global tensor: merged like its
    concretizing consumer, it was written once per element of the merged space, by many
    blocks, and read back by others."""
    x, v = rand(3, 33), rand(3, seed=1)
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, -1])
        tv = fd.define_tensor([-1])
        b = fd.ops.broadcast_in_dim(tv, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.maximum(tx, b)
        fd.add_output(y)
        fd.add_output(b)
    for t in (b, y):
        t.merge(0)
        t.split(-1, 4)
        t.axis(-2).parallelize(ParallelType.BIDx)
        t.axis(-1).parallelize(ParallelType.TIDx)
    b.inline_at(-1)
    with pytest.raises(KilnError, match=rf"{b.name} is in Global memory but inlined at .*concretized loop"):
        fd.lower([x, v])


def test_an_outputs_allocation_domain_must_order_its_logical_axes() -> None:
    """An output comes back as a strided array: a split in its allocation domain was taken by
    lower() and refused only by execute(), without naming the axis."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.neg(x)
        fd.add_output(y)
    y.split(1, 3)
    with pytest.raises(KilnError, match=r"set_allocation_domain T1: axis 1 .* is not one of its logical"):
        y.set_allocation_domain([0, 2, 1], True)
    a = rand(4, 6)
    np.testing.assert_array_equal(fd.execute([a])[0], -a)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("op", ["maximum", "add", "sub", "mul"])
@pytest.mark.parametrize("chain", [1, 2])
def test_sibling_operands_sharing_an_inlined_broadcast_place_in_either_order(
        swap: bool, op: str, chain: int) -> None:
    """w = bb + bb and z = bb + f(x) share the loops of the inlined broadcast bb; f(x), a
    tensor of its own nest, is placed before both whichever operand comes first."""
    rng = np.random.default_rng(chain)
    a = rng.uniform(-1, 1, (4, 8)).astype(np.float32)
    b = rng.uniform(-1, 1, 4).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        bt = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        y = fd.ops.neg(x)
        ys = [y]
        for _ in range(chain - 1):
            ys.append(fd.ops.exp(ys[-1]))
        bb = fd.ops.broadcast_in_dim(bt, shape=[-1, -1], broadcast_dims=[0])
        z = fd.ops.add(bb, ys[-1])
        w = fd.ops.add(bb, bb)
        first, second = (z, w) if swap else (w, z)
        out = getattr(fd.ops, op)(first, second)
        fd.add_output(out)
    for t in [*ys, z, w, out]:
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    yd = -a.astype(np.float64)
    for _ in range(chain - 1):
        yd = np.exp(yd)
    bd = b.astype(np.float64)[:, None]
    zd, wd = bd + yd, 2 * bd + 0 * yd
    fd_, sd = (zd, wd) if swap else (wd, zd)
    ref = {"maximum": np.maximum, "add": np.add, "sub": np.subtract, "mul": np.multiply}[op](fd_, sd)
    np.testing.assert_allclose(fd.execute([a, b])[0], ref, rtol=1e-6, atol=1e-6)


# -- empty parallel axes --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 0), (0, 4), (4, 3), (1, 0)])
def test_a_thread_reduction_over_an_empty_axis_writes_its_identity(shape):
    # TIDx over a runtime size that is 0: the kernel launches one guarded thread per block
    # (a block of no threads cannot be launched), and the sum over nothing is 0.
    fd = scenarios.empty_axis_row_sum()
    a = rand(*shape)
    np.testing.assert_allclose(fd.execute([a])[0], a.astype(np.float64).sum(1) + 1.0, rtol=1e-6)


@pytest.mark.parametrize("shape", [(0, 4), (3, 4), (0, 1)])
def test_a_grid_reduction_over_an_empty_axis_writes_its_identity(shape):
    # BIDx over the reduced rows: with no rows, one guarded block still writes the zeros.
    fd = scenarios.empty_axis_column_sum()
    a = rand(*shape)
    np.testing.assert_allclose(fd.execute([a])[0], a.astype(np.float64).sum(0) + 1.0, rtol=1e-6)


def test_a_broadcast_axis_on_bidx_is_computed_by_every_block():
    # The broadcast's own loop has extent one on BIDx while its reader runs BIDx over 42
    # rows: each block computes its own copy of the on-chip tensor (guarding it to block 0
    # left the other blocks' Shared copies unwritten).
    x, w = rand(42, 5), rand(5, seed=1)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([42, 5])
        t1 = fd.define_tensor([5])
        b = fd.ops.broadcast_in_dim(fd.ops.mul(t1, 2.0), shape=[-1, -1], broadcast_dims=[1])
        o = fd.ops.add(b, t0)
        fd.add_output(o)
    b.set_memory_type(MemoryType.Shared)
    b.axis(0).parallelize(ParallelType.BIDx)
    o.axis(0).parallelize(ParallelType.BIDx)
    np.testing.assert_allclose(fd.execute([x, w])[0], x + 2.0 * w.astype(np.float64), rtol=1e-6)


def test_a_split_broadcast_on_bidy_is_computed_by_every_block():
    # A broadcast split by 16 keeps a broadcast outer loop of extent one on BIDy, while its
    # reader runs BIDy over ceil(n / 16) blocks. The loop's own axis is the broadcast one
    # (its loop group promotes to the reader's iteration axis), and each block still computes
    # its own Shared copy.
    n = 128
    a, b = rand(seed=3), rand(n, seed=4)
    with FusionDefinition() as fd:
        s = fd.define_tensor([], dtype=DataType.Float)
        x = fd.define_tensor([-1])
        t = fd.ops.add(s, s)
        bc = fd.ops.broadcast_in_dim(t, shape=[-1], broadcast_dims=[])
        o = fd.ops.add(bc, x)
        fd.add_output(o)
    t.set_memory_type(MemoryType.Shared)
    bc.set_memory_type(MemoryType.Shared)
    bc.split(0, 16)
    bc.axis(-2).parallelize(ParallelType.BIDy)
    o.split(0, 16)
    o.axis(-1).parallelize(ParallelType.BIDx)
    o.axis(-2).parallelize(ParallelType.BIDy)
    np.testing.assert_allclose(fd.execute([a, b])[0], 2.0 * float(a) + b.astype(np.float64), rtol=1e-6)


@pytest.mark.parametrize("shape", [(16, 3), (5, 7), (1, 300)])
def test_a_second_reader_of_a_producer_indexed_through_another_reads_under_its_bounds(shape):
    # b = c - (-1.5) of a [1, 1] input, fully inlined into the loops it shares with
    # d = b * x ([N, M], which b is indexed through) and e = c + b ([1, 1], an output). The
    # merged and split loops overrun N * M: b is computed under d's overrun bounds, so e,
    # which reads it in the same loops, must read it under them too (it read b where b was
    # never written).
    a1, a2 = rand(*shape, seed=1), rand(1, 1, seed=2)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        c = fd.define_tensor(shape=[1, 1], dtype=DataType.Float)
        b = fd.ops.sub(c, -1.5)
        d = fd.ops.mul(b, x)
        e = fd.ops.add(c, b)
        fd.add_output(e)
        fd.add_output(d)
    for t in (b, d, e):
        t.merge(0)
        t.split(0, 257, inner_split=False)
        t.split(0, 64)
        t.axis(-2).parallelize(ParallelType.TIDx)
    b.inline_at(-1)
    got_e, got_d = fd.execute([a1, a2])
    c64 = a2.astype(np.float64)
    np.testing.assert_allclose(got_e, c64 + c64 + 1.5, rtol=1e-6)
    np.testing.assert_allclose(got_d, (c64 + 1.5) * a1.astype(np.float64), rtol=1e-6)


def _exp_neg_inlined_at_zero(shape: List[int]) -> FusionDefinition:
    """T1 = exp(T0) inlined at 0 explicitly, T2 = -T1 on blocks."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        a = fd.ops.exp(x)
        y = fd.ops.neg(a)
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.BIDx)
    a.inline_at(0)
    return fd


def test_an_explicit_inline_at_zero_is_kept() -> None:
    # The tensor is computed whole in its own loop nest before its reader, as asked; it
    # used to be re-inlined into the reader as if never scheduled.
    fd = _exp_neg_inlined_at_zero([3, 5])
    xa = rand(3, 5)
    ir = fd.lower([xa]).kernels[0].kernel_ir
    assert "ALLOCATE T1 Local float [3, 5]" in ir
    np.testing.assert_allclose(fd.execute([xa])[0], -np.exp(xa.astype(np.float64)), rtol=1e-6)
    fd = _exp_neg_inlined_at_zero([-1, -1])
    with pytest.raises(KilnError, match=r"T1 is in Local memory but its allocation \[i0, i1\] is not a"):
        fd.execute([xa])


def test_a_cache_inlined_past_a_consumer_broadcast_axis_names_the_reorder() -> None:
    # The operand tile of a hand-written product: the broadcast adds an axis in front of the
    # one the cache shares. Moved behind, the same inline position runs.
    def build():
        with FusionDefinition() as fd:
            x, w = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1, -1])
            xb = fd.ops.broadcast_in_dim(x, shape=[-1, -1, -1], broadcast_dims=[0, 2])
            y = fd.ops.mul(xb, w)
            fd.add_output(y)
        xc = x.cache_after()
        xc.set_memory_type(MemoryType.Shared)
        return fd, xc, xb, y

    fd, xc, xb, y = build()
    a, b = rand(3, 5), rand(3, 4, 5, seed=1)
    with pytest.raises(KilnError, match=r"consumer T2 .* is a broadcast axis T\d+ does not have.*reorder"):
        xc.inline_at(2)
        fd.lower([a, b])
    fd, xc, xb, y = build()
    xb.reorder({1: -1})
    y.reorder({1: -1})
    xc.inline_at(2)
    xb.inline_at(-1)
    np.testing.assert_allclose(fd.execute([a, b])[0], a[:, None, :].astype(np.float64) * b, rtol=1e-6)


def test_a_serial_grid_reduction_without_a_block_axis_is_refused() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [1])
        fd.add_output(s)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(1).parallelize(ParallelType.TIDx)
    s.set_serial_grid_reduction()
    with pytest.raises(KilnError, match=r"T1.set_serial_grid_reduction\(\): T1 reduces across no blocks"):
        fd.lower([rand(4, 32)])


def test_nvfuser_scheduling_names_point_to_kilns() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [1])
        fd.add_output(s)
    with pytest.raises(KilnError, match=r"T1.rfactor: kiln has no rfactor: split the reduced axis"):
        s.rfactor([1])
    with pytest.raises(AttributeError, match="inline_at"):
        x.computeAt(s, 1)
    assert not hasattr(s, "rfactor") and not hasattr(s, "no_such_method")
