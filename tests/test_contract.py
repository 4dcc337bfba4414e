"""The input contract and the semantics around it: strided arrays, empty tensors,
broadcast_in_dim's expansion, inputs returned as outputs, half sums, Bool max/min, `where`
of numbers, index bounds. Each case against NumPy in float64, on the CPU (the automatic
schedule in the interpreter) and, marked ``gpu``, with CuPy and torch inputs."""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError

VIEWS = {
    "transposed": lambda b: b.T,
    "sliced": lambda b: b[:, 2:7],
    "stepped": lambda b: b[:, ::2],
    "fortran": np.asfortranarray,
    "expanded": lambda b: np.broadcast_to(b[:1], b.shape),
    "reversed": lambda b: b[::-1],
    "size_one_rows": lambda b: b[3:4, 1:],
}


def _base(rows: int = 13, cols: int = 37) -> np.ndarray:
    return (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 17 - 8) / 4


def _affine_and_sums() -> FusionDefinition:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.add(fd.ops.mul(a, 2.0), 1.0))
        fd.add_output(fd.ops.sum(a, dims=[1]))
        fd.add_output(fd.ops.sum(a, dims=[0]))
    return fd


def _expect_affine_and_sums(x: np.ndarray) -> List[np.ndarray]:
    x64 = x.astype(np.float64)
    return [x64 * 2 + 1, x64.sum(1), x64.sum(0)]


def _close(got: Any, want: np.ndarray, tol: float = 1e-4) -> None:
    got = np.asarray(got.get() if hasattr(got, "get") else got.cpu() if hasattr(got, "cpu") else got)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_strided_numpy_inputs_run_with_their_strides(view: str) -> None:
    x = VIEWS[view](_base())
    fd = _affine_and_sums()
    for got, want in zip(fd.execute([x]), _expect_affine_and_sums(x)):
        _close(got, want)


@pytest.mark.parametrize("view", ["transposed", "sliced", "fortran"])
def test_strided_input_beside_a_contiguous_one_of_a_normalization(view: str) -> None:
    # x - max(x) over rows, plus a contiguous bias: the strided input must not be vectorized.
    x = VIEWS[view](_base(16, 40))
    bias = np.linspace(-1, 1, x.shape[1]).astype(np.float32)
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        b = fd.define_tensor(shape=[-1])
        m = fd.ops.max(a, dims=[1], keepdim=True)
        row = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        fd.add_output(fd.ops.add(fd.ops.sub(a, m), row))
    (out,) = fd.execute([x, bias])
    x64 = x.astype(np.float64)
    _close(out, x64 - x64.max(1, keepdims=True) + bias)


def test_strided_kernels_are_cached_by_stride_pattern() -> None:
    fd = _affine_and_sums()
    b = _base()
    lows = {id(fd.lower([v(b)])) for v in (lambda y: y, lambda y: y.T.copy().T, lambda y: y)}
    assert len(lows) == 2


def test_declared_contiguity_is_enforced() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1], contiguity=[True, True])
        fd.add_output(fd.ops.neg(a))
    with pytest.raises(KilnError, match=r"input 0 \(T0\): axis 1 has stride 37 but is declared contiguous"):
        fd.execute([_base().T])


def test_empty_tensors_give_empty_outputs_and_sum_identities() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.exp(a))
        fd.add_output(fd.ops.sum(a, dims=[1]))
        fd.add_output(fd.ops.sum(a, dims=[0]))
    for shape in [(0, 4), (3, 0), (0, 0)]:
        x = np.ones(shape, np.float32)
        outs = fd.execute([x])
        for got, want in zip(outs, [np.exp(x.astype(np.float64)), x.sum(1), x.sum(0)]):
            _close(got, want)


def test_empty_tensors_through_intermediates_and_reductions() -> None:
    # exp -> sum over the empty axis -> scale: the identity flows through later ops.
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        s = fd.ops.sum(fd.ops.exp(a), dims=[1])
        fd.add_output(fd.ops.add(fd.ops.mul(s, 2.0), 1.0))
        fd.add_output(fd.ops.relu(a))
    x = np.ones((5, 0), np.float32)
    got, r = fd.execute([x])
    _close(got, np.ones(5))
    _close(r, np.zeros((5, 0)))
    for k in fd.lower([x]).kernels:
        assert "__global__" in k.cuda_source  # compiles for the GPU too


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_over_an_empty_axis_is_an_error(op: str) -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        fd.add_output(getattr(fd.ops, op)(a, dims=[1]))
    with pytest.raises(KilnError, match=rf"T1 = {op}\(\.\.\.\): axis 1 it reduces has size 0"):
        fd.execute([np.ones((3, 0), np.float32)])


@pytest.mark.parametrize(("shape", "dims", "n", "want"), [
    ([3, 3], [0], 3, (3, 3)), ([3, 5], [0], 3, (3, 5)), ([2, 4], [1], 4, (2, 4)),
    ([0, 0], [1], 0, (0, 0)), ([-1, 1], [0], 5, (5, 1)), ([2, 1, 3], [2], 3, (2, 1, 3)),
])
def test_broadcast_in_dim_expands_to_the_sizes_asked(shape: List[int], dims: List[int], n: int,
                                                      want: tuple) -> None:
    with FusionDefinition() as fd:
        b = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.broadcast_in_dim(b, shape=shape, broadcast_dims=dims))
    x = np.arange(n, dtype=np.float32)
    (out,) = fd.execute([x])
    view = [1] * len(shape)
    view[dims[0]] = n
    _close(out, np.broadcast_to(x.astype(np.float64).reshape(view), want))


def test_broadcast_in_dim_of_a_mismatched_size_is_an_error() -> None:
    with FusionDefinition() as fd:
        b = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.broadcast_in_dim(b, shape=[3, 4], broadcast_dims=[1]))
    with pytest.raises(KilnError, match=r"\(T0\): axis 0 has size 5 but the definition fixes it to 4"):
        fd.execute([np.ones(5, np.float32)])


def test_inputs_given_as_outputs_come_back_as_copies_in_order() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        y = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.add(x, y))
        fd.add_output(x)
        fd.add_output(y)
    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    s, xa, yb = fd.execute([a, b])
    _close(s, a + b.astype(np.float64))
    _close(xa, a.astype(np.float64))
    _close(yb, b.astype(np.float64))
    assert xa is not a
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        fd.add_output(x)
    _close(fd.execute([a])[0], a.astype(np.float64))


@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16])
def test_half_sums_accumulate_in_float(dtype: DataType) -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 1023)).astype(np.float32) + 3
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        h = fd.ops.cast(t, dtype)
        fd.add_output(fd.ops.cast(fd.ops.sum(h, dims=[1]), DataType.Float))
    (out,) = fd.execute([x])
    # The inputs rounded once to half; the sum rounded once: about 3 significant digits.
    rounded = fd.execute([x], as_written=True)[0]
    exact = x.astype(np.float64).sum(1)
    _close(out, exact, 0.01 * np.abs(exact).max())
    _close(out, np.asarray(rounded, np.float64), 0.01 * np.abs(exact).max())


@pytest.mark.parametrize(("op", "want"), [("max", [False, True, True]), ("min", [False, False, True])])
def test_bool_max_and_min_are_any_and_all(op: str, want: List[bool]) -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1], dtype=DataType.Bool)
        fd.add_output(getattr(fd.ops, op)(a, dims=[1]))
    x = np.array([[False, False], [True, False], [True, True]])
    (out,) = fd.execute([x])
    assert out.dtype == np.bool_ and out.tolist() == want


@pytest.mark.parametrize(("a", "b", "dtype"), [(0.1, -2.5, np.float32), (1, 2, np.int64),
                                                (True, False, np.bool_), (1, 2.5, np.float32)])
def test_where_of_two_numbers_has_pytorchs_default_dtype(a: Any, b: Any, dtype: Any) -> None:
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.where(fd.ops.ge(t, 0.0), a, b))
    (out,) = fd.execute([np.array([1.0, -1.0], np.float32)])
    assert out.dtype == dtype
    assert out.tolist() == [dtype(a).item(), dtype(b).item()]


@pytest.mark.parametrize("bad", [[0, 7, 2], [-3], [5]])
def test_out_of_range_indices_name_the_index_tensor(bad: List[int]) -> None:
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1])
        i = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(t, i, 0))
    first = next(k for k, v in enumerate(bad) if not 0 <= v < 5)
    want = rf"index tensor T1 holds {bad[first]} at element {first}; T0 has 5 entries"
    with pytest.raises(KilnError, match=want):
        fd.execute([np.ones((5, 3), np.float32), np.array(bad, np.int64)])


@pytest.mark.parametrize(("build", "message"), [
    (lambda fd: fd.define_tensor(shape=[2**64]), r"define_tensor T0: axis 0 has size 18446744073709551616"),
    (lambda fd: fd.define_scalar(2**70), "does not fit an Int"),
    (lambda fd: fd.define_scalar(2**40, dtype=DataType.Int32), "does not fit a Int32 constant"),
    (lambda fd: fd.ops.full(shape=[2**40, 2**40], value=1.0, dtype=DataType.Float),
     "more than 2\\^63 elements"),
])
def test_out_of_range_definitions_are_errors(build: Callable[[FusionDefinition], Any], message: str) -> None:
    fd = FusionDefinition()
    with pytest.raises(KilnError, match=message):
        build(fd)


def test_out_of_range_runtime_sizes_and_scalars_are_errors() -> None:
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.full(shape=[n, n], value=1.0, dtype=DataType.Float))
    with pytest.raises(KilnError, match="T0 axis 0: size -3 is negative"):
        fd.execute([-3])
    with pytest.raises(KilnError, match="more than 2\\^63 elements"):
        fd.execute([2**40])
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1], dtype=DataType.Int32)
        s = fd.define_scalar(dtype=DataType.Int32)
        fd.add_output(fd.ops.add(t, s))
    with pytest.raises(KilnError, match=r"input 1 \(s0\): 1099511627776 does not fit an Int32 scalar"):
        fd.execute([np.ones(3, np.int32), 2**40])
    with pytest.raises(KilnError, match=r"input 1 \(s0\): .* does not fit a Int32 scalar|does not fit"):
        fd.execute([np.ones(3, np.int32), 2**70])


def test_a_fusion_without_outputs_is_an_error_when_defined() -> None:
    with pytest.raises(KilnError, match="defines no outputs"):
        with FusionDefinition() as fd:
            fd.ops.neg(fd.define_tensor(shape=[-1]))


def test_one_place_raises_the_rank_mismatch() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    hits = [p for p in list((root / "rust" / "src").rglob("*.rs")) + list((root / "python").rglob("*.py"))
            if "does not match the definition's rank" in p.read_text()]
    assert [p.name for p in hits] == ["bind.rs"]


# GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("view", ["transposed", "sliced", "stepped", "fortran", "expanded"])
def test_gpu_strided_inputs(framework: str, view: str) -> None:
    base = _base()
    x = VIEWS[view](base)
    if framework == "cupy":
        cp = pytest.importorskip("cupy")
        dev = cp.lib.stride_tricks.as_strided(cp.asarray(base), x.shape, x.strides)
        if view == "fortran":
            dev = cp.asfortranarray(cp.asarray(base))
        elif view == "sliced":
            dev = cp.asarray(base)[:, 2:7]
        elif view == "stepped":
            dev = cp.asarray(base)[:, ::2]
    else:
        torch = pytest.importorskip("torch")
        tb = torch.tensor(base, device="cuda")
        dev = {"transposed": tb.T, "sliced": tb[:, 2:7], "stepped": tb[:, ::2],
               "fortran": tb.T.contiguous().T,
               "expanded": tb[:1].expand(*base.shape)}[view]
    fd = _affine_and_sums()
    for got, want in zip(fd.execute([dev]), _expect_affine_and_sums(x)):
        _close(got, want)


@pytest.mark.gpu
def test_gpu_out_of_range_index_is_reported_by_the_next_call_and_check_errors() -> None:
    cp = pytest.importorskip("cupy")
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1])
        i = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(t, i, 0))
    tab = cp.arange(15, dtype=cp.float32).reshape(5, 3)
    fd.execute([tab, cp.array([0, 7, 2], cp.int64)])
    with pytest.raises(KilnError, match="index tensor T1 held 7 at element 1; T0 has 5 entries"):
        fd.check_errors()
    fd.execute([tab, cp.array([-3, 0], cp.int64)])
    cp.cuda.Device().synchronize()
    with pytest.raises(KilnError, match="held -3 at element 0"):
        fd.execute([tab, cp.array([1, 0], cp.int64)])
    (out,) = fd.execute([tab, cp.array([4, 1], cp.int64)])
    _close(out, cp.asnumpy(tab)[[4, 1]].astype(np.float64))
    fd.check_errors()


@pytest.mark.gpu
def test_gpu_empty_tensors_and_expansion() -> None:
    cp = pytest.importorskip("cupy")
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.add(a, 1.0))
        fd.add_output(fd.ops.sum(a, dims=[0]))
    e, s = fd.execute([cp.ones((0, 4), cp.float32)])
    _close(e, np.ones((0, 4)))
    _close(s, np.zeros(4))
    with FusionDefinition() as fd:
        b = fd.define_tensor(shape=[-1])
        fd.add_output(fd.ops.broadcast_in_dim(b, shape=[3, 5], broadcast_dims=[0]))
    (out,) = fd.execute([cp.arange(3, dtype=cp.float32)])
    _close(out, np.repeat(np.arange(3.0)[:, None], 5, 1))
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1])
        fd.add_output(fd.ops.add(fd.ops.sum(fd.ops.exp(a), dims=[1]), 1.0))
    (out,) = fd.execute([cp.ones((5, 0), cp.float32)])
    _close(out, np.ones(5))


def _copy(shape: List[int]) -> Any:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=shape)
        y = fd.ops.neg(x)
        fd.add_output(y)
    return fd, y


@pytest.mark.parametrize(("schedule", "inputs", "message"), [
    ("tidx_2048", (2048,), r"2048 threads per block \(2048 x 1 x 1\); the GPU allows at most 1024"),
    ("tidy_tidx", (64, 32), r"2048 threads per block \(32 x 64 x 1\)"),
    ("grid_y", (70000, 1), r"gridDim.y = 70000 blocks; the GPU allows at most 65535"),
])
def test_launch_limits_are_checked_on_every_path(schedule: str, inputs: tuple, message: str) -> None:
    from kiln import ParallelType

    if schedule == "tidx_2048":
        fd, y = _copy([2048])
        y.axis(0).parallelize(ParallelType.TIDx)
    elif schedule == "tidy_tidx":
        fd, y = _copy([-1, -1])
        y.axis(0).parallelize(ParallelType.TIDy)
        y.axis(1).parallelize(ParallelType.TIDx)
    else:
        fd, y = _copy([-1, -1])
        y.axis(0).parallelize(ParallelType.BIDy)
    x = np.ones(inputs, np.float32)
    # Static sizes at lowering; symbolic ones when the plan or the interpreter binds them.
    with pytest.raises(KilnError, match=message):
        fd.lower([x]).plan([x])
    with pytest.raises(KilnError, match=message):
        fd.execute([x])


def test_shared_memory_past_the_target_is_refused_at_lowering() -> None:
    from kiln import MemoryType

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[65536])
        t = fd.ops.exp(x)
        fd.add_output(fd.ops.neg(t))
    t.set_memory_type(MemoryType.Shared)
    want = r"262144 bytes of Shared memory per block; the target allows at most 232448"
    with pytest.raises(KilnError, match=want):
        fd.lower([np.ones(65536, np.float32)])


@pytest.mark.parametrize("rows", [1, 7, 31, 130])
def test_gather_from_a_computed_table_reads_what_other_threads_wrote(rows: int) -> None:
    # The table is computed in the kernel; the index picks rows another thread computed, so
    # the table cannot stay in that thread's registers (it was read uninitialized).
    with FusionDefinition() as fd:
        ids = fd.define_tensor([rows], dtype=DataType.Int32)
        table = fd.ops.broadcast_in_dim(fd.ops.cast(ids, DataType.Float), shape=[-1, -1], broadcast_dims=[0])
        fd.add_output(fd.ops.index_select(table, ids, 0))
    i = np.random.default_rng(rows).integers(0, rows, rows).astype(np.int32)
    (out,) = fd.execute([i])
    _close(out, i.astype(np.float64)[i][:, None])
