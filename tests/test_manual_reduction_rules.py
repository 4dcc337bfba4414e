"""Rules of hand-written (manual) schedules of reductions and of splits: every block initializes
its own Shared copy of a reduction that a BIDx consumer recomputes; splitting a size-one
(broadcast) axis gives parts of extent one, so a reduction merged with such a part adds every
element once and a BIDx loop over it writes every element once; a reduction inside a loop that
an Unswitch axis runs (promoted from a broadcast axis) is initialized on every pass; a consumer
whose one-iteration thread loop runs on thread 0 only places no barrier in it; a consumer of a
grid reduction in the same kernel that runs a thread dimension over an axis that reduction
combined is refused at lowering (only one thread of the finishing block holds the result),
while the same consumer run serially is accepted; a split factor above 2^20 and above the
runtime size of the axis it splits is refused before any kernel runs. Accepted schedules run in
the CPU interpreter (which checks bounds, uninitialized reads, races and divergent barriers) on
NumPy arrays against a float64 NumPy reference; refused ones raise ``KilnError`` naming the
tensor and the reason from ``fd.lower`` and ``fd.execute`` without launching a kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType
from kiln import _core as core
from kiln.fusion import Tensor

F32 = np.float32
REDUCE: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "max": np.max, "min": np.min}


def rand(*shape: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(F32)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The kernels the CPU interpreter runs from here on (one entry per launch)."""
    seen: list[Any] = []
    run = core.execute_cpu

    def counting(kernel: Any, inputs: Any) -> Any:
        seen.append(kernel)
        return run(kernel, inputs)

    monkeypatch.setattr(core, "execute_cpu", counting)
    return seen


# -- a Shared reduction recomputed by every block of its BIDx consumer ----------------------------
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("shape", [(3, 5), (2, 9), (4, 2)])
@pytest.mark.parametrize("symbolic", [False, True])
def test_shared_reduction_under_a_bidx_consumer_is_initialized_in_every_block(
        op: str, shape: tuple[int, int], symbolic: bool, launches: list[Any]) -> None:
    # y = x + op(x, 1) with y's columns on BIDx: every block computes its own Shared copy of
    # the reduction, so every block (not only block 0) initializes it.
    a = rand(*shape)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1] if symbolic else list(shape), dtype=DataType.Float)
        s = getattr(fd.ops, op)(x, dims=[1])
        b = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.add(x, b)
        fd.add_output(y)
    s.set_memory_type(MemoryType.Shared)
    y.axis(1).parallelize(ParallelType.BIDx)
    (got,) = fd.execute([a])
    x64 = a.astype(np.float64)
    np.testing.assert_allclose(got, x64 + REDUCE[op](x64, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert len(launches) == 1


# -- splits of a size-one (broadcast) axis --------------------------------------------------------
@pytest.mark.parametrize("k", [2, 7])
@pytest.mark.parametrize("shape", [(1, 5), (1, 17), (4, 1, 3)])
@pytest.mark.parametrize("layout", ["inner split", "outer split", "reduced axis outer"])
@pytest.mark.parametrize("memory", [None, MemoryType.Local, MemoryType.Shared, MemoryType.Global])
def test_split_size_one_axis_merged_with_the_reduced_axis_adds_each_element_once(
        k: int, shape: tuple[int, ...], layout: str, memory: MemoryType | None) -> None:
    # Splitting the size-one axis (second to last) by k gives two parts of extent one, not one
    # of extent k: merged with the reduced axis, the reduction loop visits each element once.
    # The sum is the output (memory None) or an intermediate in ``memory`` read by o = 2 * s.
    a = rand(*shape)
    ax = len(shape) - 2
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[*shape[:-1], -1])
        s = fd.ops.sum(x, dims=[ax + 1])
        fd.add_output(s if memory is None else fd.ops.mul(s, 2.0))
    if layout == "inner split":
        s.split(ax, k)  # [.., b1, bk, r n]
    else:
        s.split(ax, k, inner_split=False)  # [.., bk, b1, r n]
        s.reorder({ax: ax + 1})  # [.., b1, bk, r n]
    if layout == "reduced axis outer":
        s.reorder({ax + 1: ax + 2})  # [.., b1, r n, bk]
    s.merge(ax + 1)  # [.., b1, r k * n] (or n * k)
    if memory is not None:
        s.set_memory_type(memory)
    (got,) = fd.execute([a])
    want = a.astype(np.float64).sum(-1) * (1.0 if memory is None else 2.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4, 5])
@pytest.mark.parametrize("shape", [(3, 1, 2), (2, 1, 3), (4, 1, 5)])
def test_split_size_one_axis_merged_onto_bidx_writes_each_element_once(
        k: int, shape: tuple[int, int, int]) -> None:
    # The same split in Global memory: t1 (an output, inlined into t2 at 1) and t2 split their
    # size-one axis by k and merge its inner part onto BIDx; no copy of an element is written
    # by one block and read by another.
    a = rand(*shape)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=list(shape), dtype=DataType.Float)
        t1 = fd.ops.neg(x)
        t2 = fd.ops.mul(t1, -1.5)
        fd.add_output(t2)
        fd.add_output(t1)
    for t in (t1, t2):
        t.split(1, k)  # [a, 1, bk, c]
        t.merge(2)  # [a, 1, bk * c]
        t.reorder({0: 2, 2: 0})  # [bk * c, 1, a]
    t2.axis(0).parallelize(ParallelType.BIDx)
    t1.inline_at(1)
    g2, g1 = fd.execute([a])
    x64 = a.astype(np.float64)
    np.testing.assert_allclose(g1, -x64, rtol=1e-6)
    np.testing.assert_allclose(g2, 1.5 * x64, rtol=1e-6)


# -- a reduction inside a promoted loop that an Unswitch axis runs -------------------------------
@pytest.mark.parametrize("shape", [(5, 33), (7, 4), (6, 10)])
@pytest.mark.parametrize("factor", [2, 3])
def test_reduction_inside_an_unswitched_promoted_loop_is_initialized_on_every_pass(
        shape: tuple[int, int], factor: int) -> None:
    # t4 = sum(min(t0, dims=[0])) sits inside the loop of the copy t7's Unswitch axis (t7's
    # size-one axis, split and promoted to t0's rows by the loops it shares): its init goes
    # inside that loop, so each pass sums afresh instead of adding to the previous pass's total.
    a = rand(*shape, seed=57830)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        t2 = fd.ops.min(t0, dims=[0], keepdim=True)  # [1, M]; T1 is the min under it
        t3 = fd.ops.maximum(t0, t2)
        t4 = fd.ops.sum(t2, dims=[1])  # [1]
        t5 = fd.ops.broadcast_in_dim(t4, shape=[-1, -1], broadcast_dims=[0])
        t6 = fd.ops.sub(t5, t3)
        fd.add_output(t6)
        fd.add_output(t3)
    t7 = t4.cache_after()
    t2.set_memory_type(MemoryType.Shared)
    Tensor(fd, 1).set_memory_type(MemoryType.Shared)  # the min (Local would need a symbolic-size buffer)
    for t in (t2, t3, t6, t7):
        t.split(0, factor)
    t6.axis(1).parallelize(ParallelType.TIDx)
    t7.axis(1).parallelize(ParallelType.TIDx)
    t7.axis(0).parallelize(ParallelType.Unswitch)
    t2.inline_at(-1)
    got_o, got_m = fd.execute([a])
    x64 = a.astype(np.float64)
    mn = x64.min(0, keepdims=True)
    np.testing.assert_allclose(got_m, np.maximum(x64, mn), rtol=1e-6)
    np.testing.assert_allclose(got_o, mn.sum() - np.maximum(x64, mn), rtol=1e-5, atol=1e-5)


# -- no barrier inside a thread loop that runs on thread 0 only -----------------------------------
@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("op", ["min", "max", "sum"])
def test_no_barrier_inside_a_one_iteration_thread_loop_of_a_wider_block(n: int, op: str) -> None:
    # s = sum(x) is a block reduction over n threads; m = op(p) over p's size-one axis is a
    # TIDx loop of extent 1 (thread 0 only) that reads g (Global, through the untouched h):
    # g's read-after-write barrier is not placed inside that loop, where only thread 0 would
    # reach it.
    a = rand(n)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        s = fd.ops.sum(x, dims=[0])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1], broadcast_dims=[])  # [1]
        h = fd.ops.mul(sb, 0.5)
        g = fd.ops.add(h, 0.5)
        p = fd.ops.mul(sb, g)
        m = getattr(fd.ops, op)(p, dims=[0])  # over the size-one axis
        fd.add_output(m)
    g.set_memory_type(MemoryType.Global)
    s.axis(0).parallelize(ParallelType.TIDx)  # a block reduction over n threads
    m.axis(0).parallelize(ParallelType.TIDx)  # a TIDx loop of extent 1
    h.inline_at(-1)
    (got,) = fd.execute([a])
    ss = a.astype(np.float64).sum()
    np.testing.assert_allclose(got, ss * (0.5 * ss + 0.5), rtol=1e-5, atol=1e-6)


# -- a grid reduction's result read over a thread dimension it combined ---------------------------
def _grid_min_plus(op: str) -> tuple[FusionDefinition, Tensor, Tensor, Tensor]:
    """y = op(x) + z with op(x) a grid reduction over BIDy (Global); returns fd, the reduction,
    its broadcast and y."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        z = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        m = getattr(fd.ops, op)(x, dims=[0])
        mb = fd.ops.broadcast_in_dim(m, shape=[-1], broadcast_dims=[])
        y = fd.ops.add(mb, z)
        fd.add_output(y)
    m.set_memory_type(MemoryType.Global)
    m.axis(0).parallelize(ParallelType.BIDy)  # a grid reduction
    return fd, m, mb, y


@pytest.mark.parametrize("op", ["min", "max", "sum"])
@pytest.mark.parametrize("ptype", [ParallelType.TIDx, ParallelType.TIDy, ParallelType.TIDz])
def test_grid_reduction_read_over_a_thread_dimension_it_combined_is_refused(
        op: str, ptype: ParallelType, launches: list[Any]) -> None:
    # y's thread dimension reaches the broadcast mb through the loop they share: mb, read in
    # the block that finishes the grid reduction, is refused (not run with elements unwritten).
    xs, zs = rand(5), rand(5, seed=2)
    fd, m, mb, y = _grid_min_plus(op)
    y.axis(0).parallelize(ptype)
    dim = ptype.name
    want = (rf"{mb.name} is computed from the grid reduction {m.name} but runs {dim} over its axis 0 "
            rf"\(.*\), which that reduction combined: only one thread of the block that finishes it "
            rf"holds the result; give {mb.name} a kernel of its own")
    with pytest.raises(KilnError, match=want):
        fd.lower([xs, zs])
    with pytest.raises(KilnError, match=want):
        fd.execute([xs, zs])
    assert launches == []


@pytest.mark.parametrize("op", ["min", "max", "sum"])
@pytest.mark.parametrize("n", [1, 5, 9])
def test_grid_reduction_read_serially_in_the_same_kernel_runs(op: str, n: int, launches: list[Any]) -> None:
    # Control: the same fusion with y not spread over threads reads the result in the block
    # that finishes the grid reduction.
    xs, zs = rand(n), rand(n, seed=2)
    fd, _, _, _ = _grid_min_plus(op)
    (got,) = fd.execute([xs, zs])
    np.testing.assert_allclose(got, REDUCE[op](xs.astype(np.float64)) + zs, rtol=1e-5, atol=1e-6)
    assert len(launches) == 1


def _serial_grid_sum(spread: ParallelType | None) -> tuple[FusionDefinition, Tensor, Tensor]:
    """s = sum(x, dims=[0]) across blocks (BIDy, set_serial_grid_reduction) and its broadcast
    sb (both outputs), sb's columns on ``spread``; returns fd, s and sb."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        s = fd.ops.sum(x, dims=[0])  # [cols]
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[1])  # [1, cols]
        fd.add_output(sb)
        fd.add_output(s)
    s.axis(0).parallelize(ParallelType.BIDy)  # the reduced rows across blocks; the columns a serial loop
    if spread is not None:
        sb.axis(1).parallelize(spread)
    s.set_serial_grid_reduction()
    return fd, s, sb


@pytest.mark.parametrize("ptype", [ParallelType.TIDx, ParallelType.TIDy])
@pytest.mark.parametrize("shape", [(2, 5), (3, 4)])
def test_serial_grid_reduction_read_over_a_thread_dimension_is_refused(
        ptype: ParallelType, shape: tuple[int, int], launches: list[Any]) -> None:
    a = rand(*shape, seed=2)
    fd, s, sb = _serial_grid_sum(ptype)
    want = (rf"{sb.name} is computed from the grid reduction {s.name} but runs {ptype.name} over its "
            rf"axis 1 \(.*\), which that reduction combined: only one thread of the block that finishes "
            rf"it holds the result; give {sb.name} a kernel of its own")
    with pytest.raises(KilnError, match=want):
        fd.lower([a])
    with pytest.raises(KilnError, match=want):
        fd.execute([a])
    assert launches == []


@pytest.mark.parametrize("shape", [(2, 5), (3, 4), (1, 7)])
def test_serial_grid_reduction_read_serially_in_the_same_kernel_runs(
        shape: tuple[int, int], launches: list[Any]) -> None:
    a = rand(*shape, seed=2)
    fd, _, _ = _serial_grid_sum(None)
    got_b, got_s = fd.execute([a])
    x64 = a.astype(np.float64)
    np.testing.assert_allclose(got_s, x64.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, x64.sum(0, keepdims=True), rtol=1e-5, atol=1e-6)
    assert len(launches) == 1


# -- split factors far past the axis they split ---------------------------------------------------
def _neg(shape: list[int]) -> tuple[FusionDefinition, Tensor]:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        z = fd.ops.neg(x)
        fd.add_output(z)
    return fd, z


@pytest.mark.parametrize(("cols", "factor", "symbolic"), [
    (16, 2**20 + 1, False),
    (16, 2**20 + 1, True),
    (16, 2**24, False),
    (16, 2**24, True),
    (16, 2**31 - 1, False),
    (2**20 + 3, 2**20 + 4, True),
])
def test_split_by_more_than_2_to_the_20_past_the_axis_size_is_refused(
        cols: int, factor: int, symbolic: bool, launches: list[Any]) -> None:
    # A factor above both 2^20 and the axis's runtime size would make the loop run mostly
    # empty iterations: refused (by fd.lower where the size is static, by fd.execute once the
    # inputs give it) before any kernel runs.
    a = rand(2, cols)
    fd, z = _neg([-1, -1] if symbolic else [2, cols])
    z.split(1, factor)
    want = (rf"split {z.name}: axis .* has size {cols} but is split by {factor}: its loop would run "
            rf"{factor} iterations for {cols} elements; split it by at most {max(cols, 2**20)}")
    if not symbolic:
        with pytest.raises(KilnError, match=want):
            fd.lower([a])
    with pytest.raises(KilnError, match=want):
        fd.execute([a])
    assert launches == []


@pytest.mark.parametrize(("cols", "factor", "symbolic"), [
    (16, 2**20, True),
    (16, 2**20, False),
    (16, 1000, True),
    (2**20 + 3, 2**20 + 3, True),
])
def test_split_by_at_most_2_to_the_20_or_at_most_the_axis_size_runs(
        cols: int, factor: int, symbolic: bool) -> None:
    # Controls: a factor up to 2^20 may pad any axis; a larger one runs on an axis at least as long.
    a = rand(1, cols)
    fd, z = _neg([-1, -1] if symbolic else [1, cols])
    z.split(1, factor)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, -a.astype(np.float64))


# -- a broadcast shared by consumers that iterate or reduce it differently -------------------------
@pytest.mark.parametrize("second", ["reduce", "wider"])
def test_inline_most_stops_before_a_broadcast_its_consumers_run_differently(second: str) -> None:
    # b = broadcast(neg(x)) [4, 1] read by c1 = b + y [4, 6] and by c2, which reduces the
    # size-one axis (or concretizes it to 7): one loop cannot run both, so inline_at(-1) stops
    # at 1 and position 2 is refused when asked for, instead of failing in lowering.
    x, y, z = rand(4), rand(4, 6, seed=2), rand(4, 7, seed=3)
    with FusionDefinition() as fd:
        tx = fd.define_tensor(shape=[4])
        ty = fd.define_tensor(shape=[4, 6])
        tz = fd.define_tensor(shape=[4, 7])
        b = fd.ops.broadcast_in_dim(fd.ops.neg(tx), shape=[-1, -1], broadcast_dims=[0])
        fd.add_output(fd.ops.add(b, ty))
        fd.add_output(fd.ops.sum(b, dims=[1]) if second == "reduce" else fd.ops.add(b, tz))
    want = (rf"inline_at {b.name}: axis 1 .* is a broadcast that its consumer T\d+ iterates it over 6 and "
            r"its consumer T\d+ (reduces it over 1|iterates it over 7); one loop cannot run both")
    with pytest.raises(KilnError, match=want):
        b.inline_at(2)
    b.inline_at(-1)
    assert b.inline_position == 1
    g1, g2 = fd.execute([x, y, z])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(g1, y - x64[:, None], rtol=1e-6)
    np.testing.assert_allclose(g2, -x64 if second == "reduce" else z - x64[:, None], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cols,split", [(7, 3), (9, 3), (10, 4), (100, 7)])
def test_an_unswitched_loop_around_a_grid_reduction_keeps_one_arm(cols: int, split: int) -> None:
    # The reduced axis split raggedly and its outer part on BIDx, an unswitched loop over the
    # rows around it: a bounds check that depends on blockIdx would send blocks into two arms,
    # each with its own grid reduction, so the loop keeps its per-statement checks instead.
    a = np.random.default_rng(cols).uniform(-1, 1, [32, cols]).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[32, cols], dtype=DataType.Float)
        t2 = fd.ops.sum(t0, dims=[1])
        fd.add_output(t2)
    t2.split(1, split)
    t2.reorder({0: 1, 1: 0, 2: 2})
    t2.axis(0).parallelize(ParallelType.BIDx)
    t2.axis(1).parallelize(ParallelType.Unswitch)
    t2.set_serial_grid_reduction()
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    ir = fd.lower([a]).kernels[0].kernel_ir
    assert ir.count("parallel reduction") == 1, ir


@pytest.mark.parametrize("reduced_on", [None, ParallelType.TIDx, ParallelType.TIDy])
@pytest.mark.parametrize("factor", [2, 3])
@pytest.mark.parametrize("reduced_first", [True, False])
def test_a_kept_size_one_axis_split_inside_the_reduced_loop_adds_once(
    reduced_on: Any, factor: int, reduced_first: bool
) -> None:
    # sum over the rows of [31, 1]: the kept size-one axis split by a factor runs `factor`
    # iterations; inside the reduced loop (after the one init) only the first may add to the
    # result, outside it each iteration starts from its own init.
    a = np.random.default_rng(factor).uniform(-1, 1, [31, 1]).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[31, 1], dtype=DataType.Float)
        t1 = fd.ops.sum(t0, dims=[0])
        t2 = fd.ops.broadcast_in_dim(t1, shape=[-1, -1], broadcast_dims=[1])
        t3 = fd.ops.add(t2, fd.ops.mul(t2, -1.5))
        fd.add_output(t3)
    for t in (t1, t2, t3):
        t.split(1, factor)
        if not reduced_first:
            t.reorder({0: 2, 1: 0, 2: 1})
    if reduced_on is not None:
        for t in (t1, t2, t3):
            t.axis(0 if reduced_first else 2).parallelize(reduced_on)
    t1.inline_at(-1)
    t2.inline_at(-1)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, -0.5 * a.astype(np.float64).sum(0, keepdims=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [2, 3, 4])
@pytest.mark.parametrize("reduced_on", [ParallelType.TIDy, ParallelType.TIDx])
def test_a_sibling_reduction_keeping_a_split_size_one_axis_adds_once(factor: int, reduced_on: Any) -> None:
    # Two reductions of one cached input inlined in one nest: the total over both axes, and
    # the column sum that keeps the size-one axis. That axis's loop (split by `factor`) runs
    # inside the rows' block reduction, after the column sum's init: the block reduction
    # added the whole column `factor` times.
    a0 = np.random.default_rng(factor).uniform(-1, 1, [31, 1]).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[31, 1], dtype=DataType.Float)
        t2 = fd.ops.sum(t0, dims=[0, 1], keepdim=True)
        t1 = Tensor(fd, 1)  # the reduction under the keepdim broadcast
        t3 = fd.ops.mul(t2, -1.5)
        t4 = fd.ops.sum(t0, dims=[0])
        t5 = fd.ops.broadcast_in_dim(t4, shape=[-1, -1], broadcast_dims=[1])
        t6 = fd.ops.add(t5, t3)
        fd.add_output(t6)
        fd.add_output(t1)
    t7 = t0.cache_after()
    for t in (t1, t2, t3, t4, t5, t6, t7):
        t.split(1, factor)
        t.axis(0).parallelize(reduced_on)
    t7.inline_at(3)
    t3.inline_at(-1)
    t2.inline_at(1)
    t4.inline_at(-1)
    t1.inline_at(-1)
    got6, got1 = fd.execute([a0])
    total = a0.astype(np.float64).sum()
    np.testing.assert_allclose(got6, [[-0.5 * total]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got1, total, rtol=1e-5, atol=1e-5)


def test_a_discarded_read_of_a_value_thread_0_stored_is_not_a_race() -> None:
    # The keepdim sum `t6` is an output (Global, stored by thread 0) that a one-value product
    # reads back; every thread computes that product (a register value is computed wherever
    # a reader may run), but only thread 0's enters the next sum. The other threads' reads
    # race with the store on the GPU and are discarded, like an uninitialized register's: the
    # interpreter poisons them rather than refusing the kernel.
    rng = np.random.default_rng(21650)
    a0, a1 = rng.uniform(-1, 1, [128]).astype(np.float32), rng.uniform(-1, 1, [128]).astype(np.float32)
    with FusionDefinition() as fd:
        fd.define_tensor(shape=[-1], dtype=DataType.Float)  # an unused input
        t1 = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        t3 = fd.ops.max(t1, dims=[0], keepdim=True)
        t2 = Tensor(fd, 2)
        t4 = fd.ops.mul(t3, 0.5)
        t6 = fd.ops.sum(t4, dims=[0], keepdim=True)
        t5 = Tensor(fd, 5)
        t7 = fd.ops.mul(t4, t6)
        t9 = fd.ops.sum(t7, dims=[0], keepdim=True)
        t8 = Tensor(fd, 8)
        t10 = fd.ops.mul(t9, 1.0)
        fd.add_output(t10)
        fd.add_output(t6)
    for t in (t2, t3, t4, t5, t6, t8, t9, t10):
        t.axis(0).parallelize(ParallelType.TIDx)
    t2.inline_at(0)
    t5.inline_at(-1)
    t3.inline_at(-1)
    got10, got6 = fd.execute([a0, a1])
    m = 0.5 * a1.astype(np.float64).max()
    np.testing.assert_allclose(got6, [m], rtol=1e-6)
    np.testing.assert_allclose(got10, [m * m], rtol=1e-6)


def test_a_kept_size_one_axis_on_a_thread_dimension_reduces_in_every_thread() -> None:
    # The row sums of [85, 8, 1] kept in registers, the kept size-one axis split and merged
    # into a TIDx loop of one iteration inside the reduced loop: every thread holds its own
    # copy of the sums and computes all of them (only a serial loop over that axis would add
    # the rows twice), then each thread negates its own row.
    a0 = np.random.default_rng(57600).uniform(-1, 1, [85, 8, 1]).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor(shape=[85, 8, 1], dtype=DataType.Float)
        t3 = fd.ops.sum(t0, dims=[1])
        t4 = fd.ops.neg(t3)
        fd.add_output(t4)
    t5 = t0.cache_after()
    t3.set_memory_type(MemoryType.Local)
    t3.split(0, 1)
    t3.split(3, 3, inner_split=False)
    t3.merge(2)
    t3.merge(0)
    t3.axis(0).parallelize(ParallelType.Unswitch)
    t3.axis(2).parallelize(ParallelType.TIDx)
    t4.split(1, 2)
    t4.axis(0).parallelize(ParallelType.TIDx)
    t5.merge(0)
    t5.merge(0)
    t3.inline_at(-1)
    (got,) = fd.execute([a0])
    np.testing.assert_allclose(got, -a0.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
