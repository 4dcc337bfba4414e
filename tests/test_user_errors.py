"""Mistakes a user can make that kiln must refuse with a ``KilnError`` naming what is wrong, before
anything runs, instead of answering silently (a wrapped size, an uneven shard's mean, a
Vectorize that moves one element at a time) or failing inside Python; and NumPy numbers, which
users pass where Python numbers go, taken as the numbers they hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kiln import DataType, DeviceMesh, FusionDefinition, KilnError, KilnTypeError, ParallelType
from kiln.cli import main as cli_main
from kiln.multidevice import simulate


@pytest.mark.parametrize("op,a,b,what", [
    ("mul", 2**62, 4, "outside the Int"),
    ("add", 2**63 - 1, 1, "outside the Int"),
    ("sub", -(2**63), 1, "outside the Int"),
    ("div", 6, 0, "divided by zero"),
    ("fmod", 6, 0, "divided by zero"),
    ("remainder", 6, 0, "divided by zero"),
])
def test_integer_constants_fold_exactly_or_raise(op: str, a: int, b: int, what: str) -> None:
    with FusionDefinition() as fd:
        fd.define_tensor([-1], DataType.Float)
        with pytest.raises(KilnError, match=rf"{op}: .*{what}"):
            getattr(fd.ops, op)(a, b)
        # In range, the fold is exact and sizes a tensor.
        n = fd.ops.mul(3, 4)
        fd.add_output(fd.ops.full([n], 1.0, DataType.Float))
    (out,) = fd.execute([np.ones(2, np.float32)])
    assert out.shape == (12,)


def test_a_size_divided_by_a_runtime_zero_names_the_tensor_and_axis() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        s = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.full([fd.ops.div(fd.ops.size(x, 0), s)], 1.0, DataType.Float))
    with pytest.raises(KilnError, match=r"T\d+ axis 0: its size i0 / s0 divides by zero"):
        fd.execute([np.ones((2, 3), np.float32), 0])
    (out,) = fd.execute([np.ones((6, 3), np.float32), 2])
    np.testing.assert_array_equal(out, np.ones(3))


def test_plan_checks_its_inputs_against_the_definition() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[1]))
    a = np.ones((4, 8), np.float32)
    low = fd.lower([a])
    assert low.plan([a]) is not None
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): unsupported dtype int8; expected float32"):
        low.plan([np.ones((4, 8), np.int8)])
    with pytest.raises(KilnTypeError, match=r"input 0 \(T0\): expected an array"):
        low.plan(["a"])
    with pytest.raises(KilnTypeError, match=r"plan: inputs must be a list"):
        low.plan(None)  # type: ignore[arg-type]
    with pytest.raises(KilnError, match=r"input 0 \(T0\): rank 1 does not match the definition's rank 2"):
        low.plan([np.ones(3, np.float32)])


def test_a_second_cluster_dimension_is_refused() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[0]))
    fd.set_cluster(ParallelType.BIDy, 4)
    fd.set_cluster(ParallelType.BIDy, 2)  # the same dimension: the new size
    with pytest.raises(KilnError, match=r"already has clusters of 2 blocks along BIDy"):
        fd.set_cluster(ParallelType.BIDx, 4)


def test_vectorize_of_an_axis_that_is_not_contiguous_is_refused() -> None:
    def build(transposed: bool) -> FusionDefinition:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1], DataType.Float)
            z = fd.ops.add(fd.ops.exp(x), 1.0)
            fd.add_output(z)
        c = x.cache_after()
        for t in (c, z):
            if transposed:
                t.reorder({0: 1})  # the vector would walk the rows
            t.split(1, 4)
            t.axis(0).parallelize(ParallelType.BIDx)
            t.axis(1).parallelize(ParallelType.TIDx)
        c.axis(-1).parallelize(ParallelType.Vectorize)
        c.inline_at(-1)
        return fd

    a = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    with pytest.raises(KilnError, match=r"its Vectorize axis .* reads T0 with consecutive lanes .*"
                       r"Vectorize needs the axis that walks T0's contiguous innermost axis"):
        build(True).lower([a])
    (got,) = build(False).execute([a])
    np.testing.assert_allclose(got, np.exp(a.astype(np.float64)) + 1.0, rtol=1e-6)


def test_simulated_ranks_with_uneven_shards_are_refused() -> None:
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.mean(x, dims=[1]))
    x.set_device_mesh(mesh)
    x.split(1, 2, inner_split=False)
    x.axis(1).parallelize(ParallelType.DIDx)
    a = np.arange(24, dtype=np.float32).reshape(3, 8)
    with pytest.raises(KilnError, match=r"input 0 has shape \(3, 3\) on rank 1 and \(3, 4\) on rank 0"):
        simulate(fd, [[a[:, :4]], [a[:, 4:7]]])
    r = simulate(fd, [[a[:, :4]], [a[:, 4:]]])
    for rank in r:
        np.testing.assert_allclose(rank[0], a.astype(np.float64).mean(1), rtol=1e-6)


def test_pad_fills_with_a_number_or_a_0d_tensor_only() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], DataType.Float)
        with pytest.raises(KilnTypeError, match=r"pad: value must be a number, a Scalar or a 0-d tensor"):
            fd.ops.pad(x, [1, 1], x)
        fd.add_output(fd.ops.pad(x, [1, 2], fd.ops.sum(x, [0])))
    a = np.arange(3, dtype=np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_array_equal(got, [3, 0, 1, 2, 3, 3])


def test_numpy_numbers_are_the_numbers_they_hold() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([np.int64(-1), -1], DataType.Float)
        y = fd.ops.add(fd.ops.mul(x, np.float32(0.5)), np.int64(2))
        fd.add_output(y)
    y.split(np.int64(1), np.int64(4))
    y.axis(np.int64(0)).parallelize(ParallelType.BIDx)
    a = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a.astype(np.float64) * 0.5 + 2.0, rtol=1e-6)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.where(fd.ops.gt(x, np.float64(0.0)), np.bool_(True), False))
    (positive,) = fd.execute([a])
    np.testing.assert_array_equal(positive, a > 0)


@pytest.mark.parametrize("arg", ["-5", "0", "x"])
def test_the_demo_refuses_bad_sizes_as_usage_errors(arg: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--rows", arg])
    assert e.value.code == 2
    assert "argument --rows: expected" in capsys.readouterr().err


def test_numpy_integers_size_full_iota_and_reshape() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        r = fd.ops.reshape(x, (np.int64(2), np.int32(6)))
        fd.add_output(fd.ops.add(r, fd.ops.full([np.int64(2), 6], 1.5, DataType.Float)))
        fd.add_output(fd.ops.iota(np.int64(4)))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    got, idx = fd.execute([a])
    np.testing.assert_array_equal(got, a.reshape(2, 6) + 1.5)
    np.testing.assert_array_equal(idx, np.arange(4))


@pytest.mark.parametrize("value", [np.float32("nan"), np.float32("inf"), np.float32(1.5), np.float64(2.5)])
@pytest.mark.parametrize("dtype", [DataType.Int, DataType.Int32])
def test_integer_constants_refuse_numpy_floats_that_are_not_integers(value: Any, dtype: DataType) -> None:
    with FusionDefinition() as fd:
        with pytest.raises(KilnTypeError, match=r"define_scalar: .* is not an integer"):
            fd.define_scalar(value, dtype=dtype)
        fd.add_output(fd.define_tensor([-1], DataType.Float))


def test_numpy_booleans_are_flags() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float, contiguity=np.True_)
        y = fd.define_tensor([-1, -1], DataType.Float, contiguity=[np.True_, np.True_])
        s = fd.define_scalar(np.True_, dtype=DataType.Int)
        fd.add_output(fd.ops.add(fd.ops.add(x, y), s))
    a = np.ones((2, 3), np.float32)
    (got,) = fd.execute([a, a])
    np.testing.assert_array_equal(got, np.full((2, 3), 3.0))


@pytest.mark.parametrize("build", [
    lambda fd, x: fd.ops.sum(x, [1], keepdim="False"),
    lambda fd, x: fd.ops.max(x, [1], keepdim=[]),
    lambda fd, x: fd.ops.var_mean(x, [1], keepdim="no")[0],
], ids=["sum_keepdim_str", "max_keepdim_list", "var_mean_keepdim_str"])
def test_yes_no_options_take_bools_only(build: Any) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        with pytest.raises(KilnTypeError, match=r"keepdim: expected a bool"):
            build(fd, x)
        fd.add_output(x)


def test_execute_and_split_options_take_bools_only() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        y = fd.ops.neg(x)
        fd.add_output(y)
    with pytest.raises(KilnTypeError, match=r"execute: as_written: expected a bool"):
        fd.execute([np.ones((2, 2), np.float32)], as_written="no")
    with pytest.raises(KilnTypeError, match=r"inner_split: expected a bool"):
        y.split(1, 2, inner_split="no")


def test_sub_of_two_bools_is_refused() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1], DataType.Bool)
        b = fd.define_tensor([-1], DataType.Bool)
        with pytest.raises(KilnTypeError, match=r"sub: T0 and T1 promote to bool; sub is not defined"):
            fd.ops.sub(a, b)
        fd.add_output(fd.ops.logical_xor(a, b) if hasattr(fd.ops, "logical_xor") else fd.ops.ne(a, b))
    x, y = np.array([True, False, True]), np.array([True, True, False])
    (got,) = fd.execute([x, y])
    np.testing.assert_array_equal(got, x ^ y)


def test_simulate_needs_a_sharded_fusion_with_outputs() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.exp(x))
    with pytest.raises(KilnError, match=r"not sharded .*fd\.execute"):
        simulate(fd, [[np.ones((2, 4), np.float32)]])
    fd = FusionDefinition()
    x = fd.define_tensor([-1, -1], DataType.Float)
    x.set_device_mesh(DeviceMesh([0, 1]))
    with pytest.raises(KilnError, match=r"no outputs"):
        simulate(fd, [[np.ones((2, 4), np.float32)], [np.ones((2, 4), np.float32)]])


def test_a_size_past_any_gpu_names_the_tensor_and_axis() -> None:
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.full([3, n], 1.0, DataType.Double))
    with pytest.raises(KilnError, match=r"T\d+: its shape \[3, 2305843009213693952\] .* axis 1 has size"):
        fd.execute([2**61])


def test_a_non_contiguous_output_axis_names_the_tensor_and_axis() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        z = fd.ops.neg(x)
        fd.add_output(z)
    z.set_allocation_domain([0, 1], [False, True])
    with pytest.raises(KilnError, match=rf"{z.name}: axis 0 is marked non-contiguous"):
        fd.execute([np.ones((2, 3), np.float32)])


def test_the_demo_refuses_sizes_it_cannot_hold(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--rows", "1", "--cols", str(2**62)])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--rows", "100000", "--cols", "100000"])
    assert e.value.code == 2
    assert "elements" in capsys.readouterr().err


def test_an_inner_split_of_a_sharded_input_points_to_the_outer_split() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.exp(x))
    x.set_device_mesh(DeviceMesh([0, 1]))
    with pytest.raises(KilnError, match=rf"split {x.name}: .*inner_split=False"):
        x.split(0, 2)
    x.split(0, 2, inner_split=False)


@pytest.mark.parametrize("dims", [[np.uint64(2**63)], [2**70], (-(2**64),)])
def test_a_reduction_axis_past_64_bits_names_the_tensor(dims: Any) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        with pytest.raises(KilnError, match=rf"sum: axis -?\d+ is out of range for {x.name} of rank 2"):
            fd.ops.sum(x, dims)
        fd.add_output(x)


@pytest.mark.parametrize("index32", [5, "yes", None, 1.0])
def test_cuda_source_for_takes_a_bool(index32: Any) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], DataType.Float)
        fd.add_output(fd.ops.neg(x))
    k = fd.lower([np.zeros(3, np.float32)]).kernels[0]
    if index32 is None:
        assert k.cuda_source_for(index32) == k.cuda_source_for(False)
        return
    with pytest.raises(KilnTypeError, match="cuda_source_for: index32: expected a bool"):
        k.cuda_source_for(index32)
    assert k.cuda_source_for(np.bool_(True)) == k.cuda_source_for(True)


def test_unswitch_of_a_symbolic_axis_names_the_unswitch() -> None:
    from kiln import ParallelType as PT

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    for t in (y, z):
        t.split(1, 8)
        t.split(1, 2)  # [m, n/16, 2, 8]
        t.axis(0).parallelize(PT.BIDx)
        t.axis(1).parallelize(PT.Unswitch)
        t.axis(-1).parallelize(PT.TIDx)
    y.inline_at(-1)
    with pytest.raises(KilnError, match=rf"{y.name} is in Local memory .* its axis 1 .* is unswitched"):
        fd.execute([np.ones((4, 40), np.float32)])


def test_an_integer_iota_refuses_a_fractional_start_or_step() -> None:
    """``iota(4, 0, 0.5, Int)`` cut the step to 0 (all zeros): refused, integral floats kept."""
    with pytest.raises(KilnTypeError, match=r"iota: step 0.5 is not an integer; an Int iota"), \
            FusionDefinition() as fd:
        fd.ops.iota(4, 0, 0.5, dtype=DataType.Int)
    with pytest.raises(KilnTypeError, match=r"iota: step s\d+ is not an integer"), FusionDefinition() as fd:
        fd.ops.iota(4, 0, fd.define_scalar(dtype=DataType.Double), dtype=DataType.Int)
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.iota(4, 1.0, 2.0, dtype=DataType.Int32))
        fd.add_output(fd.ops.iota(4, 1, 0.5, dtype=DataType.Float))
    a, b = fd.execute([])
    np.testing.assert_array_equal(a, [1, 3, 5, 7])
    np.testing.assert_array_equal(b, [1.0, 1.5, 2.0, 2.5])


def test_flags_and_bools_are_bools() -> None:
    with pytest.raises(KilnTypeError, match=r"define_scalar: 2.5 is not a bool"), FusionDefinition() as fd:
        fd.define_scalar(2.5, dtype=DataType.Bool)
    flag = r"broadcast: is_broadcast_dim\[0\]: expected a bool, got 'False'"
    with pytest.raises(KilnTypeError, match=flag), FusionDefinition() as fd:
        fd.ops.broadcast(fd.define_tensor([-1]), ["False", False])


def test_numpy_integers_as_slice_pad_and_select_positions() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.slice(x, [np.int64(1)], [np.int32(4)]))
        fd.add_output(fd.ops.pad(x, [np.int64(1), np.int64(2)]))
        fd.add_output(fd.ops.select(x, 0, np.int64(2)))
    a = np.arange(6, dtype=np.float32)
    s, p, e = fd.execute([a])
    np.testing.assert_array_equal(s, a[1:4])
    np.testing.assert_array_equal(p, np.pad(a, (1, 2)))
    assert float(e) == 2.0



@pytest.mark.parametrize("pt, word", [(ParallelType.Unroll, "unrolled"),
                                      (ParallelType.Unswitch, "unswitched")])
def test_an_unrolled_or_unswitched_runtime_axis_is_named(pt: ParallelType, word: str) -> None:
    """Only the output scheduled, ``[BIDx, Unroll|Unswitch(ceilDiv(n, 4)), TIDx]``: the untouched
    producer that follows it needs registers for every iteration of that runtime-sized loop;
    the error names the unrolled or unswitched axis, not only the producer's allocation."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.ops.neg(fd.ops.exp(x))
        fd.add_output(z)
    z.split(1, 4)
    z.axis(0).parallelize(ParallelType.BIDx)
    z.axis(1).parallelize(pt)
    z.axis(2).parallelize(ParallelType.TIDx)
    named = rf"T1 is in Local memory.*axis 1 \(i\w+\{{ceilDiv\(i1, 4\)\}}\) is {word}"
    with pytest.raises(KilnError, match=named):
        fd.execute([np.ones((3, 11), np.float32)])


def test_an_output_no_gpu_holds_is_refused_by_its_size() -> None:
    """``full([2**62])`` and an expand to ``[2**31, 2**31]``: the error gives the output's
    shape and bytes, not the schedulers' refusals of its grid."""
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.full([2**62], 1.0, DataType.Float))
    huge = r"T\d+: its shape \[4611686018427387904\] \(float\) needs 2\^63 or more bytes"
    with pytest.raises(KilnError, match=huge):
        fd.execute([])
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, 1])
        fd.add_output(fd.ops.expand(x, [2**31, 2**31]))
    with pytest.raises(KilnError, match=r"its shape \[2147483648, 2147483648\].*more than any GPU holds"):
        fd.execute([np.ones((1, 1), np.float32)])
