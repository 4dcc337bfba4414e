"""Tensors whose values are input sizes run in whichever kernel the segmenter gives them.

``torch.tensor(x.shape[0]).float()``, ``arange(n, n + 3)`` with ``n = x.size(0)``, or a
``full`` of a size: the value is a size of an input that no tensor of the kernel computing it
may read. Such a kernel still needs that input's sizes bound, also when it reads no tensor
at all. Each case is checked against NumPy in float64, in multi-kernel fusions (a softmax's
total beside the size-valued tensor) and one-kernel ones.
"""

from __future__ import annotations

from typing import Callable, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, Scalar, Tensor

F32, I64 = DataType.Float, DataType.Int


def _softmax_total(fd: FusionDefinition, x: Tensor) -> Tensor:
    """softmax(x, 1).sum(): a normalization and a full reduction, more than one kernel."""
    mx = fd.ops.max(x, dims=[1], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(x, mx))
    return fd.ops.sum(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)), dims=[0, 1])


def _size_value(fd: FusionDefinition, x: Tensor, kind: str, value: Scalar) -> Tensor:
    """A float scalar-shaped tensor built from `value` (an expression of x's sizes)."""
    if kind == "full_int":
        return fd.ops.cast(fd.ops.full([], value, I64), F32)
    if kind == "full_float":
        return fd.ops.sum(fd.ops.full([3], value, F32), dims=[0])
    if kind == "iota_start":
        return fd.ops.sum(fd.ops.cast(fd.ops.iota(3, value, 1), F32), dims=[0])
    # iota with a size as its step
    return fd.ops.sum(fd.ops.cast(fd.ops.iota(4, 0, value), F32), dims=[0])


def _size_value_ref(kind: str, v: int) -> float:
    return {"full_int": v, "full_float": 3 * v, "iota_start": 3 * v + 3, "iota_step": 6 * v}[kind]


def _value(fd: FusionDefinition, x: Tensor, which: str) -> Scalar:
    n, m = fd.ops.size(x, 0), fd.ops.size(x, 1)
    if which == "rows":
        return n
    if which == "cols":
        return m
    return fd.ops.add(fd.ops.mul(n, 2), m)


def _value_ref(shape: tuple, which: str) -> int:
    return {"rows": shape[0], "cols": shape[1], "mix": 2 * shape[0] + shape[1]}[which]


def _run(build: Callable[[FusionDefinition], None], x: np.ndarray) -> List[np.ndarray]:
    with FusionDefinition() as fd:
        build(fd)
    return [np.asarray(o, dtype=np.float64) for o in fd.execute([x])]


KINDS = ["full_int", "full_float", "iota_start", "iota_step"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("beside", ["softmax_total", "row_sum", "none"])
def test_size_valued_tensor_beside_other_kernels(kind: str, beside: str) -> None:
    x = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)

    def build(fd: FusionDefinition) -> None:
        xt = fd.define_tensor([-1, -1], F32)
        v = _size_value(fd, xt, kind, _value(fd, xt, "rows"))
        if beside == "softmax_total":
            fd.add_output(fd.ops.add(_softmax_total(fd, xt), v))
        elif beside == "row_sum":
            fd.add_output(fd.ops.sum(xt, dims=[1]))
            fd.add_output(v)
        else:
            fd.add_output(v)

    outs = _run(build, x)
    want = _size_value_ref(kind, 8)
    if beside == "softmax_total":
        np.testing.assert_allclose(outs[0], 8.0 + want, rtol=1e-5)
    elif beside == "row_sum":
        np.testing.assert_allclose(outs[0], x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outs[1], want, rtol=1e-6)
    else:
        np.testing.assert_allclose(outs[0], want, rtol=1e-6)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), which=st.sampled_from(["rows", "cols", "mix"]),
       rows=st.integers(1, 12), cols=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_size_valued_tensors_property(kind: str, which: str, rows: int, cols: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)

    def build(fd: FusionDefinition) -> None:
        xt = fd.define_tensor([-1, -1], F32)
        fd.add_output(fd.ops.add(_softmax_total(fd, xt), _size_value(fd, xt, kind, _value(fd, xt, which))))

    out = _run(build, x)[0]
    np.testing.assert_allclose(out, rows + _size_value_ref(kind, _value_ref((rows, cols), which)), rtol=1e-5)
