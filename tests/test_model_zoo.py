"""A zoo of fusions written the way model code writes them (backward passes, optimizers,
quantization, attention masks built from ``iota``, poolings, losses, strided and narrow
inputs), run through the automatic schedule in the CPU interpreter (``fd.execute`` on NumPy
inputs) and checked against float64 NumPy references.

None of these is a builder of ``tests/families.py``. Each is parametrized over a few shapes
(one odd or non-power-of-two, one with a size-one axis where that means something). Half
inputs are compared to a reference computed from the same rounded values; bfloat16 tensors
are made inside the fusion by a cast (NumPy has no bfloat16 without ml_dtypes) and their
results, which come back as uint16 bits without ml_dtypes, are decoded here.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, List, Sequence, Tuple, Union

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

F32 = DataType.Float
F32_MIN = float(np.finfo(np.float32).min)
Shape = Tuple[int, ...]
Tol = Tuple[float, float]

_erf = np.vectorize(math.erf, otypes=[np.float64])


# ----------------------------------------------------------------------------- helpers
def _rng(name: str, shape: Sequence[int]) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{name}{tuple(shape)}".encode()))


def _randn(rng: np.random.Generator, shape: Sequence[int], scale: float = 1.0, shift: float = 0.0,
           dtype: Any = np.float32) -> np.ndarray:
    return (rng.standard_normal(tuple(shape)) * scale + shift).astype(dtype)


def _t(fd: FusionDefinition, rank: int, dtype: DataType = F32) -> Any:
    return fd.define_tensor([-1] * rank, dtype)


def _bc(fd: FusionDefinition, t: Any, rank: int, dims: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=[-1] * rank, broadcast_dims=list(dims))


def _d(a: Any) -> np.ndarray:
    """An input as float64 (exactly the values kiln reads)."""
    return np.asarray(a).astype(np.float64)


def _out64(x: Any) -> np.ndarray:
    """An output as float64; bfloat16 without ml_dtypes comes back as its uint16 bits."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _check(outs: Sequence[Any], wants: Sequence[np.ndarray], tols: Union[Tol, Sequence[Tol]]) -> None:
    assert len(outs) == len(wants), f"{len(outs)} outputs, expected {len(wants)}"
    per = [tols] * len(wants) if isinstance(tols[0], float) else list(tols)  # type: ignore[list-item]
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = _out64(out)
        want = np.asarray(want, dtype=np.float64)
        assert got.shape == want.shape, f"output {i}: shape {got.shape}, expected {want.shape}"
        rtol, atol = per[i]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"output {i}")


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _lse(x: np.ndarray, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    out = np.log(np.exp(x - m).sum(axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _softmax_fd(fd: FusionDefinition, w: Any, axis: int) -> Any:
    mx = fd.ops.max(w, dims=[axis], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(w, mx))
    return fd.ops.div(e, fd.ops.sum(e, dims=[axis], keepdim=True))


def _sqrt_n(n: int) -> float:
    return math.sqrt(max(1, n))


# ============================================================================ backward passes
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 5)])
def test_log_softmax_backward(shape: Shape) -> None:
    """``_log_softmax_backward_data``: ``dx = dy - exp(logp) * sum(dy, -1)``."""
    with FusionDefinition() as fd:
        logp, dy = _t(fd, 2), _t(fd, 2)
        s = fd.ops.sum(dy, dims=[1], keepdim=True)
        fd.add_output(fd.ops.sub(dy, fd.ops.mul(fd.ops.exp(logp), s)))
    rng = _rng("log_softmax_backward", shape)
    x = rng.standard_normal(shape) * 2
    logp = (x - _lse(x, keepdims=True)).astype(np.float32)
    dy = _randn(rng, shape)
    lp, g = _d(logp), _d(dy)
    want = g - np.exp(lp) * g.sum(1, keepdims=True)
    _check(fd.execute([logp, dy]), [want], (1e-5, 1e-5 * _sqrt_n(shape[1])))


@pytest.mark.parametrize("shape", [(1, 1), (5, 97)])
def test_rmsnorm_forward_and_backward_recomputing_rstd(shape: Shape) -> None:
    """LLaMA RMSNorm with activation recomputation: rstd from x in the fusion, outputs the
    forward y, dx (a row reduction) and dw (a column reduction)."""
    m, n = shape
    with FusionDefinition() as fd:
        x, w, dy = _t(fd, 2), _t(fd, 1), _t(fd, 2)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(x, x), dims=[1], keepdim=True), 1e-6))
        xn = fd.ops.mul(x, rstd)
        wb = _bc(fd, w, 2, [1])
        g = fd.ops.mul(dy, wb)
        c = fd.ops.mean(fd.ops.mul(g, xn), dims=[1], keepdim=True)
        fd.add_output(fd.ops.mul(xn, wb))
        fd.add_output(fd.ops.mul(rstd, fd.ops.sub(g, fd.ops.mul(xn, c))))
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, xn), dims=[0]))
    rng = _rng("rmsnorm_fb", shape)
    ins = [_randn(rng, shape, shift=0.2), _randn(rng, (n,), 0.5, 1.0), _randn(rng, shape)]
    x, w, dy = map(_d, ins)
    rs = 1 / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6)
    xn = x * rs
    g = dy * w
    want = [xn * w, rs * (g - xn * (g * xn).mean(1, keepdims=True)), (dy * xn).sum(0)]
    _check(fd.execute(ins), want, [(1e-5, 1e-5), (1e-4, 1e-4), (1e-4, 1e-4 * _sqrt_n(m))])


@pytest.mark.parametrize("shape", [(1, 1), (9, 31), (3, 1, 130)])
def test_gelu_erf_backward(shape: Shape) -> None:
    """``gelu_backward(dy, x, approximate='none')``: ``dy * (Phi(x) + x * phi(x))``."""
    with FusionDefinition() as fd:
        dy, x = _t(fd, len(shape)), _t(fd, len(shape))
        cdf = fd.ops.mul(fd.ops.add(fd.ops.erf(fd.ops.mul(x, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = fd.ops.mul(fd.ops.exp(fd.ops.mul(fd.ops.mul(x, x), -0.5)), 1 / math.sqrt(2 * math.pi))
        fd.add_output(fd.ops.mul(dy, fd.ops.add(cdf, fd.ops.mul(x, pdf))))
    rng = _rng("gelu_erf_bwd", shape)
    ins = [_randn(rng, shape), _randn(rng, shape, scale=3.0)]
    dy, x = map(_d, ins)
    want = dy * (0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    _check(fd.execute(ins), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (13, 7), (4, 257)])
def test_megatron_bias_gelu_tanh_backward(shape: Shape) -> None:
    """Megatron's ``bias_gelu_back(g, bias, y)``: the tanh GELU's derivative at ``y + bias``,
    times ``g``; also the bias gradient (a column sum)."""
    m, n = shape
    with FusionDefinition() as fd:
        g, b, y = _t(fd, 2), _t(fd, 1), _t(fd, 2)
        x = fd.ops.add(y, _bc(fd, b, 2, [1]))
        xx = fd.ops.mul(x, x)
        th = fd.ops.tanh(fd.ops.mul(fd.ops.mul(x, 0.79788456), fd.ops.add(fd.ops.mul(xx, 0.044715), 1.0)))
        left = fd.ops.mul(fd.ops.mul(x, 0.5), fd.ops.mul(
            fd.ops.sub(1.0, fd.ops.mul(th, th)), fd.ops.add(fd.ops.mul(xx, 0.1070322243), 0.79788456)))
        dx = fd.ops.mul(fd.ops.add(left, fd.ops.mul(fd.ops.add(th, 1.0), 0.5)), g)
        fd.add_output(dx)
        fd.add_output(fd.ops.sum(dx, dims=[0]))
    rng = _rng("bias_gelu_back", shape)
    ins = [_randn(rng, shape), _randn(rng, (n,)), _randn(rng, shape, scale=2.0)]
    g, b, y = map(_d, ins)
    x = y + b
    th = np.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    dx = (0.5 * x * ((1 - th * th) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + th)) * g
    _check(fd.execute(ins), [dx, dx.sum(0)], [(1e-5, 1e-5), (1e-5, 1e-5 * _sqrt_n(m))])


@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 5, 67)])
def test_silu_backward(shape: Shape) -> None:
    """``silu_backward``: ``dy * s * (1 + x * (1 - s))``, ``s = sigmoid(x)``."""
    with FusionDefinition() as fd:
        dy, x = _t(fd, len(shape)), _t(fd, len(shape))
        s = fd.ops.sigmoid(x)
        fd.add_output(fd.ops.mul(fd.ops.mul(dy, s), fd.ops.add(fd.ops.mul(x, fd.ops.sub(1.0, s)), 1.0)))
    rng = _rng("silu_bwd", shape)
    ins = [_randn(rng, shape), _randn(rng, shape, scale=4.0)]
    dy, x = map(_d, ins)
    s = 1 / (1 + np.exp(-x))
    _check(fd.execute(ins), [dy * s * (1 + x * (1 - s))], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 2), (3, 258)])
def test_swiglu_chunked_forward_and_backward(shape: Shape) -> None:
    """``gate, up = x.chunk(2, -1); out = silu(gate) * up`` and its backward written into one
    ``[M, 2F]`` gradient with ``cat`` (as fused SwiGLU kernels store it)."""
    m, n2 = shape
    f = n2 // 2
    with FusionDefinition() as fd:
        x, dout = _t(fd, 2), _t(fd, 2)
        gate = fd.ops.slice(x, [0, 0], [m, f])
        up = fd.ops.slice(x, [0, f], [m, n2])
        s = fd.ops.sigmoid(gate)
        act = fd.ops.mul(gate, s)
        fd.add_output(fd.ops.mul(act, up))
        dact = fd.ops.mul(s, fd.ops.add(fd.ops.mul(gate, fd.ops.sub(1.0, s)), 1.0))
        dgate = fd.ops.mul(fd.ops.mul(dout, up), dact)
        fd.add_output(fd.ops.cat([dgate, fd.ops.mul(dout, act)], dim=1))
    rng = _rng("swiglu", shape)
    ins = [_randn(rng, shape, scale=2.0), _randn(rng, (m, f))]
    x, dout = map(_d, ins)
    gate, up = x[:, :f], x[:, f:]
    s = 1 / (1 + np.exp(-gate))
    want_dx = np.concatenate([dout * up * s * (1 + gate * (1 - s)), dout * gate * s], axis=1)
    _check(fd.execute(ins), [gate * s * up, want_dx], (1e-5, 1e-6))


# ----------------------------------------------------------------------------- dropout
_M32 = 0xFFFFFFFF


def _philox(counter: List[int], key: List[int]) -> List[int]:
    """Philox 4x32-10 (Salmon et al.), the generator kiln documents."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & _M32, p1 & _M32, ((p0 >> 32) ^ c[3] ^ k[1]) & _M32, p0 & _M32]
        k = [(k[0] + 0x9E3779B9) & _M32, (k[1] + 0xBB67AE85) & _M32]
    return c


def _uniform01(seed: int, offset: int, n: int) -> np.ndarray:
    """float32 uniforms in [0, 1): the top 24 bits of word 0 at each row-major position."""
    return np.array([(_philox([i & _M32, i >> 32, offset & _M32, offset >> 32],
                              [seed & _M32, seed >> 32])[0] >> 8) / 16777216.0 for i in range(n)])


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (3, 129)])
def test_dropout_from_philox_is_reproducible(shape: Shape) -> None:
    """``F.dropout(x, p=0.25)`` with kiln's counter-based generator: the kept positions are
    ``rand < 1 - p`` and kept values are scaled by ``1 / (1 - p)``; checked against an
    independent Philox, for two seeds."""
    p = 0.25
    with FusionDefinition() as fd:
        x = _t(fd, 2)
        seed, offset = fd.define_scalar(dtype=DataType.Int), fd.define_scalar(dtype=DataType.Int)
        keep = fd.ops.lt(fd.ops.rand_like(x, seed, offset), 1.0 - p)
        fd.add_output(fd.ops.where(keep, fd.ops.mul(x, 1.0 / (1.0 - p)), 0.0))
        fd.add_output(keep)
    x = _randn(_rng("dropout", shape), shape)
    for s, o in [(42, 0), (7, 3)]:
        u = _uniform01(s, o, x.size).reshape(shape)
        keep = u < np.float32(1.0 - p)
        outs = fd.execute([x, s, o])
        np.testing.assert_array_equal(outs[1], keep)
        _check(outs[:1], [np.where(keep, _d(x) / (1 - p), 0.0)], (1e-6, 0.0))


# ============================================================================ poolings, norms
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 33, 17)])
def test_masked_mean_pooling(shape: Shape) -> None:
    """sentence-transformers mean pooling: ``sum(x * mask, 1) / clamp(sum(mask, 1), 1e-9)``
    with an int64 0/1 attention mask [B, S] (a sequence with no tokens pools to 0)."""
    b, s, _ = shape
    with FusionDefinition() as fd:
        x, mask = _t(fd, 3), _t(fd, 2, DataType.Int)
        mf = fd.ops.cast(mask, F32)
        num = fd.ops.sum(fd.ops.mul(x, _bc(fd, mf, 3, [0, 1])), dims=[1])
        den = fd.ops.clamp(fd.ops.sum(mf, dims=[1]), min=1e-9)
        fd.add_output(fd.ops.div(num, _bc(fd, den, 2, [0])))
    rng = _rng("mean_pool", shape)
    x = _randn(rng, shape)
    lengths = rng.integers(1, s + 1, size=b)
    if b > 1:
        lengths[-1] = 0
    mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.int64)
    m = mask[:, :, None].astype(np.float64)
    want = (_d(x) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    _check(fd.execute([x, mask]), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (3, 1, 64)])
def test_cosine_similarity_last_axis(shape: Shape) -> None:
    """``F.cosine_similarity(a, b, dim=-1)`` as ATen computes it: each operand divided by its
    norm clamped to eps, then the dot product."""
    r = len(shape)
    with FusionDefinition() as fd:
        a, b = _t(fd, r), _t(fd, r)

        def unit(v: Any) -> Any:
            n = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(v, v), dims=[r - 1], keepdim=True))
            return fd.ops.div(v, fd.ops.clamp(n, min=1e-8))
        fd.add_output(fd.ops.sum(fd.ops.mul(unit(a), unit(b)), dims=[r - 1]))
    rng = _rng("cosine", shape)
    ins = [_randn(rng, shape), _randn(rng, shape, shift=0.3)]
    a, b = map(_d, ins)

    def unit_ref(v: np.ndarray) -> np.ndarray:
        return v / np.maximum(np.sqrt((v * v).sum(-1, keepdims=True)), 1e-8)
    _check(fd.execute(ins), [(unit_ref(a) * unit_ref(b)).sum(-1)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (3, 17, 1)])
def test_l2_normalize_channel_axis(shape: Shape) -> None:
    """``F.normalize(x, dim=1)`` on [N, C, L] (a middle-axis norm)."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        n = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(x, x), dims=[1], keepdim=True))
        fd.add_output(fd.ops.div(x, fd.ops.clamp(n, min=1e-12)))
    x = _randn(_rng("l2norm", shape), shape)
    x64 = _d(x)
    want = x64 / np.maximum(np.sqrt((x64 * x64).sum(1, keepdims=True)), 1e-12)
    _check(fd.execute([x]), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (8, 3, 3, 3), (5, 7, 1, 1)])
def test_weight_standardization(shape: Shape) -> None:
    """timm's StdConv2d: the conv weight [O, I, kH, kW] standardized per output channel
    (biased variance over axes 1, 2, 3, eps 1e-6)."""
    with FusionDefinition() as fd:
        w = _t(fd, 4)
        var, mean = fd.ops.var_mean(w, dims=[1, 2, 3], correction=0, keepdim=True)
        fd.add_output(fd.ops.div(fd.ops.sub(w, mean), fd.ops.sqrt(fd.ops.add(var, 1e-6))))
    w = _randn(_rng("wstd", shape), shape, scale=0.2, shift=0.05)
    w64 = _d(w)
    mu = w64.mean(axis=(1, 2, 3), keepdims=True)
    want = (w64 - mu) / np.sqrt(w64.var(axis=(1, 2, 3), keepdims=True) + 1e-6)
    _check(fd.execute([w]), [want], (1e-4, 1e-4))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (1, 6, 1, 13)])
def test_batchnorm_eval_running_stats(shape: Shape, layout: str) -> None:
    """BatchNorm2d in eval as the decomposition writes it: per channel ``scale = w *
    rsqrt(running_var + eps)``, ``shift = b - running_mean * scale``; ``y = x * scale + shift``;
    x row-major or ``channels_last`` (an NHWC buffer seen as NCHW)."""
    c = shape[1]
    with FusionDefinition() as fd:
        x, rm, rv, w, b = _t(fd, 4), _t(fd, 1), _t(fd, 1), _t(fd, 1), _t(fd, 1)
        scale = fd.ops.mul(w, fd.ops.rsqrt(fd.ops.add(rv, 1e-5)))
        shift = fd.ops.sub(b, fd.ops.mul(rm, scale))
        fd.add_output(fd.ops.add(fd.ops.mul(x, _bc(fd, scale, 4, [1])), _bc(fd, shift, 4, [1])))
    rng = _rng("bn_eval", shape)
    n_, _, h_, w_ = shape
    x_ = (_randn(rng, shape, 2.0, 0.5) if layout == "nchw"
          else _randn(rng, (n_, h_, w_, c), 2.0, 0.5).transpose(0, 3, 1, 2))
    ins = [x_, _randn(rng, (c,), 0.3),
           rng.uniform(0.5, 2.0, c).astype(np.float32), _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x, rm, rv, w, b = map(_d, ins)
    e = (slice(None), None, None)
    want = (x - rm[e]) / np.sqrt(rv[e] + 1e-5) * w[e] + b[e]
    _check(fd.execute(ins), [want], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(2, 1), (7, 13), (129, 5)])
def test_batchnorm_1d_training_backward(shape: Shape) -> None:
    """BatchNorm1d backward on [N, C] from the saved mean and invstd: column sums
    ``sum(dy)``, ``sum(dy * xhat)`` and ``dx = w * invstd / N * (N dy - sum(dy) - xhat
    sum(dy xhat))``."""
    n, c = shape
    with FusionDefinition() as fd:
        dy, x, mean, invstd, w = _t(fd, 2), _t(fd, 2), _t(fd, 1), _t(fd, 1), _t(fd, 1)
        xhat = fd.ops.mul(fd.ops.sub(x, _bc(fd, mean, 2, [1])), _bc(fd, invstd, 2, [1]))
        sdy = fd.ops.sum(dy, dims=[0])
        sdyx = fd.ops.sum(fd.ops.mul(dy, xhat), dims=[0])
        k = fd.ops.div(fd.ops.mul(w, invstd), float(n))
        inner = fd.ops.sub(fd.ops.sub(fd.ops.mul(dy, float(n)), _bc(fd, sdy, 2, [1])),
                           fd.ops.mul(xhat, _bc(fd, sdyx, 2, [1])))
        fd.add_output(fd.ops.mul(_bc(fd, k, 2, [1]), inner))
        fd.add_output(sdyx)
        fd.add_output(sdy)
    rng = _rng("bn1d_bwd", shape)
    x = _randn(rng, shape, 2.0, 0.5)
    x64 = _d(x)
    mean = x64.mean(0).astype(np.float32)
    invstd = (1 / np.sqrt(x64.var(0) + 1e-5)).astype(np.float32)
    ins = [_randn(rng, shape), x, mean, invstd, _randn(rng, (c,), 0.5, 1.0)]
    dy, x64, mu, inv, w = map(_d, ins)
    xhat = (x64 - mu) * inv
    s1, s2 = dy.sum(0), (dy * xhat).sum(0)
    want = [w * inv / n * (n * dy - s1 - xhat * s2), s2, s1]
    _check(fd.execute(ins), want, (1e-4, 1e-4 * _sqrt_n(n)))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 5, 3, 7), (1, 32, 4, 4)])
def test_convnext_layernorm_channels_first(shape: Shape) -> None:
    """ConvNeXt's ``LayerNorm(data_format='channels_first')``: mean and biased variance over
    axis 1 of NCHW (keepdim), then the per-channel affine."""
    c = shape[1]
    with FusionDefinition() as fd:
        x, w, b = _t(fd, 4), _t(fd, 1), _t(fd, 1)
        u = fd.ops.mean(x, dims=[1], keepdim=True)
        xc = fd.ops.sub(x, u)
        s = fd.ops.mean(fd.ops.mul(xc, xc), dims=[1], keepdim=True)
        xn = fd.ops.div(xc, fd.ops.sqrt(fd.ops.add(s, 1e-6)))
        fd.add_output(fd.ops.add(fd.ops.mul(_bc(fd, w, 4, [1]), xn), _bc(fd, b, 4, [1])))
    rng = _rng("convnext_ln", shape)
    ins = [_randn(rng, shape, 1.5, 0.3), _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x, w, b = map(_d, ins)
    e = (slice(None), None, None)
    xn = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-6)
    _check(fd.execute(ins), [w[e] * xn + b[e]], (1e-4, 1e-4))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (1, 4, 13, 1)])
def test_gem_pooling(shape: Shape) -> None:
    """Generalized-mean pooling (image retrieval): ``mean(clamp(x, 1e-6) ** 3, (2, 3)) ** (1/3)``."""
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        pm = fd.ops.mean(fd.ops.pow(fd.ops.clamp(x, min=1e-6), 3.0), dims=[2, 3])
        fd.add_output(fd.ops.pow(pm, 1.0 / 3.0))
    x = _randn(_rng("gem", shape), shape, shift=0.5)
    x64 = np.maximum(_d(x), 1e-6)
    _check(fd.execute([x]), [((x64 ** 3).mean(axis=(2, 3))) ** (1 / 3)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 5, 4 * 16), (3, 7, 2 * 13)])
def test_qk_rmsnorm_on_reshaped_heads(shape: Shape) -> None:
    """Qwen3/OLMo2 QK-norm: the projection [B, S, H*D] viewed as [B, S, H, D], RMSNorm over D
    with a [D] weight, then ``transpose(1, 2)`` to [B, H, S, D]. Sizes (B, S, H*D); D is
    16 or 13 (or 1)."""
    b_, s_, hd = shape
    d = 16 if hd % 16 == 0 else (13 if hd % 13 == 0 else 1)
    with FusionDefinition() as fd:
        x, w = _t(fd, 3), _t(fd, 1)
        v = fd.ops.reshape(x, [fd.ops.size(x, 0), fd.ops.size(x, 1), -1, d])
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(v, v), dims=[3], keepdim=True), 1e-6))
        y = fd.ops.mul(fd.ops.mul(v, rstd), _bc(fd, w, 4, [3]))
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]))
    rng = _rng("qk_norm", shape)
    ins = [_randn(rng, shape), _randn(rng, (d,), 0.5, 1.0)]
    x, w = map(_d, ins)
    v = x.reshape(b_, s_, hd // d, d)
    want = (v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * w).transpose(0, 2, 1, 3)
    _check(fd.execute(ins), [want], (1e-5, 1e-5))


# ============================================================================ optimizers, AMP
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 65)])
def test_lamb_step_with_trust_ratio(shape: Shape) -> None:
    """LAMB at step 3: Adam moments, the update with weight decay, two full norms (of the
    parameter and of the update), the trust ratio (1 where either norm is 0), the step.
    Outputs p, m, v. The 1x1 case has a zero parameter (trust ratio 1)."""
    lr, b1, b2, eps, wd, step = 1e-2, 0.9, 0.999, 1e-6, 0.01, 3
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    with FusionDefinition() as fd:
        p, g, m, v = _t(fd, 2), _t(fd, 2), _t(fd, 2), _t(fd, 2)
        m2 = fd.ops.add(fd.ops.mul(m, b1), fd.ops.mul(g, 1 - b1))
        v2 = fd.ops.add(fd.ops.mul(v, b2), fd.ops.mul(fd.ops.mul(g, g), 1 - b2))
        upd = fd.ops.div(fd.ops.div(m2, bc1), fd.ops.add(fd.ops.sqrt(fd.ops.div(v2, bc2)), eps))
        upd = fd.ops.add(upd, fd.ops.mul(p, wd))
        wn = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(p, p), dims=[0, 1]))
        un = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(upd, upd), dims=[0, 1]))
        ratio = fd.ops.where(fd.ops.logical_and(fd.ops.gt(wn, 0.0), fd.ops.gt(un, 0.0)),
                             fd.ops.div(wn, un), 1.0)
        fd.add_output(fd.ops.sub(p, fd.ops.mul(fd.ops.mul(ratio, lr), upd)))
        fd.add_output(m2)
        fd.add_output(v2)
    rng = _rng("lamb", shape)
    ins = [_randn(rng, shape, 0.5), _randn(rng, shape, 0.1), _randn(rng, shape, 0.05),
           np.abs(_randn(rng, shape, 0.01))]
    if shape == (1, 1):
        ins[0] = np.zeros(shape, np.float32)
    p, g, m, v = map(_d, ins)
    m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    upd = (m2 / bc1) / (np.sqrt(v2 / bc2) + eps) + wd * p
    wn, un = np.linalg.norm(p), np.linalg.norm(upd)
    ratio = wn / un if wn > 0 and un > 0 else 1.0
    _check(fd.execute(ins), [p - lr * ratio * upd, m2, v2], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (16, 33)])
def test_ema_update_in_place(shape: Shape) -> None:
    """timm ModelEmaV2: ``ema.lerp_(param, 1 - decay)`` with a runtime decay, written into the
    EMA buffer in place (``alias_input``); nothing is returned."""
    with FusionDefinition() as fd:
        ema, p = _t(fd, 2), _t(fd, 2)
        decay = fd.define_scalar(dtype=F32)
        fd.add_output(fd.ops.lerp(ema, p, fd.ops.sub(1.0, decay)), alias_input=ema)
    rng = _rng("ema", shape)
    ema, p = _randn(rng, shape), _randn(rng, shape, 3.0)
    want = _d(ema) + (1 - 0.999) * (_d(p) - _d(ema))
    assert fd.execute([ema, p, 0.999]) == []
    _check([ema], [want], (1e-6, 1e-6))


@pytest.mark.parametrize("bad", ["none", "inf", "nan"])
@pytest.mark.parametrize("shape", [(1, 1), (130, 3)])
def test_amp_unscale_and_found_inf(shape: Shape, bad: str) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_``: ``g * inv_scale`` and a float flag
    that is 1 where any gradient is not finite."""
    with FusionDefinition() as fd:
        g = _t(fd, 2)
        inv = fd.define_scalar(dtype=F32)
        fd.add_output(fd.ops.mul(g, inv))
        found = fd.ops.max(fd.ops.logical_not(fd.ops.isfinite(g)), dims=[0, 1])
        fd.add_output(fd.ops.cast(found, F32))
    g = _randn(_rng("amp", shape), shape, 65536.0)
    if bad != "none":
        g[shape[0] // 2, shape[1] - 1] = np.inf if bad == "inf" else np.nan
    inv = 1.0 / 65536.0
    outs = fd.execute([g, inv])
    _check(outs, [_d(g) * inv, np.asarray(float(not np.isfinite(g).all()))], (1e-6, 0.0))


# ============================================================================ quantization
@pytest.mark.parametrize("shape", [(1, 1), (9, 31), (2, 3, 64)])
def test_int8_fake_quant_per_tensor(shape: Shape) -> None:
    """``torch.fake_quantize_per_tensor_affine(x, scale, zp, -128, 127)`` as its CPU kernel
    computes it: ``q = clamp(nearbyint(x * inv_scale) + zp)``, ``(q - zp) * scale``; outputs
    the dequantized values and q as int32. Runtime scale, 1/scale and zero point."""
    scale = float(np.float32(0.05))
    inv = float(np.float32(1.0) / np.float32(scale))
    zp = 3
    with FusionDefinition() as fd:
        x = _t(fd, len(shape))
        sc, isc = fd.define_scalar(dtype=F32), fd.define_scalar(dtype=F32)
        z = fd.define_scalar(dtype=DataType.Int)
        q = fd.ops.clamp(fd.ops.add(fd.ops.round(fd.ops.mul(x, isc)), z), -128, 127)
        fd.add_output(fd.ops.mul(fd.ops.sub(q, z), sc))
        fd.add_output(fd.ops.cast(q, DataType.Int32))
    x = _randn(_rng("fq_tensor", shape), shape, 3.0)
    q = np.clip(np.rint(x * np.float32(inv)).astype(np.float64) + zp, -128, 127)  # float32 product
    outs = fd.execute([x, scale, inv, zp])
    assert outs[1].dtype == np.int32
    np.testing.assert_array_equal(outs[1], q.astype(np.int32))
    _check(outs[:1], [(q - zp) * np.float64(np.float32(scale))], (1e-6, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1), (4, 37), (17, 64)])
def test_int8_absmax_per_channel_weight_quant(shape: Shape) -> None:
    """W8 symmetric per-output-channel quantization (LLM.int8/SmoothQuant style): ``scale =
    clamp(amax(|w|, 1), 1e-8) / 127``, ``q = clamp(round(w / scale), -127, 127)``; outputs
    q (int32), the dequantized weight and scale [O, 1]."""
    with FusionDefinition() as fd:
        w = _t(fd, 2)
        amax = fd.ops.max(fd.ops.abs(w), dims=[1], keepdim=True)
        scale = fd.ops.div(fd.ops.clamp(amax, min=1e-8), 127.0)
        q = fd.ops.clamp(fd.ops.round(fd.ops.div(w, scale)), -127.0, 127.0)
        fd.add_output(fd.ops.cast(q, DataType.Int32))
        fd.add_output(fd.ops.mul(q, scale))
        fd.add_output(scale)
    w = _randn(_rng("fq_channel", shape), shape, 0.05)
    # float32 arithmetic mirrored (IEEE division, exact max), so q must match exactly.
    sc = np.maximum(np.abs(w).max(1, keepdims=True), np.float32(1e-8)) / np.float32(127.0)
    q = np.clip(np.rint(w / sc), -127, 127)
    outs = fd.execute([w])
    np.testing.assert_array_equal(outs[0], q.astype(np.int32))
    _check(outs[1:], [_d(q) * _d(sc), _d(sc)], [(1e-6, 1e-9), (0.0, 0.0)])


# ============================================================================ attention, MoE
@pytest.mark.parametrize("tokens", [1, 257])
def test_moe_router_outputs_of_four_ranks(tokens: int) -> None:
    """An 8-expert MoE router with temperature 0.7: softmax probabilities [T, 8], the top-1
    probability [T], the per-expert mean probability [8] (load balancing) and the ST-MoE
    router z-loss ``mean(logsumexp(logits) ** 2)`` (0-d)."""
    with FusionDefinition() as fd:
        logits = _t(fd, 2)
        z = fd.ops.div(logits, 0.7)
        mx = fd.ops.max(z, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(z, mx))
        s = fd.ops.sum(e, dims=[1], keepdim=True)
        p = fd.ops.div(e, s)
        lse = fd.ops.add(fd.ops.log(s), mx)
        fd.add_output(p)
        fd.add_output(fd.ops.max(p, dims=[1]))
        fd.add_output(fd.ops.mean(p, dims=[0]))
        fd.add_output(fd.ops.mean(fd.ops.mul(lse, lse), dims=[0, 1]))
    logits = _randn(_rng("moe", (tokens,)), (tokens, 8), 2.0)
    z = _d(logits) / 0.7
    p = _softmax(z)
    want = [p, p.max(1), p.mean(0), np.asarray((_lse(z) ** 2).mean())]
    _check(fd.execute([logits]), want, (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 4, 7), (1, 3, 33)])
def test_alibi_bidirectional_softmax(shape: Shape) -> None:
    """ALiBi for an encoder: ``softmax(scores / sqrt(d) - slope[h] * |i - j|)`` with the
    distances built from ``iota`` of the runtime key length and per-head slopes [H]."""
    b, h, s = shape
    with FusionDefinition() as fd:
        scores, slopes = _t(fd, 4), _t(fd, 1)
        n = fd.ops.size(scores, 3)
        i, j = fd.ops.iota(n), fd.ops.iota(n)
        dist = fd.ops.cast(fd.ops.abs(fd.ops.sub(_bc(fd, i, 2, [0]), _bc(fd, j, 2, [1]))), F32)
        bias = fd.ops.mul(_bc(fd, slopes, 4, [1]), fd.ops.neg(_bc(fd, dist, 4, [2, 3])))
        fd.add_output(_softmax_fd(fd, fd.ops.add(fd.ops.mul(scores, 0.125), bias), 3))
    rng = _rng("alibi", shape)
    slopes = np.array([2.0 ** (-8 * (k + 1) / h) for k in range(h)], np.float32)
    ins = [_randn(rng, (b, h, s, s), 3.0), slopes]
    sc, sl = map(_d, ins)
    ar = np.arange(s)
    dist = np.abs(ar[:, None] - ar[None, :])
    want = _softmax(sc * 0.125 - sl[None, :, None, None] * dist)
    _check(fd.execute(ins), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 5), (1, 2, 3, 11)])
def test_causal_softmax_from_iota_with_kv_offset(shape: Shape) -> None:
    """Decoder attention with a KV cache: scores [B, H, Sq, Sk], query positions
    ``iota(Sq, start=Sk - Sq)``, ``masked_fill(q_pos < k_pos, -inf)`` after the 1/sqrt(d)
    scale, softmax over keys."""
    b, h, sq, sk = shape
    with FusionDefinition() as fd:
        scores = _t(fd, 4)
        nq, nk = fd.ops.size(scores, 2), fd.ops.size(scores, 3)
        qpos = fd.ops.iota(nq, start=fd.ops.sub(nk, nq))
        kpos = fd.ops.iota(nk)
        allowed = fd.ops.ge(_bc(fd, qpos, 2, [0]), _bc(fd, kpos, 2, [1]))
        w = fd.ops.where(_bc(fd, allowed, 4, [2, 3]), fd.ops.mul(scores, 1 / math.sqrt(32)), float("-inf"))
        fd.add_output(_softmax_fd(fd, w, 3))
    x = _randn(_rng("causal_iota", shape), shape, 3.0)
    allowed = (np.arange(sq)[:, None] + (sk - sq)) >= np.arange(sk)[None, :]
    want = _softmax(np.where(allowed, _d(x) / math.sqrt(32), -np.inf))
    _check(fd.execute([x]), [want], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (3, 2, 17)])
def test_t5_position_bias_and_padding_softmax(shape: Shape) -> None:
    """T5 attention weights: ``softmax(scores + position_bias + extended_mask)`` (no scaling),
    the position bias a [1, H, S, S] input declared with its broadcast batch axis, the padding
    mask [B, S] turned into ``(1 - mask) * finfo.min``."""
    b, h, s = shape
    with FusionDefinition() as fd:
        scores = _t(fd, 4)
        pos = fd.define_tensor([1, -1, -1, -1], F32)
        mask = _t(fd, 2)
        ext = _bc(fd, fd.ops.mul(fd.ops.sub(1.0, mask), F32_MIN), 4, [0, 3])
        fd.add_output(_softmax_fd(fd, fd.ops.add(fd.ops.add(scores, pos), ext), 3))
    rng = _rng("t5", shape)
    lengths = rng.integers(1, s + 1, size=b)
    mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.float32)
    ins = [_randn(rng, (b, h, s, s), 2.0), _randn(rng, (1, h, s, s), 2.0), mask]
    sc, pos, mk = map(_d, ins)
    ext = ((1.0 - mk) * F32_MIN)[:, None, None, :]
    _check(fd.execute(ins), [_softmax(sc + pos + ext)], (1e-5, 1e-7))


# ============================================================================ losses
@pytest.mark.parametrize("shape", [(1, 1), (13, 33), (4, 1000)])
def test_label_smoothing_cross_entropy_forward_and_backward(shape: Shape) -> None:
    """``F.cross_entropy(x, t, label_smoothing=0.1)``: per-row loss ``lse - 0.9 x[t] - 0.1
    mean(x)`` [B] and the logits' gradient of the mean loss ``(softmax - (0.9 onehot +
    0.1 / V)) / B``; the one-hot from ``iota(V) == t``."""
    bsz, v = shape
    eps = 0.1
    with FusionDefinition() as fd:
        x, t = _t(fd, 2), _t(fd, 1, DataType.Int)
        cols = fd.ops.iota(fd.ops.size(x, 1))
        onehot = fd.ops.eq(_bc(fd, cols, 2, [1]), _bc(fd, t, 2, [0]))
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, mx))
        s = fd.ops.sum(e, dims=[1], keepdim=True)
        lse = fd.ops.squeeze(fd.ops.add(fd.ops.log(s), mx), dims=[1])
        picked = fd.ops.sum(fd.ops.where(onehot, x, 0.0), dims=[1])
        loss = fd.ops.sub(fd.ops.sub(lse, fd.ops.mul(picked, 1 - eps)),
                          fd.ops.mul(fd.ops.mean(x, dims=[1]), eps))
        target = fd.ops.add(fd.ops.mul(fd.ops.cast(onehot, F32), 1 - eps), eps / v)
        fd.add_output(loss)
        fd.add_output(fd.ops.div(fd.ops.sub(fd.ops.div(e, s), target), float(bsz)))
    rng = _rng("ls_ce", shape)
    x, t = _randn(rng, shape, 2.0), rng.integers(0, v, size=bsz).astype(np.int64)
    x64 = _d(x)
    onehot = np.arange(v)[None, :] == t[:, None]
    loss = _lse(x64) - (1 - eps) * x64[np.arange(bsz), t] - eps * x64.mean(1)
    grad = (_softmax(x64) - ((1 - eps) * onehot + eps / v)) / bsz
    _check(fd.execute([x, t]), [loss, grad], [(1e-5, 1e-5), (1e-5, 1e-7)])


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (30, 65)])
def test_bce_with_logits_pos_weight_mean(shape: Shape) -> None:
    """``F.binary_cross_entropy_with_logits(x, y, pos_weight=pw)`` with its stable formula
    ``(1 - y) x + (1 + (pw - 1) y) (log1p(exp(-|x|)) + max(-x, 0))``, mean over all; logits
    up to +-40 where a naive formula overflows."""
    with FusionDefinition() as fd:
        x, y, pw = _t(fd, 2), _t(fd, 2), _t(fd, 1)
        lw = fd.ops.add(fd.ops.mul(fd.ops.sub(_bc(fd, pw, 2, [1]), 1.0), y), 1.0)
        soft = fd.ops.add(fd.ops.log1p(fd.ops.exp(fd.ops.neg(fd.ops.abs(x)))), fd.ops.relu(fd.ops.neg(x)))
        loss = fd.ops.add(fd.ops.mul(fd.ops.sub(1.0, y), x), fd.ops.mul(lw, soft))
        fd.add_output(fd.ops.mean(loss, dims=[0, 1]))
    rng = _rng("bce", shape)
    x = _randn(rng, shape, 4.0)
    x.flat[:: 5] = 40.0 * np.sign(x.flat[:: 5])
    ins = [x, (rng.uniform(size=shape) < 0.3).astype(np.float32),
           rng.uniform(0.5, 3.0, shape[1]).astype(np.float32)]
    x64, y, pw = map(_d, ins)
    lw = 1 + (pw - 1) * y
    want = ((1 - y) * x64 + lw * (np.log1p(np.exp(-np.abs(x64))) + np.maximum(-x64, 0))).mean()
    _check(fd.execute(ins), [np.asarray(want)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (16, 257)])
def test_kl_distillation_loss(shape: Shape) -> None:
    """Knowledge distillation: ``KL(softmax(t/T) || softmax(s/T)) * T^2`` with
    ``reduction='batchmean'``, T = 2: two log-softmaxes of the same rows; outputs the
    per-row KL [B] and the loss (0-d)."""
    bsz, _ = shape
    temp = 2.0
    with FusionDefinition() as fd:
        s, t = _t(fd, 2), _t(fd, 2)

        def log_softmax(z: Any) -> Any:
            z = fd.ops.div(z, temp)
            return fd.ops.sub(z, fd.ops.logsumexp(z, dims=[1], keepdim=True))
        ls, lt = log_softmax(s), log_softmax(t)
        row = fd.ops.sum(fd.ops.mul(fd.ops.exp(lt), fd.ops.sub(lt, ls)), dims=[1])
        fd.add_output(row)
        fd.add_output(fd.ops.mul(fd.ops.sum(row, dims=[0]), temp * temp / bsz))
    rng = _rng("kd", shape)
    ins = [_randn(rng, shape, 3.0), _randn(rng, shape, 3.0)]
    s, t = (_d(a) / temp for a in ins)
    ls, lt = s - _lse(s, keepdims=True), t - _lse(t, keepdims=True)
    row = (np.exp(lt) * (lt - ls)).sum(1)
    _check(fd.execute(ins), [row, np.asarray(row.sum() * temp * temp / bsz)], (1e-4, 1e-5))


# ============================================================================ reductions
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 33, 1)])
def test_logsumexp_over_the_middle_axis(shape: Shape) -> None:
    """``torch.logsumexp(x, 1)`` [A, C] and ``log_softmax(x, 1)`` from the keepdim logsumexp."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        fd.add_output(fd.ops.logsumexp(x, dims=[1]))
        fd.add_output(fd.ops.sub(x, fd.ops.logsumexp(x, dims=[1], keepdim=True)))
    x = _randn(_rng("lse_mid", shape), shape, 4.0)
    x64 = _d(x)
    _check(fd.execute([x]), [_lse(x64, 1), x64 - _lse(x64, 1, keepdims=True)], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(2, 1, 3), (3, 5, 7), (4, 9, 1)])
def test_var_mean_over_axes_0_and_2(shape: Shape) -> None:
    """``torch.var_mean(x, dim=(0, 2))`` (unbiased) on [A, B, C], ``x.mean((0, 2))`` and the
    standard deviation: reductions over two non-adjacent axes."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        var, mean = fd.ops.var_mean(x, dims=[0, 2], correction=1)
        fd.add_output(var)
        fd.add_output(mean)
        fd.add_output(fd.ops.mean(x, dims=[0, 2]))
        fd.add_output(fd.ops.sqrt(var))
    x = _randn(_rng("var_mean02", shape), shape, 2.0, 10.0)
    x64 = _d(x)
    var, mean = x64.var(axis=(0, 2), ddof=1), x64.mean(axis=(0, 2))
    _check(fd.execute([x]), [var, mean, mean, np.sqrt(var)], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 5), (7, 13), (130, 3)])
def test_minmax_feature_scaling_keepdim(shape: Shape) -> None:
    """Per-feature min-max scaling: keepdim ``min``/``max`` over rows broadcast back, and the
    column mean of the result (a size-one batch scales to 0)."""
    with FusionDefinition() as fd:
        x = _t(fd, 2)
        lo = fd.ops.min(x, dims=[0], keepdim=True)
        hi = fd.ops.max(x, dims=[0], keepdim=True)
        y = fd.ops.div(fd.ops.sub(x, lo), fd.ops.add(fd.ops.sub(hi, lo), 1e-6))
        fd.add_output(y)
        fd.add_output(fd.ops.mean(y, dims=[0], keepdim=True))
    x = _randn(_rng("minmax", shape), shape, 3.0)
    x64 = _d(x)
    lo, hi = x64.min(0, keepdims=True), x64.max(0, keepdims=True)
    y = (x64 - lo) / (hi - lo + 1e-6)
    _check(fd.execute([x]), [y, y.mean(0, keepdims=True)], (1e-5, 1e-6))


# ============================================================================ pointwise
@pytest.mark.parametrize("shape", [(1,), (8, 33), (3, 1, 129)])
def test_mish_with_softplus_threshold(shape: Shape) -> None:
    """Mish ``x * tanh(softplus(x))`` with softplus's threshold (``x`` itself above 20), on
    values up to +-100 where ``exp`` overflows float32."""
    with FusionDefinition() as fd:
        x = _t(fd, len(shape))
        sp = fd.ops.where(fd.ops.gt(x, 20.0), x, fd.ops.log1p(fd.ops.exp(x)))
        fd.add_output(fd.ops.mul(x, fd.ops.tanh(sp)))
    x = _randn(_rng("mish", shape), shape, 4.0)
    x.flat[::7] = 100.0 * np.sign(x.flat[::7])
    x64 = _d(x)
    with np.errstate(over="ignore"):
        sp = np.where(x64 > 20, x64, np.log1p(np.exp(x64)))
    _check(fd.execute([x]), [x64 * np.tanh(sp)], (1e-5, 1e-6))


# ============================================================================ strided inputs
@pytest.mark.parametrize("layout", ["transposed", "stepped", "fortran", "weight_stepped"])
@pytest.mark.parametrize("shape", [(1, 33), (40, 3)])
def test_layernorm_affine_on_strided_views(shape: Shape, layout: str) -> None:
    """nn.LayerNorm over the last axis of [M, N] given NumPy views that are not row-major:
    a transpose, a ``[:, ::2]`` slice, a Fortran-ordered copy, a ``[::3]`` weight."""
    m, n = shape
    with FusionDefinition() as fd:
        x, w, b = _t(fd, 2), _t(fd, 1), _t(fd, 1)
        var, mean = fd.ops.var_mean(x, dims=[1], correction=0, keepdim=True)
        xn = fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(fd.ops.add(fd.ops.mul(xn, _bc(fd, w, 2, [1])), _bc(fd, b, 2, [1])))
    rng = _rng(f"ln_{layout}", shape)
    x = {"transposed": lambda: _randn(rng, (n, m), shift=0.5).T,
         "stepped": lambda: _randn(rng, (m, 2 * n), shift=0.5)[:, ::2],
         "fortran": lambda: np.asfortranarray(_randn(rng, (m, n), shift=0.5)),
         "weight_stepped": lambda: _randn(rng, (m, n), shift=0.5)}[layout]()
    w = _randn(rng, (3 * n,), 0.5, 1.0)[::3] if layout == "weight_stepped" else _randn(rng, (n,), 0.5, 1.0)
    b = _randn(rng, (n,))
    if layout != "weight_stepped":
        assert not x.flags.c_contiguous or m == 1 or n == 1
    x64, w64, b64 = map(_d, (x, w, b))
    mu = x64.mean(1, keepdims=True)
    want = (x64 - mu) / np.sqrt(x64.var(1, keepdims=True) + 1e-5) * w64 + b64
    _check(fd.execute([x, w, b]), [want], (1e-5, 1e-5))


@pytest.mark.parametrize("layout", ["heads_transposed", "keys_stepped"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 5), (1, 4, 17)])
def test_attention_softmax_on_strided_scores(shape: Shape, layout: str) -> None:
    """Attention probabilities of scores [B, H, S, S] that are a view: ``[B, S, H, S]``
    transposed (1, 2), or every other key of a [B, H, S, 2S] buffer."""
    b, h, s = shape
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        fd.add_output(_softmax_fd(fd, fd.ops.mul(x, 0.25), 3))
    rng = _rng(f"attn_{layout}", shape)
    if layout == "heads_transposed":
        x = _randn(rng, (b, s, h, s), 3.0).transpose(0, 2, 1, 3)
    else:
        x = _randn(rng, (b, h, s, 2 * s), 3.0)[..., ::2]
    _check(fd.execute([x]), [_softmax(_d(x) * 0.25)], (1e-5, 1e-7))


# ============================================================================ half, bfloat16
@pytest.mark.parametrize("shape", [(1, 1), (6, 50), (37, 129)])
def test_half_logits_cross_entropy(shape: Shape) -> None:
    """Cross-entropy of fp16 logits computed in float (``logits.float()``): per-row loss [B]
    (float) and its mean; the label's logit picked with ``iota(V) == label``."""
    bsz, _ = shape
    with FusionDefinition() as fd:
        xh, t = _t(fd, 2, DataType.Half), _t(fd, 1, DataType.Int)
        x = fd.ops.cast(xh, F32)
        onehot = fd.ops.eq(_bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 2, [1]), _bc(fd, t, 2, [0]))
        nll = fd.ops.sub(fd.ops.logsumexp(x, dims=[1]), fd.ops.sum(fd.ops.where(onehot, x, 0.0), dims=[1]))
        fd.add_output(nll)
        fd.add_output(fd.ops.mean(nll, dims=[0]))
    rng = _rng("half_ce", shape)
    x = _randn(rng, shape, 4.0, dtype=np.float16)
    t = rng.integers(0, shape[1], size=bsz).astype(np.int64)
    x64 = _d(x)  # the rounded half values
    nll = _lse(x64) - x64[np.arange(bsz), t]
    _check(fd.execute([x, t]), [nll, np.asarray(nll.mean())], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1), (9, 31), (64, 128)])
def test_half_bias_gelu_residual(shape: Shape) -> None:
    """A transformer MLP epilogue in fp16: ``residual + gelu_tanh(x + bias)`` computed in float
    from half inputs, stored as half."""
    n = shape[1]
    h = DataType.Half
    with FusionDefinition() as fd:
        x, b, r = _t(fd, 2, h), _t(fd, 1, h), _t(fd, 2, h)
        u = fd.ops.add(fd.ops.cast(x, F32), _bc(fd, fd.ops.cast(b, F32), 2, [1]))
        inner = fd.ops.mul(fd.ops.add(u, fd.ops.mul(fd.ops.mul(fd.ops.mul(u, u), u), 0.044715)),
                           math.sqrt(2 / math.pi))
        g = fd.ops.mul(fd.ops.mul(u, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))
        fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.cast(r, F32), g), h))
    rng = _rng("half_gelu", shape)
    ins = [_randn(rng, shape, 2.0, dtype=np.float16), _randn(rng, (n,), dtype=np.float16),
           _randn(rng, shape, dtype=np.float16)]
    x, b, r = map(_d, ins)
    u = x + b
    want = r + 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    outs = fd.execute(ins)
    assert outs[0].dtype == np.float16
    _check(outs, [want], (2e-3, 2e-3))


@pytest.mark.parametrize("shape", [(1, 1), (5, 97), (16, 256)])
def test_bf16_rmsnorm_gemma(shape: Shape) -> None:
    """Gemma's RMSNorm on bfloat16 activations and weight: ``x.float() * rsqrt(mean(x^2) +
    eps) * (1 + w.float())``, cast back to bf16. The bf16 tensors are made by casts of float
    inputs in the fusion; the reference uses the same rounded values."""
    bf = DataType.BFloat16
    with FusionDefinition() as fd:
        x32, w32 = _t(fd, 2), _t(fd, 1)
        x = fd.ops.cast(fd.ops.cast(x32, bf), F32)
        w = fd.ops.cast(fd.ops.cast(w32, bf), F32)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(x, x), dims=[1], keepdim=True), 1e-6))
        y = fd.ops.mul(fd.ops.mul(x, rstd), _bc(fd, fd.ops.add(w, 1.0), 2, [1]))
        fd.add_output(fd.ops.cast(y, bf))
    rng = _rng("bf16_rms", shape)
    ins = [_randn(rng, shape, 2.0), _randn(rng, (shape[1],), 0.3)]
    x, w = (_bf16_round(a).astype(np.float64) for a in ins)
    want = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * (1 + w)
    outs = fd.execute(ins)
    assert outs[0].dtype.itemsize == 2
    _check(outs, [want], (1e-2, 1e-2))


# ============================================================================ positions, shifts
@pytest.mark.parametrize("shape", [(1, 2), (3, 130)])
def test_diffusion_timestep_embedding(shape: Shape) -> None:
    """The sinusoidal timestep embedding of diffusion UNets: ``freqs = exp(-ln(10000) *
    arange(half) / half)`` from ``iota``, ``args = t[:, None] * freqs``, ``cat([cos(args),
    sin(args)], -1)``; timesteps [B] are int64. Sizes (B, dim)."""
    bsz, dim = shape
    half = dim // 2
    with FusionDefinition() as fd:
        t = _t(fd, 1, DataType.Int)
        k = fd.ops.iota(half, dtype=F32)
        freqs = fd.ops.exp(fd.ops.mul(k, -math.log(10000.0) / half))
        args = fd.ops.mul(_bc(fd, fd.ops.cast(t, F32), 2, [0]), _bc(fd, freqs, 2, [1]))
        fd.add_output(fd.ops.cat([fd.ops.cos(args), fd.ops.sin(args)], dim=1))
    ts = _rng("timestep", shape).integers(0, 1000, size=bsz).astype(np.int64)
    # float32 angles as the model computes them; then the reference in float64.
    freqs = np.exp(np.arange(half, dtype=np.float32) * np.float32(-math.log(10000.0) / half))
    args = (ts.astype(np.float32)[:, None] * freqs[None, :]).astype(np.float64)
    want = np.concatenate([np.cos(args), np.sin(args)], axis=1)
    # An angle near 1000 rad has a float32 ulp of 6e-5: the float32 exp of the frequencies
    # (1 ulp apart between libms) moves it by that much.
    _check(fd.execute([ts]), [want], (1e-4, 2e-4))


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 7, 34)])
def test_rope_with_angles_from_iota_and_cache_offset(shape: Shape) -> None:
    """HF LLaMA rotary embedding with the angles computed in the fusion: ``inv_freq =
    10000^(-2i/D)``, positions ``iota(S, start=past)`` with a runtime cache length, ``emb =
    cat(freqs, freqs)``, ``q * cos + rotate_half(q) * sin`` on [B, S, D] (``rotate_half =
    cat(-q[..., D/2:], q[..., :D/2])``)."""
    b_, s_, d = shape
    h = d // 2
    with FusionDefinition() as fd:
        q = _t(fd, 3)
        past = fd.define_scalar(dtype=DataType.Int)
        pos = fd.ops.cast(fd.ops.iota(fd.ops.size(q, 1), start=past), F32)
        inv = fd.ops.exp(fd.ops.mul(fd.ops.iota(h, dtype=F32), -2.0 * math.log(10000.0) / d))
        fr = fd.ops.mul(_bc(fd, pos, 2, [0]), _bc(fd, inv, 2, [1]))
        emb = _bc(fd, fd.ops.cat([fr, fr], dim=1), 3, [1, 2])
        rot = fd.ops.cat([fd.ops.neg(fd.ops.slice(q, [0, 0, h], [b_, s_, d])),
                          fd.ops.slice(q, [0, 0, 0], [b_, s_, h])], dim=2)
        fd.add_output(fd.ops.add(fd.ops.mul(q, fd.ops.cos(emb)), fd.ops.mul(rot, fd.ops.sin(emb))))
    q = _randn(_rng("rope_iota", shape), shape)
    past = 5
    inv = np.exp(np.arange(h, dtype=np.float32) * np.float32(-2.0 * math.log(10000.0) / d))
    fr = (np.arange(past, past + s_, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
    emb = np.concatenate([fr, fr], axis=1)
    q64 = _d(q)
    rot = np.concatenate([-q64[..., h:], q64[..., :h]], axis=-1)
    _check(fd.execute([q, past]), [q64 * np.cos(emb) + rot * np.sin(emb)], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (3, 17, 4)])
def test_rwkv_token_shift_mix(shape: Shape) -> None:
    """RWKV's time mixing input: ``xx = ZeroPad2d((0, 0, 1, -1))(x)`` (the previous token,
    zero at t = 0, written as a pad that crops the last step) and ``x * mix + xx * (1 - mix)``
    with a per-channel mix [C]; x is [B, T, C]."""
    with FusionDefinition() as fd:
        x, mix = _t(fd, 3), _t(fd, 1)
        xx = fd.ops.pad(x, [0, 0, 1, -1])
        mb = _bc(fd, mix, 3, [2])
        fd.add_output(fd.ops.add(fd.ops.mul(x, mb), fd.ops.mul(xx, fd.ops.sub(1.0, mb))))
    rng = _rng("rwkv", shape)
    ins = [_randn(rng, shape), rng.uniform(0, 1, shape[2]).astype(np.float32)]
    x, mix = map(_d, ins)
    xx = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    _check(fd.execute(ins), [x * mix + xx * (1 - mix)], (1e-6, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 9)])
def test_mamba_causal_depthwise_conv1d_silu(shape: Shape) -> None:
    """Mamba's short causal conv (kernel 4, depthwise) on [B, D, L] written with a left pad of
    3 and four shifted slices weighted by the columns of w [D, 4], plus a bias, then SiLU."""
    b_, d, ln = shape
    k = 4
    with FusionDefinition() as fd:
        x, w, bias = _t(fd, 3), _t(fd, 2), _t(fd, 1)
        xp = fd.ops.pad(x, [k - 1, 0])
        acc = _bc(fd, bias, 3, [1])
        for j in range(k):
            tap = fd.ops.slice(xp, [0, 0, j], [b_, d, j + ln])
            acc = fd.ops.add(acc, fd.ops.mul(tap, _bc(fd, fd.ops.select(w, 1, j), 3, [1])))
        fd.add_output(fd.ops.mul(acc, fd.ops.sigmoid(acc)))
    rng = _rng("mamba_conv", shape)
    ins = [_randn(rng, shape), _randn(rng, (d, k), 0.5), _randn(rng, (d,), 0.1)]
    x, w, bias = map(_d, ins)
    xp = np.concatenate([np.zeros((b_, d, k - 1)), x], axis=2)
    y = bias[None, :, None] + sum(xp[:, :, j:j + ln] * w[None, :, j, None] for j in range(k))
    _check(fd.execute(ins), [y / (1 + np.exp(-y))], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (6, 11), (33, 257)])
def test_nll_with_gather_and_focal_weight(shape: Shape) -> None:
    """Focal loss (RetinaNet-style multiclass): ``logp = log_softmax(x)``, the label's
    ``logp.gather(1, t[:, None])``, ``-(1 - p_t) ** 2.5 * logp_t``; outputs [B, 1] and the
    mean."""
    bsz, v = shape
    with FusionDefinition() as fd:
        x, t = _t(fd, 2), fd.define_tensor([-1, 1], DataType.Int)
        logp = fd.ops.sub(x, fd.ops.logsumexp(x, dims=[1], keepdim=True))
        lpt = fd.ops.gather(logp, t, 1)
        loss = fd.ops.neg(fd.ops.mul(fd.ops.pow(fd.ops.sub(1.0, fd.ops.exp(lpt)), 2.5), lpt))
        fd.add_output(loss)
        fd.add_output(fd.ops.mean(loss, dims=[0, 1]))
    rng = _rng("focal", shape)
    x, t = _randn(rng, shape, 2.0), rng.integers(0, v, size=(bsz, 1)).astype(np.int64)
    x64 = _d(x)
    lpt = np.take_along_axis(x64 - _lse(x64, keepdims=True), t, axis=1)
    loss = -((1 - np.exp(lpt)) ** 2.5) * lpt
    _check(fd.execute([x, t]), [loss, np.asarray(loss.mean())], (1e-4, 1e-6))
