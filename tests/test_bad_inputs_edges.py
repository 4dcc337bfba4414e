"""Edges of the input contract found by probing kiln with hostile inputs, beyond
``test_bad_inputs.py`` and ``test_bad_inputs_more.py``: strides that no element stride
describes, constants a narrow integer type cannot hold, extreme diagonals and steps, ranks past
the NumPy bindings, offsets past 32 bits that only element counts show, sizes of the wrong
scalar type, errors that must come before any kernel runs, numbers past C's ranges in the
Python API, and sharded fusions (re-meshing, unused ops, ranks that disagree).

Every mistake is a ``KilnError`` (``KilnTypeError`` for a wrong type) raised before anything
runs; every accepted input gives NumPy's answer.
"""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np
import pytest
from kiln import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    KilnError,
    KilnTypeError,
    ParallelType,
    _core,
)
from kiln.multidevice import simulate
from numpy.lib.stride_tricks import as_strided

I32 = DataType.Int32
PT = ParallelType


def _one_input(build: Callable[[Any, Any], Any], dtype: DataType = DataType.Float) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=dtype)
        fd.add_output(build(fd, x))
    return fd


# ----------------------------------------------------------------------------- strides
def test_a_byte_stride_that_is_not_a_whole_element_is_refused_by_name() -> None:
    rec = np.zeros(4, dtype=[("a", "f4"), ("b", "i2")])
    rec["a"] = [1, 2, 3, 4]
    a = rec["a"]  # float32 values 6 bytes apart
    fd = _one_input(lambda fd, x: fd.ops.mul(x, 1.0))
    for run in (fd.execute, fd.lower):
        with pytest.raises(KilnTypeError, match=r"input 0 \(T0\).*axis 0 stride of 6 bytes is not a multiple "
                                                 r"of its 4-byte elements"):
            run([a])
    # A copy is fine, and so is a size-one axis whose stride nothing reads.
    np.testing.assert_array_equal(fd.execute([np.ascontiguousarray(a)])[0], [1, 2, 3, 4])
    one = as_strided(np.arange(4, dtype=np.float32), (1,), (6,))
    np.testing.assert_array_equal(fd.execute([one])[0], [0.0])


# ----------------------------------------------------------------------------- constants
@pytest.mark.parametrize("name,build", [
    ("add", lambda fd, x: fd.ops.add(x, 2**40)),
    ("add", lambda fd, x: fd.ops.add(x, 2**31)),
    ("eq", lambda fd, x: fd.ops.eq(x, 2**32 + 1)),
    ("lt", lambda fd, x: fd.ops.lt(x, -(2**31) - 1)),
    ("maximum", lambda fd, x: fd.ops.clamp(x, -(2**40), 2**40)),
    ("where", lambda fd, x: fd.ops.where(fd.ops.gt(x, 1), x, 2**40)),
    ("pad", lambda fd, x: fd.ops.pad(x, [1, 1], 2**40)),
], ids=["add_2^40", "add_2^31", "eq", "lt", "clamp", "where", "pad"])
def test_an_int_constant_outside_int32_is_refused_next_to_an_int32_tensor(name: str,
                                                                          build: Callable) -> None:
    with pytest.raises(KilnError, match=rf"{name}: the constant -?\d+ does not fit Int32"):
        _one_input(build, I32)


def test_int32_constants_at_the_edges_of_the_range_still_work() -> None:
    x = np.array([1, -2, 3], np.int32)
    fd = _one_input(lambda fd, t: fd.ops.add(fd.ops.mul(t, 0), 2**31 - 1), I32)
    np.testing.assert_array_equal(fd.execute([x])[0], [2**31 - 1] * 3)
    fd = _one_input(lambda fd, t: fd.ops.lt(t, -(2**31)), I32)
    np.testing.assert_array_equal(fd.execute([x])[0], [False] * 3)
    # An int64 tensor takes any int64 constant.
    fd = _one_input(lambda fd, t: fd.ops.add(t, 2**40), DataType.Int)
    np.testing.assert_array_equal(fd.execute([x.astype(np.int64)])[0], x.astype(np.int64) + 2**40)


def test_full_and_pad_refuse_values_their_integer_dtype_cannot_hold() -> None:
    with pytest.raises(KilnError, match=r"full: the constant 1099511627781 does not fit Int32"):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.full([2], 2**40 + 5, I32))
    with pytest.raises(KilnError, match=r"pad: the constant NaN has no int64 value"):
        _one_input(lambda fd, x: fd.ops.pad(x, [1, 1], float("nan")), DataType.Int)
    with pytest.raises(KilnError, match=r"pad: the constant inf has no int32 value"):
        _one_input(lambda fd, x: fd.ops.pad(x, [1, 1], float("inf")), I32)


# ----------------------------------------------------------------------------- extremes
@pytest.mark.parametrize("diagonal", [2**63 - 1, 2**62, 2**40, 3, -3, -(2**40), -(2**63)])
def test_triu_with_extreme_diagonals_matches_numpy(diagonal: int) -> None:
    a = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.triu(x, diagonal))
    want = np.triu(a, max(min(diagonal, 2**62), -(2**62)))
    np.testing.assert_array_equal(fd.execute([a])[0], want)
    np.testing.assert_array_equal(fd.execute([a], as_written=True)[0], want)


@pytest.mark.parametrize("step", [39, 40, 2**40, 2**61, 2**62, 2**63 - 1])
def test_slice_with_steps_past_the_axis_takes_one_element(step: int) -> None:
    a = np.arange(40, dtype=np.float32)
    fd = _one_input(lambda fd, x: fd.ops.slice(x, [1], [40], [step]))
    np.testing.assert_array_equal(fd.execute([a])[0], a[1:40:step])


def test_more_axes_than_the_interpreter_converts_is_an_error_not_a_panic() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 33)
        fd.add_output(fd.ops.mul(x, 2.0))
    with pytest.raises(KilnError, match=r"input 0 \(T0\) has 33 axes; the CPU interpreter takes arrays of at "
                                        r"most 32"):
        fd.execute([np.ones([1] * 32 + [3], np.float32)])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.broadcast_in_dim(x, [1] * 32 + [-1], [32]))
    with pytest.raises(KilnError, match=r"an output has 33 axes"):
        fd.execute([np.ones(3, np.float32)])


# ----------------------------------------------------------------------------- 32-bit indexing
def test_element_counts_past_2_to_31_choose_64_bit_offsets() -> None:
    # An expanded [2^16, 2^16] input spans 2^16 elements, but its reshape is indexed by
    # row-major positions up to 2^32.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(fd.ops.reshape(x, [2**15, 2**17]), [1]))
    a = as_strided(np.arange(2**16, dtype=np.float32), shape=(2**16, 2**16), strides=(0, 4))
    assert [la.index32 for la in fd.lower([a]).plan([a]).launches] == [False] * len(fd.lower([a]).kernels)
    small = as_strided(np.arange(64, dtype=np.float32), shape=(64, 64), strides=(0, 4))
    with FusionDefinition() as fd2:
        y = fd2.define_tensor([-1, -1])
        fd2.add_output(fd2.ops.sum(fd2.ops.reshape(y, [32, 128]), [1]))
    assert all(la.index32 for la in fd2.lower([small]).plan([small]).launches)
    # Random numbers are drawn at row-major positions too.
    with FusionDefinition() as fd3:
        fd3.add_output(fd3.ops.sum(fd3.ops.uniform(0.0, 1.0, [2**16, 2**16]), [1]))
    assert not any(la.index32 for la in fd3.lower([]).plan([]).launches)


def test_32_bit_offsets_leave_room_only_for_loops_that_round_up() -> None:
    # 2^30 elements whose splits divide every extent: no offset passes 2^30, so 32 bits.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x))
    a = as_strided(np.zeros(1, np.float32), shape=(2**15, 2**15), strides=(0, 0))
    assert all(la.index32 for la in fd.lower([a]).plan([a]).launches)
    # A split that does not divide its extent (5 rows by 128) loops past the tensor's end
    # before its predicate applies: such a kernel keeps 32 bits only below 2^30 elements.
    rows = 5

    def manual(columns: int) -> FusionDefinition:
        from kiln import ParallelType

        with FusionDefinition() as fd2:
            y = fd2.define_tensor([-1, -1], contiguity=[False, False])
            z = fd2.ops.neg(y)
            fd2.add_output(z)
        z.split(0, 128)
        z.split(2, 256)
        z.axis(0).parallelize(ParallelType.BIDy)
        z.axis(2).parallelize(ParallelType.BIDx)
        z.axis(3).parallelize(ParallelType.TIDx)
        return fd2

    big = as_strided(np.zeros(1, np.float32), shape=(rows, 2**28), strides=(0, 0))
    assert not any(la.index32 for la in manual(2**28).lower([big]).plan([big]).launches)
    small = as_strided(np.zeros(1, np.float32), shape=(rows, 2**20), strides=(0, 0))
    assert all(la.index32 for la in manual(2**20).lower([small]).plan([small]).launches)


def test_a_gathered_index_is_checked_before_a_32_bit_kernel_narrows_it() -> None:
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(t, i, 0))
    tab, idx = np.zeros((4, 8), np.float32), np.array([2**32 + 1])
    low = fd.lower([tab, idx])
    assert all(la.index32 for la in low.plan([tab, idx]).launches)
    src = low.kernels[0].cuda_source_for(True)
    assert "kiln::checkedIndex(" in src
    assert "(kiln_index_t)T1[" not in src and "(int64_t)T1[" in src
    with pytest.raises(KilnError, match=r"index tensor T1 holds 4294967297 at element 0"):
        fd.execute([tab, idx])


# ----------------------------------------------------------------------------- scalar types
@pytest.mark.parametrize("dtype", [DataType.Double, DataType.Bool])
def test_iota_and_full_sized_by_a_non_int_scalar_are_refused_when_defined(dtype: DataType) -> None:
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=dtype)
        with pytest.raises(KilnTypeError,
                           match=r"iota: the size of axis 0 \(s0\) has dtype \w+; sizes must be Int scalars"):
            fd.ops.iota(n)
        with pytest.raises(KilnTypeError, match=r"full: the size of axis 1 \(s0\) has dtype"):
            fd.ops.full([2, n], 1.0, DataType.Float)
        fd.add_output(fd.ops.full([2], 1.0, DataType.Float))


# ----------------------------------------------------------------------------- before launching
def _count_launches(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    launches: List[int] = []
    real = _core.execute_cpu

    def counting(kernel: Any, args: Any) -> Any:
        launches.append(1)
        return real(kernel, args)

    monkeypatch.setattr(_core, "execute_cpu", counting)
    return launches


def test_a_later_kernel_over_the_launch_limits_stops_the_call_before_the_first_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    fd.segment_after(y)
    y.axis(0).parallelize(PT.BIDx)
    y.split(1, 128)
    y.axis(2).parallelize(PT.TIDx)
    z.axis(0).parallelize(PT.BIDx)
    z.axis(1).parallelize(PT.TIDx)  # 2000 threads: only the second kernel is over the limit
    launches = _count_launches(monkeypatch)
    with pytest.raises(KilnError, match=r"launches 2000 threads per block"):
        fd.execute([np.ones((2, 2000), np.float32)])
    assert launches == []


def test_an_in_place_output_of_another_shape_is_refused_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [1], keepdim=True), alias_input=x)
    a = np.ones((3, 4), np.float32)
    launches = _count_launches(monkeypatch)
    with pytest.raises(KilnError, match=r"input 0 \(T0\): has shape \(3, 4\) but output 0, written into "
                                        r"it in place, has shape \(3, 1\); nothing was run"):
        fd.execute([a])
    assert launches == []
    np.testing.assert_array_equal(a, 1.0)
    # Where the shapes agree (a size-one row), the sum is written into x.
    b = np.arange(3, dtype=np.float32).reshape(3, 1)
    assert fd.execute([b]) == []
    np.testing.assert_array_equal(b, [[0], [1], [2]])


# ----------------------------------------------------------------------------- Python numbers
def test_numbers_past_c_ranges_in_the_python_api_are_kiln_errors() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.neg(x))
        with pytest.raises(KilnError, match=r"define_scalar: the integer is too large for a Double constant"):
            fd.define_scalar(10**400, dtype=DataType.Double)
    for size in (-1, 2**70):
        with pytest.raises(KilnError, match=rf"set_cluster: a cluster of {size} blocks along BIDy"):
            fd.set_cluster(PT.BIDy, size)
    with pytest.raises(KilnError, match=r"DeviceMesh: ranks are in \[0, 2\*\*31\)"):
        DeviceMesh([0, 2**64])


def test_define_tensor_takes_one_contiguity_flag_and_refuses_other_types() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=True)
        fd.add_output(fd.ops.mul(x, 3.0))
        with pytest.raises(KilnTypeError, match=r"contiguity must be a bool or a list of bools"):
            fd.define_tensor([-1, -1], contiguity="ab")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(fd.execute([a])[0], a * 3)
    with pytest.raises(KilnError, match=r"T0"):
        fd.execute([a.T])


# ----------------------------------------------------------------------------- sharded fusions
def _row_sum_sharded(unused: bool = False) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        if unused:
            fd.ops.exp(x)  # computed by nothing the outputs need
        fd.add_output(fd.ops.sum(x, [1]))
    x.set_device_mesh(DeviceMesh([0, 1]))
    x.split(1, 2, inner_split=False)
    x.axis(1).parallelize(PT.DIDx)
    return fd


def test_re_meshing_a_sharded_tensor_to_another_size_is_refused() -> None:
    with FusionDefinition() as fd2:
        y = fd2.define_tensor([-1, -1])
        fd2.add_output(fd2.ops.sum(y, [1]))
    y.set_device_mesh(DeviceMesh([0, 1]))
    y.split(1, 2, inner_split=False)
    y.axis(1).parallelize(PT.DIDx)
    with pytest.raises(KilnError, match=r"set_device_mesh T0: the tensor is split over its mesh of 2 "
                                        r"devices; a mesh of 3 would drop that sharding"):
        y.set_device_mesh(DeviceMesh([0, 1, 2]))
    y.set_device_mesh(DeviceMesh([1, 0]))  # the same size: the sharding stays
    assert y.axis(1).parallel_type == PT.DIDx


@pytest.mark.parametrize("unused", [False, True])
def test_a_sharded_fusion_with_an_unused_op_runs(unused: bool) -> None:
    fd = _row_sum_sharded(unused)
    a = np.arange(12, dtype=np.float32).reshape(2, 6)
    fd.lower([a[:, :3].copy()])
    outs = simulate(fd, [[a[:, :3].copy()], [a[:, 3:].copy()]])
    for rank_outs in outs:
        np.testing.assert_allclose(rank_outs[0], a.astype(np.float64).sum(1))


def test_simulated_ranks_whose_inputs_disagree_are_refused() -> None:
    fd = _row_sum_sharded()
    with pytest.raises(KilnError, match=r"input 0 has shape \(3, 3\) on rank 1 and \(2, 3\) on rank 0"):
        simulate(fd, [[np.ones((2, 3), np.float32)], [np.ones((3, 3), np.float32)]])
    with pytest.raises(KilnTypeError, match=r"simulate: rank 0: expected a list of inputs, got NoneType"):
        simulate(fd, [None, None])  # type: ignore[list-item]
    with pytest.raises(KilnTypeError, match=r"comm= takes a kiln.multidevice.Communicator"):
        fd.execute([np.ones((2, 3), np.float32)], comm="nccl")


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.int64(2)])
def test_a_bool_or_numpy_integer_for_a_size_scalar_is_the_int_it_stands_for(value: Any) -> None:
    """A Python bool is an int: it sizes a `full` and starts a slice as 1 or 0 (it was dropped
    from the plan's shape scalars, and the schedulers saw an unbound size)."""
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.full([n, 3], 2.0, DataType.Float))
        fd.add_output(fd.ops.slice(x, [n], [fd.ops.add(n, 2)]))
    k = int(value)
    a = np.arange(5, dtype=np.float32)
    full, sl = fd.execute([value, a])
    np.testing.assert_array_equal(full, np.full((k, 3), 2.0))
    np.testing.assert_array_equal(sl, a[k:k + 2])


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**32 + 1, 2**40 + 7])
def test_a_runtime_int_scalar_meeting_int32_must_fit_it(value: int) -> None:
    """As a constant it is refused at definition; as a runtime scalar it was cast and wrapped
    (x == 2**32 + 1 held for x == 1). PyTorch refuses such a value too."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], I32)
        s = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.eq(x, s))
        fd.add_output(fd.ops.add(x, s))
    a = np.array([1, 2, 3], np.int32)
    with pytest.raises(KilnError, match=r"the Int scalar s0 meets Int32 and must fit it"):
        fd.execute([a, value])
    eq, add = fd.execute([a, 2**31 - 1])  # the edge itself fits
    np.testing.assert_array_equal(eq, a == 2**31 - 1)
    np.testing.assert_array_equal(add, (a.astype(np.int64) + 2**31 - 1).astype(np.int32))


def test_as_written_in_place_updates_the_callers_strided_array() -> None:
    with FusionDefinition() as fd:
        p = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(p, 1.0), alias_input=p)
    for as_written in (False, True):
        target = np.zeros((3, 2), np.float32).T  # a transposed view
        assert fd.execute([target], as_written=as_written) == []
        np.testing.assert_array_equal(target, 1.0)


@pytest.mark.parametrize("value", [np.int64(5), 5])
def test_a_number_as_an_in_place_target_is_refused(value: Any) -> None:
    with FusionDefinition() as fd:
        c = fd.define_tensor([], DataType.Int)
        fd.add_output(fd.ops.add(c, 1), alias_input=c)
    with pytest.raises(KilnError, match=r"input 0 \(T0\): output 0 is written into it in place"):
        fd.execute([value])
    arr = np.array(5)
    fd.execute([arr])
    assert int(arr) == 6


def test_a_view_spread_past_the_interpreters_reach_is_a_kiln_error() -> None:
    """Three elements 2^30 places apart: the interpreter keeps a view's layout, so it would
    allocate the whole span (the process died of it); past 2^31 places it is a KilnError."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], DataType.Bool)
        fd.add_output(fd.ops.logical_not(x))
    buf = np.zeros(2**31 + 2, bool)  # untouched pages: no memory
    view = buf[:: 2**30]
    with pytest.raises(KilnError, match=r"input 0 \(T0\): a strided view of shape \[3\].*2\^31 places"):
        fd.execute([view])
    np.testing.assert_array_equal(fd.execute([buf[:: 2**20][:5]])[0], True)


def test_numpy_scalar_kinds_and_array_subclasses_are_taken_as_numbers_and_arrays() -> None:
    class Tagged(np.ndarray):
        pass

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], DataType.Double)
        s = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(x, s))
    a = np.arange(3, dtype=np.float64)
    for arr in (a, a.view(Tagged)):
        np.testing.assert_array_equal(fd.execute([arr, np.longdouble(1.5)])[0], a * 1.5)
        assert len(fd.lower([arr, np.float32(2.0)]).kernels) == 1


def test_a_scalar_names_itself_in_messages() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        n = fd.define_scalar(dtype=DataType.Int)
        assert repr(n) == "Scalar(s0: Int)"
        with pytest.raises(KilnError, match=r"axis 0 has a runtime Scalar stride \(s0\)"):
            fd.ops.slice(x, [0], [4], [n])
        fd.add_output(fd.ops.mul(x, 2.0))
