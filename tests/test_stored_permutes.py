"""Permutes in fusions with reductions: QK-norm written as Qwen3 writes it
(``rmsnorm(q.view(B, S, H, D)).transpose(1, 2)``) and as Gemma3 writes it
(``rmsnorm(q.view(B, S, H, D).transpose(1, 2))``), softmaxes and sums whose results are
permuted. A permute that keeps the last axis is computed away: what it leads to runs in its
source's order and the outputs are stored permuted (handed back as plain row-major arrays),
so each takes one kernel where the permute was a transposing kernel of its own. Checked
against NumPy in float64 through the CPU interpreter, and on the GPU where there is one."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

HALF_TOL = dict(rtol=2e-2, atol=2e-2)
FLOAT_TOL = dict(rtol=1e-4, atol=1e-5)


def _rms(fd: FusionDefinition, x: Any, w: Any, n: int) -> Any:
    """LLaMA's RMSNorm over the last axis of float ``x``, scaled by float weight ``w``."""
    ms = fd.ops.mul(fd.ops.sum(fd.ops.mul(x, x), dims=[-1], keepdim=True), 1.0 / n)
    return fd.ops.mul(fd.ops.mul(x, fd.ops.rsqrt(fd.ops.add(ms, 1e-6))), w)


def _ref_rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def _qk_norm(after: bool, unpermuted_too: bool, d: int) -> FusionDefinition:
    """QK-norm of a half [B, S, H, D] tensor to [B, H, S, D]: normalized then transposed
    (``after``), or transposed then normalized."""
    with FusionDefinition() as fd:
        q = fd.define_tensor([-1, -1, -1, -1], DataType.Half)
        w = fd.define_tensor([-1], DataType.Half)
        wf = fd.ops.broadcast_in_dim(fd.ops.cast(w, DataType.Float), [-1, -1, -1, -1], [3])
        qf = fd.ops.cast(q, DataType.Float)
        if after:
            n = _rms(fd, qf, wf, d)
            out = fd.ops.permute(fd.ops.cast(n, DataType.Half), [0, 2, 1, 3])
        else:
            n = _rms(fd, fd.ops.permute(qf, [0, 2, 1, 3]), wf, d)
            out = fd.ops.cast(n, DataType.Half)
        fd.add_output(out)
        if unpermuted_too:
            fd.add_output(fd.ops.cast(n, DataType.Half))
    return fd


@pytest.mark.parametrize("after", [True, False], ids=["norm_then_transpose", "transpose_then_norm"])
@pytest.mark.parametrize("unpermuted_too", [False, True], ids=["one_output", "both_orders"])
@pytest.mark.parametrize("shape", [(2, 33, 4, 64), (1, 7, 3, 128), (3, 1, 5, 40)])
def test_qk_norm_one_kernel(after: bool, unpermuted_too: bool, shape: Sequence[int]) -> None:
    """Both ways models write QK-norm take one kernel and hand back [B, H, S, D] row-major."""
    rng = np.random.default_rng(sum(shape))
    q = rng.standard_normal(shape).astype(np.float16)
    w = rng.standard_normal(shape[3]).astype(np.float16)
    fd = _qk_norm(after, unpermuted_too, shape[3])
    assert len(fd.lower([q, w]).kernels) == 1
    outs = fd.execute([q, w])
    normed = _ref_rms(q.astype(np.float64), w.astype(np.float64))
    want = normed.transpose(0, 2, 1, 3)
    assert outs[0].shape == want.shape and outs[0].flags.c_contiguous
    np.testing.assert_allclose(outs[0].astype(np.float64), want, **HALF_TOL)
    if unpermuted_too:
        second = want if not after else normed
        assert outs[1].shape == second.shape
        np.testing.assert_allclose(outs[1].astype(np.float64), second, **HALF_TOL)


def _softmax_last(fd: FusionDefinition, x: Any) -> Any:
    e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, dims=[-1], keepdim=True)))
    return fd.ops.div(e, fd.ops.sum(e, dims=[-1], keepdim=True))


def _ref_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


Case = Callable[[FusionDefinition, Any, Any], List[Any]]
RefCase = Callable[[np.ndarray, np.ndarray], List[np.ndarray]]

CASES: List[tuple] = [
    # Attention probabilities of [B, S, H, T] scores stored as [B, H, S, T], scaled.
    ("softmax_then_permute",
     lambda fd, x, w: [fd.ops.mul(fd.ops.permute(_softmax_last(fd, x), [0, 2, 1, 3]), 0.5)],
     lambda x, w: [0.5 * _ref_softmax(x).transpose(0, 2, 1, 3)], 1),
    # Row sums of a [B, S, H, D] tensor handed back as [S, B, H].
    ("sum_then_permute",
     lambda fd, x, w: [fd.ops.permute(fd.ops.sum(x, dims=[3]), [1, 0, 2])],
     lambda x, w: [x.sum(3).transpose(1, 0, 2)], 1),
    # A centred tensor permuted, with a weight over the last axis added after the permute,
    # and the unpermuted tensor as a second output.
    ("centred_weight_after_permute",
     lambda fd, x, w: (lambda c: [fd.ops.add(fd.ops.permute(c, [1, 2, 0, 3]),
                                             fd.ops.broadcast_in_dim(w, [-1, -1, -1, -1], [3])), c])(
         fd.ops.sub(x, fd.ops.mul(fd.ops.sum(x, dims=[3], keepdim=True), 0.25))),
     lambda x, w: (lambda c: [c.transpose(1, 2, 0, 3) + w, c])(x - 0.25 * x.sum(3, keepdims=True)), 1),
    # Transposed input, normalized, with the mean square as an output too ([B, H, S]).
    ("permute_then_norm_with_statistic",
     lambda fd, x, w: (lambda p: [fd.ops.mul(p, fd.ops.rsqrt(fd.ops.add(
         fd.ops.sum(fd.ops.mul(p, p), dims=[3], keepdim=True), 1.0))),
         fd.ops.sum(fd.ops.mul(p, p), dims=[3])])(fd.ops.permute(x, [0, 2, 1, 3])),
     lambda x, w: (lambda p: [p / np.sqrt((p * p).sum(3, keepdims=True) + 1.0), (p * p).sum(3)])(
         x.transpose(0, 2, 1, 3)), 1),
    # Transposed, normalized and transposed back: the permutes cancel.
    ("permute_norm_permute_back",
     lambda fd, x, w: [fd.ops.permute(_softmax_last(fd, fd.ops.permute(x, [2, 1, 0, 3])), [2, 1, 0, 3])],
     lambda x, w: [_ref_softmax(x)], 1),
    # A permute that moves the last axis stays a permute (answer still checked).
    ("moves_last_axis",
     lambda fd, x, w: [fd.ops.permute(fd.ops.sub(x, fd.ops.max(x, dims=[3], keepdim=True)), [0, 1, 3, 2])],
     lambda x, w: [(x - x.max(3, keepdims=True)).transpose(0, 1, 3, 2)], None),
]


@pytest.mark.parametrize("name,build,ref,kernels", CASES, ids=[c[0] for c in CASES])
def test_reductions_beside_permutes(name: str, build: Case, ref: RefCase, kernels: Any) -> None:
    """Softmaxes, sums and normalizations next to permutes give NumPy's arrays, row-major."""
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((3, 5, 4, 37)).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1, -1, -1], DataType.Float)
        wt = fd.define_tensor([-1], DataType.Float)
        for o in build(fd, xt, wt):
            fd.add_output(o)
    if kernels is not None:
        assert len(fd.lower([x, w]).kernels) == kernels
    outs = fd.execute([x, w])
    for got, want in zip(outs, ref(x.astype(np.float64), w.astype(np.float64))):
        assert got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, **FLOAT_TOL)


@st.composite
def _programs(draw: Any) -> dict:
    rank = draw(st.integers(3, 4))
    shape = [draw(st.sampled_from([1, 2, 3, 5, 7])) for _ in range(rank - 1)]
    shape.append(draw(st.sampled_from([1, 8, 33])))
    outer = list(draw(st.permutations(range(rank - 1))))
    return dict(
        shape=shape,
        perm=outer + [rank - 1],
        where=draw(st.sampled_from(["input", "middle", "output"])),
        kind=draw(st.sampled_from(["rms", "softmax", "center", "rowsum"])),
        epilogue=draw(st.sampled_from(["none", "scale", "weight", "half"])),
        extra=draw(st.sampled_from(["none", "unpermuted", "statistic"])),
    )


@settings(max_examples=60, deadline=None)
@given(_programs())
def test_random_permutes_beside_reductions(p: dict) -> None:
    """Random kept-last permutes before, inside or after a row reduction, with epilogues and
    extra outputs, give NumPy's arrays in the defined shapes."""
    rank, perm = len(p["shape"]), p["perm"]
    rng = np.random.default_rng(7)
    x = rng.standard_normal(p["shape"]).astype(np.float32)
    w = rng.standard_normal(p["shape"][-1]).astype(np.float32)
    full = [-1] * rank

    def body(fd: FusionDefinition, t: Any, wt: Any) -> Any:
        if p["kind"] == "rms":
            return _rms(fd, t, fd.ops.broadcast_in_dim(wt, full, [rank - 1]), p["shape"][-1])
        if p["kind"] == "softmax":
            return _softmax_last(fd, t)
        if p["kind"] == "center":
            return fd.ops.sub(t, fd.ops.max(t, dims=[rank - 1], keepdim=True))
        return fd.ops.sum(t, dims=[rank - 1], keepdim=True)

    def ref_body(t: np.ndarray, wt: np.ndarray) -> np.ndarray:
        if p["kind"] == "rms":
            return _ref_rms(t, wt)
        if p["kind"] == "softmax":
            return _ref_softmax(t)
        if p["kind"] == "center":
            return t - t.max(-1, keepdims=True)
        return t.sum(-1, keepdims=True)

    with FusionDefinition() as fd:
        xt = fd.define_tensor(full, DataType.Float)
        wt = fd.define_tensor([-1], DataType.Float)
        src = fd.ops.permute(xt, perm) if p["where"] == "input" else fd.ops.exp(xt)
        y = body(fd, src, wt)
        if p["where"] == "middle":
            y = fd.ops.mul(fd.ops.permute(y, perm), 2.0)
        elif p["where"] == "output":
            y = fd.ops.permute(y, perm)
        if p["epilogue"] == "scale":
            y = fd.ops.mul(y, 3.0)
        elif p["epilogue"] == "weight":
            y = fd.ops.add(y, fd.ops.broadcast_in_dim(wt, full, [rank - 1]))
        elif p["epilogue"] == "half":
            y = fd.ops.cast(fd.ops.cast(y, DataType.Half), DataType.Float)
        fd.add_output(y)
        if p["extra"] == "unpermuted":
            fd.add_output(src)
        elif p["extra"] == "statistic":
            fd.add_output(fd.ops.max(src, dims=[rank - 1]))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    src_ref = x64.transpose(perm) if p["where"] == "input" else np.exp(x64)
    y_ref = ref_body(src_ref, w64)
    if p["where"] == "middle":
        y_ref = 2.0 * y_ref.transpose(perm)
    elif p["where"] == "output":
        y_ref = y_ref.transpose(perm)
    if p["epilogue"] == "scale":
        y_ref = 3.0 * y_ref
    elif p["epilogue"] == "weight":
        y_ref = y_ref + w64
    wants = [y_ref] + ([src_ref] if p["extra"] == "unpermuted" else []) + (
        [src_ref.max(-1)] if p["extra"] == "statistic" else [])
    outs = fd.execute([x, w])
    tol = HALF_TOL if p["epilogue"] == "half" else FLOAT_TOL
    for got, want in zip(outs, wants):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("after", [True, False], ids=["norm_then_transpose", "transpose_then_norm"])
def test_qk_norm_gpu(after: bool) -> None:
    """On the GPU, QK-norm both ways matches NumPy and comes back [B, H, S, D] contiguous."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    shape = (2, 77, 8, 128)
    rng = np.random.default_rng(3)
    q = rng.standard_normal(shape).astype(np.float16)
    w = rng.standard_normal(shape[3]).astype(np.float16)
    fd = _qk_norm(after, True, shape[3])
    outs = fd.execute([cp.asarray(q), cp.asarray(w)])
    normed = _ref_rms(q.astype(np.float64), w.astype(np.float64))
    want = normed.transpose(0, 2, 1, 3)
    got = cp.asnumpy(outs[0])
    assert got.shape == want.shape and outs[0].flags.c_contiguous
    np.testing.assert_allclose(got.astype(np.float64), want, **HALF_TOL)
    np.testing.assert_allclose(cp.asnumpy(outs[1]).astype(np.float64), normed if after else want, **HALF_TOL)
