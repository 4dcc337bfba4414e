"""Golden checks of the allocation pass (DESIGN.md "The allocation pass", seed 000)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType

F32 = np.float32


def arr(*shape: int, dtype=F32) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def lines(ir: str) -> list:
    return [ln for ln in ir.splitlines() if ln.strip()]


def depth(line: str) -> int:
    return (len(line) - len(line.lstrip(" "))) // 2


def find(ir: str, pattern: str) -> int:
    """Index of the first kernel-IR line matching ``pattern``."""
    for i, ln in enumerate(lines(ir)):
        if re.search(pattern, ln):
            return i
    raise AssertionError(f"{pattern!r} not in kernel IR:\n{ir}")


# a) pointwise 2D, merge+split, BIDx/TIDx, inlined --------------------------------------
def test_a_pointwise_intermediates_sized_by_ids_right_of_inline_position():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        b = fd.ops.mul(a, 2.0)
        c = fd.ops.relu(b)
        fd.add_output(c)
    for t in (a, b, c):
        t.merge(0)
        t.split(0, 128)
        t.split(1, 4)  # [ceilDiv(i0*i1, 128), 32, 4]
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(2)  # keeps the serial 4 private
    b.inline_at(-1)  # fully inlined
    k = fd.lower([arr(5, 7)]).kernels[0]
    ta, tb = k.allocation(a.name), k.allocation(b.name)
    assert ta.memory_type == MemoryType.Local
    assert ta.extents == ("4",) and ta.strides == ("1",) and ta.contiguity == (True,)
    assert ta.position == 2
    assert tb.memory_type == MemoryType.Local
    assert tb.ids == () and tb.position == 3
    # Placement: T1 is allocated inside blockIdx.x and threadIdx.x loops, before its loop over 4.
    ir = k.kernel_ir
    i_alloc = find(ir, rf"ALLOCATE {a.name} Local float \[4\]")
    i_loop = find(ir, r"FOR idx\d+ in iS\d+\{4\}")
    assert depth(lines(ir)[i_alloc]) == 2 and i_alloc < i_loop
    assert depth(lines(ir)[find(ir, rf"ALLOCATE {b.name} Local float \[1\]")]) == 3
    # Global input and output: whole logical domain, row-major strides.
    t0 = k.allocation(x.name)
    assert t0.extents == ("i0", "i1") and t0.strides == ("i1", "1")


# b) Shared vs Local with a TIDx id left of the inline position ---------------------------
def _cache_schedule(mem: MemoryType):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(mem)
    for t in (c, y):
        t.split(1, 128)  # [i0, ceilDiv(i1, 128), 128]
        t.reorder({2: 1})  # [i0, 128, ceilDiv(i1, 128)]
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    return fd, c


def test_b_shared_cache_allocates_tidx_id_left_of_inline_position():
    fd, c = _cache_schedule(MemoryType.Shared)
    k = fd.lower([arr(3, 300)]).kernels[0]
    info = k.allocation(c.name)
    assert info.memory_type == MemoryType.Shared
    # TIDx is shared across by Shared memory: allocated; BIDx partitions it: not allocated.
    # Reordered to follow the logical split order: [ceilDiv(i1, 128), 128].
    assert info.extents == ("ceilDiv(i1, 128)", "128")
    assert info.strides == ("128", "1")
    assert any("threadIdx.x" in i for i in info.ids)
    assert info.position == 0
    assert depth(lines(k.kernel_ir)[find(k.kernel_ir, rf"ALLOCATE {c.name} Shared")]) == 0


def test_b_local_cache_does_not_allocate_tidx_id():
    fd, c = _cache_schedule(MemoryType.Local)
    k = fd.lower([arr(3, 300)]).kernels[0]
    info = k.allocation(c.name)
    assert info.memory_type == MemoryType.Local
    assert info.extents == ("ceilDiv(i1, 128)",)
    assert not any("threadIdx" in i for i in info.ids)
    assert info.position == 2


# c) broadcast + inline + Unroll ------------------------------------------------------------
def test_c_inlined_unroll_allocates_the_promoted_unrolled_ids():
    with FusionDefinition() as fd:
        x0 = fd.define_tensor([-1])
        x1 = fd.define_tensor([-1, -1])
        t2 = fd.ops.exp(x0)
        t3 = fd.ops.broadcast_in_dim(t2, shape=[-1, -1], broadcast_dims=[0])
        t4 = fd.ops.add(t3, x1)
        fd.add_output(t4)
    for t in (t3, t4):
        t.merge(0)
        t.split(0, 4, inner_split=False)  # [4, ceilDiv(i0 * i*, 4)]
        t.axis(0).parallelize(ParallelType.Unroll)
    t2.split(0, 4, inner_split=False)  # [4, ceilDiv(i0, 4)] on its own
    t2.inline_at(2)
    t3.inline_at(2)
    k = fd.lower([arr(6), arr(6, 5)]).kernels[0]
    info = k.allocation(t2.name)
    # The allocation is hoisted out of the Unroll loop (position 0), so it needs the
    # unrolled id and the serial id, both with T4's (promoted) extents.
    assert info.position == 0
    assert info.extents == (t4.axis(0).extent, t4.axis(1).extent)
    assert info.extents[1] != t2.axis(1).extent, "promotion must replace T2's own extent"
    assert info.ids[0].startswith("iUR"), "the unrolled id of the consumer is allocated"
    assert info.strides == (t4.axis(1).extent, "1")


# d) non-contiguous Global input ------------------------------------------------------------
def test_d_non_contiguous_global_input_strides():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, False])
        y = fd.ops.neg(x)
        fd.add_output(y)
    k = fd.lower([arr(4, 6)]).kernels[0]
    info = k.allocation(x.name)
    assert info.contiguity == (True, False)
    assert info.strides == ("T0.stride[1] * i1", "T0.stride[1]")


# e) permuted Global output allocation + vectorized cache_before ----------------------------
def test_e_nhwc_output_and_cache_before_follows_its_layout():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1])  # N, C, H, W
        y = fd.ops.relu(x)
        fd.add_output(y)
    y.set_allocation_domain([0, 2, 3, 1], [True, True, True, True])  # NHWC
    c = y.cache_before()
    y.reorder({1: 3})  # [N, H, W, C]
    y.split(3, 4)
    y.axis(4).parallelize(ParallelType.Vectorize)
    c.split(1, 4)  # [N, C/4, 4, H, W]
    c.reorder({2: 4})  # [N, C/4, H, W, 4]
    c.axis(4).parallelize(ParallelType.Vectorize)
    k = fd.lower([arr(2, 8, 3, 5)]).kernels[0]
    out = k.allocation(y.name)
    assert out.extents == ("i0", "i2", "i3", "i1")
    assert out.strides == ("i1 * i3 * i2", "i1 * i3", "i1", "1")
    cache = k.allocation(c.name)
    # Local allocation reordered to NHWC with the vectorized id innermost.
    assert cache.extents == ("i0", "i2", "i3", "ceilDiv(i1, 4)", "4")
    assert cache.ids[-1].startswith("iV")
    assert cache.strides[-1] == "1" and cache.strides[-2] == "4"


def test_allocation_contiguity_may_be_one_flag_for_every_axis():
    # nvFuser takes a bool for "every axis"; anything but a bool or a list is a KilnError.
    def nhwc(contiguity):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1, -1, -1])
            y = fd.ops.relu(x)
            fd.add_output(y)
        y.set_allocation_domain([0, 2, 3, 1], contiguity)
        return fd, y

    fd, y = nhwc(True)
    a = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (out,) = fd.execute([a])
    np.testing.assert_array_equal(np.asarray(out), np.maximum(a, 0))
    assert out.strides == (4 * 60, 4, 4 * 15, 4 * 3)  # NHWC storage, NCHW view
    with pytest.raises(KilnError, match="contiguity must be a bool or a list"):
        nhwc(None)


# f) transpose staged through Shared --------------------------------------------------------
def test_f_transposed_shared_staging_buffer_is_32_by_32():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        t = fd.ops.permute(x, [1, 0])
        fd.add_output(t)
    s = t.cache_before()  # s = permute(x); t = set(s)
    s.set_memory_type(MemoryType.Shared)
    # Consumer (Global store): [J/32, I/32, 32j*32i/4 (TIDx), 4 (Vectorize)]
    t.split(0, 32)
    t.split(2, 32)  # [J/32, 32j, I/32, 32i]
    t.reorder({1: 2})  # [J/32, I/32, 32j, 32i]
    t.merge(2, 3)  # merge(32b, 32a)
    t.split(2, 4)
    t.axis(0).parallelize(ParallelType.BIDy)
    t.axis(1).parallelize(ParallelType.BIDx)
    t.axis(2).parallelize(ParallelType.TIDx)
    t.axis(3).parallelize(ParallelType.Vectorize)
    # Producer (Shared): reads x along i: [J/32, I/32, 32i*32j/4 (TIDx), 4]
    s.split(0, 32)
    s.split(2, 32)
    s.reorder({1: 3, 3: 2})  # [J/32, I/32, 32i, 32j]
    s.merge(2, 3)  # merge(32a, 32b)
    s.split(2, 4)
    s.axis(0).parallelize(ParallelType.BIDy)
    s.axis(1).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.TIDx)
    s.inline_at(2)
    k = fd.lower([arr(64, 96)]).kernels[0]
    info = k.allocation(s.name)
    assert info.memory_type == MemoryType.Shared
    assert info.extents == ("32", "32"), f"expected [32b, 32a], got {info}"
    # Rows padded by one bank (33 floats) so row writes and column reads are conflict-free.
    assert info.strides == ("33", "1")
    assert re.search(rf"ALLOCATE {s.name} Shared float \[32, 33\]", k.kernel_ir)
    # [32b, 32a]: the outer allocated id is the merge's inner input (the consumer-side j).
    merge_line = [ln for ln in s.transforms().splitlines() if "Merge" in ln][0]
    outer, inner = re.findall(r"(\w+\d+\{32\})", merge_line)[:2]
    assert info.ids == (inner, outer)


# g) index_select with an inlined producer -------------------------------------------------
def test_g_indexed_producer_allocates_the_whole_indexed_id():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])  # [n, d]
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        t1 = fd.ops.exp(x)
        t2 = fd.ops.index_select(t1, idx, 0)  # [k, d]
        fd.add_output(t2)
    t1.reorder({0: 1})  # [d, n]
    t1.split(1, 4)  # [d, n/4, 4]
    t2.reorder({0: 1})  # [d, k]
    t2.axis(0).parallelize(ParallelType.BIDx)
    t1.inline_at(1)
    k = fd.lower([arr(10, 3), np.zeros(4, np.int64)]).kernels[0]
    info = k.allocation(t1.name)
    # Without the patch it would be [ceilDiv(i0, 4), 4]; the whole indexed id n is allocated.
    assert info.extents == ("i0",)
    assert info.ids == (repr(t1.logical_domain[0]),)
    assert info.position == 1


# h) reductions ------------------------------------------------------------------------------
def test_h_block_row_reduction_init_placement():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    s.split(1, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.TIDx)
    acc = s.cache_before()  # Local accumulator with s's schedule
    s.axis(0).parallelize(ParallelType.BIDx)
    acc.inline_at(1)
    k = fd.lower([arr(4, 1000)]).kernels[0]
    info = k.allocation(acc.name)
    assert info.memory_type == MemoryType.Local and info.position == 1 and info.ids == ()
    ir = k.kernel_ir
    i_alloc = find(ir, rf"ALLOCATE {acc.name} Local float \[1\]")
    # The block reduction is hoisted out of the serial loop and stores every element, so the
    # identity lives in a register (the init of the tensor itself is dead and left out).
    i_init = find(ir, rf"acc\d+ = identity  // register of {acc.name}")
    i_red = find(ir, rf"acc\d+ \+= {acc.name} = reduce_sum")
    i_done = find(ir, rf"{acc.name} = parallel reduction of acc\d+")
    assert i_alloc < i_init < i_red < i_done
    assert depth(lines(ir)[i_init]) == 1, "init sits in the blockIdx.x loop, outside the reduction loops"
    assert depth(lines(ir)[i_red]) == 3
    assert depth(lines(ir)[i_done]) == 1
    assert not re.search(rf"{acc.name} = 0\.0  // init", ir), ir
    assert k.global_allocations == []


def _column_sum(serial: bool):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(s)
    s.split(0, 4)  # [r ceilDiv(i0, 4), r 4, i1]
    s.split(2, 128)  # [.., ceilDiv(i1, 128), 128]
    s.axis(0).parallelize(ParallelType.BIDx)  # reduce across blocks
    s.axis(1).parallelize(ParallelType.TIDy)  # and across threads: no serial step around it
    s.axis(2).parallelize(ParallelType.BIDy)
    s.axis(3).parallelize(ParallelType.TIDx)
    if serial:
        s.set_serial_grid_reduction()
    return fd, s


def test_h_grid_column_reduction_buffers():
    fd, s = _column_sum(serial=False)
    k = fd.lower([arr(64, 300)]).kernels[0]
    work, sync = k.global_allocations
    assert work.name == f"{s.name}_work" and work.dtype == DataType.Float
    # [segments (BIDy), reducing blocks (BIDx), threads per block]: the runtime's layout.
    assert work.shape == ("ceilDiv(i1, 128)", "ceilDiv(i0, 4)", "128")
    assert (work.zero_init, work.resets_to_zero) == (False, False)
    assert sync.name == f"{s.name}_sync" and sync.dtype == DataType.Int
    assert sync.shape == ("ceilDiv(i1, 128)",)
    # The last block to arrive resets it: zeroed once, reused by every launch.
    assert (sync.zero_init, sync.resets_to_zero) == (True, True)
    ir = k.kernel_ir
    sync_alloc = rf"ALLOCATE {s.name}_sync Global int64 \[ceilDiv\(i1, 128\)\] zero_init resets_to_zero$"
    assert depth(lines(ir)[find(ir, sync_alloc)]) == 0
    # The output is initialised by an init nest over its non-reduction ids.
    i_init = find(ir, rf"{s.name} = 0\.0  // init")
    assert i_init < find(ir, rf"{s.name} = reduce_sum")


def test_h_serial_grid_reduction_semaphore_resets_to_zero():
    fd, s = _column_sum(serial=True)
    k = fd.lower([arr(64, 300)]).kernels[0]
    work, sync = k.global_allocations
    # One running result per (segment, thread): [BIDy, TIDx].
    assert work.shape == ("ceilDiv(i1, 128)", "128")
    assert (work.zero_init, work.resets_to_zero) == (False, False)
    assert (sync.zero_init, sync.resets_to_zero) == (True, True)
    assert "resets_to_zero" in k.kernel_ir


# i) errors ----------------------------------------------------------------------------------
def test_i_non_contiguous_shared_allocation_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    c.set_allocation_domain([1, 0], [True, False])
    with pytest.raises(KilnError, match=rf"{c.name}.*non-contiguous") as e:
        fd.lower([arr(3, 4)])
    assert re.search(r"iS\d+\{i\d\}", str(e.value)), "the message names the id"


def test_i_non_contiguous_local_allocation_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    y.set_allocation_domain([0, 1], [False, True])
    with pytest.raises(KilnError, match=rf"{y.name} is in Local memory.*non-contiguous"):
        fd.lower([arr(3, 4)])


def test_i_set_allocation_domain_dropping_an_inlined_id_is_rejected():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    c.set_allocation_domain([1, 0], [True, True])
    c.split(0, 2)  # the set domain now misses the new outer id
    y.split(0, 2)
    c.inline_at(1)
    with pytest.raises(KilnError, match=rf"{c.name}: the set allocation domain drops inlined id\(s\) iS\d+"):
        fd.lower([arr(4, 4)])


def test_grid_reduction_inside_a_serial_reduction_loop_is_hoisted():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(s)
    s.split(0, 4)
    s.axis(0).parallelize(ParallelType.BIDx)  # axis 1 (r4) stays a serial loop
    # Axis 2 is a serial output loop: the grid reduction would repeat inside it.
    repeat = r"T1: its reduction across blocks would run once per iteration of the serial loop iS\d+\{i1\}"
    with pytest.raises(KilnError, match=repeat):
        fd.lower([arr(8, 3)])
    s.axis(2).parallelize(ParallelType.TIDx)
    k = fd.lower([arr(8, 3)]).kernels[0]
    src = k.cuda_source
    body = src[src.index("kiln_kernel("):]
    # One register accumulates through the serial loop; one grid reduction follows it.
    assert body.count("kiln::gridReduce<") == 1
    assert body.index("float kiln_acc") < body.index("for (kiln_index_t") < body.index("kiln::gridReduce<")


def test_i_id_that_cannot_be_promoted_is_rejected():
    with FusionDefinition() as fd:
        v = fd.define_tensor([-1])
        x0 = fd.define_tensor([-1, -1])
        x1 = fd.define_tensor([-1, -1])
        b = fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[1])
        y0 = fd.ops.add(b, x0)
        y1 = fd.ops.mul(b, x1)
        fd.add_output(y0)
        fd.add_output(y1)
    b.inline_at(1)
    with pytest.raises(KilnError, match=rf"cannot promote loop axis 0 of {b.name}.*{y0.name}.*{y1.name}|"
                                        rf"cannot promote loop axis 0 of {b.name}.*{y1.name}.*{y0.name}"):
        fd.lower([arr(3), arr(2, 3), arr(5, 3)])


def test_lower_validates_inputs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.exp(x))
    with pytest.raises(KilnError, match="takes 1 inputs"):
        fd.lower([])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): dtype Double"):
        fd.lower([np.zeros((2, 4))])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 1 has size 5"):
        fd.lower([arr(2, 5)])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): rank 1"):
        fd.lower([arr(2)])


def test_kiln_dump_prints_kernel_ir_and_allocations(monkeypatch, capfd):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.exp(x))
    monkeypatch.setenv("KILN_DUMP", "kernel_ir,allocations")
    fd.lower([arr(3)])
    out = capfd.readouterr().out
    # fd.lower shows what execute runs: the automatic pointwise schedule.
    assert "FOR blockIdx.x in" in out and "T0 Global ids=[iS0{i0}] strides=[1]" in out
