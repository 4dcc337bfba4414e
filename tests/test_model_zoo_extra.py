"""More fusions written the way model code writes them: activations, GLU variants, losses
(ignore_index and z-loss cross-entropy, Huber, cosine-embedding, triplet, Dice, CLIP, PPO,
MAE), optimizers (capturable Adam, Adagrad, centered RMSprop, Lion, gradient accumulation),
normalizations (unbiased-std LayerNorm, Swin patch merging, NHWC GroupNorm, instance-norm
backward, utterance CMVN, global standardization, Sinkhorn), fp16 epilogues (T5's overflow
clamp, the split-KV attention combine), masks (bool inputs, expanded zero-stride views,
iota-built sliding windows), gathers (int32 embedding ids, Mixup's permutation), reshapes
(pixel shuffle, GPT-J's interleaved rotary) and an argmax-based accuracy metric.

Each runs through the automatic schedule in the CPU interpreter (``fd.execute`` on NumPy
inputs) and is checked against a float64 NumPy reference computed from the exact input
values. Each is parametrized over a few shapes (an odd or non-power-of-two size, a size-one
axis where meaningful) and several take non-contiguous NumPy views (transposed, stepped,
Fortran-ordered, sliced). None of these is in ``tests/test_model_zoo.py`` or
``tests/families.py``.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Dict, Sequence, Tuple, Union

import numpy as np
import pytest
from kiln import DataType, FusionDefinition
from test_model_zoo import F32, F32_MIN, Shape, Tol, _bc, _d, _erf, _lse, _randn, _softmax, _sqrt_n, _t

F16 = DataType.Half


# ----------------------------------------------------------------------------- helpers
def _rng(name: str, shape: Sequence[int]) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"extra-{name}{tuple(shape)}".encode()))


def _view(rng: np.random.Generator, shape: Sequence[int], layout: str, scale: float = 1.0,
          shift: float = 0.0, dtype: Any = np.float32) -> np.ndarray:
    """Random values of ``shape`` in a given memory layout: ``c`` row-major, ``t`` the
    transpose of a row-major array of the reversed shape, ``s`` every other element of the
    last axis of a wider buffer, ``f`` Fortran order, ``r`` positions [1:] of axis 1 of a longer buffer."""
    shape = tuple(shape)
    if layout == "c":
        return _randn(rng, shape, scale, shift, dtype)
    if layout == "t":
        return _randn(rng, shape[::-1], scale, shift, dtype).T
    if layout == "s":
        return _randn(rng, shape[:-1] + (2 * shape[-1],), scale, shift, dtype)[..., ::2]
    if layout == "f":
        return np.asfortranarray(_randn(rng, shape, scale, shift, dtype))
    if layout == "r":
        return _randn(rng, (shape[0], shape[1] + 1) + shape[2:], scale, shift, dtype)[:, 1:]
    raise ValueError(layout)


def _check(outs: Sequence[Any], wants: Sequence[Any], tols: Union[Tol, Sequence[Tol]]) -> None:
    assert len(outs) == len(wants), f"{len(outs)} outputs, expected {len(wants)}"
    per = [tols] * len(wants) if isinstance(tols[0], float) else list(tols)  # type: ignore[list-item]
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = np.asarray(out).astype(np.float64)
        want = np.asarray(want, dtype=np.float64)
        assert got.shape == want.shape, f"output {i}: shape {got.shape}, expected {want.shape}"
        rtol, atol = per[i]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"output {i}")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _layernorm_fd(fd: FusionDefinition, x: Any, axis: int, eps: float) -> Any:
    """``F.layer_norm`` without affine over ``axis``, decomposed as torch's reference does:
    ``mean``, then ``mean((x - mean) ** 2)``."""
    mean = fd.ops.mean(x, dims=[axis], keepdim=True)
    xc = fd.ops.sub(x, mean)
    var = fd.ops.mean(fd.ops.pow(xc, 2.0), dims=[axis], keepdim=True)
    return fd.ops.mul(xc, fd.ops.rsqrt(fd.ops.add(var, eps)))


def _layernorm_ref(x: np.ndarray, axis: int = -1, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(axis, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis, keepdims=True) + eps)


# ============================================================================ activations
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805

Build = Callable[[FusionDefinition, Any], Any]
Ref = Callable[[np.ndarray], np.ndarray]


def _relu6(fd: FusionDefinition, x: Any) -> Any:
    return fd.ops.clamp(x, min=0.0, max=6.0)


_ACTIVATIONS: Dict[str, Tuple[Build, Ref]] = {
    "leaky_relu": (lambda fd, x: fd.ops.where(fd.ops.gt(x, 0.0), x, fd.ops.mul(x, 0.01)),
                   lambda x: np.where(x > 0, x, 0.01 * x)),
    "elu": (lambda fd, x: fd.ops.where(fd.ops.gt(x, 0.0), x, fd.ops.expm1(x)),
            lambda x: np.where(x > 0, x, np.expm1(x))),
    "selu": (lambda fd, x: fd.ops.mul(fd.ops.where(fd.ops.gt(x, 0.0), x,
                                                   fd.ops.mul(fd.ops.expm1(x), _SELU_ALPHA)), _SELU_SCALE),
             lambda x: _SELU_SCALE * np.where(x > 0, x, _SELU_ALPHA * np.expm1(x))),
    "celu": (lambda fd, x: fd.ops.add(fd.ops.relu(x), fd.ops.minimum(
        fd.ops.mul(fd.ops.expm1(fd.ops.div(x, 0.5)), 0.5), 0.0)),
             lambda x: np.maximum(x, 0) + np.minimum(0.5 * np.expm1(x / 0.5), 0)),
    "relu6": (_relu6, lambda x: np.clip(x, 0, 6)),
    "hardswish": (lambda fd, x: fd.ops.div(fd.ops.mul(x, _relu6(fd, fd.ops.add(x, 3.0))), 6.0),
                  lambda x: x * np.clip(x + 3, 0, 6) / 6),
    "hardsigmoid": (lambda fd, x: fd.ops.div(_relu6(fd, fd.ops.add(x, 3.0)), 6.0),
                    lambda x: np.clip(x + 3, 0, 6) / 6),
    "hardtanh": (lambda fd, x: fd.ops.clamp(x, min=-2.0, max=2.0), lambda x: np.clip(x, -2, 2)),
    "softsign": (lambda fd, x: fd.ops.div(x, fd.ops.add(fd.ops.abs(x), 1.0)), lambda x: x / (1 + np.abs(x))),
    "logsigmoid": (lambda fd, x: fd.ops.sub(fd.ops.minimum(x, 0.0),
                                            fd.ops.log1p(fd.ops.exp(fd.ops.neg(fd.ops.abs(x))))),
                   lambda x: np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))),
    "quick_gelu": (lambda fd, x: fd.ops.mul(x, fd.ops.sigmoid(fd.ops.mul(x, 1.702))),
                   lambda x: x * _sigmoid(1.702 * x)),
    "softplus_beta2": (lambda fd, x: fd.ops.where(fd.ops.gt(fd.ops.mul(x, 2.0), 20.0), x, fd.ops.div(
        fd.ops.log1p(fd.ops.exp(fd.ops.mul(x, 2.0))), 2.0)),
                       lambda x: np.where(2 * x > 20, x, np.log1p(np.exp(np.minimum(2 * x, 50))) / 2)),
    "softshrink": (lambda fd, x: fd.ops.where(fd.ops.gt(x, 0.5), fd.ops.sub(x, 0.5), fd.ops.where(
        fd.ops.lt(x, -0.5), fd.ops.add(x, 0.5), 0.0)),
                   lambda x: np.where(x > 0.5, x - 0.5, np.where(x < -0.5, x + 0.5, 0.0))),
    "hardshrink": (lambda fd, x: fd.ops.where(fd.ops.gt(fd.ops.abs(x), 0.5), x, 0.0),
                   lambda x: np.where(np.abs(x) > 0.5, x, 0.0)),
    "tanhshrink": (lambda fd, x: fd.ops.sub(x, fd.ops.tanh(x)), lambda x: x - np.tanh(x)),
}


@pytest.mark.parametrize("shape,layout", [((1,), "c"), ((7, 33), "t"), ((3, 1, 129), "s")])
@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
def test_activation_functions(name: str, shape: Shape, layout: str) -> None:
    """torch.nn.functional activations as their decompositions write them, on values up to
    +-100 and on the kinks (0, +-0.5, +-3, +-6), given contiguous, transposed and stepped."""
    build, ref = _ACTIVATIONS[name]
    with FusionDefinition() as fd:
        fd.add_output(build(fd, _t(fd, len(shape))))
    x = _view(_rng(f"act_{name}", shape), shape, layout, scale=4.0)
    special = [0.0, -3.0, 3.0, 6.0, -6.0, 0.5, -0.5, 30.0, -30.0, 100.0, -100.0, 10.0][:x.size]
    x[np.unravel_index(np.arange(len(special)), x.shape)] = special  # through the view
    with np.errstate(over="ignore", under="ignore"):
        want = ref(_d(x))
    _check(fd.execute([x]), [want], (1e-5, 1e-6))


# ============================================================================ gated units
@pytest.mark.parametrize("layout", ["c", "r"])
@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 5, 34), (3, 7, 130)])
def test_glu_and_geglu_on_chunked_halves(shape: Shape, layout: str) -> None:
    """``a, b = x.chunk(2, -1)``: ``F.glu`` (``a * sigmoid(b)``) and diffusers' GEGLU
    (``a * gelu(b)``, erf) from the same projection [B, S, 2F], sliced on the last axis."""
    f = shape[2] // 2
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        a = fd.ops.slice(x, [0, 0, 0], [None, None, f])
        b = fd.ops.slice(x, [0, 0, f], [None, None, 2 * f])
        fd.add_output(fd.ops.mul(a, fd.ops.sigmoid(b)))
        gelu = fd.ops.mul(fd.ops.mul(b, 0.5), fd.ops.add(fd.ops.erf(fd.ops.mul(b, 1 / math.sqrt(2))), 1.0))
        fd.add_output(fd.ops.mul(a, gelu))
    x = _view(_rng("glu", shape), shape, layout, scale=2.0)
    x64 = _d(x)
    a, b = x64[..., :f], x64[..., f:]
    _check(fd.execute([x]), [a * _sigmoid(b), a * 0.5 * b * (1 + _erf(b / math.sqrt(2)))], (1e-5, 1e-6))


# ============================================================================ normalizations
@pytest.mark.parametrize("shape,layout", [((1, 1, 2), "c"), ((2, 5, 33), "t"), ((1, 2, 6007), "c")])
def test_annotated_transformer_layernorm_unbiased_std(shape: Shape, layout: str) -> None:
    """The Annotated Transformer's LayerNorm: ``a_2 * (x - mean) / (std + eps) + b_2`` with
    ``x.std(-1, keepdim=True)`` (unbiased, N - 1) and eps 1e-6."""
    with FusionDefinition() as fd:
        x, a, b = _t(fd, 3), _t(fd, 1), _t(fd, 1)
        mean = fd.ops.mean(x, dims=[-1], keepdim=True)
        std = fd.ops.sqrt(fd.ops.var(x, dims=[-1], correction=1, keepdim=True))
        y = fd.ops.div(fd.ops.sub(x, mean), fd.ops.add(std, 1e-6))
        fd.add_output(fd.ops.add(fd.ops.mul(_bc(fd, a, 3, [2]), y), _bc(fd, b, 3, [2])))
    rng = _rng("annotated_ln", shape)
    n = shape[-1]
    ins = [_view(rng, shape, layout, 2.0, 3.0), _randn(rng, (n,), 0.5, 1.0), _randn(rng, (n,))]
    x, a, b = map(_d, ins)
    want = a * (x - x.mean(-1, keepdims=True)) / (x.std(-1, ddof=1, keepdims=True) + 1e-6) + b
    _check(fd.execute(ins), [want], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 2, 1), (2, 5, 33), (3, 17, 64)])
def test_vit_cls_and_avgpool_heads_layernorm_no_affine(shape: Shape) -> None:
    """A ViT's two pooled heads: ``F.layer_norm(x[:, 0], (D,))`` on the class token and
    ``F.layer_norm(x[:, 1:].mean(1), (D,))`` on the averaged patch tokens (timm's
    ``global_pool='avg'``), both without affine, written as ``mean((x - mean) ** 2)``."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        fd.add_output(_layernorm_fd(fd, fd.ops.select(x, 1, 0), 1, 1e-6))
        pooled = fd.ops.mean(fd.ops.slice(x, [0, 1, 0], [None, None, None]), dims=[1])
        fd.add_output(_layernorm_fd(fd, pooled, 1, 1e-6))
    x = _randn(_rng("vit_heads", shape), shape, 2.0, 0.5)
    x64 = _d(x)
    want = [_layernorm_ref(x64[:, 0], -1, 1e-6), _layernorm_ref(x64[:, 1:].mean(1), -1, 1e-6)]
    _check(fd.execute([x]), want, (1e-5, 1e-5))


@pytest.mark.parametrize("writing", ["strided_slices", "reshape_permute"])
@pytest.mark.parametrize("shape", [(1, 2, 2, 1), (2, 6, 6, 3), (1, 4, 10, 8)])
def test_swin_patch_merging(shape: Shape, writing: str) -> None:
    """Swin's PatchMerging on x [B, H*W, C]: ``x.view(B, H, W, C)``, the four 2x2 phases
    ``x[:, 0::2, 0::2]``, ``x[:, 1::2, 0::2]``, ``x[:, 0::2, 1::2]``, ``x[:, 1::2, 1::2]``
    concatenated on channels (or the same as a view/permute/reshape), ``view(B, -1, 4C)``,
    then LayerNorm(4C) with affine."""
    bsz, h, w, c = shape
    h2, w2 = h // 2, w // 2
    with FusionDefinition() as fd:
        x, g, b = _t(fd, 3), _t(fd, 1), _t(fd, 1)
        if writing == "strided_slices":
            xv = fd.ops.reshape(x, [bsz, h, w, c])
            parts = [fd.ops.slice(xv, [0, i, j, 0], [bsz, h, w, c], [1, 2, 2, 1])
                     for i, j in ((0, 0), (1, 0), (0, 1), (1, 1))]
            merged = fd.ops.reshape(fd.ops.cat(parts, dim=3), [bsz, -1, 4 * c])
        else:
            xv = fd.ops.reshape(x, [bsz, h2, 2, w2, 2, c])
            merged = fd.ops.reshape(fd.ops.permute(xv, [0, 1, 3, 4, 2, 5]), [bsz, h2 * w2, 4 * c])
        var, mean = fd.ops.var_mean(merged, dims=[2], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(merged, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bc(fd, g, 3, [2])), _bc(fd, b, 3, [2])))
    rng = _rng(f"swin_{writing}", shape)
    ins = [_randn(rng, (bsz, h * w, c)), _randn(rng, (4 * c,), 0.5, 1.0), _randn(rng, (4 * c,))]
    x, g, b = map(_d, ins)
    xv = x.reshape(bsz, h, w, c)
    merged = np.concatenate([xv[:, 0::2, 0::2], xv[:, 1::2, 0::2], xv[:, 0::2, 1::2], xv[:, 1::2, 1::2]],
                            axis=-1).reshape(bsz, -1, 4 * c)
    want = _layernorm_ref(merged) * g + b
    _check(fd.execute(ins), [want], (1e-5, 1e-5))


@pytest.mark.parametrize("layout", ["nhwc", "nchw_transposed"])
@pytest.mark.parametrize("shape,groups", [((1, 1, 1, 4), 2), ((2, 5, 3, 6), 3), ((1, 7, 9, 32), 8)])
def test_group_norm_channels_last_flax_style(shape: Shape, groups: int, layout: str) -> None:
    """flax's GroupNorm on NHWC: ``x.reshape(N, H, W, G, C // G)``, ``mean`` and ``mean(x²)``
    over the non-adjacent axes (1, 2, 4), ``var = max(mean2 - mean², 0)``, eps 1e-6, then
    reshape back and the per-channel affine. Given NHWC, or an NCHW buffer transposed to
    NHWC."""
    n, h, w, c = shape
    with FusionDefinition() as fd:
        x, scale, bias = _t(fd, 4), _t(fd, 1), _t(fd, 1)
        xr = fd.ops.reshape(x, [n, h, w, groups, c // groups])
        mean = fd.ops.mean(xr, dims=[1, 2, 4], keepdim=True)
        mean2 = fd.ops.mean(fd.ops.mul(xr, xr), dims=[1, 2, 4], keepdim=True)
        var = fd.ops.maximum(fd.ops.sub(mean2, fd.ops.mul(mean, mean)), 0.0)
        yr = fd.ops.mul(fd.ops.sub(xr, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-6)))
        y = fd.ops.reshape(yr, [n, h, w, c])
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bc(fd, scale, 4, [3])), _bc(fd, bias, 4, [3])))
    rng = _rng(f"gn_nhwc_{layout}", shape)
    if layout == "nhwc":
        x = _randn(rng, shape, 1.5, 0.2)
    else:
        x = _randn(rng, (n, c, h, w), 1.5, 0.2).transpose(0, 2, 3, 1)
    ins = [x, _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x64, s64, b64 = map(_d, ins)
    xr = x64.reshape(n, h, w, groups, c // groups)
    mu = xr.mean((1, 2, 4), keepdims=True)
    var = xr.var((1, 2, 4), keepdims=True)
    want = ((xr - mu) / np.sqrt(var + 1e-6)).reshape(n, h, w, c) * s64 + b64
    _check(fd.execute(ins), [want], (1e-5, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 17), (4, 5, 64)])
def test_instance_norm_1d_backward_recomputing_stats(shape: Shape) -> None:
    """InstanceNorm1d(affine=True) backward on [N, C, L] recomputing mean and rstd over L:
    ``g = dy * w``, ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` over L, and the
    parameter gradients ``dw = sum(dy * xhat, (0, 2))``, ``db = sum(dy, (0, 2))`` [C]."""
    n, c, ln = shape
    with FusionDefinition() as fd:
        x, dy, w = _t(fd, 3), _t(fd, 3), _t(fd, 1)
        var, mean = fd.ops.var_mean(x, dims=[2], correction=0, keepdim=True)
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        xhat = fd.ops.mul(fd.ops.sub(x, mean), rstd)
        g = fd.ops.mul(dy, _bc(fd, w, 3, [1]))
        mg = fd.ops.mean(g, dims=[2], keepdim=True)
        mgx = fd.ops.mean(fd.ops.mul(g, xhat), dims=[2], keepdim=True)
        fd.add_output(fd.ops.mul(rstd, fd.ops.sub(fd.ops.sub(g, mg), fd.ops.mul(xhat, mgx))))
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, xhat), dims=[0, 2]))
        fd.add_output(fd.ops.sum(dy, dims=[0, 2]))
    rng = _rng("in_bwd", shape)
    ins = [_randn(rng, shape, 2.0, 1.0), _randn(rng, shape), _randn(rng, (c,), 0.5, 1.0)]
    x, dy, w = map(_d, ins)
    mu = x.mean(2, keepdims=True)
    rstd = 1 / np.sqrt(x.var(2, keepdims=True) + 1e-5)
    xhat = (x - mu) * rstd
    g = dy * w[:, None]
    dx = rstd * (g - g.mean(2, keepdims=True) - xhat * (g * xhat).mean(2, keepdims=True))
    red = _sqrt_n(n * ln)
    _check(fd.execute(ins), [dx, (dy * xhat).sum((0, 2)), dy.sum((0, 2))],
           [(2e-5, 1e-5), (1e-5, 1e-5 * red), (1e-5, 1e-5 * red)])


@pytest.mark.parametrize("layout", ["c", "btf_from_bft"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 9, 5), (2, 33, 13)])
def test_espnet_utterance_mvn_with_lengths(shape: Shape, layout: str) -> None:
    """ESPnet's UtteranceMVN on features [B, T, F] with int64 lengths [B]: padded frames
    (``iota(T) >= len``) zeroed, ``mean = x.sum(1) / len``, ``x -= mean``, ``var =
    x_masked.pow(2).sum(1) / len``, ``x / clamp(sqrt(var), min=1e-20)``."""
    b, t, f = shape
    with FusionDefinition() as fd:
        x, lens = _t(fd, 3), _t(fd, 1, DataType.Int)
        valid = fd.ops.lt(_bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 3, [1]), _bc(fd, lens, 3, [0]))
        xm = fd.ops.where(valid, x, 0.0)
        lf = _bc(fd, fd.ops.cast(lens, F32), 2, [0])
        mean = fd.ops.div(fd.ops.sum(xm, dims=[1]), lf)
        xc = fd.ops.sub(xm, _bc(fd, mean, 3, [0, 2]))
        var = fd.ops.div(fd.ops.sum(fd.ops.pow(fd.ops.where(valid, xc, 0.0), 2.0), dims=[1]), lf)
        std = fd.ops.clamp(fd.ops.sqrt(var), min=1e-20)
        fd.add_output(fd.ops.div(xc, _bc(fd, std, 3, [0, 2])))
    rng = _rng(f"uttmvn_{layout}", shape)
    x = _randn(rng, shape, 2.0, 1.0) if layout == "c" else _randn(rng, (b, f, t), 2.0, 1.0).transpose(0, 2, 1)
    lens = rng.integers(1, t + 1, size=b).astype(np.int64)
    lens[0] = t
    x64 = _d(x)
    valid = np.arange(t)[None, :, None] < lens[:, None, None]
    xm = np.where(valid, x64, 0.0)
    mean = xm.sum(1) / lens[:, None]
    xc = xm - mean[:, None, :]
    std = np.maximum(np.sqrt((np.where(valid, xc, 0.0) ** 2).sum(1) / lens[:, None]), 1e-20)
    _check(fd.execute([x, lens]), [xc / std[:, None, :]], (1e-5, 1e-5))


@pytest.mark.parametrize("shape,layout", [((1, 3), "c"), ((7, 33), "f"), ((64, 130), "s")])
def test_global_standardization_std_mean(shape: Shape, layout: str) -> None:
    """``std, mean = torch.std_mean(x)`` over the whole tensor (unbiased), then
    ``(x - mean) / (std + 1e-7)``: reductions to 0-d broadcast back; outputs the tensor and
    both 0-d statistics."""
    with FusionDefinition() as fd:
        x = _t(fd, 2)
        var, mean = fd.ops.var_mean(x, dims=[0, 1], correction=1)
        std = fd.ops.sqrt(var)
        y = fd.ops.div(fd.ops.sub(x, _bc(fd, mean, 2, [])), _bc(fd, fd.ops.add(std, 1e-7), 2, []))
        fd.add_output(y)
        fd.add_output(mean)
        fd.add_output(std)
    x = _view(_rng("std_mean", shape), shape, layout, 2.0, 10.0)
    x64 = _d(x)
    mu, sd = x64.mean(), x64.std(ddof=1)
    _check(fd.execute([x]), [(x64 - mu) / (sd + 1e-7), np.asarray(mu), np.asarray(sd)], (1e-5, 1e-5))


# ============================================================================ losses
@pytest.mark.parametrize("shape", [(1, 2, 3), (2, 7, 33), (3, 5, 129)])
def test_causal_lm_shifted_cross_entropy_ignore_index(shape: Shape) -> None:
    """HF causal-LM loss: ``logits[:, :-1]`` and ``labels[:, 1:]`` flattened with ``view``,
    ``F.cross_entropy(..., ignore_index=-100)``: the label's log-probability by
    ``take_along_axis`` on a safe index (``where(labels == -100, 0, labels)``), the mean over
    valid tokens only. int64 labels."""
    b, s, v = shape
    with FusionDefinition() as fd:
        logits, labels = _t(fd, 3), _t(fd, 2, DataType.Int)
        x = fd.ops.reshape(fd.ops.slice(logits, [0, 0, 0], [b, s - 1, v]), [-1, v])
        lab = fd.ops.reshape(fd.ops.slice(labels, [0, 1], [b, s]), [-1])
        valid = fd.ops.ne(lab, -100)
        safe = fd.ops.where(valid, lab, 0)
        logp = fd.ops.sub(x, fd.ops.logsumexp(x, dims=[1], keepdim=True))
        picked = fd.ops.take_along_axis(logp, fd.ops.broadcast_in_dim(safe, [-1, 1], [0]), 1)
        nll = fd.ops.where(valid, fd.ops.neg(fd.ops.squeeze(picked, [1])), 0.0)
        count = fd.ops.sum(fd.ops.cast(valid, F32), dims=[0])
        fd.add_output(fd.ops.div(fd.ops.sum(nll, dims=[0]), count))
    rng = _rng("clm_ce", shape)
    logits = _randn(rng, shape, 3.0)
    labels = rng.integers(0, v, size=(b, s)).astype(np.int64)
    labels[rng.random((b, s)) < 0.3] = -100
    labels[0, 1] = rng.integers(0, v)  # at least one valid token
    x = _d(logits)[:, :-1].reshape(-1, v)
    lab = labels[:, 1:].reshape(-1)
    ok = lab != -100
    nll = _lse(x) - x[np.arange(len(lab)), np.where(ok, lab, 0)]
    want = np.asarray(nll[ok].sum() / ok.sum())
    _check(fd.execute([logits, labels]), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (6, 11), (33, 200)])
def test_palm_z_loss_with_int32_labels_and_padded_vocab(shape: Shape) -> None:
    """PaLM's auxiliary z-loss added to cross-entropy: ``loss = mean(lse - x[t] + 1e-4 *
    lse²)`` with int32 labels [N, 1] (``gather``) on logits that are the first V columns of
    a vocabulary padded to a multiple of 128 (a sliced view); also the z-loss alone."""
    n, v = shape
    vpad = -(-v // 128) * 128 + 128
    with FusionDefinition() as fd:
        x, t = _t(fd, 2), fd.define_tensor([-1, 1], DataType.Int32)
        lse = fd.ops.logsumexp(x, dims=[1], keepdim=True)
        ce = fd.ops.sub(lse, fd.ops.gather(x, t, 1))
        z = fd.ops.mul(fd.ops.mul(lse, lse), 1e-4)
        fd.add_output(fd.ops.mean(fd.ops.add(ce, z), dims=[0, 1]))
        fd.add_output(fd.ops.mean(z, dims=[0, 1]))
    rng = _rng("z_loss", shape)
    x = _randn(rng, (n, vpad), 4.0, 2.0)[:, :v]
    t = rng.integers(0, v, size=(n, 1)).astype(np.int32)
    x64 = _d(x)
    lse = _lse(x64, keepdims=True)
    z = 1e-4 * lse * lse
    want = [np.asarray((lse - np.take_along_axis(x64, t, 1) + z).mean()), np.asarray(z.mean())]
    _check(fd.execute([x, t]), want, (1e-5, 1e-6))


@pytest.mark.parametrize("shape,layout", [((1, 4), "c"), ((37, 4), "t"), ((3, 1, 65), "s")])
def test_smooth_l1_and_huber_loss_mean(shape: Shape, layout: str) -> None:
    """Box regression losses, mean-reduced: ``F.smooth_l1_loss(pred, target, beta=0.5)``
    and ``F.huber_loss(pred, target, delta=1.0)``; the target is a non-contiguous view."""
    dims = list(range(len(shape)))
    with FusionDefinition() as fd:
        p, t = _t(fd, len(shape)), _t(fd, len(shape))
        d = fd.ops.abs(fd.ops.sub(p, t))
        small = fd.ops.lt(d, 0.5)
        sl1 = fd.ops.where(small, fd.ops.div(fd.ops.mul(fd.ops.mul(d, d), 0.5), 0.5), fd.ops.sub(d, 0.25))
        hub = fd.ops.where(fd.ops.lt(d, 1.0), fd.ops.mul(fd.ops.mul(d, d), 0.5),
                           fd.ops.mul(fd.ops.sub(d, 0.5), 1.0))
        fd.add_output(fd.ops.mean(sl1, dims=dims))
        fd.add_output(fd.ops.mean(hub, dims=dims))
    rng = _rng(f"huber_{layout}", shape)
    ins = [_randn(rng, shape), _view(rng, shape, layout, 1.5)]
    p, t = map(_d, ins)
    d = np.abs(p - t)
    want = [np.asarray(np.where(d < 0.5, 0.5 * d * d / 0.5, d - 0.25).mean()),
            np.asarray(np.where(d < 1.0, 0.5 * d * d, d - 0.5).mean())]
    _check(fd.execute(ins), want, (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (64, 33)])
def test_cosine_embedding_loss(shape: Shape) -> None:
    """``F.cosine_embedding_loss(x1, x2, y, margin=0.2)`` as ATen computes it: ``cos =
    sum(x1 x2) / sqrt((|x1|² + 1e-12)(|x2|² + 1e-12))``, ``1 - cos`` for y = 1 and
    ``clamp(cos - margin, min=0)`` for y = -1 (int64 targets), mean over the batch."""
    with FusionDefinition() as fd:
        a, b, y = _t(fd, 2), _t(fd, 2), _t(fd, 1, DataType.Int)
        prod = fd.ops.sum(fd.ops.mul(a, b), dims=[1])
        m1 = fd.ops.add(fd.ops.sum(fd.ops.mul(a, a), dims=[1]), 1e-12)
        m2 = fd.ops.add(fd.ops.sum(fd.ops.mul(b, b), dims=[1]), 1e-12)
        cos = fd.ops.div(prod, fd.ops.sqrt(fd.ops.mul(m1, m2)))
        pos = fd.ops.where(fd.ops.eq(y, 1), fd.ops.sub(1.0, cos), 0.0)
        neg = fd.ops.where(fd.ops.eq(y, -1), fd.ops.clamp(fd.ops.sub(cos, 0.2), min=0.0), 0.0)
        fd.add_output(fd.ops.mean(fd.ops.add(pos, neg), dims=[0]))
    rng = _rng("cos_emb", shape)
    a = _randn(rng, shape)
    y = rng.choice([-1, 1], size=shape[0]).astype(np.int64)
    ins = [a, (a + _randn(rng, shape, 0.7)).astype(np.float32), y]
    a64, b64, y = _d(ins[0]), _d(ins[1]), ins[2]
    cos = (a64 * b64).sum(1) / np.sqrt(((a64 * a64).sum(1) + 1e-12) * ((b64 * b64).sum(1) + 1e-12))
    loss = np.where(y == 1, 1 - cos, 0.0) + np.where(y == -1, np.maximum(cos - 0.2, 0.0), 0.0)
    _check(fd.execute(ins), [np.asarray(loss.mean())], (1e-5, 1e-6))


@pytest.mark.parametrize("layout", ["c", "positives_stepped"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (65, 128)])
def test_triplet_margin_loss(shape: Shape, layout: str) -> None:
    """``F.triplet_margin_loss(a, p, n, margin=1.0)``: ``pairwise_distance(x, y) =
    ||x - y + 1e-6||₂`` over the last axis, ``clamp(d(a, p) - d(a, n) + 1, min=0).mean()``."""
    with FusionDefinition() as fd:
        a, p, n = _t(fd, 2), _t(fd, 2), _t(fd, 2)

        def dist(u: Any, w: Any) -> Any:
            diff = fd.ops.add(fd.ops.sub(u, w), 1e-6)
            return fd.ops.sqrt(fd.ops.sum(fd.ops.mul(diff, diff), dims=[1]))
        loss = fd.ops.clamp(fd.ops.add(fd.ops.sub(dist(a, p), dist(a, n)), 1.0), min=0.0)
        fd.add_output(fd.ops.mean(loss, dims=[0]))
    rng = _rng(f"triplet_{layout}", shape)
    a = _randn(rng, shape)
    pos = _view(rng, shape, "s" if layout == "positives_stepped" else "c", 0.6)
    pos += a
    ins = [a, pos, _randn(rng, shape, 1.0)]
    a64, p64, n64 = map(_d, ins)

    def dist_ref(u: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.sqrt(((u - w + 1e-6) ** 2).sum(1))
    loss = np.maximum(dist_ref(a64, p64) - dist_ref(a64, n64) + 1.0, 0.0)
    _check(fd.execute(ins), [np.asarray(loss.mean())], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 2, 1, 1), (2, 3, 5, 7), (1, 4, 16, 9)])
def test_multiclass_dice_loss(shape: Shape) -> None:
    """Segmentation Dice loss on logits [N, C, H, W] and an int64 label map [N, H, W]:
    ``p = softmax(x, 1)``, the one-hot from ``iota(C) == label``, per (n, c) ``dice = (2
    sum(p t) + 1) / (sum(p) + sum(t) + 1)`` over (2, 3); outputs dice [N, C] and ``1 -
    mean(dice)``."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        x, lab = _t(fd, 4), _t(fd, 3, DataType.Int)
        e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True)))
        p = fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True))
        classes = _bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 4, [1])
        onehot = fd.ops.cast(fd.ops.eq(classes, _bc(fd, lab, 4, [0, 2, 3])), F32)
        inter = fd.ops.sum(fd.ops.mul(p, onehot), dims=[2, 3])
        card = fd.ops.add(fd.ops.sum(p, dims=[2, 3]), fd.ops.sum(onehot, dims=[2, 3]))
        dice = fd.ops.div(fd.ops.add(fd.ops.mul(inter, 2.0), 1.0), fd.ops.add(card, 1.0))
        fd.add_output(dice)
        fd.add_output(fd.ops.sub(1.0, fd.ops.mean(dice, dims=[0, 1])))
    rng = _rng("dice", shape)
    x, lab = _randn(rng, shape, 2.0), rng.integers(0, c, size=(n, h, w)).astype(np.int64)
    p = _softmax(_d(x), 1)
    t = (np.arange(c)[None, :, None, None] == lab[:, None]).astype(np.float64)
    dice = (2 * (p * t).sum((2, 3)) + 1) / (p.sum((2, 3)) + t.sum((2, 3)) + 1)
    _check(fd.execute([x, lab]), [dice, np.asarray(1 - dice.mean())], (1e-5, 1e-6))


@pytest.mark.parametrize("log_scale", [math.log(1 / 0.07), 5.0])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_clip_contrastive_loss(batch: int, log_scale: float) -> None:
    """CLIP's loss from the cosine similarities S [B, B] and the learnable 0-d
    ``logit_scale``: ``L = exp(logit_scale).clamp(max=100) * S``, ``(CE(L, arange(B)) +
    CE(L.T, arange(B))) / 2`` with the same CE helper applied to ``L`` and its permute."""
    with FusionDefinition() as fd:
        s, ls = _t(fd, 2), fd.define_tensor([])
        scale = fd.ops.clamp(fd.ops.exp(ls), max=100.0)
        logits = fd.ops.mul(s, _bc(fd, scale, 2, []))

        def ce(z: Any) -> Any:
            rows = _bc(fd, fd.ops.iota(fd.ops.size(z, 0)), 2, [0])
            cols = _bc(fd, fd.ops.iota(fd.ops.size(z, 1)), 2, [1])
            picked = fd.ops.sum(fd.ops.where(fd.ops.eq(rows, cols), z, 0.0), dims=[1])
            return fd.ops.mean(fd.ops.sub(fd.ops.logsumexp(z, dims=[1]), picked), dims=[0])
        fd.add_output(fd.ops.div(fd.ops.add(ce(logits), ce(fd.ops.permute(logits, [1, 0]))), 2.0))
    rng = _rng("clip", (batch, int(log_scale)))
    img, txt = _randn(rng, (batch, 16)), _randn(rng, (batch, 16))
    img[:, 0] += 3.0
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    txt = (txt + img * 3.0)
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    s = (img @ txt.T).astype(np.float32)
    ls = np.array(log_scale, np.float32)
    logits = min(math.exp(float(ls)), 100.0) * _d(s)
    d = np.diag(logits)
    want = ((_lse(logits, 1) - d).mean() + (_lse(logits, 0) - d).mean()) / 2
    _check(fd.execute([s, ls]), [np.asarray(want)], (1e-5, 2e-5))


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 5, 48), (3, 16, 5)])
def test_mae_norm_pix_loss_with_bool_mask(shape: Shape) -> None:
    """MAE's ``forward_loss`` with ``norm_pix_loss``: the target patches normalized by their
    mean and unbiased variance (``(t - mean) / (var + 1e-6) ** .5``), ``((pred - t) ** 2)
    .mean(-1)``, averaged over the masked patches only, the mask a numpy bool [N, L] used in
    ``where``."""
    with FusionDefinition() as fd:
        pred, tgt, mask = _t(fd, 3), _t(fd, 3), _t(fd, 2, DataType.Bool)
        mean = fd.ops.mean(tgt, dims=[-1], keepdim=True)
        var = fd.ops.var(tgt, dims=[-1], keepdim=True)
        tn = fd.ops.div(fd.ops.sub(tgt, mean), fd.ops.pow(fd.ops.add(var, 1e-6), 0.5))
        per_patch = fd.ops.mean(fd.ops.pow(fd.ops.sub(pred, tn), 2.0), dims=[-1])
        masked = fd.ops.sum(fd.ops.where(mask, per_patch, 0.0), dims=[0, 1])
        fd.add_output(fd.ops.div(masked, fd.ops.sum(fd.ops.cast(mask, F32), dims=[0, 1])))
    rng = _rng("mae", shape)
    n, ln, _ = shape
    mask = rng.random((n, ln)) < 0.75
    mask[0, 0] = True
    ins = [_randn(rng, shape), _randn(rng, shape, 0.3, 0.5), mask]
    pred, tgt = _d(ins[0]), _d(ins[1])
    tn = (tgt - tgt.mean(-1, keepdims=True)) / np.sqrt(tgt.var(-1, ddof=1, keepdims=True) + 1e-6)
    per = ((pred - tn) ** 2).mean(-1)
    _check(fd.execute(ins), [np.asarray(per[mask].sum() / mask.sum())], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1), (4, 33), (16, 257)])
def test_ppo_clipped_policy_loss_with_response_mask(shape: Shape) -> None:
    """RLHF PPO policy loss over responses [B, T] with a bool response mask:
    ``ratio = exp(logp - old_logp)``, ``-min(ratio * adv, clamp(ratio, 0.8, 1.2) * adv)``,
    the masked mean ``sum(where(mask, v, 0)) / sum(mask)`` of it, of the approximate KL
    ``old_logp - logp``, and of the clip fraction ``|ratio - 1| > 0.2``; three 0-d outputs."""
    with FusionDefinition() as fd:
        logp, old, adv, mask = _t(fd, 2), _t(fd, 2), _t(fd, 2), _t(fd, 2, DataType.Bool)
        n = fd.ops.sum(fd.ops.cast(mask, F32), dims=[0, 1])

        def masked_mean(v: Any) -> Any:
            return fd.ops.div(fd.ops.sum(fd.ops.where(mask, v, 0.0), dims=[0, 1]), n)
        ratio = fd.ops.exp(fd.ops.sub(logp, old))
        s1 = fd.ops.mul(ratio, adv)
        s2 = fd.ops.mul(fd.ops.clamp(ratio, min=0.8, max=1.2), adv)
        fd.add_output(masked_mean(fd.ops.neg(fd.ops.minimum(s1, s2))))
        fd.add_output(masked_mean(fd.ops.sub(old, logp)))
        fd.add_output(masked_mean(fd.ops.cast(fd.ops.gt(fd.ops.abs(fd.ops.sub(ratio, 1.0)), 0.2), F32)))
    rng = _rng("ppo", shape)
    b, t = shape
    old = -np.abs(_randn(rng, shape, 2.0))
    logp = (old + _randn(rng, shape, 0.2)).astype(np.float32)
    # A ratio within float rounding of 0.8 or 1.2 may fall on either side of the clip: move it.
    near = np.abs(np.abs(np.exp(_d(logp) - _d(old)) - 1) - 0.2) < 1e-4
    logp[near] += np.float32(0.01)
    lens = rng.integers(1, t + 1, size=b)
    mask = np.arange(t)[None, :] < lens[:, None]
    ins = [logp, old, _randn(rng, shape), mask]
    lp, ol, ad = map(_d, ins[:3])
    ratio = np.exp(lp - ol)
    loss = -np.minimum(ratio * ad, np.clip(ratio, 0.8, 1.2) * ad)
    clipped = (np.abs(ratio - 1) > 0.2).astype(np.float64)
    assert np.all(np.abs(np.abs(ratio - 1) - 0.2) > 1e-5)
    want = [np.asarray(v[mask].sum() / mask.sum()) for v in (loss, ol - lp, clipped)]
    _check(fd.execute(ins), want, (1e-5, 1e-6))


# ============================================================================ optimizers
@pytest.mark.parametrize("step", [0.0, 9.0])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (257,)])
def test_capturable_adam_bias_correction_from_step_tensor(shape: Shape, step: float) -> None:
    """torch.optim.Adam(capturable=True, weight_decay=0.01): the 0-d step tensor is
    incremented in the fusion, ``bias_correction1 = 1 - beta1 ** step`` and ``2`` from it,
    ``grad += wd * p``, ``m.lerp_(grad, 1 - beta1)``, ``v = beta2 v + (1 - beta2) g²``, ``p -=
    lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``. Outputs p, m, v and the new step."""
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    r = len(shape)
    with FusionDefinition() as fd:
        p, g, m, v, st = _t(fd, r), _t(fd, r), _t(fd, r), _t(fd, r), fd.define_tensor([])
        new_step = fd.ops.add(st, 1.0)
        bc1 = _bc(fd, fd.ops.sub(1.0, fd.ops.pow(b1, new_step)), r, [])
        bc2 = _bc(fd, fd.ops.sub(1.0, fd.ops.pow(b2, new_step)), r, [])
        grad = fd.ops.add(g, fd.ops.mul(p, wd))
        m2 = fd.ops.lerp(m, grad, 1 - b1)
        v2 = fd.ops.add(fd.ops.mul(v, b2), fd.ops.mul(fd.ops.mul(grad, grad), 1 - b2))
        denom = fd.ops.add(fd.ops.div(fd.ops.sqrt(v2), fd.ops.sqrt(bc2)), eps)
        fd.add_output(fd.ops.sub(p, fd.ops.mul(fd.ops.div(lr, bc1), fd.ops.div(m2, denom))))
        fd.add_output(m2)
        fd.add_output(v2)
        fd.add_output(new_step)
    rng = _rng(f"adam_cap{step}", shape)
    v0 = np.abs(_randn(rng, shape, 1e-3)) if step else np.zeros(shape, np.float32)
    ins = [_randn(rng, shape), _randn(rng, shape, 0.1), _randn(rng, shape, 0.01), v0,
           np.array(step, np.float32)]
    p, g, m, v = map(_d, ins[:4])
    t = step + 1
    grad = g + wd * p
    m2 = m + (1 - b1) * (grad - m)
    v2 = b2 * v + (1 - b2) * grad * grad
    # The step tensor is float32, so are ``beta ** step`` and ``1 - beta ** step`` (as in
    # torch): 1 - 0.999 in float32 is 1.3e-5 off 1e-3. The powers are rounded to float32
    # here; the subtraction is then exact.
    bc1, bc2 = (1 - float(np.float32(float(np.float32(b)) ** t)) for b in (b1, b2))
    p2 = p - lr / bc1 * m2 / (np.sqrt(v2) / math.sqrt(bc2) + eps)
    _check(fd.execute(ins), [p2, m2, v2, np.asarray(t)], [(1e-6, 1e-6), (1e-5, 1e-7), (1e-5, 1e-10),
                                                         (0.0, 0.0)])


@pytest.mark.parametrize("shape,layout", [((1, 1), "c"), ((7, 33), "t"), ((1000,), "c")])
def test_adagrad_step_with_lr_decay_in_place_state(shape: Shape, layout: str) -> None:
    """torch.optim.Adagrad(lr=0.1, lr_decay=0.01, weight_decay=1e-4) at a runtime step:
    ``clr = lr / (1 + (step - 1) * lr_decay)``, ``state_sum += g²`` written back into its
    input (``alias_input``), ``p -= clr * g / (sqrt(state_sum) + 1e-10)``; p returned."""
    r = len(shape)
    with FusionDefinition() as fd:
        p, g, ss = _t(fd, r), _t(fd, r), _t(fd, r)
        step = fd.define_scalar(dtype=DataType.Int)
        grad = fd.ops.add(g, fd.ops.mul(p, 1e-4))
        clr = fd.ops.div(0.1, fd.ops.add(fd.ops.mul(fd.ops.sub(step, 1), 0.01), 1.0))
        ss2 = fd.ops.add(ss, fd.ops.mul(grad, grad))
        fd.add_output(fd.ops.sub(p, fd.ops.mul(fd.ops.div(grad, fd.ops.add(fd.ops.sqrt(ss2), 1e-10)), clr)))
        fd.add_output(ss2, alias_input=ss)
    rng = _rng("adagrad", shape)
    p = _view(rng, shape, layout)
    g = _view(rng, shape, layout, 0.1)
    ss = np.abs(_randn(rng, shape, 0.05))
    p64, g64, ss64 = map(_d, (p, g, ss))
    grad = g64 + 1e-4 * p64
    ss2 = ss64 + grad * grad
    want_p = p64 - 0.1 / (1 + 4 * 0.01) * grad / (np.sqrt(ss2) + 1e-10)
    outs = fd.execute([p, g, ss, 5])
    _check(outs, [want_p], (1e-6, 1e-7))
    _check([ss], [ss2], (1e-6, 1e-9))


@pytest.mark.parametrize("shape", [(1, 1), (5, 97), (3, 1, 64)])
def test_rmsprop_centered_with_momentum(shape: Shape) -> None:
    """torch.optim.RMSprop(lr=0.01, alpha=0.99, eps=1e-8, momentum=0.9, centered=True):
    ``sq = a sq + (1 - a) g²``, ``ga = a ga + (1 - a) g``, ``avg = sqrt(sq - ga²) + eps``,
    ``buf = 0.9 buf + g / avg``, ``p -= lr buf``; outputs p, sq, ga, buf."""
    r = len(shape)
    a = 0.99
    with FusionDefinition() as fd:
        p, g, sq, ga, buf = (_t(fd, r) for _ in range(5))
        sq2 = fd.ops.add(fd.ops.mul(sq, a), fd.ops.mul(fd.ops.mul(g, g), 1 - a))
        ga2 = fd.ops.lerp(ga, g, 1 - a)
        avg = fd.ops.add(fd.ops.sqrt(fd.ops.sub(sq2, fd.ops.mul(ga2, ga2))), 1e-8)
        buf2 = fd.ops.add(fd.ops.mul(buf, 0.9), fd.ops.div(g, avg))
        fd.add_output(fd.ops.sub(p, fd.ops.mul(buf2, 0.01)))
        fd.add_output(sq2)
        fd.add_output(ga2)
        fd.add_output(buf2)
    rng = _rng("rmsprop", shape)
    ga = _randn(rng, shape, 0.1)
    sq = (ga.astype(np.float64) ** 2 + rng.uniform(0.1, 1.0, shape)).astype(np.float32)
    ins = [_randn(rng, shape), _randn(rng, shape, 0.5), sq, ga, _randn(rng, shape, 0.3)]
    p, g, sq, ga, buf = map(_d, ins)
    sq2 = a * sq + (1 - a) * g * g
    ga2 = ga + (1 - a) * (g - ga)
    buf2 = 0.9 * buf + g / (np.sqrt(sq2 - ga2 * ga2) + 1e-8)
    _check(fd.execute(ins), [p - 0.01 * buf2, sq2, ga2, buf2], (1e-5, 1e-6))


@pytest.mark.parametrize("shape,layout", [((1, 1), "c"), ((9, 31), "f"), ((2, 3, 130), "s")])
def test_lion_step(shape: Shape, layout: str) -> None:
    """Lion (lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1): ``p *= 1 - lr wd``, ``p -= lr *
    sign(b1 m + (1 - b1) g)``, ``m = b2 m + (1 - b2) g``; entries with g = m = 0 take
    ``sign(0) = 0``."""
    lr, b1, b2, wd = 1e-4, 0.9, 0.99, 0.1
    r = len(shape)
    with FusionDefinition() as fd:
        p, g, m = _t(fd, r), _t(fd, r), _t(fd, r)
        upd = fd.ops.sign(fd.ops.add(fd.ops.mul(m, b1), fd.ops.mul(g, 1 - b1)))
        fd.add_output(fd.ops.sub(fd.ops.mul(p, 1 - lr * wd), fd.ops.mul(upd, lr)))
        fd.add_output(fd.ops.add(fd.ops.mul(m, b2), fd.ops.mul(g, 1 - b2)))
    rng = _rng("lion", shape)
    p, g, m = _randn(rng, shape), _view(rng, shape, layout, 0.1), _randn(rng, shape, 0.05)
    g[(0,) * r] = 0.0
    m[(0,) * r] = 0.0
    p64, g64, m64 = map(_d, (p, g, m))
    c = b1 * m64 + (1 - b1) * g64
    # A c within float rounding of 0 may take either sign.
    assert np.all((c == 0) | (np.abs(c) > 1e-6))
    want = [p64 * (1 - lr * wd) - lr * np.sign(c), b2 * m64 + (1 - b2) * g64]
    _check(fd.execute([p, g, m]), want, [(1e-6, 1e-7), (1e-6, 1e-8)])


@pytest.mark.parametrize("shape,layout", [((1, 1), "c"), ((7, 33), "t"), ((64, 130), "s")])
def test_grad_accumulation_from_half_and_clip_by_value(shape: Shape, layout: str) -> None:
    """Gradient accumulation under AMP: ``acc += g.float() / accum_steps`` with fp16 micro-
    batch gradients (a non-contiguous view) and a runtime Int ``accum_steps``, then
    ``clip_grad_value_(acc, 0.05)``; outputs the accumulator and the clipped gradient."""
    with FusionDefinition() as fd:
        acc, g = _t(fd, 2), _t(fd, 2, F16)
        steps = fd.define_scalar(dtype=DataType.Int)
        acc2 = fd.ops.add(acc, fd.ops.div(fd.ops.cast(g, F32), steps))
        fd.add_output(acc2)
        fd.add_output(fd.ops.clamp(acc2, min=-0.05, max=0.05))
    rng = _rng("grad_acc", shape)
    ins = [_randn(rng, shape, 0.05), _view(rng, shape, layout, 0.2, dtype=np.float16), 4]
    acc, g = _d(ins[0]), _d(ins[1])
    acc2 = acc + g / 4
    _check(fd.execute(ins), [acc2, np.clip(acc2, -0.05, 0.05)], (1e-6, 1e-8))


# ============================================================================ attention, masks
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (1, 2, 33)])
def test_gemma2_softcapped_sliding_window_softmax(shape: Shape) -> None:
    """Gemma 2 / Mistral attention probabilities on scores [B, H, S, S]: soft-capping
    ``tanh(s / 50) * 50``, a causal sliding window (key j visible from query i when ``j <=
    i`` and ``i - j < window``, window a runtime Int) built from ``iota``, masked with
    ``finfo.min``, softmax over keys."""
    b, h, s = shape
    window = 3
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        win = fd.define_scalar(dtype=DataType.Int)
        capped = fd.ops.mul(fd.ops.tanh(fd.ops.div(x, 50.0)), 50.0)
        i = _bc(fd, fd.ops.iota(fd.ops.size(x, 2)), 2, [0])
        j = _bc(fd, fd.ops.iota(fd.ops.size(x, 3)), 2, [1])
        keep = fd.ops.logical_and(fd.ops.le(j, i), fd.ops.lt(fd.ops.sub(i, j), win))
        w = fd.ops.where(_bc(fd, keep, 4, [2, 3]), capped, F32_MIN)
        e = fd.ops.exp(fd.ops.sub(w, fd.ops.max(w, dims=[3], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True)))
    x = _randn(_rng("softcap_swa", shape), (b, h, s, s), 40.0)
    ii, jj = np.arange(s)[:, None], np.arange(s)[None, :]
    keep = (jj <= ii) & (ii - jj < window)
    w = np.where(keep, 50.0 * np.tanh(_d(x) / 50.0), -np.inf)
    _check(fd.execute([x, window]), [_softmax(w)], (1e-5, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 5, 7), (3, 17, 64)])
def test_drop_path_with_bool_keep_mask(shape: Shape) -> None:
    """Stochastic depth in a residual block: ``x + where(keep[:, None, None], branch /
    keep_prob, 0)`` with a per-sample numpy bool ``keep`` [B] and keep_prob 0.8; the branch
    arrives as [B, C, N] transposed to [B, N, C] (a view)."""
    b, n, c = shape
    with FusionDefinition() as fd:
        x, br, keep = _t(fd, 3), _t(fd, 3), _t(fd, 1, DataType.Bool)
        fd.add_output(fd.ops.add(x, fd.ops.where(_bc(fd, keep, 3, [0]), fd.ops.div(br, 0.8), 0.0)))
    rng = _rng("drop_path", shape)
    keep = rng.random(b) < 0.8
    keep[-1] = not keep[0] if b > 1 else keep[0]
    ins = [_randn(rng, shape), _randn(rng, (b, c, n)).transpose(0, 2, 1), keep]
    x, br = _d(ins[0]), _d(ins[1])
    _check(fd.execute(ins), [x + np.where(keep[:, None, None], br / 0.8, 0.0)], (1e-6, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 16), (3, 5, 129)])
def test_split_kv_attention_combine_half(shape: Shape) -> None:
    """Flash-decoding's combine of two split-KV partial outputs o1, o2 [B, H, D] (fp16) with
    their log-sum-exps [B, H] (float; ``-inf`` for a split that saw no key): ``m =
    max(lse1, lse2)``, weights ``exp(lse - m)``, ``o = (o1 w1 + o2 w2) / (w1 + w2)`` in
    float stored as fp16, and the combined ``lse = m + log(w1 + w2)`` (float)."""
    b, h, d = shape
    with FusionDefinition() as fd:
        o1, o2, l1, l2 = _t(fd, 3, F16), _t(fd, 3, F16), _t(fd, 2), _t(fd, 2)
        m = fd.ops.maximum(l1, l2)
        w1, w2 = fd.ops.exp(fd.ops.sub(l1, m)), fd.ops.exp(fd.ops.sub(l2, m))
        den = fd.ops.add(w1, w2)
        num = fd.ops.add(fd.ops.mul(fd.ops.cast(o1, F32), _bc(fd, w1, 3, [0, 1])),
                         fd.ops.mul(fd.ops.cast(o2, F32), _bc(fd, w2, 3, [0, 1])))
        fd.add_output(fd.ops.cast(fd.ops.div(num, _bc(fd, den, 3, [0, 1])), F16))
        fd.add_output(fd.ops.add(m, fd.ops.log(den)))
    rng = _rng("splitkv", shape)
    l1, l2 = _randn(rng, (b, h), 3.0, 5.0), _randn(rng, (b, h), 3.0, 5.0)
    l1.flat[::3] = -np.inf
    ins = [_randn(rng, shape, dtype=np.float16), _randn(rng, shape, dtype=np.float16), l1, l2]
    o1, o2, a, c = map(_d, ins)
    mm = np.maximum(a, c)
    w1, w2 = np.exp(a - mm), np.exp(c - mm)
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    outs = fd.execute(ins)
    assert outs[0].dtype == np.float16
    _check(outs, [o, mm + np.log(w1 + w2)], [(2e-3, 2e-3), (1e-6, 1e-6)])


# ============================================================================ fp16, embeddings
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 5, 33), (1, 3, 128)])
def test_t5_fp16_residual_overflow_clamp(shape: Shape, overflow: bool) -> None:
    """T5's fp16 guard after a residual add: ``h = hidden + attn`` (fp16, computed in float),
    ``clamp_value = where(isinf(h).any(), finfo.max - 1000, finfo.max)``, ``h.clamp(-cv,
    cv)`` stored as fp16; ``any`` is a full reduction broadcast back to every element."""
    half_max = float(np.finfo(np.float16).max)
    with FusionDefinition() as fd:
        a, b = _t(fd, 3, F16), _t(fd, 3, F16)
        hs = fd.ops.cast(fd.ops.add(fd.ops.cast(a, F32), fd.ops.cast(b, F32)), F16)
        any_inf = fd.ops.gt(fd.ops.max(fd.ops.cast(fd.ops.isinf(hs), F32), dims=[0, 1, 2]), 0.0)
        cv = _bc(fd, fd.ops.where(any_inf, half_max - 1000.0, half_max), 3, [])
        hf = fd.ops.cast(hs, F32)
        fd.add_output(fd.ops.cast(fd.ops.clamp(hf, min=fd.ops.neg(cv), max=cv), F16))
    rng = _rng(f"t5clamp{overflow}", shape)
    a = _randn(rng, shape, 1000.0, dtype=np.float16)
    b = _randn(rng, shape, 1000.0, dtype=np.float16)
    a.flat[-1], b.flat[-1] = 64000.0, 800.0  # 64800: above finfo.max - 1000, still finite
    if overflow:
        a.flat[0], b.flat[0] = -60000.0, -30000.0
    with np.errstate(over="ignore"):
        h = (_d(a) + _d(b)).astype(np.float16).astype(np.float64)
    cv = half_max - 1000.0 if np.isinf(h).any() else half_max
    want = np.clip(h, -cv, cv).astype(np.float16)
    got = fd.execute([a, b])[0]
    assert got.dtype == np.float16 and bool(np.isinf(want).any()) is False
    _check([got], [want], (1e-3, 1e-3))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 7, 50, 12), (3, 5, 13, 64)])
def test_gemma_scaled_embedding_int32_ids(shape: Shape) -> None:
    """Gemma's input embeddings: ``embed_tokens(ids) * sqrt(hidden)`` with int32 ids [B*S]
    (``index_select``), reshaped to [B, S, H]; the table [V, H] is the first H columns of a
    wider buffer (a strided view)."""
    b, s, v, h = shape
    with FusionDefinition() as fd:
        table, ids = _t(fd, 2), _t(fd, 1, DataType.Int32)
        emb = fd.ops.mul(fd.ops.index_select(table, ids, 0), math.sqrt(h))
        fd.add_output(fd.ops.reshape(emb, [b, s, h]))
    rng = _rng("gemma_emb", shape)
    table = _randn(rng, (v, h + 3), 0.02)[:, :h]
    ids = rng.integers(0, v, size=b * s).astype(np.int32)
    want = (_d(table)[ids] * math.sqrt(h)).reshape(b, s, h)
    _check(fd.execute([table, ids]), [want], (1e-6, 1e-9))


# ============================================================================ reshapes
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (1, 4, 8, 3)])
def test_pixel_shuffle_bias_leaky_relu(shape: Shape) -> None:
    """An ESRGAN/ESPCN upsampler after the conv: ``(conv_out + bias[:, None, None])``,
    ``F.pixel_shuffle(., 2)`` written as ``view(N, C, 2, 2, H, W).permute(0, 1, 4, 2, 5, 3)
    .reshape(N, C, 2H, 2W)``, then ``leaky_relu(., 0.2)``; sizes (N, C, H, W) of the output
    channels."""
    n, c, h, w = shape
    r = 2
    with FusionDefinition() as fd:
        x, bias = _t(fd, 4), _t(fd, 1)
        y = fd.ops.add(x, _bc(fd, bias, 4, [1]))
        y = fd.ops.reshape(y, [n, c, r, r, h, w])
        y = fd.ops.reshape(fd.ops.permute(y, [0, 1, 4, 2, 5, 3]), [n, c, h * r, w * r])
        fd.add_output(fd.ops.where(fd.ops.gt(y, 0.0), y, fd.ops.mul(y, 0.2)))
    rng = _rng("pixel_shuffle", shape)
    ins = [_randn(rng, (n, c * r * r, h, w)), _randn(rng, (c * r * r,), 0.5)]
    x, bias = map(_d, ins)
    y = (x + bias[:, None, None]).reshape(n, c, r, r, h, w)
    y = y.transpose(0, 1, 4, 2, 5, 3).reshape(n, c, h * r, w * r)
    _check(fd.execute(ins), [np.where(y > 0, y, 0.2 * y)], (1e-6, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 3, 5), (4, 17, 64)])
def test_softmax_with_runtime_temperature_and_entropy(shape: Shape) -> None:
    """Sampling-time distribution on logits [B, S, V]: ``z = logits / temperature`` (a
    runtime Double), ``z - z.amax(-1, keepdim=True)`` written out, softmax, and the
    per-position entropy ``-sum(p * log_softmax(z))`` [B, S]; logits as a Fortran view."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        temp = fd.define_scalar(dtype=DataType.Double)
        z = fd.ops.div(x, temp)
        zc = fd.ops.sub(z, fd.ops.max(z, dims=[-1], keepdim=True))
        e = fd.ops.exp(zc)
        se = fd.ops.sum(e, dims=[-1], keepdim=True)
        p = fd.ops.div(e, se)
        fd.add_output(p)
        fd.add_output(fd.ops.neg(fd.ops.sum(fd.ops.mul(p, fd.ops.sub(zc, fd.ops.log(se))), dims=[-1])))
    x = _view(_rng("temp_softmax", shape), shape, "f", 3.0)
    z = _d(x) / 0.7
    p = _softmax(z)
    ent = -(p * (z - _lse(z, keepdims=True))).sum(-1)
    _check(fd.execute([x, 0.7]), [p, ent], [(1e-5, 1e-7), (1e-5, 1e-5)])


# ============================================================================ metrics, views, reshapes
@pytest.mark.parametrize("shape,layout", [((1, 1), "c"), ((9, 13), "t"), ((70, 101), "s")])
def test_top1_accuracy_with_argmax_from_iota(shape: Shape, layout: str) -> None:
    """Top-1 accuracy: ``argmax(logits, 1)`` written as the smallest index where the row
    max is reached (``min(where(x == amax, iota(V), V))``), output as int64 [N], and
    ``(pred == labels).float().mean()`` (0-d)."""
    n, v = shape
    with FusionDefinition() as fd:
        x, t = _t(fd, 2), _t(fd, 1, DataType.Int)
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        idx = _bc(fd, fd.ops.iota(fd.ops.size(x, 1)), 2, [1])
        pred = fd.ops.min(fd.ops.where(fd.ops.eq(x, mx), idx, fd.ops.size(x, 1)), dims=[1])
        fd.add_output(pred)
        fd.add_output(fd.ops.mean(fd.ops.cast(fd.ops.eq(pred, t), F32), dims=[0]))
    rng = _rng(f"top1_{layout}", shape)
    x = _view(rng, shape, layout, 2.0)
    want_pred = x.argmax(1)
    t = np.where(rng.random(n) < 0.6, want_pred, rng.integers(0, v, size=n)).astype(np.int64)
    outs = fd.execute([x, t])
    assert outs[0].dtype == np.int64
    np.testing.assert_array_equal(outs[0], want_pred)
    _check(outs[1:], [np.asarray((want_pred == t).mean())], (1e-6, 0.0))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (4, 3, 16, 9)])
def test_imagenet_normalize_of_a_flipped_int_image(shape: Shape) -> None:
    """torchvision-style preprocessing of a horizontally flipped batch: an int32 image
    [N, C, H, W] given as the NumPy view ``img[..., ::-1]`` (a negative stride), ``x / 255``,
    then ``(x - mean[c]) / std[c]`` with ImageNet's per-channel constants as [C] inputs."""
    n, c, h, w = shape
    with FusionDefinition() as fd:
        img, mean, std = _t(fd, 4, DataType.Int32), _t(fd, 1), _t(fd, 1)
        x = fd.ops.div(fd.ops.cast(img, F32), 255.0)
        fd.add_output(fd.ops.div(fd.ops.sub(x, _bc(fd, mean, 4, [1])), _bc(fd, std, 4, [1])))
    rng = _rng("imagenet_flip", shape)
    img = rng.integers(0, 256, size=shape).astype(np.int32)[..., ::-1]
    mean = np.resize(np.array([0.485, 0.456, 0.406], np.float32), c)
    std = np.resize(np.array([0.229, 0.224, 0.225], np.float32), c)
    want = (_d(img) / 255 - _d(mean)[:, None, None]) / _d(std)[:, None, None]
    _check(fd.execute([img, mean, std]), [want], (1e-6, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (3, 2, 33)])
def test_softmax_with_expanded_bool_padding_mask(shape: Shape) -> None:
    """``scores.masked_fill(~mask, finfo.min).softmax(-1)`` where the key padding mask
    [B, 1, 1, S] was ``expand``-ed to [B, H, S, S] before the call (a NumPy view with zero
    strides on H and the query axis)."""
    b, h, s = shape
    with FusionDefinition() as fd:
        x, mask = _t(fd, 4), _t(fd, 4, DataType.Bool)
        w = fd.ops.where(mask, x, F32_MIN)
        e = fd.ops.exp(fd.ops.sub(w, fd.ops.max(w, dims=[3], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True)))
    rng = _rng("expanded_mask", shape)
    x = _randn(rng, (b, h, s, s), 3.0)
    lens = rng.integers(1, s + 1, size=b)
    mask = np.broadcast_to((np.arange(s)[None, :] < lens[:, None])[:, None, None, :], (b, h, s, s))
    assert 0 in mask.strides or mask.size == 1
    want = _softmax(np.where(mask, _d(x), -np.inf))
    _check(fd.execute([x, mask]), [want], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (1, 7, 2, 66)])
def test_gptj_interleaved_rotary_embedding(shape: Shape) -> None:
    """GPT-J's rotary embedding on q [B, S, H, D]: ``rotate_every_two(x) = stack((-x[...,
    1::2], x[..., ::2]), -1).flatten(-2)`` (strided slices, a new last axis, a reshape) and
    sin/cos [S, D/2] ``duplicate_interleave``-d to [S, D] (a size-2 broadcast merged by a
    reshape); ``x * cos + rotate_every_two(x) * sin``."""
    b, s, h, d = shape
    d2 = d // 2
    with FusionDefinition() as fd:
        x, sin, cos = _t(fd, 4), _t(fd, 2), _t(fd, 2)
        x1 = fd.ops.slice(x, [0, 0, 0, 0], [b, s, h, d], [1, 1, 1, 2])
        x2 = fd.ops.slice(x, [0, 0, 0, 1], [b, s, h, d], [1, 1, 1, 2])
        stacked = fd.ops.cat([fd.ops.reshape(fd.ops.neg(x2), [b, s, h, d2, 1]),
                              fd.ops.reshape(x1, [b, s, h, d2, 1])], dim=4)
        rot = fd.ops.reshape(stacked, [b, s, h, d])

        def interleave(t: Any) -> Any:
            rep = fd.ops.broadcast_in_dim(t, [s, d2, 2], [0, 1])
            return _bc(fd, fd.ops.reshape(rep, [s, d]), 4, [1, 3])
        fd.add_output(fd.ops.add(fd.ops.mul(x, interleave(cos)), fd.ops.mul(rot, interleave(sin))))
    rng = _rng("gptj_rope", shape)
    ang = np.arange(s)[:, None] * (10000.0 ** (-np.arange(d2) / d2))[None, :]
    ins = [_randn(rng, shape), np.sin(ang).astype(np.float32), np.cos(ang).astype(np.float32)]
    x, sn, cs = map(_d, ins)
    rot = np.stack((-x[..., 1::2], x[..., ::2]), axis=-1).reshape(shape)
    sn2, cs2 = (np.repeat(t, 2, axis=1)[None, :, None, :] for t in (sn, cs))
    _check(fd.execute(ins), [x * cs2 + rot * sn2], (1e-6, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 5, 7), (3, 17, 16)])
def test_sinkhorn_normalization_three_iterations(shape: Shape) -> None:
    """Sinkhorn normalization of a score matrix (SuperGlue, optimal-transport heads):
    ``P = exp(S / 0.5)``, then three rounds of ``P /= P.sum(2, keepdim)`` and ``P /=
    P.sum(1, keepdim)``: row and column reductions chained on [B, M, N]."""
    with FusionDefinition() as fd:
        sc = _t(fd, 3)
        p = fd.ops.exp(fd.ops.div(sc, 0.5))
        for _ in range(3):
            p = fd.ops.div(p, fd.ops.sum(p, dims=[2], keepdim=True))
            p = fd.ops.div(p, fd.ops.sum(p, dims=[1], keepdim=True))
        fd.add_output(p)
    sc = _randn(_rng("sinkhorn", shape), shape)
    p = np.exp(_d(sc) / 0.5)
    for _ in range(3):
        p = p / p.sum(2, keepdims=True)
        p = p / p.sum(1, keepdims=True)
    _check(fd.execute([sc]), [p], (1e-5, 1e-7))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (4, 3, 5, 7), (7, 2, 8, 3)])
def test_mixup_batch_with_permutation(shape: Shape) -> None:
    """Mixup on a batch [B, C, H, W] with int64 labels [B]: ``perm = randperm(B)`` given,
    ``lam * x + (1 - lam) * x[perm]`` (``index_select`` on the batch axis) and the mixed
    one-hot targets ``lam * onehot(y) + (1 - lam) * onehot(y[perm])`` [B, 10], lam a runtime
    Double."""
    b = shape[0]
    classes = 10
    with FusionDefinition() as fd:
        x, y, perm = _t(fd, 4), _t(fd, 1, DataType.Int), _t(fd, 1, DataType.Int)
        lam = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.add(fd.ops.mul(x, lam), fd.ops.mul(fd.ops.index_select(x, perm, 0),
                                                                 fd.ops.sub(1.0, lam))))
        cls = _bc(fd, fd.ops.iota(classes), 2, [1])

        def onehot(lab: Any) -> Any:
            return fd.ops.cast(fd.ops.eq(cls, _bc(fd, lab, 2, [0])), F32)
        fd.add_output(fd.ops.add(fd.ops.mul(onehot(y), lam),
                                 fd.ops.mul(onehot(fd.ops.index_select(y, perm, 0)), fd.ops.sub(1.0, lam))))
    rng = _rng("mixup", shape)
    x = _randn(rng, shape)
    y = rng.integers(0, classes, size=b).astype(np.int64)
    perm = rng.permutation(b).astype(np.int64)
    lam = 0.3
    x64 = _d(x)
    eye = np.eye(classes)
    want = [lam * x64 + (1 - lam) * x64[perm], lam * eye[y] + (1 - lam) * eye[y[perm]]]
    _check(fd.execute([x, y, perm, lam]), want, (1e-6, 1e-7))
