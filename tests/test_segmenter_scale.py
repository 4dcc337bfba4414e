"""A fusion of many reductions feeding many outputs: ``torch.nn.utils.clip_grad_norm_`` in its
foreach form, one global norm over k gradients of different sizes scaling each of them. The
segmenter's greedy merge scheduled and lowered each pair of groups it asked, again after every
merge (k = 24 took two minutes to lower); this checks the kernels it now finds and their values
against NumPy, at a k that would time the suite out the old way."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

MAX_NORM = 1.0


def _clip_grad_norm(k: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        grads = [fd.define_tensor([-1], DataType.Float) for _ in range(k)]
        total = None
        for g in grads:
            sq = fd.ops.sum(fd.ops.mul(g, g), dims=[0])
            total = sq if total is None else fd.ops.add(total, sq)
        norm = fd.ops.sqrt(total)
        coef = fd.ops.clamp(fd.ops.div(MAX_NORM, fd.ops.add(norm, 1e-6)), max=1.0)
        for g in grads:
            fd.add_output(fd.ops.mul(g, coef))
    return fd


@pytest.mark.parametrize("k", [3, 24])
def test_foreach_gradient_clipping_over_many_tensors(k: int) -> None:
    rng = np.random.default_rng(k)
    grads: List[np.ndarray] = [rng.standard_normal(17 + 5 * i).astype(np.float32) for i in range(k)]
    fd = _clip_grad_norm(k)
    low = fd.lower(grads)
    assert len(low.kernels) == 2  # the sums and the norm, then the scaled gradients
    outs = fd.execute(grads)
    g64 = [g.astype(np.float64) for g in grads]
    norm = np.sqrt(sum(float((g * g).sum()) for g in g64))
    coef = min(MAX_NORM / (norm + 1e-6), 1.0)
    assert len(outs) == k
    for got, g in zip(outs, g64):
        np.testing.assert_allclose(got, g * coef, rtol=2e-6, atol=1e-7)
