"""More user mistakes (and odd but valid inputs), beyond ``test_bad_inputs.py`` and ``test_errors.py``.

Three areas: definition-time misuse (foreign handles, axes and sizes out of range, ints past 64
bits, bad shape-op arguments), run-time binding (dtypes NumPy can describe but kiln cannot run,
scalars of the wrong kind, overlapping and odd strides, index values out of range, runtime sizes
that disagree or overflow, empty tensors, NaN/inf, in-place outputs) and hand schedules (launch
limits, memory limits, vectorize widths, inconsistent parallelization and inlining, scheduling
inputs). Every mistake must be a ``KilnError`` (``KilnTypeError`` for a wrong type) naming the
tensor/axis, raised before anything runs; every accepted input must give NumPy's (float64)
answer. The cases that could hang or crash run in a child interpreter.
"""

from __future__ import annotations

import fractions
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from error_util import ax, close, expect, f64, inp, rnd, run_child, tv
from kiln import (
    DataType,
    FusionDefinition,
    IterDomain,
    KilnError,
    KilnTypeError,
    MemoryType,
    ParallelType,
    Scalar,
    Tensor,
)
from numpy.lib.stride_tricks import as_strided, sliding_window_view

F = DataType.Float
PT = ParallelType
MT = MemoryType
BIG = 2**70  # an int no 64-bit field holds

# ======================================================================================
# helpers
# ======================================================================================


def np_var(a: np.ndarray, axis: int, ddof: int) -> np.ndarray:
    """NumPy's variance in float64, quietly (a divisor <= 0 gives inf or NaN, as in PyTorch)."""
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.var(f64(a), axis=axis, ddof=ddof)


# ======================================================================================
# 1. Definition-time misuse
# ======================================================================================


def _def(
    body: Callable[[FusionDefinition, Tensor], Any], shape: Sequence[int] = (-1, -1), dtype: DataType = F
) -> Callable[[], None]:
    """A fusion with input x = T0 of ``shape``; ``body(fd, x)`` must raise (else its tensor
    result, or -x, is the output)."""

    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=list(shape), dtype=dtype)
            out = body(fd, x)
            fd.add_output(out if isinstance(out, Tensor) else fd.ops.neg(x))

    return run


def _idx(fd: FusionDefinition, shape: Sequence[int], dtype: DataType = DataType.Int) -> Tensor:
    return fd.define_tensor(shape=list(shape), dtype=dtype)


DEFINITION_ERRORS = [
    # sizes as scalars
    pytest.param(
        _def(lambda fd, x: fd.ops.full([fd.ops.size(x, 5)], 1.0, F)),
        KilnError,
        (tv(0), ax(5)),
        id="size_axis_out_of_range",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([fd.ops.size(x, -3)], 1.0, F)),
        KilnError,
        (tv(0), r"axis -3"),
        id="size_axis_negative_out_of_range",
    ),
    # squeeze
    pytest.param(
        _def(lambda fd, x: fd.ops.squeeze(x, [0]), (3, -1)),
        KilnError,
        (tv(0), ax(0), r"\b3\b"),
        id="squeeze_size_3",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.squeeze(x, [4]), (1, -1)),
        KilnError,
        (tv(0), ax(4)),
        id="squeeze_axis_out_of_range",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.squeeze(x, [0, 0]), (1, -1)),
        KilnError,
        (tv(0), ax(0), r"twice"),
        id="squeeze_axis_twice",
    ),
    # reshape
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [5, 5]), (4, 6)),
        KilnError,
        (tv(0), r"\b24\b", r"\b25\b"),
        id="reshape_24_to_25",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [5, -1]), (4, 6)),
        KilnError,
        (tv(0), r"\b24\b"),
        id="reshape_infer_not_divisible",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [0, -1]), (4, 6)),
        KilnError,
        (tv(0), r"\b24\b"),
        id="reshape_zero_then_infer",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [-1, -1]), (4, 6)),
        KilnError,
        (tv(0), r"one size may be -1"),
        id="reshape_two_inferred",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [-2, 12]), (4, 6)),
        KilnError,
        (r"-2", r"negative"),
        id="reshape_negative_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [4.0, 6]), (4, 6)),
        KilnTypeError,
        (r"reshape", r"4\.0"),
        id="reshape_float_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [True, 24]), (4, 6)),
        KilnTypeError,
        (r"reshape", r"True"),
        id="reshape_bool_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [fd.define_scalar(dtype=DataType.Double), -1])),
        KilnTypeError,
        (r"reshape", r"s0", r"Int"),
        id="reshape_double_scalar_size",
    ),
    # slice / select / pad / cat / triu
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0], [1])), KilnError, (tv(0), r"rank 2"), id="slice_rank"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0, 0], [4, 6], [0, 1]), (4, 6)),
        KilnError,
        (ax(0), r"stride 0"),
        id="slice_step_0",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0, 0], [4, 6], [1, -2]), (4, 6)),
        KilnError,
        (ax(1), r"stride -2"),
        id="slice_step_negative",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0.5, 0], [4, 6]), (4, 6)),
        KilnTypeError,
        (r"slice", r"0\.5"),
        id="slice_float_start",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [fd.define_scalar(dtype=DataType.Double), 0], [4, 6]), (4, 6)),
        KilnTypeError,
        (r"slice", r"s0", r"Int"),
        id="slice_double_scalar_start",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.select(x, 0, 4), (4, 6)),
        KilnError,
        (tv(0), ax(0), r"index 4"),
        id="select_index_4_of_4",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.select(x, 2, 0), (4, 6)),
        KilnError,
        (tv(0), ax(2)),
        id="select_dim_out_of_range",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.select(x, 0, -5), (4, 6)),
        KilnError,
        (tv(0), ax(0), r"-5", r"\[-size, size\)"),
        id="select_negative_index_past_the_start",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [1]), (4, 6)), KilnError, (tv(0), r"even"), id="pad_odd_widths"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [1] * 6), (4, 6)),
        KilnError,
        (tv(0), r"at most 4"),
        id="pad_too_many_widths",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [-4, -4]), (4, 6)),
        KilnError,
        (tv(0), ax(1), r"-2"),
        id="pad_crops_more_than_the_axis",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [1.5, 1]), (4, 6)),
        KilnTypeError,
        (r"pad", r"1\.5"),
        id="pad_float_width",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [1, 1], "a"), (4, 6)),
        KilnTypeError,
        (r"pad", r"'a'"),
        id="pad_str_value",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [1, 1], x), (4, 6)),
        KilnTypeError,
        (tv(0), r"rank 2", r"0-d tensor"),
        id="pad_value_is_a_ranked_tensor",
    ),
    pytest.param(_def(lambda fd, x: fd.ops.cat([], 0)), KilnError, (r"at least one",), id="cat_nothing"),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, x], 2)), KilnError, (tv(0), ax(2)), id="cat_dim_2_of_rank_2"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, x], -3)), KilnError, (tv(0), r"axis -3"), id="cat_dim_minus_3"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, fd.define_tensor([-1])], 0)),
        KilnError,
        (tv(1), tv(0), r"rank"),
        id="cat_ranks_differ",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, fd.define_tensor([4, 5])], 0), (4, 6)),
        KilnError,
        (tv(1), tv(0), ax(1), r"\b5\b", r"\b6\b"),
        id="cat_other_axis_differs",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, 1.0], 0)), KilnTypeError, (r"cat", r"Tensor"), id="cat_number"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, x], 0), ()), KilnError, (tv(0), ax(0), r"rank 0"), id="cat_0d"
    ),
    pytest.param(_def(lambda fd, x: fd.ops.triu(x), (4,)), KilnError, (tv(0), r"rank 1"), id="triu_1d"),
    # broadcast_in_dim / expand
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [-5, 4, 6], [1, 2]), (4, 6)),
        KilnError,
        (ax(0), r"-5"),
        id="broadcast_in_dim_size_minus_5",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2, 4, 6], [-2, -1]), (4, 6)),
        KilnError,
        (tv(0), r"-2"),
        id="broadcast_in_dim_negative_dims",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2**62, 4, 6], [1, 2]), (4, 6)),
        KilnError,
        (r"2\^63",),
        id="broadcast_in_dim_2_66_elements",
    ),
    pytest.param(
        _def(
            lambda fd, x: fd.ops.broadcast_in_dim(x, [fd.define_scalar(dtype=DataType.Double), 4, 6], [1, 2]),
            (4, 6),
        ),
        KilnTypeError,
        (r"broadcast_in_dim", r"integer"),
        id="broadcast_in_dim_double_scalar_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [0, 6], [0, 1]), (4, 6)),
        KilnError,
        (tv(0), ax(0), r"\b4\b", r"\b0\b"),
        id="broadcast_in_dim_static_4_asked_0",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.expand(x, [5, 6]), (4, 6)),
        KilnError,
        (tv(0), ax(0), r"\b4\b", r"\b5\b"),
        id="expand_non_one_axis",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.expand(x, [-3, 6]), (1, 6)),
        KilnError,
        (ax(0), r"-3"),
        id="expand_to_minus_3",
    ),
    # take_along_axis / gather / index_select
    pytest.param(
        _def(lambda fd, x: fd.ops.take_along_axis(x, _idx(fd, [-1, -1], F), 0)),
        KilnTypeError,
        (tv(1), r"Int"),
        id="take_along_axis_float_index",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.take_along_axis(x, _idx(fd, [-1, -1], DataType.Bool), 0)),
        KilnTypeError,
        (tv(1), r"Int"),
        id="take_along_axis_bool_index",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.take_along_axis(x, _idx(fd, [-1]), 0)),
        KilnError,
        (tv(1), tv(0), r"rank"),
        id="take_along_axis_index_rank_1",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.take_along_axis(x, _idx(fd, [-1, -1]), 2)),
        KilnError,
        (tv(0), ax(2)),
        id="take_along_axis_dim_2",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.take_along_axis(x, _idx(fd, [3, 5]), 0), (4, 6)),
        KilnError,
        (tv(1), tv(0), ax(1), r"\b5\b", r"\b6\b"),
        id="take_along_axis_off_dim_size_differs",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.gather(x, _idx(fd, [-1, -1], DataType.Half), 1)),
        KilnTypeError,
        (tv(1), r"Int"),
        id="gather_half_index",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.gather(x, _idx(fd, [5, 2]), 1), (4, 6)),
        KilnError,
        (tv(1), tv(0), ax(0), r"\b5\b", r"\b4\b"),
        id="gather_index_larger_off_dim",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.index_select(x, _idx(fd, [-1]), 0), ()),
        KilnError,
        (tv(0), ax(0)),
        id="index_select_of_0d",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.index_select(x, 1, 0)),
        KilnTypeError,
        (r"index_select", r"Tensor"),
        id="index_select_number_index",
    ),
    # statistics and reductions
    pytest.param(
        _def(lambda fd, x: fd.ops.var(x, [1]), (4, 6), DataType.Int),
        KilnTypeError,
        (tv(0), r"floating"),
        id="var_of_int",
    ),
    pytest.param(_def(lambda fd, x: fd.ops.var(x, [2]), (4, 6)), KilnError, (tv(0), ax(2)), id="var_axis_2"),
    pytest.param(_def(lambda fd, x: fd.ops.var(x, []), (4, 6)), KilnError, (r"no axes",), id="var_no_axes"),
    pytest.param(
        _def(lambda fd, x: fd.ops.mean(x, [3]), (4, 6)), KilnError, (tv(0), ax(3)), id="mean_axis_3"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.welford(x, [3])[0], (4, 6)), KilnError, (tv(0), ax(3)), id="welford_axis_3"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.logsumexp(x, [1]), (4, 6), DataType.Int),
        KilnError,
        (tv(0), r"floating"),
        id="logsumexp_of_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.logsumexp(x, [2]), (4, 6)), KilnError, (tv(0), ax(2)), id="logsumexp_axis_2"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.prod(x, [0, 0]), (4, 6)),
        KilnError,
        (tv(0), ax(0), r"twice"),
        id="prod_axis_twice",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.sum(x, [0]), ()), KilnError, (tv(0), ax(0), r"rank 0"), id="sum_of_0d"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.permute(x, [0]), ()), KilnError, (tv(0), r"rank 0"), id="permute_of_0d"
    ),
    # element-wise ops outside their types
    pytest.param(
        _def(lambda fd, x: fd.ops.bitwise_and(x, x)),
        KilnTypeError,
        (tv(0), r"bitwise_and", r"float"),
        id="bitwise_and_float",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.bitwise_not(x)),
        KilnTypeError,
        (tv(0), r"bitwise_not"),
        id="bitwise_not_float",
    ),
    pytest.param(_def(lambda fd, x: fd.ops.gcd(x, x)), KilnTypeError, (tv(0), r"gcd"), id="gcd_float"),
    pytest.param(
        _def(lambda fd, x: fd.ops.bitwise_left_shift(x, 1)),
        KilnTypeError,
        (tv(0), r"shift"),
        id="shift_float",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.nextafter(x, x), (-1,), DataType.Int),
        KilnTypeError,
        (tv(0), r"nextafter"),
        id="nextafter_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.frac(x), (-1,), DataType.Int),
        KilnTypeError,
        (tv(0), r"frac"),
        id="frac_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.where(1.0, x, x)),
        KilnTypeError,
        (r"condition", r"Bool"),
        id="where_float_number_condition",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.where(fd.define_scalar(dtype=DataType.Int), x, x)),
        KilnTypeError,
        (r"condition", r"s0", r"Bool"),
        id="where_int_scalar_condition",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.clamp(x, fd.define_tensor([-1]), 1.0)),
        KilnError,
        (tv(0), tv(1), r"rank"),
        id="clamp_bound_of_another_rank",
    ),
    # operands that are not operands
    *[
        pytest.param(
            _def(lambda fd, x, v=v: fd.ops.add(x, v)),
            KilnTypeError,
            (r"add", r"expected a Tensor"),
            id=f"add_{name}",
        )
        for name, v in [
            ("str", "1"),
            ("None", None),
            ("complex", 1j),
            ("ndarray", np.ones(3)),
        ]
    ],
    pytest.param(
        _def(lambda fd, x: fd.ops.add(x, 2**64)), KilnError, (str(2**64), r"Int"), id="add_int_past_64_bits"
    ),
    # scalars
    *[
        pytest.param(
            _def(lambda fd, x, v=v: fd.ops.mul(x, fd.define_scalar(v, dtype=DataType.Int))),
            KilnTypeError,
            (r"define_scalar", r"not an integer"),
            id=f"define_scalar_{v}_as_Int",
        )
        for v in [2.5, float("nan"), float("inf")]
    ],
    pytest.param(
        _def(lambda fd, x: fd.ops.mul(x, fd.define_scalar("a"))),
        KilnTypeError,
        (r"'a'",),
        id="define_scalar_str",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.iota(-3, dtype=F), (-1,)),
        KilnError,
        (r"-3", r"negative"),
        id="iota_negative_length",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.iota(3, dtype=DataType.Bool), (-1,)),
        KilnTypeError,
        (r"Bool",),
        id="iota_bool",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.uniform(0.0, 1.0, [3], dtype=DataType.Int), (-1,)),
        KilnTypeError,
        (r"floating",),
        id="uniform_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.uniform(0.0, 1.0, [3], rng_seed=0.5), (-1,)),
        KilnTypeError,
        (r"rng_seed", r"Int"),
        id="uniform_float_seed",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], x, F), (-1,)),
        KilnTypeError,
        (tv(0), r"scalar"),
        id="full_value_is_a_ranked_tensor",
    ),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), DEFINITION_ERRORS)
def test_definition_error(fn: Callable[[], Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(fn, exc, *patterns)


# -- outputs ----------------------------------------------------------------------------


def _outputs(body: Callable[[FusionDefinition, Tensor], None]) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            body(fd, x)

    return run


def _alias_rank(fd: FusionDefinition, x: Tensor) -> None:
    y = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sum(y, [1]), alias_input=y)


OUTPUT_ERRORS = [
    pytest.param(
        _outputs(lambda fd, x: fd.add_output(3.0)),
        KilnTypeError,
        (r"add_output", r"Tensor"),
        id="output_a_number",
    ),
    pytest.param(
        _outputs(lambda fd, x: fd.add_output(fd.define_scalar(2.0))),
        KilnTypeError,
        (r"add_output", r"Tensor"),
        id="output_a_constant_scalar",
    ),
    pytest.param(
        _outputs(
            lambda fd, x: (
                fd.add_output(fd.ops.neg(x), alias_input=x),
                fd.add_output(fd.ops.exp(x), alias_input=x),
            )
        ),
        KilnError,
        (tv(0), r"both alias"),
        id="two_outputs_alias_one_input",
    ),
    pytest.param(
        _outputs(lambda fd, x: fd.add_output(fd.ops.exp(x), alias_input=fd.ops.neg(x))),
        KilnError,
        (tv(2), r"not a fusion input"),
        id="alias_of_a_computed_tensor",
    ),
    pytest.param(_outputs(_alias_rank), KilnError, (tv(1), r"rank"), id="alias_of_another_rank"),
    pytest.param(
        _outputs(lambda fd, x: fd.add_output(fd.ops.cast(x, DataType.Double), alias_input=x)),
        KilnTypeError,
        (tv(0), r"dtype"),
        id="alias_of_another_dtype",
    ),
    pytest.param(
        _outputs(lambda fd, x: fd.add_output(x, alias_input=x)),
        KilnError,
        (tv(0), r"itself"),
        id="input_aliasing_itself",
    ),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), OUTPUT_ERRORS)
def test_output_error(fn: Callable[[], Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(fn, exc, *patterns)


def test_same_output_twice_and_input_twice_are_fresh_copies() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.ops.neg(x)
        for t in (y, y, x, x):
            fd.add_output(t)
    a = np.arange(3, dtype=np.float32)
    outs = fd.execute([a])
    for got, want in zip(outs, [-a, -a, a, a]):
        close(got, want)
    for i in range(4):
        assert not np.shares_memory(a, outs[i])
        for j in range(i + 1, 4):
            assert not np.shares_memory(outs[i], outs[j])


def test_outputs_added_after_a_run_are_returned_too() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.neg(x))
    a = rnd(5)
    close(fd.execute([a])[0], -f64(a))
    with fd:
        fd.add_output(fd.ops.exp(x))
    outs = fd.execute([a])
    assert len(outs) == 2
    close(outs[1], np.exp(f64(a)))


def test_running_a_fusion_without_outputs_says_so() -> None:
    with pytest.raises(KilnError, match=r"out of range"):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            fd.ops.sum(fd.ops.neg(x), [3])
    expect(lambda: fd.execute([np.zeros(3, np.float32)]), KilnError, r"no outputs")


# -- handles of another fusion ------------------------------------------------------------


def _other_size() -> Scalar:
    """``size(x, 0)`` of a fusion other than the one it is used in."""
    with FusionDefinition() as other:
        x0 = other.define_tensor([-1])
        n = other.ops.size(x0, 0)
        other.add_output(other.ops.neg(x0))
    return n


def _foreign(body: Callable[[FusionDefinition, Tensor, Scalar], Any]) -> Callable[[], None]:
    def run() -> None:
        n = _other_size()
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            out = body(fd, x, n)
            fd.add_output(out)

    return run


FOREIGN_OK = [
    pytest.param(_foreign(lambda fd, x, n: fd.ops.mul(x, n)), id="mul"),
    pytest.param(
        _foreign(lambda fd, x, n: fd.ops.broadcast_in_dim(x, [n, -1, -1], [1, 2])), id="broadcast_in_dim"
    ),
    pytest.param(
        _foreign(
            lambda fd, x, n: fd.ops.expand(fd.ops.broadcast_in_dim(x, [1, -1, -1], [1, 2]), [n, -1, -1])
        ),
        id="expand",
    ),
]

FOREIGN_BAD = [
    pytest.param(_foreign(lambda fd, x, n: fd.ops.reshape(x, [n, -1])), id="reshape"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.full([n], 1.0, F)), id="full"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.iota(n)), id="iota"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.slice(x, [0, 0], [n, n])), id="slice"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.pad(x, [n, 0])), id="pad"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.select(x, 0, n)), id="select"),
    pytest.param(_foreign(lambda fd, x, n: fd.ops.uniform(0.0, 1.0, [n])), id="uniform_shape"),
]


@pytest.mark.parametrize("fn", FOREIGN_OK)
def test_scalar_of_another_fusion_is_refused(fn: Callable[[], None]) -> None:
    expect(fn, KilnError, r"another FusionDefinition")


@pytest.mark.parametrize("fn", FOREIGN_BAD)
def test_scalar_of_another_fusion_in_a_shape_is_refused(fn: Callable[[], None]) -> None:
    expect(fn, KilnError, r"another FusionDefinition")


def test_scalar_of_another_fusion_gives_no_wrong_answer() -> None:
    n = _other_size()

    def run() -> None:
        with FusionDefinition() as fd:
            fd.define_tensor([-1, -1])
            fd.add_output(fd.ops.iota(n))
        fd.execute([np.zeros((2, 3), np.float32)])

    expect(run, KilnError, r"another FusionDefinition")


# -- ints that do not fit 64 bits, and other ints of the wrong kind ----------------------


def _big_def(body: Callable[[FusionDefinition, Tensor, Tensor], Any]) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            i = fd.define_tensor([-1, -1], dtype=DataType.Int)
            fd.add_output(body(fd, x, i))

    return run


def _big_sched(body: Callable[[Tensor, Tensor], Any]) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([8, 16])
            y = fd.ops.exp(x)
            z = fd.ops.neg(y)
            fd.add_output(z)
        body(y, z)

    return run


BIG_INT_OK = [  # already a KilnError naming what is wrong
    pytest.param(_big_def(lambda fd, x, i: fd.ops.gather(x, i, BIG)), (tv(0), str(BIG)), id="gather_dim"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.var(x, [BIG])), (tv(0), str(BIG)), id="var_dim"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.mean(x, [BIG])), (tv(0), str(BIG)), id="mean_dim"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.select(x, 0, BIG)), (str(BIG),), id="select_index"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.reshape(x, [BIG, -1])), (str(BIG),), id="reshape_size"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.pad(x, [BIG, 0])), (str(BIG),), id="pad_width"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.slice(x, [BIG, 0], [1, 1])), (str(BIG),), id="slice_start"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.full([BIG], 1.0, F)), (str(BIG),), id="full_size"),
    pytest.param(
        _big_def(lambda fd, x, i: fd.ops.var(x, [1], correction=BIG)), (str(BIG),), id="var_correction"
    ),
    pytest.param(_big_sched(lambda y, z: z.axis(BIG)), (tv(2), str(BIG)), id="axis"),
    pytest.param(
        _big_sched(lambda y, z: z.set_allocation_domain([BIG, 0], [True, True])),
        (tv(2), str(BIG)),
        id="set_allocation_domain",
    ),
]

BIG_INT_BAD = [  # builtins.OverflowError ("Python int too large to convert to C long") today
    pytest.param(_big_def(lambda fd, x, i: fd.ops.permute(x, [0, BIG])), id="permute_dims"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.sum(x, [BIG])), id="sum_dims"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.sum(x, [-BIG])), id="sum_dims_negative"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.logsumexp(x, [BIG])), id="logsumexp_dims"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.squeeze(x, [BIG])), id="squeeze_dims"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.cat([x, x], BIG)), id="cat_dim"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.select(x, BIG, 0)), id="select_dim"),
    pytest.param(
        _big_def(lambda fd, x, i: fd.ops.index_select(x, fd.ops.reshape(i, [-1]), BIG)), id="index_select_dim"
    ),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.take_along_axis(x, i, BIG)), id="take_along_axis_dim"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.full([fd.ops.size(x, BIG)], 1.0, F)), id="size_dim"),
    pytest.param(
        _big_def(lambda fd, x, i: fd.ops.broadcast_in_dim(x, [-1, -1, -1], [0, BIG])),
        id="broadcast_in_dim_dims",
    ),
    pytest.param(
        _big_def(lambda fd, x, i: fd.ops.broadcast_in_dim(x, [BIG, -1, -1], [1, 2])),
        id="broadcast_in_dim_shape",
    ),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.expand(x, [BIG, -1])), id="expand_shape"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.slice(x, [0, 0], [1, 1], [1, BIG])), id="slice_step"),
    pytest.param(_big_def(lambda fd, x, i: fd.ops.triu(x, BIG)), id="triu_diagonal"),
    pytest.param(_big_sched(lambda y, z: z.split(BIG, 4)), id="split_axis"),
    pytest.param(_big_sched(lambda y, z: z.split(1, 2**63)), id="split_factor_2_63"),
    pytest.param(_big_sched(lambda y, z: z.merge(0, BIG)), id="merge_axis"),
    pytest.param(_big_sched(lambda y, z: z.reorder({BIG: 0})), id="reorder_source"),
    pytest.param(_big_sched(lambda y, z: z.reorder({0: BIG})), id="reorder_target"),
    pytest.param(_big_sched(lambda y, z: y.inline_at(BIG)), id="inline_at"),
    pytest.param(_big_sched(lambda y, z: y.circular_buffer(BIG)), id="circular_buffer_stages"),
]


@pytest.mark.parametrize(("fn", "patterns"), BIG_INT_OK)
def test_int_past_64_bits_is_a_kiln_error(fn: Callable[[], None], patterns: tuple[str, ...]) -> None:
    expect(fn, KilnError, *patterns)


@pytest.mark.parametrize("fn", BIG_INT_BAD)
def test_int_past_64_bits_is_a_kiln_error_everywhere(fn: Callable[[], None]) -> None:
    expect(fn, KilnError)


@pytest.mark.parametrize("dim", [1.5, True, "1"], ids=repr)
def test_size_axis_of_the_wrong_type(dim: Any) -> None:
    expect(_def(lambda fd, x: fd.ops.full([fd.ops.size(x, dim)], 1.0, F)), KilnTypeError, r"size")


def test_define_scalar_str_with_dtype() -> None:
    expect(
        _def(lambda fd, x: fd.ops.mul(x, fd.define_scalar("a", dtype=DataType.Double))),
        KilnTypeError,
        r"define_scalar",
    )


def test_reshape_whose_size_product_wraps_64_bits_is_refused() -> None:
    # (2**62 + 6) * 4 wraps to 24, the input's element count, in 64-bit arithmetic.
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([4, 6])
            fd.add_output(fd.ops.reshape(x, [2**62 + 6, 4]))
        fd.execute([np.zeros((4, 6), np.float32)])

    expect(run, KilnError, tv(1), r"2\^63")


# -- odd but valid definitions: NumPy's answer ------------------------------------------------


def _run1(
    body: Callable[[FusionDefinition, Tensor], Tensor], a: np.ndarray, shape: Sequence[int] | None = None
) -> Any:
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape) if shape is not None else [-1] * a.ndim)
        fd.add_output(body(fd, x))
    return fd.execute([a])[0]


B46 = np.arange(24, dtype=np.float32).reshape(4, 6)


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
@pytest.mark.parametrize(
    ("start", "end", "step"),
    [
        ([3, 0], [1, 6], [1, 1]),
        ([10, 0], [12, 6], [1, 1]),
        ([1, 0], [2**63 - 1, 6], [2, 1]),
        ([0, 5], [4, 99], [3, 4]),
    ],
    ids=["start_after_end", "start_past_size", "end_int64_max", "ends_clamped"],
)
def test_slice_out_of_bounds_is_empty_or_clamped(
    start: list[int], end: list[int], step: list[int], static: bool
) -> None:
    got = _run1(lambda fd, x: fd.ops.slice(x, start, end, step), B46, (4, 6) if static else None)
    close(got, B46[start[0] : end[0] : step[0], start[1] : end[1] : step[1]])


@pytest.mark.parametrize("ddof", [6, -1, 0, 5])
def test_var_correction_up_to_n(ddof: int) -> None:
    want = np_var(f64(B46), axis=1, ddof=ddof)
    close(_run1(lambda fd, x: fd.ops.var(x, [1], correction=ddof), B46), want)


def test_var_correction_past_n() -> None:
    want = np_var(f64(B46), axis=1, ddof=7)
    close(_run1(lambda fd, x: fd.ops.var(x, [1], correction=7), B46), want)


def test_var_over_an_empty_axis() -> None:
    a = np.zeros((3, 0), np.float32)
    want = np_var(f64(a), axis=1, ddof=1)
    close(_run1(lambda fd, x: fd.ops.var(x, [1]), a), want)


def test_welford_with_a_repeated_axis() -> None:
    def run() -> list[Any]:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            for t in fd.ops.welford(x, [1, 1]):
                fd.add_output(t)
        return fd.execute([B46])

    try:
        mean, var_sum, n = run()
    except KilnError as e:
        assert re.search(ax(1), str(e)), str(e)
        return
    close(mean, f64(B46).mean(1))
    close(var_sum, ((f64(B46) - f64(B46).mean(1, keepdims=True)) ** 2).sum(1))
    close(n, np.full(4, 6))


def test_full_of_a_float_value_as_int_truncates() -> None:
    with FusionDefinition() as fd:
        fd.define_tensor([-1])
        fd.add_output(fd.ops.full([3], 2.5, DataType.Int))
    (out,) = fd.execute([np.zeros(2, np.float32)])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, np.full(3, 2.5).astype(np.int64))


# ======================================================================================
# 2. Run-time binding
# ======================================================================================


def _unary() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(fd.ops.mul(x, 2), 1))
    return fd


def _rsum(dim: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [dim]))
    return fd


def _permute_exp() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(fd.ops.exp(x), [1, 0]))
    return fd


def _scalar(dtype: DataType) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.mul(x, fd.define_scalar(dtype=dtype)))
    return fd


A23 = np.arange(6, dtype=np.float32).reshape(2, 3)


# -- arrays NumPy can describe but kiln cannot run -------------------------------------------


@pytest.mark.parametrize("mode", ["execute", "lower"])
@pytest.mark.parametrize(
    ("make", "shown"),
    [
        (lambda: A23.astype(">f4"), r">f4"),
        (lambda: A23.astype(np.longdouble), r"float128|longdouble|float96"),
        (lambda: A23.astype(object), r"object"),
        (lambda: A23.astype(str), r"<U"),
        (lambda: np.zeros((2, 3), "datetime64[s]"), r"datetime64"),
        (lambda: np.zeros((2, 3), [("a", np.float32)]), r"'a'"),
    ],
    ids=["big_endian_float32", "longdouble", "object", "str", "datetime64", "structured"],
)
def test_unsupported_array_dtype(make: Callable[[], np.ndarray], shown: str, mode: str) -> None:
    fd = _unary()
    call = fd.execute if mode == "execute" else fd.lower
    expect(lambda: call([make()]), KilnTypeError, inp(0, 0), r"unsupported dtype", shown)


@pytest.mark.parametrize(
    "value", [[[1.0, 2.0], [3.0, 4.0]], memoryview(A23), b"abc"], ids=["nested_list", "memoryview", "bytes"]
)
def test_array_likes_that_are_not_arrays(value: Any) -> None:
    expect(lambda: _unary().execute([value]), KilnTypeError, inp(0, 0), r"expected an array")


@pytest.mark.parametrize(
    "make",
    [lambda: _matrix(A23), lambda: np.ma.masked_array(A23, mask=A23 > 2)],
    ids=["matrix", "masked_array"],
)
def test_ndarray_subclasses_read_their_data(make: Callable[[], np.ndarray]) -> None:
    (out,) = _unary().execute([make()])
    close(np.asarray(out), f64(A23) * 2 + 1)


def _matrix(a: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(a)


def test_unaligned_array() -> None:
    a = np.ndarray((2, 3), np.float32, buffer=bytearray(25), offset=1)
    a[...] = A23
    assert not a.flags.aligned
    (out,) = _unary().execute([a])
    close(out, f64(A23) * 2 + 1)


# -- scalars of the wrong kind ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "exc", "patterns"),
    [
        (DataType.Int, np.float64(2.0), KilnTypeError, (r"input 1 \(s0\)", r"float", r"\bInt\b")),
        (DataType.Int, float("nan"), KilnTypeError, (r"input 1 \(s0\)", r"NaN", r"\bInt\b")),
        (DataType.Int, float("inf"), KilnTypeError, (r"input 1 \(s0\)", r"\bInt\b")),
        (DataType.Int32, np.int64(2**40), KilnError, (r"input 1 \(s0\)", str(2**40), r"Int32")),
        (DataType.Double, 1j, KilnTypeError, (r"input 1 \(s0\)", r"complex")),
        (DataType.Double, np.complex64(1), KilnTypeError, (r"input 1 \(s0\)", r"complex")),
        (DataType.Double, fractions.Fraction(1, 2), KilnTypeError, (r"input 1 \(s0\)", r"Fraction")),
        (DataType.Double, b"1", KilnTypeError, (r"input 1 \(s0\)", r"bytes")),
    ],
    ids=[
        "np_float64_for_Int",
        "nan_for_Int",
        "inf_for_Int",
        "np_int64_2_40_for_Int32",
        "complex_for_Double",
        "np_complex64_for_Double",
        "Fraction_for_Double",
        "bytes_for_Double",
    ],
)
def test_scalar_of_the_wrong_kind(
    dtype: DataType, value: Any, exc: type[KilnError], patterns: tuple[str, ...]
) -> None:
    fd = _scalar(dtype)
    expect(lambda: fd.execute([np.ones(3, np.float32), value]), exc, *patterns)
    expect(lambda: fd.lower([np.ones(3, np.float32), value]), exc, *patterns)


@pytest.mark.parametrize(
    ("dtype", "value", "want"),
    [
        (DataType.Int, True, 1.0),
        (DataType.Double, False, 0.0),
        (DataType.Float, 1e300, np.inf),
        (DataType.Half, 70000, np.inf),
        (DataType.Double, np.float16(0.5), 0.5),
        (DataType.Int, np.uint8(7), 7.0),
    ],
    ids=[
        "bool_for_Int",
        "bool_for_Double",
        "1e300_for_Float",
        "70000_for_Half",
        "np_float16_for_Double",
        "np_uint8_for_Int",
    ],
)
def test_scalar_values_convert_like_pytorch(dtype: DataType, value: Any, want: float) -> None:
    a = np.array([1.0, -2.0, 3.0], np.float32)
    (out,) = _scalar(dtype).execute([a, value])
    close(out, f64(a) * want)


def test_numpy_bool_for_a_bool_scalar() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Bool)
        fd.add_output(fd.ops.where(s, x, fd.ops.neg(x)))
    a = rnd(4)
    close(fd.execute([a, np.bool_(False)])[0], -f64(a))
    close(fd.execute([a, np.bool_(True)])[0], a)


def _zero_d() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([])
        fd.add_output(fd.ops.mul(x, 3.0))
    return fd


def test_0d_tensor_inputs() -> None:
    close(_zero_d().execute([np.array(2.0, np.float32)])[0], np.array(6.0))
    expect(
        lambda: _zero_d().execute([np.array([2.0], np.float32)]), KilnError, inp(0, 0), r"rank 1", r"rank 0"
    )
    expect(lambda: _zero_d().execute([2.0]), KilnTypeError, inp(0, 0), r"expected an array")


# -- NaN and inf data -----------------------------------------------------------------------


def _nan_rows(rows: int, cols: int) -> np.ndarray:
    a = rnd(rows, cols)
    a[1, cols // 2] = np.nan
    a[2, 0] = np.inf
    a[3, -1] = -np.inf
    a[4, 0] = np.nan
    a[4, -1] = np.inf
    return a


@pytest.mark.parametrize(
    "shape", [(6, 3), (6, 3000), (3000, 6)], ids=["short_rows", "long_rows", "long_cols"]
)
@pytest.mark.parametrize("dim", [0, 1])
def test_reductions_propagate_nan_and_inf(shape: tuple[int, int], dim: int) -> None:
    a = _nan_rows(*shape)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.max(x, [dim]))
        fd.add_output(fd.ops.min(x, [dim]))
        fd.add_output(fd.ops.sum(x, [dim]))
    mx, mn, sm = fd.execute([a])
    close(mx, np.max(f64(a), axis=dim))
    close(mn, np.min(f64(a), axis=dim))
    with np.errstate(invalid="ignore"):
        close(sm, np.sum(f64(a), axis=dim), rtol=1e-4)


def test_softmax_of_rows_with_inf_and_nan() -> None:
    a = np.array(
        [[np.inf, 1, 2], [-np.inf, -np.inf, -np.inf], [0, 0, np.nan], [-np.inf, 0, 1], [1, 2, 3]], np.float32
    )
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.broadcast_in_dim(fd.ops.max(x, [1]), [-1, -1], [0])
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.broadcast_in_dim(fd.ops.sum(e, [1]), [-1, -1], [0])))
    with np.errstate(invalid="ignore"):
        d = f64(a)
        e = np.exp(d - d.max(1, keepdims=True))
        want = e / e.sum(1, keepdims=True)
    close(fd.execute([a])[0], want)


# -- strides: overlapping, zero, negative, huge on size-one and empty axes ------------------------

STRIDED = {
    "sliding_window_small": lambda: sliding_window_view(np.arange(40, dtype=np.float32), 7),
    "sliding_window_big": lambda: sliding_window_view(np.arange(5000, dtype=np.float32) / 5000, 700),
    "size1_axis_stride_2_40": lambda: as_strided(np.arange(5, dtype=np.float32), (1, 5), (2**40, 4)),
    "negative_and_zero_strides": lambda: as_strided(np.arange(30, dtype=np.float32)[20:], (6, 5), (-8, 0)),
    "step_slice_transposed_big": lambda: (
        (np.arange(3000 * 7, dtype=np.float32).reshape(3000, 7) / 1000)[::3, 1:6:2].T
    ),
}


@pytest.mark.parametrize("op", ["unary", "row_sum", "col_sum", "permute"])
@pytest.mark.parametrize("view", list(STRIDED))
def test_odd_strides(view: str, op: str) -> None:
    a = STRIDED[view]()
    d = f64(a)
    fd, want = {
        "unary": (_unary, d * 2 + 1),
        "row_sum": (lambda: _rsum(1), d.sum(1)),
        "col_sum": (lambda: _rsum(0), d.sum(0)),
        "permute": (_permute_exp, np.exp(d).T),
    }[op]
    close(fd().execute([a])[0], want)


def test_empty_axis_with_absurd_strides() -> None:
    a = as_strided(np.arange(5, dtype=np.float32), (0, 5), (2**62, -(2**62)))
    close(_unary().execute([a])[0], np.zeros((0, 5)))
    close(_rsum(0).execute([a])[0], np.zeros(5))
    close(_rsum(1).execute([a])[0], np.zeros(0))


def test_zero_stride_2_40_elements_lowers() -> None:
    a = as_strided(np.zeros(1, np.float32), (2**20, 2**20), (0, 0))
    assert len(_rsum(1).lower([a]).kernels) >= 1


def test_zero_stride_2_40_elements_refused_by_name() -> None:
    proc = run_child(
        """
        from numpy.lib.stride_tricks import as_strided
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            fd.add_output(fd.ops.neg(x))
        a = as_strided(np.zeros(1, np.float32), (2**20, 2**20), (0, 0))
        try:
            fd.execute([a])
        except KilnError as e:
            print("KILN_ERROR:", e)
    """,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KILN_ERROR" in proc.stdout, proc.stdout
    assert re.search(r"input 0 \(T0\)|\bT[01]\b", proc.stdout), proc.stdout


RESHAPE_VIEWS = {
    "transpose": lambda: B46.T,
    "rows_reversed": lambda: B46[::-1],
    "cols_reversed": lambda: B46[:, ::-1],
    "broadcast": lambda: np.broadcast_to(np.arange(6, dtype=np.float32), (4, 6)),
    "slice": lambda: B46[1:, 1:4],
    "step": lambda: B46[::2, ::3],
    "fortran": lambda: np.asfortranarray(B46),
}


@pytest.mark.parametrize("as_written", [False, True], ids=["auto", "as_written"])
@pytest.mark.parametrize("view", list(RESHAPE_VIEWS))
def test_reshape_of_a_strided_input_reads_row_major_order(view: str, as_written: bool) -> None:
    # A plain reshape of a row-major input is a View of its buffer: any other layout must not be.
    a = RESHAPE_VIEWS[view]()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.reshape(x, [-1]))
    np.testing.assert_array_equal(fd.execute([a], as_written=as_written)[0], a.reshape(-1))


# -- index values out of range ----------------------------------------------------------------


def _index_select(dim: int, idx_dtype: DataType = DataType.Int, rank: int = 2) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        i = fd.define_tensor([-1], dtype=idx_dtype)
        fd.add_output(fd.ops.index_select(x, i, dim))
    return fd


def _take_along_axis(dim: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1, -1], dtype=DataType.Int)
        fd.add_output(fd.ops.take_along_axis(x, i, dim))
    return fd


T43 = np.arange(12, dtype=np.float32).reshape(4, 3)
T34 = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.mark.parametrize("as_written", [False, True], ids=["auto", "as_written"])
@pytest.mark.parametrize(
    ("build", "inputs", "patterns"),
    [
        (
            lambda: _index_select(1, DataType.Int32),
            lambda: [T43, np.array([0, 2, 3], np.int32)],
            (tv(1), r"holds 3 at element 2\b", tv(0), r"\[0, 3\)"),
        ),
        (
            lambda: _index_select(0),
            lambda: [T43, np.array([0, 1, 2, 9, 1, 3])[::-1]],
            (tv(1), r"holds 9 at element 2\b", r"\[0, 4\)"),
        ),
        (
            lambda: _index_select(0),
            lambda: [T43, np.broadcast_to(np.array(5), (3,))],
            (tv(1), r"holds 5 at element 0\b"),
        ),
        (lambda: _index_select(0), lambda: [T43, np.array([0, 2**62])], (tv(1), str(2**62), r"element 1\b")),
        (
            lambda: _index_select(0),
            lambda: [T43, np.array([0, 1, 2, 3, 0, 1, 2, 3, -9, 0])],
            (tv(1), r"holds -9 at element 8\b"),
        ),
    ],
    ids=["int32_dim1", "reversed_index_view", "broadcast_index", "2_62", "long_index_negative"],
)
def test_index_out_of_range_is_named(
    build: Callable[[], FusionDefinition],
    inputs: Callable[[], list[Any]],
    patterns: tuple[str, ...],
    as_written: bool,
) -> None:
    fd = build()
    expect(lambda: fd.execute(inputs(), as_written=as_written), KilnError, *patterns)


def test_index_out_of_range_feeding_only_a_reduction() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=DataType.Int)
        fd.add_output(fd.ops.sum(fd.ops.index_select(x, i, 0), [0, 1]))
    expect(lambda: fd.execute([T43, np.array([0, 4])]), KilnError, tv(1), r"holds 4 at element 1\b")


def test_index_into_an_empty_axis() -> None:
    expect(
        lambda: _index_select(0).execute([np.zeros((0, 3), np.float32), np.array([0])]),
        KilnError,
        tv(0),
        ax(0),
        r"empty",
    )
    # An empty row is fine to select from, and an empty index selects nothing.
    close(_index_select(0).execute([np.zeros((4, 0), np.float32), np.array([3])])[0], np.zeros((1, 0)))
    close(_index_select(0).execute([T43, np.zeros(0, np.int64)])[0], np.zeros((0, 3)))


def test_a_good_call_after_an_index_error_runs() -> None:
    fd = _index_select(0)
    expect(lambda: fd.execute([T43, np.array([9])]), KilnError, r"\b9\b")
    close(fd.execute([T43, np.array([3, 1])])[0], T43[[3, 1]])


def test_take_along_axis_out_of_range_as_written() -> None:
    expect(
        lambda: _take_along_axis(1).execute([T34, np.array([[0, 1], [2, 4], [3, 0]])], as_written=True),
        KilnError,
        tv(1),
        r"holds 4 at element 3\b",
        r"\[0, 4\)",
    )


def test_index_out_of_range_1d_is_named() -> None:
    fd = _index_select(0, rank=1)
    expect(
        lambda: fd.execute([np.arange(4, dtype=np.float32), np.array([0, 1, 2, 3, 4, 0])]),
        KilnError,
        tv(1),
        r"holds 4 at element 4\b",
    )


def test_take_along_axis_out_of_range_is_named() -> None:
    expect(
        lambda: _take_along_axis(1).execute([T34, np.array([[0, 1], [2, 4], [3, 0]])]),
        KilnError,
        tv(1),
        r"holds 4 at element 3\b",
    )


def test_gather_out_of_range_is_named() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4])
        i = fd.define_tensor([2, 2], dtype=DataType.Int)
        fd.add_output(fd.ops.gather(x, i, 0))
    close(
        fd.execute([T34, np.array([[0, 1], [2, 0]])])[0],
        np.take_along_axis(T34[:, :2], np.array([[0, 1], [2, 0]]), 0),
    )
    expect(
        lambda: fd.execute([T34, np.array([[0, 1], [3, 0]])]),
        KilnError,
        tv(1),
        tv(0),
        r"holds 3 at element 2\b",
    )


def _computed_index(kind: str) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        if kind == "iota":
            idx = fd.ops.iota(5)  # T1
        else:
            idx = fd.ops.add(fd.define_tensor([-1], dtype=DataType.Int), 3)  # T2 = T1 + 3
        fd.add_output(fd.ops.index_select(x, idx, 0))
    return fd


@pytest.mark.parametrize(
    ("kind", "inputs", "patterns"),
    [
        ("iota", lambda: [T43], (tv(1), r"holds 4 at element 4\b")),
        ("add", lambda: [T43, np.array([0, 1])], (tv(2), r"holds 4 at element 1\b")),
    ],
)
@pytest.mark.parametrize(
    "as_written",
    [True, False],
    ids=["as_written", "auto"],
)
def test_computed_index_out_of_range_is_named(
    kind: str, inputs: Callable[[], list[Any]], patterns: tuple[str, ...], as_written: bool
) -> None:
    expect(lambda: _computed_index(kind).execute(inputs(), as_written=as_written), KilnError, *patterns)


# -- sizes that disagree or overflow at run time -------------------------------------------------


def test_take_along_axis_off_dim_sizes_disagree() -> None:
    expect(
        lambda: _take_along_axis(1).execute([T34, np.zeros((2, 2), np.int64)]),
        KilnError,
        inp(1, 1),
        inp(0, 0),
        ax(0),
        r"\b2\b",
        r"\b3\b",
    )


def test_cat_other_axis_disagrees_at_run_time() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.cat([x, y], 0))
    expect(
        lambda: fd.execute([np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)]),
        KilnError,
        tv(1),
        tv(0),
        ax(1),
    )
    close(fd.execute([np.ones((0, 3), np.float32), np.ones((2, 3), np.float32)])[0], np.ones((2, 3)))


def _shape_scalars(body: Callable[[FusionDefinition, Tensor, Scalar, Scalar], Tensor]) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.define_scalar(dtype=DataType.Int)
        e = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(body(fd, x, s, e))
    return fd


RUNTIME_SHAPE_ERRORS = [
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, e]),
        (2**62 + 6, 4),
        (tv(1), r"2\^63"),
        id="reshape_product_wraps_to_numel",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, e]), (2**32, 2**32), (tv(1), r"2\^63"), id="reshape_2_64"
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, e]),
        (-4, -6),
        (tv(1), ax(0), r"-4", r"negative"),
        id="reshape_two_negatives",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, e]),
        (0, 5),
        (tv(0), r"element counts"),
        id="reshape_to_nothing",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, -1]),
        (5, 0),
        (tv(0), r"element counts"),
        id="reshape_infer_not_divisible",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.reshape(x, [s, -1]),
        (-1, 0),
        (ax(0), r"-1", r"negative"),
        id="reshape_scalar_minus_1",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.select(x, 1, s),
        (6, 0),
        (tv(0), ax(1), r"s0 = 6"),
        id="select_index_6_of_6",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.select(x, 1, s),
        (-7, 0),
        (tv(0), ax(1), r"s0 = -7", r"\[-size, size\)"),
        id="select_index_negative_past_the_start",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.select(x, 1, s),
        (2**62, 0),
        (tv(0), ax(1), str(2**62)),
        id="select_index_2_62",
    ),
    pytest.param(
        lambda fd, x, s, e: fd.ops.pad(x, [s, e]),
        (-10, 1),
        (tv(1), ax(1), r"-3", r"negative"),
        id="pad_crops_past_the_axis",
    ),
    pytest.param(
        # torch.nn.functional.pad refuses it too: the crop takes more than the axis holds,
        # though the other width would grow the result back to 0 elements.
        lambda fd, x, s, e: fd.ops.pad(x, [s, e]),
        (-7, 1),
        (tv(0), ax(1), r"crop"),
        id="pad_crops_past_the_axis_then_grows",
    ),
    pytest.param(lambda fd, x, s, e: fd.ops.pad(x, [s, e]), (2**62, 0), (tv(1), r"2\^63"), id="pad_2_62"),
    pytest.param(
        lambda fd, x, s, e: fd.ops.iota(s, dtype=F),
        (-2, 0),
        (tv(1), ax(0), r"-2", r"negative"),
        id="iota_negative_length",
    ),
]


@pytest.mark.parametrize(("body", "scalars", "patterns"), RUNTIME_SHAPE_ERRORS)
def test_runtime_sizes_are_checked(
    body: Callable[..., Tensor], scalars: tuple[int, int], patterns: tuple[str, ...]
) -> None:
    fd = _shape_scalars(body)
    expect(lambda: fd.execute([B46, *scalars]), KilnError, *patterns)


@pytest.mark.parametrize(
    ("body", "scalars", "want"),
    [
        (lambda fd, x, s, e: fd.ops.reshape(x, [s, e]), (3, 8), B46.reshape(3, 8)),
        (lambda fd, x, s, e: fd.ops.select(x, 1, s), (5, 0), B46[:, 5]),
        (lambda fd, x, s, e: fd.ops.select(x, 1, s), (-1, 0), B46[:, -1]),
        (lambda fd, x, s, e: fd.ops.select(x, 1, s), (-6, 0), B46[:, -6]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (-4, -1), B46[:, -4:-1]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (-100, 3), B46[:, -100:3]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (2, -100), B46[:, 2:-100]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (4, 2), B46[:, 4:2]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (10, 20), B46[:, 10:20]),
        (lambda fd, x, s, e: fd.ops.slice(x, [0, s], [4, e]), (1, 2**63 - 1), B46[:, 1:]),
        (lambda fd, x, s, e: fd.ops.pad(x, [s, e]), (-6, 0), np.zeros((4, 0))),
        (lambda fd, x, s, e: fd.ops.pad(x, [s, e]), (-2, 1), np.pad(B46[:, 2:], ((0, 0), (0, 1)))),
    ],
    ids=[
        "reshape",
        "select_last",
        "select_minus_1",
        "select_minus_size",
        "slice_negative_start_and_end",
        "slice_start_before_minus_size",
        "slice_end_before_minus_size",
        "slice_start_after_end",
        "slice_past_size",
        "slice_end_int64_max",
        "pad_crops_everything",
        "pad_crop_and_pad",
    ],
)
def test_runtime_sizes_at_the_edge(
    body: Callable[..., Tensor], scalars: tuple[int, int], want: np.ndarray
) -> None:
    close(_shape_scalars(body).execute([B46, *scalars])[0], want)


def test_broadcast_in_dim_scalar_size_disagrees_with_the_input() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.broadcast_in_dim(x, [n, 5], [1]))
    expect(lambda: fd.execute([np.ones(4, np.float32), 3]), KilnError, inp(0, 0), ax(0), r"\b4\b", r"\b5\b")
    expect(lambda: fd.execute([np.ones(5, np.float32), -3]), KilnError, r"-3", r"negative")
    close(fd.execute([np.arange(5, dtype=np.float32), 3])[0], np.broadcast_to(np.arange(5), (3, 5)))


def _full_plus_input() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.add(x, fd.ops.full([n], 1.0, F)))  # T1 = full, T2 = T0 + T1
    return fd


def test_runtime_size_disagreeing_with_an_input_as_written() -> None:
    expect(
        lambda: _full_plus_input().execute([np.ones(4, np.float32), 3], as_written=True),
        KilnError,
        tv(1),
        tv(2),
        r"\b3\b",
        r"\b4\b",
    )


def test_runtime_size_disagreeing_with_an_input() -> None:
    fd = _full_plus_input()
    expect(lambda: fd.execute([np.ones(4, np.float32), 3]), KilnError, tv(1), tv(2), r"\b3\b", r"\b4\b")
    expect(lambda: fd.lower([np.ones(4, np.float32), 3]), KilnError, r"\b3\b", r"\b4\b")


def test_reshape_empty_with_an_inferred_size() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.reshape(x, [0, -1]))
    a = np.zeros((0, 3), np.float32)
    expect(lambda: fd.execute([a]), KilnError, tv(0), r"reshape|-1")
    expect(lambda: fd.lower([a]), KilnError, tv(0))


def test_reshape_runtime_zero_then_inferred() -> None:
    fd = _shape_scalars(lambda fd, x, s, e: fd.ops.reshape(x, [s, -1]))
    expect(lambda: fd.execute([B46, 0, 0]), KilnError, tv(0), r"element counts|cannot be inferred")


# -- empty tensors -------------------------------------------------------------------------------


def _reduce(op: str, dtype: DataType = F, dims: Sequence[int] = (1,)) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        fd.add_output(getattr(fd.ops, op)(x, list(dims)))
    return fd


@pytest.mark.parametrize(
    ("op", "dims", "want"),
    [
        ("sum", (0, 1), np.zeros(())),
        ("mean", (1,), np.full(3, np.nan)),
        ("prod", (1,), np.ones(3)),
        ("logsumexp", (1,), np.full(3, -np.inf)),
    ],
)
def test_reductions_of_nothing(op: str, dims: Sequence[int], want: np.ndarray) -> None:
    a = np.zeros((0, 3), np.float32) if dims == (0, 1) else np.zeros((3, 0), np.float32)
    close(_reduce(op, dims=dims).execute([a])[0], want)


@pytest.mark.parametrize(
    ("op", "dtype", "npdtype"),
    [("min", DataType.Int, np.int64), ("max", DataType.Bool, bool), ("max", F, np.float32)],
)
def test_max_min_of_nothing_is_an_error(op: str, dtype: DataType, npdtype: Any) -> None:
    expect(
        lambda: _reduce(op, dtype).execute([np.zeros((3, 0), npdtype)]), KilnError, tv(1), ax(1), r"size 0"
    )


EMPTY_CASES: dict[
    str, tuple[Callable[[FusionDefinition], Tensor], list[tuple[int, ...]], Callable[..., Any]]
] = {
    "broadcast_add": (
        lambda fd: fd.ops.add(
            fd.define_tensor([-1, -1]), fd.ops.broadcast_in_dim(fd.define_tensor([-1]), [-1, -1], [1])
        ),
        [(3, 0), (0,)],
        lambda a, b: a + b,
    ),
    "pad_empty_axis": (
        lambda fd: fd.ops.pad(fd.define_tensor([-1, -1]), [1, 2], 7.0),
        [(2, 0)],
        lambda a: np.pad(a, ((0, 0), (1, 2)), constant_values=7.0),
    ),
    "cat_empty_part": (
        lambda fd: fd.ops.cat([fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])], 1),
        [(2, 0), (2, 3)],
        lambda a, b: np.concatenate([a, b], 1),
    ),
    "sum_of_empty_then_add": (
        lambda fd: fd.ops.add(fd.ops.sum(fd.define_tensor([-1, -1]), [0]), 1.0),
        [(0, 3)],
        lambda a: a.sum(0) + 1,
    ),
    "softmax_no_rows": (lambda fd: _softmax(fd, fd.define_tensor([-1, -1])), [(0, 5)], lambda a: a),
    "take_along_axis_empty_index": (
        lambda fd: fd.ops.take_along_axis(
            fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1], dtype=DataType.Int), 1
        ),
        [(3, 4), (3, 0)],
        lambda a, i: np.zeros((3, 0)),
    ),
}


def _softmax(fd: FusionDefinition, x: Tensor) -> Tensor:
    e = fd.ops.exp(fd.ops.sub(x, fd.ops.broadcast_in_dim(fd.ops.max(x, [1]), [-1, -1], [0])))
    return fd.ops.div(e, fd.ops.broadcast_in_dim(fd.ops.sum(e, [1]), [-1, -1], [0]))


@pytest.mark.parametrize("name", list(EMPTY_CASES))
def test_empty_inputs(name: str) -> None:
    body, shapes, ref = EMPTY_CASES[name]
    with FusionDefinition() as fd:
        fd.add_output(body(fd))
    dtypes = [np.int64 if t.dtype == "Int" else np.float32 for t in fd._core.input_specs()]
    ins = [np.zeros(s, d) for s, d in zip(shapes, dtypes)]
    close(fd.execute(ins)[0], ref(*[f64(a) for a in ins]))


def test_empty_axis_sizes_still_have_to_agree() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(b, [-1, -1], [1])))
    expect(
        lambda: fd.execute([np.zeros((3, 0), np.float32), np.zeros(2, np.float32)]),
        KilnError,
        inp(1, 1),
        inp(0, 0),
        r"\b0\b",
        r"\b2\b",
    )
    with FusionDefinition() as fd2:
        fd2.add_output(fd2.ops.neg(fd2.define_tensor([0, 3])))
    close(fd2.execute([np.zeros((0, 3), np.float32)])[0], np.zeros((0, 3)))
    expect(lambda: fd2.execute([np.zeros((1, 3), np.float32)]), KilnError, inp(0, 0), ax(0), r"\b0\b")


def test_softmax_over_an_empty_row_is_an_error() -> None:
    with FusionDefinition() as fd:
        fd.add_output(_softmax(fd, fd.define_tensor([-1, -1])))
    expect(lambda: fd.execute([np.zeros((5, 0), np.float32)]), KilnError, ax(1), r"size 0")


def test_take_along_axis_into_an_empty_axis() -> None:
    expect(
        lambda: _take_along_axis(1).execute([np.zeros((3, 0), np.float32), np.zeros((3, 2), np.int64)]),
        KilnError,
        tv(0),
        ax(1),
        r"empty",
    )


# -- in-place outputs -----------------------------------------------------------------------------


def _in_place() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(x, 2.0), alias_input=x)
        fd.add_output(fd.ops.neg(x))
    return fd


IN_PLACE_VIEWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "column_step": lambda b: b[:, ::2],
    "transpose": lambda b: b.T,
    "reversed_rows": lambda b: b[::-1],
    "empty": lambda b: b[:0],
}


@pytest.mark.parametrize("view", list(IN_PLACE_VIEWS))
def test_in_place_into_a_view(view: str) -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    want_base = base.copy()
    IN_PLACE_VIEWS[view](want_base)[...] *= 2
    a = IN_PLACE_VIEWS[view](base)
    (neg,) = _in_place().execute([a])
    close(neg, -f64(IN_PLACE_VIEWS[view](np.arange(12, dtype=np.float32).reshape(3, 4))))
    np.testing.assert_array_equal(base, want_base)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.broadcast_to(np.arange(3, dtype=np.float32), (2, 3)),
        lambda: np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), np.float32).reshape(2, 3),
    ],
    ids=["broadcast_to", "frombuffer_bytes"],
)
def test_in_place_into_a_read_only_array(make: Callable[[], np.ndarray]) -> None:
    fd = _in_place()
    expect(lambda: fd.execute([make()]), KilnError, inp(0, 0), r"read-only|writ")


# ======================================================================================
# 3. Hand schedules
# ======================================================================================


def _chain(
    shape: Sequence[int] = (-1, -1), dtype: DataType = F
) -> tuple[FusionDefinition, Tensor, Tensor, Tensor]:
    """x = T0 -> y = exp(x) = T1 -> z = -y = T2 (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype=dtype)
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    return fd, x, y, z


def _red(shape: Sequence[int] = (-1, -1)) -> tuple[FusionDefinition, Tensor, Tensor, Tensor]:
    """x = T0 -> y = exp(x) = T1 -> z = sum(y, [1]) = T2 (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape))
        y = fd.ops.exp(x)
        z = fd.ops.sum(y, [1])
        fd.add_output(z)
    return fd, x, y, z


def _check_chain(fd: FusionDefinition, a: np.ndarray) -> None:
    close(fd.execute([a])[0], -np.exp(f64(a)))


def _check_red(fd: FusionDefinition, a: np.ndarray) -> None:
    close(fd.execute([a])[0], np.exp(f64(a)).sum(1))


# -- launch limits --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "sched", "patterns"),
    [
        ((4, 2048), lambda z: z.axis(1).parallelize(PT.TIDx), (r"2048 threads", tv(2), ax(1), r"1024")),
        (
            (64, 64),
            lambda z: (z.axis(0).parallelize(PT.TIDy), z.axis(1).parallelize(PT.TIDx)),
            (r"4096 threads", tv(2), ax(0), ax(1), r"1024"),
        ),
        (
            (128, 2),
            lambda z: (z.axis(0).parallelize(PT.TIDz), z.axis(1).parallelize(PT.TIDx)),
            (r"blockDim\.z = 128", r"\b64\b", tv(2), ax(0)),
        ),
        (
            (70000, 1),
            lambda z: z.axis(0).parallelize(PT.BIDy),
            (r"gridDim\.y = 70000", r"65535", tv(2), ax(0)),
        ),
        (
            (8, 4096),
            lambda z: (z.split(1, 2048), z.axis(2).parallelize(PT.TIDx)),
            (r"2048 threads", tv(2), ax(2)),
        ),
    ],
    ids=["tidx_2048", "tidx_x_tidy_4096", "tidz_128", "bidy_70000", "split_inner_2048"],
)
@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_launch_limits(
    shape: tuple[int, int], sched: Callable[[Tensor], Any], patterns: tuple[str, ...], static: bool
) -> None:
    fd, x, y, z = _chain(shape if static else (-1, -1))
    sched(z)
    a = np.zeros(shape, np.float32)
    if static:
        expect(lambda: fd.lower([a]), KilnError, *patterns)
    expect(lambda: fd.execute([a]), KilnError, *patterns)


def test_bidz_past_65535_symbolic() -> None:
    fd, x, y, z = _chain()
    z.axis(0).parallelize(PT.BIDz)
    expect(
        lambda: fd.execute([np.zeros((70000, 1), np.float32)]), KilnError, r"gridDim\.z = 70000", tv(2), ax(0)
    )


def test_tidz_64_runs() -> None:
    fd, x, y, z = _chain((64, 2))
    z.axis(0).parallelize(PT.TIDz)
    z.axis(1).parallelize(PT.TIDx)
    _check_chain(fd, rnd(64, 2))


# -- memory -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1024, 1024), (512, 512)])
def test_shared_memory_past_the_device(shape: tuple[int, int]) -> None:
    fd, x, y, z = _chain(shape)
    y.set_memory_type(MT.Shared)
    a = np.zeros(shape, np.float32)
    expect(lambda: fd.lower([a]), KilnError, r"Shared memory", str(shape[0] * shape[1] * 4), r"232448")
    expect(lambda: fd.execute([a]), KilnError, r"Shared memory")


def test_shared_memory_past_the_device_symbolic() -> None:
    fd, x, y, z = _chain()
    y.set_memory_type(MT.Shared)
    expect(lambda: fd.execute([np.zeros((512, 512), np.float32)]), KilnError, r"Shared memory", r"1048576")
    a = rnd(8, 16)
    _check_chain(fd, a)


def test_shared_memory_past_the_device_names_the_tensor() -> None:
    fd, x, y, z = _chain((1024, 1024))
    y.set_memory_type(MT.Shared)
    expect(lambda: fd.lower([np.zeros((1024, 1024), np.float32)]), KilnError, tv(1))


def test_local_memory_past_the_device() -> None:
    fd, x, y, z = _chain((4096, 4096))
    y.set_memory_type(MT.Local)
    y.inline_at(0)
    # Refused when the CUDA is generated, before anything runs (the CPU path checks too).
    expect(lambda: fd.execute([np.zeros((4096, 4096), np.float32)]), KilnError, tv(1), r"Local")


@pytest.mark.parametrize(
    ("who", "mt", "patterns"),
    [
        ("z", MT.Shared, (tv(2), r"output", r"Global")),
        ("z", MT.Local, (tv(2), r"output", r"Global")),
        ("x", MT.Local, (tv(0), r"input", r"Global")),
    ],
)
def test_memory_type_of_inputs_and_outputs(who: str, mt: MemoryType, patterns: tuple[str, ...]) -> None:
    fd, x, y, z = _chain((8, 16))
    expect(lambda: {"x": x, "z": z}[who].set_memory_type(mt), KilnError, *patterns)


# -- vectorize ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "cols", "factor", "patterns"),
    [
        (F, 12, 3, (tv(2), ax(2), r"extent 3", r"power-of-two")),
        (F, 64, 32, (tv(2), ax(2), r"128 bytes", r"16 bytes")),
        (DataType.Half, 32, 16, (tv(2), ax(2), r"32 bytes")),
        (DataType.Double, 32, 4, (tv(2), ax(2), r"32 bytes")),
    ],
    ids=["float_x3", "float_x32", "half_x16", "double_x4"],
)
def test_vectorize_width(dtype: DataType, cols: int, factor: int, patterns: tuple[str, ...]) -> None:
    fd, x, y, z = _chain((8, cols), dtype)
    z.split(1, factor)
    expect(lambda: z.axis(-1).parallelize(PT.Vectorize), KilnError, *patterns)


def test_vectorize_a_reduction_axis() -> None:
    fd, x, y, z = _red((8, 16))
    z.split(1, 4)
    expect(lambda: z.axis(-1).parallelize(PT.Vectorize), KilnError, tv(2), ax(2), r"reduction")


@pytest.mark.parametrize(
    ("shape", "cols"),
    [((8, 10), 10), ((-1, -1), 77), ((-1, -1), 76)],
    ids=["static_10_by_4", "symbolic_77_by_4", "symbolic_76_by_4"],
)
def test_vectorize_a_non_divisible_axis_is_predicated(shape: tuple[int, int], cols: int) -> None:
    fd, x, y, z = _chain(shape)
    z.split(1, 4)
    z.axis(-1).parallelize(PT.Vectorize)
    if shape[0] == -1:
        z.axis(0).parallelize(PT.BIDx)
        z.axis(1).parallelize(PT.TIDx)
    _check_chain(fd, rnd(8 if shape[0] != -1 else 5, cols))


def test_vectorized_cache_of_an_input_with_a_ragged_row() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, True])
        z = fd.ops.neg(fd.ops.exp(x))
        fd.add_output(z)
    c = x.cache_after()
    for t in (c, z):
        t.split(1, 4)
        t.axis(0).parallelize(PT.BIDx)
        t.axis(1).parallelize(PT.TIDx)
    c.axis(2).parallelize(PT.Vectorize)
    _check_chain(fd, rnd(5, 77))
    _check_chain(fd, rnd(5, 76))
    expect(lambda: fd.execute([rnd(5, 78)[:, 1:]]), KilnError, inp(0, 0), ax(0), r"contiguous")


def test_vectorize_through_a_permute_reads_strided() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        z = fd.ops.permute(fd.ops.exp(x), [1, 0])
        fd.add_output(z)
    z.split(1, 4)
    z.axis(-1).parallelize(PT.Vectorize)
    a = rnd(8, 16)
    close(fd.execute([a])[0], np.exp(f64(a)).T)


# -- parallelization and inlining that disagree ------------------------------------------------------


def test_inline_then_parallelize_differently() -> None:
    fd, x, y, z = _chain((8, 16))
    y.inline_at(1)
    y.axis(0).parallelize(PT.TIDx)
    z.axis(0).parallelize(PT.BIDx)
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(2), ax(0), r"BIDx", tv(1), r"TIDx")


def test_local_producer_on_another_tidx_extent() -> None:
    fd, x, y, z = _chain((8, 16))
    y.axis(1).parallelize(PT.TIDx)
    z.split(1, 8)
    z.axis(2).parallelize(PT.TIDx)
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(1), ax(1), r"Local", tv(2), r"another thread")


def test_shared_producer_on_another_tidx_extent_runs() -> None:
    fd, x, y, z = _chain((8, 16))
    y.set_memory_type(MT.Shared)
    y.axis(1).parallelize(PT.TIDx)
    z.split(1, 8)
    z.axis(2).parallelize(PT.TIDx)
    _check_chain(fd, rnd(8, 16))


def test_global_producer_on_another_bidx_axis() -> None:
    fd, x, y, z = _chain((8, 16))
    y.set_memory_type(MT.Global)
    y.axis(0).parallelize(PT.BIDx)
    z.axis(1).parallelize(PT.BIDx)
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(1), ax(0), r"BIDx", tv(2), r"another block")


def test_two_outputs_on_different_thread_axes_run() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        y = fd.ops.exp(x)
        z = fd.ops.neg(x)
        fd.add_output(y)
        fd.add_output(z)
    y.axis(1).parallelize(PT.TIDx)
    z.axis(0).parallelize(PT.TIDx)
    a = rnd(8, 16)
    o1, o2 = fd.execute([a])
    close(o1, np.exp(f64(a)))
    close(o2, -f64(a))


@pytest.mark.parametrize(
    ("sched", "patterns"),
    [
        (lambda x, y, z: y.inline_at(-4), (tv(1), r"-4")),
        (lambda x, y, z: z.inline_at(1), (tv(2), r"no consumers")),
        (lambda x, y, z: (z.reorder({1: 0}), y.inline_at(1)), (tv(1), ax(0), tv(2))),
        (lambda x, y, z: z.reorder({-1: 0, 1: 1}), (tv(2), ax(1), r"twice")),
        (lambda x, y, z: x.inline_at(1), (tv(0), r"input")),
        (lambda x, y, z: z.set_serial_grid_reduction(), (tv(2), r"reduction")),
        (lambda x, y, z: y.set_evict_last(), (tv(1), r"fusion input")),
    ],
    ids=[
        "inline_at_minus_4",
        "inline_an_output",
        "inline_into_a_reordered_consumer",
        "reorder_axis_twice",
        "inline_an_input",
        "serial_grid_reduction_of_a_pointwise_op",
        "evict_last_on_a_computed_tensor",
    ],
)
def test_schedule_call_refused(
    sched: Callable[[Tensor, Tensor, Tensor], Any], patterns: tuple[str, ...]
) -> None:
    fd, x, y, z = _chain((8, 16))
    expect(lambda: sched(x, y, z), KilnError, *patterns)


def test_axis_handles_that_went_stale_or_belong_elsewhere() -> None:
    fd, x, y, z = _chain((8, 16))
    old = z.axis(1)
    z.split(1, 4)
    expect(lambda: old.parallelize(PT.TIDx), KilnError, tv(2), r"no longer a loop axis")
    # another tensor's axis wrapped as z's: the error names the tensor that owns it
    other = IterDomain(z, y.axis(0)._id)
    expect(lambda: other.parallelize(PT.TIDx), KilnError, tv(2), r"not an axis of T2", tv(1))
    expect(
        lambda: z.set_allocation_domain([y.axis(0), z.axis(1)], [True, True]),
        KilnError,
        tv(2),
        r"not an axis of T2",
    )
    fd2, x2, y2, z2 = _chain((8, 16))
    expect(
        lambda: z.set_allocation_domain([z2.axis(0), z.axis(1)], [True, True]),
        KilnError,
        tv(2),
        r"another fusion",
    )


def test_streaming_load_without_a_vector_is_refused_at_lower() -> None:
    fd, x, y, z = _chain((8, 16))
    c = x.cache_after()
    c.set_streaming_load()
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(3), r"vectorized")


def test_circular_buffering_a_global_tensor_is_refused_at_lower() -> None:
    # A Global output: only a Shared copy (or a Local one, in registers) is circular-buffered.
    fd, x, y, z = _chain((8, 16))
    z.circular_buffer(2)
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(2), r"is in Global memory; only a Shared copy")


def test_circular_buffering_a_local_cache_without_a_serial_loop_is_refused_at_lower() -> None:
    fd, x, y, z = _chain((8, 16))
    c = x.cache_after()
    c.circular_buffer(2)
    expect(lambda: fd.lower([rnd(8, 16)]), KilnError, tv(3), r"no serial loop to pipeline")


def test_segment_after_an_input() -> None:
    fd, x, y, z = _chain((8, 16))
    expect(lambda: fd.segment_after(x), KilnError, tv(0), r"input")
    fd.segment_after(z)  # the last tensor: an empty cut
    _check_chain(fd, rnd(8, 16))


# -- reductions by hand --------------------------------------------------------------------------


def test_grid_reduction_under_a_serial_loop_is_refused() -> None:
    fd, x, y, z = _red((8, 64))
    z.split(1, 16)
    z.axis(1).parallelize(PT.BIDx)
    z.axis(2).parallelize(PT.TIDx)
    expect(lambda: fd.lower([rnd(8, 64)]), KilnError, tv(2), r"serial loop", r"set_serial_grid_reduction")


@pytest.mark.parametrize("case", ["block_reduce", "split_block_reduce_symbolic", "unroll", "reduction_outer"])
def test_accepted_reduction_schedules(case: str) -> None:
    shape = (-1, -1) if case == "split_block_reduce_symbolic" else (8, 64)
    fd, x, y, z = _red(shape)
    if case == "block_reduce":
        z.axis(1).parallelize(PT.TIDx)
        z.axis(0).parallelize(PT.BIDx)
    elif case == "split_block_reduce_symbolic":
        z.split(1, 32)
        z.axis(2).parallelize(PT.TIDx)
        z.axis(0).parallelize(PT.BIDx)
    elif case == "unroll":
        z.axis(0).parallelize(PT.BIDx)  # one row's exp per block: the unrolled loop stays in registers
        z.split(1, 4)
        z.axis(2).parallelize(PT.Unroll)
    else:
        z.reorder({1: 0})
        z.axis(1).parallelize(PT.TIDx)
    _check_red(fd, rnd(5, 77) if shape[0] == -1 else rnd(8, 64))


# -- accepted pointwise schedules ------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "split_past_extent_on_tidx",
        "outer_split_symbolic",
        "reorder_negative_key",
        "unroll_symbolic",
        "cache_after_output",
        "cache_before_output",
        "cache_before_shared_tidx",
        "zero_size_tidx",
        "output_allocation_transposed",
    ],
)
def test_accepted_pointwise_schedules(case: str) -> None:
    symbolic = case in ("outer_split_symbolic", "unroll_symbolic")
    fd, x, y, z = _chain((-1, -1) if symbolic else ((0, 16) if case == "zero_size_tidx" else (8, 16)))
    if case == "split_past_extent_on_tidx":
        z.split(1, 1000)
        z.axis(-1).parallelize(PT.TIDx)
    elif case == "outer_split_symbolic":
        z.split(1, 3, inner_split=False)
        z.axis(1).parallelize(PT.TIDx)
        z.axis(0).parallelize(PT.BIDx)
    elif case == "reorder_negative_key":
        z.reorder({-1: 0})
    elif case == "unroll_symbolic":
        z.split(1, 4)
        z.axis(2).parallelize(PT.Unroll)
        z.axis(1).parallelize(PT.TIDx)
        z.axis(0).parallelize(PT.BIDx)
    elif case == "cache_after_output":
        assert z.cache_after().name == "T3"
    elif case == "cache_before_output":
        assert z.cache_before().name == "T3"
    elif case == "cache_before_shared_tidx":
        c = z.cache_before()
        c.set_memory_type(MT.Shared)
        c.axis(1).parallelize(PT.TIDx)
        z.axis(0).parallelize(PT.TIDx)
    elif case == "zero_size_tidx":
        z.axis(0).parallelize(PT.TIDx)
    else:
        z.set_allocation_domain([1, 0], [True, True])
    a = rnd(0, 16) if case == "zero_size_tidx" else (rnd(5, 17) if symbolic else rnd(8, 16))
    _check_chain(fd, a)


def test_broadcast_axes_on_threads() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, 8])
        z = fd.ops.neg(x)
        fd.add_output(z)
    z.axis(0).parallelize(PT.TIDy)
    z.axis(1).parallelize(PT.TIDx)
    a = rnd(1, 8)
    close(fd.execute([a])[0], -f64(a))
    with FusionDefinition() as fd:
        v = fd.define_tensor([-1])
        m = fd.define_tensor([-1, -1])
        z = fd.ops.add(fd.ops.broadcast_in_dim(v, [-1, -1], [1]), m)
        fd.add_output(z)
    z.merge(0, 1)
    z.split(0, 4)
    z.axis(1).parallelize(PT.TIDx)
    z.axis(0).parallelize(PT.BIDx)
    b, c = rnd(5), rnd(6, 5)
    close(fd.execute([b, c])[0], f64(b) + c)


def test_a_hand_schedule_after_an_automatic_run() -> None:
    fd, x, y, z = _red()
    a = rnd(8, 64)
    _check_red(fd, a)
    z.axis(1).parallelize(PT.TIDx)
    z.axis(0).parallelize(PT.BIDx)
    _check_red(fd, a)
    assert fd.lower([a]).kernels[0].launch["block"][0] == "max(i1, 1)"


def test_input_allocation_domain_declares_its_layout() -> None:
    fd, x, y, z = _chain((8, 16))
    x.set_allocation_domain([1, 0], [True, True])
    expect(lambda: fd.execute([rnd(8, 16)]), KilnError, inp(0, 0), ax(0), r"contiguous")
    _check_chain(fd, rnd(16, 8).T)


# -- scheduling inputs, layouts, and runaway loops ----------------------------------------------------


@pytest.mark.parametrize(
    "sched",
    [
        lambda x: x.axis(0).parallelize(PT.TIDx),
        lambda x: x.split(1, 4),
        lambda x: (x.split(1, 4), x.axis(-1).parallelize(PT.Vectorize)),
    ],
    ids=["parallelize", "split", "vectorize"],
)
def test_scheduling_an_input_is_refused(sched: Callable[[Tensor], Any]) -> None:
    fd, x, y, z = _chain((8, 16))
    expect(lambda: (sched(x), fd.lower([rnd(8, 16)])), KilnError, tv(0), r"input")


def test_hand_schedule_with_undeclared_layout_and_a_transposed_input() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        z = fd.ops.neg(x)
        fd.add_output(z)
    z.axis(0).parallelize(PT.BIDx)
    a = np.arange(12, dtype=np.float32).reshape(4, 3).T
    try:
        (out,) = fd.execute([a])
    except KilnError as e:
        assert "declared contiguous" not in str(e), str(e)
        return
    close(out, -f64(a))


def test_hand_schedule_with_declared_non_contiguity_and_a_transposed_input() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[False, False])
        z = fd.ops.neg(x)
        fd.add_output(z)
    z.axis(0).parallelize(PT.BIDx)
    a = np.arange(12, dtype=np.float32).reshape(4, 3).T
    close(fd.execute([a])[0], -f64(a))


def test_split_factor_far_past_the_extent_does_not_hang() -> None:
    proc = run_child(
        """
        with FusionDefinition() as fd:
            x = fd.define_tensor([8, 16])
            z = fd.ops.neg(fd.ops.exp(x))
            fd.add_output(z)
        a = np.ones((8, 16), np.float32)
        try:
            z.split(1, 2**62)
            (out,) = fd.execute([a])
        except KilnError as e:
            print("KILN_ERROR:", e)
        else:
            assert np.allclose(out, -np.exp(a)), out
            print("RESULT_OK")
    """,
        timeout=8,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KILN_ERROR" in proc.stdout or "RESULT_OK" in proc.stdout, proc.stdout


def test_split_factor_a_million_runs() -> None:
    fd, x, y, z = _chain((2, 3))
    z.split(1, 10**6)
    _check_chain(fd, rnd(2, 3))


@pytest.mark.parametrize("op", ["shape", "rand_like", "randn_like"])
@pytest.mark.parametrize("x", [1.5, None, [1, 2], "x", True])
def test_ops_taking_a_tensor_refuse_anything_else(op: str, x: Any) -> None:
    # A random op-call fuzzer found these raising AttributeError ('float' object has no
    # attribute 'ndim') instead of naming the op.
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match=f"{op}: expected a Tensor"):
            getattr(fd.ops, op)(x)
        fd.add_output(fd.ops.neg(t))


@pytest.mark.parametrize(
    "widths",
    [[-(2**63), 2**63 - 1], [-(2**62), -(2**62)], [-5, 6]],
    ids=["int64_min", "two_halves", "crop_then_grow"],
)
def test_pad_widths_that_crop_past_any_size_are_refused(widths: list) -> None:
    # Each crops more than the 4 elements given (and the first two more than any axis);
    # the extreme ones once computed 3 fill values from an overflowed size.
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            fd.add_output(fd.ops.pad(x, widths, 7.0))
        fd.execute([np.arange(4, dtype=np.float32)])

    expect(run, KilnError, tv(0), ax(0), r"crop")
