"""Fusions over many tensors at once, the way multi-tensor (foreach) training code writes
them: one value computed from every tensor's total and applied to each of them. The
value is computed once, where the totals are finished, and each tensor's kernel reads it:
copied into every reader it would grow with the number of tensors times its chain."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def _clip(k: int) -> FusionDefinition:
    """``clip_grad_norm_`` over k gradients: ``coef = min(max_norm / (sqrt(sum_i |g_i|²) + eps), 1)``."""
    with FusionDefinition() as fd:
        gs = [fd.define_tensor([-1] * (1 + i % 2), dtype=DataType.Float) for i in range(k)]
        max_norm = fd.define_scalar(dtype=DataType.Double)
        total = None
        for g in gs:
            s = fd.ops.sum(fd.ops.mul(g, g), dims=list(range(1 + gs.index(g) % 2)))
            total = s if total is None else fd.ops.add(total, s)
        norm = fd.ops.sqrt(total)
        coef = fd.ops.minimum(fd.ops.div(max_norm, fd.ops.add(norm, 1e-6)), 1.0)
        for i, g in enumerate(gs):
            fd.add_output(fd.ops.mul(g, fd.ops.broadcast_in_dim(coef, [-1] * (1 + i % 2), [])))
        fd.add_output(norm)
    return fd


def _grads(k: int, seed: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((5 + 3 * i,) if i % 2 == 0 else (3 + i % 5, 7 + i)).astype(np.float32)
            for i in range(k)]


@pytest.mark.parametrize("k", [3, 48])
def test_gradient_clip_over_many_tensors(k: int) -> None:
    fd = _clip(k)
    gs = _grads(k, k)
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gs))
    max_norm = 0.5 * float(norm)
    outs = fd.execute(gs + [max_norm])
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for o, g in zip(outs[:-1], gs):
        np.testing.assert_allclose(o, g.astype(np.float64) * coef, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(outs[-1], norm, rtol=1e-5)
    # Two kernels: the totals (and the coefficient, in the block that finishes them), then
    # every scaled gradient. The norm's square root is taken once, not once per gradient.
    low = lowered_for(fd, gs + [max_norm])
    assert len(low.kernels) == 2
    assert sum(k.cuda_source.split("kiln_kernel(")[-1].count("kiln::sqrt(") for k in low.kernels) == 1


@pytest.mark.gpu
def test_gradient_clip_over_many_tensors_on_the_gpu() -> None:
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    k = 48
    fd = _clip(k)
    gs = _grads(k, 7)
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gs))
    outs = fd.execute([cp.asarray(g) for g in gs] + [0.5 * float(norm)])
    coef = min(0.5 * norm / (norm + 1e-6), 1.0)
    for o, g in zip(outs[:-1], gs):
        np.testing.assert_allclose(cp.asnumpy(o), g.astype(np.float64) * coef, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cp.asnumpy(outs[-1]), norm, rtol=1e-5)
