"""Host IR (issue 5): segmentation, Allocate/LaunchKernel/Deallocate, flags carried over
from KernelSummary, liveness memory plan, plan cache, and the CuPy evaluator on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import scenarios
from gpu_util import cupy_or_skip, plan_without_resets
from kiln import FusionDefinition, KilnError, KilnTypeError, ParallelType
from kiln.cli import build_demo
from kiln.cli import reference as softmax_reference


def _row(t, factor=128):
    t.split(1, factor)
    t.axis(0).parallelize(ParallelType.BIDx)
    t.axis(-1).parallelize(ParallelType.TIDx)


def three_segment_chain():
    """x -> a = exp(x) | s = sum(a, 1) | y = a / s[:, None]: a lives across all three kernels."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        s = fd.ops.sum(a, dims=[1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.div(a, sb)
        fd.add_output(y)
    for t in (a, s, sb, y):
        _row(t)
    sb.inline_at(-1)
    fd.segment_after(a)
    fd.segment_after(s)
    return fd


def _chain_ref(x):
    e = np.exp(x.astype(np.float64))
    return e / e.sum(axis=1, keepdims=True)


def _lines(text, op):
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(op)]


# -- host program (CPU: lowering and planning only) -----------------------------------
@pytest.mark.parametrize("serial", [False, True])
def test_grid_reduction_program_lists_work_buffer_and_semaphore(serial):
    sc = scenarios.h_serial_grid_column_sum() if serial else scenarios.h_grid_column_sum()
    x = sc.make_inputs(np)[0]
    low = sc.fd.lower([x])
    text = low.host_program
    allocs = _lines(text, "Allocate")
    assert allocs[0].startswith("Allocate T1 [i1] float")
    work, sync = allocs[1], allocs[2]
    assert work.startswith("Allocate T1_work [") and "zero_init=false resets_to_zero=false" in work
    # Both protocols leave the semaphore at zero: it lives in the zeroed pool.
    assert sync == "Allocate T1_sync [ceilDiv(i1, 128)] int64 zero_init=true resets_to_zero=true"
    # Same order as the kernel's buffer parameters, flags as in KernelSummary.
    k = low.kernels[0]
    assert [p[0] for p in k.params if p[1] == "buffer"] == ["T1_work", "T1_sync"]
    assert [(g.zero_init, g.resets_to_zero) for g in k.global_allocations] == [(False, False), (True, True)]
    launch = _lines(text, "LaunchKernel")[0]
    assert "intermediates=[T1_work, T1_sync]" in launch
    assert _lines(text, "Deallocate") == ["Deallocate T1_work", "Deallocate T1_sync"]
    plan = low.plan([x])
    assert plan.buffer("T1_sync").place == "zero_pool"
    assert plan.buffer("T1_work").place == "arena"


def test_three_segment_chain_deallocates_after_last_use_and_peak():
    fd = three_segment_chain()
    x = np.zeros((8, 300), np.float32)
    low = fd.lower([x])
    assert len(low.kernels) == 3
    instrs = low.program.instructions()
    flat = [(i.op, i.buffer if i.kernel is None else i.kernel) for i in instrs]
    assert flat == [
        ("Allocate", "T1"), ("LaunchKernel", 0),
        ("Allocate", "T2"), ("LaunchKernel", 1),
        ("Allocate", "T4"), ("LaunchKernel", 2),
        ("Deallocate", "T1"), ("Deallocate", "T2"),
    ]
    # Each Deallocate follows the last launch that reads the buffer.
    for n, (op, name) in enumerate(flat):
        if op == "Deallocate":
            last = max(j for j, i in enumerate(instrs)
                       if i.op == "LaunchKernel" and (name in i.inputs or name in i.outputs))
            assert n > last and all(o == "Deallocate" for o, _ in flat[last + 1:n])
    plan = low.plan([x])
    n = 8 * 300 * 4
    row = 8 * 4
    # Live sets: {T1} -> {T1, T2} -> {T1, T2, T4} -> (free T1, T2) -> {T4}.
    assert plan.peak_bytes == max(n, n + row, n + row + n) == 2 * n + row
    assert plan.buffer("T4").place == "output"
    assert plan.arena_bytes >= n + row


def test_arena_reuses_freed_regions():
    # Four segments: T1 dies after kernel 1, so T3 (same size) takes its region.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        t = [x]
        for _ in range(4):
            t.append(fd.ops.mul(t[-1], 2.0))
        fd.add_output(t[-1])
    for u in t[1:]:
        _row(u)
    for u in t[1:-1]:
        fd.segment_after(u)
    x0 = np.zeros((4, 256), np.float32)
    plan = fd.lower([x0]).plan([x0])
    assert plan.buffer("T3").offset == plan.buffer("T1").offset
    assert plan.arena_bytes == 2 * 4 * 256 * 4
    assert plan.peak_bytes == 2 * 4 * 256 * 4


def test_plan_is_cached_per_signature():
    fd = three_segment_chain()
    x = np.zeros((8, 300), np.float32)
    low = fd.lower([x])
    for _ in range(5):
        low.plan([x])
    assert low.program.plan_misses == 1
    low.plan([np.zeros((9, 300), np.float32)])
    assert low.program.plan_misses == 2


def test_symbols_of_later_segments_bind_from_fusion_inputs():
    fd = three_segment_chain()
    x = np.zeros((5, 130), np.float32)
    plan = fd.lower([x]).plan([x])
    assert plan.buffer("T2").sizes == (5,)
    assert [la.grid for la in plan.launches] == [(5, 1, 1)] * 3


def test_segment_after_errors_name_the_tensor():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.ops.neg(x)
        fd.add_output(y)
    with pytest.raises(KilnError, match="segment_after T0: T0 is a fusion input"):
        fd.segment_after(x)
    y.segment_after()  # a segment that ends at the output: still one kernel
    assert len(fd.lower([np.zeros(3, np.float32)]).kernels) == 1


def test_inputs_inconsistent_across_inputs_raise_naming_the_input():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        y = fd.ops.add(x, b)
        fd.add_output(y)
    _row(y)
    low = fd.lower([np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)])
    want = r"input 1 \(T1\): axis 1 has size 4 but input 0 \(T0\) axis 1 has size 3"
    with pytest.raises(KilnError, match=want):
        low.plan([np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 1 has stride 2 but must be contiguous"):
        low.plan([np.zeros((2, 6), np.float32)[:, ::2], np.zeros((2, 3), np.float32)])


def test_demo_program_has_three_kernels():
    fd = build_demo()
    x = np.zeros((4, 300), np.float32)
    low = fd.lower([x])
    assert len(low.kernels) == 3
    assert "LaunchKernel kernel2(inputs=[T4, T5], outputs=[T7]" in low.host_program


def test_dump_host_ir_on_lower(monkeypatch, capsys):
    monkeypatch.setenv("KILN_DUMP", "host_ir")
    three_segment_chain().lower([np.zeros((2, 3), np.float32)])
    assert "HostProgram(T0) -> (T4): 3 kernel(s)" in capsys.readouterr().out


# -- GPU ------------------------------------------------------------------------------
def _assert_close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.gpu
@pytest.mark.parametrize("serial", [False, True])
def test_grid_reduction_zeroes_its_pool_once(serial):
    cp = cupy_or_skip()
    sc = scenarios.h_serial_grid_column_sum() if serial else scenarios.h_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    ref = sc.reference([cp.asnumpy(x)])[0]
    first = None
    for _ in range(100):
        (out,) = sc.fd.execute([x])
        got = cp.asnumpy(out)
        _assert_close(got, ref)
        if first is None:
            first = got
        np.testing.assert_array_equal(got, first)
    ev = sc.fd._lowered().evaluator()
    stats = ev.pool.stats()
    print("zeroed pool statistics after 100 calls:", stats)
    assert stats["zero_fills"] == 1 and stats["reuses"] == 99
    assert ev.memsets == 0


@pytest.mark.gpu
def test_zero_init_without_reset_is_zeroed_every_launch(monkeypatch):
    cp = cupy_or_skip()
    plan_without_resets(monkeypatch)
    sc = scenarios.h_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    ref = sc.reference([cp.asnumpy(x)])[0]
    ev = sc.fd._lowered().evaluator()
    for i in range(5):
        if ev._arena is not None:
            ev._arena.fill(0xFF)  # dirty the workspace: the semaphore region reads -1
        (out,) = sc.fd.execute([x])
        _assert_close(cp.asnumpy(out), ref)
        assert ev.memsets == i + 1
    # Without the per-launch memset the dirty semaphore never reaches G-1: no block
    # finishes the reduction and the output keeps whatever its memory held.
    ev.zero_per_launch = False
    ev._arena.fill(0xFF)
    junk = cp.full(x.shape[1], cp.nan, dtype=cp.float32)
    del junk
    (bad,) = sc.fd.execute([x])
    cp.cuda.Device().synchronize()
    assert not np.allclose(cp.asnumpy(bad), ref, equal_nan=False)
    ev.zero_per_launch = True


@pytest.mark.gpu
def test_executor_fallback_matches_host_program():
    cp = cupy_or_skip()
    from kiln.runtime.kernel_executor import KernelExecutor

    for build in (scenarios.h_grid_column_sum, scenarios.h_serial_grid_column_sum):
        sc = build()
        x = sc.make_inputs(cp)[0]
        (host,) = sc.fd.execute([x])
        (own,) = KernelExecutor(sc.fd.lower([x]).kernels[0]).run([x])  # allocates its own buffers
        np.testing.assert_array_equal(cp.asnumpy(own), cp.asnumpy(host))


@pytest.mark.gpu
def test_wrong_intermediates_raise():
    cp = cupy_or_skip()
    from kiln.runtime.kernel_executor import KernelExecutor

    sc = scenarios.h_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    ex = KernelExecutor(sc.fd.lower([x]).kernels[0])
    plan = ex.plan([x], [])
    work = cp.empty(plan.buffers[0].elements, dtype=cp.float32)
    sync = cp.zeros(plan.buffers[1].elements, dtype=cp.int64)
    with pytest.raises(KilnError, match="global buffer T1_work: 3 elements"):
        ex.run([x], buffers=[work[:3], sync])
    with pytest.raises(KilnTypeError, match="global buffer T1_sync: dtype float32"):
        ex.run([x], buffers=[work, sync.astype(cp.float32)])
    with pytest.raises(KilnError, match="needs 2 global buffers"):
        ex.run([x], buffers=[work])
    assert ex.launches == 0


@pytest.mark.gpu
def test_three_segment_chain_and_demo_match_numpy():
    cp = cupy_or_skip()
    x = np.random.default_rng(1).standard_normal((37, 333)).astype(np.float32)
    fd = three_segment_chain()
    for _ in range(3):
        (out,) = fd.execute([cp.asarray(x)])
        _assert_close(cp.asnumpy(out), _chain_ref(x))
    (out,) = build_demo().execute([cp.asarray(x)])
    _assert_close(cp.asnumpy(out), softmax_reference(x))


@pytest.mark.gpu
def test_validation_happens_before_any_launch():
    cp = cupy_or_skip()
    fd = three_segment_chain()
    (out,) = fd.execute([cp.ones((4, 130), dtype=cp.float32)])
    ev = fd._lowered().evaluator()
    n = ev.launches
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): dtype Double"):
        fd.execute([cp.ones((4, 130), dtype=cp.float64)])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 1 has stride 2"):
        fd.execute([cp.ones((4, 260), dtype=cp.float32)[:, ::2]])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): rank 1"):
        fd.execute([cp.ones(4, dtype=cp.float32)])
    assert ev.launches == n


@pytest.mark.gpu
def test_torch_in_torch_out_through_host_program():
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    x = torch.randn(9, 200, device="cuda")
    (out,) = three_segment_chain().execute([x])
    assert isinstance(out, torch.Tensor) and out.is_cuda
    _assert_close(out.cpu().numpy(), _chain_ref(x.cpu().numpy()))


