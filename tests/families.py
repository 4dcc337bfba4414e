"""Fusions from real model families, written the way model code writes them, with float64
NumPy references.

Each builder takes the sizes of one case (a tuple; what each entry means is in the builder's
docstring) and returns a :class:`Family`: the unscheduled ``FusionDefinition`` (symbolic
shapes; constants that model code derives from a size, such as ``1 / N`` or
``1 / sqrt(head_dim)``, are baked in for those sizes, as a tracer would), a function making
NumPy inputs for given sizes (seeded), the float64 reference, the smallest number of kernels
that can compute it (1 wherever one kernel can: a grid-wide reduction followed by its
broadcast is one persistent kernel) and the tolerances.

``SPECS`` lists every builder with awkward CPU sizes (1, primes, non-multiples of 4, tall,
wide), GPU sizes and one model-like size for ``benches/families.py``.

Inputs are NumPy arrays and Python numbers (runtime scalars, ``define_scalar``) in the order
of the definition. BFloat16 arrays need ``ml_dtypes``; :func:`bf16_or_skip`-style callers
handle the ImportError.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
from kiln import DataType, FusionDefinition

Sizes = Tuple[int, ...]

F32_MIN = float(np.finfo(np.float32).min)  # torch.finfo(torch.float32).min: HF's mask value
LN_EPS = 1e-5
RMS_EPS = 1e-6


# ----------------------------------------------------------------------------- the record
@dataclass
class Family:
    """One fusion of a model family, with what a test or a benchmark needs to run it."""

    name: str
    sizes: Sizes
    fd: FusionDefinition
    make_inputs: Callable[[Sizes, int], List[Any]]  # (sizes, seed) -> NumPy arrays and scalars
    reference: Callable[..., List[np.ndarray]]  # float64 outputs from float64-cast inputs
    kernels: int = 1  # the fewest kernels that can do it
    rtol: float = 1e-5
    atol: float = 1e-5
    out_tols: Optional[Sequence[Optional[Tuple[float, float]]]] = None  # per output, overrides
    # Minimum bytes moved (inputs read once, outputs written once) when that is less than the
    # inputs' and outputs' sizes (a gather reads only the rows it selects).
    min_bytes: Optional[Callable[[Sequence[Any], Sequence[Any]], int]] = None
    notes: str = ""
    dtypes: Tuple[str, ...] = field(default_factory=tuple)  # low-precision dtypes it uses

    def inputs(self, seed: int = 0) -> List[Any]:
        """NumPy inputs for this family's sizes."""
        return self.make_inputs(self.sizes, seed)

    def stand_ins(self) -> List[Any]:
        """Inputs of the right shapes and dtypes with no values drawn (zeros), for ``fd.lower``."""
        return self.make_inputs(self.sizes, SHAPES_ONLY)

    def expected(self, inputs: Sequence[Any]) -> List[np.ndarray]:
        """The float64 reference outputs for NumPy ``inputs``."""
        return [np.asarray(r, dtype=np.float64) for r in self.reference(*to_f64(inputs))]

    def tol(self, i: int) -> Tuple[float, float]:
        """(rtol, atol) of output ``i``."""
        if self.out_tols is not None and i < len(self.out_tols) and self.out_tols[i] is not None:
            return self.out_tols[i]  # type: ignore[return-value]
        return self.rtol, self.atol

    def bytes_moved(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
        """Minimum traffic of one call in bytes."""
        if self.min_bytes is not None:
            return int(self.min_bytes(inputs, outputs))
        return sum(_nbytes(a) for a in list(inputs) + list(outputs))


@dataclass(frozen=True)
class Spec:
    """A builder with the sizes it is tested and benchmarked at."""

    build: Callable[[Sizes], Family]
    cpu: Tuple[Sizes, ...]
    gpu: Tuple[Sizes, ...]
    bench: Sizes

    @property
    def name(self) -> str:
        return self.build.__name__


SPECS: List[Spec] = []


def family(cpu: Sequence[Sizes], gpu: Sequence[Sizes], bench: Sizes) -> Callable:
    """Register a builder in ``SPECS``."""
    def register(build: Callable[[Sizes], Family]) -> Callable[[Sizes], Family]:
        SPECS.append(Spec(build, tuple(cpu), tuple(gpu), tuple(bench)))
        return build
    return register


# ----------------------------------------------------------------------------- helpers
def _nbytes(a: Any) -> int:
    if isinstance(a, (bool, int, float)):
        return 0
    if hasattr(a, "nbytes"):
        return int(a.nbytes)
    return int(a.numel() * a.element_size())  # torch


def bf16_dtype() -> Any:
    """NumPy's bfloat16 (from ml_dtypes); ImportError without it."""
    import ml_dtypes  # noqa: PLC0415

    return ml_dtypes.bfloat16


def np_dtype(dt: DataType) -> Any:
    """The NumPy dtype of a kiln float DataType."""
    if dt == DataType.BFloat16:
        return bf16_dtype()
    return {DataType.Float: np.float32, DataType.Half: np.float16, DataType.Double: np.float64}[dt]


def to_f64(inputs: Sequence[Any]) -> List[Any]:
    """Float arrays as float64 (exact), integer and bool arrays and scalars unchanged."""
    out: List[Any] = []
    for a in inputs:
        if isinstance(a, np.ndarray) and a.dtype.kind not in "iub":  # float16/32, bfloat16
            out.append(a.astype(np.float64))
        else:
            out.append(a)
    return out


def output_f64(x: Any) -> np.ndarray:
    """An output (NumPy, bf16 bits as uint16, ml_dtypes bf16, CuPy or torch) as float64."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        return x.detach().float().cpu().numpy().astype(np.float64)
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        x = cupy.asnumpy(x)
    x = np.asarray(x)
    if x.dtype == np.uint16:  # bfloat16 bits (no ml_dtypes)
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


class ShapesOnly:
    """Stands in for the random generator when only shapes, dtypes and strides matter
    (``fd.lower`` at model sizes): every draw is zeros, which NumPy maps lazily."""

    def standard_normal(self, shape: Sequence[int]) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=np.float32)

    def integers(self, low: int, high: int, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def uniform(self, low: float, high: float, size: int) -> np.ndarray:
        return np.full(size, low, dtype=np.float64)


SHAPES_ONLY = -1  # the seed that makes ``make_inputs`` draw nothing (see ShapesOnly)


def _total_kernels(rows: int) -> int:
    """Kernels of a row schedule with a total over its rows: one while the rows fit in four
    waves of blocks on the default target (132 SMs), else a second kernel for the total,
    which is faster than every block waiting on the grid reduction's semaphore."""
    return 1 if rows <= 4 * 132 else 2


def _rng(name: str, sizes: Sizes, seed: int) -> Any:
    if seed == SHAPES_ONLY:
        return ShapesOnly()
    return np.random.default_rng(zlib.crc32(f"{name}{tuple(sizes)}{seed}".encode()))


def _randn(rng: Any, shape: Sequence[int], dtype: Any = np.float32,
           scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    if isinstance(rng, ShapesOnly):
        return np.zeros(tuple(shape), dtype=dtype)
    return (rng.standard_normal(tuple(shape)) * scale + shift).astype(dtype)


def _bcast(fd: FusionDefinition, t: Any, rank: int, dims: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=[-1] * rank, broadcast_dims=list(dims))


def _tensor(fd: FusionDefinition, rank: int, dtype: DataType = DataType.Float) -> Any:
    return fd.define_tensor(shape=[-1] * rank, dtype=dtype)


def _lowp_tols(dt: DataType) -> Tuple[float, float]:
    return (2e-2, 2e-2) if dt == DataType.BFloat16 else (5e-3, 5e-3)


def _dt_names(*dts: DataType) -> Tuple[str, ...]:
    return tuple(sorted({d.name for d in dts if d in (DataType.Half, DataType.BFloat16)}))


def _ln_ref(x: np.ndarray, eps: float = LN_EPS) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(normalized, mean, rstd) over the last axis."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mu) * rstd, mu[..., 0], rstd[..., 0]


def _softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _gelu_tanh(u: np.ndarray) -> np.ndarray:
    return 0.5 * u * (1.0 + np.tanh(0.7978845608 * (u + 0.044715 * u ** 3)))


NORM_CPU: Tuple[Sizes, ...] = ((1, 1), (5, 3), (13, 97), (1000, 3), (2, 4099), (31, 1031))
NORM_GPU: Tuple[Sizes, ...] = ((1, 1), (5, 3), (37, 1000), (4099, 13), (128, 4096), (7, 8191),
                                (2048, 12288))
NORM_BENCH: Sizes = (16384, 4096)


# ============================================================================ LayerNorm
def _layernorm_inputs(name: str, dt: DataType, n_vec: int = 2, residual: int = 0,
                      shift: float = 0.0) -> Callable[[Sizes, int], List[Any]]:
    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        m, n = sizes
        rng = _rng(name, sizes, seed)
        npd = np_dtype(dt)
        arrs: List[Any] = [_randn(rng, (m, n), npd, shift=shift)]
        arrs += [_randn(rng, (m, n), npd) for _ in range(residual)]
        arrs += [_randn(rng, (n,), npd, scale=0.5, shift=1.0) for _ in range(n_vec)]
        return arrs
    return make


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm(sizes: Sizes) -> Family:
    """GPT-2/nn.LayerNorm forward for training, [M, N] float: ``mean = sum(x, [1]) * (1/N)``
    and ``rstd = rsqrt(var + eps)`` on the rank-1 statistics, broadcast afterwards; outputs
    y, mean [M] and rstd [M] (what the backward needs)."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1]), 1.0 / n)
        xc = fd.ops.sub(x, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.mul(xc, _bcast(fd, rstd, 2, [0])), _bcast(fd, w, 2, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 2, [1])))
        fd.add_output(mean)
        fd.add_output(rstd)

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        xn, mu, rstd = _ln_ref(x)
        return [xn * w + b, mu, rstd]
    return Family("layernorm", sizes, fd, _layernorm_inputs("layernorm", DataType.Float), ref,
                  rtol=1e-4, atol=1e-4, out_tols=[None, None, (1e-4, 1e-2)])


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_var_mean(sizes: Sizes) -> Family:
    """nn.LayerNorm written with ``var_mean(x, [1], correction=0, keepdim=True)`` (Welford's
    statistics, computed in double) and an affine transform."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        var, mean = fd.ops.var_mean(x, [1], correction=0, keepdim=True)
        xn = fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, LN_EPS)))
        y = fd.ops.add(fd.ops.mul(xn, fd.ops.broadcast(w, [True, False])), fd.ops.broadcast(b, [True, False]))
        fd.add_output(y)

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [_ln_ref(x)[0] * w + b]
    make = _layernorm_inputs("layernorm_var_mean", DataType.Float)
    return Family("layernorm_var_mean", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def dropout_residual_layernorm(sizes: Sizes) -> Family:
    """A transformer block's ``LayerNorm(dropout(x) + residual)``: the mask from
    ``rand_like(x, seed, offset) >= p`` (Philox, the same bits on the CPU and the GPU),
    statistics from ``var_mean``; outputs y and the mask."""
    p = 0.1
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        res = _tensor(fd, 2)
        seed = fd.define_scalar(dtype=DataType.Int)
        keep = fd.ops.ge(fd.ops.rand_like(x, seed, 7), p)
        h = fd.ops.add(fd.ops.where(keep, fd.ops.mul(x, 1.0 / (1.0 - p)), 0.0), res)
        var, mean = fd.ops.var_mean(h, [1], correction=0, keepdim=True)
        fd.add_output(fd.ops.mul(fd.ops.sub(h, mean), fd.ops.rsqrt(fd.ops.add(var, LN_EPS))))
        fd.add_output(keep)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("dropout_residual_layernorm", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, sizes), 1234 + seed]

    def ref(x: np.ndarray, res: np.ndarray, s: Any) -> List[np.ndarray]:
        # The mask is reproduced by the interpreter (same Philox stream): use its bits.
        with FusionDefinition() as mfd:
            t = mfd.define_tensor([-1, -1])
            mfd.add_output(mfd.ops.ge(mfd.ops.rand_like(t, mfd.define_scalar(int(s), DataType.Int), 7), p))
        (keep,) = mfd.execute([np.zeros(x.shape, np.float32)])
        h = np.where(keep, x / (1.0 - p), 0.0) + res
        return [_ln_ref(h)[0], keep]
    return Family("dropout_residual_layernorm", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_div_after_broadcast(sizes: Sizes) -> Family:
    """LayerNorm with the division by N after the broadcast: ``bcast(sum(x, [1])) / N``."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        mean = fd.ops.div(_bcast(fd, fd.ops.sum(x, dims=[1]), 2, [0]), float(n))
        xc = fd.ops.sub(x, mean)
        var = fd.ops.div(_bcast(fd, fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]), 2, [0]), float(n))
        y = fd.ops.mul(xc, fd.ops.rsqrt(fd.ops.add(var, LN_EPS)))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bcast(fd, w, 2, [1])), _bcast(fd, b, 2, [1])))

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [_ln_ref(x)[0] * w + b]
    return Family("layernorm_div_after_broadcast", sizes, fd,
                  _layernorm_inputs("layernorm_div_after_broadcast", DataType.Float), ref,
                  rtol=1e-4, atol=1e-4)


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_from_moments(sizes: Sizes) -> Family:
    """LayerNorm with ``var = mean(x²) − mean²`` (one pass over x for both moments; apex
    style), inputs centred at 0.5 so the subtraction matters."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1]), 1.0 / n)
        meansq = fd.ops.mul(fd.ops.sum(fd.ops.mul(x, x), dims=[1]), 1.0 / n)
        var = fd.ops.sub(meansq, fd.ops.mul(mean, mean))
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        xc = fd.ops.sub(x, _bcast(fd, mean, 2, [0]))
        y = fd.ops.mul(xc, _bcast(fd, rstd, 2, [0]))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bcast(fd, w, 2, [1])), _bcast(fd, b, 2, [1])))

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [_ln_ref(x)[0] * w + b]
    # E[x²] − E[x]² in float32 loses about eps32 * E[x²] / var of the variance.
    return Family("layernorm_from_moments", sizes, fd,
                  _layernorm_inputs("layernorm_from_moments", DataType.Float, shift=0.5), ref,
                  rtol=1e-3, atol=1e-3)


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_keepdim(sizes: Sizes) -> Family:
    """LayerNorm with ``keepdim=True`` statistics ([M, 1], no broadcast_in_dim) and a runtime
    ``eps`` scalar; outputs y and the [M, 1] rstd."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        eps = fd.define_scalar(dtype=DataType.Double)
        mean = fd.ops.div(fd.ops.sum(x, dims=[1], keepdim=True), float(n))
        xc = fd.ops.sub(x, mean)
        var = fd.ops.div(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1], keepdim=True), float(n))
        rstd = fd.ops.rsqrt(fd.ops.add(var, eps))
        y = fd.ops.mul(fd.ops.mul(xc, rstd), _bcast(fd, w, 2, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 2, [1])))
        fd.add_output(rstd)
    base = _layernorm_inputs("layernorm_keepdim", DataType.Float)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        return [*base(sizes, seed), 1e-5]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> List[np.ndarray]:
        xn, _, rstd = _ln_ref(x, eps)
        return [xn * w + b, rstd[:, None]]
    return Family("layernorm_keepdim", sizes, fd, make, ref, rtol=1e-4, atol=1e-4,
                  out_tols=[None, (1e-4, 1e-2)])


def _layernorm_lowp(sizes: Sizes, dt: DataType, name: str) -> Family:
    """LayerNorm in ``dt`` in and out, float statistics: x, w, b cast to float (w and b on
    the rank-1 tensors, before broadcasting), y cast back; outputs y, mean, rstd (float)."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2, dt)
        w = _tensor(fd, 1, dt)
        b = _tensor(fd, 1, dt)
        xf = fd.ops.cast(x, DataType.Float)
        mean = fd.ops.mul(fd.ops.sum(xf, dims=[1]), 1.0 / n)
        xc = fd.ops.sub(xf, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        wf = _bcast(fd, fd.ops.cast(w, DataType.Float), 2, [1])
        bf = _bcast(fd, fd.ops.cast(b, DataType.Float), 2, [1])
        y = fd.ops.add(fd.ops.mul(fd.ops.mul(xc, _bcast(fd, rstd, 2, [0])), wf), bf)
        fd.add_output(fd.ops.cast(y, dt))
        fd.add_output(mean)
        fd.add_output(rstd)

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        xn, mu, rstd = _ln_ref(x)
        return [xn * w + b, mu, rstd]
    return Family(name, sizes, fd, _layernorm_inputs(name, dt), ref, rtol=1e-4, atol=1e-4,
                  out_tols=[_lowp_tols(dt), None, (1e-4, 1e-2)], dtypes=_dt_names(dt))


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_half(sizes: Sizes) -> Family:
    """LayerNorm, half in and out, float statistics."""
    return _layernorm_lowp(sizes, DataType.Half, "layernorm_half")


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def layernorm_bf16(sizes: Sizes) -> Family:
    """LayerNorm, bfloat16 in and out, float statistics."""
    return _layernorm_lowp(sizes, DataType.BFloat16, "layernorm_bf16")


@family(NORM_CPU, NORM_GPU, (16384, 1024))
def bert_residual_layernorm(sizes: Sizes) -> Family:
    """BERT's BertSelfOutput after the dense matmul: ``LayerNorm(dense + bias + residual)``,
    [M, N] float, with the residual sum as an extra output."""
    _, n = sizes
    with FusionDefinition() as fd:
        h = _tensor(fd, 2)
        res = _tensor(fd, 2)
        bias = _tensor(fd, 1)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        t = fd.ops.add(fd.ops.add(h, _bcast(fd, bias, 2, [1])), res)
        mean = fd.ops.mul(fd.ops.sum(t, dims=[1]), 1.0 / n)
        tc = fd.ops.sub(t, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(tc, tc), dims=[1]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-12))
        y = fd.ops.mul(fd.ops.mul(tc, _bcast(fd, rstd, 2, [0])), _bcast(fd, w, 2, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 2, [1])))
        fd.add_output(t)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        m, n = sizes
        rng = _rng("bert_residual_layernorm", sizes, seed)
        return [_randn(rng, (m, n)), _randn(rng, (m, n)), _randn(rng, (n,), scale=0.1),
                _randn(rng, (n,), scale=0.5, shift=1.0), _randn(rng, (n,), scale=0.5)]

    def ref(h: np.ndarray, res: np.ndarray, bias: np.ndarray, w: np.ndarray,
            b: np.ndarray) -> List[np.ndarray]:
        t = h + bias + res
        return [_ln_ref(t, 1e-12)[0] * w + b, t]
    return Family("bert_residual_layernorm", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def prenorm_residual_layernorm_half(sizes: Sizes) -> Family:
    """Pre-LN transformer block entry in half: ``s = x.float() + res.float()``; outputs the
    new residual stream ``s.half()`` and ``LayerNorm(s).half()``."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2, DataType.Half)
        res = _tensor(fd, 2, DataType.Half)
        w = _tensor(fd, 1, DataType.Half)
        b = _tensor(fd, 1, DataType.Half)
        s = fd.ops.add(fd.ops.cast(x, DataType.Float), fd.ops.cast(res, DataType.Float))
        mean = fd.ops.mul(fd.ops.sum(s, dims=[1]), 1.0 / n)
        sc = fd.ops.sub(s, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(sc, sc), dims=[1]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.mul(sc, _bcast(fd, rstd, 2, [0])),
                       _bcast(fd, fd.ops.cast(w, DataType.Float), 2, [1]))
        y = fd.ops.add(y, _bcast(fd, fd.ops.cast(b, DataType.Float), 2, [1]))
        fd.add_output(fd.ops.cast(s, DataType.Half))
        fd.add_output(fd.ops.cast(y, DataType.Half))

    def ref(x: np.ndarray, res: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        s = x + res
        return [s, _ln_ref(s)[0] * w + b]
    return Family("prenorm_residual_layernorm_half", sizes, fd,
                  _layernorm_inputs("prenorm_residual_layernorm_half", DataType.Half, residual=1),
                  ref, rtol=5e-3, atol=5e-3, dtypes=("Half",))


# ============================================================================ RMSNorm
@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def rmsnorm_t5(sizes: Sizes) -> Family:
    """T5LayerNorm (float): ``variance = mean(x²)`` on the rank-1 tensor, ``rstd`` rank-1,
    ``w * (x * rstd)``; outputs y and rstd [M]."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        variance = fd.ops.mul(fd.ops.sum(fd.ops.mul(x, x), dims=[1]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(variance, RMS_EPS))
        y = fd.ops.mul(_bcast(fd, w, 2, [1]), fd.ops.mul(x, _bcast(fd, rstd, 2, [0])))
        fd.add_output(y)
        fd.add_output(rstd)

    def ref(x: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        rstd = 1.0 / np.sqrt((x * x).mean(axis=1) + RMS_EPS)
        return [w * (x * rstd[:, None]), rstd]
    return Family("rmsnorm_t5", sizes, fd, _layernorm_inputs("rmsnorm_t5", DataType.Float, n_vec=1),
                  ref, rtol=1e-4, atol=1e-4, out_tols=[None, (1e-4, 1e-1)])


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def rmsnorm_llama_half(sizes: Sizes) -> Family:
    """LlamaRMSNorm in half: ``h = x.float(); h = h * rsqrt(mean(h², -1, keepdim) + eps);
    weight * h.half()`` (the weight multiply in half)."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2, DataType.Half)
        w = _tensor(fd, 1, DataType.Half)
        h = fd.ops.cast(x, DataType.Float)
        variance = fd.ops.mul(fd.ops.sum(fd.ops.mul(h, h), dims=[1], keepdim=True), 1.0 / n)
        h = fd.ops.mul(h, fd.ops.rsqrt(fd.ops.add(variance, RMS_EPS)))
        fd.add_output(fd.ops.mul(_bcast(fd, w, 2, [1]), fd.ops.cast(h, DataType.Half)))

    def ref(x: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        return [w * (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + RMS_EPS))]
    return Family("rmsnorm_llama_half", sizes, fd,
                  _layernorm_inputs("rmsnorm_llama_half", DataType.Half, n_vec=1), ref,
                  rtol=1e-2, atol=1e-2, dtypes=("Half",))


@family(NORM_CPU, NORM_GPU, NORM_BENCH)
def rmsnorm_gemma_bf16(sizes: Sizes) -> Family:
    """GemmaRMSNorm in bfloat16: ``out = norm(x.float()) * (1 + w.float())`` with the offset
    on the rank-1 weight before broadcasting, then ``.type_as(x)``."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2, DataType.BFloat16)
        w = _tensor(fd, 1, DataType.BFloat16)
        xf = fd.ops.cast(x, DataType.Float)
        ms = fd.ops.mul(fd.ops.sum(fd.ops.mul(xf, xf), dims=[1], keepdim=True), 1.0 / n)
        out = fd.ops.mul(xf, fd.ops.rsqrt(fd.ops.add(ms, RMS_EPS)))
        scale = fd.ops.add(fd.ops.cast(w, DataType.Float), 1.0)
        out = fd.ops.mul(out, _bcast(fd, scale, 2, [1]))
        fd.add_output(fd.ops.cast(out, DataType.BFloat16))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        m, n = sizes
        rng = _rng("rmsnorm_gemma_bf16", sizes, seed)
        bf = bf16_dtype()
        return [_randn(rng, (m, n)).astype(bf), _randn(rng, (n,), scale=0.3).astype(bf)]

    def ref(x: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        return [x / np.sqrt((x * x).mean(axis=1, keepdims=True) + RMS_EPS) * (1.0 + w)]
    return Family("rmsnorm_gemma_bf16", sizes, fd, make, ref, rtol=2e-2, atol=2e-2,
                  dtypes=("BFloat16",))


# ============================================================================ Softmax
ATTN_CPU: Tuple[Sizes, ...] = ((1, 1, 1), (2, 3, 5), (1, 2, 33), (3, 1, 67), (2, 4, 128))
ATTN_GPU: Tuple[Sizes, ...] = ((1, 1, 1), (2, 3, 5), (3, 1, 67), (2, 12, 128), (4, 16, 509),
                                (1, 8, 2048))
ATTN_BENCH: Sizes = (8, 16, 1024)


@family(ATTN_CPU, ATTN_GPU, ATTN_BENCH)
def attention_softmax_padding_mask(sizes: Sizes) -> Family:
    """BERT self-attention probabilities: ``softmax(scores / sqrt(d) + mask)`` on [B, H, S, S]
    with the additive padding mask ``(1 - attention_mask) * -10000`` of shape [B, S] broadcast
    over heads and queries (d = 64)."""
    with FusionDefinition() as fd:
        scores = _tensor(fd, 4)
        mask = _tensor(fd, 2)
        s = fd.ops.add(fd.ops.mul(scores, 1.0 / math.sqrt(64)), _bcast(fd, mask, 4, [0, 3]))
        mx = fd.ops.max(s, dims=[3], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(s, mx))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, h, s = sizes
        rng = _rng("attention_softmax_padding_mask", sizes, seed)
        lengths = rng.integers(1, s + 1, size=b)
        keep = np.arange(s)[None, :] < lengths[:, None]
        mask = ((1.0 - keep) * -10000.0).astype(np.float32)
        return [_randn(rng, (b, h, s, s), scale=3.0), mask]

    def ref(scores: np.ndarray, mask: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(scores / 8.0 + mask[:, None, None, :])]
    return Family("attention_softmax_padding_mask", sizes, fd, make, ref, rtol=1e-4, atol=1e-6)


@family(ATTN_CPU, ATTN_GPU, ATTN_BENCH)
def attention_softmax_square_bias(sizes: Sizes) -> Family:
    """Softmax of scores plus an additive [S, S] mask (causal, ``finfo.min`` above the
    diagonal, as HF builds it) broadcast onto [B, H, S, S], scale 1/sqrt(128)."""
    with FusionDefinition() as fd:
        scores = _tensor(fd, 4)
        bias = _tensor(fd, 2)
        s = fd.ops.add(fd.ops.mul(scores, 1.0 / math.sqrt(128)), _bcast(fd, bias, 4, [2, 3]))
        mx = fd.ops.max(s, dims=[3], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(s, mx))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, h, s = sizes
        rng = _rng("attention_softmax_square_bias", sizes, seed)
        bias = np.where(np.tril(np.ones((s, s), dtype=bool)), 0.0, F32_MIN).astype(np.float32)
        return [_randn(rng, (b, h, s, s), scale=3.0), bias]

    def ref(scores: np.ndarray, bias: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(scores / math.sqrt(128) + bias)]
    return Family("attention_softmax_square_bias", sizes, fd, make, ref, rtol=1e-4, atol=1e-6)


@family(ATTN_CPU, ATTN_GPU, ATTN_BENCH)
def causal_softmax_where_half(sizes: Sizes) -> Family:
    """GPT-2 attention in half: ``w = scores.float() * scale; w = where(causal_mask, w,
    finfo.min); softmax(w).half()`` with the Bool [S, S] mask broadcast onto [B, H, S, S]."""
    with FusionDefinition() as fd:
        scores = _tensor(fd, 4, DataType.Half)
        mask = _tensor(fd, 2, DataType.Bool)
        w = fd.ops.mul(fd.ops.cast(scores, DataType.Float), 1.0 / math.sqrt(64))
        w = fd.ops.where(_bcast(fd, mask, 4, [2, 3]), w, F32_MIN)
        mx = fd.ops.max(w, dims=[3], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(w, mx))
        p = fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True))
        fd.add_output(fd.ops.cast(p, DataType.Half))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, h, s = sizes
        rng = _rng("causal_softmax_where_half", sizes, seed)
        return [_randn(rng, (b, h, s, s), np.float16, scale=3.0), np.tril(np.ones((s, s), dtype=bool))]

    def ref(scores: np.ndarray, mask: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(np.where(mask, scores / 8.0, F32_MIN))]
    return Family("causal_softmax_where_half", sizes, fd, make, ref, rtol=5e-3, atol=5e-4,
                  dtypes=("Half",))


ROWS_CPU: Tuple[Sizes, ...] = ((1, 1), (3, 7), (1000, 3), (17, 1031), (2, 4099), (64, 509))
ROWS_GPU: Tuple[Sizes, ...] = ((1, 1), (3, 7), (4099, 13), (37, 1031), (128, 32000), (7, 8191))


def _rows_inputs(name: str, scale: float = 3.0) -> Callable[[Sizes, int], List[Any]]:
    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        return [_randn(_rng(name, sizes, seed), sizes, scale=scale)]
    return make


@family(ROWS_CPU, ROWS_GPU, (8192, 32000))
def log_softmax(sizes: Sizes) -> Family:
    """``x - max - log(sum(exp(x - max)))`` over the last axis (rank-1 statistics)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        mx = fd.ops.max(x, dims=[1])
        xs = fd.ops.sub(x, _bcast(fd, mx, 2, [0]))
        lse = fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1]))
        fd.add_output(fd.ops.sub(xs, _bcast(fd, lse, 2, [0])))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        xs = x - x.max(axis=1, keepdims=True)
        return [xs - np.log(np.exp(xs).sum(axis=1, keepdims=True))]
    return Family("log_softmax", sizes, fd, _rows_inputs("log_softmax"), ref, rtol=1e-5, atol=1e-4)


@family(ROWS_CPU, ROWS_GPU, (8192, 32000))
def logsumexp(sizes: Sizes) -> Family:
    """``torch.logsumexp(x, 1)``: ``log(sum(exp(x - max))) + max``, output [M]."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        mx = fd.ops.max(x, dims=[1])
        e = fd.ops.exp(fd.ops.sub(x, _bcast(fd, mx, 2, [0])))
        fd.add_output(fd.ops.add(fd.ops.log(fd.ops.sum(e, dims=[1])), mx))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        mx = x.max(axis=1)
        return [np.log(np.exp(x - mx[:, None]).sum(axis=1)) + mx]
    return Family("logsumexp", sizes, fd, _rows_inputs("logsumexp"), ref, rtol=1e-5, atol=1e-4)


@family(((1, 1), (3, 7), (64, 3), (17, 1031), (5, 4099), (1000, 13)),
        ((1, 1), (3, 7), (4099, 13), (37, 1031), (256, 32000), (1024, 128256)), (8192, 32000))
def cross_entropy(sizes: Sizes) -> Family:
    """``F.cross_entropy(logits, labels, ignore_index=-100)`` written without a gather: the
    label's log-probability is picked by comparing the [B] int64 labels with a [V] int64
    column-index input (``arange(V)``); rows whose label is -100 are masked out and the mean
    is over the other rows. Outputs the 0-d loss and the per-row logsumexp (for the backward)."""
    with FusionDefinition() as fd:
        logits = _tensor(fd, 2)
        labels = _tensor(fd, 1, DataType.Int)
        cols = _tensor(fd, 1, DataType.Int)
        mx = fd.ops.max(logits, dims=[1])
        xs = fd.ops.sub(logits, _bcast(fd, mx, 2, [0]))
        lse = fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1]))
        onehot = fd.ops.eq(_bcast(fd, cols, 2, [1]), _bcast(fd, labels, 2, [0]))
        picked = fd.ops.sum(fd.ops.where(onehot, xs, 0.0), dims=[1])
        nll = fd.ops.sub(lse, picked)
        valid = fd.ops.ne(labels, -100)
        total = fd.ops.sum(fd.ops.where(valid, nll, 0.0), dims=[0])
        count = fd.ops.sum(fd.ops.cast(valid, DataType.Float), dims=[0])
        fd.add_output(fd.ops.div(total, count))
        fd.add_output(fd.ops.add(lse, mx))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, v = sizes
        rng = _rng("cross_entropy", sizes, seed)
        labels = rng.integers(0, v, size=b).astype(np.int64)
        labels[1::3] = -100  # padding positions; row 0 always counts
        return [_randn(rng, (b, v), scale=2.0), labels, np.arange(v, dtype=np.int64)]

    def ref(logits: np.ndarray, labels: np.ndarray, cols: np.ndarray) -> List[np.ndarray]:
        mx = logits.max(axis=1)
        lse = np.log(np.exp(logits - mx[:, None]).sum(axis=1)) + mx
        valid = labels != -100
        picked = logits[np.arange(len(labels))[valid], labels[valid]]
        return [np.asarray((lse[valid] - picked).mean()), lse]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        return _nbytes(ins[0]) + _nbytes(ins[1]) + sum(_nbytes(o) for o in outs)  # cols: an iota
    return Family("cross_entropy", sizes, fd, make, ref, kernels=_total_kernels(sizes[0]), rtol=1e-5,
                  atol=1e-4, min_bytes=traffic)


@family(((1, 1), (7, 3), (1000, 5), (33, 17), (4099, 2)),
        ((1, 1), (7, 3), (4099, 13), (8191, 37), (32768, 1024)), (16384, 4096))
def softmax_first_axis(sizes: Sizes) -> Family:
    """``softmax(x, dim=0)`` of [S, N] (keepdim statistics over the leading axis)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        mx = fd.ops.max(x, dims=[0], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, mx))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[0], keepdim=True)))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(x, axis=0)]
    return Family("softmax_first_axis", sizes, fd, _rows_inputs("softmax_first_axis"), ref,
                  rtol=1e-4, atol=1e-6)


@family(ROWS_CPU, ROWS_GPU, (16384, 4096))
def softmax_backward(sizes: Sizes) -> Family:
    """``dx = y * (dy - sum(dy * y, -1, keepdim=True))`` (_softmax_backward_data)."""
    with FusionDefinition() as fd:
        y = _tensor(fd, 2)
        dy = _tensor(fd, 2)
        s = fd.ops.sum(fd.ops.mul(dy, y), dims=[1], keepdim=True)
        fd.add_output(fd.ops.mul(y, fd.ops.sub(dy, s)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("softmax_backward", sizes, seed)
        y = _randn(rng, sizes, np.float64, scale=2.0)
        y = y.astype(np.float32) if isinstance(rng, ShapesOnly) else _softmax_ref(y).astype(np.float32)
        return [y, _randn(rng, sizes)]

    def ref(y: np.ndarray, dy: np.ndarray) -> List[np.ndarray]:
        return [y * (dy - (dy * y).sum(axis=1, keepdims=True))]
    return Family("softmax_backward", sizes, fd, make, ref, rtol=1e-4, atol=1e-6)


@family(ROWS_CPU, ROWS_GPU, (16384, 4096))
def softmax_with_row_max(sizes: Sizes) -> Family:
    """Softmax that also outputs its row max [M] (as attention kernels keep for the
    backward)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        mx = fd.ops.max(x, dims=[1])
        e = fd.ops.exp(fd.ops.sub(x, _bcast(fd, mx, 2, [0])))
        fd.add_output(fd.ops.div(e, _bcast(fd, fd.ops.sum(e, dims=[1]), 2, [0])))
        fd.add_output(mx)

    def ref(x: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(x), x.max(axis=1)]
    return Family("softmax_with_row_max", sizes, fd, _rows_inputs("softmax_with_row_max"), ref,
                  rtol=1e-4, atol=1e-6)


# ============================================================================ backward passes
def _saved_row_stats(x: np.ndarray, rms: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """The forward's saved (mean, rstd) over the last axis, float32 (mean 0 for RMSNorm)."""
    xd = x.astype(np.float64)
    if rms:
        rstd = 1.0 / np.sqrt((xd * xd).mean(axis=1) + 1e-6)
        return np.zeros(x.shape[0], np.float32), rstd.astype(np.float32)
    _, mu, rs = _ln_ref(xd)
    return mu.astype(np.float32), rs.astype(np.float32)


@family(((3, 7), (64, 257), (1000, 3), (17, 1031)),
        ((3, 7), (4099, 13), (37, 1031), (2048, 4096), (64, 70001)), (16384, 4096))
def layernorm_backward(sizes: Sizes) -> Family:
    """``native_layer_norm_backward`` from the saved mean and rstd [M]: row sums for
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * w``, and column sums
    ``dw = sum(dy * xhat, 0)``, ``db = sum(dy, 0)`` of the same ``xhat``."""
    m, n = sizes
    with FusionDefinition() as fd:
        dy, x = _tensor(fd, 2), _tensor(fd, 2)
        mean, rstd, w = _tensor(fd, 1), _tensor(fd, 1), _tensor(fd, 1)
        rb = _bcast(fd, rstd, 2, [0])
        xhat = fd.ops.mul(fd.ops.sub(x, _bcast(fd, mean, 2, [0])), rb)
        g = fd.ops.mul(dy, _bcast(fd, w, 2, [1]))
        c1 = fd.ops.mul(fd.ops.sum(fd.ops.mul(g, xhat), dims=[1]), 1.0 / n)
        c2 = fd.ops.mul(fd.ops.sum(g, dims=[1]), 1.0 / n)
        inner = fd.ops.add(fd.ops.mul(xhat, _bcast(fd, c1, 2, [0])), _bcast(fd, c2, 2, [0]))
        fd.add_output(fd.ops.mul(fd.ops.sub(g, inner), rb))
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, xhat), dims=[0]))
        fd.add_output(fd.ops.sum(dy, dims=[0]))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("layernorm_backward", sizes, seed)
        x = _randn(rng, sizes, shift=0.3)
        shapes_only = isinstance(rng, ShapesOnly)
        mean, rstd = (np.zeros(sizes[0], np.float32),) * 2 if shapes_only else _saved_row_stats(x)
        return [_randn(rng, sizes), x, mean, rstd, _randn(rng, (sizes[1],), scale=0.5, shift=1.0)]

    def ref(dy: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
            w: np.ndarray) -> List[np.ndarray]:
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w
        c1, c2 = (g * xhat).mean(axis=1, keepdims=True), g.mean(axis=1, keepdims=True)
        dx = rstd[:, None] * (g - c2 - xhat * c1)
        return [dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)]
    col = (1e-4, 1e-4 * math.sqrt(m))
    # Two kernels, one per class of reductions (rows for dx, columns for dw and db), each
    # computing xhat from the inputs; one kernel would need row results and column partials
    # in one schedule.
    return Family("layernorm_backward", sizes, fd, make, ref, kernels=2, rtol=1e-4, atol=1e-4,
                  out_tols=[None, col, col])


@family(((1, 1), (3, 7), (64, 257), (17, 1031)),
        ((1, 1), (3, 7), (4099, 13), (2048, 4096), (64, 70001)), (16384, 4096))
def rmsnorm_backward(sizes: Sizes) -> Family:
    """LLaMA RMSNorm backward from the saved rstd [M]: ``dx = rstd * (g - xn * mean(g * xn))``
    with ``xn = x * rstd``, ``g = dy * w`` (a row sum), and ``dw = sum(dy * xn, 0)``."""
    m, n = sizes
    with FusionDefinition() as fd:
        dy, x, rstd, w = _tensor(fd, 2), _tensor(fd, 2), _tensor(fd, 1), _tensor(fd, 1)
        rb = _bcast(fd, rstd, 2, [0])
        xn = fd.ops.mul(x, rb)
        g = fd.ops.mul(dy, _bcast(fd, w, 2, [1]))
        c = fd.ops.div(fd.ops.sum(fd.ops.mul(g, xn), dims=[1]), float(n))
        fd.add_output(fd.ops.mul(rb, fd.ops.sub(g, fd.ops.mul(xn, _bcast(fd, c, 2, [0])))))
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, xn), dims=[0]))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("rmsnorm_backward", sizes, seed)
        x = _randn(rng, sizes)
        shapes_only = isinstance(rng, ShapesOnly)
        rstd = np.ones(sizes[0], np.float32) if shapes_only else _saved_row_stats(x, rms=True)[1]
        return [_randn(rng, sizes), x, rstd, _randn(rng, (sizes[1],), scale=0.5, shift=1.0)]

    def ref(dy: np.ndarray, x: np.ndarray, rstd: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        xn = x * rstd[:, None]
        g = dy * w
        return [rstd[:, None] * (g - xn * (g * xn).mean(axis=1, keepdims=True)), (dy * xn).sum(axis=0)]
    return Family("rmsnorm_backward", sizes, fd, make, ref, kernels=2, rtol=1e-4, atol=1e-4,
                  out_tols=[None, (1e-4, 1e-4 * math.sqrt(m))])


@family(((1, 1, 1, 1), (2, 3, 5, 7), (3, 7, 1, 61)),
        ((2, 3, 5, 7), (8, 64, 28, 28), (4, 32, 112, 112)), (32, 256, 56, 56))
def batchnorm_nchw_backward(sizes: Sizes) -> Family:
    """BatchNorm2d backward on NCHW from the saved mean and invstd [C]: per channel
    ``dx = w * invstd / n * (n * dy - sum(dy) - xhat * sum(dy * xhat))``, ``dw``, ``db``."""
    n_, _, h, w_ = sizes
    cnt = n_ * h * w_
    with FusionDefinition() as fd:
        dy, x = _tensor(fd, 4), _tensor(fd, 4)
        mean, invstd, w = _tensor(fd, 1), _tensor(fd, 1), _tensor(fd, 1)
        xhat = fd.ops.mul(fd.ops.sub(x, _bcast(fd, mean, 4, [1])), _bcast(fd, invstd, 4, [1]))
        sdy = fd.ops.sum(dy, dims=[0, 2, 3])
        sdyx = fd.ops.sum(fd.ops.mul(dy, xhat), dims=[0, 2, 3])
        k = fd.ops.mul(fd.ops.mul(w, invstd), 1.0 / cnt)
        inner = fd.ops.sub(fd.ops.sub(fd.ops.mul(dy, float(cnt)), _bcast(fd, sdy, 4, [1])),
                           fd.ops.mul(xhat, _bcast(fd, sdyx, 4, [1])))
        fd.add_output(fd.ops.mul(_bcast(fd, k, 4, [1]), inner))
        fd.add_output(sdyx)
        fd.add_output(sdy)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("batchnorm_nchw_backward", sizes, seed)
        x = _randn(rng, sizes, scale=2.0, shift=0.5)
        c = sizes[1]
        if isinstance(rng, ShapesOnly):
            mean, invstd = np.zeros(c, np.float32), np.ones(c, np.float32)
        else:
            xd = x.astype(np.float64)
            mean = xd.mean(axis=(0, 2, 3)).astype(np.float32)
            invstd = (1.0 / np.sqrt(xd.var(axis=(0, 2, 3)) + LN_EPS)).astype(np.float32)
        return [_randn(rng, sizes), x, mean, invstd, _randn(rng, (c,), scale=0.5, shift=1.0)]

    def ref(dy: np.ndarray, x: np.ndarray, mean: np.ndarray, invstd: np.ndarray,
            w: np.ndarray) -> List[np.ndarray]:
        b = (slice(None), None, None)
        xhat = (x - mean[b]) * invstd[b]
        s1, s2 = dy.sum(axis=(0, 2, 3)), (dy * xhat).sum(axis=(0, 2, 3))
        return [(w * invstd / cnt)[b] * (cnt * dy - s1[b] - xhat * s2[b]), s2, s1]
    red = (1e-4, 1e-4 * math.sqrt(cnt))
    return Family("batchnorm_nchw_backward", sizes, fd, make, ref, rtol=1e-4, atol=1e-4 * math.sqrt(cnt) / 8,
                  out_tols=[None, red, red])


# ============================================================================ leading axes
@family(((2, 1), (3, 5), (1000, 3), (7, 257), (4099, 13)),
        ((2, 1), (3, 5), (4099, 13), (8192, 1000), (256, 4096)), (16384, 2048))
def batchnorm_1d_train(sizes: Sizes) -> Family:
    """nn.BatchNorm1d in training on [N, C]: statistics over axis 0, affine, and the updated
    running statistics ``running_mean * (1 - m) + m * mean`` (unbiased variance for
    running_var), m = 0.1. Outputs y, running_mean, running_var."""
    n, _ = sizes
    m = 0.1
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        rm = _tensor(fd, 1)
        rv = _tensor(fd, 1)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[0]), 1.0 / n)
        xc = fd.ops.sub(x, _bcast(fd, mean, 2, [1]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[0]), 1.0 / n)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.mul(xc, _bcast(fd, rstd, 2, [1])), _bcast(fd, w, 2, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 2, [1])))
        fd.add_output(fd.ops.add(fd.ops.mul(rm, 1.0 - m), fd.ops.mul(mean, m)))
        fd.add_output(fd.ops.add(fd.ops.mul(rv, 1.0 - m), fd.ops.mul(var, m * n / (n - 1))))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        n, c = sizes
        rng = _rng("batchnorm_1d_train", sizes, seed)
        return [_randn(rng, (n, c), scale=2.0, shift=0.5), _randn(rng, (c,), scale=0.5, shift=1.0),
                _randn(rng, (c,)), _randn(rng, (c,), scale=0.1),
                rng.uniform(0.5, 1.5, size=c).astype(np.float32)]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, rm: np.ndarray,
            rv: np.ndarray) -> List[np.ndarray]:
        mu, var = x.mean(axis=0), x.var(axis=0)
        y = (x - mu) / np.sqrt(var + LN_EPS) * w + b
        return [y, rm * (1 - m) + m * mu, rv * (1 - m) + m * x.var(axis=0, ddof=1)]
    return Family("batchnorm_1d_train", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(((2, 1, 1, 1), (2, 3, 5, 7), (1, 5, 13, 11), (8, 2, 3, 3), (3, 7, 1, 61)),
        ((2, 1, 1, 1), (2, 3, 5, 7), (3, 7, 1, 61), (32, 64, 56, 56), (8, 256, 14, 14),
         (2, 3, 224, 224)), (32, 256, 56, 56))
def batchnorm_nchw_train(sizes: Sizes) -> Family:
    """nn.BatchNorm2d in training on NCHW: statistics over (0, 2, 3), affine; outputs y,
    save_mean [C], save_invstd [C], and the running statistics (m = 0.1)."""
    n, _, h, w_ = sizes
    count = n * h * w_
    m = 0.1
    with FusionDefinition() as fd:
        x = _tensor(fd, 4)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        rm = _tensor(fd, 1)
        rv = _tensor(fd, 1)
        mean = fd.ops.div(fd.ops.sum(x, dims=[0, 2, 3]), float(count))
        xc = fd.ops.sub(x, _bcast(fd, mean, 4, [1]))
        var = fd.ops.div(fd.ops.sum(fd.ops.mul(xc, xc), dims=[0, 2, 3]), float(count))
        invstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.mul(xc, _bcast(fd, invstd, 4, [1])), _bcast(fd, w, 4, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 4, [1])))
        fd.add_output(mean)
        fd.add_output(invstd)
        fd.add_output(fd.ops.add(fd.ops.mul(rm, 1.0 - m), fd.ops.mul(mean, m)))
        fd.add_output(fd.ops.add(fd.ops.mul(rv, 1.0 - m), fd.ops.mul(var, m * count / (count - 1))))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        c = sizes[1]
        rng = _rng("batchnorm_nchw_train", sizes, seed)
        return [_randn(rng, sizes, scale=2.0, shift=0.5), _randn(rng, (c,), scale=0.5, shift=1.0),
                _randn(rng, (c,)), _randn(rng, (c,), scale=0.1),
                rng.uniform(0.5, 1.5, size=c).astype(np.float32)]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, rm: np.ndarray,
            rv: np.ndarray) -> List[np.ndarray]:
        mu, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
        invstd = 1.0 / np.sqrt(var + LN_EPS)
        y = (x - mu[:, None, None]) * invstd[:, None, None] * w[:, None, None] + b[:, None, None]
        return [y, mu, invstd, rm * (1 - m) + m * mu, rv * (1 - m) + m * x.var(axis=(0, 2, 3), ddof=1)]
    return Family("batchnorm_nchw_train", sizes, fd, make, ref, rtol=1e-4, atol=1e-4,
                  out_tols=[None, None, (1e-4, 1e-2), None, None])


@family(((1, 4, 1, 2), (2, 4, 5, 7), (1, 8, 13, 11), (3, 12, 1, 61), (2, 16, 3, 3)),
        ((1, 4, 1, 2), (2, 8, 5, 7), (2, 320, 32, 32), (16, 512, 64, 64), (1, 64, 130, 7)),
        (16, 512, 64, 64))
def group_norm_nchw(sizes: Sizes) -> Family:
    """nn.GroupNorm(groups, C) on NCHW as torch traces it (diffusion UNets): x viewed as
    [N, G, C/G, H, W], statistics over the last three axes, viewed back, per-channel affine.
    G = 32 where C allows (SD's norm layers), else 4."""
    n, c, h, w_ = sizes
    g = 32 if c % 32 == 0 else 4
    with FusionDefinition() as fd:
        x = _tensor(fd, 4)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        xr = fd.ops.reshape(x, [n, g, c // g, h, w_])
        var, mean = fd.ops.var_mean(xr, dims=[2, 3, 4], correction=0)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.sub(xr, _bcast(fd, mean, 5, [0, 1])), _bcast(fd, rstd, 5, [0, 1]))
        y = fd.ops.reshape(y, [n, c, h, w_])
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bcast(fd, w, 4, [1])), _bcast(fd, b, 4, [1])))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("group_norm_nchw", sizes, seed)
        return [_randn(rng, sizes, scale=2.0, shift=0.5), _randn(rng, (sizes[1],), scale=0.5, shift=1.0),
                _randn(rng, (sizes[1],))]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        xr = x.reshape(n, g, -1)
        y = (xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + LN_EPS)
        return [y.reshape(x.shape) * w[:, None, None] + b[:, None, None]]
    # One kernel: the output is computed at the grouped shape and handed back as [N, C, H, W].
    return Family("group_norm_nchw", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(((1, 1, 1, 1), (2, 3, 5, 7), (1, 5, 13, 11), (3, 2, 1, 61), (2, 3, 33, 31)),
        ((1, 1, 1, 1), (2, 3, 5, 7), (3, 2, 1, 61), (8, 64, 64, 64), (1, 3, 512, 512)),
        (16, 128, 64, 64))
def instancenorm_last_two_axes(sizes: Sizes) -> Family:
    """nn.InstanceNorm2d(affine=True) on NCHW: statistics over the last two axes (2, 3) per
    (n, c), the per-channel weight and bias broadcast on axis 1."""
    _, _, h, w_ = sizes
    hw = h * w_
    with FusionDefinition() as fd:
        x = _tensor(fd, 4)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[2, 3]), 1.0 / hw)
        xc = fd.ops.sub(x, _bcast(fd, mean, 4, [0, 1]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[2, 3]), 1.0 / hw)
        rstd = _bcast(fd, fd.ops.rsqrt(fd.ops.add(var, LN_EPS)), 4, [0, 1])
        y = fd.ops.mul(fd.ops.mul(xc, rstd), _bcast(fd, w, 4, [1]))
        fd.add_output(fd.ops.add(y, _bcast(fd, b, 4, [1])))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        c = sizes[1]
        rng = _rng("instancenorm_last_two_axes", sizes, seed)
        return [_randn(rng, sizes, shift=0.3), _randn(rng, (c,), scale=0.5, shift=1.0), _randn(rng, (c,))]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        mu = x.mean(axis=(2, 3), keepdims=True)
        var = x.var(axis=(2, 3), keepdims=True)
        return [(x - mu) / np.sqrt(var + LN_EPS) * w[:, None, None] + b[:, None, None]]
    return Family("instancenorm_last_two_axes", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


@family(((1, 1, 1), (2, 3, 5), (3, 1, 67), (5, 17, 13), (2, 64, 65)),
        ((1, 1, 1), (2, 3, 5), (3, 1, 67), (64, 197, 768), (8, 1024, 1024)), (64, 512, 512))
def layernorm_last_two_axes_keepdim(sizes: Sizes) -> Family:
    """``F.layer_norm(x, x.shape[-2:])`` without affine on [B, R, C]: keepdim statistics
    over axes (1, 2) of shape [B, 1, 1]."""
    _, r, c = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 3)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1, 2], keepdim=True), 1.0 / (r * c))
        xc = fd.ops.sub(x, mean)
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1, 2], keepdim=True), 1.0 / (r * c))
        fd.add_output(fd.ops.mul(xc, fd.ops.rsqrt(fd.ops.add(var, LN_EPS))))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        mu = x.mean(axis=(1, 2), keepdims=True)
        return [(x - mu) / np.sqrt(x.var(axis=(1, 2), keepdims=True) + LN_EPS)]
    return Family("layernorm_last_two_axes_keepdim", sizes, fd,
                  _rows_inputs("layernorm_last_two_axes_keepdim", 1.0), ref, rtol=1e-4, atol=1e-4)


@family(((1, 1, 1, 1), (2, 8, 5, 7), (2, 96, 7, 9), (1, 3, 1, 33)),
        ((1, 1, 1, 1), (2, 8, 5, 7), (8, 96, 56, 56), (32, 192, 28, 28)), (32, 128, 56, 56))
def layernorm2d_permuted(sizes: Sizes) -> Family:
    """timm's LayerNorm2d (ConvNeXt, channels-first): ``F.layer_norm(x.permute(0, 2, 3, 1),
    (C,), w, b, 1e-6).permute(0, 3, 1, 2)`` on NCHW, the statistics in float as
    ``var_mean``; sizes (N, C, H, W)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 4)
        w, b = _tensor(fd, 1), _tensor(fd, 1)
        xp = fd.ops.permute(x, [0, 2, 3, 1])
        var, mean = fd.ops.var_mean(xp, [3], correction=0)
        y = fd.ops.mul(fd.ops.sub(xp, fd.ops.broadcast_in_dim(mean, [-1] * 4, [0, 1, 2])),
                       fd.ops.broadcast_in_dim(fd.ops.rsqrt(fd.ops.add(var, 1e-6)), [-1] * 4, [0, 1, 2]))
        y = fd.ops.add(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, [-1] * 4, [3])),
                       fd.ops.broadcast_in_dim(b, [-1] * 4, [3]))
        fd.add_output(fd.ops.permute(y, [0, 3, 1, 2]))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("layernorm2d_permuted", sizes, seed)
        c = sizes[1]
        return [_randn(rng, sizes, shift=0.5), _randn(rng, (c,), shift=1.0), _randn(rng, (c,))]

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        mu = x.mean(axis=1, keepdims=True)
        y = (x - mu) / np.sqrt(x.var(axis=1, keepdims=True) + 1e-6)
        return [y * w[:, None, None] + b[:, None, None]]
    return Family("layernorm2d_permuted", sizes, fd, make, ref, rtol=1e-4, atol=1e-4)


# ============================================================================ optimizers
OPT_CPU: Tuple[Sizes, ...] = ((1, 1), (7, 3), (5, 13), (1000, 3), (3, 4099))
OPT_GPU: Tuple[Sizes, ...] = ((1, 1), (7, 3), (4099, 13), (4096, 4096), (1, 10_000_019))
OPT_BENCH: Sizes = (8192, 4096)

# AdamW hyper-parameters at step 10 (lr, beta1, beta2, eps, weight decay).
ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 1e-2, "step": 10}


def _adamw_scalars() -> List[float]:
    """What torch's _single_tensor_adamw computes on the host for the fused update."""
    a = ADAM
    bc1 = 1 - a["beta1"] ** a["step"]
    bc2 = 1 - a["beta2"] ** a["step"]
    return [1 - a["lr"] * a["wd"], 1 - a["beta1"], a["beta2"], 1 - a["beta2"], a["lr"] / bc1,
            math.sqrt(bc2), a["eps"]]


def _adamw(sizes: Sizes, grad_dt: DataType, name: str) -> Family:
    """AdamW step (torch.optim.AdamW, foreach off) on a [R, C] parameter: ``p *= 1 - lr*wd;
    m.lerp_(g, 1 - beta1); v = v * beta2 + g * g * (1 - beta2); p -= step_size * m /
    (sqrt(v) / sqrt(bc2) + eps)`` with the seven host-computed runtime scalars; outputs the
    new param, exp_avg and exp_avg_sq."""
    with FusionDefinition() as fd:
        p = _tensor(fd, 2)
        g = _tensor(fd, 2, grad_dt)
        m = _tensor(fd, 2)
        v = _tensor(fd, 2)
        decay, omb1, beta2, omb2, step_size, bc2_sqrt, eps = [
            fd.define_scalar(dtype=DataType.Double) for _ in range(7)]
        gf = fd.ops.cast(g, DataType.Float) if grad_dt != DataType.Float else g
        p1 = fd.ops.mul(p, decay)
        m1 = fd.ops.add(m, fd.ops.mul(fd.ops.sub(gf, m), omb1))
        v1 = fd.ops.add(fd.ops.mul(v, beta2), fd.ops.mul(fd.ops.mul(gf, gf), omb2))
        denom = fd.ops.add(fd.ops.div(fd.ops.sqrt(v1), bc2_sqrt), eps)
        fd.add_output(fd.ops.sub(p1, fd.ops.mul(fd.ops.div(m1, denom), step_size)))
        fd.add_output(m1)
        fd.add_output(v1)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng(name, sizes, seed)
        g = _randn(rng, sizes, np_dtype(grad_dt), scale=0.1)
        m = _randn(rng, sizes, scale=0.01)
        v = (rng.standard_normal(sizes) * 0.01) ** 2
        return [_randn(rng, sizes), g, m, v.astype(np.float32), *_adamw_scalars()]

    def ref(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, decay: float, omb1: float,
            beta2: float, omb2: float, step_size: float, bc2_sqrt: float,
            eps: float) -> List[np.ndarray]:
        m1 = m + (g - m) * omb1
        v1 = v * beta2 + g * g * omb2
        return [p * decay - step_size * m1 / (np.sqrt(v1) / bc2_sqrt + eps), m1, v1]
    return Family(name, sizes, fd, make, ref, rtol=1e-5, atol=1e-6,
                  out_tols=[None, None, (1e-5, 1e-9)], dtypes=_dt_names(grad_dt))


@family(OPT_CPU, OPT_GPU, OPT_BENCH)
def adamw(sizes: Sizes) -> Family:
    """AdamW step, float gradients."""
    return _adamw(sizes, DataType.Float, "adamw")


@family(OPT_CPU, OPT_GPU, OPT_BENCH)
def adamw_fp16_grad(sizes: Sizes) -> Family:
    """AdamW step on a float master parameter with half gradients cast to float."""
    return _adamw(sizes, DataType.Half, "adamw_fp16_grad")


@family(OPT_CPU, OPT_GPU, OPT_BENCH)
def sgd_momentum_fp16_grad(sizes: Sizes) -> Family:
    """SGD with momentum and weight decay (torch.optim.SGD, dampening 0, not Nesterov) with
    half gradients: ``d_p = g.float() + wd * p; buf = buf * momentum + d_p; p -= lr * buf``;
    runtime scalars wd, momentum, lr; outputs the new param and momentum buffer."""
    with FusionDefinition() as fd:
        p = _tensor(fd, 2)
        g = _tensor(fd, 2, DataType.Half)
        buf = _tensor(fd, 2)
        wd, momentum, lr = [fd.define_scalar(dtype=DataType.Double) for _ in range(3)]
        d_p = fd.ops.add(fd.ops.cast(g, DataType.Float), fd.ops.mul(p, wd))
        buf1 = fd.ops.add(fd.ops.mul(buf, momentum), d_p)
        fd.add_output(fd.ops.sub(p, fd.ops.mul(buf1, lr)))
        fd.add_output(buf1)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("sgd_momentum_fp16_grad", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, sizes, np.float16, scale=0.1),
                _randn(rng, sizes, scale=0.1), 1e-4, 0.9, 0.01]

    def ref(p: np.ndarray, g: np.ndarray, buf: np.ndarray, wd: float, momentum: float,
            lr: float) -> List[np.ndarray]:
        buf1 = buf * momentum + g + wd * p
        return [p - lr * buf1, buf1]
    return Family("sgd_momentum_fp16_grad", sizes, fd, make, ref, rtol=1e-5, atol=1e-6,
                  dtypes=("Half",))


@family(OPT_CPU, OPT_GPU, OPT_BENCH)
def grad_norm_clip(sizes: Sizes) -> Family:
    """``clip_grad_norm_`` on one [R, C] gradient: ``total = sum(g²)`` over everything,
    ``g * min(1, max_norm / (sqrt(total) + 1e-6))`` with max_norm a runtime scalar; outputs
    the clipped gradient and the 0-d total norm."""
    with FusionDefinition() as fd:
        g = _tensor(fd, 2)
        max_norm = fd.define_scalar(dtype=DataType.Double)
        norm = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(g, g), dims=[0, 1]))
        coef = fd.ops.minimum(fd.ops.div(max_norm, fd.ops.add(norm, 1e-6)), 1.0)
        fd.add_output(fd.ops.mul(g, _bcast(fd, coef, 2, [])))
        fd.add_output(norm)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        g = _randn(_rng("grad_norm_clip", sizes, seed), sizes)
        # max_norm at half the norm, so the clip is active (and never exactly 1).
        return [g, 0.5 * float(np.sqrt((g.astype(np.float64) ** 2).sum()))]

    def ref(g: np.ndarray, max_norm: float) -> List[np.ndarray]:
        norm = np.sqrt((g * g).sum())
        return [g * min(1.0, max_norm / (norm + 1e-6)), np.asarray(norm)]
    # The total reaches every element only after every block has added to it: without a
    # grid-wide barrier that is a second kernel.
    return Family("grad_norm_clip", sizes, fd, make, ref, kernels=2, rtol=1e-4, atol=1e-6)


@family(((1, 1, 1), (7, 3, 5), (1000, 3, 1), (5, 13, 4099)),
        ((1, 1, 1), (7, 3, 5), (4096, 4096, 4096), (1024, 11008, 4096)), (4096, 4096, 4096))
def grad_norm_clip_two_tensors(sizes: Sizes) -> Family:
    """``clip_grad_norm_`` over a layer's weight [R, C] and bias [K] gradients: the squares
    of both are summed into one total, and both are scaled; outputs both clipped gradients
    and the total norm."""
    with FusionDefinition() as fd:
        gw = _tensor(fd, 2)
        gb = _tensor(fd, 1)
        max_norm = fd.define_scalar(dtype=DataType.Double)
        total = fd.ops.add(fd.ops.sum(fd.ops.mul(gw, gw), dims=[0, 1]),
                           fd.ops.sum(fd.ops.mul(gb, gb), dims=[0]))
        norm = fd.ops.sqrt(total)
        coef = fd.ops.minimum(fd.ops.div(max_norm, fd.ops.add(norm, 1e-6)), 1.0)
        fd.add_output(fd.ops.mul(gw, _bcast(fd, coef, 2, [])))
        fd.add_output(fd.ops.mul(gb, _bcast(fd, coef, 1, [])))
        fd.add_output(norm)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        r, c, k = sizes
        rng = _rng("grad_norm_clip_two_tensors", sizes, seed)
        gw, gb = _randn(rng, (r, c)), _randn(rng, (k,), scale=3.0)
        norm = float(np.sqrt((gw.astype(np.float64) ** 2).sum() + (gb.astype(np.float64) ** 2).sum()))
        return [gw, gb, 0.5 * norm]

    def ref(gw: np.ndarray, gb: np.ndarray, max_norm: float) -> List[np.ndarray]:
        norm = np.sqrt((gw * gw).sum() + (gb * gb).sum())
        coef = min(1.0, max_norm / (norm + 1e-6))
        return [gw * coef, gb * coef, np.asarray(norm)]
    return Family("grad_norm_clip_two_tensors", sizes, fd, make, ref, kernels=2, rtol=1e-4, atol=1e-6)


# ============================================================================ gathers, permutes
@family(((1, 2, 1), (5, 7, 3), (13, 100, 97), (1000, 31, 3), (3, 50, 4099)),
        ((1, 2, 1), (5, 7, 3), (4099, 1000, 13), (8192, 50257, 768), (4096, 32000, 4096)),
        (16384, 50257, 1024))
def index_select_shifted_ids(sizes: Sizes) -> Family:
    """``index_select(table, ids + 1, 0) * scale``: a gather whose index is computed in the
    fusion (ids [N] int64 in [0, V-2], table [V, H]; sizes (N, V, H))."""
    with FusionDefinition() as fd:
        table = _tensor(fd, 2)
        ids = _tensor(fd, 1, DataType.Int)
        rows = fd.ops.index_select(table, fd.ops.add(ids, 1), 0)
        fd.add_output(fd.ops.mul(rows, 0.5))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        n, v, h = sizes
        rng = _rng("index_select_shifted_ids", sizes, seed)
        return [_randn(rng, (v, h)), rng.integers(0, v - 1, size=n).astype(np.int64)]

    def ref(table: np.ndarray, ids: np.ndarray) -> List[np.ndarray]:
        return [table[ids + 1] * 0.5]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        return _nbytes(ins[1]) + 2 * _nbytes(outs[0])  # the selected rows, the ids, the output
    return Family("index_select_shifted_ids", sizes, fd, make, ref, rtol=1e-6, atol=0.0,
                  min_bytes=traffic)


@family(((1, 1, 1), (7, 11, 5), (100, 13, 97), (3, 1000, 3), (64, 50, 1031)),
        ((1, 1, 1), (7, 11, 5), (1024, 50257, 768), (2048, 50257, 1600)), (8192, 50257, 1600))
def embedding_plus_positions(sizes: Sizes) -> Family:
    """GPT-2 embeddings: ``wte[ids] + wpe[:S]`` (index_select of the token table plus the
    position table's first S rows, passed as a slice input); sizes (S, V, H)."""
    with FusionDefinition() as fd:
        wte = _tensor(fd, 2)
        ids = _tensor(fd, 1, DataType.Int)
        pos = _tensor(fd, 2)
        fd.add_output(fd.ops.add(fd.ops.index_select(wte, ids, 0), pos))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        s, v, h = sizes
        rng = _rng("embedding_plus_positions", sizes, seed)
        wpe = _randn(rng, (s + 3, h), scale=0.1)
        return [_randn(rng, (v, h)), rng.integers(0, v, size=s).astype(np.int64), wpe[:s]]

    def ref(wte: np.ndarray, ids: np.ndarray, pos: np.ndarray) -> List[np.ndarray]:
        return [wte[ids] + pos]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        return _nbytes(ins[1]) + _nbytes(ins[2]) + 2 * _nbytes(outs[0])
    return Family("embedding_plus_positions", sizes, fd, make, ref, rtol=1e-6, atol=1e-7,
                  min_bytes=traffic)


@family(((1, 1, 1, 1), (2, 3, 11, 5), (3, 7, 50, 33), (2, 64, 100, 97)),
        ((1, 1, 1, 1), (2, 5, 11, 7), (4, 512, 50257, 768), (8, 1024, 50257, 768)), (16, 1024, 50257, 768))
def gpt2_embedding_batched(sizes: Sizes) -> Family:
    """GPT2Model's embeddings of a [B, S] batch as ATen writes them:
    ``index_select(wte, ids.reshape(-1), 0).view(B, S, H) + wpe[position_ids]`` (the
    traced sizes as constants, the position rows gathered and broadcast over the batch);
    sizes (B, S, V, H)."""
    b, s, _, h = sizes
    with FusionDefinition() as fd:
        wte = _tensor(fd, 2)
        ids = _tensor(fd, 2, DataType.Int)
        wpe = _tensor(fd, 2)
        pos = _tensor(fd, 1, DataType.Int)
        tokens = fd.ops.reshape(fd.ops.index_select(wte, fd.ops.reshape(ids, [-1]), 0), [b, s, h])
        positions = fd.ops.broadcast_in_dim(fd.ops.index_select(wpe, pos, 0), [b, s, h], [1, 2])
        fd.add_output(fd.ops.add(tokens, positions))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, s, v, h = sizes
        rng = _rng("gpt2_embedding_batched", sizes, seed)
        return [_randn(rng, (v, h)), rng.integers(0, v, size=(b, s)).astype(np.int64),
                _randn(rng, (s + 5, h), scale=0.1), np.arange(s, dtype=np.int64)]

    def ref(wte: np.ndarray, ids: np.ndarray, wpe: np.ndarray, pos: np.ndarray) -> List[np.ndarray]:
        return [wte[ids] + wpe[pos][None]]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        # The ids, the gathered token rows and position rows, the output.
        pos_rows = _nbytes(outs[0]) // max(1, ins[1].shape[0])
        return _nbytes(ins[1]) + _nbytes(ins[3]) + 2 * _nbytes(outs[0]) + pos_rows
    return Family("gpt2_embedding_batched", sizes, fd, make, ref, rtol=1e-6, atol=1e-7, min_bytes=traffic)


@family(((1, 1, 1), (7, 11, 5), (100, 13, 97), (3, 1000, 3), (64, 50, 1031)),
        ((1, 1, 1), (7, 11, 5), (4096, 30522, 768), (8192, 30522, 1024)), (16384, 30522, 1024))
def bert_embeddings(sizes: Sizes) -> Family:
    """BertEmbeddings: ``LayerNorm(word[ids] + token_type[type_ids] + position[:T])`` with
    two index_selects and a row LayerNorm (eps 1e-12); sizes (T, V, H)."""
    _, _, h = sizes
    with FusionDefinition() as fd:
        word = _tensor(fd, 2)
        ids = _tensor(fd, 1, DataType.Int)
        ttab = _tensor(fd, 2)
        tids = _tensor(fd, 1, DataType.Int)
        pos = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        e = fd.ops.add(fd.ops.add(fd.ops.index_select(word, ids, 0), fd.ops.index_select(ttab, tids, 0)), pos)
        mean = fd.ops.mul(fd.ops.sum(e, dims=[1]), 1.0 / h)
        ec = fd.ops.sub(e, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(ec, ec), dims=[1]), 1.0 / h)
        y = fd.ops.mul(ec, _bcast(fd, fd.ops.rsqrt(fd.ops.add(var, 1e-12)), 2, [0]))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bcast(fd, w, 2, [1])), _bcast(fd, b, 2, [1])))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        t, v, h = sizes
        rng = _rng("bert_embeddings", sizes, seed)
        return [_randn(rng, (v, h)), rng.integers(0, v, size=t).astype(np.int64), _randn(rng, (2, h)),
                (np.arange(t) >= t // 2).astype(np.int64), _randn(rng, (512 + t, h), scale=0.1)[:t],
                _randn(rng, (h,), scale=0.5, shift=1.0), _randn(rng, (h,), scale=0.5)]

    def ref(word: np.ndarray, ids: np.ndarray, ttab: np.ndarray, tids: np.ndarray, pos: np.ndarray,
            w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [_ln_ref(word[ids] + ttab[tids] + pos, 1e-12)[0] * w + b]

    def traffic(ins: Sequence[Any], outs: Sequence[Any]) -> int:
        return (_nbytes(ins[1]) + _nbytes(ins[3]) + _nbytes(ins[4]) + 2 * _nbytes(outs[0])
                + _nbytes(ins[5]) + _nbytes(ins[6]))
    return Family("bert_embeddings", sizes, fd, make, ref, rtol=1e-4, atol=1e-4, min_bytes=traffic)


@family(((1, 1), (3, 5), (33, 65), (1000, 3), (70, 130)),
        ((1, 1), (3, 5), (1000, 3), (4099, 1031), (8192, 8192)), (8192, 8192))
def permute_with_pointwise_around(sizes: Sizes) -> Family:
    """Pointwise ops before and after a 2-D transpose: ``(relu(x * 2 + 1).T + bias) * 0.5``
    with bias [M] broadcast along the output's rows."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        bias = _tensor(fd, 1)
        a = fd.ops.relu(fd.ops.add(fd.ops.mul(x, 2.0), 1.0))
        p = fd.ops.permute(a, [1, 0])
        fd.add_output(fd.ops.mul(fd.ops.add(p, _bcast(fd, bias, 2, [1])), 0.5))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("permute_with_pointwise_around", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, (sizes[0],))]

    def ref(x: np.ndarray, bias: np.ndarray) -> List[np.ndarray]:
        return [(np.maximum(x * 2 + 1, 0).T + bias[None, :]) * 0.5]
    return Family("permute_with_pointwise_around", sizes, fd, make, ref, rtol=1e-6, atol=1e-6)


@family(((1, 1, 1), (2, 3, 5), (3, 33, 65), (1, 1000, 3), (2, 70, 130)),
        ((1, 1, 1), (2, 3, 5), (3, 1000, 7), (8, 1024, 768), (4, 4096, 4096)), (8, 4096, 4096))
def bsh_to_bhs_silu(sizes: Sizes) -> Family:
    """A batched transpose between pointwise ops: ``silu((x + bias).permute(0, 2, 1))`` on
    [B, S, H] -> [B, H, S] (bias [H] before the permute, silu = t * sigmoid(t) after)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 3)
        bias = _tensor(fd, 1)
        t = fd.ops.permute(fd.ops.add(x, _bcast(fd, bias, 3, [2])), [0, 2, 1])
        fd.add_output(fd.ops.mul(t, fd.ops.sigmoid(t)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("bsh_to_bhs_silu", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, (sizes[2],))]

    def ref(x: np.ndarray, bias: np.ndarray) -> List[np.ndarray]:
        t = np.transpose(x + bias, (0, 2, 1))
        return [t / (1.0 + np.exp(-t))]
    return Family("bsh_to_bhs_silu", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)


@family(((1, 1, 1), (3, 2, 5), (33, 3, 65), (1000, 1, 3), (7, 5, 131)),
        ((1, 1, 1), (3, 2, 5), (1000, 3, 7), (2048, 4, 4096), (4096, 8, 1024)), (4096, 8, 4096))
def megatron_sbh_to_bsh_bias_residual(sizes: Sizes) -> Family:
    """Megatron's sequence-first layout back to batch-first after the output projection:
    ``x.permute(1, 0, 2) + bias + residual`` with x [S, B, H], bias [H], residual [B, S, H]
    (a permute that keeps the last axis)."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 3)
        bias = _tensor(fd, 1)
        res = _tensor(fd, 3)
        t = fd.ops.add(fd.ops.permute(x, [1, 0, 2]), _bcast(fd, bias, 3, [2]))
        fd.add_output(fd.ops.add(t, res))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        s, b, h = sizes
        rng = _rng("megatron_sbh_to_bsh_bias_residual", sizes, seed)
        return [_randn(rng, (s, b, h)), _randn(rng, (h,)), _randn(rng, (b, s, h))]

    def ref(x: np.ndarray, bias: np.ndarray, res: np.ndarray) -> List[np.ndarray]:
        return [np.transpose(x, (1, 0, 2)) + bias + res]
    return Family("megatron_sbh_to_bsh_bias_residual", sizes, fd, make, ref, rtol=1e-6, atol=1e-6)


# ============================================================================ outputs and shapes
PW_CPU: Tuple[Sizes, ...] = ((1, 1), (1, 7), (7, 1), (3, 5), (31, 997), (1000, 3), (2, 4099))
PW_GPU: Tuple[Sizes, ...] = ((1, 1), (7, 1), (31, 997), (4099, 13), (2, 65537), (8192, 8192))


@family(PW_CPU, PW_GPU, (16384, 4096))
def outputs_of_three_ranks(sizes: Sizes) -> Family:
    """``y = x * w`` with its row sums [M] and its total (0-d) as outputs beside it."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        y = fd.ops.mul(x, _bcast(fd, w, 2, [1]))
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, dims=[1]))
        fd.add_output(fd.ops.sum(y, dims=[0, 1]))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("outputs_of_three_ranks", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, (sizes[1],))]

    def ref(x: np.ndarray, w: np.ndarray) -> List[np.ndarray]:
        y = x * w
        return [y, y.sum(axis=1), np.asarray(y.sum())]
    m, n = sizes
    return Family("outputs_of_three_ranks", sizes, fd, make, ref, kernels=_total_kernels(m),
                  rtol=1e-5, atol=1e-5,
                  out_tols=[None, (1e-4, 1e-5 * math.sqrt(n) * 10), (1e-4, 1e-5 * math.sqrt(m * n) * 10)])


@family(PW_CPU, PW_GPU, (16384, 4096))
def intermediate_outputs(sizes: Sizes) -> Family:
    """Bias + GELU(tanh) that also outputs the pre-activation ``t = x + b`` (kept for the
    backward): the intermediate is an output and feeds the rest."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        b = _tensor(fd, 1)
        t = fd.ops.add(x, _bcast(fd, b, 2, [1]))
        inner = fd.ops.mul(fd.ops.add(t, fd.ops.mul(fd.ops.mul(fd.ops.mul(t, t), t), 0.044715)), 0.7978845608)
        fd.add_output(t)
        fd.add_output(fd.ops.mul(fd.ops.mul(t, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("intermediate_outputs", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, (sizes[1],))]

    def ref(x: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        t = x + b
        return [t, _gelu_tanh(t)]
    return Family("intermediate_outputs", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)


@family(PW_CPU, PW_GPU, (16384, 3072))
def bert_gelu_erf(sizes: Sizes) -> Family:
    """BERT's exact GELU on the bias-added intermediate: ``0.5 * h * (1 + erf(h / sqrt(2)))``."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        b = _tensor(fd, 1)
        h = fd.ops.add(x, fd.ops.broadcast(b, [True, False]))
        erf = fd.ops.erf(fd.ops.mul(h, 0.7071067811865476))
        fd.add_output(fd.ops.mul(fd.ops.mul(h, 0.5), fd.ops.add(erf, 1.0)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("bert_gelu_erf", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, (sizes[1],))]

    def ref(x: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        h = x + b
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return [0.5 * h * (1 + erf(h / math.sqrt(2)))]
    return Family("bert_gelu_erf", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)


@family(PW_CPU, PW_GPU, (16384, 4096))
def half_input_two_outputs(sizes: Sizes) -> Family:
    """A half input cast to float once, feeding two outputs: the float upcast itself
    (``x.float()``) and ``tanh(x.float()).half()``."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2, DataType.Half)
        xf = fd.ops.cast(x, DataType.Float)
        fd.add_output(xf)
        fd.add_output(fd.ops.cast(fd.ops.tanh(xf), DataType.Half))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        return [_randn(_rng("half_input_two_outputs", sizes, seed), sizes, np.float16, scale=2.0)]

    def ref(x: np.ndarray) -> List[np.ndarray]:
        return [x, np.tanh(x)]
    return Family("half_input_two_outputs", sizes, fd, make, ref, rtol=0.0, atol=0.0,
                  out_tols=[None, (1e-3, 1e-3)], dtypes=("Half",))


@family(((1, 1, 1), (1, 7, 3), (7, 1, 1), (3, 5, 97), (31, 997, 5), (1000, 3, 4099)),
        ((1, 1, 1), (7, 1, 1), (31, 997, 5), (4096, 4096, 1000003)), (16384, 4096, 16777216))
def independent_outputs(sizes: Sizes) -> Family:
    """Two independent outputs of different rank in one fusion: ``exp(a) * 2`` of [M, N] and
    ``b * 3 + 1`` of an unrelated [K]; sizes (M, N, K)."""
    with FusionDefinition() as fd:
        a = _tensor(fd, 2)
        b = _tensor(fd, 1)
        fd.add_output(fd.ops.mul(fd.ops.exp(a), 2.0))
        fd.add_output(fd.ops.add(fd.ops.mul(b, 3.0), 1.0))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        m, n, k = sizes
        rng = _rng("independent_outputs", sizes, seed)
        return [_randn(rng, (m, n)), _randn(rng, (k,))]

    def ref(a: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [np.exp(a) * 2.0, b * 3.0 + 1.0]
    return Family("independent_outputs", sizes, fd, make, ref, rtol=1e-6, atol=1e-6)


@family(((1, 1, 1), (3, 1, 5), (1, 7, 1), (5, 3, 2), (17, 33, 9), (2, 1, 4099)),
        ((1, 1, 1), (3, 1, 5), (17, 33, 9), (512, 64, 1024), (1, 4096, 4096)), (256, 128, 1024))
def broadcast_axes_anywhere(sizes: Sizes) -> Family:
    """Size-1 axes in every position: ``u = (x[A, 1, C] + y[1, B, C]) * z[B]`` (z broadcast on
    the middle axis) with outputs u [A, B, C], ``u.sum(1)`` [A, C] and ``u.amax(0,
    keepdim=True)`` [1, B, C]; sizes (A, B, C)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 1, -1])
        y = fd.define_tensor(shape=[1, -1, -1])
        z = _tensor(fd, 1)
        u = fd.ops.mul(fd.ops.add(x, y), _bcast(fd, z, 3, [1]))
        fd.add_output(u)
        fd.add_output(fd.ops.sum(u, dims=[1]))
        fd.add_output(fd.ops.max(u, dims=[0], keepdim=True))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        a, b, c = sizes
        rng = _rng("broadcast_axes_anywhere", sizes, seed)
        return [_randn(rng, (a, 1, c)), _randn(rng, (1, b, c)), _randn(rng, (b,))]

    def ref(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> List[np.ndarray]:
        u = (x + y) * z[None, :, None]
        return [u, u.sum(axis=1), u.max(axis=0, keepdims=True)]
    # Two kernels: the sum over B and the max over A cross (neither axis set holds the
    # other), so one launch would need a cross-block partial of u's own size (or min(A, B)
    # accumulators per thread) where a second kernel rereads no more than u.
    # The sum over B terms of size ~2 cancels to O(1): float32 rounding grows with sqrt(B).
    return Family("broadcast_axes_anywhere", sizes, fd, make, ref, kernels=2, rtol=1e-5, atol=1e-5,
                  out_tols=[None, (1e-5, 1e-5 * max(1.0, math.sqrt(sizes[1]))), None])


@family(PW_CPU, PW_GPU, (16384, 4096))
def row_sum_then_mean_over_rows(sizes: Sizes) -> Family:
    """A per-sample loss averaged over the batch: ``((pred - target)²).sum(1).mean()``, a row
    reduction followed by a mean over the rows (0-d output)."""
    m, _ = sizes
    with FusionDefinition() as fd:
        pred = _tensor(fd, 2)
        target = _tensor(fd, 2)
        d = fd.ops.sub(pred, target)
        per_row = fd.ops.sum(fd.ops.mul(d, d), dims=[1])
        fd.add_output(fd.ops.mul(fd.ops.sum(per_row, dims=[0]), 1.0 / m))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        rng = _rng("row_sum_then_mean_over_rows", sizes, seed)
        return [_randn(rng, sizes), _randn(rng, sizes)]

    def ref(pred: np.ndarray, target: np.ndarray) -> List[np.ndarray]:
        return [np.asarray(((pred - target) ** 2).sum(axis=1).mean())]
    return Family("row_sum_then_mean_over_rows", sizes, fd, make, ref, rtol=1e-4, atol=1e-6)


@family(PW_CPU, PW_GPU, (16384, 4096))
def full_reduction_then_scale(sizes: Sizes) -> Family:
    """AMP loss scaling of a mean loss: ``x.mean() * loss_scale`` (a full reduction, then a
    runtime-scalar scale of the 0-d result)."""
    m, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        scale = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(fd.ops.mul(fd.ops.sum(x, dims=[0, 1]), 1.0 / (m * n)), scale))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        return [_randn(_rng("full_reduction_then_scale", sizes, seed), sizes, shift=0.25), 65536.0]

    def ref(x: np.ndarray, scale: float) -> List[np.ndarray]:
        return [np.asarray(x.mean() * scale)]
    return Family("full_reduction_then_scale", sizes, fd, make, ref, rtol=1e-4, atol=1e-2)


# ============================================================================ long rows
LONG_CPU: Tuple[Sizes, ...] = ((1, 32768), (2, 65536), (3, 32771), (1, 262144))
LONG_GPU: Tuple[Sizes, ...] = ((1, 32768), (3, 32771), (8, 65536), (4, 131072), (2, 262144),
                                (64, 262139), (160, 65537))
LONG_BENCH: Sizes = (64, 262144)


@family(LONG_CPU, LONG_GPU, LONG_BENCH)
def softmax_long_rows(sizes: Sizes) -> Family:
    """Softmax over rows of 32768–262144 columns (too long for registers), few rows."""
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, mx))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        return [_softmax_ref(x)]
    # rtol 1e-3: a float32 sum of 262144 positive terms in sequence (the interpreter running
    # the fusion as written) is off by a few 1e-4.
    return Family("softmax_long_rows", sizes, fd, _rows_inputs("softmax_long_rows"), ref,
                  rtol=1e-3, atol=1e-10)


@family(LONG_CPU, LONG_GPU, LONG_BENCH)
def layernorm_long_rows(sizes: Sizes) -> Family:
    """LayerNorm (rank-1 statistics, affine) over rows of 32768–262144 columns."""
    _, n = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 2)
        w = _tensor(fd, 1)
        b = _tensor(fd, 1)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1]), 1.0 / n)
        xc = fd.ops.sub(x, _bcast(fd, mean, 2, [0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]), 1.0 / n)
        y = fd.ops.mul(xc, _bcast(fd, fd.ops.rsqrt(fd.ops.add(var, LN_EPS)), 2, [0]))
        fd.add_output(fd.ops.add(fd.ops.mul(y, _bcast(fd, w, 2, [1])), _bcast(fd, b, 2, [1])))

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
        return [_ln_ref(x)[0] * w + b]
    return Family("layernorm_long_rows", sizes, fd,
                  _layernorm_inputs("layernorm_long_rows", DataType.Float), ref, rtol=1e-3, atol=1e-3)



@family(((1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 2, 64)), ((1, 1, 1, 2), (2, 129, 4, 64), (4, 512, 32, 128)),
        (4, 2048, 32, 128))
def llama_rope(sizes: Sizes) -> Family:
    """LLaMA attention pre-processing of q: ``q = x.view(B, S, H, D)``; ``q * cos + rotate_half(q)
    * sin`` with ``rotate_half(q) = cat(-q[..., D/2:], q[..., :D/2])`` and cos/sin [S, D];
    ``q.transpose(1, 2)`` to [B, H, S, D], written in that order. Sizes (B, S, H, D)."""
    return _llama_rope(sizes, "llama_rope", None)


@family(((1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 2, 64)), ((1, 1, 1, 2), (2, 129, 4, 64), (4, 512, 32, 128)),
        (4, 2048, 32, 128))
def llama_rope_view(sizes: Sizes) -> Family:
    """``llama_rope`` as Hugging Face's LlamaAttention hands q on: ``transpose(1, 2)`` is a
    strided [B, H, S, D] view of a tensor stored [B, S, H, D] (``add_output(..., stride_order=
    [3, 1, 2, 0])``). Sizes (B, S, H, D)."""
    return _llama_rope(sizes, "llama_rope_view", [3, 1, 2, 0])


def _llama_rope(sizes: Sizes, name: str, stride_order: Optional[List[int]]) -> Family:
    """``llama_rope`` with its output stored in ``stride_order`` (None: [B, H, S, D] order)."""
    _, _, h, d = sizes
    with FusionDefinition() as fd:
        x = _tensor(fd, 3)
        cos = _tensor(fd, 2)
        sin = _tensor(fd, 2)
        q = fd.ops.reshape(x, [fd.ops.size(x, 0), fd.ops.size(x, 1), h, d])
        x1 = fd.ops.slice(q, [0, 0, 0, 0], [None, None, None, d // 2])
        x2 = fd.ops.slice(q, [0, 0, 0, d // 2], [None, None, None, d])
        rot = fd.ops.cat([fd.ops.neg(x2), x1], -1)
        y = fd.ops.add(fd.ops.mul(q, _bcast(fd, cos, 4, [1, 3])), fd.ops.mul(rot, _bcast(fd, sin, 4, [1, 3])))
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]), stride_order=stride_order)

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, s, h, d = sizes
        rng = _rng("llama_rope", sizes, seed)
        pos = np.arange(s)[:, None] / 10000.0 ** (np.arange(0, d, 2) / d)[None, :]
        emb = np.concatenate([pos, pos], -1)
        return [_randn(rng, (b, s, h * d)), np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)]

    def ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> List[np.ndarray]:
        b, s = x.shape[:2]
        q = x.reshape(b, s, h, d)
        rot = np.concatenate([-q[..., d // 2:], q[..., :d // 2]], -1)
        return [(q * cos[None, :, None, :] + rot * sin[None, :, None, :]).transpose(0, 2, 1, 3)]
    return Family(name, sizes, fd, make, ref, rtol=1e-5, atol=1e-5)


@family(((1, 1, 1, 1), (2, 3, 5, 4), (1, 2, 17, 64)), ((1, 1, 1, 1), (2, 4, 129, 64), (8, 8, 1024, 128)),
        (8, 8, 2048, 128))
def llama_repeat_kv(sizes: Sizes) -> Family:
    """LLaMA's ``repeat_kv`` for grouped-query attention, on k [B, KV, S, D] with 4 query heads
    per KV head: ``k[:, :, None].expand(B, KV, 4, S, D).reshape(B, KV * 4, S, D)``, then scaled
    by ``1/sqrt(D)``. Sizes (B, KV, S, D)."""
    b, kv, s, d = sizes
    with FusionDefinition() as fd:
        k = _tensor(fd, 4)
        e = fd.ops.broadcast_in_dim(k, [b, kv, 4, s, d], [0, 1, 3, 4])
        r = fd.ops.reshape(e, [fd.ops.size(k, 0), kv * 4, fd.ops.size(k, 2), d])
        fd.add_output(fd.ops.mul(r, 1.0 / math.sqrt(d)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        return [_randn(_rng("llama_repeat_kv", sizes, seed), sizes)]

    def ref(k: np.ndarray) -> List[np.ndarray]:
        e = np.broadcast_to(k[:, :, None], (b, kv, 4, s, d))
        return [e.reshape(b, kv * 4, s, d) / math.sqrt(d)]
    return Family("llama_repeat_kv", sizes, fd, make, ref, rtol=1e-6, atol=1e-7,
                  min_bytes=lambda ins, outs: 5 * _nbytes(ins[0]))


@family(((1, 1, 1), (2, 3, 5), (1, 2, 67)), ((1, 1, 1), (2, 4, 129), (8, 16, 1024)), (8, 16, 1024))
def causal_softmax_triu(sizes: Sizes) -> Family:
    """Causal attention probabilities with the mask built in the fusion, as Mistral/LLaMA code
    builds it: ``mask = triu(full([S, S], finfo.min), 1)``; ``softmax(scores * scale + mask)``
    on [B, H, S, S]. Sizes (B, H, S)."""
    _, _, s = sizes
    with FusionDefinition() as fd:
        scores = _tensor(fd, 4)
        mask = fd.ops.triu(fd.ops.full([s, s], F32_MIN, DataType.Float), 1)
        w = fd.ops.add(fd.ops.mul(scores, 0.125), _bcast(fd, mask, 4, [2, 3]))
        mx = fd.ops.max(w, dims=[3], keepdim=True)
        ex = fd.ops.exp(fd.ops.sub(w, mx))
        fd.add_output(fd.ops.div(ex, fd.ops.sum(ex, dims=[3], keepdim=True)))

    def make(sizes: Sizes, seed: int = 0) -> List[Any]:
        b, h, s = sizes
        return [_randn(_rng("causal_softmax_triu", sizes, seed), (b, h, s, s), scale=3.0)]

    def ref(scores: np.ndarray) -> List[np.ndarray]:
        s = scores.shape[-1]
        return [_softmax_ref(scores * 0.125 + np.triu(np.full((s, s), F32_MIN), 1))]
    return Family("causal_softmax_triu", sizes, fd, make, ref, rtol=1e-5, atol=1e-6)

def spec(name: str) -> Spec:
    """The spec of builder ``name``."""
    for s in SPECS:
        if s.name == name:
            return s
    raise KeyError(name)
