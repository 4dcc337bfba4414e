"""Output reuse on the GPU (``KILN_REUSE_OUTPUTS``): a repeat call hands back the previous
call's output array only when nothing outside kiln can still see it. Every case checks the
values against NumPy, and that whatever the caller kept of an earlier output still holds
that call's values after later calls."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import FusionDefinition

pytestmark = pytest.mark.gpu

SHAPE = (64, 100)


def _fusion() -> FusionDefinition:
    """``x * 2 + 1`` on a [64, 100] float tensor (automatic schedule)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(SHAPE))
        fd.add_output(fd.ops.add(fd.ops.mul(x, 2.0), 1.0))
    return fd


def _ref(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) * 2 + 1


def test_cupy_output_dropped_is_reused_and_correct():
    cp = cupy_or_skip()
    fd = _fusion()
    xs = [cp.asarray(np.random.default_rng(i).standard_normal(SHAPE, dtype=np.float32)) for i in range(4)]
    fd.execute([xs[0]])
    ptrs = []
    for x in xs:
        (out,) = fd.execute([x])
        np.testing.assert_allclose(cp.asnumpy(out), _ref(cp.asnumpy(x)), rtol=1e-6)
        ptrs.append(out.data.ptr)
        del out
    assert len(set(ptrs[1:])) == 1, "a dropped output is handed back on the next call"


@pytest.mark.parametrize("keep", ["view", "memptr", "dlpack", "cuda_array_interface"])
def test_cupy_output_still_visible_is_not_overwritten(keep: str):
    cp = cupy_or_skip()
    fd = _fusion()
    rng = np.random.default_rng(7)
    x1 = cp.asarray(rng.standard_normal(SHAPE, dtype=np.float32))
    x2 = cp.asarray(rng.standard_normal(SHAPE, dtype=np.float32))
    fd.execute([x1])
    (out,) = fd.execute([x1])
    read: Callable[[], Any]
    if keep == "view":
        kept = out[1:]
        read = lambda: cp.asnumpy(kept)  # noqa: E731
        want = _ref(cp.asnumpy(x1))[1:]
    elif keep == "memptr":
        kept = out.data
        read = lambda: cp.asnumpy(cp.ndarray(SHAPE, np.float32, memptr=kept))  # noqa: E731
        want = _ref(cp.asnumpy(x1))
    elif keep == "dlpack":
        kept = cp.from_dlpack(out)
        read = lambda: cp.asnumpy(kept)  # noqa: E731
        want = _ref(cp.asnumpy(x1))
    else:
        class Holder:
            def __init__(self, a: Any) -> None:
                self.__cuda_array_interface__ = a.__cuda_array_interface__
                self.base = a  # what consumers of the interface keep

        kept = cp.asarray(Holder(out))
        read = lambda: cp.asnumpy(kept)  # noqa: E731
        want = _ref(cp.asnumpy(x1))
    p = out.data.ptr
    del out
    for _ in range(3):
        (o2,) = fd.execute([x2])
        assert o2.data.ptr != p
        np.testing.assert_allclose(cp.asnumpy(o2), _ref(cp.asnumpy(x2)), rtol=1e-6)
        del o2
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_allclose(read(), want, rtol=1e-6)


def test_cupy_output_is_not_reused_on_another_stream():
    cp = cupy_or_skip()
    fd = _fusion()
    x = cp.asarray(np.random.default_rng(3).standard_normal(SHAPE, dtype=np.float32))
    fd.execute([x])
    (out,) = fd.execute([x])
    p = out.data.ptr
    del out
    side = cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()
    with side:
        (out,) = fd.execute([x])
        assert out.data.ptr != p
        side.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), _ref(cp.asnumpy(x)), rtol=1e-6)


@pytest.mark.parametrize("keep", ["none", "view", "slice", "dlpack", "cupy", "resize", "grad"])
def test_torch_output_reuse_only_when_nothing_holds_it(keep: str):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    fd = _fusion()
    g = torch.Generator(device="cuda").manual_seed(5)
    x1 = torch.randn(SHAPE, device="cuda", generator=g)
    x2 = torch.randn(SHAPE, device="cuda", generator=g)
    fd.execute([x1])
    (out,) = fd.execute([x1])
    want = _ref(x1.cpu().numpy())
    kept: Any = None
    if keep == "view":
        kept = out.view(-1)
        want = want.reshape(-1)
    elif keep == "slice":
        kept = out[3:]
        want = want[3:]
    elif keep == "dlpack":
        kept = torch.utils.dlpack.to_dlpack(out)
    elif keep == "cupy":
        cp = cupy_or_skip()
        kept = cp.asarray(out)
    elif keep == "resize":
        out.resize_(10)  # the caller re-shaped it in place, then dropped it
    elif keep == "grad":
        out.requires_grad_(True)
    p = out.data_ptr()
    del out
    (o2,) = fd.execute([x2])
    np.testing.assert_allclose(o2.cpu().numpy(), _ref(x2.cpu().numpy()), rtol=1e-6)
    assert tuple(o2.shape) == SHAPE and not o2.requires_grad
    if keep == "none":
        assert o2.data_ptr() == p, "a dropped output is handed back on the next call"
        return
    assert o2.data_ptr() != p
    torch.cuda.synchronize()
    if keep == "dlpack":
        np.testing.assert_allclose(torch.utils.dlpack.from_dlpack(kept).cpu().numpy(), want, rtol=1e-6)
    elif keep == "cupy":
        np.testing.assert_allclose(kept.get(), want, rtol=1e-6)
    elif kept is not None:
        np.testing.assert_allclose(kept.cpu().numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_an_output_handed_back_as_a_view_is_reused_only_when_the_view_is_dropped(lib: str):
    # add_output(..., stride_order): the caller gets a permuted view of the stored array,
    # which holds that array; while the caller keeps the view, later calls must not write it.
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.permute(fd.ops.mul(x, 3.0), [0, 2, 1]), stride_order=[2, 0, 1])
    rng = np.random.default_rng(11)
    a1, a2 = (rng.standard_normal((4, 6, 8)).astype(np.float32) for _ in range(2))
    if lib == "torch":
        torch = pytest.importorskip("torch")
        x1, x2 = (torch.as_tensor(a, device="cuda") for a in (a1, a2))
        ptr = lambda o: o.data_ptr()  # noqa: E731
        host = lambda o: o.cpu().numpy()  # noqa: E731
        sync = torch.cuda.synchronize
    else:
        x1, x2 = cp.asarray(a1), cp.asarray(a2)
        ptr = lambda o: o.data.ptr  # noqa: E731
        host = cp.asnumpy
        sync = cp.cuda.get_current_stream().synchronize
    fd.execute([x1])
    (v,) = fd.execute([x1])
    p = ptr(v)
    del v
    (v,) = fd.execute([x1])
    assert ptr(v) == p, "a dropped view's array is written again"
    kept = v  # held: the next calls get fresh arrays
    del v
    for _ in range(2):
        (w,) = fd.execute([x2])
        assert ptr(w) != p
        np.testing.assert_allclose(host(w), (a2.astype(np.float64) * 3).transpose(0, 2, 1), rtol=1e-6)
        del w
    sync()
    np.testing.assert_allclose(host(kept), (a1.astype(np.float64) * 3).transpose(0, 2, 1), rtol=1e-6)
