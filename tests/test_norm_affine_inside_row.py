"""Normalizations over several trailing axes with an affine broadcast inside the row.

GroupNorm(1, C) and "LayerNorm over (C, H, W)" (PoolFormer, ConvNeXt-style) normalize each
sample over ``C*H*W`` and then scale by a per-channel ``w[c]``, which is broadcast along
``H`` and ``W`` inside the row. Such a weight repeats along the merged row axis, so it is
not loaded with the row's vectors; the normalization stays one kernel whatever the row's
length (registers, Shared memory or a looped row). Checked against NumPy in float64.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

F32 = DataType.Float
EPS = 1e-5

# Which axes of [C, H, W] the affine varies along.
PATTERNS = {"c": (0,), "hw": (1, 2), "w": (2,), "chw": (0, 1, 2), "ch": (0, 1)}


def _check(shape: Tuple[int, int, int, int], pattern: str, seed: int) -> None:
    axes = PATTERNS[pattern]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    wshape = tuple(shape[1 + a] for a in axes)
    w = (rng.random(wshape) + 0.5).astype(np.float32)
    b = rng.standard_normal(wshape).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1] * 4, F32)
        wt = fd.define_tensor([-1] * len(axes), F32)
        bt = fd.define_tensor([-1] * len(axes), F32)
        dims = [1 + a for a in axes]
        var, mean = fd.ops.var_mean(xt, dims=[1, 2, 3], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(xt, mean), fd.ops.rsqrt(fd.ops.add(var, EPS)))
        y = fd.ops.mul(y, fd.ops.broadcast_in_dim(wt, [-1] * 4, dims))
        fd.add_output(fd.ops.add(y, fd.ops.broadcast_in_dim(bt, [-1] * 4, dims)))
    ins = [x, w, b]
    kernels = len(fd.lower(ins).kernels)
    out = np.asarray(fd.execute(ins)[0], dtype=np.float64)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=(1, 2, 3), keepdims=True)
    sd = np.sqrt(x64.var(axis=(1, 2, 3), keepdims=True) + EPS)
    full = [1, 1, 1, 1]
    for a in axes:
        full[1 + a] = shape[1 + a]
    want = (x64 - mu) / sd * w.astype(np.float64).reshape(full) + b.astype(np.float64).reshape(full)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    assert kernels == 1, f"{kernels} kernels"


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("shape", [(2, 64, 20, 20), (3, 5, 7, 9), (1, 16, 40, 40)])
def test_group_norm_one_group_affine(shape: Tuple[int, int, int, int], pattern: str) -> None:
    _check(shape, pattern, 0)


@settings(max_examples=25, deadline=None)
@given(pattern=st.sampled_from(list(PATTERNS)), n=st.integers(1, 3), c=st.integers(1, 70),
       h=st.integers(1, 24), w=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_affine_inside_row_property(pattern: str, n: int, c: int, h: int, w: int, seed: int) -> None:
    _check((n, c, h, w), pattern, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["c", "hw"])
@pytest.mark.parametrize("shape", [(8, 64, 56, 56), (2, 64, 20, 20)])
def test_affine_inside_row_on_gpu(shape: Tuple[int, int, int, int], pattern: str) -> None:
    """GroupNorm(1) with a per-channel affine at a PoolFormer size, on the GPU."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    axes = PATTERNS[pattern]
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape).astype(np.float32)
    wshape = tuple(shape[1 + a] for a in axes)
    w = (rng.random(wshape) + 0.5).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1] * 4, F32)
        wt = fd.define_tensor([-1] * len(axes), F32)
        var, mean = fd.ops.var_mean(xt, dims=[1, 2, 3], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(xt, mean), fd.ops.rsqrt(fd.ops.add(var, EPS)))
        fd.add_output(fd.ops.mul(y, fd.ops.broadcast_in_dim(wt, [-1] * 4, [1 + a for a in axes])))
    assert len(fd.lower([x, w]).kernels) == 1
    out = cp.asnumpy(fd.execute([cp.asarray(x), cp.asarray(w)])[0]).astype(np.float64)
    x64 = x.astype(np.float64)
    full = [1, 1, 1, 1]
    for a in axes:
        full[1 + a] = shape[1 + a]
    sd = np.sqrt(x64.var(axis=(1, 2, 3), keepdims=True) + EPS)
    want = (x64 - x64.mean(axis=(1, 2, 3), keepdims=True)) / sd
    np.testing.assert_allclose(out, want * w.astype(np.float64).reshape(full), rtol=1e-4, atol=1e-4)
