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


def test_a_clip_over_hundreds_of_tensors_is_planned_as_totals_then_readers() -> None:
    # The segmenter splits the full reductions (with the coefficient's rank-0 math) from the
    # tensors that read them in two schedules, instead of growing the totals' group one
    # gradient per schedule (quadratic in the number of tensors).
    k = 200
    fd = _clip(k)
    gs = _grads(k, 1)
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gs))
    outs = fd.execute(gs + [2.0 * float(norm)])  # above the norm: the coefficient is 1
    for o, g in zip(outs[:-1], gs):
        np.testing.assert_allclose(o, g.astype(np.float64) * min(2.0 * norm / (norm + 1e-6), 1.0), rtol=1e-5)
    np.testing.assert_allclose(outs[-1], norm, rtol=1e-5)
    low = lowered_for(fd, gs + [2.0 * float(norm)])
    assert len(low.kernels) == 2
    assert "the full reductions, then their readers: covered" in low.program.segmentation()
    # The 48-tensor case compiles its kernels with NVRTC (conftest); these 200-tensor ones
    # take NVRTC over a minute, so they are not compiled here.
    from kiln import lowering

    lowering.take_generated()


def test_a_total_of_what_reads_a_total_is_not_split_there() -> None:
    # Standardizing by whole-tensor statistics in two passes: the variance's total reads
    # x - mean, a reader of the first total, so the totals cannot all come first.
    x = np.random.default_rng(3).standard_normal((37, 11)).astype(np.float32) * 3 + 1
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        n = float(x.size)
        mean = fd.ops.div(fd.ops.sum(t, dims=[0, 1]), n)
        d = fd.ops.sub(t, fd.ops.broadcast_in_dim(mean, [-1, -1], []))
        var = fd.ops.div(fd.ops.sum(fd.ops.mul(d, d), dims=[0, 1]), n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        fd.add_output(fd.ops.mul(d, fd.ops.broadcast_in_dim(rstd, [-1, -1], [])))
    (got,) = fd.execute([x])
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    seg = lowered_for(fd, [x]).program.segmentation()
    assert "the full reductions, then their readers: covered" not in seg


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
