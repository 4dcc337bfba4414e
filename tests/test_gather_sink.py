"""Gathers of element-wise results read the inputs where they pick.

The automatic path moves ``take_along_axis`` and ``index_select`` through element-wise ops,
so ``take_along_axis(log_softmax(x), labels)`` (cross-entropy as models write it) computes
the picked log-probabilities from the picked logits and the rows' statistics instead of
storing the whole log-softmax first. Every case is checked against NumPy in float64, auto
and as written; kernel counts where the rewrite is what makes one kernel.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError


def _lse(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return np.log(np.exp(x - m).sum(axis=1, keepdims=True)) + m


def _nll_gather(mean: bool, also_logp: bool) -> FusionDefinition:
    """``F.cross_entropy`` as log_softmax then a gather of the label's entry."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        labels = fd.define_tensor([-1], dtype=DataType.Int)
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        xs = fd.ops.sub(x, mx)
        logp = fd.ops.sub(xs, fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1], keepdim=True)))
        picked = fd.ops.take_along_axis(logp, fd.ops.broadcast_in_dim(labels, [-1, 1], [0]), 1)
        nll = fd.ops.neg(fd.ops.squeeze(picked, [1]))
        fd.add_output(fd.ops.mul(fd.ops.sum(nll, dims=[0]), 1.0 / 4) if mean else nll)
        if also_logp:
            fd.add_output(logp)
    return fd


def _ce_inputs(rows: int, cols: int) -> Callable[[np.random.Generator], List[np.ndarray]]:
    def make(rng: np.random.Generator) -> List[np.ndarray]:
        x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
        return [x, rng.integers(0, cols, size=rows).astype(np.int64)]
    return make


def _ce_ref(mean: bool, also_logp: bool) -> Callable[..., List[np.ndarray]]:
    def ref(x: np.ndarray, labels: np.ndarray) -> List[np.ndarray]:
        logp = x.astype(np.float64) - _lse(x.astype(np.float64))
        nll = -logp[np.arange(len(labels)), labels]
        out = [np.asarray(nll.sum() / 4) if mean else nll]
        return out + ([logp] if also_logp else [])
    return ref


def _rows_picked() -> FusionDefinition:
    """index_select of rows of ``exp(x) * w`` (w broadcast over the rows)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        y = fd.ops.mul(fd.ops.exp(x), fd.ops.broadcast_in_dim(w, [-1, -1], [1]))
        fd.add_output(fd.ops.index_select(y, idx, 0))
    return fd


def _rows_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((9, 33)).astype(np.float32), rng.standard_normal(33).astype(np.float32),
            np.array([8, 0, 3, 3, 5], dtype=np.int64)]


def _rows_ref(x: np.ndarray, w: np.ndarray, idx: np.ndarray) -> List[np.ndarray]:
    return [(np.exp(x.astype(np.float64)) * w)[idx]]


def _where_picked() -> FusionDefinition:
    """take_along_axis of ``where(mask, x * 2, -x)`` along the last axis, K picks per row."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
        idx = fd.define_tensor([-1, -1], dtype=DataType.Int)
        y = fd.ops.where(m, fd.ops.mul(x, 2.0), fd.ops.neg(x))
        fd.add_output(fd.ops.take_along_axis(y, idx, 1))
    return fd


def _where_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [rng.standard_normal((6, 40)).astype(np.float32), rng.random((6, 40)) < 0.5,
            rng.integers(0, 40, size=(6, 3)).astype(np.int64)]


def _where_ref(x: np.ndarray, m: np.ndarray, idx: np.ndarray) -> List[np.ndarray]:
    y = np.where(m, 2 * x.astype(np.float64), -x.astype(np.float64))
    return [np.take_along_axis(y, idx, 1)]


Case = Tuple[Callable[[], FusionDefinition], Callable[[np.random.Generator], List[np.ndarray]],
             Callable[..., List[np.ndarray]], int]

# name: (build, inputs, float64 reference, kernels where checked; 0: not checked)

CASES = {
    "cross_entropy_mean_long": (lambda: _nll_gather(True, False), _ce_inputs(4, 70001),
                                _ce_ref(True, False), 1),
    "cross_entropy_mean_short": (lambda: _nll_gather(True, False), _ce_inputs(4, 1031),
                                 _ce_ref(True, False), 0),
    "nll_per_row_long": (lambda: _nll_gather(False, False), _ce_inputs(3, 70001), _ce_ref(False, False), 1),
    "nll_and_log_softmax": (lambda: _nll_gather(False, True), _ce_inputs(5, 517), _ce_ref(False, True), 0),
    "rows_picked": (_rows_picked, _rows_inputs, _rows_ref, 0),
    "where_picked": (_where_picked, _where_inputs, _where_ref, 0),
}


def _check(got: List[Any], want: List[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("as_written", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy(name: str, as_written: bool) -> None:
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(1))
    _check(build().execute(a, as_written=as_written), ref(*a))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3]])
def test_one_kernel(name: str) -> None:
    """The picked values come from the logits in the kernel that reduces the rows."""
    build, inputs, _, kernels = CASES[name]
    low = build().lower(inputs(np.random.default_rng(2)))
    assert len(low.kernels) == kernels, low.host_program


def test_out_of_range_label_is_reported() -> None:
    fd = _nll_gather(False, False)
    x, labels = _ce_inputs(3, 50)(np.random.default_rng(3))
    labels[1] = 50
    with pytest.raises(KilnError, match="index"):
        fd.execute([x, labels])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_numpy(name: str) -> None:
    cp = cupy_or_skip()
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(4))
    got = build().execute([cp.asarray(x) for x in a])
    _check([cp.asnumpy(g) for g in got], ref(*a))


def test_many_rows_take_two_kernels_one_pass() -> None:
    """Past four waves of rows the mean over the rows takes a kernel of its own; the rows'
    kernel reads each row once (one loop over it) for the max, the log-sum-exp and the
    picked logit."""
    import re

    fd = _nll_gather(True, False)
    x = np.zeros((600, 70001), np.float32)  # zeros map lazily: nothing is touched
    low = fd.lower([x, np.zeros(600, np.int64)])
    assert len(low.kernels) == 2, low.host_program
    body = low.kernels[0].cuda_source[low.kernels[0].cuda_source.index("kiln_kernel("):]
    # One loop over the row; the picked logit's size-one axis is a loop of one iteration.
    loops = re.findall(r"^    for \(kiln_index_t idx\d+ = 0; idx\d+ < (\d+);", body, re.M)
    assert len([n for n in loops if n != "1"]) == 1, loops


@pytest.mark.parametrize("op", ["index_select", "gather"])
def test_a_gather_of_a_broadcast_table_keeps_its_extent_and_check(op: str) -> None:
    """Every operand of the gathered element-wise op broadcast along the gathered axis (a
    0-d value broadcast to [1]): nothing is left to gather, so the gather stays, with the
    index's length as the result's and its bounds check (moved away, the result had one row)."""
    with FusionDefinition() as fd:
        s = fd.define_tensor([], dtype=DataType.Float)
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        t = fd.ops.tanh(fd.ops.broadcast_in_dim(s, shape=[-1], broadcast_dims=[]))
        g = getattr(fd.ops, op)(t, fd.ops.cast(idx, DataType.Int32), 0)
        fd.add_output(fd.ops.broadcast_in_dim(g, shape=[-1, -1, -1], broadcast_dims=[0]))
    s0 = np.array(0.3, np.float32)
    for as_written in (False, True):
        (got,) = fd.execute([s0, np.zeros(7, np.int64)], as_written=as_written)
        assert got.shape == (7, 1, 1)
        np.testing.assert_allclose(got.reshape(-1), np.full(7, np.tanh(0.3)), rtol=1e-6)
        with pytest.raises(KilnError, match="index"):
            fd.execute([s0, np.array([0, 1], np.int64)], as_written=as_written)


def _nll_fixed_shapes(rows: int, vocab: int) -> FusionDefinition:
    """Cross-entropy as a traced model writes it: `broadcast_in_dim` to fixed sizes (of
    symbolic inputs), which makes the label index an expand that only names sizes."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Half)
        labels = fd.define_tensor([-1], dtype=DataType.Int)
        xf = fd.ops.cast(x, DataType.Float)
        lse = fd.ops.logsumexp(xf, [1])
        logp = fd.ops.sub(xf, fd.ops.broadcast_in_dim(lse, [rows, vocab], [0]))
        picked = fd.ops.take_along_axis(logp, fd.ops.broadcast_in_dim(labels, [rows, 1], [0]), 1)
        nll = fd.ops.neg(fd.ops.squeeze(picked, [1]))
        fd.add_output(fd.ops.mean(nll, [0]))
        fd.add_output(nll)
    return fd


@pytest.mark.parametrize(("rows", "vocab"), [(9, 1000), (5, 33)])
def test_fixed_broadcast_shapes_keep_the_gather_in_the_rows_kernel(rows: int, vocab: int) -> None:
    from kiln.execute import lowered_for

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, vocab)).astype(np.float16)
    labels = rng.integers(0, vocab, rows)
    fd = _nll_fixed_shapes(rows, vocab)
    xf = x.astype(np.float64)
    nll = -(xf - _lse(xf))[np.arange(rows), labels]
    mean, each = fd.execute([x, labels])
    np.testing.assert_allclose(np.float64(mean), nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(each.astype(np.float64), nll, rtol=1e-5, atol=1e-6)
    # One kernel, as with -1 sizes (the fixed ones made the label index a kernel of its own).
    assert len(lowered_for(fd, [x, labels]).kernels) == 1
    with pytest.raises(KilnError, match=r"input 1 \(T1\): axis 0 has size"):
        fd.execute([x, labels[:-1]])


@pytest.mark.parametrize("shape", [(9, 13), (1, 1), (33, 257)])
@pytest.mark.parametrize("form", ["bias", "temperature", "bias_and_temperature"])
def test_picks_of_adjusted_logits_take_one_kernel(shape: Tuple[int, int], form: str) -> None:
    """``log_softmax(x + bias)[i, y[i]]`` (logit adjustment, a bias over the vocabulary) and
    ``log_softmax(x / T)`` picks: the gather reads the input and the bias's row where it
    picks, beside the rows' statistics, in one kernel."""
    b, v = shape
    rng = np.random.default_rng(b + v)
    x = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(v).astype(np.float32)
    y = rng.integers(0, v, b).astype(np.int64)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1])
        bt = fd.define_tensor([-1])
        yt = fd.define_tensor([-1], dtype=DataType.Int)
        lg = xt
        if form != "temperature":
            lg = fd.ops.add(lg, fd.ops.broadcast_in_dim(bt, [-1, -1], [1]))
        if form != "bias":
            lg = fd.ops.div(lg, 0.7)
        z = fd.ops.sub(lg, fd.ops.max(lg, dims=[1], keepdim=True))
        lp = fd.ops.sub(z, fd.ops.log(fd.ops.sum(fd.ops.exp(z), dims=[1], keepdim=True)))
        pick = fd.ops.take_along_axis(lp, fd.ops.broadcast_in_dim(yt, [-1, -1], [0]), 1)
        fd.add_output(fd.ops.neg(fd.ops.squeeze(pick, [1])))
    arrays = [x, bias, y]
    assert len(fd.lower(arrays).kernels) == 1
    (got,) = fd.execute(arrays)
    l64 = x.astype(np.float64)
    if form != "temperature":
        l64 = l64 + bias
    if form != "bias":
        l64 = l64 / 0.7
    logp = l64 - _lse(l64)
    np.testing.assert_allclose(got, -logp[np.arange(b), y], rtol=1e-5, atol=1e-5)
