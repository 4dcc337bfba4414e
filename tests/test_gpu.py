"""The allocation issue's scenarios a)–h) compiled with NVRTC for the device and run on it,
against NumPy float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import scenarios
from gpu_util import cupy_or_skip
from kiln import KilnError

pytestmark = pytest.mark.gpu

RUNNABLE = [b for b in scenarios.ALL if b is not scenarios.b_local]


@pytest.mark.parametrize("build", RUNNABLE, ids=lambda b: b.__name__)
def test_scenario_matches_numpy(build):
    cp = cupy_or_skip()
    sc = build()
    arrays = sc.make_inputs(cp)
    outs = sc.fd.execute(arrays)
    refs = sc.reference([cp.asnumpy(a) for a in arrays])
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        got = cp.asnumpy(o)
        assert got.shape == r.shape
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(r).max())))


def test_local_cache_with_symbolic_size_is_refused_before_launch():
    cp = cupy_or_skip()
    sc = scenarios.b_local()
    # Static [3, 300]: constant Local size, so it runs.
    out = sc.fd.execute(sc.make_inputs(cp))
    assert out[0].shape == (3, 300)


def test_executor_allocates_buffers_or_takes_them():
    cp = cupy_or_skip()
    from kiln.runtime.kernel_executor import KernelExecutor

    sc = scenarios.h_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    ref = sc.reference([cp.asnumpy(x)])[0]
    k = sc.fd.lower([x]).kernels[0]
    ex = KernelExecutor(k)
    (own,) = ex.run([x])  # executor allocates work buffer and zeroed semaphore
    np.testing.assert_allclose(cp.asnumpy(own), ref, rtol=1e-5, atol=1e-4)
    plan = ex.plan([x], [])
    bufs = [cp.zeros(b.elements, dtype=cp.float32 if b.dtype == "Float" else cp.int64) for b in plan.buffers]
    (given,) = ex.run([x], buffers=bufs)
    np.testing.assert_allclose(cp.asnumpy(given), ref, rtol=1e-5, atol=1e-4)
    assert int(bufs[1].sum()) == 0, "the semaphore is back to zero after the launch"
    with pytest.raises(KilnError, match="global buffer T1_work"):
        ex.run([x], buffers=[bufs[0][:3], bufs[1]])
    with pytest.raises(KilnError, match="needs 2 global buffers"):
        ex.run([x], buffers=bufs[:1])


def test_serial_grid_reduction_is_deterministic():
    cp = cupy_or_skip()
    sc = scenarios.h_serial_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    first = cp.asnumpy(sc.fd.execute([x])[0])
    for _ in range(5):
        np.testing.assert_array_equal(cp.asnumpy(sc.fd.execute([x])[0]), first)


def test_torch_inputs_give_torch_outputs():
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    sc = scenarios.a_pointwise()
    x = torch.randn(37, 129, device="cuda")
    (out,) = sc.fd.execute([x])
    assert isinstance(out, torch.Tensor) and out.is_cuda
    ref = np.exp(x.cpu().numpy().astype(np.float64)) * 2.0 - 1.5
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launcher", ["rust", "cupy"])
@pytest.mark.parametrize("build", ["pointwise", "grid_column_sum"])
def test_torch_inputs_run_on_torch_s_current_stream(monkeypatch, launcher, build):
    # The input is written on a side stream behind a ~25 ms sleep; kiln, called inside
    # `with torch.cuda.stream(side)`, must run after it on that stream. (Torch's side
    # streams do not synchronize with the legacy default stream that CuPy uses.)
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KILN_LAUNCHER", launcher)
    if build == "pointwise":
        fd = scenarios.a_pointwise().fd
        x = torch.zeros(4096, 1024, device="cuda")

        def ref(a):
            return np.exp(a) * 2.0 - 1.5
    else:
        fd = scenarios.h_grid_column_sum().fd
        x = torch.zeros(61, 300, device="cuda")

        def ref(a):
            return a.sum(axis=0)
    fd.execute([x])  # compile and prepare outside the timed-out window
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.fill_(0.25)
        (out,) = fd.execute([x])
    side.synchronize()
    want = ref(np.full(tuple(x.shape), 0.25))
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


def test_one_fusion_on_two_devices_keeps_their_buffers_apart():
    # A column sum across blocks needs a work buffer (arena) and a semaphore (zeroed pool);
    # run on device 1 after device 0, it must use device 1's own buffers.
    cp = cupy_or_skip()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    sc = scenarios.h_grid_column_sum()
    host = np.random.default_rng(3).standard_normal((61, 300)).astype(np.float32)
    want = host.astype(np.float64).sum(axis=0)
    for dev in (0, 1, 0):
        with cp.cuda.Device(dev):
            (out,) = sc.fd.execute([cp.asarray(host)])
            assert out.data.device_id == dev
            np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(4, 0), (0, 4), (4, 3)])
def test_hand_schedules_over_an_empty_axis_launch(shape):
    """TIDx over a row of no elements, BIDx over no rows being reduced: the kernels launch
    one guarded thread or block and write the sum's identity."""
    cp = cupy_or_skip()
    rows, cols = scenarios.empty_axis_row_sum(), scenarios.empty_axis_column_sum()
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = rows.execute([cp.asarray(a)])[0]
    np.testing.assert_allclose(cp.asnumpy(got), a.astype(np.float64).sum(1) + 1.0, rtol=1e-5)
    got = cols.execute([cp.asarray(a)])[0]
    np.testing.assert_allclose(cp.asnumpy(got), a.astype(np.float64).sum(0) + 1.0, rtol=1e-5)
