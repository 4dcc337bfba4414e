"""CUDA codegen: every scenario generates readable CUDA that NVRTC compiles for sm_90
without spills (the conftest fixture compiles each lowered kernel), with the documented
parameter order, launch expressions and no redundant syncs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, List, Tuple

import numpy as np
import pytest
import scenarios
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError, ParallelType
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available


@pytest.mark.parametrize("build", scenarios.ALL, ids=lambda b: b.__name__)
def test_scenario_generates_and_compiles(build):
    sc = build()
    arrays = sc.make_inputs(np)
    k = sc.fd.lower(arrays).kernels[0]
    src = k.cuda_source
    assert 'extern "C" __global__ void kiln_kernel(' in src
    if nvrtc_available():
        res = compile_cubin(src, k.kernel_name, arch="sm_90")
        assert res.spills.get("kiln_kernel", 0) == 0
        assert 0 < res.registers["kiln_kernel"] <= 64


def test_parameter_order_inputs_outputs_buffers_then_scalars():
    sc = scenarios.h_grid_column_sum()
    k = sc.fd.lower(sc.make_inputs(np)).kernels[0]
    kinds = [p[1] for p in k.params]
    assert kinds[:4] == ["input", "output", "buffer", "buffer"]
    assert set(kinds[4:]) <= {"extent", "stride", "scalar"}
    names = [p[0] for p in k.params]
    assert names[2:4] == ["T1_work", "T1_sync"]
    sig = re.search(r"kiln_kernel\((.*?)\)", k.cuda_source).group(1)
    head = "const float* __restrict__ T0, float* __restrict__ T1, float* T1_work, int64_t* T1_sync"
    assert sig.startswith(head)
    assert "kiln::gridReduce<true, false, false, false, true, false>" in k.cuda_source


def test_launch_plan_is_evaluated_in_rust():
    sc = scenarios.h_grid_column_sum()
    k = sc.fd.lower(sc.make_inputs(np)).kernels[0]
    plan = k._core.plan([[61, 300]], [[300, 1]], [])
    assert [(o.sizes, o.layout, o.dtype) for o in plan.outputs] == [([300], [0], "Float")]
    assert plan.grid == (16, 3, 1) and plan.block == (128, 4, 1)
    assert plan.smem_bytes == 128 * 4 * 8  # block-reduction workspace: one 8-byte slot per thread
    assert [(b.name, b.elements) for b in plan.buffers] == [("T1_work", 3 * 16 * 128), ("T1_sync", 3)]
    assert plan.scalar_args == [61, 300]
    assert plan.index32, "small sizes take the 32-bit index variant"
    assert k._core.plan([[40_000_000, 300]], [[300, 1]], []).index32 is False
    # The reduced block axis launches at least one block: a sum over no rows is zeros.
    assert k.launch == {"grid": ("max(ceilDiv(i0, 4), 1)", "ceilDiv(i1, 128)", "1"),
                        "block": ("128", "4", "1"), "smem_bytes": "4096"}
    assert k._core.plan([[0, 300]], [[300, 1]], []).grid == (1, 3, 1)


def test_mismatched_sizes_are_rejected_before_launch():
    from kiln import DataType, FusionDefinition

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        y = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.add(x, y))
    want = r"input 1 \(T1\): axis 1 has size 4 but input 0 \(T0\) axis 1 has size 3"
    with pytest.raises(KilnError, match=want):
        fd.lower([np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)])
    k = fd.lower([np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)]).kernels[0]
    with pytest.raises(KilnError, match=want):
        k._core.plan([[2, 3], [2, 4]], [[3, 1], [4, 1]], [])


def test_declared_contiguity_is_checked():
    sc = scenarios.h_block_row_sum()
    k = sc.fd.lower(sc.make_inputs(np)).kernels[0]
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 1 has stride 2 but must be contiguous"):
        k._core.plan([[7, 1000]], [[2000, 2]], [])


def test_transpose_has_exactly_the_needed_syncs():
    sc = scenarios.f_transpose()
    k = sc.fd.lower(sc.make_inputs(np)).kernels[0]
    # One RAW sync between the Shared write and the transposed read; no WAR sync since the
    # buffer is written once per block.
    assert k.kernel_ir.count("__syncthreads()") == 1
    assert k.cuda_source.count("__syncthreads();  // RAW") == 1


def test_shared_buffer_reused_in_a_loop_gets_a_war_sync():
    from kiln import FusionDefinition, MemoryType, ParallelType

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 128)  # [i0, ceilDiv(i1, 128), 128]
        t.axis(0).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.TIDx)
    # y reads the tile with 32 threads, 4 elements each: threads read what others wrote
    y.split(2, 32)
    y.axis(3).parallelize(ParallelType.TIDx)
    c.inline_at(2)  # shares blockIdx.x and the serial loop; threadIdx.x is not shared
    k = fd.lower([np.zeros((4, 300), np.float32)]).kernels[0]
    ir = k.kernel_ir
    assert ir.count("__syncthreads()  // RAW") == 1
    assert ir.count("__syncthreads()  // WAR") == 1


def test_unswitch_hoists_bounds_out_of_the_tile():
    from kiln import FusionDefinition
    from kiln.execute import _auto_lowered

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x))
    src = _auto_lowered(fd, [np.zeros((4096, 4096), np.float32)]).kernels[0].cuda_source
    body = src[src.index("kiln_kernel("):]
    fast, slow = body.split("} else {", 1)[0], body.split("} else {", 1)[1]
    assert "unswitched: bounds hold for the whole tile" in fast
    tile = fast.split("unswitched: bounds hold for the whole tile", 1)[1]
    # Inside the fast path no per-element bound on the flattened index remains...
    assert "< (i0 * i1)" not in tile
    # ...while the fallback path keeps them.
    assert "< (i0 * i1)" in slow


# -- what the automatic schedules' kernels must look like to run at memory speed -------------
def _auto_source(fd, arrays):
    from kiln.execute import _auto_lowered

    (k,) = _auto_lowered(fd, arrays).kernels
    return k.cuda_source


def _unscheduled(build):
    from kiln import FusionDefinition

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(build(fd, x))
    return fd


def test_column_sum_checks_its_column_bound_once_outside_the_row_loop():
    fd = _unscheduled(lambda fd, x: fd.ops.sum(x, dims=[0]))
    src = _auto_source(fd, [np.zeros((4096, 1000), np.float32)])
    around = r"if \(([^\n]*)\) \{  // bounds no inner loop changes\n(\s*#pragma unroll\n)?\s*for \("
    hoisted = re.search(around, src)
    assert hoisted and "< i1" in hoisted.group(1), src
    # Inside the loops the accumulation runs unpredicated, so unrolled loads issue together.
    assert re.search(r"if \(true\) \{ kiln_acc\d+ = kiln::Sum\(\)", src), src


def test_reduced_extents_are_compiled_in_and_bounds_fold_away():
    from kiln import FusionDefinition

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))
    src = _auto_source(fd, [np.zeros((300, 4096), np.float32)])
    sig = re.search(r"kiln_kernel\((.*?)\)", src).group(1)
    assert "kiln_index_t i0" in sig and "i1" not in sig, sig  # rows symbolic, row length constant
    assert "4096" in src
    assert not re.search(r"if \([^)]*<", src.split("kiln_kernel(")[1].split("blockAllReduce")[0]), \
        "no bounds check before the first reduction of a 4096-wide row"
    # Another row length is another kernel; another row count is the same one.
    from kiln.execute import _auto_lowered

    a = _auto_lowered(fd, [np.zeros((300, 4096), np.float32)])
    assert _auto_lowered(fd, [np.zeros((7, 4096), np.float32)]) is a
    assert _auto_lowered(fd, [np.zeros((300, 2048), np.float32)]) is not a


def test_vector_copies_of_local_arrays_need_no_address_check():
    fd = _unscheduled(lambda fd, x: fd.ops.mul(fd.ops.relu(x), 2.0))
    # An input at an address 4 bytes past a 16-byte boundary: Global sides are checked.
    odd = np.zeros(64 * 4096 + 1, np.float32)[1:].reshape(64, 4096)
    assert odd.ctypes.data % 16 != 0
    src = _auto_source(fd, [odd])
    assert "loadVec<float, 4>" in src and "storeVec<float, 4>" in src
    checks = re.findall(r"reinterpret_cast<unsigned long long>\(&(T\d+)\[", src)
    params = set(re.findall(r"(T\d+),", re.search(r"kiln_kernel\((.*?)\)", src).group(1) + ","))
    assert checks and set(checks) <= params, (checks, params)  # only Global (parameter) pointers
    assert "__align__(16) float" in src


def test_aligned_inputs_get_vector_accesses_without_address_checks():
    # Aligned bases and offsets that are multiples of the vector width: no check, no fallback.
    fd = _unscheduled(lambda fd, x: fd.ops.mul(fd.ops.relu(x), 2.0))
    aligned = np.zeros((64, 4096), np.float32)
    assert aligned.ctypes.data % 16 == 0
    src = _auto_source(fd, [aligned])
    assert "loadVec<float, 4>" in src and "reinterpret_cast<unsigned long long>" not in src, src
    # A row length that is not a multiple of 4 (2-D schedule, bias per column): the row offset
    # is checked as a number, not as an address.
    with FusionDefinition() as fd2:
        x = fd2.define_tensor([-1, -1])
        b = fd2.define_tensor([-1])
        fd2.add_output(fd2.ops.add(x, fd2.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])))
    src = _auto_source(fd2, [np.zeros((1000, 1001), np.float32), np.zeros(1001, np.float32)])
    assert "reinterpret_cast<unsigned long long>" not in src and "kiln_ib % 4 == 0" in src, src
    # The lowering remembers the assumption; fd.execute keys its plans on it.
    from kiln.execute import _auto_lowered

    assert _auto_lowered(fd, [aligned]).aligned_bases
    odd = np.zeros(64 * 4096 + 1, np.float32)[1:].reshape(64, 4096)
    assert not _auto_lowered(fd, [odd]).aligned_bases


def test_vectors_in_range_whole_or_not_at_all_have_no_element_loop():
    """A row whose length the vector width divides, with aligned bases: each vector is in
    range whole or not at all, so the copy is ``if (first) wide`` with no element-by-element
    fallback (which was half a partial tile's code); a copy checked at run time keeps it."""
    def row_sum(fd: FusionDefinition, x: Any) -> Any:
        return fd.ops.sum(fd.ops.mul(x, x), dims=[1])

    fd = _unscheduled(row_sum)
    a = np.random.default_rng(0).standard_normal((8, 32000)).astype(np.float32)
    src = _auto_source(fd, [a])
    body = src[src.index("kiln_kernel("):]
    assert "loadVec" in body and "kiln::Array<float, 4> kiln_vec;" in body, body
    assert not re.search(r"kiln_vec, &T0\[kiln_ib\]\);\n.*\n\s*\} else \{", body), body
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, (a.astype(np.float64) ** 2).sum(1), rtol=1e-5)
    # Rows of 1001 columns with a bias per column: the row offset is checked at run time, so
    # a vector that fails the check copies element by element.
    with FusionDefinition() as fd2:
        x = fd2.define_tensor([-1, -1])
        b = fd2.define_tensor([-1])
        fd2.add_output(fd2.ops.add(x, fd2.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])))
    body = _auto_source(fd2, [np.zeros((1000, 1001), np.float32), np.zeros(1001, np.float32)])
    element_loop = r"\} else \{\n\s*#pragma unroll\n\s*for \(kiln_index_t"
    assert "kiln_ib % 4 == 0" in body and re.search(element_loop, body), body


def _guarded_remaps() -> List[Tuple[str, Any, Any]]:
    """Cat and pad along the rows of rows that vectors cover whole: the copy's guard (which
    input, or the pad) fails on whole vectors, where the element loop writes the other value."""
    def cat_rows(fd: FusionDefinition, x: Any) -> Any:
        return fd.ops.cat([x, x, x], 0)

    def pad_rows(fd: FusionDefinition, x: Any) -> Any:
        return fd.ops.pad(x, [0, 0, 2, 1], 0.5)  # torch order: last axis first

    def cat_cols(fd: FusionDefinition, x: Any) -> Any:
        return fd.ops.cat([x, fd.ops.mul(x, 2.0)], 1)

    return [("cat rows", cat_rows, lambda a: np.concatenate([a, a, a], 0)),
            ("pad rows", pad_rows, lambda a: np.pad(a, [(2, 1), (0, 0)], constant_values=0.5)),
            ("cat cols", cat_cols, lambda a: np.concatenate([a, 2.0 * a], 1))]


@pytest.mark.parametrize("shape", [(1, 256), (3, 1024)])
@pytest.mark.parametrize("case", _guarded_remaps(), ids=lambda c: c[0])
def test_guarded_remaps_keep_their_element_loop(case: Tuple[str, Any, Any], shape: Tuple[int, int]) -> None:
    _, build, ref = case
    a = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    (got,) = _unscheduled(build).execute([a])
    np.testing.assert_array_equal(got, ref(a).astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("case", _guarded_remaps(), ids=lambda c: c[0])
def test_guarded_remaps_on_gpu(case: Tuple[str, Any, Any]) -> None:
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    _, build, ref = case
    a = np.random.default_rng(3).standard_normal((5, 4096)).astype(np.float32)
    (got,) = _unscheduled(build).execute([cp.asarray(a)])
    np.testing.assert_array_equal(cp.asnumpy(got), ref(a).astype(np.float32))


def test_padded_transpose_tile_keeps_16_byte_global_accesses():
    fd = _unscheduled(lambda fd, x: fd.ops.permute(x, [1, 0]))
    src = _auto_source(fd, [np.zeros((256, 512), np.float32)])
    # Reads of x: one 16-byte load into registers; writes of the output: one 16-byte store fed
    # element by element from the padded Shared tile (rows of 65 floats are not 16-byte aligned).
    assert re.search(r"kiln::loadVecEvictLast<float, 4>\(kiln_vec, &T0\[kiln_ib\]\)", src), src
    gather = r"kiln_vec\[kiln_j\] = T\d+\[kiln_ib \+ kiln_j\];\n\s*kiln::storeVec<float, 4>\(&T1\["
    assert re.search(gather, src), src


def test_a_hoisted_reduction_stores_its_final_result_and_accumulates_partial_ones():
    # Complete after its loop (auto row sum): a plain store, no dependent load of the output.
    fd = _unscheduled(lambda fd, x: fd.ops.sum(x, dims=[1]))
    src = _auto_source(fd, [np.zeros((64, 4096), np.float32)])
    assert re.search(r"\{ T1\[[^\]]*\] = kiln_r\d+; \}", src), src
    assert "Sum()(T1[" not in src, src
    # A serial reduction loop outside the row loop: each step's result is partial.
    sc = scenarios.h_row_sum_partial_hoist()
    src = sc.fd.lower(sc.make_inputs(np)).kernels[0].cuda_source
    assert re.search(r"T1\[[^\]]*\] = kiln::Sum\(\)\(T1\[[^\]]*\], kiln_r\d+\)", src), src


def test_complete_hoisted_reduction_skips_its_dead_init_and_streams_its_input():
    # Auto row sum: the hoisted block reduction stores every output element, so T1 has no
    # init store (the kernel IR leaves it out, and the interpreter runs that IR).
    fd = _unscheduled(lambda fd, x: fd.ops.sum(x, dims=[1]))
    x = np.zeros((64, 4096), np.float32)
    from kiln.execute import _auto_lowered

    (k,) = _auto_lowered(fd, [x]).kernels
    assert not re.search(r"T1 = 0\.0  // init", k.kernel_ir), k.kernel_ir
    assert re.search(r"T1 = parallel reduction of acc\d+", k.kernel_ir), k.kernel_ir
    assert not re.search(r"T1\[[^\]]*\] = kiln::cast<float>\(0\.0\)", k.cuda_source), k.cuda_source
    # The input is read once: its vector loads skip L1.
    streaming = r"kiln::loadVecStreaming<float, 4>\(kiln_vec, &T0\[kiln_ib\]\)"
    assert re.search(streaming, k.cuda_source), k.cuda_source
    # A partial hoist accumulates into the output: its init stays.
    sc = scenarios.h_row_sum_partial_hoist()
    src = sc.fd.lower(sc.make_inputs(np)).kernels[0].cuda_source
    assert re.search(r"T1\[[^\]]*\] = kiln::cast<float>\(0\.0\)", src), src
    assert "kiln::loadVecStreaming<" not in src, src


def _times_two() -> Tuple[FusionDefinition, Any, Any]:
    """``y = x * 2`` on a 2-D input, unscheduled: the fusion, x and y."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    return fd, x, y


def _copy_schedule(fd: FusionDefinition, c: Any, y: Any, width: int = 4) -> None:
    for t in (c, y):
        t.split(1, width)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.axis(2).parallelize(ParallelType.Vectorize)
    c.inline_at(2)


def test_streaming_load_is_a_schedule_of_input_copies():
    fd, x, y = _times_two()
    c = x.cache_after()
    c.set_streaming_load()
    _copy_schedule(fd, c, y)
    a = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    k = fd.lower([a]).kernels[0]
    assert "kiln::loadVecStreaming<float, 4>(kiln_vec, &T0[kiln_ib])" in k.cuda_source, k.cuda_source
    assert re.search(r"T\d+_l_float\[[^\]]*\] ca_pos\(2\) streaming", str(fd)), str(fd)
    np.testing.assert_array_equal(fd.execute([a])[0], a.astype(np.float64) * 2.0)
    # Only a tensor that reads a fusion input directly reads memory that nothing else reads again.
    not_direct = r"set_streaming_load T\d+: T\d+ does not read a fusion input directly"
    with pytest.raises(KilnError, match=not_direct):
        y.set_streaming_load()


def _hinted_gather_times_three(streaming: bool) -> FusionDefinition:
    """3 * x[i] by hand, the gathered rows loaded with evict_last (and streaming) hints."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=DataType.Int)
        g = fd.ops.index_select(x, i, 0)
        y = fd.ops.mul(g, 3.0)
        fd.add_output(y)
    g.set_evict_last()
    if streaming:
        g.set_streaming_load()
    _copy_schedule(fd, g, y)
    return fd


@pytest.mark.gpu
@pytest.mark.parametrize("streaming", [False, True])
def test_cache_hinted_loads_match_numpy_on_gpu(streaming: bool):
    cp = cupy_or_skip()
    fd = _hinted_gather_times_three(streaming)
    a = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    idx = np.array([36, 0, 5, 5, 17, 2, 30], np.int64)
    out = fd.execute([cp.asarray(a), cp.asarray(idx)])[0]
    np.testing.assert_allclose(cp.asnumpy(out), a.astype(np.float64)[idx] * 3.0, rtol=1e-6)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("streaming", [False, True])
def test_evict_last_is_a_schedule_of_input_reads(streaming: bool, width: int):
    fd, x, y = _times_two()
    c = x.cache_after()
    c.set_evict_last()
    if streaming:
        c.set_streaming_load()
    _copy_schedule(fd, c, y, width)
    a = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    k = fd.lower([a]).kernels[0]
    func = "loadVecStreamingEvictLast" if streaming else "loadVecEvictLast"
    # 8- and 16-byte vectors (every generated kernel is compiled with NVRTC by conftest.py).
    assert f"kiln::{func}<float, {width}>(kiln_vec, &T0[kiln_ib])" in k.cuda_source, k.cuda_source
    dump = r"T\d+_l_float\[[^\]]*\] ca_pos\(2\)" + (" streaming" if streaming else "") + " evict_last"
    assert re.search(dump, str(fd)), str(fd)
    np.testing.assert_array_equal(fd.execute([a])[0], a.astype(np.float64) * 2.0)
    with pytest.raises(KilnError, match=r"set_evict_last T\d+: T\d+ does not read a fusion input directly"):
        y.set_evict_last()


@pytest.mark.parametrize("hint", ["set_evict_last", "set_streaming_load"])
def test_a_cache_hint_without_a_vectorized_axis_is_an_error(hint: str):
    # The hints change vector loads only: on a scalar-loaded tensor they would do nothing.
    fd, x, y = _times_two()
    c = x.cache_after()
    getattr(c, hint)()
    for t in (c, y):
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.inline_at(-1)
    a = np.zeros((8, 64), np.float32)
    with pytest.raises(KilnError, match=rf"T\d+: {hint} applies to vectorized loads, but no axis of T\d+ is "
                                        r"vectorized"):
        fd.lower([a])


def test_automatic_schedules_hint_only_what_they_vectorize():
    # Rows of 4099 floats: no 16-byte vectors in the normalization, so no hints either.
    fd = _unscheduled(lambda fd, x: fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True)))
    src = _auto_source(fd, [np.zeros((8, 4099), np.float32)])
    body = src[src.index('extern "C" __global__'):]
    assert "loadVecEvictLast" not in body and "loadVecStreaming" not in body, body
    fd = _unscheduled(lambda fd, x: fd.ops.sum(x, dims=[1]))
    body = _auto_source(fd, [np.zeros((8, 4099), np.float32)])
    body = body[body.index('extern "C" __global__'):]
    assert "loadVecStreaming" not in body, body


def test_evict_last_on_rows_gathered_from_an_input():
    fd = _hinted_gather_times_three(streaming=True)
    a = np.arange(6 * 32, dtype=np.float32).reshape(6, 32)
    idx = np.array([5, 0, 0, 3, 1, 2, 4], np.int64)
    k = fd.lower([a, idx]).kernels[0]
    assert "kiln::loadVecStreamingEvictLast<float, 4>(kiln_vec, &T0[kiln_ib])" in k.cuda_source, k.cuda_source
    np.testing.assert_array_equal(fd.execute([a, idx])[0], a.astype(np.float64)[idx] * 3.0)


_HINT_PROBE = """
import numpy as np
from kiln import FusionDefinition
from kiln.execute import _auto_lowered
with FusionDefinition() as fd:
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True)))
(k,) = _auto_lowered(fd, [np.zeros((64, 256), np.float32)]).kernels
print("hinted" if "kiln::loadVecEvictLast<" in k.cuda_source else "plain")
"""


@pytest.mark.parametrize("value, want", [("0", "plain"), ("off", "plain"), ("1", "hinted"), (None, "hinted")])
def test_kiln_l2_evict_last_switches_the_hint_of_automatic_schedules(value, want):
    # Read once per process (plans cached under one setting must not serve the other), so
    # each setting runs in its own interpreter.
    env = {k: v for k, v in os.environ.items() if k != "KILN_L2_EVICT_LAST"}
    if value is not None:
        env["KILN_L2_EVICT_LAST"] = value
    cmd = [sys.executable, "-c", _HINT_PROBE]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == want


@pytest.mark.parametrize(
    "name, build, shapes, hinted",
    [
        ("pointwise", lambda fd, x: fd.ops.relu(fd.ops.mul(x, 1.5)), [(64, 256)], True),
        ("normalization", lambda fd, x: fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True)), [(64, 256)],
         True),
        ("transpose", lambda fd, x: fd.ops.permute(x, [1, 0]), [(256, 512)], True),
        ("row sum", lambda fd, x: fd.ops.sum(x, dims=[1]), [(64, 4096)], False),
        ("column sum", lambda fd, x: fd.ops.sum(x, dims=[0]), [(4096, 64)], False),
    ],
)
def test_automatic_schedules_keep_streamed_inputs_in_l2_but_not_reductions(name, build, shapes, hinted):
    # Measured on the H200 (DEVELOPERS.md): evict_last on the inputs of kernels that write as
    # much as they read is 1-3% faster; reductions write almost nothing and gain nothing.
    fd = _unscheduled(build)
    src = _auto_source(fd, [np.zeros(s, np.float32) for s in shapes])
    hint = "kiln::loadVecEvictLast<" in src or "kiln::loadVecStreamingEvictLast<" in src
    assert hint == hinted, (name, src)


def test_2d_pointwise_compiles_the_row_length_in():
    def bias_add(fd):
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])))

    with FusionDefinition() as fd:
        bias_add(fd)
    from kiln.execute import _auto_lowered

    x, b = np.zeros((64, 4096), np.float32), np.zeros(4096, np.float32)
    (k,) = _auto_lowered(fd, [x, b]).kernels
    sig = re.search(r"kiln_kernel\((.*?)\)", k.cuda_source).group(1)
    # Row offsets are known multiples of 4: no alignment checks; the row length is no parameter.
    assert not re.search(r"kiln_[io]b % 4 == 0", k.cuda_source) and "* 4096)" in k.cuda_source, k.cuda_source
    assert "kiln_index_t i1" not in sig and "kiln_index_t i0" in sig, sig
    # Another row length is another kernel; another row count is the same one.
    other = _auto_lowered(fd, [np.zeros((64, 2048), np.float32), np.zeros(2048, np.float32)])
    same = _auto_lowered(fd, [np.zeros((100, 4096), np.float32), b])
    assert other is not _auto_lowered(fd, [x, b]) and same is _auto_lowered(fd, [x, b])


def test_kernel_ir_after_a_pass_is_dumped(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    """``KILN_DUMP=after:<pass>`` prints the kernel IR after that pass: before ``unswitch`` the
    tile has no branch, after it the unswitched arms; an unknown pass is named."""
    from kiln import _core

    assert _core.lower_passes()[-4:] == ["unswitch", "vectorize", "group_reductions", "tensor_memory"]
    fd = _unscheduled(lambda fd, x: fd.ops.mul(x, 2.0))
    x = np.zeros((64, 1000), np.float32)
    monkeypatch.setenv("KILN_DUMP", "after:launch,after:unswitch")
    fd.lower([x])
    out = capsys.readouterr().out
    before = out.split("// kernel IR after launch\n", 1)[1].split("// kernel IR after unswitch\n", 1)[0]
    after = out.split("// kernel IR after unswitch\n", 1)[1]
    assert "IF " not in before and "FOR " in before, out
    assert "IF " in after and "// unswitch" in after, out
    monkeypatch.setenv("KILN_DUMP", "after:no_such_pass")
    with pytest.raises(KilnError, match="no such pass; the passes are schedule_checks, loops"):
        fd.lower([np.zeros((3, 1001), np.float32)])


def _shifted_sum_fusion(kind: str) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        m = fd.ops.max(x, dims=[1], keepdim=True)
        if kind == "unshifted":
            e = fd.ops.exp(x)
        elif kind == "other_max":
            y = fd.define_tensor([-1, -1], dtype=DataType.Float)
            e = fd.ops.exp(fd.ops.sub(y, m))  # y - max(x) may be positive
        else:
            e = fd.ops.exp(fd.ops.sub(x, m))
        s = fd.ops.sum(e, dims=[1])
        fd.add_output(fd.ops.add(fd.ops.log(s), fd.ops.squeeze(m, [1])))
        if kind == "exp_output":
            fd.add_output(e)
    return fd


@pytest.mark.parametrize("kind, fast", [("shifted", True), ("unshifted", False), ("other_max", False),
                                        ("exp_output", False)])
def test_exp_terms_of_a_shifted_sum_use_the_fast_exp(kind: str, fast: bool) -> None:
    """exp(x - max(x)) read only by a sum takes ex2.approx (kiln::lseExp); an exp that is an
    output, or whose argument may be positive, keeps the exact expf."""
    from kiln.execute import _auto_lowered  # noqa: PLC0415

    fd = _shifted_sum_fusion(kind)
    ins = [np.zeros((64, 1000), np.float32)] * (2 if kind == "other_max" else 1)
    srcs = [k.cuda_source for k in _auto_lowered(fd, ins).kernels]
    body = "".join(s[s.index("__global__"):] for s in srcs)
    assert ("kiln::lseExp(" in body) == fast, body
    # The result is the log-sum-exp either way (interpreter against float64).
    x = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32) * 4
    got = fd.execute([x] * len(ins))[0]
    xd = x.astype(np.float64)
    ref = np.log(np.exp(xd - xd.max(1, keepdims=True)).sum(1)) + xd.max(1) if kind != "unshifted" else \
        np.log(np.exp(xd).sum(1)) + xd.max(1)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def _output_read_back_by_other_threads() -> Tuple[FusionDefinition, List[np.ndarray]]:
    """``t3 = max(x)`` is an output written by thread 0 and read by all 112 threads after a
    barrier, for ``t4 = x + t3``."""
    from kiln import ParallelType as P  # noqa: PLC0415

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[16, 7], dtype=DataType.Float)
        m = fd.ops.max(x, dims=[0, 1])
        t3 = fd.ops.broadcast_in_dim(m, shape=[-1, -1], broadcast_dims=[])
        t4 = fd.ops.add(x, t3)
        fd.add_output(t4)
        fd.add_output(t3)
    t4.merge(0)
    t4.axis(-1).parallelize(P.TIDx)
    m.inline_at(0)
    x_ = np.random.default_rng(5).uniform(-1, 1, (16, 7)).astype(np.float32)
    return fd, [x_]


def _ptx(src: str) -> str:
    """``src`` compiled to PTX for compute_90 by NVRTC."""
    from kiln.runtime.nvrtc import _nvrtc_module, default_options  # noqa: PLC0415

    nv = _nvrtc_module()
    _, prog = nv.nvrtcCreateProgram(src.encode(), b"k.cu", 0, [], [])
    opts = [o.encode() for o in default_options("sm_90") if not o.startswith("-arch") and "ptxas" not in o]
    opts.append(b"--gpu-architecture=compute_90")
    (err,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
    assert int(err) == 0
    _, n = nv.nvrtcGetPTXSize(prog)
    buf = b" " * n
    nv.nvrtcGetPTX(prog, buf)
    return buf.decode(errors="replace")


def test_an_output_read_back_in_its_kernel_is_not_restrict():
    # `__restrict__` on an output the kernel reads back let the compiler load it before the
    # barrier that orders it after thread 0's store (and store the stale value back): every
    # thread but thread 0 added the output buffer's previous contents on the GPU.
    fd, args = _output_read_back_by_other_threads()
    src = fd.lower(args).kernels[0].cuda_source
    sig = re.search(r"kiln_kernel\(([^)]*)\)", src).group(1)
    assert "float* T2" in sig and "__restrict__ T2" not in sig  # the statistic output
    assert "float* __restrict__ T3" in sig  # outputs only written keep it
    t4, t3 = fd.execute(args)
    x = args[0].astype(np.float64)
    np.testing.assert_allclose(t4, x + x.max(), rtol=1e-6)
    if not nvrtc_available():
        return
    body = _ptx(src).split(".entry kiln_kernel", 1)[1]
    before_barrier = body.split("bar.sync", 1)[0]
    # Before the barrier only the input is read (through the read-only path).
    assert not re.search(r"ld\.global\.(?!nc)", before_barrier), before_barrier


@pytest.mark.gpu
def test_an_output_read_back_in_its_kernel_matches_numpy_on_gpu():
    cp = cupy_or_skip()
    fd, args = _output_read_back_by_other_threads()
    x = args[0].astype(np.float64)
    for _ in range(3):  # the output buffers come from a pool that earlier calls filled
        t4, t3 = fd.execute([cp.asarray(a) for a in args])
        np.testing.assert_allclose(cp.asnumpy(t4), x + x.max(), rtol=1e-6)
        np.testing.assert_allclose(cp.asnumpy(t3), [[x.max()]], rtol=1e-6)
