"""Circular buffering (rule 9 of the allocation seed): a Shared copy of an input, inlined in
a serial loop, loaded ``prefetch`` iterations ahead into one of ``stages`` buffers. The
allocation holds the stages (golden checks on the Allocate and the AllocationInfo), the loop
is split into prologue, main and epilogue, and every schedule runs in the interpreter (which
checks bounds, uninitialised reads and Shared-memory races) against NumPy in float64, at
sizes that leave partial tiles and fewer iterations than the prefetch distance."""

from __future__ import annotations

import re
from typing import Any, Optional, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType

F32 = np.float32


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(F32)


def exp64(x: np.ndarray) -> np.ndarray:
    return np.exp(x.astype(np.float64))


def streamed_exp(stages: int, prefetch: Optional[int] = None, tile: int = 32, cross: bool = False,
                 serial_rows: bool = False) -> Tuple[FusionDefinition, Any, Any]:
    """``y = exp(x)`` over rows [m, n], each row streamed through a Shared copy ``c`` of
    ``x`` in tiles of ``tile`` elements (one TIDx each). ``cross``: ``y`` runs a tile on
    half as many threads, two elements each, so threads read what others loaded.
    ``serial_rows``: the rows are a serial loop around the pipeline instead of blocks."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, tile)  # [m, n / tile, tile]
        if not serial_rows:
            t.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.TIDx)
    if cross:
        y.split(2, 2)  # [m, n / tile, tile / 2, 2]
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(stages, prefetch)
    return fd, c, y


def streamed_row_sum(stages: int, prefetch: Optional[int] = None,
                     tile: int = 32) -> Tuple[FusionDefinition, Any, Any]:
    """``s = sum(x, 1)``: the row's tiles are the pipelined loop and a block reduction
    over the tile combines the threads' register partials after it."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, s):
        t.split(1, tile)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(stages, prefetch)
    return fd, c, s


def pipelined_parts(ir: str) -> list:
    return re.findall(r"pipelined (prologue|main|epilogue), (.+) iterations", ir)


# -- the allocation and the loops ------------------------------------------------------------
def test_allocation_holds_one_buffer_per_stage_and_keeps_one_buffers_layout():
    fd, c, _ = streamed_exp(3)
    k = fd.lower([rand(4, 200)]).kernels[0]
    assert f"ALLOCATE {c.name} Shared float [3, 32]" in k.kernel_ir
    a = k.allocation(c.name)
    assert a.stages == 3
    assert a.memory_type == MemoryType.Shared
    assert a.extents == ("32",) and a.strides == ("1",)
    assert k.launch["smem_bytes"] == "384"  # 3 stages x 32 floats
    # A prologue of 2 loads, then the main loop and the epilogue over the row's tiles.
    assert pipelined_parts(k.kernel_ir) == [("prologue", "2"), ("main", "max(ceilDiv(i1, 32) - 2, 0)"),
                                            ("epilogue", "min(ceilDiv(i1, 32), 2)")]


def test_loads_go_to_the_stage_of_their_iteration():
    fd, c, _ = streamed_exp(4, prefetch=2)
    ir = fd.lower([rand(2, 300)]).kernels[0].kernel_ir
    # The main loop loads iteration i + 2 into stage (i + 2) % 4 and reads stage i % 4.
    assert re.search(rf"{c.name} = set\(T0\)  @ \[threadIdx.x \+ \(idx\d+ \+ 2\) % 4 \* 32\]", ir), ir
    assert re.search(r"<- \[threadIdx.x \+ idx\d+ % 4 \* 32\]", ir), ir


@pytest.mark.parametrize("prefetch", [1, 2])
def test_threads_reading_their_own_loads_wait_for_their_own_copies(prefetch: int):
    # Plain copies are asynchronous (cp.async), one group per iteration: a thread reading only
    # what it copied waits for its own group and needs no read barrier; only a refill of the
    # stage just read (prefetch == stages - 1) waits for the block.
    fd, _, _ = streamed_exp(3, prefetch)
    ir = fd.lower([rand(2, 100)]).kernels[0].kernel_ir
    assert "__syncthreads()  // RAW" not in ir
    main = ir[ir.index("pipelined main"):ir.index("pipelined epilogue")]
    assert re.search(rf"CP_ASYNC_COMMIT\n\s+CP_ASYNC_WAIT {prefetch}\n", main), main
    assert ("__syncthreads()  // WAR" in main) == (prefetch == 2)
    pro = ir[ir.index("pipelined prologue"):ir.index("pipelined main")]
    assert "CP_ASYNC_COMMIT" in pro
    assert "CP_ASYNC_WAIT 0" in ir[ir.index("pipelined epilogue"):]


@pytest.mark.parametrize("stages,prefetch", [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_cross_thread_reads_get_a_read_barrier_and_a_reuse_barrier_when_the_next_stage_was_just_read(
        stages: int, prefetch: int):
    fd, _, _ = streamed_exp(stages, prefetch, cross=True)
    ir = fd.lower([rand(2, 300)]).kernels[0].kernel_ir
    main = ir[ir.index("pipelined main"):ir.index("pipelined epilogue")]
    assert "__syncthreads()  // RAW" in main
    # prefetch == stages - 1 loads into the stage the previous iteration read.
    assert ("__syncthreads()  // WAR" in main) == (prefetch == stages - 1)


# -- results against NumPy ----------------------------------------------------------------------
SIZES = [(3, 1), (2, 31), (2, 32), (3, 33), (2, 64), (3, 95), (2, 300), (1, 1000)]


@pytest.mark.parametrize("stages,prefetch", [(2, None), (3, 1), (3, None), (4, 1), (4, 2), (4, None)])
@pytest.mark.parametrize("cross", [False, True])
def test_streamed_exp_matches_numpy(stages: int, prefetch: Optional[int], cross: bool):
    fd, _, _ = streamed_exp(stages, prefetch, cross=cross)
    for m, n in SIZES:
        x = rand(m, n, seed=m * 1000 + n)
        np.testing.assert_allclose(fd.execute([x])[0], exp64(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stages,prefetch", [(2, 1), (3, 2), (4, 1)])
def test_rows_as_a_serial_loop_around_the_pipeline(stages: int, prefetch: int):
    # The next row's prologue overwrites the stages the last tiles of this row were read
    # from: a barrier before it (the interpreter's race check would report the overlap).
    fd, _, _ = streamed_exp(stages, prefetch, cross=True, serial_rows=True)
    ir = fd.lower([rand(3, 100)]).kernels[0].kernel_ir
    assert ir.index("__syncthreads()  // WAR") < ir.index("pipelined prologue")
    for m, n in [(3, 100), (4, 31), (2, 1)]:
        x = rand(m, n, seed=n)
        np.testing.assert_allclose(fd.execute([x])[0], exp64(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stages,prefetch", [(2, 1), (3, 2), (4, 2)])
def test_streamed_row_sum_matches_numpy(stages: int, prefetch: int):
    fd, _, _ = streamed_row_sum(stages, prefetch)
    for m, n in [(3, 1), (2, 33), (4, 500), (1, 2049)]:
        x = rand(m, n, seed=n)
        want = x.astype(np.float64).sum(1)
        np.testing.assert_allclose(fd.execute([x])[0], want, rtol=1e-5, atol=1e-5)


def test_static_sizes_fold_the_three_loops():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 250])
        y = fd.ops.neg(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 64)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(2)
    x_ = rand(6, 250)
    k = fd.lower([x_]).kernels[0]
    assert pipelined_parts(k.kernel_ir) == [("prologue", "1"), ("main", "3"), ("epilogue", "1")]
    np.testing.assert_array_equal(fd.execute([x_])[0], -x_)


# -- refused schedules -------------------------------------------------------------------------
def test_stage_and_prefetch_counts_are_checked_when_set():
    fd, c, _ = streamed_exp(2)
    with pytest.raises(KilnError, match=rf"circular_buffer {c.name}: stages must be between 2 and 32, got 1"):
        c.circular_buffer(1)
    with pytest.raises(KilnError, match=r"prefetch must be at least 1 and below the 3 stages.*got 3"):
        c.circular_buffer(3, 3)
    with pytest.raises(KilnError, match=r"got 0"):
        c.circular_buffer(3, 0)


@pytest.mark.parametrize("stages,prefetch", [(2, 1), (3, 2), (3, 1), (4, 2)])
@pytest.mark.parametrize("m,n", [(2, 64), (3, 200), (1, 31)])
def test_a_local_copy_is_loaded_ahead_in_registers(stages: int, prefetch: int, m: int, n: int):
    # Each thread loads its own elements of the tiles ahead into register stages: the
    # allocation holds the stages, the loop is split in three, and no barrier or cp.async
    # orders the loads (a thread reads only what it loaded).
    fd, c, _ = streamed_exp(stages, prefetch)
    c.set_memory_type(MemoryType.Local)
    x_ = rand(m, n)
    k = fd.lower([x_]).kernels[0]
    assert f"ALLOCATE {c.name} Local float [{stages}, 1]" in k.kernel_ir, k.kernel_ir
    parts = pipelined_parts(k.kernel_ir)
    assert [p for p, _ in parts] == ["prologue", "main", "epilogue"], k.kernel_ir
    body = k.cuda_source.split("__global__")[-1]
    assert "__syncthreads" not in body and "cp_async" not in body and "cp.async" not in body, body
    assert parts[0][1] == str(prefetch), parts
    np.testing.assert_allclose(fd.execute([x_])[0], np.exp(x_.astype(np.float64)), rtol=1e-6)


def test_a_global_tensor_is_refused():
    fd, c, y = streamed_exp(2)
    c.set_memory_type(MemoryType.Global)
    with pytest.raises(KilnError, match=rf"{c.name} is in Global memory; only a Shared copy \(or a Local "):
        fd.lower([rand(2, 64)])


def test_no_serial_loop_to_pipeline_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.inline_at(1)
    c.circular_buffer(2)
    with pytest.raises(KilnError, match=rf"circular_buffer {c.name} .*no serial loop to pipeline.*inline_at"):
        fd.lower([rand(2, 64)])


@pytest.mark.parametrize("bulk", [False, True])
def test_a_one_iteration_loop_runs_as_a_plain_copy(bulk: bool) -> None:
    # Constant sizes with a row of one tile: the only serial loop left of the inline
    # position has one iteration, so there is nothing to overlap. The schedule runs as it
    # does with runtime sizes (a pipeline of one iteration), the copy without stages.
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 64])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 64)  # [6, 1, 64]
        t.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk if bulk else ParallelType.TIDx)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(3)
    a = rand(6, 64, seed=3)
    ir = fd.lower([a]).kernels[0].kernel_ir
    assert re.search(rf"ALLOCATE {c.name} .*Shared float \[64\]", ir), ir
    np.testing.assert_allclose(fd.execute([a])[0], exp64(a), rtol=1e-6)


def test_a_computed_tensor_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        y = fd.ops.neg(a)
        fd.add_output(y)
    a.set_memory_type(MemoryType.Shared)
    for t in (a, y):
        t.split(1, 32)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    a.inline_at(2)
    a.circular_buffer(2)
    with pytest.raises(KilnError, match=rf"{a.name} is defined by `.*exp.*`; only a copy of a fusion input"):
        fd.lower([rand(2, 64)])


def test_too_many_stages_for_shared_memory_is_refused_naming_the_tensor():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 64])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 256)  # [m, n / 256, 256, 64]: a stage is 256 x 64 floats (64 KiB)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(4)
    with pytest.raises(KilnError, match=rf"Shared memory.*{c.name} 262144 bytes"):
        fd.lower([rand(1, 512, 64)])


# -- bulk (TMA) copies ordered by mbarriers ----------------------------------------------------
def bulk_exp(stages: Optional[int], prefetch: Optional[int] = None, tile: int = 32, cross: bool = False,
             serial_rows: bool = False) -> Tuple[FusionDefinition, Any, Any]:
    """``streamed_exp`` with the copy's tile axis a Bulk copy; ``stages=None``: one bulk
    copy per tile, not circular-buffered."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, tile)
        if not serial_rows:
            t.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk)
    if cross:
        y.split(2, 2)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    if stages is not None:
        c.circular_buffer(stages, prefetch)
    return fd, c, y


def test_bulk_pipeline_allocates_read_and_reuse_barriers_around_the_loops():
    fd, c, _ = bulk_exp(3)
    ir = fd.lower([rand(2, 200)]).kernels[0].kernel_ir
    assert "ALLOCATE mbar0 (mbarriers) Shared int64 [6]" in ir
    # mbar[0:3] read-after-write (one bulk copy each), mbar[3:6] write-after-read (every thread).
    init = re.search(r"FOR (idx\d+) in .*// 3 iterations\n\s+MBARRIER_INIT mbar0\[\1\] arrivals=1 .*\n"
                     r"\s+MBARRIER_INIT mbar0\[\1 \+ 3\] arrivals=blockDim.x \* blockDim.y \* blockDim.z", ir)
    assert init, ir
    inval = re.search(r"FOR (idx\d+) in .*// 6 iterations\n\s+MBARRIER_INVAL mbar0\[\1\]", ir)
    assert inval, ir
    marks = ("MBARRIER_INIT", "pipelined prologue", "pipelined main", "pipelined epilogue", "MBARRIER_INVAL")
    order = [ir.index(s) for s in marks]
    assert order == sorted(order)
    main = ir[ir.index("pipelined main"):ir.index("pipelined epilogue")]
    # The issuer waits for the readers of the stage it refills; everyone waits for its bytes.
    assert re.search(r"BULK T2\[\(idx\d+ \+ 2\) % 3 \* 32\] .* arrive mbar0\[\(idx\d+ \+ 2\) % 3\] .*"
                     r"after MBARRIER_WAIT mbar0\[\(idx\d+ \+ 2\) % 3 \+ 3\]", main), main
    assert re.search(r"MBARRIER_WAIT mbar0\[idx\d+ % 3\] parity idx\d+ / 3 % 2", main), main
    assert re.search(r"MBARRIER_ARRIVE mbar0\[idx\d+ % 3 \+ 3\]", main), main
    assert "__syncthreads" not in main


def test_a_bulk_copy_outside_a_pipeline_gets_one_barrier_around_it():
    fd, c, _ = bulk_exp(None)
    ir = fd.lower([rand(2, 200)]).kernels[0].kernel_ir
    assert "ALLOCATE mbar0 (mbarriers) Shared int64 [1]" in ir
    # Initialised once before the loops; each tile's copy completes one phase, so the wait
    # alternates parity with the tile loop's index.
    assert ir.startswith("ALLOCATE T2 Shared float [32]\nALLOCATE mbar0 (mbarriers) Shared int64 [1]\n"
                         "MBARRIER_INIT mbar0[0] arrivals=1  // first thread\n__syncthreads()  // RAW\n"), ir
    assert ir.endswith("__syncthreads()  // RAW\nMBARRIER_INVAL mbar0[0]  // first thread\n"), ir
    assert re.search(r"__syncthreads\(\)  // WAR\n\s+BULK T2\[0\] .* arrive mbar0\[0\]"
                     r".*\n\s+MBARRIER_WAIT mbar0\[0\] parity idx\d+ % 2", ir), ir


@pytest.mark.parametrize("stages,prefetch", [(None, None), (2, 1), (3, 1), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("cross", [False, True])
def test_bulk_copies_match_numpy(stages: Optional[int], prefetch: Optional[int], cross: bool):
    fd, _, _ = bulk_exp(stages, prefetch, cross=cross)
    for m, n in SIZES:
        x = rand(m, n, seed=m * 1000 + n)
        np.testing.assert_allclose(fd.execute([x])[0], exp64(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stages", [None, 2, 3])
def test_bulk_copies_with_rows_as_a_serial_loop(stages: Optional[int]):
    # The barriers are set up again for every row's pipeline.
    fd, _, _ = bulk_exp(stages, cross=True, serial_rows=True)
    for m, n in [(3, 100), (4, 31), (2, 1)]:
        x = rand(m, n, seed=n)
        np.testing.assert_allclose(fd.execute([x])[0], exp64(x), rtol=1e-6, atol=1e-6)


def test_bulk_row_sum_matches_numpy():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    c.split(1, 64)
    c.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk)
    s.split(1, 64)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(4, 2)
    for m, n in [(3, 1), (2, 65), (4, 500), (1, 2049)]:
        x_ = rand(m, n, seed=n)
        want = x_.astype(np.float64).sum(1)
        np.testing.assert_allclose(fd.execute([x_])[0], want, rtol=1e-5, atol=1e-5)


def test_bulk_axis_rules_when_parallelized():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.split(1, 3)
    with pytest.raises(KilnError, match=rf"parallelize {c.name}: axis 1: Bulk must be on the innermost axis"):
        c.axis(1).parallelize(ParallelType.Bulk)
    with pytest.raises(KilnError, match=r"axis 2 has extent 3 \(12 bytes of float\); "
                                        r"a Bulk copy moves a multiple of 16"):
        c.axis(2).parallelize(ParallelType.Bulk)
    c2 = y.cache_before()
    with pytest.raises(KilnError, match=r"symbolic extent i1; a Bulk box has a constant size"):
        c2.axis(1).parallelize(ParallelType.Bulk)


def _bulk_refusal(change: Any) -> str:
    fd, c, y = bulk_exp(2)
    change(c, y)
    with pytest.raises(KilnError) as e:
        fd.lower([rand(2, 64)])
    return str(e.value)


def test_a_bulk_copy_into_local_memory_is_refused():
    msg = _bulk_refusal(lambda c, y: c.set_memory_type(MemoryType.Local))
    assert "T2 axis 2 (Bulk): T2 is in Local memory; a bulk copy lands in Shared memory" in msg


def test_a_bulk_copy_partitioned_by_threads_is_refused():
    def change(c, y):
        c.axis(0).parallelize(ParallelType.TIDy)
        y.axis(0).parallelize(ParallelType.TIDy)
    msg = _bulk_refusal(change)
    assert "T2 axis 0 runs on TIDy; one thread issues a bulk copy for the whole block" in msg


def test_a_bulk_copy_of_a_strided_walk_is_refused():
    # The Bulk axis walks x's rows (stride n): not one contiguous run.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(0, 32)  # [m / 32, 32, n]
        t.reorder({1: 2})  # [m / 32, n, 32]
    c.axis(2).parallelize(ParallelType.Bulk)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    with pytest.raises(KilnError, match=r"T2 axis 2 \(Bulk\): a bulk copy moves one contiguous run of T0, "
                                        r"but the Bulk axis does not walk T0's elements one by one"):
        fd.lower([rand(64, 40)])


# -- on the GPU ---------------------------------------------------------------------------------
GPU_CASES = [("plain", 3, None, False), ("plain", 4, 2, True), ("bulk", None, None, False),
             ("bulk", 2, 1, True), ("bulk", 3, None, False), ("bulk", 4, 2, True), ("bulk", 4, 3, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,stages,prefetch,cross", GPU_CASES)
def test_gpu_matches_numpy(kind: str, stages: Optional[int], prefetch: Optional[int], cross: bool) -> None:
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    build = bulk_exp if kind == "bulk" else streamed_exp
    # Rows of 16-byte multiples take the bulk copy; odd rows its element-loop fallback.
    for m, n in [(3, 1), (5, 33), (4, 96), (7, 301), (64, 4096), (3, 4099)]:
        fd, _, _ = build(stages, prefetch, cross=cross, tile=64)
        x = rand(m, n, seed=n)
        got = fd.execute([cp.asarray(x)])[0].get()
        np.testing.assert_allclose(got, exp64(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_bulk_row_sum_over_long_rows() -> None:
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, s):
        t.split(1, 1024)
        t.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk)
    s.split(2, 4)
    s.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(4)
    for m, n in [(132, 65536), (7, 5000), (2, 1)]:
        x_ = rand(m, n, seed=n)
        got = fd.execute([cp.asarray(x_)])[0].get()
        np.testing.assert_allclose(got, x_.astype(np.float64).sum(1), rtol=1e-4, atol=1e-3)


def test_a_thread_loop_between_the_pipelined_loop_and_the_copy_is_refused():
    # The batches are the pipelined loop; the rows between it and the copy run on TIDy, so
    # the pipeline cannot move inside them and the copy and its reader share that loop.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.axis(1).parallelize(ParallelType.TIDy)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(2)
    with pytest.raises(KilnError, match=r"circular_buffer T2: its copy and its readers share loop .* "
                                        r"inside the pipelined loop .*, and that loop runs on TIDy"):
        fd.lower([rand(3, 4, 8)])


@pytest.mark.parametrize("bulk", [False, True])
def test_block_loops_between_the_pipelined_loop_and_the_copy_take_the_pipeline_inside(bulk: bool):
    # Rows serial (pipelined), each row's tiles on blocks: the pipeline runs inside the block
    # loop, row after row.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.neg(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 32)
        t.axis(1).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk if bulk else ParallelType.TIDx)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(2)
    ir = fd.lower([rand(3, 70)]).kernels[0].kernel_ir
    assert ir.index("(BIDx)") < ir.index("pipelined prologue"), ir
    for m, n in [(3, 70), (5, 1), (1, 64)]:
        x_ = rand(m, n, seed=n)
        np.testing.assert_array_equal(fd.execute([x_])[0], -x_)


# -- other architectures (NVRTC, no GPU needed) ---------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "bulk"])
def test_kernels_compile_for_blackwell_and_bulk_copies_need_hopper(kind: str):
    from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    fd, _, _ = (bulk_exp if kind == "bulk" else streamed_exp)(3, tile=64)
    src = fd.lower([rand(4, 1000)]).kernels[0].cuda_source
    for arch in ("sm_90", "sm_100a"):
        assert compile_cubin(src, "k.cu", arch).cubin.startswith(b"\x7fELF")
    if kind == "bulk":
        # No bulk copies before Hopper: a named compile error, not a kernel that faults.
        with pytest.raises(KilnError, match=r"ParallelType.Bulk copies \(TMA\) need an sm_90 or newer GPU"):
            compile_cubin(src, "k.cu", "sm_80")
    else:
        assert compile_cubin(src, "k.cu", "sm_80").cubin.startswith(b"\x7fELF")  # cp.async is sm_80


# -- vector copies and 2-byte elements -----------------------------------------------------------
def vector_exp(dtype: DataType, vec: int, stages: int, bulk: bool) -> FusionDefinition:
    """``exp`` in float of a Float or Half input through a circular-buffered copy of tiles of
    128: plain copies of ``vec`` consecutive elements per thread (one ``cp.async`` of the
    vector where ``vec > 1``), or one bulk copy per tile."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        y = fd.ops.cast(fd.ops.exp(fd.ops.cast(x, DataType.Float)), dtype)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
    if bulk:
        c.axis(2).parallelize(ParallelType.Bulk)
        y.split(2, vec)
        y.axis(2).parallelize(ParallelType.TIDx)
    else:
        for t in (c, y):
            t.split(2, vec)
            t.axis(2).parallelize(ParallelType.TIDx)
        if vec > 1:
            c.axis(3).parallelize(ParallelType.Vectorize)
    c.inline_at(2)
    c.circular_buffer(stages)
    return fd


VECTOR_CASES = [(dt, vec, stages, bulk) for dt in ("Float", "Half") for vec in (1, 2, 4, 8)
                for stages in (2, 3) for bulk in (False, True) if not (dt == "Float" and vec == 8)]


def _vector_check(xp: Any, dt: str, vec: int, stages: int, bulk: bool) -> None:
    npdt = np.float32 if dt == "Float" else np.float16
    fd = vector_exp(DataType(dt), vec, stages, bulk)
    for n in (1, 130, 515, 1024, 4099):
        a = (np.random.default_rng(n).random((3, n)) - 0.5).astype(npdt)
        out = fd.execute([xp.asarray(a)])[0]
        out = out.get() if hasattr(out, "get") else out
        tol = 2e-3 if npdt == np.float16 else 1e-6
        np.testing.assert_allclose(out.astype(np.float64), exp64(a), rtol=tol, atol=tol)


@pytest.mark.parametrize("dt,vec,stages,bulk", VECTOR_CASES)
def test_vector_and_half_copies_match_numpy(dt: str, vec: int, stages: int, bulk: bool):
    _vector_check(np, dt, vec, stages, bulk)
    if not bulk and vec > 1:
        x = rand(2, 1024).astype(np.float16 if dt == "Half" else np.float32)
        ir = vector_exp(DataType(dt), vec, stages, bulk).lower([x]).kernels[0].kernel_ir
        assert re.search(rf"VECTOR x{vec} T\d+ = set\(T0\)", ir), ir


@pytest.mark.gpu
@pytest.mark.parametrize("dt,vec,stages,bulk", VECTOR_CASES)
def test_gpu_vector_and_half_copies_match_numpy(dt: str, vec: int, stages: int, bulk: bool) -> None:
    from gpu_util import cupy_or_skip

    _vector_check(cupy_or_skip(), dt, vec, stages, bulk)


@pytest.mark.parametrize("vec", [2, 4])
def test_vector_copies_of_one_byte_elements(vec: int):
    # A Bool vector of 2 bytes is below cp.async's smallest copy: element by element.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Bool)
        y = fd.ops.where(x, 2.0, -1.0)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 64)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.split(2, vec)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.axis(3).parallelize(ParallelType.Vectorize)
    c.inline_at(2)
    c.circular_buffer(3)
    for n in (1, 65, 300):
        a = np.random.default_rng(n).random((3, n)) < 0.5
        np.testing.assert_array_equal(fd.execute([a])[0], np.where(a, 2.0, -1.0).astype(np.float32))
