"""Losses that total a row schedule's per-row values the way model code writes them run in
the row schedule's one kernel, the total a grid reduction over its rows:

- ``-(onehot * log_softmax(x)).sum(1).mean()``: the mean of row sums is not merged into one
  reduction over both axes of the log-softmax (``merge_nested_reductions`` leaves reductions
  of tensors computed from another reduction alone);
- ``(p * (log p - log_softmax(q))).sum() / B`` (KL divergence, ``batchmean``) and a sum or max
  over both axes of a log-softmax: the reduction over both axes is split into the row
  reduction and a total (``split_reductions_of_rows``);
- ``total / cast(S)`` of a runtime size: the size's value joins the ops after the totals;
- ``loss.mean()`` beside ``loss.sum(-1)`` (or ``mask.all()`` beside ``mask.sum(-1)``): the total
  over every axis is split into the rows' reduction and a total.

Each is checked against NumPy in float64, with its kernel count."""

from __future__ import annotations

import numpy as np
import pytest
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def log_softmax(fd: FusionDefinition, x):
    m = fd.ops.max(x, dims=[1], keepdim=True)
    s = fd.ops.sub(x, m)
    return fd.ops.sub(s, fd.ops.log(fd.ops.sum(fd.ops.exp(s), dims=[1], keepdim=True)))


def log_softmax_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    s = x - x.max(1, keepdims=True)
    return s - np.log(np.exp(s).sum(1, keepdims=True))


SHAPES = [(48, 48), (5, 1000), (1, 7), (130, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("neg_first", [False, True])
def test_nll_as_the_mean_of_row_sums_is_one_kernel(shape, neg_first: bool) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1], DataType.Int)
        col = fd.ops.broadcast_in_dim(fd.ops.iota(fd.ops.size(x, 1)), [-1, -1], [1])
        onehot = fd.ops.eq(col, fd.ops.broadcast_in_dim(y, [-1, -1], [0]))
        picked = fd.ops.sum(fd.ops.where(onehot, log_softmax(fd, x), 0.0), dims=[1])
        if neg_first:
            fd.add_output(fd.ops.mean(fd.ops.neg(picked), dims=[0]))
        else:
            fd.add_output(fd.ops.neg(fd.ops.mean(picked, dims=[0])))
    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    x_ = rng.standard_normal(shape).astype(np.float32) * 2
    y_ = rng.integers(0, shape[1], shape[0])
    (got,) = fd.execute([x_, y_])
    want = -log_softmax_ref(x_)[np.arange(shape[0]), y_].mean()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(lowered_for(fd, [x_, y_]).kernels) == 1


@pytest.mark.parametrize("shape", SHAPES)
def test_kl_divergence_batchmean_is_one_kernel(shape) -> None:
    with FusionDefinition() as fd:
        q = fd.define_tensor([-1, -1])
        p = fd.define_tensor([-1, -1])
        kl = fd.ops.sum(fd.ops.mul(p, fd.ops.sub(fd.ops.log(p), log_softmax(fd, q))), dims=[0, 1])
        fd.add_output(fd.ops.div(kl, fd.ops.cast(fd.ops.size(q, 0), DataType.Float)))
    rng = np.random.default_rng(shape[1])
    q_ = rng.standard_normal(shape).astype(np.float32)
    p_ = rng.random(shape).astype(np.float32) + 0.05
    p_ /= p_.sum(1, keepdims=True)
    (got,) = fd.execute([q_, p_])
    pd = p_.astype(np.float64)
    np.testing.assert_allclose(got, (pd * (np.log(pd) - log_softmax_ref(q_))).sum() / shape[0], rtol=1e-4,
                               atol=1e-6)
    assert len(lowered_for(fd, [q_, p_]).kernels) == 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_a_reduction_over_both_axes_of_a_log_softmax_is_its_rows_then_a_total(shape, op: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(getattr(fd.ops, op)(log_softmax(fd, x), dims=[0, 1]))
    x_ = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32)
    (got,) = fd.execute([x_])
    np.testing.assert_allclose(got, getattr(log_softmax_ref(x_), op)(), rtol=1e-5, atol=1e-5)
    assert len(lowered_for(fd, [x_]).kernels) == 1


@pytest.mark.parametrize("shape", SHAPES + [(3, 4, 50)])
@pytest.mark.parametrize("kind", ["huber_mean_and_row_sums", "mask_all_and_row_counts", "max_and_row_max"])
def test_a_total_beside_row_reductions_of_the_same_inputs_is_one_kernel(shape, kind: str) -> None:
    # `loss.mean()` beside `loss.sum(-1)`, `mask.all()` beside `mask.sum(-1)`: the total over
    # every axis is split into the rows' reduction and a total (`sibling_row_axes`).
    rank = len(shape)
    last = [rank - 1]
    every = list(range(rank))
    rng = np.random.default_rng(sum(shape))
    with FusionDefinition() as fd:
        if kind == "mask_all_and_row_counts":
            m = fd.define_tensor([-1] * rank, DataType.Int32)
            fd.add_output(fd.ops.sum(m, dims=last))
            fd.add_output(fd.ops.min(fd.ops.ne(m, 0), dims=every))
            ins = [(rng.random(shape) < 0.9).astype(np.int32)]
            want = [ins[0].sum(-1), (ins[0] != 0).all()]
        else:
            a = fd.define_tensor([-1] * rank)
            b = fd.define_tensor([-1] * rank)
            d = fd.ops.abs(fd.ops.sub(a, b))
            if kind == "huber_mean_and_row_sums":
                loss = fd.ops.where(fd.ops.lt(d, 1.0), fd.ops.mul(fd.ops.mul(d, d), 0.5), fd.ops.sub(d, 0.5))
                fd.add_output(fd.ops.mean(loss, dims=every))
                fd.add_output(fd.ops.sum(d, dims=last))
            else:
                fd.add_output(fd.ops.max(d, dims=every))
                fd.add_output(fd.ops.max(fd.ops.mul(d, 2.0), dims=last))
            ins = [(rng.standard_normal(shape) * 2).astype(np.float32) for _ in range(2)]
            dd = np.abs(ins[0].astype(np.float64) - ins[1])
            if kind == "huber_mean_and_row_sums":
                want = [np.where(dd < 1.0, 0.5 * dd * dd, dd - 0.5).mean(), dd.sum(-1)]
            else:
                want = [dd.max(), (2 * dd).max(-1)]
    got = fd.execute([x.copy() for x in ins])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), w, rtol=1e-5, atol=1e-5)
    assert len(lowered_for(fd, ins).kernels) == 1
