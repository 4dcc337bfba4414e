"""Cross-entropy over logits masked by position, picked at computed labels: one kernel.

Contrastive losses (SimCLR's NT-Xent, CLIP) mask the diagonal with ``iota(N)[:, None] ==
iota(N)[None, :]`` and pick each row's positive at a label computed from an iota
(``(i + N) % 2N``). Picking the mask at the label needs the column id at the label, which is
the label itself (``start + label * step`` of the iota), not a gather from an iota stored
whole; and the row id read again after the row's logsumexp is one value per row, not the
unreduced input. Checked against NumPy in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

F32 = DataType.Float


def _lse(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return (np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m)[:, 0]


def _build(shift: int, col_start: int, col_step: int, reduce: str) -> FusionDefinition:
    """NT-Xent-style loss over a square similarity matrix: the diagonal (of a column iota of
    ``col_start`` and ``col_step``) masked, each row's positive at ``(i + shift) % N``."""
    with FusionDefinition() as fd:
        s = fd.define_tensor([-1, -1], F32)
        rows = fd.ops.broadcast_in_dim(fd.ops.iota(fd.ops.size(s, 0)), [-1, -1], [0])
        cols = fd.ops.iota(fd.ops.size(s, 1), col_start, col_step)
        cols_b = fd.ops.broadcast_in_dim(cols, [-1, -1], [1])
        logits = fd.ops.where(fd.ops.eq(rows, cols_b), -30.0, fd.ops.div(s, 0.5))
        label = fd.ops.remainder(fd.ops.add(fd.ops.iota(fd.ops.size(s, 0)), shift), fd.ops.size(s, 0))
        idx = fd.ops.broadcast_in_dim(label, [-1, 1], [0])
        picked = fd.ops.squeeze(fd.ops.take_along_axis(logits, idx, 1), [1])
        nll = fd.ops.sub(fd.ops.logsumexp(logits, dims=[1]), picked)
        fd.add_output(nll if reduce == "none" else fd.ops.mean(nll, dims=[0]))
    return fd


def _reference(sim: np.ndarray, shift: int, col_start: int, col_step: int, reduce: str) -> np.ndarray:
    n = sim.shape[0]
    r = np.arange(n)
    c = col_start + col_step * np.arange(n)
    lg = np.where(r[:, None] == c[None, :], -30.0, sim.astype(np.float64) / 0.5)
    nll = _lse(lg) - lg[r, (r + shift) % n]
    return nll if reduce == "none" else np.asarray(nll.mean())


def _check(n: int, shift: int, col_start: int, col_step: int, reduce: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sim = rng.standard_normal((n, n)).astype(np.float32)
    fd = _build(shift, col_start, col_step, reduce)
    kernels = len(fd.lower([sim]).kernels)
    out = np.asarray(fd.execute([sim])[0], dtype=np.float64)
    np.testing.assert_allclose(out, _reference(sim, shift, col_start, col_step, reduce), rtol=1e-5, atol=1e-5)
    assert kernels == 1, f"{kernels} kernels"


@pytest.mark.parametrize("reduce", ["none", "mean"])
def test_nt_xent_one_kernel(reduce: str) -> None:
    _check(38, 19, 0, 1, reduce, 0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), shift=st.integers(0, 70), col_start=st.integers(-3, 3),
       col_step=st.integers(-2, 2), reduce=st.sampled_from(["none", "mean"]), seed=st.integers(0, 2**16))
def test_masked_contrastive_losses_property(n: int, shift: int, col_start: int, col_step: int, reduce: str,
                                           seed: int) -> None:
    _check(n, shift, col_start, col_step, reduce, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["none", "mean"])
@pytest.mark.parametrize("n", [38, 4096])
def test_nt_xent_on_gpu(n: int, reduce: str) -> None:
    """NT-Xent over a [2N, 2N] similarity matrix on the GPU: kernels and values."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    sim = np.random.default_rng(3).standard_normal((n, n)).astype(np.float32)
    fd = _build(n // 2, 0, 1, reduce)
    assert len(fd.lower([sim]).kernels) == (2 if reduce == "mean" and n > 1024 else 1)
    out = cp.asnumpy(fd.execute([cp.asarray(sim)])[0]).astype(np.float64)
    np.testing.assert_allclose(out, _reference(sim, n // 2, 0, 1, reduce), rtol=1e-5, atol=1e-4)
