"""Cross-entropy with a computed label index runs as one kernel and matches NumPy.

Models do not gather at the labels as given: they mask ``ignore_index`` first
(``where(label != -100, label, 0)``), clamp, or shift the labels, and then weight the rows
by the same mask, sum them and divide by the count of valid labels. The index is then a
tensor computed in the kernel beside the row statistics, and the mask is read both by the
gather's index and by the row total. Each case is checked against NumPy in float64 and must
take one kernel, as the plain-label cross-entropy does.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

IGNORE = -100


def _build(rank: int, dtype: DataType, index: str, form: str, reduce: str,
           smoothing: float) -> FusionDefinition:
    """Cross-entropy over the last axis of a rank-`rank` logits tensor, written as models do."""
    last = rank - 1
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank, dtype)
        labels = fd.define_tensor([-1] * last, DataType.Int)
        xf = fd.ops.cast(x, DataType.Float) if dtype != DataType.Float else x
        valid = fd.ops.ne(labels, IGNORE)
        if index == "where":
            safe = fd.ops.where(valid, labels, 0)
        elif index == "clamp":
            safe = fd.ops.clamp(labels, 0, fd.ops.sub(fd.ops.size(x, last), 1))
        else:  # "mul": labels * valid, as some codebases zero the ignored ones
            safe = fd.ops.mul(labels, fd.ops.cast(valid, DataType.Int))
        idx = fd.ops.broadcast_in_dim(safe, [-1] * rank, list(range(last)))
        if form == "lse":
            lse = fd.ops.logsumexp(xf, dims=[last])
            picked = fd.ops.squeeze(fd.ops.take_along_axis(xf, idx, last), [last])
            nll = fd.ops.sub(lse, picked)
            if smoothing:
                # mean over the row of -log p = lse - mean(x)
                mean_x = fd.ops.mul(fd.ops.sum(xf, dims=[last]), fd.ops.reciprocal(fd.ops.size(x, last)))
                smooth = fd.ops.mul(fd.ops.sub(lse, mean_x), smoothing)
                nll = fd.ops.add(fd.ops.mul(nll, 1.0 - smoothing), smooth)
        else:
            mx = fd.ops.max(xf, dims=[last], keepdim=True)
            z = fd.ops.sub(xf, mx)
            logp = fd.ops.sub(z, fd.ops.log(fd.ops.sum(fd.ops.exp(z), dims=[last], keepdim=True)))
            nll = fd.ops.neg(fd.ops.squeeze(fd.ops.take_along_axis(logp, idx, last), [last]))
        vf = fd.ops.cast(valid, DataType.Float)
        nll = fd.ops.mul(nll, vf)
        every = list(range(last))
        if reduce == "none":
            fd.add_output(nll)
        elif reduce == "sum":
            fd.add_output(fd.ops.sum(nll, dims=every))
        else:
            fd.add_output(fd.ops.div(fd.ops.sum(nll, dims=every), fd.ops.sum(vf, dims=every)))
    return fd


def _reference(x: np.ndarray, labels: np.ndarray, reduce: str, smoothing: float) -> np.ndarray:
    xd = x.astype(np.float64)
    valid = labels != IGNORE
    safe = np.where(valid, labels, 0)
    m = xd.max(-1, keepdims=True)
    lse = (np.log(np.exp(xd - m).sum(-1, keepdims=True)) + m)[..., 0]
    nll = lse - np.take_along_axis(xd, safe[..., None], -1)[..., 0]
    if smoothing:
        nll = (1 - smoothing) * nll + smoothing * (lse - xd.mean(-1))
    nll = nll * valid
    if reduce == "none":
        return nll
    if reduce == "sum":
        return np.asarray(nll.sum())
    return np.asarray(nll.sum() / valid.sum())


def _inputs(rng: np.random.Generator, shape: Tuple[int, ...], dtype: DataType) -> List[np.ndarray]:
    npdt = np.float16 if dtype == DataType.Half else np.float32
    x = (rng.standard_normal(shape) * 2).astype(npdt)
    labels = rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int64)
    flat = labels.reshape(-1)
    flat[rng.random(flat.size) < 0.3] = IGNORE
    flat[0] = 0  # at least one valid label: the mean divides by the count
    return [x, labels]


def _check(rank: int, dtype: DataType, index: str, form: str, reduce: str, smoothing: float,
           shape: Tuple[int, ...], seed: int) -> None:
    fd = _build(rank, dtype, index, form, reduce, smoothing)
    ins = _inputs(np.random.default_rng(seed), shape, dtype)
    kernels = len(fd.lower(ins).kernels)
    out = np.asarray(fd.execute(ins)[0], dtype=np.float64)
    want = _reference(*ins, reduce, smoothing)
    tol = 2e-3 if dtype == DataType.Half else 1e-4
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    assert kernels == 1, f"{kernels} kernels for {index}/{form}/{reduce}"


@pytest.mark.parametrize("reduce", ["none", "sum", "mean"])
@pytest.mark.parametrize("index", ["where", "clamp", "mul"])
def test_masked_label_cross_entropy_one_kernel(index: str, reduce: str) -> None:
    _check(2, DataType.Float, index, "lse", reduce, 0.0, (37, 129), 1)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("form", ["lse", "log_softmax"])
def test_hf_style_loss_mean_over_valid_tokens(rank: int, form: str) -> None:
    shape = (45, 100) if rank == 2 else (3, 15, 100)
    _check(rank, DataType.Half, "where", form, "mean", 0.0, shape, 2)


def test_label_smoothing_with_ignore_index() -> None:
    _check(3, DataType.Float, "where", "lse", "mean", 0.1, (2, 9, 31), 3)


@settings(max_examples=25, deadline=None)
@given(
    rank=st.sampled_from([2, 3]),
    half=st.booleans(),
    index=st.sampled_from(["where", "clamp", "mul"]),
    form=st.sampled_from(["lse", "log_softmax"]),
    reduce=st.sampled_from(["none", "sum", "mean"]),
    smooth=st.booleans(),
    rows=st.integers(1, 40),
    cols=st.integers(2, 300),
    seed=st.integers(0, 2**16),
)
def test_computed_label_losses_property(rank: int, half: bool, index: str, form: str, reduce: str,
                                        smooth: bool, rows: int, cols: int, seed: int) -> None:
    smoothing = 0.1 if smooth and form == "lse" else 0.0
    shape = (rows, cols) if rank == 2 else (2, rows, cols)
    _check(rank, DataType.Half if half else DataType.Float, index, form, reduce, smoothing, shape, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["none", "mean"])
@pytest.mark.parametrize("shape", [(4099, 1000), (8, 1024, 32000), (3, 7, 31)])
def test_computed_label_cross_entropy_on_gpu(shape: Tuple[int, ...], reduce: str) -> None:
    """The schedules above on the GPU (large vocabularies, odd sizes): one kernel, or for the
    mean over thousands of rows, the rows then their total (a grid-wide total in the row
    kernel would hold every block at its semaphore)."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    fd = _build(len(shape), DataType.Float, "where", "lse", reduce, 0.1)
    ins = _inputs(np.random.default_rng(7), shape, DataType.Float)
    rows = int(np.prod(shape[:-1]))
    assert len(fd.lower(ins).kernels) == (2 if reduce == "mean" and rows > 1024 else 1)
    out = cp.asnumpy(fd.execute([cp.asarray(a) for a in ins])[0]).astype(np.float64)
    np.testing.assert_allclose(out, _reference(*ins, reduce, 0.1), rtol=1e-4, atol=1e-4)
