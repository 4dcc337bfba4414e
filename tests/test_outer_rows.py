"""Normalizations over leading or middle axes (a softmax over the classes of NCHW, timm's
LayerNorm2d over the channels, a softmax over dim 0) whose rows fit in registers: the looped
normalization keeps each thread's values of the row (at most 16, on up to 512 / 32 thread
rows) in registers, so every pass after the first reads them there instead of reading the
input again (``looped_normalization[2, held, 1, tx, 0]``). Longer rows keep the looped passes.
Each case runs in the interpreter against NumPy in float64; conftest compiles its kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import numpy as np
import pytest
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def softmax_over(shape: Sequence[int], axis: int, dtype: DataType = DataType.Float) -> FusionDefinition:
    """``softmax(x, axis)`` written with keepdim max and sum."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), dtype=dtype)
        xf = fd.ops.cast(x, DataType.Float)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[axis], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[axis], keepdim=True)), dtype))
    return fd


def softmax_ref(x: np.ndarray, axis: int) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def params(fd: FusionDefinition, sizes: Sequence[Sequence[int]]) -> tuple:
    auto = fd._core.auto_program([list(s) for s in sizes])
    return auto.heuristic, list(auto.params)


@pytest.mark.parametrize("shape, axis, held", [
    ((2, 21, 5, 7), 1, True),      # segmentation classes over NCHW
    ((3, 3, 4, 11), 1, True),
    ((1, 150, 2, 33), 1, True),
    ((256, 40), 0, True),          # 16 values on 16 thread rows
    ((257, 40), 0, False),         # one more: the looped passes
    ((7, 3, 1000), 1, True),
])
def test_a_softmax_over_a_middle_or_leading_axis_keeps_short_rows_in_registers(shape, axis, held) -> None:
    fd = softmax_over(shape, axis)
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 3
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, softmax_ref(x, axis), rtol=1e-5, atol=1e-7)
    kind, p = params(fd, [shape])
    assert kind == "looped_normalization", (kind, p)
    assert (p[0] == 2) == held, p
    if held:
        assert 1 <= p[1] <= 16 and p[3] * -(-shape[axis] // p[1]) <= 512, p
    assert len(lowered_for(fd, [x]).kernels) == 1


@pytest.mark.parametrize("shape", [(2, 8, 5, 7), (1, 96, 3, 3), (3, 5, 1, 1), (2, 192, 4, 9)])
@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16])
def test_layernorm2d_keeps_the_channels_in_registers(shape, dtype) -> None:
    """timm's LayerNorm2d with ``var_mean`` and an affine over the channels, through the two
    permutes that ``cancel_permutes`` removes."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 4, dtype=dtype)
        w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
        xp = fd.ops.cast(fd.ops.permute(x, [0, 2, 3, 1]), DataType.Float)
        var, mean = fd.ops.var_mean(xp, [3], correction=0)
        y = fd.ops.mul(fd.ops.sub(xp, fd.ops.broadcast_in_dim(mean, [-1] * 4, [0, 1, 2])),
                       fd.ops.broadcast_in_dim(fd.ops.rsqrt(fd.ops.add(var, 1e-6)), [-1] * 4, [0, 1, 2]))
        y = fd.ops.add(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, [-1] * 4, [3])),
                       fd.ops.broadcast_in_dim(b, [-1] * 4, [3]))
        fd.add_output(fd.ops.cast(fd.ops.permute(y, [0, 3, 1, 2]), dtype))
    rng = np.random.default_rng(shape[1])
    x = rng.standard_normal(shape).astype(np.float32) + 0.5
    w = rng.standard_normal(shape[1]).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    if dtype == DataType.BFloat16:
        x = x.astype(pytest.importorskip("ml_dtypes").bfloat16)
    (got,) = fd.execute([x, w, b])
    xd = x.astype(np.float64)
    mu = xd.mean(1, keepdims=True)
    want = (xd - mu) / np.sqrt(xd.var(1, keepdims=True) + 1e-6) * w[:, None, None] + b[:, None, None]
    tol = 2e-2 if dtype == DataType.BFloat16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    kind, p = params(fd, [shape, [shape[1]], [shape[1]]])
    assert (kind, p[0]) == ("looped_normalization", 2), (kind, p)
    assert len(lowered_for(fd, [x, w, b]).kernels) == 1


def test_the_looped_passes_can_be_asked_for() -> None:
    """``KILN_OUTER_ROWS_LOOPED=1`` (read once per process) keeps every pass reading the input."""
    code = ("from test_outer_rows import softmax_over, params; "
            "print(params(softmax_over((2, 21, 5, 7), 1), [(2, 21, 5, 7)])[1][0])")
    env = dict(os.environ, KILN_OUTER_ROWS_LOOPED="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
