"""Bad arguments that leaked Python's own exceptions (ModuleNotFoundError, AttributeError,
ValueError, OverflowError, TypeError, KeyError) out of kiln's Python layer, NumPy numbers
that paths other than ``fd.execute`` refused, and messages that named the wrong axis or fix;
each now gets a ``KilnError`` naming what was given, or runs and matches NumPy's float64
answer (CPU only)."""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Sequence

import kiln
import numpy as np
import pytest
from kiln import DataType, DeviceMesh, FusionDefinition, KilnError, KilnTypeError, ParallelType
from kiln.multidevice import LocalCommunicator, simulate

PT = ParallelType


def _shard(tensors: Sequence[Any], mesh: DeviceMesh, axis: int = 0) -> None:
    """Put ``tensors`` on ``mesh``, axis ``axis`` sharded over DIDx."""
    for t in tensors:
        t.set_device_mesh(mesh)
        t.split(axis, mesh.size, inner_split=False)
        t.axis(axis).parallelize(PT.DIDx)


def _exp_fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x))
    return fd


# -- 1. execute / simulate / lowering -----------------------------------------------------


@pytest.mark.parametrize("scalar_input", [False, True])
def test_cuda_without_array_inputs_and_without_cupy(monkeypatch: pytest.MonkeyPatch,
                                                    scalar_input: bool) -> None:
    # Outputs of a fusion without array inputs are CuPy arrays on device='cuda': without
    # CuPy, the same KilnTypeError as NumPy inputs get, not ModuleNotFoundError.
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails, installed or not
    with FusionDefinition() as fd:
        if scalar_input:
            s = fd.define_scalar(dtype=DataType.Double)
            fd.add_output(fd.ops.full([3], s, DataType.Float))
        else:
            fd.add_output(fd.ops.full([3], 1.0, DataType.Float))
    with pytest.raises(KilnTypeError, match=r"device='cuda'.*CuPy"):
        fd.execute([2.0] if scalar_input else [], device="cuda")
    with pytest.raises(KilnTypeError, match=r"device='cuda' needs CuPy arrays"):
        _exp_fusion().execute([np.ones((2, 3), np.float32)], device="cuda")
    # The CPU still runs it.
    np.testing.assert_array_equal(fd.execute([2.0] if scalar_input else [])[0],
                                  np.full(3, 2.0 if scalar_input else 1.0, np.float32))


@pytest.mark.parametrize("bad", ["fd", None, 3])
def test_simulate_needs_a_fusion_definition(bad: Any) -> None:
    want = rf"simulate: expected a kiln.FusionDefinition, got {type(bad).__name__}"
    with pytest.raises(KilnTypeError, match=want):
        simulate(bad, [[np.ones(3, np.float32)]])


class _Duck:
    """Looks like an array, but its shape holds no integers."""

    dtype = np.dtype(np.float32)
    itemsize = 4
    strides = (8, 4)

    def __init__(self, shape: Any) -> None:
        self.shape = shape


@pytest.mark.parametrize("shape", [("a", "b"), (float("nan"), 2), 5])
def test_duck_array_with_non_integer_shape(shape: Any) -> None:
    fd = _exp_fusion()
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): expected an array.*_Duck"):
        fd.execute([_Duck(shape)])
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\)"):
        fd.lower([_Duck(shape)])


# -- 2. handles built by hand --------------------------------------------------------------


def _chain() -> Any:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    return fd, x, y


@pytest.mark.parametrize("make, err, message", [
    (lambda fd, x, y: fd.ops.exp(kiln.Tensor(fd, -1)), KilnError, r"T-1 is not a tensor of this fusion"),
    (lambda fd, x, y: fd.ops.exp(kiln.Tensor(fd, 2**40)), KilnError,
     r"T1099511627776 is not a tensor of this fusion"),
    (lambda fd, x, y: kiln.Tensor(fd, -1).split(0, 2), KilnError, r"T-1 is not a tensor of this fusion"),
    (lambda fd, x, y: fd.ops.exp(kiln.Tensor(fd, "a")), KilnTypeError,
     r"Tensor: expected an int id, got 'a'"),
    (lambda fd, x, y: kiln.Tensor(fd, True), KilnTypeError, r"Tensor: expected an int id, got True"),
    (lambda fd, x, y: fd.ops.add(x, kiln.Scalar(fd, -1)), KilnError,
     r"scalar -1 is not a scalar of this fusion"),
    (lambda fd, x, y: kiln.Scalar(fd, 2**32), KilnError, r"scalar 4294967296 is not a scalar of this fusion"),
    (lambda fd, x, y: kiln.IterDomain(y, -1).parallelize(PT.TIDx), KilnError,
     r"iter domain -1 is not part of this fusion"),
    (lambda fd, x, y: kiln.IterDomain(None, 0), KilnTypeError,
     r"IterDomain: expected the Tensor it belongs to, got None"),
    (lambda fd, x, y: kiln.Tensor(None, 0).split(0, 2), KilnTypeError,
     r"Tensor: expected the FusionDefinition it belongs to, got None"),
    (lambda fd, x, y: kiln.Scalar("fd", 0), KilnTypeError,
     r"Scalar: expected the FusionDefinition it belongs to, got 'fd'"),
], ids=["tensor-negative", "tensor-2**40", "tensor-negative-split", "tensor-str", "tensor-bool",
        "scalar-negative", "scalar-2**32", "iterdomain-negative", "iterdomain-no-tensor", "tensor-no-fusion",
        "scalar-no-fusion"])
def test_handle_ids_out_of_range(make: Callable[..., Any], err: type, message: str) -> None:
    fd, x, y = _chain()
    with pytest.raises(err, match=message):
        make(fd, x, y)


def test_handle_ids_in_range_still_work() -> None:
    fd, x, y = _chain()
    t = kiln.Tensor(fd, np.int64(x._id))  # a NumPy integer is the int it holds
    assert t.name == "T0" and isinstance(t._id, int)
    assert kiln.IterDomain(y, y.axis(0)._id) == y.axis(0)


# -- 3. NumPy numbers wherever Python numbers are taken ------------------------------------


def test_plan_takes_numpy_numbers() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(x, s))
    a = np.arange(3, dtype=np.float32)
    low = fd.lower([a, np.float32(2.0)])
    want = low.plan([a, 2.0])
    got = low.plan([a, np.float32(2.0)])
    assert got.table() == want.table()
    np.testing.assert_allclose(fd.execute([a, np.float32(2.0)])[0], a.astype(np.float64) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("dtype, value", [(DataType.Double, np.float32(2.5)), (DataType.Int, np.int64(3))])
def test_simulate_takes_numpy_numbers(dtype: DataType, value: Any) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.define_scalar(dtype=dtype)
        y = fd.ops.mul(x, s)
        fd.add_output(y)
    _shard([x, y], DeviceMesh([0, 1]))
    rng = np.random.default_rng(0)
    slices = [rng.standard_normal((1, 3)).astype(np.float32) for _ in range(2)]
    outs = simulate(fd, [[b, value] for b in slices])
    for b, (o,) in zip(slices, outs):
        np.testing.assert_allclose(o, b.astype(np.float64) * float(value), rtol=1e-6)


def test_simulate_numpy_number_for_a_tensor_names_the_rank() -> None:
    fd = _exp_fusion()
    x = kiln.Tensor(fd, 0)
    _shard([x, kiln.Tensor(fd, 1)], DeviceMesh([0, 1]))
    with pytest.raises(KilnError, match=r"input 0 \(T0\): rank 0 does not match the definition's rank 2"):
        simulate(fd, [[np.float32(1.0)], [np.float32(1.0)]])


# -- 4. in-place outputs of a sharded fusion ----------------------------------------------


def test_sharded_in_place_output_matches_numpy() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.ops.neg(x)
        y = fd.ops.exp(x)
        fd.add_output(z)
        fd.add_output(y, alias_input=x)
        fd.add_output(fd.ops.sum(x, [0]))  # an allreduce, in another stage, reading x too
    _shard([x, y, z], DeviceMesh([0, 1]))
    rng = np.random.default_rng(1)
    slices = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2)]
    before = [b.astype(np.float64) for b in slices]
    outs = simulate(fd, [[b] for b in slices])
    total = sum(b.sum(axis=0) for b in before)
    for b, x64, got in zip(slices, before, outs):
        # As fd.execute: the in-place output is written into the input and not returned.
        assert len(got) == 2
        np.testing.assert_allclose(got[0], -x64, rtol=1e-6)
        np.testing.assert_allclose(got[1], total, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, np.exp(x64), rtol=1e-6)


def _one_device_in_place() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y, alias_input=x)
    _shard([x], DeviceMesh([0]))
    return fd


def test_sharded_in_place_output_with_a_communicator_matches_execute() -> None:
    a = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)
    want = np.exp(a.astype(np.float64))
    plain = FusionDefinition()
    with plain:
        x = plain.define_tensor([-1, -1])
        plain.add_output(plain.ops.exp(x), alias_input=x)
    b = a.copy()
    assert plain.execute([b]) == []
    np.testing.assert_allclose(b, want, rtol=1e-6)
    c = a.copy()
    assert _one_device_in_place().execute([c], comm=LocalCommunicator()) == []
    np.testing.assert_allclose(c, want, rtol=1e-6)


def test_sharded_in_place_into_read_only_or_a_number_is_refused() -> None:
    fd = _one_device_in_place()
    a = np.ones((2, 3), np.float32)
    a.flags.writeable = False
    with pytest.raises(KilnError, match=r"input 0 \(T0\): output 0 is written into it in place.*read-only"):
        fd.execute([a], comm=LocalCommunicator())
    with pytest.raises(KilnError, match=r"input 0 \(T0\): output 0 is written into it in place"):
        simulate(fd, [[a]])
    with pytest.raises(KilnError, match=r"input 0 \(T0\): output 0 is written into it in place.*float32"):
        simulate(fd, [[np.float32(1.0)]])
    np.testing.assert_array_equal(a, 1.0)


# -- 5. replicated input of the wrong size beside a sharded one ---------------------------


def test_replicated_weight_of_local_size_names_the_input() -> None:
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        y = fd.ops.add(x, fd.ops.broadcast_in_dim(w, [-1, -1], [1]))
        fd.add_output(y)
    _shard([x, y], mesh, axis=1)
    w.set_device_mesh(mesh)
    a = np.ones((2, 3), np.float32)
    with pytest.raises(KilnError, match=r"input 1 \(T1\): axis 0 has size 3 but input 0 \(T0\) axis 1 "
                                        r"has size 6"):
        simulate(fd, [[a, np.ones(3, np.float32)]] * 2)
    # The whole weight (every device's slices) runs.
    wv = np.arange(6, dtype=np.float32)
    outs: List[Any] = simulate(fd, [[a, wv], [a, wv]])
    for r, (o,) in enumerate(outs):
        want = a.astype(np.float64) + wv[3 * r:3 * r + 3].astype(np.float64)
        np.testing.assert_allclose(o, want, rtol=1e-6)


def test_allocation_domain_listing_an_axis_twice_names_both_entries() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    with pytest.raises(KilnError, match=r"set_allocation_domain T\d+: loop axis 0 \(\S+\) is listed twice, "
                                        r"at entries 0 and 1"):
        y.set_allocation_domain([0, 0], True)


def test_input_in_the_wrong_layout_for_its_allocation_domain_names_that_layout() -> None:
    # The input's declared layout is column-major: the message says so, not "row-major".
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    x.set_allocation_domain([1, 0], True)
    y.axis(0).parallelize(PT.BIDx)
    y.axis(1).parallelize(PT.TIDx)
    a = np.random.default_rng(3).standard_normal((3, 7)).astype(np.float32)
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 0 has stride 7 but must be contiguous in the "
                                        r"layout its allocation domain sets \(axes \[1, 0\]"):
        fd.execute([a])
    (got,) = fd.execute([np.asfortranarray(a)])
    np.testing.assert_allclose(got, np.exp(a.astype(np.float64)), rtol=1e-6)


def test_torch_tensors_with_device_cpu_are_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.exp(x))
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\) is a torch tensor: device='cpu' runs the CPU "
                                            r"interpreter on NumPy arrays, got torch"):
        fd.execute([torch.ones(3)], device="cpu")


def test_numpy_arrays_with_device_cuda_are_refused_by_name() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.define_tensor([-1])
        fd.add_output(fd.ops.add(x, y))
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\) is a NumPy array: device='cuda' needs CuPy"):
        fd.execute([np.ones(3, np.float32), np.ones(3, np.float32)], device="cuda")


@pytest.mark.parametrize("what", ["requires_grad_leaf", "inference"])
def test_in_place_into_a_torch_tensor_torch_would_refuse_is_refused_first(what: str) -> None:
    # torch raises these itself when the result is copied back, after the kernels ran.
    torch = pytest.importorskip("torch")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.exp(x), alias_input=x)
    if what == "requires_grad_leaf":
        t = torch.ones(3, requires_grad=True)
        match = r"input 0 \(T0\): output 0 is written into it in place .* leaf tensor that requires grad"
    else:
        with torch.inference_mode():
            t = torch.ones(3)
        match = r"input 0 \(T0\): output 0 is written into it in place .* inference tensor"
    with pytest.raises(KilnError, match=match):
        fd.execute([t])


def test_sparse_and_meta_torch_tensors_are_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x))
    for t, what in ((torch.eye(3).to_sparse(), "layout torch.sparse_coo"),
                    (torch.empty(3, 3, device="meta"), r"no data \(device 'meta'\)")):
        with pytest.raises(KilnTypeError, match=rf"input 0 \(T0\): .*a torch tensor of {what}"):
            fd.execute([t])


def test_torch_view_with_its_negative_bit_set_is_refused_by_name() -> None:
    # x.conj().imag shares memory holding the values before negation: read as it is, every
    # element came out negated.
    torch = pytest.importorskip("torch")
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.mul(x, 2.0))
    v = torch.complex(torch.ones(4), torch.arange(4.0)).conj().imag
    assert v.is_neg()
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): .*negative or conjugate bit set"):
        fd.execute([v])


@pytest.mark.gpu
def test_gpu_array_starting_inside_an_element_is_refused_by_name() -> None:
    # A float32 view one byte into a buffer: the GPU faults on its misaligned loads.
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.exp(x))
    buf = cp.zeros(4 * 1024 + 4, dtype=cp.uint8)
    odd = cp.ndarray((1024,), dtype=cp.float32, memptr=buf.data + 1)
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): its data starts at address 0x[0-9a-f]+, not a "
                                            r"multiple of its element size \(4 bytes\)"):
        fd.execute([odd])
    ok = cp.ndarray((1024,), dtype=cp.float32, memptr=buf.data + 4)
    (got,) = fd.execute([ok])
    np.testing.assert_allclose(cp.asnumpy(got), np.exp(cp.asnumpy(ok).astype(np.float64)), rtol=1e-6)
    with pytest.raises(KilnTypeError, match="not a multiple of its element size"):
        fd.execute([odd])  # after a cached call with the same shape and strides
