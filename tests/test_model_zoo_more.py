"""Still more fusions written the way model code writes them, none of them in
``tests/test_model_zoo.py``, ``tests/test_model_zoo_extra.py`` or ``tests/families.py``:
reductions over non-last and several axes (PointNet, CBAM, weight norm, BatchNorm2d training
with its running statistics updated in place, InstanceNorm from ``welford``, LayerNorm over
two axes, Conv-TasNet's global LayerNorm), reductions of reductions, fusions with outputs
of several ranks, mixed dtypes (bfloat16 and fp16 in, float math, bfloat16, fp16 or int
out; int64, int32 and bool inputs), runtime scalars (eps, momentum, learning rates,
windows, shifts), size-one axes ([B, 1], [1, K], [O, 1, 1] and [1, 1, S, R] inputs),
strided NumPy views, gathers at indices computed in the fusion (T5's relative position
buckets, NT-Xent's positives, Swin's cyclic shift, clamped positions, ignore_index),
attention masks from ``iota`` (Longformer, packed sequences, block-local), -inf masks with
fully masked rows, ``pad``/``slice``/``cat`` combinations, optimizers that write their
state in place (Adafactor, AdamW-amsgrad, RMSprop, gradient-norm clipping), losses,
activation backwards and quantization round trips; a few rows are longer than 32768
elements.

Each runs through the automatic schedule in the CPU interpreter (``fd.execute`` on NumPy
inputs) and is checked against a float64 NumPy reference computed from the exact input
values (bfloat16 arrays through ml_dtypes).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

import numpy as np
import pytest
from kiln import DataType, FusionDefinition
from test_model_zoo import F32, F32_MIN, Shape, _bc, _check, _d, _lse, _randn, _softmax, _t

try:
    import ml_dtypes

    BF16_NP: Any = ml_dtypes.bfloat16
except ImportError:  # bfloat16 NumPy arrays need ml_dtypes
    BF16_NP = None

needs_bf16 = pytest.mark.skipif(BF16_NP is None, reason="bfloat16 NumPy arrays need ml_dtypes")

F16 = DataType.Half
BF = DataType.BFloat16
I64 = DataType.Int
I32 = DataType.Int32
DBL = DataType.Double
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers
def _rng(name: str, shape: Sequence[int]) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"more-{name}{tuple(shape)}".encode()))


def _softmax_fd(fd: FusionDefinition, w: Any, axis: int) -> Any:
    mx = fd.ops.max(w, dims=[axis], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(w, mx))
    return fd.ops.div(e, fd.ops.sum(e, dims=[axis], keepdim=True))


def _softmax_nan(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax in float64 with PyTorch's answer for a row of -inf only: NaN."""
    with np.errstate(invalid="ignore"):
        return _softmax(x, axis)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _col(fd: FusionDefinition, t: Any) -> Any:
    """A 1-D tensor [N] as a column [N, 1] (``t[:, None]``)."""
    return fd.ops.broadcast_in_dim(t, [-1, 1], [0])


# ============================================================================ reductions
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (3, 4, 1000)])
def test_pointnet_global_max_pool_and_its_batch_statistics(shape: Shape) -> None:
    """PointNet's symmetric function on conv features [B, C, N] seen as [B, N, C] (a
    transposed view): ``x.max(1)`` over the points, a non-last axis, gives the global
    feature [B, C]; also its batch mean [C] and per-cloud mean [B] (reductions of a
    reduction) and the mean over clouds of ``x.amax((1, 2))`` (0-d). Sizes (B, C, N)."""
    b, c, n = shape
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        g = fd.ops.max(x, dims=[1])
        fd.add_output(g)
        fd.add_output(fd.ops.mean(g, dims=[0]))
        fd.add_output(fd.ops.mean(g, dims=[1]))
        fd.add_output(fd.ops.mean(fd.ops.max(x, dims=[1, 2]), dims=[0]))
    x = _randn(_rng("pointnet", shape), (b, c, n), 2.0).transpose(0, 2, 1)
    x64 = _d(x)
    g = x64.max(1)
    _check(fd.execute([x]), [g, g.mean(0), g.mean(1), np.asarray(x64.max((1, 2)).mean())], (1e-6, 1e-6))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 5, 3, 7), (1, 64, 4, 9)])
def test_cbam_spatial_attention_from_channel_pools(shape: Shape, layout: str) -> None:
    """CBAM's spatial attention on NCHW: ``x.mean(1, keepdim=True)`` and ``x.amax(1,
    keepdim=True)`` (reductions over the channel axis kept as [N, 1, H, W]), ``cat`` of the
    two on axis 1, a 1x1 conv to one channel (a weight [2], summed over the concatenated
    axis, plus a runtime float bias), ``x * sigmoid(.)``; outputs the pooled map [N, 2, H, W]
    and the gated x. x row-major or channels_last."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        x, wt = _t(fd, 4), _t(fd, 1)
        bias = fd.define_scalar(dtype=F32)
        pooled = fd.ops.cat([fd.ops.mean(x, dims=[1], keepdim=True), fd.ops.max(x, dims=[1], keepdim=True)],
                            dim=1)
        logit = fd.ops.add(fd.ops.sum(fd.ops.mul(pooled, _bc(fd, wt, 4, [1])), dims=[1], keepdim=True), bias)
        fd.add_output(pooled)
        fd.add_output(fd.ops.mul(x, fd.ops.sigmoid(logit)))
    rng = _rng(f"cbam_{layout}", shape)
    x = _randn(rng, shape, 1.5) if layout == "nchw" else _randn(rng, (n, h, w, c), 1.5).transpose(0, 3, 1, 2)
    wt = np.array([0.8, -0.6], np.float32)
    x64 = _d(x)
    pooled = np.concatenate([x64.mean(1, keepdims=True), x64.max(1, keepdims=True)], axis=1)
    logit = (pooled * _d(wt)[None, :, None, None]).sum(1, keepdims=True) + 0.25
    _check(fd.execute([x, wt, 0.25]), [pooled, x64 * _sigmoid(logit)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 3, 5), (33, 7, 3)])
def test_weight_norm_over_trailing_axes(shape: Shape) -> None:
    """``torch.nn.utils.weight_norm`` of a Conv1d (``_weight_norm(v, g, dim=0)``): ``w = v *
    (g / ||v||)`` with the norm over axes (1, 2) kept as [O, 1, 1] and ``g`` an [O, 1, 1]
    input declared with its size-one axes; outputs w and the norm."""
    with FusionDefinition() as fd:
        v, g = _t(fd, 3), fd.define_tensor([-1, 1, 1], F32)
        nrm = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(v, v), dims=[1, 2], keepdim=True))
        fd.add_output(fd.ops.mul(v, fd.ops.div(g, nrm)))
        fd.add_output(nrm)
    rng = _rng("weight_norm", shape)
    ins = [_randn(rng, shape, 0.3), _randn(rng, (shape[0], 1, 1), 0.5, 1.0)]
    v, g = map(_d, ins)
    nrm = np.sqrt((v * v).sum((1, 2), keepdims=True))
    _check(fd.execute(ins), [v * (g / nrm), nrm], (1e-5, 1e-7))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (4, 5, 3, 7), (1, 16, 5, 9)])
def test_batchnorm2d_training_forward_with_in_place_running_stats(shape: Shape, layout: str) -> None:
    """BatchNorm2d in training mode: the batch mean and biased variance over (0, 2, 3)
    (``var_mean``, correction 0) normalize; the running statistics are updated in place
    (``alias_input``) from the mean and the unbiased variance (``var``, correction 1):
    ``running = (1 - momentum) * running + momentum * stat`` with a runtime momentum;
    returns y, save_mean and save_invstd [C]."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        x, wt, b, rm, rv = _t(fd, 4), _t(fd, 1), _t(fd, 1), _t(fd, 1), _t(fd, 1)
        mom = fd.define_scalar(dtype=DBL)
        var, mean = fd.ops.var_mean(x, dims=[0, 2, 3], correction=0)
        unbiased = fd.ops.var(x, dims=[0, 2, 3], correction=1)
        invstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        xhat = fd.ops.mul(fd.ops.sub(x, _bc(fd, mean, 4, [1])), _bc(fd, invstd, 4, [1]))
        fd.add_output(fd.ops.add(fd.ops.mul(xhat, _bc(fd, wt, 4, [1])), _bc(fd, b, 4, [1])))
        fd.add_output(mean)
        fd.add_output(invstd)
        keep = fd.ops.sub(1.0, mom)
        fd.add_output(fd.ops.add(fd.ops.mul(rm, keep), fd.ops.mul(mean, mom)), alias_input=rm)
        fd.add_output(fd.ops.add(fd.ops.mul(rv, keep), fd.ops.mul(unbiased, mom)), alias_input=rv)
    rng = _rng(f"bn2d_train_{layout}", shape)
    x = (_randn(rng, shape, 2.0, 0.5) if layout == "nchw"
         else _randn(rng, (n, h, w, c), 2.0, 0.5).transpose(0, 3, 1, 2))
    wt, b = _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))
    rm, rv = _randn(rng, (c,), 0.2), rng.uniform(0.5, 2.0, c).astype(np.float32)
    x64, w64, b64, rm64, rv64 = map(_d, (x, wt, b, rm, rv))
    mean, var = x64.mean((0, 2, 3)), x64.var((0, 2, 3))
    invstd = 1 / np.sqrt(var + 1e-5)
    e = (None, slice(None), None, None)
    y = (x64 - mean[e]) * invstd[e] * w64[e] + b64[e]
    outs = fd.execute([x, wt, b, rm, rv, 0.1])
    _check(outs, [y, mean, invstd], (1e-5, 1e-5))
    _check([rm, rv], [0.9 * rm64 + 0.1 * mean, 0.9 * rv64 + 0.1 * x64.var((0, 2, 3), ddof=1)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (3, 4, 16, 9)])
def test_instance_norm_2d_affine_from_welford(shape: Shape) -> None:
    """InstanceNorm2d(affine=True) from ``welford`` over (2, 3): ``var = var_sum / n`` (the
    Int count cast to float), ``rstd = rsqrt(var + 1e-5)``, the per-channel affine; x every
    other column of a wider buffer; outputs y and the saved mean and rstd [N, C]."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        x, wt, b = _t(fd, 4), _t(fd, 1), _t(fd, 1)
        mean, var_sum, cnt = fd.ops.welford(x, dims=[2, 3])
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.div(var_sum, fd.ops.cast(cnt, F32)), 1e-5))
        xhat = fd.ops.mul(fd.ops.sub(x, _bc(fd, mean, 4, [0, 1])), _bc(fd, rstd, 4, [0, 1]))
        fd.add_output(fd.ops.add(fd.ops.mul(xhat, _bc(fd, wt, 4, [1])), _bc(fd, b, 4, [1])))
        fd.add_output(mean)
        fd.add_output(rstd)
    rng = _rng("instnorm_welford", shape)
    x = _randn(rng, (n, c, h, 2 * w), 1.5, 3.0)[..., ::2]
    ins = [x, _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x64, w64, b64 = map(_d, ins)
    mean = x64.mean((2, 3))
    rstd = 1 / np.sqrt(x64.var((2, 3)) + 1e-5)
    y = (x64 - mean[..., None, None]) * rstd[..., None, None] * w64[:, None, None] + b64[:, None, None]
    _check(fd.execute(ins), [y, mean, rstd], (1e-5, 1e-5))


@pytest.mark.parametrize("layout", ["c", "transposed"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 33), (2, 5, 4099)])
def test_layernorm_without_affine_over_the_last_two_axes(shape: Shape, layout: str) -> None:
    """``F.layer_norm(x, x.shape[-2:])`` (no weight, eps 1e-5) on [B, T, F]: ``var_mean``
    over (1, 2) with keepdim; outputs y, the mean and rstd [B, 1, 1]. x row-major or a
    [B, F, T] buffer transposed."""
    b, t, f = shape
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        var, mean = fd.ops.var_mean(x, dims=[1, 2], correction=0, keepdim=True)
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        fd.add_output(fd.ops.mul(fd.ops.sub(x, mean), rstd))
        fd.add_output(mean)
        fd.add_output(rstd)
    rng = _rng(f"ln2axes_{layout}", shape)
    x = _randn(rng, shape, 2.0, 1.0) if layout == "c" else _randn(rng, (b, f, t), 2.0, 1.0).transpose(0, 2, 1)
    x64 = _d(x)
    mean = x64.mean((1, 2), keepdims=True)
    rstd = 1 / np.sqrt(x64.var((1, 2), keepdims=True) + 1e-5)
    _check(fd.execute([x]), [(x64 - mean) * rstd, mean, rstd], (1e-5, 1e-5))


@pytest.mark.parametrize("dilation", [1, 4])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 17), (3, 8, 130)])
def test_conv_tasnet_causal_dilated_depthwise_conv_prelu_gln(shape: Shape, dilation: int) -> None:
    """Conv-TasNet's separation block after the 1x1 conv, on [B, C, T]: a causal depthwise
    conv (kernel 3, the dilation given) written as a left ``pad`` of ``2 * dilation`` and
    three shifted slices weighted by the columns of w [C, 3], PReLU with a per-channel slope
    [C], then global LayerNorm (gLN): mean and biased variance over (1, 2) (keepdim), eps
    1e-8, gamma and beta [C]."""
    b, c, t = shape
    k = 3
    with FusionDefinition() as fd:
        x, w, slope, gamma, beta = _t(fd, 3), _t(fd, 2), _t(fd, 1), _t(fd, 1), _t(fd, 1)
        xp = fd.ops.pad(x, [(k - 1) * dilation, 0])
        y = None
        for j in range(k):
            tap = fd.ops.mul(fd.ops.slice(xp, [0, 0, j * dilation], [b, c, j * dilation + t]),
                             _bc(fd, fd.ops.select(w, 1, j), 3, [1]))
            y = tap if y is None else fd.ops.add(y, tap)
        y = fd.ops.where(fd.ops.ge(y, 0.0), y, fd.ops.mul(y, _bc(fd, slope, 3, [1])))
        mean = fd.ops.mean(y, dims=[1, 2], keepdim=True)
        yc = fd.ops.sub(y, mean)
        var = fd.ops.mean(fd.ops.mul(yc, yc), dims=[1, 2], keepdim=True)
        yn = fd.ops.div(yc, fd.ops.sqrt(fd.ops.add(var, 1e-8)))
        fd.add_output(fd.ops.add(fd.ops.mul(yn, _bc(fd, gamma, 3, [1])), _bc(fd, beta, 3, [1])))
    rng = _rng(f"tasnet{dilation}", shape)
    ins = [_randn(rng, shape), _randn(rng, (c, k), 0.6), rng.uniform(0.05, 0.3, c).astype(np.float32),
           _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x, w, slope, gamma, beta = map(_d, ins)
    xp = np.concatenate([np.zeros((b, c, (k - 1) * dilation)), x], axis=2)
    y = sum(xp[:, :, j * dilation:j * dilation + t] * w[None, :, j, None] for j in range(k))
    y = np.where(y >= 0, y, y * slope[None, :, None])
    yn = (y - y.mean((1, 2), keepdims=True)) / np.sqrt(y.var((1, 2), keepdims=True) + 1e-8)
    # A 1x1x1 tensor has no spread: eps 1e-8 leaves (y - mean) / 1e-4 = 0.
    _check(fd.execute(ins), [yn * gamma[:, None] + beta[:, None]], (1e-4, 1e-4))


# ============================================================================ normalizations
@pytest.mark.parametrize("shape,groups", [((1, 2, 1, 1), 1), ((2, 6, 3, 5), 3), ((1, 32, 4, 4), 8)])
def test_diffusers_resnet_temb_groupnorm_silu(shape: Shape, groups: int) -> None:
    """diffusers' ResnetBlock2D middle: ``h = h + temb[:, :, None, None]``, GroupNorm(G, C,
    eps=1e-6) on NCHW written as ``reshape(N, G, C/G, H, W)`` with ``var_mean`` over (2, 3,
    4) keepdim, back to NCHW, the per-channel affine, then SiLU."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        x, temb, gw, gb = _t(fd, 4), _t(fd, 2), _t(fd, 1), _t(fd, 1)
        hh = fd.ops.reshape(fd.ops.add(x, _bc(fd, temb, 4, [0, 1])), [n, groups, c // groups, h, w])
        var, mean = fd.ops.var_mean(hh, dims=[2, 3, 4], correction=0, keepdim=True)
        yn = fd.ops.mul(fd.ops.sub(hh, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-6)))
        y = fd.ops.reshape(yn, [n, c, h, w])
        y = fd.ops.add(fd.ops.mul(y, _bc(fd, gw, 4, [1])), _bc(fd, gb, 4, [1]))
        fd.add_output(fd.ops.mul(y, fd.ops.sigmoid(y)))
    rng = _rng("diffusers_gn", shape)
    ins = [_randn(rng, shape, 1.5), _randn(rng, (n, c)), _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x, temb, gw, gb = map(_d, ins)
    hr = (x + temb[:, :, None, None]).reshape(n, groups, -1)
    yn = ((hr - hr.mean(2, keepdims=True)) / np.sqrt(hr.var(2, keepdims=True) + 1e-6)).reshape(shape)
    y = yn * gw[:, None, None] + gb[:, None, None]
    _check(fd.execute(ins), [y * _sigmoid(y)], (1e-5, 1e-5))


@needs_bf16
@pytest.mark.parametrize("shape", [(1, 1), (3, 4099), (2, 33000)])
def test_vllm_fused_add_rmsnorm_bf16_in_place(shape: Shape) -> None:
    """vLLM's ``fused_add_rms_norm(input, residual, weight, eps)`` on bfloat16 [T, H]:
    ``residual = input + residual`` (rounded to bf16) and ``input = rmsnorm(residual) *
    weight`` (statistics of the rounded residual in float, eps a runtime float), both
    written back in place. Rows of 33000 elements are longer than 32768."""
    with FusionDefinition() as fd:
        x, res, w = _t(fd, 2, BF), _t(fd, 2, BF), _t(fd, 1, BF)
        eps = fd.define_scalar(dtype=F32)
        s = fd.ops.cast(fd.ops.add(fd.ops.cast(x, F32), fd.ops.cast(res, F32)), BF)
        sf = fd.ops.cast(s, F32)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(sf, sf), dims=[1], keepdim=True), eps))
        y = fd.ops.mul(fd.ops.mul(sf, rstd), _bc(fd, fd.ops.cast(w, F32), 2, [1]))
        fd.add_output(fd.ops.cast(y, BF), alias_input=x)
        fd.add_output(s, alias_input=res)
    rng = _rng("vllm_add_rms", shape)
    x, res = _randn(rng, shape, 2.0, dtype=BF16_NP), _randn(rng, shape, dtype=BF16_NP)
    w = _randn(rng, (shape[1],), 0.3, 1.0, dtype=BF16_NP)
    s = (_d(x) + _d(res)).astype(np.float32).astype(BF16_NP)  # the float sum, rounded once
    s64 = _d(s)
    want = s64 / np.sqrt((s64 * s64).mean(1, keepdims=True) + 1e-6) * _d(w)
    assert fd.execute([x, res, w, 1e-6]) == []
    assert x.dtype == BF16_NP and res.dtype == BF16_NP
    np.testing.assert_array_equal(_d(res), s64)
    # bfloat16 keeps 8 significant bits: one rounding of the result is 2^-9 relative.
    _check([x], [want], (8e-3, 1e-2))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 33), (1, 3, 4099)])
def test_deepnorm_post_ln_residual_fp16(shape: Shape) -> None:
    """DeepNet's DeepNorm residual of a 12-layer encoder: ``LN(alpha * x + f(x))`` with
    ``alpha = (2 N) ** 0.25``; x and the sublayer's output f are fp16, the sum and the
    LayerNorm (affine, eps 1e-5) in float, y stored as fp16; the float pre-norm sum is a
    second output."""
    d = shape[-1]
    alpha = (2 * 12) ** 0.25
    with FusionDefinition() as fd:
        x, f, w, b = _t(fd, 3, F16), _t(fd, 3, F16), _t(fd, 1), _t(fd, 1)
        s = fd.ops.add(fd.ops.mul(fd.ops.cast(x, F32), alpha), fd.ops.cast(f, F32))
        var, mean = fd.ops.var_mean(s, dims=[2], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(s, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.mul(y, _bc(fd, w, 3, [2])), _bc(fd, b, 3, [2])), F16))
        fd.add_output(s)
    rng = _rng("deepnorm", shape)
    ins = [_randn(rng, shape, dtype=np.float16), _randn(rng, shape, 0.5, dtype=np.float16),
           _randn(rng, (d,), 0.5, 1.0), _randn(rng, (d,))]
    x, f, w, b = map(_d, ins)
    s = alpha * x + f
    y = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5) * w + b
    outs = fd.execute(ins)
    assert outs[0].dtype == np.float16 and outs[1].dtype == np.float32
    # fp16 keeps 11 significant bits (4.9e-4 relative per rounding).
    _check(outs, [y, s], [(2e-3, 2e-3), (1e-6, 1e-6)])


# ============================================================================ activations
@pytest.mark.parametrize("shape", [(1,), (7, 33), (2, 16, 1, 1)])
def test_mobilenetv3_hardswish_and_hardsigmoid_backward(shape: Shape) -> None:
    """MobileNetV3's activation gradients as ATen writes them: ``hardswish_backward = g *
    where(x < -3, 0, where(x <= 3, x / 3 + 0.5, 1))`` and ``hardsigmoid_backward = where(-3
    < x < 3, g / 6, 0)``, on values that include -3, 3 and 0 exactly ([N, C, 1, 1] is the
    squeeze-excitation gate's shape)."""
    r = len(shape)
    with FusionDefinition() as fd:
        g, x = _t(fd, r), _t(fd, r)
        mid = fd.ops.add(fd.ops.div(x, 3.0), 0.5)
        slope = fd.ops.where(fd.ops.lt(x, -3.0), 0.0, fd.ops.where(fd.ops.le(x, 3.0), mid, 1.0))
        fd.add_output(fd.ops.mul(g, slope))
        inside = fd.ops.logical_and(fd.ops.gt(x, -3.0), fd.ops.lt(x, 3.0))
        fd.add_output(fd.ops.where(inside, fd.ops.div(g, 6.0), 0.0))
    rng = _rng("hswish_bwd", shape)
    g, x = _randn(rng, shape), _randn(rng, shape, 3.0)
    x.flat[: min(x.size, 3)] = [-3.0, 3.0, 0.0][: min(x.size, 3)]
    g64, x64 = _d(g), _d(x)
    want = [g64 * np.where(x64 < -3, 0.0, np.where(x64 <= 3, x64 / 3 + 0.5, 1.0)),
            np.where((x64 > -3) & (x64 < 3), g64 / 6, 0.0)]
    _check(fd.execute([g, x]), want, (1e-6, 1e-7))


@pytest.mark.parametrize("shape", [(1,), (9, 31), (3, 1, 130)])
def test_parametric_activations_with_runtime_parameters(shape: Shape) -> None:
    """Activations whose parameters come at run time: ``nn.Softplus(beta, threshold)`` (x
    where ``beta x > threshold``, else ``log1p(exp(beta x)) / beta``), ``nn.ELU(alpha)``
    (``alpha * expm1(x)`` for x <= 0), ``F.leaky_relu(x, slope)``, and the tanh GELU with a
    constant; four outputs of one input with values up to +-60."""
    with FusionDefinition() as fd:
        x = _t(fd, len(shape))
        beta, thr, alpha, slope = (fd.define_scalar(dtype=DBL) for _ in range(4))
        bx = fd.ops.mul(x, beta)
        fd.add_output(fd.ops.where(fd.ops.gt(bx, thr), x, fd.ops.div(fd.ops.log1p(fd.ops.exp(bx)), beta)))
        fd.add_output(fd.ops.where(fd.ops.gt(x, 0.0), x, fd.ops.mul(fd.ops.expm1(x), alpha)))
        fd.add_output(fd.ops.where(fd.ops.ge(x, 0.0), x, fd.ops.mul(x, slope)))
        inner = fd.ops.mul(fd.ops.add(x, fd.ops.mul(fd.ops.mul(fd.ops.mul(x, x), x), 0.044715)),
                           math.sqrt(2 / math.pi))
        fd.add_output(fd.ops.mul(fd.ops.mul(x, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0)))
    x = _randn(_rng("param_act", shape), shape, 6.0)
    x.flat[:: 5] = 60.0 * np.sign(x.flat[:: 5])
    x64 = _d(x)
    beta, thr, alpha, slope = 0.5, 10.0, 1.5, 0.2
    with np.errstate(over="ignore"):
        sp = np.where(beta * x64 > thr, x64, np.log1p(np.exp(beta * x64)) / beta)
    want = [sp, np.where(x64 > 0, x64, alpha * np.expm1(x64)), np.where(x64 >= 0, x64, slope * x64),
            0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))]
    _check(fd.execute([x, beta, thr, alpha, slope]), want, (1e-5, 1e-6))


# ============================================================================ attention masks
@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (3, 2, 5, 7), (2, 1, 2, 33000)])
def test_key_padding_softmax_with_neg_inf_and_fully_masked_rows(shape: Shape) -> None:
    """``scores.masked_fill(~key_mask[:, None, None, :], -inf).softmax(-1)`` with a bool key
    mask [B, S] where the last sequence has no valid key: PyTorch gives NaN for those rows
    (``-inf - max`` with ``max = -inf``), and so does float64 here (and kiln, per
    ``tests/test_masked_rows.py``, also past 128 KiB rows where it computes ``exp(x - lse)``:
    33000 keys). Second output: the usual fix ``probs.masked_fill(~key_mask.any(-1), 0)``,
    the ``any`` a max over the bool mask."""
    b, h, sq, sk = shape
    with FusionDefinition() as fd:
        x, keep = _t(fd, 4), _t(fd, 2, DataType.Bool)
        w = fd.ops.where(_bc(fd, keep, 4, [0, 3]), fd.ops.mul(x, 0.125), NEG_INF)
        p = _softmax_fd(fd, w, 3)
        fd.add_output(p)
        none_kept = fd.ops.logical_not(fd.ops.max(keep, dims=[1]))
        fd.add_output(fd.ops.where(_bc(fd, none_kept, 4, [0]), 0.0, p))
    rng = _rng("pad_neg_inf", shape)
    x = _randn(rng, shape, 3.0)
    lens = rng.integers(1, sk + 1, size=b)
    lens[-1] = 0
    keep = np.arange(sk)[None, :] < lens[:, None]
    p = _softmax_nan(np.where(keep[:, None, None, :], _d(x) * 0.125, -np.inf))
    assert np.isnan(p[-1]).all() and not np.isnan(p[:-1]).any()
    _check(fd.execute([x, keep]), [p, np.where(np.isnan(p), 0.0, p)], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 9), (1, 2, 40)])
def test_longformer_local_and_global_attention_mask(shape: Shape) -> None:
    """Longformer-style attention probabilities on scores [B, H, S, S]: key j visible from
    query i when ``|i - j| <= w`` (w a runtime Int) or either is one of the first g global
    tokens (g a runtime Int), from ``iota``; masked with ``finfo.min``, scaled by 1/8,
    softmax over keys."""
    b, h, s = shape
    w_, g_ = 2, 1
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        win, glob = fd.define_scalar(dtype=I64), fd.define_scalar(dtype=I64)
        i = _bc(fd, fd.ops.iota(fd.ops.size(x, 2)), 2, [0])
        j = _bc(fd, fd.ops.iota(fd.ops.size(x, 3)), 2, [1])
        local = fd.ops.le(fd.ops.abs(fd.ops.sub(i, j)), win)
        keep = fd.ops.logical_or(local, fd.ops.logical_or(fd.ops.lt(i, glob), fd.ops.lt(j, glob)))
        w = fd.ops.where(_bc(fd, keep, 4, [2, 3]), fd.ops.mul(x, 0.125), F32_MIN)
        fd.add_output(_softmax_fd(fd, w, 3))
    x = _randn(_rng("longformer", shape), (b, h, s, s), 3.0)
    ii, jj = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = (np.abs(ii - jj) <= w_) | (ii < g_) | (jj < g_)
    _check(fd.execute([x, w_, g_]), [_softmax(np.where(keep, _d(x) * 0.125, -np.inf))], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 11), (3, 1, 64)])
def test_packed_sequences_block_causal_mask_from_segment_ids(shape: Shape) -> None:
    """Sequence packing (document masking): int64 segment ids [B, S] (non-decreasing), key
    j visible from query i when ``seg[i] == seg[j]`` and ``j <= i``; -inf elsewhere (the
    diagonal is always visible, so no row is fully masked); softmax over the keys of
    scores [B, H, S, S]; also the Int count of visible keys per query [B, S] (an integer
    sum: the position inside the document plus one)."""
    b, h, s = shape
    with FusionDefinition() as fd:
        x, seg = _t(fd, 4), _t(fd, 2, I64)
        n = fd.ops.size(x, 3)
        causal = fd.ops.le(_bc(fd, fd.ops.iota(n), 2, [1]), _bc(fd, fd.ops.iota(n), 2, [0]))
        same = fd.ops.eq(_bc(fd, seg, 3, [0, 1]), _bc(fd, seg, 3, [0, 2]))
        keep = fd.ops.logical_and(same, _bc(fd, causal, 3, [1, 2]))
        fd.add_output(_softmax_fd(fd, fd.ops.where(_bc(fd, keep, 4, [0, 2, 3]), x, NEG_INF), 3))
        fd.add_output(fd.ops.sum(fd.ops.cast(keep, I64), dims=[2]))
    rng = _rng("packed", shape)
    x = _randn(rng, (b, h, s, s), 2.0)
    seg = np.sort(rng.integers(0, 4, size=(b, s)), axis=1).astype(np.int64)
    keep = (seg[:, :, None] == seg[:, None, :]) & (np.arange(s)[None, None, :] <= np.arange(s)[None, :, None])
    outs = fd.execute([x, seg])
    _check(outs[:1], [_softmax(np.where(keep[:, None], _d(x), -np.inf))], (1e-5, 1e-7))
    assert outs[1].dtype == np.int64
    np.testing.assert_array_equal(outs[1], keep.sum(2))


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 13), (1, 2, 32)])
def test_block_local_attention_mask_from_iota_remainder(shape: Shape, block: int) -> None:
    """Block-local attention (BigBird's sliding blocks): position p is in the block that
    starts at ``p - p % blk`` (``remainder`` of an ``iota`` by a runtime Int block size);
    key j visible from query i in i's block or the one before; ``finfo.min`` elsewhere. The
    scores arrive as a [B, S, H, S] buffer transposed to [B, H, S, S]."""
    b, h, s = shape
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        blk = fd.define_scalar(dtype=I64)

        def start(t: Any) -> Any:
            return fd.ops.sub(t, fd.ops.remainder(t, blk))
        bi = _bc(fd, start(fd.ops.iota(fd.ops.size(x, 2))), 2, [0])
        bj = _bc(fd, start(fd.ops.iota(fd.ops.size(x, 3))), 2, [1])
        keep = fd.ops.logical_or(fd.ops.eq(bj, bi), fd.ops.eq(bj, fd.ops.sub(bi, blk)))
        fd.add_output(_softmax_fd(fd, fd.ops.where(_bc(fd, keep, 4, [2, 3]), x, F32_MIN), 3))
    x = _randn(_rng(f"block_local{block}", shape), (b, s, h, s), 2.0).transpose(0, 2, 1, 3)
    p = np.arange(s)
    st = p - p % block
    keep = (st[None, :] == st[:, None]) | (st[None, :] == st[:, None] - block)
    _check(fd.execute([x, block]), [_softmax(np.where(keep, _d(x), -np.inf))], (1e-5, 1e-7))


def _t5_bucket_ref(rel: np.ndarray, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """T5's ``_relative_position_bucket(relative_position, bidirectional=True)`` in float64."""
    half = num_buckets // 2
    out = (rel > 0).astype(np.int64) * half
    arel = np.abs(rel)
    max_exact = half // 2
    big = np.maximum(arel, max_exact).astype(np.float64)
    v = np.log(big / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    frac = v[arel > max_exact] % 1.0
    # The float32 logs of kiln and of this reference may differ by an ulp: no value may lie
    # that close to a bucket boundary (true below 16 positions; 16 itself is one; at 8 the
    # log is exactly 0).
    assert np.all((frac > 1e-4) & (frac < 1 - 1e-4)) or frac.size == 0
    large = np.minimum(max_exact + v.astype(np.int64), half - 1)
    return out + np.where(arel < max_exact, arel, large)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 9), (1, 4, 15)])
def test_t5_relative_position_bucket_bias_gathered_in_fusion(shape: Shape) -> None:
    """T5 attention with its relative position bias computed in the fusion: ``rel = j - i``
    from ``iota``, the bidirectional bucket (32 buckets, max distance 128: ``16 * (rel >
    0)``, then ``|rel|`` below 8, else ``8 + int(log(|rel| / 8) / log(16) * 8)`` capped at
    15), ``embedding(bucket)`` by ``index_select`` from the [32, H] table at those computed
    indices, ``permute`` to [H, S, S], added to the scores [B, H, S, S], softmax. Outputs the
    probabilities and the Int buckets [S, S]."""
    b, h, s = shape
    with FusionDefinition() as fd:
        x, table = _t(fd, 4), _t(fd, 2)
        n = fd.ops.size(x, 3)
        rel = fd.ops.sub(_bc(fd, fd.ops.iota(n), 2, [1]), _bc(fd, fd.ops.iota(n), 2, [0]))
        arel = fd.ops.abs(rel)
        logr = fd.ops.log(fd.ops.div(fd.ops.cast(arel, F32), 8.0))
        scaled = fd.ops.mul(fd.ops.div(logr, math.log(16.0)), 8.0)
        large = fd.ops.minimum(fd.ops.add(fd.ops.cast(scaled, I64), 8), 15)
        bucket = fd.ops.add(fd.ops.where(fd.ops.gt(rel, 0), 16, 0),
                            fd.ops.where(fd.ops.lt(arel, 8), arel, large))
        vals = fd.ops.index_select(table, fd.ops.reshape(bucket, [-1]), 0)
        bias = fd.ops.permute(fd.ops.reshape(vals, [n, n, -1]), [2, 0, 1])
        fd.add_output(_softmax_fd(fd, fd.ops.add(x, _bc(fd, bias, 4, [1, 2, 3])), 3))
        fd.add_output(bucket)
    rng = _rng("t5_bucket", shape)
    ins = [_randn(rng, (b, h, s, s), 2.0), _randn(rng, (32, h), 1.5)]
    ar = np.arange(s)
    bucket = _t5_bucket_ref(ar[None, :] - ar[:, None])
    bias = _d(ins[1])[bucket].transpose(2, 0, 1)
    outs = fd.execute(ins)
    np.testing.assert_array_equal(outs[1], bucket)
    _check(outs[:1], [_softmax(_d(ins[0]) + bias[None])], (1e-5, 1e-7))


# ============================================================================ losses
@needs_bf16
@pytest.mark.parametrize("shape", [(1, 7), (5, 1000), (3, 33000)])
def test_gemma2_final_logit_softcap_cross_entropy_bf16(shape: Shape) -> None:
    """Gemma 2's LM head epilogue on bfloat16 logits [N, V]: ``tanh(logits / 30) * 30`` in
    float, then cross-entropy with int64 labels (-100 ignored): the label's log-probability
    by ``take_along_axis`` at ``where(valid, label, 0)``; outputs the per-token loss [N] (0
    for ignored) and the mean over valid tokens. 33000 columns is past 32768."""
    n, v = shape
    with FusionDefinition() as fd:
        xb, lab = _t(fd, 2, BF), _t(fd, 1, I64)
        x = fd.ops.mul(fd.ops.tanh(fd.ops.div(fd.ops.cast(xb, F32), 30.0)), 30.0)
        valid = fd.ops.ne(lab, -100)
        safe = fd.ops.where(valid, lab, 0)
        logp = fd.ops.sub(x, fd.ops.logsumexp(x, dims=[1], keepdim=True))
        picked = fd.ops.squeeze(fd.ops.take_along_axis(logp, _col(fd, safe), 1), [1])
        nll = fd.ops.where(valid, fd.ops.neg(picked), 0.0)
        fd.add_output(nll)
        fd.add_output(fd.ops.div(fd.ops.sum(nll, dims=[0]), fd.ops.sum(fd.ops.cast(valid, F32), dims=[0])))
    rng = _rng("gemma2_ce", shape)
    xb = _randn(rng, shape, 8.0, dtype=BF16_NP)
    lab = rng.integers(0, v, size=n).astype(np.int64)
    if n > 1:
        lab[-1] = -100
    x = np.tanh(_d(xb) / 30) * 30
    ok = lab != -100
    nll = np.where(ok, _lse(x) - x[np.arange(n), np.where(ok, lab, 0)], 0.0)
    # float32 logits near 30 carry 2e-6 each; the log-sum-exp of 33000 of them ~1e-5.
    _check(fd.execute([xb, lab]), [nll, np.asarray(nll[ok].mean())], (1e-5, 2e-5))


@pytest.mark.parametrize("n,d", [(1, 3), (4, 16), (17, 33)])
def test_simclr_nt_xent_loss(n: int, d: int) -> None:
    """SimCLR's NT-Xent on embeddings z [2N, D] of two views: rows L2-normalized, the cosine
    similarities [2N, 2N] as a broadcast product summed over D, divided by the temperature
    0.5, self-similarities masked with -inf (the ``iota`` diagonal), the positive of row i
    at column ``(i + N) % 2N`` (an index computed in the fusion, taken with
    ``take_along_axis``); outputs per-row losses ``lse - pos`` [2N] and their mean."""
    with FusionDefinition() as fd:
        z = _t(fd, 2)
        u = fd.ops.div(z, fd.ops.clamp(fd.ops.sqrt(fd.ops.sum(fd.ops.mul(z, z), dims=[1], keepdim=True)),
                                       min=1e-12))
        sim = fd.ops.sum(fd.ops.mul(_bc(fd, u, 3, [0, 2]), _bc(fd, u, 3, [1, 2])), dims=[2])
        logits = fd.ops.div(sim, 0.5)
        m = fd.ops.size(z, 0)
        rows = fd.ops.iota(m)
        diag = fd.ops.eq(_bc(fd, rows, 2, [0]), _bc(fd, fd.ops.iota(m), 2, [1]))
        logits = fd.ops.where(diag, NEG_INF, logits)
        pos = fd.ops.remainder(fd.ops.add(rows, fd.ops.div(m, 2)), m)
        picked = fd.ops.squeeze(fd.ops.take_along_axis(logits, _col(fd, pos), 1), [1])
        loss = fd.ops.sub(fd.ops.logsumexp(logits, dims=[1]), picked)
        fd.add_output(loss)
        fd.add_output(fd.ops.mean(loss, dims=[0]))
    rng = _rng("ntxent", (n, d))
    a = _randn(rng, (n, d))
    z = np.concatenate([a, a + _randn(rng, (n, d), 0.5)]).astype(np.float32)
    z64 = _d(z)
    u = z64 / np.maximum(np.linalg.norm(z64, axis=1, keepdims=True), 1e-12)
    logits = u @ u.T / 0.5
    np.fill_diagonal(logits, -np.inf)
    r = np.arange(2 * n)
    loss = _lse(logits) - logits[r, (r + n) % (2 * n)]
    _check(fd.execute([z]), [loss, np.asarray(loss.mean())], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1), (9, 5), (130, 80)])
def test_retinanet_sigmoid_focal_loss_over_foreground(shape: Shape) -> None:
    """torchvision's ``sigmoid_focal_loss(x, t, alpha=0.25, gamma=2)`` for RetinaNet: the
    one-hot targets from int64 anchor labels (-1 background) and ``iota(C)``, ``ce =
    BCE-with-logits`` in its stable form, ``ce * (1 - p_t) ** 2 * alpha_t``; outputs the
    per-anchor loss [A] and the sum divided by ``max(1, #foreground anchors)``."""
    with FusionDefinition() as fd:
        x, lab = _t(fd, 2), _t(fd, 1, I64)
        t = fd.ops.cast(fd.ops.eq(_bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 2, [1]), _bc(fd, lab, 2, [0])), F32)
        p = fd.ops.sigmoid(x)
        ce = fd.ops.add(fd.ops.sub(fd.ops.relu(x), fd.ops.mul(x, t)),
                        fd.ops.log1p(fd.ops.exp(fd.ops.neg(fd.ops.abs(x)))))
        p_t = fd.ops.add(fd.ops.mul(p, t), fd.ops.mul(fd.ops.sub(1.0, p), fd.ops.sub(1.0, t)))
        alpha_t = fd.ops.add(fd.ops.mul(t, 0.25), fd.ops.mul(fd.ops.sub(1.0, t), 0.75))
        loss = fd.ops.mul(alpha_t, fd.ops.mul(ce, fd.ops.pow(fd.ops.sub(1.0, p_t), 2.0)))
        nfg = fd.ops.maximum(fd.ops.sum(fd.ops.cast(fd.ops.ge(lab, 0), F32), dims=[0]), 1.0)
        fd.add_output(fd.ops.sum(loss, dims=[1]))
        fd.add_output(fd.ops.div(fd.ops.sum(loss, dims=[0, 1]), nfg))
    a, c = shape
    rng = _rng("sigmoid_focal", shape)
    x = _randn(rng, shape, 3.0, -2.0)
    lab = np.where(rng.random(a) < 0.3, rng.integers(0, c, size=a), -1).astype(np.int64)
    x64 = _d(x)
    t = (np.arange(c)[None, :] == lab[:, None]).astype(np.float64)
    p = _sigmoid(x64)
    ce = np.maximum(x64, 0) - x64 * t + np.log1p(np.exp(-np.abs(x64)))
    p_t = p * t + (1 - p) * (1 - t)
    loss = (0.25 * t + 0.75 * (1 - t)) * ce * (1 - p_t) ** 2
    want = [loss.sum(1), np.asarray(loss.sum() / max(1, int((lab >= 0).sum())))]
    _check(fd.execute([x, lab]), want, (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (64, 1000)])
def test_nll_loss_with_class_weights_and_ignore_index(shape: Shape) -> None:
    """``F.cross_entropy(x, t, weight=w, ignore_index=-100)``: ``logp = x - lse``, each
    valid token's weight ``w[t]`` by ``index_select`` at the computed safe index
    ``where(t == -100, 0, t)``, its log-probability by ``take_along_axis``; the 'none'
    losses [N] (0 where ignored) and the weighted mean ``sum(w[t] * nll) / sum(w[t])``."""
    n, c = shape
    with FusionDefinition() as fd:
        x, t, w = _t(fd, 2), _t(fd, 1, I64), _t(fd, 1)
        logp = fd.ops.sub(x, fd.ops.logsumexp(x, dims=[1], keepdim=True))
        valid = fd.ops.ne(t, -100)
        safe = fd.ops.where(valid, t, 0)
        wt = fd.ops.where(valid, fd.ops.index_select(w, safe, 0), 0.0)
        lp = fd.ops.squeeze(fd.ops.take_along_axis(logp, _col(fd, safe), 1), [1])
        per = fd.ops.neg(fd.ops.mul(wt, lp))
        fd.add_output(per)
        fd.add_output(fd.ops.div(fd.ops.sum(per, dims=[0]), fd.ops.sum(wt, dims=[0])))
    rng = _rng("nll_weights", shape)
    x = _randn(rng, shape, 2.0)
    t = rng.integers(0, c, size=n).astype(np.int64)
    t[rng.random(n) < 0.25] = -100
    t[0] = c - 1
    w = rng.uniform(0.2, 3.0, c).astype(np.float32)
    x64, w64 = _d(x), _d(w)
    ok = t != -100
    safe = np.where(ok, t, 0)
    wt = np.where(ok, w64[safe], 0.0)
    per = -wt * (x64 - _lse(x64, keepdims=True))[np.arange(n), safe]
    _check(fd.execute([x, t, w]), [per, np.asarray(per.sum() / wt.sum())], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (6, 4), (33, 100)])
def test_multi_margin_loss(shape: Shape) -> None:
    """``F.multi_margin_loss(x, y, p=1, margin=1)`` as ATen computes it: ``sum over j != y
    of max(0, 1 - x[y] + x[j]) / C`` per sample, the label's score by ``take_along_axis``
    and ``j != y`` from ``iota``; outputs the per-sample loss [N] and the mean."""
    with FusionDefinition() as fd:
        x, y = _t(fd, 2), _t(fd, 1, I64)
        xy = fd.ops.take_along_axis(x, _col(fd, y), 1)
        z = fd.ops.clamp(fd.ops.add(fd.ops.sub(1.0, xy), x), min=0.0)
        other = fd.ops.ne(_bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 2, [1]), _bc(fd, y, 2, [0]))
        per = fd.ops.div(fd.ops.sum(fd.ops.where(other, z, 0.0), dims=[1]), fd.ops.size(x, 1))
        fd.add_output(per)
        fd.add_output(fd.ops.mean(per, dims=[0]))
    n, c = shape
    rng = _rng("multi_margin", shape)
    x, y = _randn(rng, shape), rng.integers(0, c, size=n).astype(np.int64)
    x64 = _d(x)
    z = np.maximum(1 - x64[np.arange(n), y][:, None] + x64, 0)
    z[np.arange(n), y] = 0
    per = z.sum(1) / c
    _check(fd.execute([x, y]), [per, np.asarray(per.mean())], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1), (8, 3), (100, 17)])
def test_gaussian_nll_loss_with_per_sample_variance(shape: Shape) -> None:
    """``F.gaussian_nll_loss(mu, target, var, full=True, eps=1e-6)`` with one variance per
    sample, var an [B, 1] input broadcast over D (declared with its size-one axis), clamped
    at eps (zeros included): ``0.5 * (log(var) + (mu - t)^2 / var) + 0.5 log(2 pi)``; the
    per-sample sum [B] and the mean."""
    with FusionDefinition() as fd:
        mu, tgt, var = _t(fd, 2), _t(fd, 2), fd.define_tensor([-1, 1], F32)
        v = fd.ops.clamp(var, min=1e-6)
        d = fd.ops.sub(mu, tgt)
        loss = fd.ops.add(fd.ops.mul(fd.ops.add(fd.ops.log(v), fd.ops.div(fd.ops.mul(d, d), v)), 0.5),
                          0.5 * math.log(2 * math.pi))
        fd.add_output(fd.ops.sum(loss, dims=[1]))
        fd.add_output(fd.ops.mean(loss, dims=[0, 1]))
    rng = _rng("gauss_nll", shape)
    var = rng.uniform(0.1, 2.0, (shape[0], 1)).astype(np.float32)
    var[0, 0] = 0.0
    ins = [_randn(rng, shape), _randn(rng, shape), var]
    mu, tgt, v = map(_d, ins)
    v = np.maximum(v, np.float32(1e-6))
    loss = 0.5 * (np.log(v) + (mu - tgt) ** 2 / v) + 0.5 * math.log(2 * math.pi)
    _check(fd.execute(ins), [loss.sum(1), np.asarray(loss.mean())], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 8, 33), (16, 32, 784)])
def test_vae_reparameterize_reconstruction_and_kl(shape: Shape) -> None:
    """A VAE's loss head: ``z = mu + eps * exp(0.5 logvar)`` [B, D], the KL term ``-0.5 *
    sum(1 + logvar - mu^2 - exp(logvar), 1)`` [B], the reconstruction MSE ``sum((x_hat -
    x)^2, 1)`` on images [B, F] (another axis size), and ``mean(recon + beta * kl)`` (0-d)
    with beta a runtime float: outputs of three ranks."""
    b, d, f = shape
    with FusionDefinition() as fd:
        mu, logvar, eps, xh, x = _t(fd, 2), _t(fd, 2), _t(fd, 2), _t(fd, 2), _t(fd, 2)
        beta = fd.define_scalar(dtype=DBL)
        fd.add_output(fd.ops.add(mu, fd.ops.mul(eps, fd.ops.exp(fd.ops.mul(logvar, 0.5)))))
        kl_terms = fd.ops.sub(fd.ops.sub(fd.ops.add(logvar, 1.0), fd.ops.mul(mu, mu)), fd.ops.exp(logvar))
        kl = fd.ops.mul(fd.ops.sum(kl_terms, dims=[1]), -0.5)
        diff = fd.ops.sub(xh, x)
        rec = fd.ops.sum(fd.ops.mul(diff, diff), dims=[1])
        fd.add_output(kl)
        fd.add_output(fd.ops.mean(fd.ops.add(rec, fd.ops.mul(kl, beta)), dims=[0]))
    rng = _rng("vae", shape)
    ins = [_randn(rng, (b, d)), _randn(rng, (b, d), 0.5, -1.0), _randn(rng, (b, d)),
           rng.uniform(0, 1, (b, f)).astype(np.float32), rng.uniform(0, 1, (b, f)).astype(np.float32)]
    mu, lv, ep, xh, x = map(_d, ins)
    kl = -0.5 * (1 + lv - mu * mu - np.exp(lv)).sum(1)
    total = ((xh - x) ** 2).sum(1) + 4.0 * kl
    _check(fd.execute([*ins, 4.0]), [mu + ep * np.exp(0.5 * lv), kl, np.asarray(total.mean())],
           (1e-5, 1e-5))


# ============================================================================ optimizers in place
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 130)])
def test_adafactor_factored_step_in_place(shape: Shape) -> None:
    """HF Adafactor (relative step, scale_parameter, no first moment) on a matrix [R, C]:
    ``grad_sq = g^2 + 1e-30``; the factored second moments row [R] and col [C] updated in
    place with ``beta2t`` (a runtime float) from ``grad_sq.mean(-1)`` and ``.mean(-2)``;
    ``update = rsqrt(row / row.mean())[:, None] * rsqrt(col)[None, :] * g``, divided by
    ``max(1, rms(update))``; ``lr = rel_step * max(1e-3, rms(p))`` (a runtime rel_step and
    full reductions broadcast back); p written in place too."""
    with FusionDefinition() as fd:
        p, g, row, col = _t(fd, 2), _t(fd, 2), _t(fd, 1), _t(fd, 1)
        beta2t, rel = fd.define_scalar(dtype=DBL), fd.define_scalar(dtype=DBL)
        gsq = fd.ops.add(fd.ops.mul(g, g), 1e-30)
        new = fd.ops.sub(1.0, beta2t)
        row2 = fd.ops.add(fd.ops.mul(row, beta2t), fd.ops.mul(fd.ops.mean(gsq, dims=[1]), new))
        col2 = fd.ops.add(fd.ops.mul(col, beta2t), fd.ops.mul(fd.ops.mean(gsq, dims=[0]), new))
        r = fd.ops.rsqrt(fd.ops.div(row2, _bc(fd, fd.ops.mean(row2, dims=[0]), 1, [])))
        upd = fd.ops.mul(fd.ops.mul(_bc(fd, r, 2, [0]), _bc(fd, fd.ops.rsqrt(col2), 2, [1])), g)
        rms_u = fd.ops.sqrt(fd.ops.mean(fd.ops.mul(upd, upd), dims=[0, 1]))
        upd = fd.ops.div(upd, _bc(fd, fd.ops.maximum(rms_u, 1.0), 2, []))
        lr = fd.ops.mul(fd.ops.maximum(fd.ops.sqrt(fd.ops.mean(fd.ops.mul(p, p), dims=[0, 1])), 1e-3), rel)
        fd.add_output(fd.ops.sub(p, fd.ops.mul(upd, _bc(fd, lr, 2, []))), alias_input=p)
        fd.add_output(row2, alias_input=row)
        fd.add_output(col2, alias_input=col)
    rng = _rng("adafactor", shape)
    p, g = _randn(rng, shape, 0.05), _randn(rng, shape, 0.01)
    row = np.abs(_randn(rng, (shape[0],), 1e-4)) + np.float32(1e-5)
    col = np.abs(_randn(rng, (shape[1],), 1e-4)) + np.float32(1e-5)
    step = 10
    beta2t, rel = 1.0 - step ** -0.8, min(1e-2, 1 / math.sqrt(step))
    p64, g64, row64, col64 = map(_d, (p, g, row, col))
    gsq = g64 * g64 + 1e-30
    row2 = beta2t * row64 + (1 - beta2t) * gsq.mean(1)
    col2 = beta2t * col64 + (1 - beta2t) * gsq.mean(0)
    upd = (1 / np.sqrt(row2 / row2.mean()))[:, None] / np.sqrt(col2)[None, :] * g64
    upd /= max(1.0, np.sqrt((upd * upd).mean()))
    p2 = p64 - rel * max(1e-3, np.sqrt((p64 * p64).mean())) * upd
    assert fd.execute([p, g, row, col, beta2t, rel]) == []
    _check([p, row, col], [p2, row2, col2], [(1e-6, 1e-8), (1e-5, 1e-12), (1e-5, 1e-12)])


@pytest.mark.parametrize("shape,layout", [((1, 1), "c"), ((7, 33), "t"), ((1000,), "s")])
def test_adamw_amsgrad_step_in_place(shape: Shape, layout: str) -> None:
    """torch.optim.AdamW(amsgrad=True, weight_decay=0.01), the non-capturable step: the host
    passes ``lr``, ``step_size = lr / bc1`` and ``sqrt(bc2)`` as runtime Doubles; ``p *= 1 -
    lr wd``, ``m.lerp_(g, 1 - b1)``, ``v = b2 v + (1 - b2) g^2``, ``vmax = max(vmax, v)``,
    ``p -= step_size * m / (sqrt(vmax) / sqrt(bc2) + eps)``; p, m, v and vmax all written in
    place; the gradient a transposed or stepped view."""
    b1, b2, eps, wd, lr, step = 0.9, 0.999, 1e-8, 0.01, 1e-3, 7
    r = len(shape)
    with FusionDefinition() as fd:
        p, g, m, v, vmax = (_t(fd, r) for _ in range(5))
        lr_s, step_size, bc2_sqrt = (fd.define_scalar(dtype=DBL) for _ in range(3))
        p1 = fd.ops.mul(p, fd.ops.sub(1.0, fd.ops.mul(lr_s, wd)))
        m2 = fd.ops.lerp(m, g, 1 - b1)
        v2 = fd.ops.add(fd.ops.mul(v, b2), fd.ops.mul(fd.ops.mul(g, g), 1 - b2))
        vmax2 = fd.ops.maximum(vmax, v2)
        denom = fd.ops.add(fd.ops.div(fd.ops.sqrt(vmax2), bc2_sqrt), eps)
        fd.add_output(fd.ops.sub(p1, fd.ops.mul(fd.ops.div(m2, denom), step_size)), alias_input=p)
        fd.add_output(m2, alias_input=m)
        fd.add_output(v2, alias_input=v)
        fd.add_output(vmax2, alias_input=vmax)
    rng = _rng(f"adamw_ams_{layout}", shape)
    p, m = _randn(rng, shape), _randn(rng, shape, 0.01)
    if layout == "t":
        g = _randn(rng, shape[::-1], 0.1).T
    elif layout == "s":
        g = _randn(rng, (2 * shape[0],), 0.1)[::2]
    else:
        g = _randn(rng, shape, 0.1)
    v = np.abs(_randn(rng, shape, 1e-3))
    vmax = (v * rng.uniform(0.5, 2.0, shape)).astype(np.float32)
    p64, g64, m64, v64, vmax64 = map(_d, (p, g, m, v, vmax))
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    m2 = m64 + (1 - b1) * (g64 - m64)
    v2 = b2 * v64 + (1 - b2) * g64 * g64
    vmax2 = np.maximum(vmax64, v2)
    p2 = p64 * (1 - lr * wd) - lr / bc1 * m2 / (np.sqrt(vmax2) / math.sqrt(bc2) + eps)
    assert fd.execute([p, g, m, v, vmax, lr, lr / bc1, math.sqrt(bc2)]) == []
    _check([p, m, v, vmax], [p2, m2, v2, vmax2], [(1e-6, 1e-7), (1e-5, 1e-9), (1e-5, 1e-12), (1e-5, 1e-12)])


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 3)])
def test_clip_grad_norm_of_three_parameters_in_place(shape: Shape, max_norm: float) -> None:
    """``clip_grad_norm_`` over a conv weight's gradient [O, I, 3, 3], a linear weight's
    [O, I] and a bias's [O]: the per-tensor 2-norms, the norm of those norms (0-d, returned),
    ``clamp(max_norm / (total + 1e-6), max=1)`` with a runtime max_norm, each gradient scaled
    in place (inputs of ranks 4, 2 and 1); clipping happens for max_norm 0.5, not for 1e3."""
    o, i = shape
    with FusionDefinition() as fd:
        gk, gw, gb = _t(fd, 4), _t(fd, 2), _t(fd, 1)
        mx = fd.define_scalar(dtype=F32)
        norms = [fd.ops.sqrt(fd.ops.sum(fd.ops.mul(t, t), dims=list(range(r)))) for t, r in
                 ((gk, 4), (gw, 2), (gb, 1))]
        sq = [fd.ops.mul(nm, nm) for nm in norms]
        total = fd.ops.sqrt(fd.ops.add(fd.ops.add(sq[0], sq[1]), sq[2]))
        coef = fd.ops.clamp(fd.ops.div(mx, fd.ops.add(total, 1e-6)), max=1.0)
        fd.add_output(total)
        for t, r in ((gk, 4), (gw, 2), (gb, 1)):
            fd.add_output(fd.ops.mul(t, _bc(fd, coef, r, [])), alias_input=t)
    rng = _rng(f"clipnorm{max_norm}", shape)
    gk, gw, gb = _randn(rng, (o, i, 3, 3), 0.1), _randn(rng, shape, 0.2), _randn(rng, (o,), 0.3)
    gs = [_d(a) for a in (gk, gw, gb)]
    total = math.sqrt(sum(float(np.linalg.norm(a.ravel())) ** 2 for a in gs))
    coef = min(max_norm / (total + 1e-6), 1.0)
    assert (coef < 1.0) == (max_norm == 0.5)
    outs = fd.execute([gk, gw, gb, max_norm])
    _check(outs, [np.asarray(total)], (1e-5, 1e-7))
    _check([gk, gw, gb], [a * coef for a in gs], (1e-5, 1e-8))


@needs_bf16
@pytest.mark.parametrize("shape", [(1, 1), (5, 97), (3, 1, 64)])
def test_rmsprop_momentum_in_place_with_bf16_model_copy(shape: Shape) -> None:
    """torch.optim.RMSprop(alpha=0.99, eps=1e-8, weight_decay=1e-4, momentum=0.9) on fp32
    master weights, lr a runtime Double: ``g += wd p``, ``sq = a sq + (1 - a) g^2``, ``buf =
    0.9 buf + g / (sqrt(sq) + eps)``, ``p -= lr buf``; p, sq and buf written in place, and
    the bfloat16 copy of the new p for the model returned (mixed-precision training)."""
    a, r = 0.99, len(shape)
    with FusionDefinition() as fd:
        p, g, sq, buf = (_t(fd, r) for _ in range(4))
        lr = fd.define_scalar(dtype=DBL)
        grad = fd.ops.add(g, fd.ops.mul(p, 1e-4))
        sq2 = fd.ops.add(fd.ops.mul(sq, a), fd.ops.mul(fd.ops.mul(grad, grad), 1 - a))
        buf2 = fd.ops.add(fd.ops.mul(buf, 0.9), fd.ops.div(grad, fd.ops.add(fd.ops.sqrt(sq2), 1e-8)))
        p2 = fd.ops.sub(p, fd.ops.mul(buf2, lr))
        fd.add_output(p2, alias_input=p)
        fd.add_output(sq2, alias_input=sq)
        fd.add_output(buf2, alias_input=buf)
        fd.add_output(fd.ops.cast(p2, BF))
    rng = _rng("rmsprop_inplace", shape)
    p, g = _randn(rng, shape), _randn(rng, shape, 0.5)
    sq, buf = rng.uniform(0.1, 1.0, shape).astype(np.float32), _randn(rng, shape, 0.3)
    p64, g64, sq64, buf64 = map(_d, (p, g, sq, buf))
    grad = g64 + 1e-4 * p64
    sq2 = a * sq64 + (1 - a) * grad * grad
    buf2 = 0.9 * buf64 + grad / (np.sqrt(sq2) + 1e-8)
    p2 = p64 - 0.01 * buf2
    outs = fd.execute([p, g, sq, buf, 0.01])
    assert len(outs) == 1 and outs[0].dtype == BF16_NP
    _check([p, sq, buf], [p2, sq2, buf2], (1e-5, 1e-7))
    # The bf16 copy is the rounding of the returned float p (kiln's, compared above).
    np.testing.assert_array_equal(_d(outs[0]), _d(p.astype(BF16_NP)))


# ============================================================================ quantization
@needs_bf16
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (4, 4099)])
def test_smoothquant_per_token_dynamic_int8_from_bf16(shape: Shape) -> None:
    """SmoothQuant activation quantization, per token: bfloat16 x [M, K] times the inverse
    smoothing factors [1, K] (an input with a size-one axis), ``scale = clamp(amax(|x|, -1,
    keepdim), 1e-5) / 127`` [M, 1], ``q = clamp(round(x / scale), -128, 127)`` as int32, and
    the dequantized ``q * scale``. A row of zeros takes the clamp. float32 arithmetic is
    mirrored, so q must match exactly."""
    with FusionDefinition() as fd:
        xb, inv_s = _t(fd, 2, BF), fd.define_tensor([1, -1], F32)
        x = fd.ops.mul(fd.ops.cast(xb, F32), inv_s)
        scale = fd.ops.div(fd.ops.clamp(fd.ops.max(fd.ops.abs(x), dims=[1], keepdim=True), min=1e-5), 127.0)
        q = fd.ops.clamp(fd.ops.round(fd.ops.div(x, scale)), -128.0, 127.0)
        fd.add_output(fd.ops.cast(q, I32))
        fd.add_output(scale)
        fd.add_output(fd.ops.mul(q, scale))
    rng = _rng("smoothquant", shape)
    xb = _randn(rng, shape, 2.0, dtype=BF16_NP)
    xb[-1] = 0
    inv_s = rng.uniform(0.25, 4.0, (1, shape[1])).astype(np.float32)
    x = xb.astype(np.float32) * inv_s
    sc = np.maximum(np.abs(x).max(1, keepdims=True), np.float32(1e-5)) / np.float32(127)
    q = np.clip(np.rint(x / sc), -128, 127)
    outs = fd.execute([xb, inv_s])
    assert outs[0].dtype == np.int32
    np.testing.assert_array_equal(outs[0], q.astype(np.int32))
    _check(outs[1:], [_d(sc), _d(q) * _d(sc)], [(1e-7, 0.0), (1e-6, 1e-12)])
    assert np.all(np.abs(_d(outs[2]) - _d(x)) <= 0.5 * _d(sc) * (1 + 1e-6))


@pytest.mark.parametrize("shape,group", [((1, 1), 1), ((3, 96), 32), ((17, 4096), 128)])
def test_groupwise_fp16_int8_dequant_round_trip(shape: Shape, group: int) -> None:
    """Group-wise weight quantization (GPTQ/AWQ storage) of an fp16 weight [O, K]: viewed as
    [O, K / g, g], ``scale = clamp(amax(|w|, -1), 1e-4) / 127`` stored as fp16 [O, K / g],
    ``q = clamp(round(w / scale), -127, 127)`` (int32) with the fp16 scale, the dequantized
    weight ``q * scale`` as fp16 [O, K] and each row's largest error ``max |w_deq - w|`` [O].
    Every step is exact in float32 (q has 8 bits, the scale 11), so all outputs must match
    the mirrored NumPy values exactly."""
    o, k = shape
    with FusionDefinition() as fd:
        wh = _t(fd, 2, F16)
        w = fd.ops.reshape(fd.ops.cast(wh, F32), [o, k // group, group])
        amax = fd.ops.max(fd.ops.abs(w), dims=[2], keepdim=True)
        sh = fd.ops.cast(fd.ops.div(fd.ops.clamp(amax, min=1e-4), 127.0), F16)
        sf = fd.ops.cast(sh, F32)
        q = fd.ops.clamp(fd.ops.round(fd.ops.div(w, sf)), -127.0, 127.0)
        deq = fd.ops.cast(fd.ops.reshape(fd.ops.mul(q, sf), [o, k]), F16)
        fd.add_output(fd.ops.cast(fd.ops.reshape(q, [o, k]), I32))
        fd.add_output(fd.ops.squeeze(sh, [2]))
        fd.add_output(deq)
        err = fd.ops.abs(fd.ops.sub(fd.ops.cast(deq, F32), fd.ops.cast(wh, F32)))
        fd.add_output(fd.ops.max(err, dims=[1]))
    wh = _randn(_rng("group_quant", shape), shape, 0.02, dtype=np.float16)
    w = wh.astype(np.float32).reshape(o, k // group, group)
    sh = (np.maximum(np.abs(w).max(2, keepdims=True), np.float32(1e-4)) / np.float32(127)).astype(np.float16)
    q = np.clip(np.rint(w / sh.astype(np.float32)), -127, 127)
    deq = (q * sh.astype(np.float32)).reshape(o, k).astype(np.float16)
    err = np.abs(deq.astype(np.float32) - wh.astype(np.float32)).max(1)
    outs = fd.execute([wh])
    assert [a.dtype for a in outs] == [np.int32, np.float16, np.float16, np.float32]
    np.testing.assert_array_equal(outs[0], q.reshape(o, k).astype(np.int32))
    np.testing.assert_array_equal(outs[1], sh[..., 0])
    np.testing.assert_array_equal(outs[2], deq)
    np.testing.assert_array_equal(outs[3], err)


# ============================================================================ positions, gathers
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 5, 16), (1, 2, 7, 64)])
def test_gpt_neox_partial_rotary_with_broadcast_cos_sin(shape: Shape) -> None:
    """GPT-NeoX's partial rotary embedding (``rotary_pct=0.25``) on q [B, H, S, D] and k (a
    [B, S, H, D] buffer transposed): the first r = D/4 dims rotated (``rotate_half`` as
    ``cat(-x[..., r/2:r], x[..., :r/2])`` of slices), the rest passed through, joined with
    ``cat``; cos and sin are [1, 1, S, r] inputs declared with their size-one axes."""
    b, h, s, d = shape
    r = d // 4
    with FusionDefinition() as fd:
        q, k = _t(fd, 4), _t(fd, 4)
        cos, sin = fd.define_tensor([1, 1, -1, -1], F32), fd.define_tensor([1, 1, -1, -1], F32)

        def rope(x: Any) -> Any:
            rot = fd.ops.slice(x, [0, 0, 0, 0], [b, h, s, r])
            half = fd.ops.cat([fd.ops.neg(fd.ops.slice(x, [0, 0, 0, r // 2], [b, h, s, r])),
                               fd.ops.slice(x, [0, 0, 0, 0], [b, h, s, r // 2])], dim=3)
            emb = fd.ops.add(fd.ops.mul(rot, cos), fd.ops.mul(half, sin))
            return fd.ops.cat([emb, fd.ops.slice(x, [0, 0, 0, r], [b, h, s, d])], dim=3)
        fd.add_output(rope(q))
        fd.add_output(rope(k))
    rng = _rng("neox_rope", shape)
    inv = 1.0 / (10000.0 ** (np.arange(0, r, 2) / r))
    ang = np.arange(s)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=1)[None, None]
    ins = [_randn(rng, shape), _randn(rng, (b, s, h, d)).transpose(0, 2, 1, 3),
           np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)]
    q, k, cs, sn = map(_d, ins)

    def rope_ref(x: np.ndarray) -> np.ndarray:
        rot = x[..., :r]
        half = np.concatenate([-rot[..., r // 2:], rot[..., :r // 2]], axis=-1)
        return np.concatenate([rot * cs + half * sn, x[..., r:]], axis=-1)
    _check(fd.execute(ins), [rope_ref(q), rope_ref(k)], (1e-6, 1e-6))


@pytest.mark.parametrize("shift", [3, 10])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 7, 7, 3), (1, 8, 12, 5)])
def test_swin_cyclic_shift_and_reverse_via_remainder_gathers(shape: Shape, shift: int) -> None:
    """Swin's shifted windows: ``torch.roll(x, (-s, -s), (1, 2))`` on [B, H, W, C] written
    as two ``index_select``s at ``(iota(n) + s) % n``, and the reverse roll of the block's
    output y (``(iota(n) - s) % n``: a remainder of negative numbers, Python's sign) added
    to the shortcut x; s a runtime Int (10 is larger than some axes)."""
    with FusionDefinition() as fd:
        x, y = _t(fd, 4), _t(fd, 4)
        s = fd.define_scalar(dtype=I64)

        def roll(t: Any, by: Any) -> Any:
            for axis in (1, 2):
                n = fd.ops.size(t, axis)
                t = fd.ops.index_select(t, fd.ops.remainder(fd.ops.add(fd.ops.iota(n), by), n), axis)
            return t
        fd.add_output(roll(x, s))
        fd.add_output(fd.ops.add(x, roll(y, fd.ops.neg(s))))
    rng = _rng(f"swin_roll{shift}", shape)
    ins = [_randn(rng, shape), _randn(rng, shape)]
    x, y = map(_d, ins)
    want = [np.roll(x, (-shift, -shift), (1, 2)), x + np.roll(y, (shift, shift), (1, 2))]
    _check(fd.execute([*ins, shift]), want, (1e-6, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 16), (3, 40, 33)])
def test_bert_embeddings_with_clamped_positions_and_layernorm(shape: Shape) -> None:
    """BERT's embedding layer with a KV-cache offset: word embeddings by ``index_select`` of
    int64 ids [B, S] (flattened) from a table that is the first H columns of a wider buffer,
    positions ``clamp(iota(S) + past, max=P - 1)`` (past a runtime Int; the last positions
    clamp) gathered from the [P, H] table, token types from int32 ids and a [2, H] table;
    the sum, then LayerNorm(eps=1e-12) with affine."""
    b, s, h = shape
    vocab, npos = 50, 32
    with FusionDefinition() as fd:
        ids, tt = _t(fd, 2, I64), _t(fd, 2, I32)
        wtab, ptab, ttab, g, beta = _t(fd, 2), _t(fd, 2), _t(fd, 2), _t(fd, 1), _t(fd, 1)
        past = fd.define_scalar(dtype=I64)
        words = fd.ops.reshape(fd.ops.index_select(wtab, fd.ops.reshape(ids, [-1]), 0), [b, s, h])
        types = fd.ops.reshape(fd.ops.index_select(ttab, fd.ops.reshape(tt, [-1]), 0), [b, s, h])
        pos_ids = fd.ops.clamp(fd.ops.add(fd.ops.iota(fd.ops.size(ids, 1)), past), max=npos - 1)
        pos = _bc(fd, fd.ops.index_select(ptab, pos_ids, 0), 3, [1, 2])
        e = fd.ops.add(fd.ops.add(words, pos), types)
        var, mean = fd.ops.var_mean(e, dims=[2], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(e, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-12)))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bc(fd, g, 3, [2])), _bc(fd, beta, 3, [2])))
    rng = _rng("bert_emb", shape)
    past = 5
    ids = rng.integers(0, vocab, size=(b, s)).astype(np.int64)
    tt = (rng.random((b, s)) < 0.5).astype(np.int32)
    wtab = _randn(rng, (vocab, h + 5), 0.5)[:, :h]
    ins = [ids, tt, wtab, _randn(rng, (npos, h), 0.5), _randn(rng, (2, h), 0.5),
           _randn(rng, (h,), 0.5, 1.0), _randn(rng, (h,))]
    wt, pt, tty, g, beta = map(_d, ins[2:])
    e = wt[ids] + pt[np.minimum(np.arange(s) + past, npos - 1)][None] + tty[tt]
    y = (e - e.mean(-1, keepdims=True)) / np.sqrt(e.var(-1, keepdims=True) + 1e-12) * g + beta
    # A 1-element row normalizes (e - mean = 0, exactly in both) to the bias.
    _check(fd.execute([*ins, past]), [y], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1), (7, 4099), (33000, 3)])
def test_logit_statistics_reduction_of_reductions(shape: Shape) -> None:
    """Training-loop logit monitoring on [N, V]: the mean over tokens of each token's max
    logit and of its log-sum-exp (the router/LM-head health numbers, 0-d), the per-vocab max
    over tokens [V] (a reduction over the non-last axis), the largest ``lse - max`` gap
    (0-d, a max of a difference of two reductions) and the ``std`` over tokens of the row
    maxima (``var`` with correction 1 of a reduction; 0-d, NaN for one token as in torch).
    33000 tokens make the reductions over the tokens longer than 32768."""
    with FusionDefinition() as fd:
        x = _t(fd, 2)
        mx = fd.ops.max(x, dims=[1])
        lse = fd.ops.logsumexp(x, dims=[1])
        fd.add_output(fd.ops.mean(mx, dims=[0]))
        fd.add_output(fd.ops.mean(lse, dims=[0]))
        fd.add_output(fd.ops.max(x, dims=[0]))
        fd.add_output(fd.ops.max(fd.ops.sub(lse, mx), dims=[0]))
        fd.add_output(fd.ops.sqrt(fd.ops.var(mx, dims=[0], correction=1)))
    x = _randn(_rng("logit_stats", shape), shape, 3.0, 1.0)
    x64 = _d(x)
    mx, lse = x64.max(1), _lse(x64)
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.asarray(mx.std(ddof=1)) if shape[0] > 1 else np.asarray(np.nan)
    want = [np.asarray(mx.mean()), np.asarray(lse.mean()), x64.max(0), np.asarray((lse - mx).max()), std]
    _check(fd.execute([x]), want, (1e-5, 1e-5))
