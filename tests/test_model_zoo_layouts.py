"""Fusions from real model families, written the way PyTorch model code writes them, fed
NumPy inputs in the layouts and shapes real code hands over and the other zoo files do not
use: transposed views (``x.transpose(1, 2)`` of conv features, fairseq's T x B x C
activations, scores of a column-major GEMM), slices with a step or an offset (``chunk`` and
interleaved halves of a fused projection, the shifted logits and labels of a causal LM, a
KV-cache prefix, a position-embedding window), expanded views with zero strides
(``np.broadcast_to``: ViT's class token, attention masks), negative strides (``x[::-1]``),
size-one axes, odd and prime sizes (1, 3, 7, 127, 1000, 1031), rows longer than 4096 and
32768 elements, empty batches, float16 / bfloat16 (ml_dtypes) inputs computed in float32,
float64, int32 / int64 indices and bool masks.

Every fusion runs through kiln's automatic schedule in the CPU interpreter (``fd.execute``
on NumPy arrays) and is checked against an independent float64 NumPy reference computed from
the same (rounded) input values. Inputs declared without ``contiguity`` must accept every
strided view (README: "Strided arrays ... run on every path"); an input declared
``contiguity=[True, ...]`` must refuse a non-dense one with a ``KilnError`` naming it.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, List, Sequence, Tuple, Union

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError

try:
    import ml_dtypes

    BF16_NP: Any = ml_dtypes.bfloat16
except ImportError:  # bfloat16 NumPy arrays need ml_dtypes
    BF16_NP = None

F32 = DataType.Float
F64 = DataType.Double
I64 = DataType.Int
I32 = DataType.Int32
BOOL = DataType.Bool
F32_MIN = float(np.finfo(np.float32).min)
F16_MIN = float(np.finfo(np.float16).min)
NEG_INF = float("-inf")
Shape = Tuple[int, ...]
Tol = Tuple[float, float]

_erf = np.vectorize(math.erf, otypes=[np.float64])

# name -> (kiln dtype, NumPy dtype, (rtol, atol) of an element-wise result in that dtype)
DTYPES: Dict[str, Tuple[DataType, Any, Tol]] = {
    "f32": (F32, np.float32, (1e-5, 1e-5)),
    "f64": (F64, np.float64, (1e-12, 1e-12)),
    "f16": (DataType.Half, np.float16, (1e-2, 1e-2)),
    "bf16": (DataType.BFloat16, BF16_NP, (2e-2, 2e-2)),
}


def _dt(name: str) -> Tuple[DataType, Any, Tol]:
    if name == "bf16" and BF16_NP is None:
        pytest.skip("bfloat16 NumPy arrays need ml_dtypes")
    return DTYPES[name]


# ----------------------------------------------------------------------------- helpers
def _rng(name: str, *key: Any) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"layouts-{name}{key}".encode()))


def _randn(rng: np.random.Generator, shape: Sequence[int], scale: float = 1.0, shift: float = 0.0,
           dtype: Any = np.float32) -> np.ndarray:
    return (rng.standard_normal(tuple(shape)) * scale + shift).astype(dtype)


def _lay(a: np.ndarray, kind: str) -> np.ndarray:
    """The values of ``a`` in another memory layout (a NumPy view of a bigger buffer):

    - ``contig``: row-major;
    - ``T``: the last two axes transposed in memory (``y.transpose(-1, -2)`` of a row-major y);
    - ``step``: every other element of the last axis, starting at 1 (``buf[..., 1::2]``);
    - ``offset``: the last axis starting 3 elements into each row (``buf[..., 3:]``);
    - ``rows_step``: every other entry of the first axis (``buf[::2]``);
    - ``neg``: every axis reversed (negative strides, ``buf[::-1, ::-1]``);
    - ``fortran``: column-major.
    """
    a = np.asarray(a)
    if kind == "contig":
        v = np.ascontiguousarray(a)
    elif kind == "T":
        v = np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -1, -2)), -1, -2)
    elif kind == "step":
        buf = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        buf[..., 1::2] = a
        v = buf[..., 1::2]
    elif kind == "offset":
        buf = np.zeros(a.shape[:-1] + (a.shape[-1] + 3,), a.dtype)
        buf[..., 3:] = a
        v = buf[..., 3:]
    elif kind == "rows_step":
        buf = np.zeros((2 * a.shape[0] + 1,) + a.shape[1:], a.dtype)
        buf[1::2] = a
        v = buf[1::2]
    elif kind == "neg":
        v = np.flip(np.ascontiguousarray(np.flip(a)))
    elif kind == "fortran":
        v = np.asfortranarray(a)
    else:
        raise ValueError(kind)
    assert v.shape == a.shape and v.dtype == a.dtype
    np.testing.assert_array_equal(v, a)
    return v


def _nchw(a: np.ndarray, layout: str) -> np.ndarray:
    """An NCHW tensor row-major, ``channels_last`` (an NHWC buffer seen as NCHW) or with its
    H axis flipped in memory (``neg_h``)."""
    if layout == "channels_last":
        v = np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    elif layout == "neg_h":
        v = np.ascontiguousarray(a[:, :, ::-1])[:, :, ::-1]
    else:
        v = _lay(a, layout)
    np.testing.assert_array_equal(v, a)
    return v


def _outside(v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The buffer a view ``v`` lies in, and a mask of the buffer's elements ``v`` does not
    reach (an in-place update must leave those alone)."""
    buf = v
    while buf.base is not None:
        buf = buf.base
    it = v.itemsize
    off = (v.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // it
    mask = np.ones(buf.size, bool)
    elem_strides = tuple(st // it for st in v.strides)
    np.ndarray(v.shape, bool, buffer=mask, offset=off, strides=elem_strides)[...] = False
    return buf, mask.reshape(buf.shape)


def _d(a: Any) -> np.ndarray:
    """An input as float64 (exactly the values kiln reads)."""
    return np.asarray(a).astype(np.float64)


def _t(fd: FusionDefinition, rank: int, dtype: DataType = F32) -> Any:
    return fd.define_tensor([-1] * rank, dtype)


def _bc(fd: FusionDefinition, t: Any, rank: int, dims: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=[-1] * rank, broadcast_dims=list(dims))


def _f32(fd: FusionDefinition, t: Any) -> Any:
    """``t.float()`` (no op on a float32 or float64 tensor)."""
    return t if t.dtype in (F32, F64) else fd.ops.cast(t, F32)


def _back(fd: FusionDefinition, t: Any, dtype: DataType) -> Any:
    """``y.to(x.dtype)``."""
    return t if t.dtype == dtype else fd.ops.cast(t, dtype)


def _check(outs: Sequence[Any], wants: Sequence[Any], tols: Union[Tol, Sequence[Tol]],
           dtypes: Sequence[Any] = ()) -> None:
    assert len(outs) == len(wants), f"{len(outs)} outputs, expected {len(wants)}"
    per = [tols] * len(wants) if isinstance(tols[0], float) else list(tols)  # type: ignore[list-item]
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = np.asarray(out)
        if i < len(dtypes) and dtypes[i] is not None:
            assert got.dtype == np.dtype(dtypes[i]), f"output {i}: dtype {got.dtype}, expected {dtypes[i]}"
        got = got.astype(np.float64)
        want = np.asarray(want, dtype=np.float64)
        assert got.shape == want.shape, f"output {i}: shape {got.shape}, expected {want.shape}"
        rtol, atol = per[i]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"output {i}")


def _sqrt_n(n: int) -> float:
    return math.sqrt(max(1, n))


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _softmax_fd(fd: FusionDefinition, w: Any, axis: int) -> Any:
    mx = fd.ops.max(w, dims=[axis], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(w, mx))
    return fd.ops.div(e, fd.ops.sum(e, dims=[axis], keepdim=True))


def _log_softmax_fd(fd: FusionDefinition, w: Any, axis: int) -> Any:
    mx = fd.ops.max(w, dims=[axis], keepdim=True)
    sh = fd.ops.sub(w, mx)
    return fd.ops.sub(sh, fd.ops.log(fd.ops.sum(fd.ops.exp(sh), dims=[axis], keepdim=True)))


def _layer_norm_fd(fd: FusionDefinition, x: Any, w: Any, b: Any, axis: int, eps: float) -> Any:
    """``F.layer_norm`` over ``axis`` (the last) as its decomposition writes it."""
    r = len(x.shape)
    mean = fd.ops.mean(x, dims=[axis], keepdim=True)
    xc = fd.ops.sub(x, mean)
    var = fd.ops.mean(fd.ops.mul(xc, xc), dims=[axis], keepdim=True)
    y = fd.ops.mul(xc, fd.ops.rsqrt(fd.ops.add(var, eps)))
    return fd.ops.add(fd.ops.mul(y, _bc(fd, w, r, [axis])), _bc(fd, b, r, [axis]))


def _layer_norm_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


# ============================================================================ normalizations
@pytest.mark.parametrize("dt", ["f32", "f64", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 3), (3, 5, 127), (2, 2, 4099), (0, 3, 5)])
def test_wav2vec2_layernorm_on_transposed_conv_features(shape: Shape, dt: str) -> None:
    """wav2vec2's feature projection: conv features [B, C, T] -> ``x.transpose(1, 2)`` ->
    ``LayerNorm(C)`` with weight and bias; the input is the transposed view [B, T, C], the
    weight a stepped view ``w_buf[1::2]`` and the bias reversed (negative stride). Half
    inputs are normalized in float and stored back in their dtype. Sizes (B, T, C)."""
    b, t, c = shape
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        x, w, bias = _t(fd, 3, kdt), _t(fd, 1, kdt), _t(fd, 1, kdt)
        y = _layer_norm_fd(fd, _f32(fd, x), _f32(fd, w), _f32(fd, bias), 2, 1e-5)
        fd.add_output(_back(fd, y, kdt))
    rng = _rng("w2v2_ln", shape, dt)
    feats = _randn(rng, (b, c, t), 2.0, 0.5, npdt)
    x = np.swapaxes(feats, 1, 2)
    w = _lay(_randn(rng, (c,), 0.5, 1.0, npdt), "step")
    bb = _lay(_randn(rng, (c,), 1.0, 0.0, npdt), "neg")
    want = _layer_norm_ref(_d(x), _d(w), _d(bb), 1e-5)
    rtol, atol = tol
    _check(fd.execute([x, w, bb]), [want], (rtol, atol if dt in ("f16", "bf16") else atol * 10), [npdt])


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 127), (2, 1031), (2, 4099), (1, 32771)])
def test_rmsnorm_with_weight_and_bias_on_transposed_rows(shape: Shape, dt: str) -> None:
    """Gemma-style RMSNorm with an added bias, ``x.float() * rsqrt(mean(x^2, -1) + eps) *
    (1 + w.float()) + b.float()`` cast back, on rows that are the columns of a row-major
    [H, N] buffer (``x = h.T``). Sizes (N, H); one row of 32771 elements."""
    n, h = shape
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        x, w, b = _t(fd, 2, kdt), _t(fd, 1, kdt), _t(fd, 1, kdt)
        xf = _f32(fd, x)
        rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(xf, xf), dims=[1], keepdim=True), 1e-6))
        y = fd.ops.mul(fd.ops.mul(xf, rstd), _bc(fd, fd.ops.add(_f32(fd, w), 1.0), 2, [1]))
        fd.add_output(_back(fd, fd.ops.add(y, _bc(fd, _f32(fd, b), 2, [1])), kdt))
    rng = _rng("rms_bias", shape, dt)
    x = _randn(rng, (h, n), 2.0, 0.3, npdt).T
    w = _randn(rng, (h,), 0.3, 0.0, npdt)
    b = _lay(_randn(rng, (h,), 0.5, 0.0, npdt), "offset")
    x64, w64, b64 = _d(x), _d(w), _d(b)
    want = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6) * (1 + w64) + b64
    rtol, atol = tol
    _check(fd.execute([x, w, b]), [want], (rtol, atol * 10 if dt == "f32" else atol), [npdt])


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("layout", ["contig", "channels_last", "neg_h"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (3, 5, 7, 1), (1, 3, 33, 31), (4, 2, 1, 127)])
def test_batchnorm2d_training_statistics_over_n_h_w(shape: Shape, layout: str, dt: str) -> None:
    """``F.batch_norm(x, running_mean, running_var, w, b, training=True, momentum=0.1)`` on
    NCHW: per-channel mean and biased variance over (N, H, W), ``y`` (in x's dtype: AMP keeps
    BatchNorm's parameters in float32), ``save_mean``, ``save_invstd`` and the updated running
    statistics (unbiased variance). x row-major, channels_last or with H reversed in memory."""
    n, c, h, w_ = shape
    kdt, npdt, tol = _dt(dt)
    cnt = n * h * w_
    mom, eps = 0.1, 1e-5
    with FusionDefinition() as fd:
        x, rm, rv, w, b = _t(fd, 4, kdt), _t(fd, 1), _t(fd, 1), _t(fd, 1), _t(fd, 1)
        xf = _f32(fd, x)
        var, mean = fd.ops.var_mean(xf, dims=[0, 2, 3], correction=0)
        invstd = fd.ops.rsqrt(fd.ops.add(var, eps))
        y = fd.ops.mul(fd.ops.sub(xf, _bc(fd, mean, 4, [1])), _bc(fd, fd.ops.mul(invstd, w), 4, [1]))
        fd.add_output(_back(fd, fd.ops.add(y, _bc(fd, b, 4, [1])), kdt))
        fd.add_output(mean)
        fd.add_output(invstd)
        fd.add_output(fd.ops.add(fd.ops.mul(rm, 1 - mom), fd.ops.mul(mean, mom)))
        fd.add_output(fd.ops.add(fd.ops.mul(rv, 1 - mom), fd.ops.mul(var, mom * cnt / (cnt - 1))))
    rng = _rng("bn_train", shape, layout, dt)
    x = _nchw(_randn(rng, shape, 2.0, 0.5, npdt), layout)
    ins = [x, _randn(rng, (c,), 0.3), rng.uniform(0.5, 2.0, c).astype(np.float32),
           _randn(rng, (c,), 0.5, 1.0), _randn(rng, (c,))]
    x64, rm, rv, w, b = map(_d, ins)
    mu = x64.mean((0, 2, 3))
    var = x64.var((0, 2, 3))
    inv = 1 / np.sqrt(var + eps)
    e = (None, slice(None), None, None)
    y = (x64 - mu[e]) * inv[e] * w[e] + b[e]
    want = [y, mu, inv, rm * (1 - mom) + mu * mom, rv * (1 - mom) + var * cnt / (cnt - 1) * mom]
    t32 = (1e-5, 1e-5)
    tols = [tol if dt == "f16" else (1e-4, 1e-4), t32, (1e-4, 1e-4), t32, (1e-4, 1e-5)]
    _check(fd.execute(ins), want, tols, [npdt, np.float32, np.float32, np.float32, np.float32])


@pytest.mark.parametrize("layout", ["contig", "channels_last", "neg_h"])
@pytest.mark.parametrize("shape,groups", [((1, 1, 1, 1), 1), ((2, 6, 5, 7), 3), ((1, 32, 3, 3), 8),
                                          ((2, 4, 1, 127), 2), ((0, 4, 2, 2), 2)])
def test_group_norm_via_reshape_of_a_strided_input(shape: Shape, groups: int, layout: str) -> None:
    """``F.group_norm`` as its decomposition writes it: ``x.view(N, G, -1)``, mean and biased
    variance over the last axis (keepdim), normalize, ``view`` back to NCHW, per-channel
    affine. The reshaped input is channels_last or H-reversed (no row-major view of it)."""
    n, c, h, w_ = shape
    k = (c // groups) * h * w_
    with FusionDefinition() as fd:
        x, w, b = _t(fd, 4), _t(fd, 1), _t(fd, 1)
        g = fd.ops.reshape(x, [n, groups, k])
        var, mean = fd.ops.var_mean(g, dims=[2], correction=0, keepdim=True)
        gn = fd.ops.mul(fd.ops.sub(g, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        y = fd.ops.reshape(gn, [n, c, h, w_])
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bc(fd, w, 4, [1])), _bc(fd, b, 4, [1])))
    rng = _rng("group_norm", shape, groups, layout)
    x = _nchw(_randn(rng, shape, 1.5, -0.2), layout)
    w, b = _lay(_randn(rng, (c,), 0.5, 1.0), "neg"), _randn(rng, (c,))
    g = _d(x).reshape(n, groups, k)
    gn = ((g - g.mean(2, keepdims=True)) / np.sqrt(g.var(2, keepdims=True) + 1e-5)).reshape(shape)
    want = gn * _d(w)[None, :, None, None] + _d(b)[None, :, None, None]
    _check(fd.execute([x, w, b]), [want], (1e-4, 1e-4))


@pytest.mark.parametrize("layout", ["rows_step", "T", "neg"])
@pytest.mark.parametrize("shape", [(2, 3, 1, 5), (1, 7, 3, 127), (3, 1, 2, 1), (2, 5, 7, 33)])
def test_mean_and_unbiased_var_over_axes_1_and_3_keepdim(shape: Shape, layout: str) -> None:
    """``m = x.mean((1, 3), keepdim=True); v = x.var((1, 3), keepdim=True)`` (unbiased) and the
    standardized ``(x - m) / sqrt(v + eps)``, on a strided [N, C, T, F] input (spectrogram
    feature normalization over channels and frequencies)."""
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        v, m = fd.ops.var_mean(x, dims=[1, 3], correction=1, keepdim=True)
        fd.add_output(m)
        fd.add_output(v)
        fd.add_output(fd.ops.div(fd.ops.sub(x, m), fd.ops.sqrt(fd.ops.add(v, 1e-5))))
    rng = _rng("mean_var_13", shape, layout)
    x = _lay(_randn(rng, shape, 3.0, 1.0), layout)
    x64 = _d(x)
    cnt = shape[1] * shape[3]
    m = x64.mean((1, 3), keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = ((x64 - m) ** 2).sum((1, 3), keepdims=True) / (cnt - 1)
        y = (x64 - m) / np.sqrt(v + 1e-5)
    if cnt == 1:  # PyTorch: the unbiased variance of one element is NaN
        assert np.isnan(v).all()
    _check(fd.execute([x]), [m, v, y], [(1e-5, 1e-5), (1e-4, 1e-5), (1e-4, 1e-4)])


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 127), (2, 1031), (1, 4099), (2, 32771)])
def test_pre_ln_residual_add_and_layernorm_two_outputs(shape: Shape, dt: str) -> None:
    """A pre-LN transformer block's ``residual = hidden + residual; hidden = ln(residual)``
    (vLLM / Megatron fused add-norm): both the new residual and the normalized hidden state
    are outputs. The sublayer output is a transposed view, the residual every other row of a
    buffer, LayerNorm's weight and bias float32 (AMP keeps them so)."""
    m, n = shape
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        x, r, w, b = _t(fd, 2, kdt), _t(fd, 2, kdt), _t(fd, 1), _t(fd, 1)
        res = fd.ops.add(_f32(fd, x), _f32(fd, r))
        fd.add_output(_back(fd, res, kdt))
        fd.add_output(_back(fd, _layer_norm_fd(fd, res, w, b, 1, 1e-5), kdt))
    rng = _rng("add_ln", shape, dt)
    x = _lay(_randn(rng, shape, 1.0, 0.0, npdt), "T")
    r = _lay(_randn(rng, shape, 2.0, 0.5, npdt), "rows_step")
    w, b = _randn(rng, (n,), 0.3, 1.0), _randn(rng, (n,), 0.2)
    res = _d(x) + _d(r)
    want = [res, _layer_norm_ref(res, _d(w), _d(b), 1e-5)]
    t = tol if dt != "f32" else (1e-5, 1e-4)
    _check(fd.execute([x, r, w, b]), want, t, [npdt, npdt])


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (3, 16, 127), (1, 2, 1000)])
def test_vit_class_token_expand_cat_pos_embed_and_layernorm(shape: Shape) -> None:
    """ViT's input: ``cls = self.cls_token.expand(B, -1, -1)`` (given as that expanded view,
    zero strides), ``x = torch.cat((cls, patches), dim=1) + self.pos_embed`` (pos_embed [1,
    N + 1, D] expanded the same way), then the first block's LayerNorm; outputs x and
    ln(x). Sizes (B, N, D)."""
    bsz, npatch, d = shape
    with FusionDefinition() as fd:
        cls, patches, pos, w, b = _t(fd, 3), _t(fd, 3), _t(fd, 3), _t(fd, 1), _t(fd, 1)
        x = fd.ops.add(fd.ops.cat([cls, patches], dim=1), pos)
        fd.add_output(x)
        fd.add_output(_layer_norm_fd(fd, x, w, b, 2, 1e-6))
    rng = _rng("vit_cls", shape)
    cls = np.broadcast_to(_randn(rng, (1, 1, d)), (bsz, 1, d))
    pos = np.broadcast_to(_randn(rng, (1, npatch + 1, d), 0.1), (bsz, npatch + 1, d))
    patches = _randn(rng, (bsz, npatch, d))
    w, b = _randn(rng, (d,), 0.3, 1.0), _randn(rng, (d,), 0.2)
    assert cls.strides[0] == 0 and pos.strides[0] == 0
    x = np.concatenate([_d(cls), _d(patches)], axis=1) + _d(pos)
    _check(fd.execute([cls, patches, pos, w, b]), [x, _layer_norm_ref(x, _d(w), _d(b), 1e-6)],
           [(1e-6, 1e-6), (1e-5, 1e-4)])


# ============================================================================ softmax, attention
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape,layout", [((1, 1, 1), "neg"), ((2, 7, 3), "T"), ((1, 127, 5), "rows_step"),
                                          ((3, 3, 1031), "T"), ((2, 1031, 3), "neg"),
                                          ((0, 4, 5), "rows_step")])
def test_segmentation_softmax_over_a_non_last_axis(shape: Shape, layout: str, dim: int) -> None:
    """``torch.softmax(logits, dim=1)`` over the classes of a segmentation head's [N, K, L]
    logits (``dim=0``: over the batch, as a mixture weight), the logits reversed in memory,
    every other sample of a buffer, or stored [N, L, K] (channels-last). Outputs the
    probabilities and ``log_softmax``."""
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        fd.add_output(_softmax_fd(fd, x, dim))
        fd.add_output(_log_softmax_fd(fd, x, dim))
    rng = _rng("seg_softmax", shape, layout, dim)
    x = _lay(_randn(rng, shape, 3.0), layout)
    if shape[dim] == 0:  # amax over an empty axis is an error in PyTorch too (README)
        with pytest.raises(KilnError, match=r"size 0"):
            fd.execute([x])
        return
    x64 = _d(x)
    _check(fd.execute([x]), [_softmax(x64, dim), _log_softmax(x64, dim)], [(1e-5, 1e-6), (1e-5, 1e-5)])


@pytest.mark.parametrize("mask_form", ["size_one_axes", "broadcast_to"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (1, 2, 127), (3, 1, 33)])
def test_attention_scale_plus_padding_and_causal_additive_masks(shape: Shape, mask_form: str) -> None:
    """HF's eager attention: ``scores * scale + attention_mask`` with the padding mask
    [B, 1, 1, S] (0 or ``finfo(float32).min``, from ``_expand_mask``) and a causal mask
    [1, 1, S, S] (0 or -inf), then softmax. Scores are the transposed view of a column-major
    [B, H, S, S] product; the masks are given with their size-one axes, or expanded to
    [B, H, S, S] by ``np.broadcast_to`` (zero strides) for a full-rank input. Key 0 is never
    padded, so every row keeps a finite entry."""
    bsz, heads, s = shape
    scale = 1 / math.sqrt(64)
    full = mask_form == "broadcast_to"
    with FusionDefinition() as fd:
        x = _t(fd, 4)
        pad = _t(fd, 4) if full else fd.define_tensor([-1, 1, 1, -1], F32)
        causal = _t(fd, 4) if full else fd.define_tensor([1, 1, -1, -1], F32)
        fd.add_output(_softmax_fd(fd, fd.ops.add(fd.ops.add(fd.ops.mul(x, scale), pad), causal), 3))
    rng = _rng("attn_masks", shape, mask_form)
    x = _lay(_randn(rng, (bsz, heads, s, s), 4.0), "T")
    lengths = rng.integers(1, s + 1, size=bsz)
    keep = np.arange(s)[None, :] < lengths[:, None]
    pad = np.where(keep, 0.0, F32_MIN).astype(np.float32)[:, None, None, :]
    causal = np.triu(np.full((s, s), NEG_INF, np.float32), 1)[None, None]
    if full:
        pad, causal = (np.broadcast_to(a, (bsz, heads, s, s)) for a in (pad, causal))
    want = _softmax(_d(x) * scale + _d(pad) + _d(causal))
    _check(fd.execute([x, pad, causal]), [want], (1e-5, 1e-6))


@pytest.mark.parametrize("writing", ["triu_full_neg_inf", "iota_masked_fill_finfo_min"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (1, 127), (3, 33)])
def test_causal_mask_from_triu_or_iota_on_transposed_scores(shape: Shape, writing: str) -> None:
    """A causal mask built in the fusion: ``torch.triu(torch.full((S, S), -inf), 1)`` added to
    the scores (GPT-NeoX / Mistral), or ``scores.masked_fill(j > i, finfo.min)`` with ``i, j``
    from ``arange`` (GPT-2's ``torch.where(causal_mask, w, mask_value)``), then softmax; the
    scores are a transposed view. Sizes (B, S)."""
    bsz, s = shape
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        n = fd.ops.size(x, 2)
        if writing == "triu_full_neg_inf":
            mask = fd.ops.triu(fd.ops.full([n, n], NEG_INF, F32), diagonal=1)
            w = fd.ops.add(x, _bc(fd, mask, 3, [1, 2]))
        else:
            i = _bc(fd, fd.ops.iota(n), 2, [0])
            j = _bc(fd, fd.ops.iota(n), 2, [1])
            w = fd.ops.where(_bc(fd, fd.ops.gt(j, i), 3, [1, 2]), F32_MIN, x)
        fd.add_output(_softmax_fd(fd, w, 2))
    rng = _rng("causal_build", shape, writing)
    x = _lay(_randn(rng, (bsz, s, s), 3.0), "T")
    upper = np.triu(np.ones((s, s), bool), 1)
    w = np.where(upper, NEG_INF if writing == "triu_full_neg_inf" else F32_MIN, _d(x))
    _check(fd.execute([x]), [_softmax(w)], (1e-5, 1e-6))


@pytest.mark.parametrize("fill", ["f32_neg_inf", "f32_finfo_min", "f16_finfo_min", "f16_neg_inf"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 7), (3, 5, 127), (2, 2, 1000)])
def test_masked_fill_with_expanded_bool_key_mask(shape: Shape, fill: str) -> None:
    """``scores.masked_fill(~key_mask[:, None, :], value)`` then ``softmax(dim=-1,
    dtype=float32)`` and ``.to(scores.dtype)``: value -inf or ``torch.finfo(dtype).min``, the
    bool key mask [B, S] expanded to [B, T, S] (``np.broadcast_to``, zero stride), scores a
    transposed view. Sample 0 keeps every key, the last masks every key: NaN rows with -inf
    (as PyTorch), uniform rows with finfo.min. Sizes (B, T, S)."""
    bsz, t, s = shape
    dname, value = fill.split("_", 1)
    kdt, npdt, tol = _dt(dname)
    v = {"neg_inf": NEG_INF, "finfo_min": F32_MIN if dname == "f32" else F16_MIN}[value]
    with FusionDefinition() as fd:
        x, keep = _t(fd, 3, kdt), _t(fd, 3, BOOL)
        w = fd.ops.where(fd.ops.logical_not(keep), v, x)
        fd.add_output(_back(fd, _softmax_fd(fd, _f32(fd, w), 2), kdt))
    rng = _rng("masked_fill", shape, fill)
    x = _lay(_randn(rng, (bsz, t, s), 3.0, 0.0, npdt), "T")
    km = rng.random((bsz, s)) < 0.6
    km[0] = True
    if bsz > 1:
        km[-1] = False
    keep = np.broadcast_to(km[:, None, :], (bsz, t, s))
    want = _softmax(np.where(keep, _d(x), v))
    if bsz > 1:
        assert np.isnan(want[-1]).all() == (value == "neg_inf")
    _check(fd.execute([x, keep]), [want], tol if dname == "f16" else (1e-5, 1e-6), [npdt])


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 4), (2, 3, 7, 8, 16), (1, 2, 127, 16, 130),
                                   (1, 1, 1031, 4, 1100)])
def test_decode_attention_over_a_kv_cache_prefix(shape: Shape) -> None:
    """One decoding step over a KV cache: q [B, H, 1, D] (a size-one query axis), keys and
    values ``cache[:, :, :L]`` (views of a [B, H, MAX, D] cache), ``p = softmax(sum(q * k,
    -1) * scale)`` over the L keys and ``o = sum(p[..., None] * v, 2)``. Sizes (B, H, L, D,
    MAX)."""
    bsz, heads, ln, d, mx = shape
    scale = 1 / math.sqrt(d)
    with FusionDefinition() as fd:
        q = fd.define_tensor([-1, -1, 1, -1], F32)
        k, v = _t(fd, 4), _t(fd, 4)
        sc = fd.ops.mul(fd.ops.sum(fd.ops.mul(q, k), dims=[3]), scale)
        p = _softmax_fd(fd, sc, 2)
        fd.add_output(p)
        fd.add_output(fd.ops.sum(fd.ops.mul(_bc(fd, p, 4, [0, 1, 2]), v), dims=[2]))
    rng = _rng("decode_attn", shape)
    q = _randn(rng, (bsz, heads, 1, d))
    kc, vc = _randn(rng, (bsz, heads, mx, d), 2.0), _randn(rng, (bsz, heads, mx, d))
    k, v = kc[:, :, :ln], vc[:, :, :ln]
    p = _softmax((_d(q) * _d(k)).sum(-1) * scale)
    o = (p[..., None] * _d(v)).sum(2)
    _check(fd.execute([q, k, v]), [p, o], [(1e-5, 1e-6), (1e-5, 1e-5)])


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 4099), (1, 32771), (3, 1031)])
def test_sampling_softmax_with_runtime_temperature_on_long_half_rows(shape: Shape, dt: str) -> None:
    """Next-token sampling: ``softmax(logits.float() / temperature, -1)`` over a vocabulary of
    4099 or 32771, the logits every other row of a half buffer and the temperature a
    runtime float scalar; also ``log_softmax`` (float32) for the log-probabilities."""
    kdt, npdt, _ = _dt(dt)
    with FusionDefinition() as fd:
        x = _t(fd, 2, kdt)
        temp = fd.define_scalar(dtype=F32)
        z = fd.ops.div(_f32(fd, x), temp)
        fd.add_output(_softmax_fd(fd, z, 1))
        fd.add_output(_log_softmax_fd(fd, z, 1))
    rng = _rng("sampling", shape, dt)
    x = _lay(_randn(rng, shape, 4.0, 0.0, npdt), "rows_step")
    z = _d(x) / 0.7
    _check(fd.execute([x, 0.7]), [_softmax(z), _log_softmax(z)], [(1e-4, 1e-9), (1e-5, 1e-4)],
           [np.float32, np.float32])


# ============================================================================ activations
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape,layout", [((1, 1), "neg"), ((1, 7), "step"), ((3, 1031), "T"),
                                          ((2, 4099), "step"), ((0, 5), "T"), ((127, 3), "rows_step"),
                                          ((5, 1000), "neg")])
def test_gelu_erf_and_tanh_forms(shape: Shape, layout: str, dt: str) -> None:
    """``F.gelu(x)`` (``0.5 x (1 + erf(x / sqrt 2))``) and ``F.gelu(x, approximate='tanh')``
    (``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``) computed in float, stored in x's
    dtype, on strided views."""
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        x = _t(fd, 2, kdt)
        xf = _f32(fd, x)
        erf = fd.ops.mul(fd.ops.mul(xf, 0.5), fd.ops.add(fd.ops.erf(fd.ops.mul(xf, 1 / math.sqrt(2))), 1.0))
        inner = fd.ops.mul(fd.ops.add(xf, fd.ops.mul(fd.ops.mul(fd.ops.mul(xf, xf), xf), 0.044715)),
                           math.sqrt(2 / math.pi))
        tnh = fd.ops.mul(fd.ops.mul(xf, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))
        fd.add_output(_back(fd, erf, kdt))
        fd.add_output(_back(fd, tnh, kdt))
    rng = _rng("gelu", shape, layout, dt)
    x = _lay(_randn(rng, shape, 3.0, 0.0, npdt), layout)
    x64 = _d(x)
    want_erf = 0.5 * x64 * (1 + _erf(x64 / math.sqrt(2)))
    want_tanh = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    _check(fd.execute([x]), [want_erf, want_tanh], tol if dt != "f32" else (1e-5, 1e-6), [npdt, npdt])


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("mode", ["chunk_views", "interleaved_views", "slice_in_fusion",
                                  "step_slice_in_fusion"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 127), (2, 2053), (0, 4)])
def test_swiglu_on_strided_halves_of_a_fused_projection(shape: Shape, mode: str, dt: str) -> None:
    """LLaMA's MLP after a fused gate-up projection ``gu`` [M, 2H]: ``silu(gate) * up`` with
    ``gate, up = gu.chunk(2, -1)`` or the interleaved ``gu[..., ::2], gu[..., 1::2]``, either
    passed as the two NumPy views or sliced in the fusion (``fd.ops.slice``, stepped for the
    interleaved form) from ``gu`` given as every other row of a buffer. 2H = 4106 makes rows
    longer than 4096. Sizes (M, H)."""
    m, hh = shape
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        if mode.endswith("views"):
            gate, up = _t(fd, 2, kdt), _t(fd, 2, kdt)
        else:
            gu = _t(fd, 2, kdt)
            if mode == "slice_in_fusion":
                gate = fd.ops.slice(gu, [0, 0], [m, hh])
                up = fd.ops.slice(gu, [0, hh], [m, 2 * hh])
            else:
                gate = fd.ops.slice(gu, [0, 0], [m, 2 * hh], [1, 2])
                up = fd.ops.slice(gu, [0, 1], [m, 2 * hh], [1, 2])
        g = _f32(fd, gate)
        fd.add_output(_back(fd, fd.ops.mul(fd.ops.mul(g, fd.ops.sigmoid(g)), _f32(fd, up)), kdt))
    rng = _rng("swiglu", shape, mode, dt)
    gu = _randn(rng, (m, 2 * hh), 2.0, 0.0, npdt)
    if mode == "chunk_views":
        ins: List[Any] = [gu[:, :hh], gu[:, hh:]]
    elif mode == "interleaved_views":
        ins = [gu[:, ::2], gu[:, 1::2]]
    else:
        ins = [_lay(gu, "rows_step")]
    g64, u64 = ((_d(gu[:, :hh]), _d(gu[:, hh:])) if mode in ("chunk_views", "slice_in_fusion")
                else (_d(gu[:, ::2]), _d(gu[:, 1::2])))
    want = g64 / (1 + np.exp(-g64)) * u64
    _check(fd.execute(ins), [want], tol if dt != "f32" else (1e-5, 1e-6), [npdt])


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (1, 127, 3, 16), (0, 2, 2, 4)])
def test_llama_rotary_embedding_on_transposed_heads(shape: Shape, dt: str) -> None:
    """LLaMA's ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` with
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``; q is ``q_proj(h).view(B, S, H,
    D).transpose(1, 2)`` (a transposed view), cos and sin rows ``offset:offset + S`` of the
    cached [MAX, D] tables (a decode with a KV cache), broadcast over batch and heads. Sizes
    (B, S, H, D)."""
    bsz, s, heads, d = shape
    kdt, npdt, tol = _dt(dt)
    half = d // 2
    with FusionDefinition() as fd:
        q, cos, sin = _t(fd, 4, kdt), _t(fd, 2, kdt), _t(fd, 2, kdt)
        x1 = fd.ops.slice(q, [0, 0, 0, 0], [bsz, heads, s, half])
        x2 = fd.ops.slice(q, [0, 0, 0, half], [bsz, heads, s, d])
        rot = fd.ops.cat([fd.ops.neg(x2), x1], dim=3)
        out = fd.ops.add(fd.ops.mul(_f32(fd, q), _bc(fd, _f32(fd, cos), 4, [2, 3])),
                         fd.ops.mul(_f32(fd, rot), _bc(fd, _f32(fd, sin), 4, [2, 3])))
        fd.add_output(_back(fd, out, kdt))
    rng = _rng("rope", shape, dt)
    q = np.swapaxes(_randn(rng, (bsz, s, heads, d), 1.0, 0.0, npdt), 1, 2)
    offset, mx = 5, s + 9
    inv = 1.0 / (10000 ** (np.arange(0, d, 2) / d))
    ang = np.arange(mx)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos_c, sin_c = np.cos(emb).astype(npdt), np.sin(emb).astype(npdt)
    cos, sin = cos_c[offset:offset + s], sin_c[offset:offset + s]
    q64 = _d(q)
    rot = np.concatenate([-q64[..., half:], q64[..., :half]], axis=-1)
    want = q64 * _d(cos) + rot * _d(sin)
    _check(fd.execute([q, cos, sin]), [want], tol if dt != "f32" else (1e-5, 1e-6), [npdt])


# ============================================================================ losses
@pytest.mark.parametrize("idx", ["int64", "int32"])
@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 7), (3, 5, 127), (1, 2, 1031), (2, 1, 32771)])
def test_causal_lm_shifted_log_softmax_nll_with_take_along_axis(shape: Shape, idx: str) -> None:
    """The causal-LM loss with the shift written as views: ``logits[:, :-1]`` of [B, S + 1, V]
    and ``labels[:, 1:, None]`` of [B, S + 1] (offset views), ``log_softmax`` over the
    vocabulary, ``take_along_axis`` of the labels, per-token NLL [B, S] and its mean. Sizes
    (B, S, V)."""
    bsz, s, vocab = shape
    kidx = I64 if idx == "int64" else I32
    with FusionDefinition() as fd:
        x = _t(fd, 3)
        lab = fd.define_tensor([-1, -1, 1], kidx)
        logp = _log_softmax_fd(fd, x, 2)
        nll = fd.ops.neg(fd.ops.squeeze(fd.ops.take_along_axis(logp, lab, 2), [2]))
        fd.add_output(nll)
        fd.add_output(fd.ops.mean(nll, dims=[0, 1]))
    rng = _rng("shifted_nll", shape, idx)
    logits_buf = _randn(rng, (bsz, s + 1, vocab), 3.0)
    labels_buf = rng.integers(0, vocab, size=(bsz, s + 1)).astype(idx)
    x, lab = logits_buf[:, :-1], labels_buf[:, 1:, None]
    lp = _log_softmax(_d(x))
    nll = -np.take_along_axis(lp, lab.astype(np.int64), 2)[..., 0]
    _check(fd.execute([x, lab]), [nll, np.asarray(nll.mean())], [(1e-5, 1e-5), (1e-5, 1e-5)])


@pytest.mark.parametrize("idx", ["int64", "int32"])
@pytest.mark.parametrize("shape,layout", [((1, 3), "T"), ((5, 2), "offset"), ((7, 127), "T"),
                                          ((13, 1031), "offset"), ((2, 32771), "T")])
def test_cross_entropy_with_ignore_index_masked_mean(shape: Shape, layout: str, idx: str) -> None:
    """``F.cross_entropy(logits, labels, ignore_index=-100)`` (mean over the kept tokens):
    ``valid = labels != -100``, the label clamped to 0 where ignored for the gather
    (``take_along_axis``), ``sum(where(valid, nll, 0)) / valid.sum()``. Logits are a
    transposed or offset view, labels every other entry of a buffer; row 0 is always kept.
    Also returns the per-token loss (0 where ignored, as ``reduction='none'``)."""
    n, vocab = shape
    kidx = I64 if idx == "int64" else I32
    with FusionDefinition() as fd:
        x, lab = _t(fd, 2), _t(fd, 1, kidx)
        valid = fd.ops.ne(lab, -100)
        safe = fd.ops.where(valid, lab, 0)
        logp = _log_softmax_fd(fd, x, 1)
        picked = fd.ops.squeeze(fd.ops.take_along_axis(logp, _bc(fd, safe, 2, [0]), 1), [1])
        per = fd.ops.where(valid, fd.ops.neg(picked), 0.0)
        fd.add_output(per)
        fd.add_output(fd.ops.div(fd.ops.sum(per, dims=[0]), fd.ops.sum(fd.ops.cast(valid, F32), dims=[0])))
    rng = _rng("ce_ignore", shape, layout, idx)
    x = _lay(_randn(rng, shape, 3.0), layout)
    labels = rng.integers(0, vocab, size=n)
    labels[rng.random(n) < 0.3] = -100
    labels[0] = rng.integers(0, vocab)
    lab = _lay(labels.astype(idx), "step")
    lp = _log_softmax(_d(x))
    valid = labels != -100
    per = np.where(valid, -lp[np.arange(n), np.where(valid, labels, 0)], 0.0)
    _check(fd.execute([x, lab]), [per, np.asarray(per.sum() / valid.sum())], (1e-5, 1e-5))


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 2), (3, 1031), (2, 4099), (0, 5)])
def test_label_smoothing_cross_entropy_per_token(shape: Shape, dt: str) -> None:
    """``F.cross_entropy(logits.float(), y, label_smoothing=0.1, reduction='none')``:
    ``(1 - eps) * nll + eps * mean_j(-log_softmax_j)``, on float32 or bf16 logits, every other
    row of a buffer, labels int64 with a size-one axis, ``y[:, None]``, reversed in memory.
    An empty batch gives an empty loss."""
    n, vocab = shape
    eps = 0.1
    kdt, npdt, _ = _dt(dt)
    with FusionDefinition() as fd:
        xh, lab = _t(fd, 2, kdt), fd.define_tensor([-1, 1], I64)
        logp = _log_softmax_fd(fd, _f32(fd, xh), 1)
        nll = fd.ops.neg(fd.ops.squeeze(fd.ops.take_along_axis(logp, lab, 1), [1]))
        smooth = fd.ops.neg(fd.ops.mean(logp, dims=[1]))
        fd.add_output(fd.ops.add(fd.ops.mul(nll, 1 - eps), fd.ops.mul(smooth, eps)))
    rng = _rng("label_smooth", shape, dt)
    x = _lay(_randn(rng, shape, 3.0, 0.0, npdt), "rows_step")
    y = rng.integers(0, vocab, size=n)
    lab = _lay(y[:, None], "neg")
    lp = _log_softmax(_d(x))
    want = (1 - eps) * -lp[np.arange(n), y] + eps * -lp.mean(1)
    _check(fd.execute([x, lab]), [want], (1e-5, 1e-5), [np.float32])


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 33, 127), (0, 3, 4), (4, 1, 1031)])
def test_mean_pooling_of_seq_first_states_with_bool_padding_mask(shape: Shape) -> None:
    """sentence-transformers mean pooling on fairseq's T x B x C states: ``x =
    states.transpose(0, 1)`` (a transposed view), ``m = ~padding_mask`` a bool [B, S] given as
    every other column of a buffer, ``sum(x * m[..., None], 1) / clamp(m.sum(1), min=1e-9)``
    (a sample with no tokens pools to 0). Also the token count (int64). Sizes (B, S, H)."""
    bsz, s, h = shape
    with FusionDefinition() as fd:
        x, keep = _t(fd, 3), _t(fd, 2, BOOL)
        mf = fd.ops.cast(keep, F32)
        num = fd.ops.sum(fd.ops.mul(x, _bc(fd, mf, 3, [0, 1])), dims=[1])
        den = fd.ops.clamp(fd.ops.sum(mf, dims=[1]), min=1e-9)
        fd.add_output(fd.ops.div(num, _bc(fd, den, 2, [0])))
        fd.add_output(fd.ops.sum(fd.ops.cast(keep, I64), dims=[1]))
    rng = _rng("mean_pool", shape)
    x = np.swapaxes(_randn(rng, (s, bsz, h)), 0, 1)
    lengths = rng.integers(1, s + 1, size=bsz)
    if bsz > 1:
        lengths[-1] = 0
    km = np.arange(s)[None, :] < lengths[:, None]
    keep = _lay(km, "step")
    m = km[:, :, None].astype(np.float64)
    want = (_d(x) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    outs = fd.execute([x, keep])
    _check(outs, [want, lengths.astype(np.int64)], [(1e-5, 1e-6), (0.0, 0.0)], [np.float32, np.int64])


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 3), (3, 49, 127), (2, 1, 1031)])
def test_mae_masked_patch_mse_with_reversed_bool_mask(shape: Shape, dt: str) -> None:
    """MAE's loss: ``loss = ((pred - target) ** 2).mean(-1)`` per patch, then ``(loss *
    mask).sum() / mask.sum()`` over the masked patches; pred (half under AMP) a transposed
    view, target every other sample of a buffer, the bool mask reversed in memory. Sizes
    (N, L, P); patch 0 of sample 0 is always masked."""
    n, ln, p = shape
    kdt, npdt, _ = _dt(dt)
    with FusionDefinition() as fd:
        pred, target, mask = _t(fd, 3, kdt), _t(fd, 3), _t(fd, 2, BOOL)
        dd = fd.ops.sub(_f32(fd, pred), target)
        per = fd.ops.mean(fd.ops.mul(dd, dd), dims=[2])
        mf = fd.ops.cast(mask, F32)
        fd.add_output(fd.ops.div(fd.ops.sum(fd.ops.mul(per, mf), dims=[0, 1]), fd.ops.sum(mf, dims=[0, 1])))
    rng = _rng("mae", shape, dt)
    pred = _lay(_randn(rng, shape, 1.0, 0.0, npdt), "T")
    target = _lay(_randn(rng, shape), "rows_step")
    mk = rng.random((n, ln)) < 0.75
    mk[0, 0] = True
    mask = _lay(mk, "neg")
    per = ((_d(pred) - _d(target)) ** 2).mean(-1)
    _check(fd.execute([pred, target, mask]), [np.asarray((per * mk).sum() / mk.sum())], (1e-5, 1e-6))


# ============================================================================ optimizers
@pytest.mark.parametrize("sizes", [((1, 1), (1,), (1, 1, 1)), ((7, 3), (127,), (2, 5, 3)),
                                   ((33, 31), (1000,), (3, 7, 2)), ((5, 4099), (3,), (1, 1, 1031))])
def test_clip_grad_norm_over_tensors_of_different_shapes(sizes: Tuple[Shape, Shape, Shape]) -> None:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)`` over five gradients of
    different shapes and layouts (a transposed matrix, a reversed vector, a stepped 3-D
    tensor, a [1] scalar parameter and an empty [0, 4] one): ``total = sqrt(sum_i
    sum(g_i^2))``, ``coef = clamp(max_norm / (total + 1e-6), max=1)``; outputs the total norm
    and scales every non-empty gradient in place (``g.mul_(coef)``, ``alias_input``): the
    views are written, the rest of their buffers is left alone."""
    s1, s2, s3 = sizes
    with FusionDefinition() as fd:
        gs = [_t(fd, 2), _t(fd, 1), _t(fd, 3), _t(fd, 1), _t(fd, 2)]
        sq = [fd.ops.sum(fd.ops.mul(g, g), dims=list(range(len(g.shape)))) for g in gs]
        tot = sq[0]
        for q in sq[1:]:
            tot = fd.ops.add(tot, q)
        norm = fd.ops.sqrt(tot)
        coef = fd.ops.clamp(fd.ops.div(1.0, fd.ops.add(norm, 1e-6)), max=1.0)
        fd.add_output(norm)
        for g in gs[:4]:
            fd.add_output(fd.ops.mul(g, coef), alias_input=g)
    rng = _rng("clip_norm", sizes)
    ins = [_lay(_randn(rng, s1, 0.05), "T"), _lay(_randn(rng, s2, 0.05), "neg"),
           _lay(_randn(rng, s3, 0.05), "step"), _randn(rng, (1,), 0.5), np.zeros((0, 4), np.float32)]
    g64 = [_d(g) for g in ins]
    norm = math.sqrt(sum(float((g * g).sum()) for g in g64))
    coef = min(1.0 / (norm + 1e-6), 1.0)
    bufs = [_outside(g) for g in ins[:4]]
    before = [b.copy() for b, _ in bufs]
    _check(fd.execute(ins), [np.asarray(norm)], (1e-5, 1e-7))
    _check(ins[:4], [g * coef for g in g64[:4]], (1e-5, 1e-7))
    for (buf, gap), old in zip(bufs, before):
        np.testing.assert_array_equal(buf[gap], old[gap])


_ADAM_SHAPES = [((1, 1), 1), ((7, 3), 1000), ((127, 33), 1), ((0, 5), 1000), ((3, 1031), 1000)]
# An empty parameter updated in place: NumPy 2 gives fresh empty arrays zero strides, which
# must not read as a broadcast view (nothing to share without elements).
_ADAM_CASES = [pytest.param(shape, step, in_place)
               for shape, step in _ADAM_SHAPES for in_place in (False, True)]


@pytest.mark.parametrize("dt", ["f32", "f64"])
@pytest.mark.parametrize("shape,step,in_place", _ADAM_CASES)
def test_adam_step_with_runtime_bias_corrections(shape: Shape, step: int, in_place: bool, dt: str) -> None:
    """``torch.optim.Adam``'s single-tensor step (weight decay 0): ``m.lerp_(g, 1 - b1)``,
    ``v.mul_(b2).addcmul_(g, g, value=1 - b2)``, ``denom = sqrt(v) / sqrt(bc2) + eps``,
    ``p -= lr / bc1 * m / denom``, with lr, betas, eps and both bias corrections ``1 -
    beta ** step`` as runtime scalars. The parameter is a transposed view, the gradient
    stepped, m reversed, v every other row of a buffer; float32 or float64 state. Returned as
    outputs, or written into p, m and v in place (``alias_input``, as the optimizer does),
    leaving the rest of their buffers alone; an empty parameter is a no-op."""
    kdt, npdt, _ = _dt(dt)
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    with FusionDefinition() as fd:
        p, g, m, v = (_t(fd, 2, kdt) for _ in range(4))
        s_lr, s_b1, s_b2, s_eps, s_bc1, s_bc2 = (fd.define_scalar(dtype=F64) for _ in range(6))
        m2 = fd.ops.add(m, fd.ops.mul(fd.ops.sub(g, m), fd.ops.sub(1.0, s_b1)))
        v2 = fd.ops.add(fd.ops.mul(v, s_b2), fd.ops.mul(fd.ops.mul(g, g), fd.ops.sub(1.0, s_b2)))
        denom = fd.ops.add(fd.ops.div(fd.ops.sqrt(v2), fd.ops.sqrt(s_bc2)), s_eps)
        p2 = fd.ops.sub(p, fd.ops.mul(fd.ops.div(m2, denom), fd.ops.div(s_lr, s_bc1)))
        for o, state in ((p2, p), (m2, m), (v2, v)):
            fd.add_output(_back(fd, o, kdt), alias_input=state if in_place else None)
    rng = _rng("adam", shape, step, dt)
    p = _lay(_randn(rng, shape, 1.0, 0.0, npdt), "T")
    g = _lay(_randn(rng, shape, 0.1, 0.0, npdt), "step")
    m = _lay(_randn(rng, shape, 0.05, 0.0, npdt), "neg")
    v = _lay(np.abs(_randn(rng, shape, 0.01, 0.0, npdt)), "rows_step")
    p64, g64, m64, v64 = map(_d, (p, g, m, v))
    m2 = m64 + (g64 - m64) * (1 - b1)
    v2 = v64 * b2 + g64 * g64 * (1 - b2)
    p2 = p64 - lr / bc1 * m2 / (np.sqrt(v2) / math.sqrt(bc2) + eps)
    tol = (1e-5, 1e-6) if dt == "f32" else (1e-12, 1e-14)
    bufs = [_outside(a) for a in (p, m, v)]
    before = [b.copy() for b, _ in bufs]
    outs = fd.execute([p, g, m, v, lr, b1, b2, eps, bc1, bc2])
    if in_place:
        assert outs == []
        outs = [p, m, v]
        for (buf, gap), old in zip(bufs, before):
            np.testing.assert_array_equal(buf[gap], old[gap])
    _check(outs, [p2, m2, v2], tol, [npdt] * 3)


# ============================================================================ embeddings
@pytest.mark.parametrize("idx,ids_layout", [("int64", "step"), ("int32", "neg")])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 1031, 3), (5, 127, 33), (0, 7, 5), (3, 1000, 130)])
def test_scaled_embedding_index_select_plus_position_window(shape: Shape, ids_layout: str, idx: str) -> None:
    """``F.embedding(ids, W) * sqrt(D) + pos_emb[offset:offset + N]`` (Gemma's scaled
    embedding, a decode window of learned positions): ``index_select(W, 0, ids)`` with int64
    or int32 ids given as a stepped or reversed view, W [V, D] the transposed view of a
    tied [D, V] output projection, the position rows an offset window. An empty batch of
    ids gives [0, D]. Sizes (N, V, D)."""
    n, vocab, d = shape
    kidx = I64 if idx == "int64" else I32
    with FusionDefinition() as fd:
        w, ids, pos = _t(fd, 2), _t(fd, 1, kidx), _t(fd, 2)
        e = fd.ops.index_select(w, ids, 0)
        fd.add_output(fd.ops.add(fd.ops.mul(e, math.sqrt(d)), pos))
    rng = _rng("embedding", shape, ids_layout, idx)
    w = _randn(rng, (d, vocab)).T
    ids_ = rng.integers(0, vocab, size=n)
    if n > 1:
        ids_[0], ids_[-1] = 0, vocab - 1
    ids = _lay(ids_.astype(idx), ids_layout)
    offset = 3
    pos_tab = _randn(rng, (n + 2 * offset, d), 0.1)
    pos = pos_tab[offset:offset + n]
    want = _d(w)[ids_] * math.sqrt(d) + _d(pos)
    _check(fd.execute([w, ids, pos]), [want], (1e-6, 1e-6))


# ============================================================================ shared buffers, reuse
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (1, 127, 2, 64)])
def test_qk_norm_on_views_of_a_fused_qkv_buffer(shape: Shape, dt: str) -> None:
    """Qwen3 / OLMo-2 attention input: ``qkv = qkv_proj(h).view(B, S, 3, H, D)``, ``q, k, v =
    qkv.unbind(2)`` (three strided views of one buffer), RMSNorm over D of q and k with their
    own weights, then ``.transpose(1, 2)`` of q, k and v to [B, H, S, D]. Sizes (B, S, H, D)."""
    bsz, s, heads, d = shape
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        q, k, v = _t(fd, 4, kdt), _t(fd, 4, kdt), _t(fd, 4, kdt)
        wq, wk = _t(fd, 1, kdt), _t(fd, 1, kdt)

        def rms(x: Any, w: Any) -> Any:
            xf = _f32(fd, x)
            r = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(xf, xf), dims=[3], keepdim=True), 1e-6))
            return _back(fd, fd.ops.mul(fd.ops.mul(xf, r), _bc(fd, _f32(fd, w), 4, [3])), kdt)
        for t in (rms(q, wq), rms(k, wk), v):
            fd.add_output(fd.ops.permute(t, [0, 2, 1, 3]))
    rng = _rng("qkv_views", shape, dt)
    qkv = _randn(rng, (bsz, s, 3, heads, d), 1.5, 0.0, npdt)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    wq, wk = _randn(rng, (d,), 0.2, 1.0, npdt), _randn(rng, (d,), 0.2, 1.0, npdt)

    def rms_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        x64 = _d(x)
        return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * _d(w)).transpose(0, 2, 1, 3)
    want = [rms_ref(q, wq), rms_ref(k, wk), _d(v).transpose(0, 2, 1, 3)]
    _check(fd.execute([q, k, v, wq, wk]), want, tol if dt != "f32" else (1e-5, 1e-5), [npdt] * 3)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 7, 4), (1, 5, 127, 4), (2, 2, 1031, 3)])
def test_mamba_causal_conv1d_on_overlapping_sliding_windows(shape: Shape) -> None:
    """Mamba's causal depthwise conv1d written with ``unfold``: ``x`` [B, C, L] left-padded by
    K - 1, ``windows = xpad.unfold(-1, K, 1)`` [B, C, L, K] (overlapping windows: NumPy's
    ``sliding_window_view``, a view whose elements share memory), ``y = silu(sum(windows *
    w[None, :, None, :], -1) + b)``. Sizes (B, C, L, K)."""
    bsz, c, ln, ksz = shape
    with FusionDefinition() as fd:
        win, w, b = _t(fd, 4), _t(fd, 2), _t(fd, 1)
        y = fd.ops.add(fd.ops.sum(fd.ops.mul(win, _bc(fd, w, 4, [1, 3])), dims=[3]), _bc(fd, b, 3, [1]))
        fd.add_output(fd.ops.mul(y, fd.ops.sigmoid(y)))
    rng = _rng("mamba_unfold", shape)
    x = _randn(rng, (bsz, c, ln))
    xpad = np.concatenate([np.zeros((bsz, c, ksz - 1), np.float32), x], axis=-1)
    win = np.lib.stride_tricks.sliding_window_view(xpad, ksz, axis=-1)
    assert win.shape == (bsz, c, ln, ksz) and not win.flags.c_contiguous or win.size <= 1
    w, b = _randn(rng, (c, ksz), 0.5), _randn(rng, (c,), 0.1)
    y = (_d(win) * _d(w)[None, :, None, :]).sum(-1) + _d(b)[None, :, None]
    _check(fd.execute([win, w, b]), [y / (1 + np.exp(-y))], (1e-5, 1e-6))


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 4099)])
def test_one_rmsnorm_definition_run_on_every_layout_in_turn(shape: Shape, dt: str) -> None:
    """A module's RMSNorm (one ``FusionDefinition``, as a cached fusion is reused call after
    call) fed the same values in every layout in turn, then row-major again: row-major,
    transposed, stepped, offset by 3 elements (misaligned), every other row, reversed,
    Fortran-ordered, and rows expanded from one (zero stride). Kernels are specialised on the
    stride pattern and alignment; no call may run another layout's kernel."""
    kdt, npdt, tol = _dt(dt)
    with FusionDefinition() as fd:
        x, w = _t(fd, 2, kdt), _t(fd, 1, kdt)
        xf = _f32(fd, x)
        r = fd.ops.rsqrt(fd.ops.add(fd.ops.mean(fd.ops.mul(xf, xf), dims=[1], keepdim=True), 1e-6))
        fd.add_output(_back(fd, fd.ops.mul(fd.ops.mul(xf, r), _bc(fd, _f32(fd, w), 2, [1])), kdt))
        fd.add_output(fd.ops.sum(xf, dims=[0]))
    rng = _rng("layout_reuse", shape, dt)
    a = _randn(rng, shape, 1.0, 0.2, npdt)
    w = _randn(rng, (shape[1],), 0.3, 1.0, npdt)
    layouts = ["contig", "T", "step", "offset", "rows_step", "neg", "fortran", "expanded", "contig"]
    for i, kind in enumerate(layouts):
        x = np.broadcast_to(a[:1], shape) if kind == "expanded" else _lay(a, kind)
        wv = _lay(w, ["contig", "step", "neg", "offset"][i % 4])
        x64, w64 = _d(x), _d(wv)
        want = [x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6) * w64, x64.sum(0)]
        try:
            _check(fd.execute([x, wv]), want, [tol if dt != "f32" else (1e-5, 1e-5), (1e-5, 1e-4)])
        except AssertionError as e:
            raise AssertionError(f"call {i} ({kind} x, weight {wv.strides}): {e}") from None


# ============================================================================ contiguity contract
@pytest.mark.parametrize("layout", ["T", "step", "neg", "broadcast_to"])
def test_declared_contiguous_input_refuses_strided_views_naming_the_input(layout: str) -> None:
    """An input declared ``contiguity=[True, True]`` (nvFuser's contiguous tensor) given a
    transposed, stepped, reversed or expanded view: a ``KilnError`` naming the input, before
    anything runs; the same definition still runs row-major arrays."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], F32, contiguity=[True, True])
        w, b = _t(fd, 1), _t(fd, 1)
        fd.add_output(_layer_norm_fd(fd, x, w, b, 1, 1e-5))
    rng = _rng("contig_refuse", layout)
    base = _randn(rng, (6, 9))
    w, b = _randn(rng, (9,), 0.3, 1.0), _randn(rng, (9,))
    x = np.broadcast_to(base[:1], (6, 9)) if layout == "broadcast_to" else _lay(base, layout)
    assert not x.flags.c_contiguous
    with pytest.raises(KilnError) as info:
        fd.execute([x, w, b])
    msg = str(info.value)
    assert "T0" in msg or "input 0" in msg, msg
    assert "contig" in msg or "stride" in msg, msg
    (got,) = fd.execute([np.ascontiguousarray(x), w, b])
    np.testing.assert_allclose(got, _layer_norm_ref(_d(x), _d(w), _d(b), 1e-5), rtol=1e-5, atol=1e-5)
