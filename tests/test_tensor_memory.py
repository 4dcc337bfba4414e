"""Tensor memory (``MemoryType.Tensor``, Blackwell's tcgen05): the region the allocation
pass lays out (lane and column offsets, a power of two of columns), the alloc / relinquish /
dealloc placement, values through the interpreter against NumPy, the sm_100a compile with
NVRTC, the KilnError on GPUs without Tensor memory, and the schedules tcgen05 cannot run."""

from __future__ import annotations

import re
from typing import List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType
from kiln.runtime import executor
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

RNG = np.random.default_rng(11)


def chain(k: int, tmem: Tuple[str, ...] = ("e", "m"), threads: int = 32,
          rows: int = 4) -> Tuple[FusionDefinition, np.ndarray]:
    """``y = 0.5 * exp(x) + x`` over [rows, threads * k]: a block per row, ``threads`` threads of
    ``k`` cells each; ``exp(x)`` (e) and its half (m) computed per thread at position 2, the
    ones named in ``tmem`` kept in Tensor memory."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[rows, threads * k], dtype=DataType.Float)
        e = fd.ops.exp(x)
        m = fd.ops.mul(e, 0.5)
        y = fd.ops.add(m, x)
        fd.add_output(y)
    named = {"e": e, "m": m}
    for n in tmem:
        named[n].set_memory_type(MemoryType.Tensor)
    for t in (e, m, y):
        t.split(1, k)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    e.inline_at(2)
    m.inline_at(2)
    return fd, RNG.standard_normal((rows, threads * k)).astype(np.float32)


def ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * np.exp(x) + x


def ir_lines(fd: FusionDefinition, x: np.ndarray) -> List[str]:
    (k,) = fd.lower([x]).kernels
    return [line.strip() for line in k.kernel_ir.splitlines()]


@pytest.mark.parametrize("k, columns", [(1, 32), (8, 32), (20, 64), (200, 512)])
def test_region_offsets_and_values(k: int, columns: int) -> None:
    """Two tensors of k cells per thread: columns 0..k and k..2k of lane offset 0, in a region
    of the next power of two of at least 32 columns; values through the interpreter."""
    fd, x = chain(k)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, ref(x), rtol=1e-6, atol=1e-6)
    lines = ir_lines(fd, x)
    assert f"ALLOCATE T1 Tensor float [{k}] at lane offset 0 columns 0..{k}" in lines, lines
    assert f"ALLOCATE T2 Tensor float [{k}] at lane offset 0 columns {k}..{2 * k}" in lines, lines
    assert f"TMEM_ALLOC {columns} columns -> smem slot  // first warp" in lines
    assert f"TMEM_DEALLOC {columns} columns  // first warp" in lines


def test_alloc_first_then_relinquish_and_barrier_dealloc_after_the_last_access() -> None:
    """The seed's placement: alloc and relinquish on the first warp at the kernel's top, a
    barrier before anyone reads the address; a barrier and the dealloc after the statement
    holding the last access (inside the block loop, which every thread runs once)."""
    fd, x = chain(4)
    lines = ir_lines(fd, x)
    assert lines[:3] == ["TMEM_ALLOC 32 columns -> smem slot  // first warp",
                         "TMEM_RELINQUISH_ALLOC_PERMIT  // first warp", "__syncthreads()  // RAW"], lines
    assert lines[-2:] == ["__syncthreads()  // WAR", "TMEM_DEALLOC 32 columns  // first warp"], lines
    uses = [i for i, line in enumerate(lines) if re.search(r"\bT[12]\b", line) and "ALLOCATE" not in line]
    last_use = max(uses)
    assert last_use < len(lines) - 2
    assert sum("TMEM_" in line for line in lines) == 3


def test_one_tensor_and_a_local_one() -> None:
    """Only ``exp(x)`` in Tensor memory: one tensor in the region, the other stays Local."""
    fd, x = chain(8, tmem=("e",))
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, ref(x), rtol=1e-6, atol=1e-6)
    lines = ir_lines(fd, x)
    assert "ALLOCATE T1 Tensor float [8] at lane offset 0 columns 0..8" in lines
    assert "ALLOCATE T2 Local float [8]" in lines


def test_memory_type_reads_back_and_dumps_tag_it() -> None:
    """``memory_type`` is Tensor; setting Local again takes it out of Tensor memory."""
    with FusionDefinition() as fd2:
        a = fd2.define_tensor(shape=[4, 64], dtype=DataType.Float)
        b = fd2.ops.exp(a)
        fd2.add_output(fd2.ops.mul(b, 2.0))
    b.set_memory_type(MemoryType.Tensor)
    assert b.memory_type == MemoryType.Tensor
    b.set_memory_type(MemoryType.Local)
    assert b.memory_type == MemoryType.Local


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC wheels not installed")
def test_kernel_compiles_for_sm_100a_with_the_tcgen05_ops() -> None:
    """The CUDA holds the tcgen05 calls and compiles for sm_100a with NVRTC (no GPU needed)."""
    fd, x = chain(8)
    (k,) = fd.lower([x]).kernels
    src = k.cuda_source
    assert "kiln::tmemAlloc<32>(&kiln_tmem_slot);" in src
    assert "kiln::tmemRelinquish();" in src
    assert "kiln::tmemDealloc<32>(kiln_tmem_slot);" in src
    assert "kiln::TmemTensor<float> T1{kiln::tmemAddress(kiln_tmem_slot, 0, 0)}" in src
    assert "kiln::TmemTensor<float> T2{kiln::tmemAddress(kiln_tmem_slot, 0, 8)}" in src
    res = compile_cubin(src, "tmem.cu", arch="sm_100a")
    assert res.cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC wheels not installed")
def test_hopper_target_is_a_kiln_error_before_nvrtc() -> None:
    """sm_90 has no Tensor memory: a KilnError before any compile; sm_100 compiles as sm_100a."""
    fd, x = chain(2)
    (k,) = fd.lower([x]).kernels
    before = executor.compile_count()
    with pytest.raises(KilnError, match=r"Tensor memory \(MemoryType.Tensor\), which needs a Blackwell GPU"):
        executor.cubin_for(k.cuda_source, "sm_90")
    assert executor.compile_count() == before
    assert executor.tensor_memory_arch(k.cuda_source, "sm_100") == "sm_100a"
    # (Without Tensor memory the arch is left alone.)
    assert executor.tensor_memory_arch("__global__ void k() {}", "sm_90") == "sm_90"


def test_only_32_bit_cells() -> None:
    """A half tensor cannot go to Tensor memory: a KilnError naming it and its dtype."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[4, 64], dtype=DataType.Half)
        b = fd.ops.neg(a)
        fd.add_output(fd.ops.mul(b, 2.0))
    with pytest.raises(KilnError, match=r"set_memory_type T1: Tensor memory holds 32-bit cells; T1 is Half"):
        b.set_memory_type(MemoryType.Tensor)


def test_inputs_and_outputs_stay_global() -> None:
    """Only intermediates go to Tensor memory (inputs and outputs are Global)."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[4, 64], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(a, 2.0))
    with pytest.raises(KilnError, match=r"fusion input and must stay in Global memory"):
        a.set_memory_type(MemoryType.Tensor)


def test_more_than_128_threads_is_a_kiln_error() -> None:
    """One lane per thread: a block of 256 threads is refused, naming the tensors."""
    fd, x = chain(2, threads=256)
    with pytest.raises(KilnError, match=r"T1, T2 in Tensor memory: a thread owns one of its 128 lanes, "
                                        r"but the schedule launches 256 threads per block"):
        fd.execute([x])


def test_more_than_512_columns_is_a_kiln_error() -> None:
    """Two tensors of 300 cells per thread: 600 columns, above a region's 512."""
    fd, x = chain(300, rows=1)
    with pytest.raises(KilnError, match=r"T1, T2 in Tensor memory need 600 columns per lane; a region holds "
                                        r"at most 512"):
        fd.execute([x])


def test_reduction_output_is_a_kiln_error() -> None:
    """Reductions accumulate in registers: their output cannot be in Tensor memory."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[64, 128], dtype=DataType.Float)
        s = fd.ops.sum(a, [1])
        y = fd.ops.mul(s, 2.0)
        fd.add_output(y)
    s.set_memory_type(MemoryType.Tensor)
    y.axis(0).parallelize(ParallelType.BIDx)
    with pytest.raises(KilnError, match=r"T1 is in Tensor memory but is a reduction's output"):
        fd.execute([np.ones((64, 128), np.float32)])


def test_symbolic_block_size_is_a_kiln_error() -> None:
    """Sizes known only at run time: the block size is not a constant of at most 128 threads."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        e = fd.ops.exp(a)
        y = fd.ops.mul(e, 2.0)
        fd.add_output(y)
    e.set_memory_type(MemoryType.Tensor)
    y.split(1, 4)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    with pytest.raises(KilnError, match=r"T1 in Tensor memory: a thread owns one of its 128 lanes, so the "
                                        r"block size must be a constant of at most 128 threads"):
        fd.execute([np.ones((4, 64), np.float32)])


@pytest.mark.gpu
def test_execute_on_a_hopper_gpu_is_a_kiln_error() -> None:
    """On a GPU without Tensor memory (the H200, sm_90) the call raises a KilnError before any
    launch; the interpreter runs the same fusion."""
    cp = cupy_or_skip()
    if int(cp.cuda.Device().compute_capability) >= 100:
        pytest.skip("this GPU has Tensor memory")
    fd, x = chain(4)
    with pytest.raises(KilnError, match=r"needs a Blackwell GPU"):
        fd.execute([cp.asarray(x)])
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, ref(x), rtol=1e-6, atol=1e-6)


def test_access_under_a_thread_condition_is_a_kiln_error() -> None:
    """130 columns in threads of 4 cells: the last thread's tile is partial, so its accesses
    run under a condition on the thread index, which warp-wide tcgen05 loads and stores
    cannot take."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[4, 130], dtype=DataType.Float)
        e = fd.ops.exp(a)
        y = fd.ops.mul(e, 2.0)
        fd.add_output(y)
    e.set_memory_type(MemoryType.Tensor)
    for t in (e, y):
        t.split(1, 4)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    e.inline_at(2)
    with pytest.raises(KilnError, match=r"T1 is in Tensor memory, whose loads and stores every thread of "
                                        r"a warp runs together, but its access here runs only where "
                                        r".*threadIdx.x"):
        fd.execute([np.ones((4, 130), np.float32)])
