"""Probe: user misuse of the Python API on the CPU, beyond the existing bad-input catalogues.

The rule (DESIGN.md, README.md): a user mistake -- a wrong shape, dtype or rank of an input, a
wrong number of inputs, an invalid op argument, an invalid schedule call -- raises
``kiln.KilnError`` (``KilnTypeError`` for a wrong type) naming the tensor/argument and what was
expected, before anything runs. No Rust panic, no other exception type, no crash of the process.
Inputs that look odd but are valid give NumPy's float64 answer.

``test_bad_inputs*.py``, ``test_errors.py`` and ``test_index_errors.py`` already cover the
common cases; this file adds the ones they do not (NumPy arrays and NumPy ints where Python
ints are expected, arguments given twice under two names, conflicting keyword arguments,
``None`` where a list is expected, schedule calls on handles of another kind, atomicity of a
refused schedule call, ...). Cases that crashed the process during probing run in a child
interpreter. Tests marked ``xfail(strict=True, reason="defect: ...")`` document defects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import kiln
import numpy as np
import pytest
from error_util import ax, close, expect, f64, inp, rnd, run_child, tv
from kiln import (
    DataType,
    FusionDefinition,
    KilnError,
    KilnTypeError,
    MemoryType,
    ParallelType,
    Tensor,
)
from numpy.lib.stride_tricks import as_strided

F = DataType.Float
D = DataType
PT = ParallelType
MT = MemoryType
INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max


# ======================================================================================
# helpers
# ======================================================================================


def child_must_not_crash(body: str, timeout: float = 30) -> str:
    """``body`` must end normally (printing RESULT_OK or KILN_ERROR), not kill the interpreter."""
    proc = run_child(body, timeout)
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-1500:]}\nstderr:\n{proc.stderr[-1500:]}"
    assert proc.returncode == 0, report
    assert "RESULT_OK" in proc.stdout or "KILN_ERROR" in proc.stdout, report
    return proc.stdout


def _def(
    body: Callable[[FusionDefinition, Tensor], Any], shape: Sequence[int] = (-1, -1), dtype: DataType = F
) -> Callable[[], None]:
    """A fusion with input x = T0 of ``shape``; ``body(fd, x)`` must raise (else its tensor
    result, or -x, is the output)."""

    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(list(shape), dtype=dtype)
            out = body(fd, x)
            fd.add_output(out if isinstance(out, Tensor) else fd.ops.neg(x))

    return run


def _define(**kwargs: Any) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(**kwargs)
            fd.add_output(fd.ops.neg(x))

    return run


def _chain(
    shape: Sequence[int] = (8, 16), dtype: DataType = F
) -> tuple[FusionDefinition, Tensor, Tensor, Tensor]:
    """x = T0 -> y = exp(x) = T1 -> z = -y = T2 (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype=dtype)
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    return fd, x, y, z


def _red(shape: Sequence[int] = (8, 16)) -> tuple[FusionDefinition, Tensor, Tensor, Tensor]:
    """x = T0 -> y = exp(x) = T1 -> z = sum(y, [1]) = T2 (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape))
        y = fd.ops.exp(x)
        z = fd.ops.sum(y, [1])
        fd.add_output(z)
    return fd, x, y, z


def _idx(fd: FusionDefinition, shape: Sequence[int], dtype: DataType = D.Int) -> Tensor:
    return fd.define_tensor(list(shape), dtype=dtype)


# ======================================================================================
# 1. Definition-time misuse
# ======================================================================================

DEFINITION_ERRORS = [
    # define_tensor: shape
    pytest.param(
        _define(shape=np.array([-1, -1])),
        KilnTypeError,
        (tv(0), r"shape", r"list of ints"),
        id="define_shape_ndarray",
    ),
    pytest.param(
        _define(shape=[-1, None]), KilnTypeError, (tv(0), r"shape", r"None"), id="define_shape_none_entry"
    ),
    pytest.param(_define(shape=5), KilnTypeError, (tv(0), r"shape", r"\b5\b"), id="define_shape_int"),
    pytest.param(
        _define(shape=[True, -1]), KilnTypeError, (tv(0), r"shape", r"True"), id="define_shape_bool"
    ),
    pytest.param(
        _define(shape=[-(2**70)]),
        KilnError,
        (tv(0), ax(0), str(-(2**70)), r"-1 \(symbolic\)"),
        id="define_shape_minus_2_70",
    ),
    # define_tensor: contiguity / stride_order / dtype / is_cpu
    pytest.param(
        _define(shape=[-1, -1], contiguity="yes"),
        KilnTypeError,
        (tv(0), r"contiguity", r"'yes'"),
        id="contiguity_str",
    ),
    pytest.param(
        _define(shape=[-1, -1], contiguity=["a", "b"]),
        KilnTypeError,
        (tv(0), r"contiguity"),
        id="contiguity_strs",
    ),
    pytest.param(
        _define(shape=[-1, -1], contiguity=[1.0, 0.5]),
        KilnTypeError,
        (tv(0), r"contiguity", r"0\.5"),
        id="contiguity_floats",
    ),
    pytest.param(
        _define(shape=[1, -1], contiguity=[False, True]),
        KilnError,
        (tv(0), ax(0), r"broadcast", r"None"),
        id="contiguity_false_on_broadcast_axis",
    ),
    pytest.param(
        _define(shape=[-1, -1], stride_order=[0, 0]),
        KilnError,
        (tv(0), r"stride_order \[0, 0\]"),
        id="stride_order_repeated",
    ),
    pytest.param(
        _define(shape=[-1, -1], stride_order=[0]),
        KilnError,
        (tv(0), r"stride_order \[0\]"),
        id="stride_order_short",
    ),
    pytest.param(
        _define(shape=[-1, -1], stride_order="ab"),
        KilnTypeError,
        (tv(0), r"stride_order", r"'ab'"),
        id="stride_order_str",
    ),
    pytest.param(
        _define(shape=[-1, -1], stride_order=[2**70, 0]),
        KilnError,
        (tv(0), r"stride_order", str(2**70), r"64 bits"),
        id="stride_order_2_70",
    ),
    pytest.param(
        _define(shape=[-1], dtype=None), KilnTypeError, (tv(0), r"DataType", r"None"), id="dtype_none"
    ),
    pytest.param(
        _define(shape=[-1], dtype=np.float32),
        KilnTypeError,
        (tv(0), r"DataType", r"float32"),
        id="dtype_numpy_type",
    ),
    pytest.param(
        _define(shape=[-1], dtype=PT.TIDx),
        KilnTypeError,
        (tv(0), r"DataType", r"TIDx"),
        id="dtype_parallel_type",
    ),
    pytest.param(
        _define(shape=[-1, -1], contiguity=[True, True], dtype="Float"),
        KilnTypeError,
        (tv(0), r"DataType", r"'Float'"),
        id="dtype_str_keyword",
    ),
    pytest.param(
        _define(shape=[], is_cpu=True), KilnError, (tv(0), r"is_cpu", r"define_scalar"), id="is_cpu"
    ),
    # reductions
    pytest.param(
        _def(lambda fd, x: fd.ops.sum(x, {1})),
        KilnTypeError,
        (r"sum: dims", r"list of ints"),
        id="sum_dims_set",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.sum(x, [1], dtype="float")),
        KilnTypeError,
        (r"sum", r"DataType", r"'float'"),
        id="sum_dtype_str",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.max(x, [-3], keepdim=True)),
        KilnError,
        (r"max", tv(0), ax(-3), r"-2 to 1"),
        id="max_keepdim_dim_minus_3",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.min(x, [1.0])), KilnTypeError, (r"min: dims", r"1\.0"), id="min_float_dim"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.prod(x, [])), KilnError, (r"prod", tv(0), r"no axes"), id="prod_no_dims"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.logsumexp(x, [])),
        KilnError,
        (r"logsumexp", tv(0), r"no axes"),
        id="logsumexp_no_dims",
    ),
    pytest.param(_def(lambda fd, x: fd.ops.mean(x, [])), KilnError, (tv(0), r"no axes"), id="mean_no_dims"),
    pytest.param(
        _def(lambda fd, x: fd.ops.mean(x, [1, 1])), KilnError, (tv(0), ax(1), r"twice"), id="mean_dim_twice"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.mean(x, [1], dtype=D.Int)),
        KilnTypeError,
        (r"mean", r"Int", r"floating"),
        id="mean_dtype_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.mean(x, [1], dtype="x")),
        KilnTypeError,
        (r"mean", r"DataType"),
        id="mean_dtype_str",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.welford(x, [])[0]), KilnError, (r"no axes",), id="welford_no_dims"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.welford(x, [1])[0], dtype=D.Int),
        KilnTypeError,
        (tv(0), r"Int", r"floating"),
        id="welford_of_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.sum(fd.define_scalar(2.0), [0])),
        KilnTypeError,
        (r"sum: expected a Tensor", r"Scalar"),
        id="sum_of_a_scalar",
    ),
    # permute / broadcast_in_dim / broadcast / expand
    pytest.param(
        _def(lambda fd, x: fd.ops.permute(x, [-1, 1])),
        KilnError,
        (r"permute", tv(0), ax(1), r"twice"),
        id="permute_negative_duplicate",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.permute(x, [0, 1, 2])),
        KilnError,
        (r"permute", tv(0), r"rank 2", r"3 entries"),
        id="permute_too_long",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.permute(x, "10")),
        KilnTypeError,
        (r"permute: dims", r"'10'"),
        id="permute_str",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [-1, -1, -1], [1, 1])),
        KilnError,
        (tv(0), r"broadcast_dims", r"strictly increasing", r"\[1, 1\]"),
        id="bid_dims_repeated",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [-1], [0, 1])),
        KilnError,
        (tv(0), r"output axis 1", r"output rank 1"),
        id="bid_shape_shorter_than_input",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2.0, -1, -1], [1, 2])),
        KilnTypeError,
        (r"broadcast_in_dim: shape", r"2\.0"),
        id="bid_shape_float",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [None, -1, -1], [1, 2])),
        KilnTypeError,
        (r"broadcast_in_dim: shape", r"None"),
        id="bid_shape_none",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [-1, -1, -1])),
        KilnError,
        (tv(0), r"rank 2", r"broadcast_dims has 0 entries"),
        id="bid_dims_missing",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2, -1, -1], [1, 5])),
        KilnError,
        (tv(0), r"output axis 5", r"output rank 3"),
        id="bid_dim_past_output_rank",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2, 5, 4], [1, 2]), (3, 4)),
        KilnError,
        (tv(0), ax(0), r"size 3", r"size 5"),
        id="bid_static_3_asked_5",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast(x, np.array([True, False, False]))),
        KilnTypeError,
        (r"broadcast: is_broadcast_dim", r"list"),
        id="broadcast_flags_ndarray",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.broadcast(x, [True])),
        KilnError,
        (r"broadcast", tv(0), r"rank 2", r"keeps 0 axes"),
        id="broadcast_flags_short",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.expand(x, [3])),
        KilnError,
        (r"expand", tv(0), r"rank 2", r"1 entries"),
        id="expand_shape_short",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.expand(x, [3.0, 4]), (1, 4)),
        KilnTypeError,
        (r"shape", r"3\.0"),
        id="expand_float_size",
    ),
    # reshape / slice / select / squeeze / pad / cat / triu
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [None, 4])),
        KilnTypeError,
        (r"reshape", r"None"),
        id="reshape_none_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [7, 2]), (3, 4)),
        KilnError,
        (tv(0), r"12 elements", r"\[7, 2\]", r"\b14\b"),
        id="reshape_static_12_to_14",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, [3, 4], [12], [12]), (3, 4)),
        KilnTypeError,
        (r"reshape", r"4 arguments"),
        id="reshape_four_arguments",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.reshape(x, np.array([12])), (3, 4)),
        KilnTypeError,
        (r"reshape: new_shape", r"list"),
        id="reshape_ndarray_shape",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [None, 0], [3, 4]), (3, 4)),
        KilnTypeError,
        (r"slice", r"None"),
        id="slice_none_start",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0, 0], [3, 4], [1.0, 1]), (3, 4)),
        KilnError,
        (r"slice", ax(0), r"stride 1\.0", tv(0)),
        id="slice_float_step",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0, 0], [3, 4], [None, 1]), (3, 4)),
        KilnError,
        (r"slice", ax(0), r"stride None", tv(0)),
        id="slice_none_step",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [0, 0], [3]), (3, 4)),
        KilnError,
        (r"slice", tv(0), r"rank 2"),
        id="slice_ends_short",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.slice(x, [True, 0], [3, 4]), (3, 4)),
        KilnTypeError,
        (r"slice", r"True"),
        id="slice_bool_start",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.select(x, 0, 1.0), (3, 4)),
        KilnTypeError,
        (r"select", r"1\.0"),
        id="select_float_index",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.select(x, -3, 1), (3, 4)),
        KilnError,
        (r"select", ax(-3), tv(0), r"rank 2"),
        id="select_dim_minus_3",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.squeeze(x, [-3]), (1, 4)),
        KilnError,
        (r"squeeze", tv(0), ax(-3), r"-2 to 1"),
        id="squeeze_dim_minus_3",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, np.array([1, 1])), (3, 4)),
        KilnTypeError,
        (r"pad: pad_widths", r"list"),
        id="pad_ndarray_widths",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [None, 1]), (3, 4)),
        KilnTypeError,
        (r"pad", r"None"),
        id="pad_none_width",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.pad(x, [True, 1]), (3, 4)),
        KilnTypeError,
        (r"pad", r"True"),
        id="pad_bool_width",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, x], 0.0)), KilnTypeError, (r"cat: dim", r"0\.0"), id="cat_float_dim"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cat([x, fd.define_scalar(1.0)], 0)),
        KilnTypeError,
        (r"cat: expected a Tensor", r"Scalar"),
        id="cat_with_a_scalar",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.triu(x), ()),
        KilnError,
        (r"triu", tv(0), r"rank 0", r"at least 2"),
        id="triu_0d",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.triu(x, True)),
        KilnTypeError,
        (r"triu: diagonal", r"True"),
        id="triu_bool_diagonal",
    ),
    # where / cast / full / iota / random / size
    pytest.param(
        _def(lambda fd, x: fd.ops.where(fd.define_tensor([3], dtype=D.Bool), x, 0.0), (4,)),
        KilnError,
        (r"where", ax(0), r"size 3", r"size 4", tv(1), tv(0)),
        id="where_static_sizes_differ",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.where(fd.ops.gt(x, 0.0), None, 1.0)),
        KilnTypeError,
        (r"where", r"None"),
        id="where_none_operand",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cast(x, None)),
        KilnTypeError,
        (r"cast", tv(0), r"DataType", r"None"),
        id="cast_to_none",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.cast("x", D.Int)), KilnTypeError, (r"cast", r"'x'"), id="cast_a_str"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], None, F)), KilnTypeError, (r"full", r"None"), id="full_value_none"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], "1", F)), KilnTypeError, (r"full", r"'1'"), id="full_value_str"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], 1.0, None)),
        KilnTypeError,
        (r"full", r"DataType"),
        id="full_dtype_none",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], float("nan"), D.Int)),
        KilnError,
        (r"full", r"NaN", r"int64"),
        id="full_nan_as_int",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], float("inf"), D.Int32)),
        KilnError,
        (r"full", r"inf", r"int32"),
        id="full_inf_as_int32",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([3], 2**40, D.Int32)),
        KilnError,
        (r"full", str(2**40), r"Int32"),
        id="full_2_40_as_int32",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([fd.define_scalar(dtype=D.Bool)], 1.0, F)),
        KilnTypeError,
        (r"full", ax(0), r"s0", r"Int"),
        id="full_bool_scalar_size",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.iota(4, "a")), KilnTypeError, (r"iota", r"'a'"), id="iota_str_start"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.iota(4.0)), KilnTypeError, (r"iota", r"4\.0"), id="iota_float_length"
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.uniform(x, 1.0, [3])),
        KilnTypeError,
        (r"uniform", r"scalars"),
        id="uniform_tensor_bound",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.full([fd.ops.size(fd.define_scalar(2.0), 0)], 1.0, F)),
        KilnTypeError,
        (r"size: expected a Tensor", r"Scalar"),
        id="size_of_a_scalar",
    ),
    pytest.param(_def(lambda fd, x: fd.ops.exp(None)), KilnTypeError, (r"exp", r"None"), id="exp_of_none"),
    # gathers
    pytest.param(
        _def(lambda fd, x: fd.ops.index_select(x, _idx(fd, [-1]), -3)),
        KilnError,
        (r"index_select", ax(-3), tv(0), r"rank 2"),
        id="index_select_dim_minus_3",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.index_select(x, _idx(fd, [-1], D.Bool), 0)),
        KilnTypeError,
        (r"index_select", tv(1), r"bool", r"Int"),
        id="index_select_bool_index",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.gather(x, _idx(fd, [-1, -1]), -3)),
        KilnError,
        (r"gather", ax(-3), tv(0)),
        id="gather_dim_minus_3",
    ),
    # scalars
    pytest.param(
        _def(lambda fd, x: fd.ops.mul(x, fd.define_scalar(2.0, dtype="Float"))),
        KilnTypeError,
        (r"define_scalar", r"DataType", r"'Float'"),
        id="define_scalar_dtype_str",
    ),
    pytest.param(
        _def(lambda fd, x: fd.ops.mul(x, fd.define_scalar(1e300, dtype=D.Int))),
        KilnError,
        (r"define_scalar", r"Int constant"),
        id="define_scalar_1e300_as_int",
    ),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), DEFINITION_ERRORS)
def test_definition_misuse(fn: Callable[[], Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(fn, exc, *patterns)


def _output_with(**kwargs: Any) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            fd.add_output(fd.ops.neg(x), **kwargs)

    return run


@pytest.mark.parametrize(
    ("kwargs", "exc", "patterns"),
    [
        ({"stride_order": [0, 0]}, KilnError, (tv(1), r"stride_order \[0, 0\]", r"permutation")),
        ({"stride_order": [0]}, KilnError, (tv(1), r"stride_order \[0\]", r"2-d output")),
        ({"stride_order": [5, 0]}, KilnError, (tv(1), r"stride_order \[5, 0\]", r"permutation")),
        ({"stride_order": "01"}, KilnTypeError, (tv(1), r"stride_order", r"list of ints")),
        ({"alias_input": 3}, KilnTypeError, (r"add_output", r"expected a Tensor", r"\b3\b")),
    ],
    ids=[
        "stride_order_repeated",
        "stride_order_short",
        "stride_order_out_of_range",
        "stride_order_str",
        "alias_input_number",
    ],
)
def test_add_output_misuse(kwargs: dict[str, Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(_output_with(**kwargs), exc, *patterns)


# -- defects found at definition time -------------------------------------------------------

# A 1-d NumPy array of axes where a list of axes is taken reads as that list (the fusion
# prints as the list's); one where a single int is taken is a KilnTypeError (NumPy arrays
# have ``__index__`` even with several elements, and it raised builtins.TypeError).
NDARRAY_LISTS = [
    pytest.param(lambda fd, x, d: fd.ops.sum(x, d([0, 1])), id="sum_dims"),
    pytest.param(lambda fd, x, d: fd.ops.max(x, d([1])), id="max_dims"),
    pytest.param(lambda fd, x, d: fd.ops.mean(x, d([1])), id="mean_dims"),
    pytest.param(lambda fd, x, d: fd.ops.var(x, d([1])), id="var_dims"),
    pytest.param(lambda fd, x, d: fd.ops.logsumexp(x, d([1])), id="logsumexp_dims"),
    pytest.param(lambda fd, x, d: fd.ops.permute(x, d([1, 0])), id="permute_dims"),
    pytest.param(
        lambda fd, x, d: fd.ops.broadcast_in_dim(x, [-1, -1, -1], d([0, 1])), id="broadcast_in_dim_dims"
    ),
    pytest.param(
        lambda fd, x, d: fd.define_tensor([-1, -1], stride_order=d([1, 0])), id="define_tensor_stride_order"
    ),
    pytest.param(
        lambda fd, x, d: fd.add_output(fd.ops.neg(x), stride_order=d([0, 1])), id="add_output_stride_order"
    ),
]

NDARRAY_SITES = [
    pytest.param(lambda fd, x: fd.ops.sum(x, [np.array([1])]), id="sum_dims_entry"),
    pytest.param(lambda fd, x: fd.ops.select(x, np.array([0]), 0), id="select_dim"),
    pytest.param(lambda fd, x: fd.ops.cat([x, x], np.array([0])), id="cat_dim"),
    pytest.param(lambda fd, x: fd.ops.triu(x, np.array([0, 1])), id="triu_diagonal"),
    pytest.param(lambda fd, x: fd.ops.full([fd.ops.size(x, np.array([0]))], 1.0, F), id="size_dim"),
    pytest.param(
        lambda fd, x: fd.ops.index_select(x, _idx(fd, [-1]), np.array([0, 1])), id="index_select_dim"
    ),
]


@pytest.mark.parametrize("body", NDARRAY_LISTS)
def test_ndarray_of_axes_reads_as_a_list(body: Callable[..., Any]) -> None:
    printed = []
    for as_axes in (list, np.array):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1], dtype=F)
            out = body(fd, x, as_axes)
            if isinstance(out, Tensor):
                fd.add_output(out)
        printed.append(str(fd))
    assert printed[0] == printed[1]


@pytest.mark.parametrize("body", NDARRAY_SITES)
def test_ndarray_for_an_int_is_a_kiln_error(body: Callable[[FusionDefinition, Tensor], Any]) -> None:
    expect(_def(body), KilnTypeError)


def test_add_output_of_a_number_with_stride_order() -> None:
    expect(
        _def(lambda fd, x: fd.add_output(3.0, stride_order=[0, 1])), KilnTypeError, r"add_output", r"Tensor"
    )


def test_define_tensor_contiguity_of_ints_other_than_0_1() -> None:
    expect(_define(shape=[-1, -1], contiguity=[2, 3]), KilnTypeError, tv(0), r"contiguity")


def test_sum_with_both_dims_and_axes() -> None:
    expect(_def(lambda fd, x: fd.ops.sum(x, [0], axes=[1])), KilnError, r"dims", r"axes")


def test_broadcast_in_dim_with_both_shape_and_output_shape() -> None:
    expect(
        _def(lambda fd, x: fd.ops.broadcast_in_dim(x, [2, -1, -1], [1, 2], output_shape=[5, -1, -1])),
        KilnError,
        r"shape",
        r"output_shape",
    )


def test_reshape_with_a_wrong_original_shape() -> None:
    expect(
        _def(lambda fd, x: fd.ops.reshape(x, [3, 5], [12]), (3, 4)),
        KilnError,
        tv(0),
        r"original_shape",
        r"\[3, 5\]",
    )


def test_reshape_original_shape_is_checked_when_the_sizes_are_known_at_run_time() -> None:
    a = rnd(3, 4)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.define_scalar(dtype=D.Int)
        fd.add_output(fd.ops.reshape(x, [s, -1], [12]))
    close(fd.execute([a, 3])[0], f64(a).reshape(12))
    expect(lambda: fd.execute([a, 4]), KilnError, tv(0), r"original_shape", r"axis 0")
    expect(_def(lambda fd, x: fd.ops.reshape(x, [3, -2], [12])), KilnError, tv(0), r"original_shape", r"-2")


@pytest.mark.parametrize("value", [np.float32(2.0), np.float64(2.0), np.int64(2), np.int32(2)])
def test_define_scalar_takes_numpy_scalars(value: Any) -> None:
    """A NumPy scalar is a constant of its Python value (it was refused, naming no call)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=F)
        fd.add_output(fd.ops.mul(x, fd.define_scalar(value)))
    xs = np.arange(5, dtype=np.float32)
    np.testing.assert_allclose(fd.execute([xs])[0], xs.astype(np.float64) * 2.0, rtol=0)
    with pytest.raises(KilnTypeError, match=r"define_scalar"):
        fd.define_scalar(np.array([1.0, 2.0]))


def test_python_call_errors_stay_type_errors() -> None:
    # Wrong arity or an unknown op name are Python call errors (TypeError/AttributeError),
    # not something kiln validates; they must at least never crash or reach Rust.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        with pytest.raises(TypeError):
            fd.ops.exp(x, 1)
        with pytest.raises(TypeError):
            fd.ops.add(x)
        with pytest.raises(AttributeError):
            fd.ops.softmax(x, 0)
        fd.add_output(fd.ops.neg(x))


# -- odd but valid definitions --------------------------------------------------------------


def _run1(
    body: Callable[[FusionDefinition, Tensor], Any],
    a: np.ndarray,
    shape: Sequence[int] | None = None,
    dtype: DataType = F,
) -> Any:
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape) if shape is not None else [-1] * a.ndim, dtype=dtype)
        fd.add_output(body(fd, x))
    return fd.execute([a])[0]


A234 = rnd(2, 3, 4)
A34 = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.mark.parametrize(
    ("body", "a", "want"),
    [
        (lambda fd, x: fd.ops.permute(x, [-1, 0, -2]), A234, A234.transpose(2, 0, 1)),
        (lambda fd, x: fd.ops.sum(x, [-1, 0], keepdim=True), A234, f64(A234).sum(axis=(0, 2), keepdims=True)),
        (lambda fd, x: fd.ops.select(x, -1, 1), A34, A34[:, 1]),
        (lambda fd, x: fd.ops.sum(x, (np.int64(1),)), A34, f64(A34).sum(1)),
        (lambda fd, x: fd.ops.cat([x, x], np.int64(1)), A34, np.concatenate([A34, A34], 1)),
        (
            lambda fd, x: fd.ops.pad(x, [1, 1], float("nan")),
            A34,
            np.pad(f64(A34), ((0, 0), (1, 1)), constant_values=np.nan),
        ),
        (
            lambda fd, x: fd.ops.pad(x, [1, 0], True),
            A34,
            np.pad(f64(A34), ((0, 0), (1, 0)), constant_values=1),
        ),
        (lambda fd, x: fd.ops.mul(x, fd.ops.where(True, 1.5, 2.0)), A34, 1.5 * f64(A34)),
        (lambda fd, x: fd.ops.sum(x, [1], keepdim=None), A34, f64(A34).sum(1)),
        (lambda fd, x: fd.ops.var(x, [1], correction=-(2**40)), A34, np.var(f64(A34), axis=1, ddof=-(2**40))),
    ],
    ids=[
        "permute_negative_dims",
        "sum_negative_dims_keepdim",
        "select_negative_dim",
        "sum_numpy_int_dim",
        "cat_numpy_int_dim",
        "pad_with_nan",
        "pad_with_true",
        "where_of_numbers",
        "keepdim_none",
        "var_huge_negative_correction",
    ],
)
def test_odd_but_valid_definitions(
    body: Callable[[FusionDefinition, Tensor], Any], a: np.ndarray, want: np.ndarray
) -> None:
    close(_run1(body, a), want)


def test_negative_dims_of_gathers() -> None:
    idx = np.array([3, 0])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=D.Int)
        fd.add_output(fd.ops.index_select(x, i, -1))
    close(fd.execute([A34, idx])[0], A34[:, idx])
    idx2 = np.array([[3], [0], [1]])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1, -1], dtype=D.Int)
        fd.add_output(fd.ops.take_along_axis(x, i, -1))
    close(fd.execute([A34, idx2])[0], np.take_along_axis(A34, idx2, -1))


def test_cat_of_bool_and_int_promotes() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], dtype=D.Bool)
        y = fd.define_tensor([3, 4], dtype=D.Int)
        fd.add_output(fd.ops.cat([x, y], 0))
    b, i = np.ones((3, 4), bool), np.arange(12).reshape(3, 4)
    (out,) = fd.execute([b, i])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, np.concatenate([b.astype(np.int64), i]))


def test_0d_shape_ops_with_empty_arguments() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([])
        outs = [
            fd.ops.reshape(x, [1, 1]),
            fd.ops.permute(x, []),
            fd.ops.squeeze(x, []),
            fd.ops.broadcast_in_dim(x, [], []),
            fd.ops.slice(x, [], []),
            fd.ops.pad(x, []),
        ]
        for t in outs:
            fd.add_output(t)
    got = fd.execute([np.array(2.5, np.float32)])
    assert [g.shape for g in got] == [(1, 1), (), (), (), (), ()]
    for g in got:
        close(np.asarray(g).reshape(-1), [2.5])
    expect(_def(lambda fd, x: fd.ops.reshape(x, [2]), ()), KilnError, tv(0), r"1 elements", r"\[2\]")
    expect(_def(lambda fd, x: fd.ops.sum(x, []), (3,)), KilnError, tv(0), r"no axes")


def test_re_entering_a_fusion_after_a_refused_op() -> None:
    with pytest.raises(KilnError, match=r"out of range"):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            fd.ops.sum(x, [3])
    with fd:
        fd.add_output(fd.ops.neg(x))
    a = rnd(5)
    close(fd.execute([a])[0], -f64(a))


# ======================================================================================
# 2. Execution-time misuse
# ======================================================================================


def _add() -> FusionDefinition:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(a, b))
    return fd


def _unary(shape: Sequence[int] = (-1, -1), contiguity: Any = None, dtype: DataType = F) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), contiguity=contiguity, dtype=dtype)
        fd.add_output(fd.ops.mul(x, 2.0))
    return fd


def _scalar_fd(dtype: DataType, tensor_dtype: DataType = F) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=tensor_dtype)
        s = fd.define_scalar(dtype=dtype)
        fd.add_output(fd.ops.where(s, x, x) if dtype == D.Bool else fd.ops.add(x, s))
    return fd


def _full_of(dtype: DataType = D.Int) -> FusionDefinition:
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=dtype)
        fd.add_output(fd.ops.full([n], 1.0, F))
    return fd


def _index_select(index_dtype: DataType = D.Int, dim: int = 0, index_rank: int = 1) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1] * index_rank, dtype=index_dtype)
        fd.add_output(fd.ops.index_select(x, i, dim))
    return fd


def _gather() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1, -1], dtype=D.Int)
        fd.add_output(fd.ops.gather(x, i, 1))
    return fd


A23 = rnd(2, 3)
STACK = np.stack([A23, A23])
OBJ = np.empty(2, object)
OBJ[0], OBJ[1] = A23, A23

EXECUTION_ERRORS = [
    # the inputs container
    pytest.param(
        lambda: _add().execute(None), KilnTypeError, (r"list of arrays", r"NoneType"), id="exec_none"
    ),
    pytest.param(lambda: _add().execute({1, 2}), KilnTypeError, (r"list of arrays", r"set"), id="exec_set"),
    pytest.param(lambda: _add().execute("ab"), KilnTypeError, (r"list of arrays", r"str"), id="exec_str"),
    pytest.param(
        lambda: _add().execute(OBJ), KilnTypeError, (r"list of arrays", r"ndarray"), id="exec_object_ndarray"
    ),
    pytest.param(
        lambda: _add().execute(STACK),
        KilnTypeError,
        (r"list of arrays", r"ndarray"),
        id="exec_stacked_ndarray",
    ),
    pytest.param(
        lambda: _add().lower(None), KilnTypeError, (r"list of arrays", r"NoneType"), id="lower_none"
    ),
    pytest.param(lambda: _add().lower("ab"), KilnTypeError, (r"list of arrays", r"str"), id="lower_str"),
    pytest.param(
        lambda: _unary((-1,)).execute([[1.0, 2.0]]),
        KilnTypeError,
        (inp(0, 0), r"expected an array", r"list"),
        id="flat_list_for_1d",
    ),
    pytest.param(
        lambda: _unary((-1,)).execute([np.asmatrix(np.ones((1, 3), np.float32))]),
        KilnError,
        (inp(0, 0), r"rank 2", r"rank 1"),
        id="np_matrix_for_1d",
        marks=pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
    ),
    # execute options
    pytest.param(
        lambda: _add().execute([A23, A23], device="CPU"),
        KilnError,
        (r"device", r"'CPU'"),
        id="device_upper_case",
    ),
    pytest.param(
        lambda: _add().execute([A23, A23], device=0), KilnError, (r"device", r"\b0\b"), id="device_int"
    ),
    pytest.param(lambda: _add().execute([A23, A23], comm=1), KilnError, (r"comm",), id="comm_without_mesh"),
    # ranks and static sizes
    pytest.param(
        lambda: _unary([0, 4]).execute([np.zeros((1, 4), np.float32)]),
        KilnError,
        (inp(0, 0), ax(0), r"size 1", r"\b0\b"),
        id="static_zero_axis_given_1",
    ),
    pytest.param(
        lambda: _unary((-1,)).execute([np.float32(1.0)]),
        KilnError,
        (inp(0, 0), r"rank 0", r"rank 1"),
        id="0d_for_1d",
    ),
    pytest.param(
        lambda: _unary((1,)).execute([np.array(1.0, np.float32)]),
        KilnError,
        (inp(0, 0), r"rank 0", r"rank 1"),
        id="0d_for_broadcast_axis",
    ),
    pytest.param(
        lambda: _unary(()).execute([1.0]),
        KilnTypeError,
        (inp(0, 0), r"expected an array", r"float"),
        id="python_float_for_0d",
    ),
    pytest.param(
        lambda: _unary(()).execute([np.ones((1, 1), np.float32)]),
        KilnError,
        (inp(0, 0), r"rank 2", r"rank 0"),
        id="2d_for_0d",
    ),
    # declared contiguity
    pytest.param(
        lambda: _unary((-1,), [True]).execute([np.broadcast_to(np.float32(1), (5,))]),
        KilnError,
        (inp(0, 0), ax(0), r"stride 0", r"contiguous"),
        id="contiguous_given_stride_0",
    ),
    pytest.param(
        lambda: _unary((-1,), [True]).execute([rnd(10)[::2]]),
        KilnError,
        (inp(0, 0), ax(0), r"stride 2", r"contiguous"),
        id="contiguous_given_step_2",
    ),
    pytest.param(
        lambda: _unary((-1, -1), True).execute([np.asfortranarray(rnd(5, 4))]),
        KilnError,
        (inp(0, 0), ax(1), r"stride 5", r"contiguous"),
        id="contiguous_flag_given_fortran",
    ),
    pytest.param(
        lambda: _unary((-1, -1), [False, True]).execute([rnd(5, 4).T]),
        KilnError,
        (inp(0, 0), ax(1), r"stride 4", r"contiguous"),
        id="inner_contiguous_given_transpose",
    ),
    # dtypes
    pytest.param(
        lambda: _unary((-1,), dtype=D.BFloat16).execute([np.ones(3, np.float16)]),
        KilnTypeError,
        (inp(0, 0), r"Half", r"BFloat16"),
        id="half_for_bfloat16",
    ),
    pytest.param(
        lambda: _unary((-1,), dtype=D.BFloat16).execute([np.ones(3, np.uint16)]),
        KilnTypeError,
        (inp(0, 0), r"uint16", r"bfloat16"),
        id="uint16_for_bfloat16",
    ),
    pytest.param(
        lambda: _index_select().execute([A23, np.array([True, False])]),
        KilnTypeError,
        (inp(1, 1), r"Bool", r"\bInt\b"),
        id="bool_array_for_int_index",
    ),
    # scalars
    pytest.param(
        lambda: _scalar_fd(D.Bool).execute([np.ones(3, np.float32), float("nan")]),
        KilnTypeError,
        (r"input 1 \(s0\)", r"NaN", r"Bool"),
        id="nan_for_bool_scalar",
    ),
    pytest.param(
        lambda: _scalar_fd(D.Int32, D.Int32).execute([np.ones(3, np.int32), float("nan")]),
        KilnTypeError,
        (r"input 1 \(s0\)", r"NaN", r"Int32"),
        id="nan_for_int32_scalar",
    ),
    pytest.param(
        lambda: _full_of().execute([float("nan")]),
        KilnTypeError,
        (r"input 0 \(s0\)", r"NaN", r"\bInt\b"),
        id="nan_for_size_scalar",
    ),
    pytest.param(
        lambda: _full_of(D.Int32).execute([2**31]),
        KilnError,
        (r"input 0 \(s0\)", str(2**31), r"Int32"),
        id="int32_size_scalar_2_31",
    ),
    pytest.param(
        lambda: _scalar_fd(D.Double).execute([2.0, np.ones(3, np.float32)]),
        KilnTypeError,
        (inp(0, 0), r"expected an array", r"float"),
        id="scalar_and_array_swapped",
    ),
    # index values
    pytest.param(
        lambda: _index_select(D.Int32).execute([A23.T.copy(), np.array([0, 3], np.int32)]),
        KilnError,
        (tv(1), r"holds 3 at element 1", tv(0), r"\[0, 3\)"),
        id="int32_index_out_of_range",
    ),
    pytest.param(
        lambda: _index_select(dim=1).execute([A23, np.array([0, 3])]),
        KilnError,
        (tv(1), r"holds 3 at element 1", r"\[0, 3\)"),
        id="index_select_dim_1_out_of_range",
    ),
    pytest.param(
        lambda: _index_select(dim=1).execute([A23, np.array([0, INT64_MIN])]),
        KilnError,
        (tv(1), rf"holds {INT64_MIN} at element 1"),
        id="index_int64_min",
    ),
    pytest.param(
        lambda: _gather().execute([A23, np.array([[0], [-1]])]),
        KilnError,
        (tv(1), r"holds -1 at element 1", tv(0)),
        id="gather_negative_index",
    ),
    # empty reductions
    pytest.param(
        lambda: _run1(lambda fd, x: fd.ops.max(x, [0, 1]), np.zeros((0, 0), np.float32)),
        KilnError,
        (r"max", ax(0), r"size 0"),
        id="max_over_0_by_0",
    ),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), EXECUTION_ERRORS)
def test_execution_misuse(fn: Callable[[], Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(fn, exc, *patterns)


@pytest.mark.parametrize("mode", ["rank", "dtype", "sizes"])
def test_a_cached_run_does_not_let_a_later_bad_input_through(mode: str) -> None:
    fd = _add()
    a = rnd(2, 3)
    if mode == "sizes":
        fd.lower([a, a])  # lowered (and cached) for good inputs first
    else:
        close(fd.execute([a, a])[0], 2 * f64(a))
    if mode == "rank":
        expect(lambda: fd.execute([rnd(2, 3, 1), rnd(2, 3, 1)]), KilnError, inp(0, 0), r"rank 3", r"rank 2")
    elif mode == "dtype":
        expect(lambda: fd.execute([a, a.astype(np.float64)]), KilnTypeError, inp(1, 1), r"Double", r"Float")
    else:
        expect(
            lambda: fd.execute([a, rnd(3, 3)]), KilnError, inp(1, 1), inp(0, 0), ax(0), r"size 3", r"size 2"
        )
    b, c = rnd(5, 7), rnd(5, 7, seed=1)
    close(fd.execute([b, c])[0], f64(b) + c)


def test_arrays_passed_as_separate_arguments() -> None:
    expect(lambda: _add().execute(A23, A23), KilnError, r"device|inputs")


# -- odd but valid inputs ----------------------------------------------------------------------


def test_nan_and_inf_scalars_propagate() -> None:
    a = np.array([1.0, -2.0, 0.0], np.float32)
    close(_scalar_fd(D.Double).execute([a, float("nan")])[0], np.full(3, np.nan))
    close(_scalar_fd(D.Float).execute([a, float("-inf")])[0], np.full(3, -np.inf))
    close(_scalar_fd(D.Half, D.Half).execute([a.astype(np.float16), 1e10])[0], np.full(3, np.inf))


def test_bool_for_a_size_scalar_is_one() -> None:
    close(_full_of().execute([True])[0], np.ones(1))


def test_zero_size_keepdim_reduction_shape() -> None:
    out = _run1(lambda fd, x: fd.ops.sum(x, [1], keepdim=True), np.zeros((0, 5), np.float32))
    assert out.shape == (0, 1)


def test_negative_strides_with_undeclared_layout() -> None:
    a = rnd(4, 5)[::-1, ::2]
    close(_unary(contiguity=[False, False]).execute([a])[0], 2 * f64(a))


def test_size_one_axis_of_any_stride_is_contiguous() -> None:
    a = rnd(5, 4)[2:3]
    close(_unary(contiguity=[True, True]).execute([a])[0], 2 * f64(a))


def test_overlapping_input_view() -> None:
    x = as_strided(np.arange(10, dtype=np.float32), (4, 5), (4, 4))  # rows overlap
    close(_run1(lambda fd, t: fd.ops.sum(t, [1]), x), f64(x).sum(1))


def _in_place_add() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.define_tensor([-1])
        fd.add_output(fd.ops.add(x, y), alias_input=x)
    return fd


def test_in_place_output_overlapping_another_input() -> None:
    a = np.arange(6, dtype=np.float32)
    want = f64(a) + f64(a[::-1])
    _in_place_add().execute([a, a[::-1]])
    close(a, want)
    base = np.arange(7, dtype=np.float32)
    want = f64(base).copy()
    want[1:] = f64(base[1:]) + f64(base[:-1])
    _in_place_add().execute([base[1:], base[:-1]])
    close(base, want)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]), alias_input=x)
    m = np.arange(9, dtype=np.float32).reshape(3, 3)
    want = m.T.copy()
    fd.execute([m])
    close(m, want)


def test_bfloat16_through_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([1.0, -2.5, 3.0], ml_dtypes.bfloat16)
    close(_unary((-1,), dtype=D.BFloat16).execute([a])[0], 2 * f64(a.astype(np.float32)))


def test_zero_d_index_select_in_range() -> None:
    close(_index_select(index_rank=0).execute([A23.T.copy(), np.array(2)])[0], A23.T[[2]])


def test_zero_d_index_out_of_range_names_the_index_tensor() -> None:
    expect(
        lambda: _index_select(index_rank=0).execute([A23.T.copy(), np.array(3)]),
        KilnError,
        tv(1),
        r"holds 3 at element 0",
    )


@pytest.mark.parametrize(
    ("op", "want"),
    [
        # a = [min, 7, -7, 5, 0, max], b = [-1, 0, 2, -2, 0, -1]; documented integer semantics
        ("div", [INT64_MIN, 0, -3, -2, 0, -INT64_MAX]),  # truncating, x / 0 = 0, min / -1 wraps
        ("fmod", [0, 0, -1, 1, 0, 0]),
        ("remainder", [0, 0, 1, -1, 0, 0]),
        ("gcd", [1, 7, 1, 1, 0, 1]),
        ("bitwise_left_shift", [0, 7, -28, 0, 0, 0]),  # negative shift gives 0
        ("bitwise_right_shift", [-1, 7, -2, 0, 0, 0]),
    ],
)
def test_integer_edge_values_do_not_crash(op: str, want: list[int]) -> None:
    a = np.array([INT64_MIN, 7, -7, 5, 0, INT64_MAX], np.int64)
    b = np.array([-1, 0, 2, -2, 0, -1], np.int64)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=D.Int)
        y = fd.define_tensor([-1], dtype=D.Int)
        fd.add_output(getattr(fd.ops, op)(x, y))
    (out,) = fd.execute([a, b])
    np.testing.assert_array_equal(out, np.array(want, np.int64))


def _sum_of_inputs(n: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        xs = [fd.define_tensor([-1]) for _ in range(n)]
        t = xs[0]
        for x in xs[1:]:
            t = fd.ops.add(t, x)
        fd.add_output(t)
        for i in range(3):
            fd.add_output(fd.ops.add(xs[i], float(i)))
    return fd


def test_many_inputs_and_outputs() -> None:
    outs = _sum_of_inputs(40).execute([np.ones(3, np.float32)] * 40)
    assert len(outs) == 4
    close(outs[0], np.full(3, 40.0))
    close(outs[3], np.full(3, 3.0))


@pytest.mark.parametrize("n", [64, 100])
def test_a_wide_pointwise_fusion_does_not_spill(n: int) -> None:
    """Vectors narrow as the inputs multiply: 64 fp32 inputs in 4-wide vectors spilled."""
    nvrtc = pytest.importorskip("kiln.runtime.nvrtc")
    if not nvrtc.nvrtc_available():
        pytest.skip("NVRTC is not available")
    fd = _sum_of_inputs(n)
    low = fd.lower([np.ones(4096, np.float32)] * n)
    for k in low.kernels:
        res = nvrtc.compile_cubin(k.cuda_source_for(False), k.kernel_name, arch="sm_90")
        assert not any(res.spills.values()), f"{k.kernel_name} spills: {res.spills}"
    xs = [rnd(37, seed=i) for i in range(n)]
    close(fd.execute(xs)[0], np.sum([f64(x) for x in xs], axis=0), rtol=1e-4)


# -- crashes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "fd.add_output(fd.ops.full([2**62, 0], 1.0, F))",
        "fd.add_output(fd.ops.full([2**60, 0], 1.0, DataType.Double))",
        "fd.add_output(fd.ops.broadcast_in_dim(fd.ops.slice(x, [0], [0]), [2**62, 0], [1]))",
    ],
    ids=["full_float_2_62_by_0", "full_double_2_60_by_0", "broadcast_to_2_62_by_0"],
)
def test_huge_empty_output_does_not_crash(body: str) -> None:
    child_must_not_crash(f"""
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            {body}
        try:
            (out,) = fd.execute([np.ones(1, np.float32)])
        except KilnError as e:
            print("KILN_ERROR:", e)
        else:
            assert out.size == 0, out.shape
            print("RESULT_OK")
    """)


def test_empty_broadcast_with_a_huge_axis_runs_on_the_automatic_path() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.broadcast_in_dim(x, [2**40, -1, -1], [1, 2]))
    a = np.zeros((0, 3), np.float32)
    assert fd.execute([a], as_written=True)[0].shape == (2**40, 0, 3)
    assert fd.execute([a])[0].shape == (2**40, 0, 3)


def test_an_empty_output_beside_a_computed_one_launches_nothing_for_it() -> None:
    """An output with no elements needs no kernel: its 2^40-row loop must not run next to a
    sum the fusion does compute (over an empty axis: zeros)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.broadcast_in_dim(x, [2**40, -1, -1], [1, 2]))
        fd.add_output(fd.ops.sum(fd.ops.exp(x), [0]))
        fd.add_output(fd.ops.add(fd.ops.sum(x, [0]), 2.0))
    a = np.zeros((0, 3), np.float32)
    big, s, t = fd.execute([a])
    assert big.shape == (2**40, 0, 3)
    close(s, np.zeros(3))
    close(t, np.full(3, 2.0))
    low = fd.lower([a])
    launched = [la.kernel for la in low.plan([a]).launches]
    assert len(launched) == len(low.kernels) - 1, launched


def test_a_very_long_op_chain_does_not_crash() -> None:
    child_must_not_crash(
        """
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1])
            t = x
            for _ in range(20000):
                t = fd.ops.add(t, 1.0)
            fd.add_output(t)
        try:
            fd.lower([np.zeros(3, np.float32)])
        except KilnError as e:
            print("KILN_ERROR:", e)
        else:
            print("RESULT_OK")
    """,
        timeout=120,
    )


def test_a_very_deep_scalar_expression_does_not_crash() -> None:
    child_must_not_crash(
        """
        fd = FusionDefinition()
        x = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Double)
        for _ in range(100000):
            s = fd.ops.add(s, 1.5)
        try:
            with fd:
                fd.add_output(fd.ops.add(x, s))
        except KilnError as e:
            print("KILN_ERROR:", e)
        else:
            print("RESULT_OK")
    """,
        timeout=40,
    )


# ======================================================================================
# 3. Scheduling misuse
# ======================================================================================


def _chain_sched(
    call: Callable[[Tensor, Tensor, Tensor], Any], shape: Sequence[int] = (8, 16)
) -> Callable[[], None]:
    def run() -> None:
        fd, x, y, z = _chain(shape)
        call(x, y, z)
        fd.execute([rnd(*shape)])

    return run


def _red_sched(call: Callable[[Tensor, Tensor, Tensor], Any]) -> Callable[[], None]:
    def run() -> None:
        fd, x, y, z = _red()
        call(x, y, z)
        fd.execute([rnd(8, 16)])

    return run


def _shared_cache(x: Tensor) -> Tensor:
    c = x.cache_after()
    c.set_memory_type(MT.Shared)
    return c


def _mesh_all(x: Tensor, y: Tensor, z: Tensor) -> None:
    m = kiln.DeviceMesh([0, 1])
    for t in (x, y, z):
        t.set_device_mesh(m)


SCHEDULE_ERRORS = [
    # split / merge / reorder / axis: arguments of the wrong type or range
    pytest.param(
        _chain_sched(lambda x, y, z: z.split(1, True)),
        KilnTypeError,
        (tv(2), r"factor", r"True"),
        id="split_bool_factor",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.split(1, None)),
        KilnTypeError,
        (tv(2), r"factor", r"None"),
        id="split_none_factor",
    ),
    pytest.param(
        _red_sched(lambda x, y, z: z.split(1, 0)),
        KilnError,
        (tv(2), ax(1), r"factor", r">= 1", r"\b0\b"),
        id="split_reduction_axis_by_0",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.merge(-3)), KilnError, (tv(2), ax(-3), r"2 axes"), id="merge_minus_3"
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder({0: -3})),
        KilnError,
        (tv(2), r"-3", r"2 axes"),
        id="reorder_target_minus_3",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder({0: 1.0})),
        KilnTypeError,
        (tv(2), r"1\.0"),
        id="reorder_float_target",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder({0: 1, -2: 0})),
        KilnError,
        (tv(2), ax(0), r"twice"),
        id="reorder_same_source_by_two_names",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder({0: 1, 1: -1})),
        KilnError,
        (tv(2), r"position 1", r"two axes"),
        id="reorder_same_target_by_two_names",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder({True: 0})),
        KilnTypeError,
        (tv(2), r"True"),
        id="reorder_bool_key",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.reorder(np.array([1, 0]))),
        KilnTypeError,
        (tv(2), r"dict"),
        id="reorder_ndarray",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.axis(0.0)), KilnTypeError, (tv(2), r"axis", r"0\.0"), id="axis_float"
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.axis(None)), KilnTypeError, (tv(2), r"axis", r"None"), id="axis_none"
    ),
    # parallelize
    pytest.param(
        _chain_sched(lambda x, y, z: z.axis(0).parallelize(None)),
        KilnTypeError,
        (tv(2), r"ParallelType", r"None"),
        id="parallelize_none",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.axis(0).parallelize(PT.DIDx)),
        KilnError,
        (tv(2), r"DIDx", r"device mesh"),
        id="didx_without_mesh",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.axis(1).parallelize(PT.Bulk)),
        KilnError,
        (tv(2), ax(1), r"Bulk", r"Global", r"Shared"),
        id="bulk_on_a_global_output",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: y.axis(1).parallelize(PT.Bulk)),
        KilnError,
        (tv(1), ax(1), r"Bulk", r"Local", r"Shared"),
        id="bulk_on_a_local_intermediate",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: x.axis(0).parallelize(PT.TIDx)),
        KilnError,
        (tv(0), r"fusion input", r"cache_after"),
        id="parallelize_an_input",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: x.split(1, 4)), KilnError, (tv(0), r"fusion input"), id="split_an_input"
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: (z.axis(0).parallelize(PT.TIDx), z.axis(1).parallelize(PT.TIDx))),
        KilnError,
        (tv(2), ax(1), r"TIDx", ax(0)),
        id="tidx_on_two_axes",
    ),
    pytest.param(
        _red_sched(lambda x, y, z: z.axis(1).parallelize(PT.Vectorize)),
        KilnError,
        (tv(2), ax(1), r"reduction", r"vectorized"),
        id="vectorize_a_reduction_axis",
    ),
    # memory types
    pytest.param(
        lambda: _chain((8, 16), D.Double)[2].set_memory_type(MT.Tensor),
        KilnError,
        (tv(1), r"Tensor memory", r"32-bit", r"Double"),
        id="tensor_memory_of_double",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: y.set_memory_type(None)),
        KilnTypeError,
        (tv(1), r"MemoryType", r"None"),
        id="set_memory_type_none",
    ),
    # inline_at
    pytest.param(
        _chain_sched(lambda x, y, z: y.inline_at(1.0)),
        KilnTypeError,
        (tv(1), r"position", r"1\.0"),
        id="inline_at_float",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: y.inline_at(None)),
        KilnTypeError,
        (tv(1), r"position", r"None"),
        id="inline_at_none",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: y.inline_at(-5)),
        KilnError,
        (tv(1), r"-5", r"0 to 2"),
        id="inline_at_minus_5",
    ),
    # set_allocation_domain
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_allocation_domain([0, 1], "yes")),
        KilnTypeError,
        (tv(2), r"contiguity", r"str"),
        id="allocation_contiguity_str",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_allocation_domain([0, 1], None)),
        KilnTypeError,
        (tv(2), r"contiguity", r"NoneType"),
        id="allocation_contiguity_none",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_allocation_domain([0, 1], np.array([True, True]))),
        KilnTypeError,
        (tv(2), r"contiguity", r"ndarray"),
        id="allocation_contiguity_ndarray",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_allocation_domain("01", True)),
        KilnTypeError,
        (tv(2), r"axes", r"'01'"),
        id="allocation_axes_str",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_allocation_domain([0.0, 1], True)),
        KilnTypeError,
        (tv(2), r"axis", r"0\.0"),
        id="allocation_axes_float",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: (z.split(0, 2), z.set_allocation_domain([z.axis(1), z.axis(2)], True))),
        KilnError,
        (tv(2), r"logical axis 0", r"not covered"),
        id="allocation_half_of_a_split",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: y.set_allocation_domain([1, 0], [False, False])),
        KilnError,
        (tv(1), r"Local", r"non-contiguous"),
        id="allocation_local_non_contiguous",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: x.set_allocation_domain([1, 0], True)),
        KilnError,
        (inp(0, 0), ax(0), r"stride 16", r"contiguous"),
        id="allocation_of_an_input_vs_its_array",
    ),
    # circular_buffer
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(2, prefetch=2)),
        KilnError,
        (tv(3), r"prefetch", r"below the 2 stages", r"got 2"),
        id="prefetch_equal_to_stages",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(2, prefetch=-1)),
        KilnError,
        (tv(3), r"prefetch", r"got -1"),
        id="prefetch_negative",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(2, prefetch=0)),
        KilnError,
        (tv(3), r"prefetch", r"got 0"),
        id="prefetch_zero",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(2.0)),
        KilnTypeError,
        (tv(3), r"stages", r"2\.0"),
        id="stages_float",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(2**40)),
        KilnError,
        (tv(3), r"stages", r"2 and 32", str(2**40)),
        id="stages_2_40",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: x.circular_buffer(2)),
        KilnError,
        (tv(0), r"fusion input"),
        id="circular_buffer_an_input",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: _shared_cache(x).circular_buffer(3)),
        KilnError,
        (tv(3), r"3 stages", r"no serial loop"),
        id="circular_buffer_without_a_serial_loop",
    ),
    # set_cluster
    *[
        pytest.param(
            _chain_sched(lambda x, y, z, n=n: z._fd.set_cluster(PT.BIDy, n)),
            KilnError,
            (r"set_cluster", rf"cluster of {n} blocks", r"BIDy", r"2 to 8"),
            id=f"cluster_of_{n}",
        )
        for n in (1, 9, 0, -2, 2**40)
    ],
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.set_cluster(PT.TIDx, 2)),
        KilnError,
        (r"set_cluster", r"TIDx", r"BIDx, BIDy or BIDz"),
        id="cluster_along_tidx",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.set_cluster("BIDy", 2)),
        KilnError,
        (r"set_cluster", r"ParallelType", r"'BIDy'"),
        id="cluster_pt_str",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.set_cluster(PT.BIDy, np.int64(2))),
        KilnError,
        (r"set_cluster", r"size", r"int"),
        id="cluster_numpy_size",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.set_cluster(PT.BIDy, 2)),
        KilnError,
        (r"clusters of 2 blocks along BIDy", r"no axis runs BIDy"),
        id="cluster_without_a_bidy_axis",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: (z.axis(0).parallelize(PT.BIDy), z._fd.set_cluster(PT.BIDy, 2))),
        KilnError,
        (r"clusters of 2 blocks along BIDy", r"launches 8", tv(2), ax(0)),
        id="cluster_grid_of_8_blocks",
    ),
    # segment_after / streaming loads
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.segment_after(None)),
        KilnTypeError,
        (r"segment_after", r"expected a Tensor", r"None"),
        id="segment_after_none",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z._fd.segment_after(_chain()[2])),
        KilnError,
        (r"segment_after", tv(1), r"another FusionDefinition"),
        id="segment_after_foreign_tensor",
    ),
    pytest.param(
        _chain_sched(lambda x, y, z: z.set_streaming_load()),
        KilnError,
        (r"set_streaming_load", tv(2), r"cache_after"),
        id="streaming_load_on_an_output",
    ),
    # device meshes
    *[
        pytest.param(lambda devs=devs: kiln.DeviceMesh(devs), exc, (r"DeviceMesh", *pats), id=f"mesh_{name}")
        for name, devs, exc, pats in [
            ("empty", [], KilnError, (r"no devices",)),
            ("repeated_rank", [0, 0], KilnError, (r"twice", r"\[0, 0\]")),
            ("negative_rank", [-1], KilnError, (r"\[-1\]", r"2\*\*31")),
            ("str", "ab", KilnTypeError, (r"'a'", r"int rank")),
            ("float_rank", [0.5], KilnTypeError, (r"0\.5", r"int rank")),
            ("none", None, KilnTypeError, (r"list of device ranks", r"None")),
            ("nested", [[0, 1], [2, 3]], KilnTypeError, (r"\[0, 1\]", r"int rank")),
            ("rank_2_70", [2**70], KilnError, (str(2**70),)),
        ]
    ],
    pytest.param(
        lambda: _mesh_split(15),
        KilnError,
        (tv(2), ax(1), r"split evenly", r"2 devices"),
        id="mesh_shard_not_divisible",
    ),
    pytest.param(lambda: _mesh_didx_twice(), KilnError, (tv(2), r"DIDx", r"once"), id="mesh_didx_twice"),
]


def _mesh_split(cols: int) -> None:
    fd, x, y, z = _chain((8, cols))
    _mesh_all(x, y, z)
    z.split(1, 2, inner_split=False)
    z.axis(1).parallelize(PT.DIDx)
    fd.lower([rnd(8, cols)])


def _mesh_didx_twice() -> None:
    fd, x, y, z = _chain()
    _mesh_all(x, y, z)
    z.split(1, 2, inner_split=False)
    z.axis(1).parallelize(PT.DIDx)
    z.axis(0).parallelize(PT.DIDx)


@pytest.mark.parametrize(("fn", "exc", "patterns"), SCHEDULE_ERRORS)
def test_schedule_misuse(fn: Callable[[], Any], exc: type[KilnError], patterns: tuple[str, ...]) -> None:
    expect(fn, exc, *patterns)


# -- limits of the device, checked before anything runs -------------------------------------------


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_shared_memory_summed_over_tensors(static: bool) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([256, 128] if static else [-1, -1])
        y = fd.ops.exp(x)
        w = fd.ops.sin(x)
        fd.add_output(fd.ops.add(y, w))
    y.set_memory_type(MT.Shared)
    w.set_memory_type(MT.Shared)
    a = rnd(256, 128)  # each Shared tensor alone (131072 bytes) fits, both do not
    # (fd.lower of a hand schedule evaluates no symbolic size: only a static one is refused there)
    for call in (fd.lower, fd.execute) if static else (fd.execute,):
        expect(
            lambda call=call: call([a]),
            KilnError,
            r"262144 bytes of Shared memory",
            r"232448",
            rf"{tv(1)} 131072 bytes",
            rf"{tv(2)} 131072 bytes",
        )
    if not static:
        b = rnd(8, 16)
        close(fd.execute([b])[0], np.exp(f64(b)) + np.sin(f64(b)))


def test_shared_cache_of_a_large_input_names_its_size() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x))
    _shared_cache(x)
    expect(lambda: fd.execute([rnd(300, 300)]), KilnError, r"360000 bytes", r"Shared", tv(2))


def test_threads_past_the_limit_after_a_schedule_change() -> None:
    fd, x, y, z = _chain((-1, -1))
    a = rnd(8, 2048)
    close(fd.execute([a])[0], -np.exp(f64(a)))
    z.axis(1).parallelize(PT.TIDx)
    expect(lambda: fd.execute([a]), KilnError, r"2048 threads", r"1024", tv(2), ax(1))
    expect(
        lambda: _chain_sched(lambda x, y, z: z.axis(1).parallelize(PT.TIDx), (4, 1025))(),
        KilnError,
        r"1025 threads",
        r"1024",
        tv(2),
        ax(1),
    )


def test_tensor_memory_past_128_threads() -> None:
    fd, x, y, z = _chain((8, 256))
    y.set_memory_type(MT.Tensor)
    y.axis(1).parallelize(PT.TIDx)
    z.axis(1).parallelize(PT.TIDx)
    expect(
        lambda: fd.execute([rnd(8, 256)]), KilnError, tv(1), r"Tensor memory", r"128 lanes", r"256 threads"
    )


def test_local_allocation_of_a_symbolic_size() -> None:
    fd, x, y, z = _chain((-1, -1))
    z.axis(1).parallelize(PT.Unroll)
    expect(lambda: fd.execute([rnd(8, 16)]), KilnError, tv(1), r"Local memory", r"not a constant size")


# -- a refused schedule call changes nothing ---------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda fd, x, y, z: z.split(1, 0),
        lambda fd, x, y, z: z.merge(0, 5),
        lambda fd, x, y, z: z.reorder({0: 1, 1: 1}),
        lambda fd, x, y, z: z.reorder({0: 1, 7: 0}),
        lambda fd, x, y, z: y.inline_at(5),
        lambda fd, x, y, z: z.set_allocation_domain([0], [True]),
        lambda fd, x, y, z: y.circular_buffer(1),
        lambda fd, x, y, z: z.set_memory_type(MT.Shared),
        lambda fd, x, y, z: fd.set_cluster(PT.BIDy, 9),
    ],
    ids=[
        "split_0",
        "merge_out_of_range",
        "reorder_target_twice",
        "reorder_source_out_of_range",
        "inline_past_the_end",
        "allocation_missing_an_axis",
        "one_stage",
        "shared_output",
        "cluster_of_9",
    ],
)
def test_a_refused_schedule_call_changes_nothing(call: Callable[..., Any]) -> None:
    fd, x, y, z = _chain()
    before = z.transforms()
    with pytest.raises(KilnError):
        call(fd, x, y, z)
    assert z.transforms() == before
    assert not fd._core.manually_scheduled
    a = rnd(8, 16)
    close(fd.execute([a])[0], -np.exp(f64(a)))


# -- odd but valid schedules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sched",
    [
        lambda z: (z.merge(1, 0), z.axis(0).parallelize(PT.TIDx)),
        lambda z: (z.merge(-1, 0),),
        lambda z: (z.split(1, 4, inner_split=False),),
        lambda z: (z.axis(0).parallelize(PT.TIDx), z.axis(0).parallelize(PT.BIDx)),
        lambda z: (z.axis(0).parallelize(PT.Unswitch), z.axis(1).parallelize(PT.Unswitch)),
        lambda z: (z.reorder({}),),
        lambda z: (z.split(1, 4), z.axis(2).parallelize(PT.Vectorize), z.axis(2).parallelize(PT.TIDx)),
    ],
    ids=[
        "merge_reversed",
        "merge_negative_reversed",
        "outer_split_without_mesh",
        "reparallelize_axis",
        "unswitch_twice",
        "reorder_nothing",
        "vectorize_then_tidx",
    ],
)
def test_odd_but_valid_schedules(sched: Callable[[Tensor], Any]) -> None:
    fd, x, y, z = _chain((3, 20))
    sched(z)
    a = rnd(3, 20)
    close(fd.execute([a])[0], -np.exp(f64(a)))


def test_merge_of_non_adjacent_axes() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 4])
        z = fd.ops.mul(x, 2.0)
        fd.add_output(z)
    z.merge(0, 2)
    z.axis(0).parallelize(PT.TIDx)
    a = rnd(2, 3, 4)
    close(fd.execute([a])[0], 2 * f64(a))


@pytest.mark.parametrize(
    "sched",
    [
        lambda x, y, z: x.cache_after(),
        lambda x, y, z: (x.cache_after(), x.cache_after()),
        lambda x, y, z: (z.cache_before(), z.cache_before()),
        lambda x, y, z: y.cache_before(),
        lambda x, y, z: z.cache_after(),
        lambda x, y, z: y.set_memory_type(MT.Global),
        lambda x, y, z: z._fd.segment_after(z),
    ],
    ids=[
        "cache_after_input",
        "cache_after_twice",
        "cache_before_twice",
        "cache_before_intermediate",
        "cache_after_output",
        "global_intermediate",
        "segment_after_the_output",
    ],
)
def test_caches_and_segments_that_are_valid(sched: Callable[[Tensor, Tensor, Tensor], Any]) -> None:
    fd, x, y, z = _chain()
    sched(x, y, z)
    a = rnd(8, 16)
    close(fd.execute([a])[0], -np.exp(f64(a)))


# -- defects in scheduling ---------------------------------------------------------------------------


@pytest.mark.parametrize("axes", [None, 0], ids=["none", "int"])
def test_allocation_domain_axes_not_a_list(axes: Any) -> None:
    fd, x, y, z = _chain()
    expect(lambda: z.set_allocation_domain(axes, True), KilnTypeError, tv(2), r"axes|list")


def test_allocation_domain_contiguity_of_strings() -> None:
    fd, x, y, z = _chain()
    expect(lambda: z.set_allocation_domain([0, 1], ["a", "b"]), KilnTypeError, tv(2), r"contiguity")
