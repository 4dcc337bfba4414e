"""A catalogue of user mistakes, and of odd-looking inputs that are valid.

Every mistake raises ``kiln.KilnError`` (``kiln.KilnTypeError`` for a wrong type) before
anything runs, with a message that names the input or tensor (``input 1 (T1)``, ``T3``),
the axis where one is involved (``axis 2``) and what was expected. Valid inputs that look
odd (empty tensors, strided views, an input returned as an output) give the NumPy result.
The nastiest cases run in a child interpreter, so that a crash fails one test, not the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from kiln import (
    DataType,
    FusionDefinition,
    KilnError,
    KilnTypeError,
    MemoryType,
    ParallelType,
    Tensor,
)

F = DataType.Float


def inp(i: int, t: int) -> str:
    """The regex of how a message names fusion input ``i``, tensor ``T{t}``."""
    return rf"input {i} \(T{t}\)"


def tv(t: int) -> str:
    """The regex of tensor ``T{t}`` (not matched by ``T{t}0``)."""
    return rf"(?<![A-Za-z0-9])T{t}(?!\d)"


def axis(k: int) -> str:
    """The regex of ``axis {k}`` (not matched by ``axis {k}0``)."""
    return rf"\baxis {k}(?!\d)"


def check_error(err: BaseException, exc: type, patterns: tuple[str, ...]) -> None:
    """``err`` is a KilnError of type ``exc`` whose message matches every pattern."""
    assert isinstance(err, KilnError), f"not a KilnError: {type(err).__name__}: {err}"
    assert isinstance(err, exc), f"expected {exc.__name__}, got {type(err).__name__}: {err}"
    msg = str(err)
    for p in patterns:
        assert re.search(p, msg, re.S), f"{p!r} not found in: {msg!r}"


def raises(fn: Callable[[], Any], exc: type, *patterns: str) -> None:
    """Run ``fn``; it must raise a KilnError of type ``exc`` matching ``patterns``."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type is what is checked
        check_error(err, exc, patterns)
        return
    pytest.fail(f"no error raised; expected {exc.__name__} matching {patterns}")


def close(got: Any, want: Any, rtol: float = 1e-5) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-5)


# --------------------------------------------------------------------------------------
# Fusions the input cases run
# --------------------------------------------------------------------------------------


def fd_add(shape_a: tuple[int, ...] = (-1, -1), shape_b: tuple[int, ...] = (-1, -1),
           dtype: DataType = F) -> FusionDefinition:
    """T0 + T1 (elementwise: the definition makes their sizes equal)."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=list(shape_a), dtype=dtype)
        b = fd.define_tensor(shape=list(shape_b), dtype=dtype)
        fd.add_output(fd.ops.add(a, b))
    return fd


def fd_unary(shape: tuple[int, ...] = (-1, -1), dtype: DataType = F,
             contiguity: list[bool] | None = None) -> FusionDefinition:
    """T0 * 2 + 1."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=list(shape), dtype=dtype, contiguity=contiguity)
        fd.add_output(fd.ops.add(fd.ops.mul(x, 2), 1))
    return fd


def fd_bool_input() -> FusionDefinition:
    """where(T0, 1.0, 0.0) of a Bool T0."""
    with FusionDefinition() as fd:
        c = fd.define_tensor(shape=[-1], dtype=DataType.Bool)
        fd.add_output(fd.ops.where(c, 1.0, 0.0))
    return fd


def fd_bcast_row(row_first: bool) -> FusionDefinition:
    """x[-1, -1] + broadcast_in_dim(b[-1], [-1, -1], [1]): b's size is x's axis 1."""
    with FusionDefinition() as fd:
        if row_first:
            b = fd.define_tensor(shape=[-1], dtype=F)
            x = fd.define_tensor(shape=[-1, -1], dtype=F)
        else:
            x = fd.define_tensor(shape=[-1, -1], dtype=F)
            b = fd.define_tensor(shape=[-1], dtype=F)
        y = fd.ops.add(x, fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1]))
        fd.add_output(y)
    return fd


def fd_scalar(dtype: DataType) -> FusionDefinition:
    """T0 * s, ``s`` a runtime scalar input of ``dtype`` (input 1)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        s = fd.define_scalar(dtype=dtype)
        fd.add_output(fd.ops.mul(x, s))
    return fd


def fd_bool_scalar() -> FusionDefinition:
    """where(s, T0, -T0), ``s`` a runtime Bool scalar (input 1)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        s = fd.define_scalar(dtype=DataType.Bool)
        fd.add_output(fd.ops.where(s, x, fd.ops.neg(x)))
    return fd


def fd_full_runtime() -> FusionDefinition:
    """full([n], 1.0) of a runtime Int ``n`` (input 0); the full is T0."""
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.full(shape=[n], value=1.0, dtype=F))
    return fd


def fd_index_select() -> FusionDefinition:
    """index_select(T0[-1, -1], T1[-1] (Int), dim=0)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        idx = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(x, idx, 0))
    return fd


def fd_row_sum(dtype: DataType = F) -> FusionDefinition:
    """sum(T0, dims=[1])."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        fd.add_output(fd.ops.sum(x, dims=[1]))
    return fd


def fd_max(dim: int) -> FusionDefinition:
    """max(T0, dims=[dim])."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        fd.add_output(fd.ops.max(x, dims=[dim]))
    return fd


# --------------------------------------------------------------------------------------
# Input validation: execute and lower, NumPy (and CuPy) inputs
# --------------------------------------------------------------------------------------


def _f32(xp: Any, *shape: int) -> Any:
    return xp.arange(int(np.prod(shape)), dtype=xp.float32).reshape(shape)


def _gen(xp: Any) -> Iterator[Any]:
    yield _f32(xp, 4, 5)
    yield _f32(xp, 4, 5)


@dataclass(frozen=True)
class InputCase:
    """A fusion, inputs for it (from an array module) and the error they must raise."""

    id: str
    build: Callable[[], FusionDefinition]
    inputs: Callable[[Any], Any]
    exc: type
    patterns: tuple[str, ...]
    lower: bool = True  # fd.lower checks it too (values of tensors are seen only when run)
    gpu: bool = True  # the GPU path checks it too before launching


DTYPE_NAMES = {"float64": "Double", "float16": "Half", "int32": "Int32", "int64": "Int", "bool": "Bool",
               "float32": "Float"}

INPUT_CASES = [
    # counts
    InputCase("too_few", fd_add, lambda xp: [_f32(xp, 4, 5)], KilnError,
              (r"takes 2 inputs but 1", inp(1, 1))),
    InputCase("too_few_empty", fd_add, lambda xp: [], KilnError, (r"takes 2 inputs but 0", inp(0, 0))),
    InputCase("too_many", fd_add, lambda xp: [_f32(xp, 4, 5)] * 3, KilnError, (r"takes 2 inputs but 3",)),
    # an array where a number is expected, and vice versa
    InputCase("number_for_array", fd_add, lambda xp: [_f32(xp, 4, 5), 3.0], KilnTypeError,
              (inp(1, 1), r"expected an array")),
    InputCase("int_for_array", fd_add, lambda xp: [7, _f32(xp, 4, 5)], KilnTypeError,
              (inp(0, 0), r"expected an array")),
    InputCase("array_for_scalar", lambda: fd_scalar(DataType.Double),
              lambda xp: [_f32(xp, 4), xp.ones(1, dtype=xp.float64)], KilnTypeError,
              (r"input 1\b", r"expected a Python scalar")),
    InputCase("0d_array_for_scalar", lambda: fd_scalar(DataType.Float),
              lambda xp: [_f32(xp, 4), xp.ones((), dtype=xp.float32)], KilnTypeError,
              (r"input 1\b", r"expected a Python scalar")),
    # dtypes
    *[InputCase(f"dtype_{name}_for_Float", fd_unary,
                lambda xp, name=name: [_f32(xp, 4, 5).astype(name)], KilnTypeError,
                (inp(0, 0), rf"dtype {DTYPE_NAMES[name]}\b", r"\bFloat\b"))
      for name in ["float64", "float16", "int32", "int64", "bool"]],
    InputCase("dtype_float32_for_Double", lambda: fd_unary(dtype=DataType.Double),
              lambda xp: [_f32(xp, 4, 5)], KilnTypeError, (inp(0, 0), r"dtype Float\b", r"\bDouble\b")),
    InputCase("dtype_int32_for_Int", lambda: fd_index_select(),
              lambda xp: [_f32(xp, 5, 3), xp.zeros(2, dtype=xp.int32)], KilnTypeError,
              (inp(1, 1), r"dtype Int32\b", r"\bInt\b")),
    InputCase("dtype_float32_for_Bool", fd_bool_input, lambda xp: [_f32(xp, 4)], KilnTypeError,
              (inp(0, 0), r"dtype Float\b", r"\bBool\b")),
    InputCase("dtype_second_input", fd_add,
              lambda xp: [_f32(xp, 4, 5), _f32(xp, 4, 5).astype(xp.float64)], KilnTypeError,
              (inp(1, 1), r"dtype Double\b", r"\bFloat\b")),
    *[InputCase(f"unsupported_{name}", fd_unary, lambda xp, name=name: [xp.zeros((4, 5), dtype=name)],
                KilnTypeError, (inp(0, 0), rf"unsupported dtype {name}", r"float32"))
      for name in ["uint8", "complex64", "int16"]],
    # ranks and sizes
    InputCase("rank_too_low", fd_unary, lambda xp: [_f32(xp, 4)], KilnError,
              (inp(0, 0), r"rank 1\b", r"rank 2\b")),
    InputCase("rank_too_high", fd_unary, lambda xp: [_f32(xp, 2, 3, 4)], KilnError,
              (inp(0, 0), r"rank 3\b", r"rank 2\b")),
    InputCase("rank_0d", fd_unary, lambda xp: [xp.float32(1.0) * xp.ones((), xp.float32)], KilnError,
              (inp(0, 0), r"rank 0\b", r"rank 2\b")),
    InputCase("static_size_mismatch", lambda: fd_unary(shape=(4, -1)), lambda xp: [_f32(xp, 5, 3)],
              KilnError, (inp(0, 0), axis(0), r"\b5\b", r"\b4\b")),
    InputCase("static_size_mismatch_axis1", lambda: fd_unary(shape=(-1, 3)), lambda xp: [_f32(xp, 5, 4)],
              KilnError, (inp(0, 0), axis(1), r"\b4\b", r"\b3\b")),
    InputCase("broadcast_axis_given_3", lambda: fd_unary(shape=(1, -1)), lambda xp: [_f32(xp, 3, 4)],
              KilnError, (inp(0, 0), axis(0), r"broadcast", r"\b3\b")),
    InputCase("broadcast_axis1_given_3", lambda: fd_add((-1, -1), (-1, 1)),
              lambda xp: [_f32(xp, 4, 3), _f32(xp, 4, 3)], KilnError,
              (inp(1, 1), axis(1), r"broadcast", r"\b3\b")),
    InputCase("equal_sizes_differ_5_6", fd_add, lambda xp: [_f32(xp, 4, 5), _f32(xp, 4, 6)], KilnError,
              (inp(1, 1), inp(0, 0), axis(1), r"\b6\b", r"\b5\b")),
    InputCase("equal_sizes_differ_6_5", fd_add, lambda xp: [_f32(xp, 4, 6), _f32(xp, 4, 5)], KilnError,
              (inp(1, 1), inp(0, 0), axis(1), r"\b6\b", r"\b5\b")),
    InputCase("equal_sizes_differ_axis0", fd_add, lambda xp: [_f32(xp, 4, 5), _f32(xp, 3, 5)], KilnError,
              (inp(1, 1), inp(0, 0), axis(0), r"\b3\b", r"\b4\b")),
    InputCase("equal_sizes_through_broadcast", lambda: fd_bcast_row(False),
              lambda xp: [_f32(xp, 4, 5), _f32(xp, 6)], KilnError,
              (inp(1, 1), axis(0), inp(0, 0), axis(1), r"\b6\b", r"\b5\b")),
    InputCase("equal_sizes_through_broadcast_row_first", lambda: fd_bcast_row(True),
              lambda xp: [_f32(xp, 6), _f32(xp, 4, 5)], KilnError,
              (inp(1, 1), axis(1), inp(0, 0), axis(0), r"\b6\b", r"\b5\b")),
    # scalars
    InputCase("float_for_Int_scalar", lambda: fd_scalar(DataType.Int), lambda xp: [_f32(xp, 4), 2.5],
              KilnTypeError, (r"input 1\b", r"2\.5", r"\bInt\b")),
    InputCase("float_for_Int32_scalar", lambda: fd_scalar(DataType.Int32), lambda xp: [_f32(xp, 4), 2.0],
              KilnTypeError, (r"input 1\b", r"\bInt32\b")),
    InputCase("str_for_scalar", lambda: fd_scalar(DataType.Double), lambda xp: [_f32(xp, 4), "2.0"],
              KilnTypeError, (r"input 1\b", r"\bstr\b", r"\bDouble\b")),
    InputCase("None_for_scalar", lambda: fd_scalar(DataType.Double), lambda xp: [_f32(xp, 4), None],
              KilnTypeError, (r"input 1\b", r"NoneType", r"\bDouble\b")),
    InputCase("list_for_scalar", lambda: fd_scalar(DataType.Double), lambda xp: [_f32(xp, 4), [2.0]],
              KilnTypeError, (r"input 1\b", r"\blist\b", r"\bDouble\b")),
    InputCase("Int32_scalar_2_40", lambda: fd_scalar(DataType.Int32), lambda xp: [_f32(xp, 4), 2**40],
              KilnError, (r"input 1\b", str(2**40), r"\bInt32\b")),
    InputCase("Int_scalar_2_70", lambda: fd_scalar(DataType.Int), lambda xp: [_f32(xp, 4), 2**70],
              KilnError, (r"input 1\b", str(2**70), r"\bInt\b")),
    InputCase("Int_scalar_minus_2_70", lambda: fd_scalar(DataType.Int), lambda xp: [_f32(xp, 4), -(2**70)],
              KilnError, (r"input 1\b", str(-(2**70)), r"\bInt\b")),
    InputCase("int_for_Bool_scalar", fd_bool_scalar, lambda xp: [_f32(xp, 4), 3], KilnTypeError,
              (r"input 1\b", r"\b3\b", r"\bBool\b")),
    InputCase("float_for_Bool_scalar", fd_bool_scalar, lambda xp: [_f32(xp, 4), 1.0], KilnTypeError,
              (r"input 1\b", r"\bBool\b")),
    # the container
    InputCase("dict_inputs", fd_add, lambda xp: {0: _f32(xp, 4, 5), 1: _f32(xp, 4, 5)}, KilnTypeError,
              (r"\blist\b", r"\bdict\b")),
    InputCase("generator_inputs", fd_add, _gen, KilnTypeError, (r"\blist\b", r"generator")),
    InputCase("single_array_inputs", fd_unary, lambda xp: _f32(xp, 4, 5), KilnTypeError,
              (r"\blist\b", r"ndarray")),
    InputCase("string_in_inputs", fd_add, lambda xp: [_f32(xp, 4, 5), "x"], KilnTypeError,
              (inp(1, 1), r"expected an array", r"\bstr\b")),
    # the definition's own tensor handle (it has a shape and a dtype, but no memory)
    InputCase("definition_tensor_in_inputs", fd_add,
              lambda xp: [_f32(xp, 4, 5), fd_add().define_tensor([-1, -1])], KilnTypeError,
              (inp(1, 1), r"expected an array", r"\bTensor\b")),
    # declared contiguity
    InputCase("contiguous_given_transpose", lambda: fd_unary(contiguity=[True, True]),
              lambda xp: [_f32(xp, 5, 4).T], KilnError, (inp(0, 0), axis(1), r"contiguous", r"stride")),
    InputCase("contiguous_given_step_slice", lambda: fd_unary(contiguity=[True, True]),
              lambda xp: [_f32(xp, 4, 10)[:, ::2]], KilnError, (inp(0, 0), axis(1), r"contiguous")),
    InputCase("contiguous_given_column_slice", lambda: fd_unary(contiguity=[True, True]),
              lambda xp: [_f32(xp, 4, 10)[:, 2:7]], KilnError, (inp(0, 0), axis(0), r"contiguous")),
    InputCase("contiguous_given_reversed", lambda: fd_unary(contiguity=[True, True]),
              lambda xp: [_f32(xp, 4, 5)[:, ::-1]], KilnError, (inp(0, 0), axis(1), r"contiguous")),
    InputCase("contiguous_given_broadcast_to", lambda: fd_unary(contiguity=[True, True]),
              lambda xp: [xp.broadcast_to(_f32(xp, 5), (4, 5))], KilnError,
              (inp(0, 0), axis(0), r"contiguous")),
    # sizes computed from runtime scalars
    InputCase("full_negative_runtime_size", fd_full_runtime, lambda xp: [-3], KilnError,
              (r"input 0\b|" + tv(0), axis(0), r"-3", r"negative|>= 0")),
    # index values (only seen when the fusion runs)
    InputCase("index_select_7_of_5", fd_index_select,
              lambda xp: [_f32(xp, 5, 3), xp.asarray([0, 7, 1], dtype=xp.int64)], KilnError,
              (tv(1), r"\b7\b", r"element 1\b", r"\b5\b"), lower=False, gpu=False),
    InputCase("index_select_minus_3", fd_index_select,
              lambda xp: [_f32(xp, 5, 3), xp.asarray([2, 4, -3], dtype=xp.int64)], KilnError,
              (tv(1), r"-3", r"element 2\b", r"\b5\b"), lower=False, gpu=False),
    InputCase("index_select_5_of_5", fd_index_select,
              lambda xp: [_f32(xp, 5, 3), xp.asarray([5], dtype=xp.int64)], KilnError,
              (tv(1), r"\b5\b", r"element 0\b"), lower=False, gpu=False),
    # reductions of nothing
    InputCase("max_over_empty_axis", lambda: fd_max(0), lambda xp: [_f32(xp, 0, 4)], KilnError,
              (tv(1), axis(0), r"size 0|empty")),
]


def _run_input_case(case: InputCase, xp: Any, mode: str) -> None:
    fd = case.build()
    inputs = case.inputs(xp)
    calls: dict[str, Callable[[], Any]] = {
        "execute": lambda: fd.execute(inputs),
        "lower": lambda: fd.lower(inputs),
        "as_written": lambda: fd.execute(inputs, as_written=True),
    }
    raises(calls[mode], case.exc, *case.patterns)


# ``as_written`` interprets the fusion without a schedule: the same input binding applies.
_CPU_PARAMS = [pytest.param(c, m, id=f"{c.id}-{m}") for c in INPUT_CASES
               for m in ("execute", "lower", "as_written") if m != "lower" or c.lower]


@pytest.mark.parametrize(("case", "mode"), _CPU_PARAMS)
def test_bad_input_numpy(case: InputCase, mode: str) -> None:
    _run_input_case(case, np, mode)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"device": "tpu"}, KilnError, r"device.*'tpu'"),
        ({"device": "cuda"}, KilnTypeError, r"device='cuda'.*NumPy"),
        ({"device": "cpu", "as_written": True}, None, ""),
    ],
    ids=["unknown_device", "cuda_with_numpy", "cpu_as_written_valid"],
)
def test_execute_options(kwargs: dict[str, Any], exc: type | None, pattern: str) -> None:
    a, b = _f32(np, 4, 5), _f32(np, 4, 5)
    fd = fd_add()
    if exc is None:
        (out,) = fd.execute([a, b], **kwargs)
        close(out, a.astype(np.float64) + b)
    else:
        raises(lambda: fd.execute([a, b], **kwargs), exc, pattern)


_GPU_PARAMS = [pytest.param(c, m, id=f"{c.id}-{m}") for c in INPUT_CASES for m in ("execute", "lower")
               if c.gpu and (m == "execute" or c.lower)]


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "mode"), _GPU_PARAMS)
def test_bad_input_cupy(case: InputCase, mode: str) -> None:
    cp = pytest.importorskip("cupy")
    _run_input_case(case, cp, mode)


# --------------------------------------------------------------------------------------
# Definition-time mistakes: raised by the op, inside the `with` block
# --------------------------------------------------------------------------------------


def _in_fusion(body: Callable[[FusionDefinition], Any],
               shape: tuple[int, ...] = (-1, -1)) -> Callable[[], Any]:
    """A callable that opens a fusion with input T0 of ``shape``, runs ``body(fd)`` (which
    must raise) and completes the fusion with an output."""

    def run() -> None:
        with FusionDefinition() as fd:
            fd.define_tensor(shape=list(shape), dtype=F)
            body(fd)

    return run


def _t0(fd: FusionDefinition) -> Tensor:
    # The first tensor defined in the fusion (T0); rebuilt from its id for brevity.
    return Tensor(fd, 0)


def _two_fusions_add() -> None:
    with FusionDefinition() as fd1:
        x1 = fd1.define_tensor(shape=[-1], dtype=F)
        fd1.add_output(fd1.ops.neg(x1))
    with FusionDefinition() as fd2:
        x2 = fd2.define_tensor(shape=[-1], dtype=F)
        fd2.add_output(fd2.ops.add(x2, x1))


def _two_fusions_unary() -> None:
    with FusionDefinition() as fd1:
        x1 = fd1.define_tensor(shape=[-1], dtype=F)
        fd1.add_output(fd1.ops.neg(x1))
    with FusionDefinition() as fd2:
        fd2.define_tensor(shape=[-1], dtype=F)
        fd2.add_output(fd2.ops.exp(x1))


def _two_fusions_output() -> None:
    with FusionDefinition() as fd1:
        x1 = fd1.define_tensor(shape=[-1], dtype=F)
        fd1.add_output(fd1.ops.neg(x1))
    with FusionDefinition() as fd2:
        fd2.define_tensor(shape=[-1], dtype=F)
        fd2.add_output(x1)


def _no_outputs() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        fd.ops.neg(x)



def _index_select(idx_dtype: DataType, dim: int) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1, -1], dtype=F)
            idx = fd.define_tensor(shape=[-1], dtype=idx_dtype)
            fd.add_output(fd.ops.index_select(x, idx, dim))

    return run


def _where_cond(cond_dtype: DataType) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            c = fd.define_tensor(shape=[-1, -1], dtype=cond_dtype)
            a = fd.define_tensor(shape=[-1, -1], dtype=F)
            fd.add_output(fd.ops.where(c, a, 0.0))

    return run


def _full_static(shape: list[int]) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.full(shape=shape, value=1.0, dtype=F))

    return run


def _define(shape: list[Any], contiguity: list[Any] | None = None, dtype: Any = F) -> Callable[[], None]:
    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=shape, dtype=dtype, contiguity=contiguity)
            fd.add_output(fd.ops.neg(x))

    return run


def _bid(in_shape: list[int], out_shape: list[int], dims: list[int]) -> Callable[[], Any]:
    return _in_fusion(lambda fd: fd.ops.broadcast_in_dim(_t0(fd), shape=out_shape, broadcast_dims=dims),
                      tuple(in_shape))


DEFINITION_CASES = [
    pytest.param(_in_fusion(lambda fd: fd.ops.sum(_t0(fd), dims=[2])), KilnError, (tv(0), axis(2)),
                 id="sum_dim_out_of_range"),
    pytest.param(_in_fusion(lambda fd: fd.ops.max(_t0(fd), dims=[-3])), KilnError, (tv(0), r"-3|axis"),
                 id="max_dim_negative_out_of_range"),
    pytest.param(_in_fusion(lambda fd: fd.ops.sum(_t0(fd), dims=[1, 1])), KilnError, (tv(0), axis(1)),
                 id="sum_dim_duplicated"),
    pytest.param(_in_fusion(lambda fd: fd.ops.sum(_t0(fd), dims=[1, -1])), KilnError, (tv(0), axis(1)),
                 id="sum_dim_duplicated_negative"),
    pytest.param(_in_fusion(lambda fd: fd.ops.sum(_t0(fd), dims=[])), KilnError, (tv(0), r"dims|empty"),
                 id="sum_dims_empty"),
    pytest.param(_in_fusion(lambda fd: fd.ops.permute(_t0(fd), dims=[0, 0])), KilnError,
                 (tv(0), axis(0), r"twice|permutation"), id="permute_repeated"),
    pytest.param(_in_fusion(lambda fd: fd.ops.permute(_t0(fd), dims=[0, 2])), KilnError,
                 (tv(0), r"permutation|\b2\b"), id="permute_out_of_range"),
    pytest.param(_in_fusion(lambda fd: fd.ops.permute(_t0(fd), dims=[1])), KilnError,
                 (tv(0), r"permutation|rank"), id="permute_too_short"),
    pytest.param(_bid([-1], [-1, -1], [0, 1]), KilnError, (tv(0), r"broadcast_dims"),
                 id="broadcast_in_dim_dims_too_long"),
    pytest.param(_bid([-1, -1], [-1, -1, -1], [2, 0]), KilnError, (tv(0), r"broadcast_dims|increasing"),
                 id="broadcast_in_dim_not_increasing"),
    pytest.param(_bid([-1], [-1, -1], [2]), KilnError, (tv(0), r"\b2\b"),
                 id="broadcast_in_dim_out_of_range"),
    pytest.param(_bid([3], [4, 4], [0]), KilnError, (tv(0), axis(0), r"\b3\b", r"\b4\b"),
                 id="broadcast_in_dim_static_mismatch"),
    pytest.param(_index_select(F, 0), KilnTypeError, (tv(1), r"Int"), id="index_select_float_index"),
    pytest.param(_index_select(DataType.Int, 2), KilnError, (tv(0), axis(2)),
                 id="index_select_dim_out_of_range"),
    pytest.param(_two_fusions_add, KilnError, (tv(0), r"another FusionDefinition"),
                 id="mix_fusions_binary"),
    pytest.param(_two_fusions_unary, KilnError, (tv(0), r"another FusionDefinition"),
                 id="mix_fusions_unary"),
    pytest.param(_two_fusions_output, KilnError, (tv(0), r"another FusionDefinition"),
                 id="mix_fusions_add_output"),
    pytest.param(_define([2**64, -1]), KilnError, (tv(0), axis(0), str(2**64)), id="define_size_2_64"),
    pytest.param(_define([-1, -2]), KilnError, (tv(0), axis(1), r"-2"), id="define_size_minus_2"),
    pytest.param(_define([-1, 4.0]), KilnTypeError, (tv(0), r"shape"), id="define_size_float"),
    pytest.param(_define([-1, -1], contiguity=[True]), KilnError, (tv(0), r"contiguity"),
                 id="contiguity_too_short"),
    pytest.param(_define([-1, -1], contiguity=[True, True, True]), KilnError, (tv(0), r"contiguity"),
                 id="contiguity_too_long"),
    pytest.param(_define([-1], dtype="float32"), KilnTypeError, (tv(0), r"DataType"),
                 id="define_dtype_str"),
    pytest.param(_full_static([2**32, 2**32]), KilnError, (r"2\^63|2\*\*63",),
                 id="full_static_2_64_elements"),
    pytest.param(_full_static([2**62, 4]), KilnError, (r"2\^63|2\*\*63",),
                 id="full_static_2_64_elements_uneven"),
    pytest.param(_full_static([-1]), KilnError, (r"-1", r"negative"), id="full_static_negative"),
    pytest.param(_no_outputs, KilnError, (r"no outputs",), id="no_outputs"),
    pytest.param(_in_fusion(lambda fd: fd.ops.cast(_t0(fd), "float8")), KilnTypeError,
                 (tv(0), r"DataType"), id="cast_unknown_dtype"),
    pytest.param(_in_fusion(lambda fd: fd.ops.cast(_t0(fd), np.float16)), KilnTypeError,
                 (tv(0), r"DataType"), id="cast_numpy_dtype"),
    pytest.param(_where_cond(F), KilnTypeError, (tv(0), r"Bool"), id="where_float_condition"),
    pytest.param(_where_cond(DataType.Int), KilnTypeError, (tv(0), r"Bool"), id="where_int_condition"),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), DEFINITION_CASES)
def test_bad_definition(fn: Callable[[], Any], exc: type, patterns: tuple[str, ...]) -> None:
    raises(fn, exc, *patterns)


# --------------------------------------------------------------------------------------
# Schedule mistakes: raised by the scheduling call, or at the latest by fd.lower
# --------------------------------------------------------------------------------------


def _scheduled(action: Callable[[Tensor, Tensor], Any]) -> Callable[[], Any]:
    """x = T0[-1, -1]; y = exp(x) (T1); z = neg(y) (T2, output); ``action(y, z)`` then lower."""

    def run() -> None:
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1, -1], dtype=F)
            y = fd.ops.exp(x)
            z = fd.ops.neg(y)
            fd.add_output(z)
        action(y, z)
        fd.lower([np.zeros((8, 64), np.float32)])

    return run


def _vectorize_outer(y: Tensor, z: Tensor) -> None:
    z.split(1, 4)
    z.axis(0).parallelize(ParallelType.Vectorize)


SCHEDULE_CASES = [
    pytest.param(_scheduled(lambda y, z: z.split(1, 0)), KilnError, (tv(2), r"factor", r"\b0\b"),
                 id="split_factor_0"),
    pytest.param(_scheduled(lambda y, z: z.split(1, -4)), KilnError, (tv(2), r"factor", r"-4"),
                 id="split_factor_negative"),
    pytest.param(_scheduled(lambda y, z: z.split(2, 4)), KilnError, (tv(2), axis(2)),
                 id="split_axis_out_of_range"),
    pytest.param(_scheduled(lambda y, z: z.split(-3, 4)), KilnError, (tv(2), r"axis -3|axis"),
                 id="split_axis_negative_out_of_range"),
    pytest.param(_scheduled(lambda y, z: z.split(1, 2.5)), KilnTypeError, (tv(2), r"factor"),
                 id="split_factor_float"),
    pytest.param(_scheduled(lambda y, z: z.merge(0, 5)), KilnError, (tv(2), axis(5)),
                 id="merge_axis_out_of_range"),
    pytest.param(_scheduled(lambda y, z: z.merge(1)), KilnError, (tv(2), axis(2)),
                 id="merge_last_axis_with_nothing"),
    pytest.param(_scheduled(lambda y, z: z.reorder({0: 5})), KilnError, (tv(2), r"\b5\b"),
                 id="reorder_target_out_of_range"),
    pytest.param(_scheduled(lambda y, z: z.reorder({7: 0})), KilnError, (tv(2), axis(7)),
                 id="reorder_source_out_of_range"),
    pytest.param(_scheduled(lambda y, z: z.reorder([(0, 1)])), KilnTypeError, (tv(2), r"dict"),
                 id="reorder_not_a_dict"),
    pytest.param(_scheduled(lambda y, z: z.axis(0).parallelize("TIDx")), KilnTypeError,
                 (tv(2), r"ParallelType"), id="parallelize_str"),
    pytest.param(_scheduled(lambda y, z: z.axis(0).parallelize(MemoryType.Shared)), KilnTypeError,
                 (tv(2), r"ParallelType"), id="parallelize_memory_type"),
    pytest.param(_scheduled(lambda y, z: z.axis(7)), KilnError, (tv(2), axis(7)), id="axis_out_of_range"),
    pytest.param(_scheduled(_vectorize_outer), KilnError, (tv(2), r"Vectorize", axis(0)),
                 id="vectorize_not_innermost"),
    pytest.param(_scheduled(lambda y, z: y.inline_at(5)), KilnError, (tv(1), r"\b5\b"),
                 id="inline_at_past_end"),
    pytest.param(_scheduled(lambda y, z: y.set_memory_type("Shared")), KilnTypeError,
                 (tv(1), r"MemoryType"), id="set_memory_type_str"),
    pytest.param(_scheduled(lambda y, z: y.set_memory_type(ParallelType.TIDx)), KilnTypeError,
                 (tv(1), r"MemoryType"), id="set_memory_type_parallel_type"),
]


@pytest.mark.parametrize(("fn", "exc", "patterns"), SCHEDULE_CASES)
def test_bad_schedule(fn: Callable[[], Any], exc: type, patterns: tuple[str, ...]) -> None:
    raises(fn, exc, *patterns)


# --------------------------------------------------------------------------------------
# Odd but valid: correct results against NumPy (float64)
# --------------------------------------------------------------------------------------


def _a(*shape: int) -> np.ndarray:
    rng = np.random.default_rng(sum(shape) + len(shape))
    return rng.standard_normal(shape).astype(np.float32)


def test_zero_size_add() -> None:
    a, b = _a(0, 4), _a(0, 4)
    (out,) = fd_add().execute([a, b])
    close(out, a.astype(np.float64) + b)


@pytest.mark.parametrize("dim", [0, 1])
def test_zero_size_sum(dim: int) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        fd.add_output(fd.ops.sum(x, dims=[dim]))
    a = _a(0, 4)
    (out,) = fd.execute([a])
    close(out, a.astype(np.float64).sum(axis=dim))


def test_zero_size_max_over_kept_axis() -> None:
    a = _a(0, 4)
    (out,) = fd_max(1).execute([a])
    close(out, np.zeros((0,)))


def test_input_as_only_output() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        fd.add_output(x)
    a = _a(3, 5)
    (out,) = fd.execute([a])
    close(out, a)


@pytest.mark.parametrize("input_first", [True, False])
def test_input_as_output_next_to_another(input_first: bool) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        y = fd.ops.mul(x, 2.0)
        if input_first:
            fd.add_output(x)
            fd.add_output(y)
        else:
            fd.add_output(y)
            fd.add_output(x)
    a = _a(3, 5)
    outs = fd.execute([a])
    want = [a, 2.0 * a.astype(np.float64)]
    if not input_first:
        want.reverse()
    assert len(outs) == 2
    for got, w in zip(outs, want):
        close(got, w)


def test_broadcast_in_dim_expands() -> None:
    with FusionDefinition() as fd:
        b = fd.define_tensor(shape=[-1], dtype=F)
        fd.add_output(fd.ops.broadcast_in_dim(b, shape=[3, 3], broadcast_dims=[0]))
    v = _a(3)
    (out,) = fd.execute([v])
    close(out, np.broadcast_to(v.astype(np.float64)[:, None], (3, 3)))


@pytest.mark.parametrize("as_written", [False, True], ids=["auto", "as_written"])
@pytest.mark.parametrize("asked", [1, 3])
def test_broadcast_in_dim_pins_symbolic_sizes(asked: int, as_written: bool) -> None:
    """A fixed size asked of an input axis of runtime size (one included) is that axis's size:
    another size is a KilnError naming the input, never an output of the input's shape."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        y = fd.ops.broadcast_in_dim(x, shape=[asked, 4], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.add(y, 1.0))
    v = _a(asked, 4)
    (out,) = fd.execute([v], as_written=as_written)
    close(out, v.astype(np.float64) + 1)
    with pytest.raises(KilnError, match=r"T0|T1|T3") as e:
        fd.execute([_a(5, 4)], as_written=as_written)
    assert "5" in str(e.value) and str(asked) in str(e.value)


def test_tuple_inputs() -> None:
    a, b = _a(4, 5), _a(4, 5)
    (out,) = fd_add().execute((a, b))
    close(out, a.astype(np.float64) + b)


def test_int_scalar_for_double_scalar() -> None:
    a = _a(4)
    (out,) = fd_scalar(DataType.Double).execute([a, 3])
    close(out, a.astype(np.float64) * 3)


STRIDED = {
    "transpose": lambda: _a(9, 6).T,
    "column_slice": lambda: _a(6, 9)[:, 2:7],
    "step_slice": lambda: _a(6, 12)[:, ::2],
    "fortran": lambda: np.asfortranarray(_a(6, 9)),
    "broadcast_to_rows": lambda: np.broadcast_to(_a(9), (6, 9)),
    "broadcast_to_cols": lambda: np.broadcast_to(_a(6, 1), (6, 9)),
    "reversed_rows": lambda: _a(6, 9)[::-1],
    "reversed_both": lambda: _a(6, 9)[::-1, ::-1],
}


@pytest.mark.parametrize("view", list(STRIDED))
def test_strided_pointwise(view: str) -> None:
    a = STRIDED[view]()
    (out,) = fd_unary().execute([a])
    close(out, a.astype(np.float64) * 2 + 1)


@pytest.mark.parametrize("view", list(STRIDED))
def test_strided_row_sum(view: str) -> None:
    a = STRIDED[view]()
    (out,) = fd_row_sum().execute([a])
    close(out, a.astype(np.float64).sum(axis=1))


def test_contiguity_declared_false_given_slice() -> None:
    a = _a(4, 10)[:, 2:7]
    (out,) = fd_unary(contiguity=[False, True]).execute([a])
    close(out, a.astype(np.float64) * 2 + 1)


# --------------------------------------------------------------------------------------
# Crash detection: the nastiest cases in a child interpreter
# --------------------------------------------------------------------------------------

_PRELUDE = """
import numpy as np
import kiln
from kiln import DataType, FusionDefinition, KilnError

F = DataType.Float

def unary():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        fd.add_output(fd.ops.add(fd.ops.mul(x, 2), 1))
    return fd

def row_sum():
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        fd.add_output(fd.ops.sum(x, dims=[1]))
    return fd

def full2():
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        m = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.sum(fd.ops.full(shape=[n, m], value=1.0, dtype=F), dims=[1]))
    return fd

def expect_error(fn):
    try:
        fn()
    except KilnError as e:
        print("KILN_ERROR:", e)
    else:
        print("NO_ERROR")

def expect_close(got, want):
    got = np.asarray(got[0]).astype(np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (got, want)
    print("RESULT_OK")
"""

CRASH_CASES = {
    # 2**60 elements (read through zero strides): too large to produce, never a crash.
    "execute_2_60_broadcast": (
        "a = np.broadcast_to(np.float32(1), (2**30, 2**30))\n"
        "expect_error(lambda: unary().execute([a]))",
        "KILN_ERROR"),
    "lower_2_60_broadcast_sum": (
        "a = np.broadcast_to(np.float32(1), (2**31, 2**29))\n"
        "low = row_sum().lower([a])\n"
        "print('RESULT_OK' if low.kernels else 'NO_KERNELS')",
        "RESULT_OK"),
    "full_runtime_2_62": (
        "expect_error(lambda: full2().execute([2**31, 2**31]))",
        "KILN_ERROR"),
    "full_runtime_2_64": (
        "expect_error(lambda: full2().execute([2**32, 2**32]))",
        "KILN_ERROR"),
    "full_runtime_int64_max": (
        "expect_error(lambda: full2().execute([2**63 - 1, 2]))",
        "KILN_ERROR"),
    "full_runtime_negative": (
        "expect_error(lambda: full2().execute([-(2**62), 4]))",
        "KILN_ERROR"),
    "negative_strides": (
        "a = np.arange(35, dtype=np.float32).reshape(5, 7)[::-1, ::-1]\n"
        "expect_close(unary().execute([a]), a.astype(np.float64) * 2 + 1)\n"
        "expect_close(row_sum().execute([a]), a.astype(np.float64).sum(axis=1))",
        "RESULT_OK"),
    "nested_views": (
        "b = np.arange(4 * 30 * 20, dtype=np.float32).reshape(4, 30, 20)\n"
        "a = b[1, ::-2, 3:][:, ::3].T[::-1, 1:]\n"
        "expect_close(unary().execute([a]), a.astype(np.float64) * 2 + 1)\n"
        "expect_close(row_sum().execute([a]), a.astype(np.float64).sum(axis=1))",
        "RESULT_OK"),
    "contiguous_declared_negative_strides": (
        "with FusionDefinition() as fd:\n"
        "    x = fd.define_tensor(shape=[-1, -1], dtype=F, contiguity=[True, True])\n"
        "    fd.add_output(fd.ops.neg(x))\n"
        "a = np.zeros((5, 7), np.float32)[::-1]\n"
        "expect_error(lambda: fd.execute([a]))",
        "KILN_ERROR"),
    "interpreter_out_of_memory": (
        # Buffers past the memory the process may have (an address-space limit here; the
        # machine's available memory otherwise): a KilnError, not an abort of the process.
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
        "with FusionDefinition() as fd:\n"
        "    x = fd.define_tensor(shape=[-1], dtype=DataType.Double)\n"
        "    a, b, c = (fd.ops.broadcast_in_dim(x, [1] * d + [-1] + [1] * (2 - d), [d]) for d in range(3))\n"
        "    fd.add_output(fd.ops.add(fd.ops.add(a, b), c))\n"
        "expect_error(lambda: fd.execute([np.ones(1000)]))",
        "KILN_ERROR"),
    "define_tensor_2_64_elements": (
        "with FusionDefinition() as fd:\n"
        "    x = fd.define_tensor(shape=[2**62, 4], dtype=F)\n"
        "    fd.add_output(fd.ops.sum(fd.ops.neg(x), dims=[1]))\n"
        "str(fd)\n"
        "expect_error(lambda: fd.lower([np.broadcast_to(np.float32(0), (2**31, 4))]))",
        "KILN_ERROR"),
}


# Each case needs well under a second; a child still running after this long has hung.
CHILD_TIMEOUT_S = 60


@pytest.mark.parametrize("name", list(CRASH_CASES))
def test_no_crash_in_child(name: str) -> None:
    body, marker = CRASH_CASES[name]
    script = _PRELUDE + "\n" + textwrap.dedent(body) + "\n"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child did not finish within {CHILD_TIMEOUT_S} s (killed); stdout: {e.stdout!r}")
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    assert marker in proc.stdout, report
    assert "NO_ERROR" not in proc.stdout, report


def test_numpy_scalars_are_0d_arrays_or_numbers():
    # np.float32(1.5) where a 0-d tensor is expected is a 0-d array; where a scalar input is
    # expected, the number it holds.
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[])
        s = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(t, s))
    (out,) = fd.execute([np.float32(1.5), np.float32(2.0)])
    assert out.shape == () and float(out) == 3.0
    assert len(fd.lower([np.float32(1.5), np.int64(2)]).kernels) == 1
