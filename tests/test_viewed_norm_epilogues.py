"""GroupNorm as diffusers' ResnetBlock writes it: ``x`` viewed into groups, normalized over each
group, viewed back, then an epilogue that may read the normalized value more than once
(``y * sigmoid(y)``, GELU's ``0.5 * y * (1 + tanh(...y...))``), with or without the per-channel
affine, in NCHW and channels-last layouts. The automatic path computes the whole epilogue at
the grouped shape and hands the output back viewed: one kernel (an epilogue reading ``y``
twice took a statistics kernel and a second pass over ``x``). Checked against NumPy in
float64 in the CPU interpreter."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def _gelu_tanh(fd: FusionDefinition, y: Any) -> Any:
    cube = fd.ops.mul(fd.ops.mul(y, y), y)
    inner = fd.ops.mul(fd.ops.add(y, fd.ops.mul(cube, 0.044715)), math.sqrt(2.0 / math.pi))
    return fd.ops.mul(fd.ops.mul(y, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))


EPILOGUES: Dict[str, Tuple[Callable[[Any, Any], Any], Callable[[np.ndarray], np.ndarray]]] = {
    "none": (lambda fd, y: y, lambda y: y),
    "silu": (lambda fd, y: fd.ops.mul(y, fd.ops.sigmoid(y)), lambda y: y / (1.0 + np.exp(-y))),
    "gelu_tanh": (lambda fd, y: _gelu_tanh(fd, y),
                  lambda y: 0.5 * y * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y ** 3)))),
}


def _build(layout: str, shape: Tuple[int, int, int, int], groups: int, affine: bool,
           epilogue: str) -> FusionDefinition:
    n, c = shape[0], shape[1] if layout == "nchw" else shape[3]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1], DataType.Float)
        w = fd.define_tensor([-1], DataType.Float)
        b = fd.define_tensor([-1], DataType.Float)
        if layout == "nchw":
            xg = fd.ops.reshape(x, [n, groups, c // groups, shape[2], shape[3]])
            dims = [2, 3, 4]
            chan = 1
        else:
            xg = fd.ops.reshape(x, [n, shape[1], shape[2], groups, c // groups])
            dims = [1, 2, 4]
            chan = 3
        var, mean = fd.ops.var_mean(xg, dims=dims, correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(xg, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-6)))
        y = fd.ops.reshape(y, list(shape))
        if affine:
            y = fd.ops.add(fd.ops.mul(fd.ops.broadcast_in_dim(w, [-1] * 4, [chan]), y),
                           fd.ops.broadcast_in_dim(b, [-1] * 4, [chan]))
        fd.add_output(EPILOGUES[epilogue][0](fd, y))
    return fd


def _reference(layout: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int, affine: bool,
               epilogue: str) -> np.ndarray:
    if layout == "nchw":
        xg = x.reshape(x.shape[0], groups, -1)
        wb = (w[None, :, None, None], b[None, :, None, None])
    else:
        n, h, wd, c = x.shape
        xg = x.reshape(n, h, wd, groups, -1).transpose(0, 3, 1, 2, 4).reshape(n, groups, -1)
        wb = (w, b)
    y = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-6)
    if layout == "nchw":
        y = y.reshape(x.shape)
    else:
        n, h, wd, c = x.shape
        y = y.reshape(n, groups, h, wd, c // groups).transpose(0, 2, 3, 1, 4).reshape(x.shape)
    if affine:
        y = wb[0] * y + wb[1]
    return EPILOGUES[epilogue][1](y)


@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("layout,shape,groups", [
    ("nchw", (2, 64, 8, 8), 8),
    ("nchw", (3, 12, 5, 7), 4),
    ("nhwc", (2, 8, 8, 64), 8),
    ("nhwc", (1, 5, 3, 12), 3),
])
def test_viewed_group_norm_with_epilogues_is_one_kernel(layout: str, shape: Tuple[int, int, int, int],
                                                        groups: int, affine: bool, epilogue: str) -> None:
    fd = _build(layout, shape, groups, affine, epilogue)
    rng = np.random.default_rng(sum(shape) + groups)
    c = shape[1] if layout == "nchw" else shape[3]
    x = (rng.standard_normal(shape) * 2.0 + 0.5).astype(np.float32)
    w = rng.standard_normal(c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    (got,) = fd.execute([x, w, b])
    xd, wd, bd = (a.astype(np.float64) for a in (x, w, b))
    want = _reference(layout, xd, wd, bd, groups, affine, epilogue)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert len(fd.lower([x, w, b]).kernels) == 1
