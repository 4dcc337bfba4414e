"""iota and counter-based random numbers: values against an independent Python Philox
4x32-10, schedule independence (automatic schedule vs the fusion as written), seeds and
offsets, the distributions' statistics, a dropout; ``-m gpu``: the GPU gives the same bits."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

M32 = 0xFFFFFFFF


def _philox(counter: List[int], key: List[int]) -> List[int]:
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k[1]) & M32, p0 & M32]
        k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
    return c


def _uniform_ref(seed: int, offset: int, n: int, lo: float, hi: float) -> np.ndarray:
    """float32 uniforms: top 24 bits of word 0, then fma(u, hi - lo, lo) (exact in float64)."""
    out = np.empty(n, np.float32)
    span = np.float32(hi) - np.float32(lo)
    for i in range(n):
        r = _philox([i & M32, i >> 32, offset & M32, offset >> 32], [seed & M32, seed >> 32])
        u = (r[0] >> 8) / 16777216.0
        out[i] = np.float32(u * np.float64(span) + np.float64(np.float32(lo)))  # one rounding: fma
    return out


def test_philox_reference_known_answer() -> None:
    assert _philox([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def _uniform_fd(shape: List[int], lo: float, hi: float) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        seed = fd.define_scalar(dtype=DataType.Int)
        offset = fd.define_scalar(dtype=DataType.Int)
        u = fd.ops.uniform(lo, hi, fd.ops.shape(x), DataType.Float, seed, offset)
        fd.add_output(fd.ops.add(u, fd.ops.mul(x, 0.0)))
    return fd


@pytest.mark.parametrize("shape", [[37], [5, 11], [2, 3, 17]])
def test_uniform_bits_match_the_reference(shape: List[int]) -> None:
    fd = _uniform_fd(shape, -2.0, 3.0)
    x = np.zeros(shape, np.float32)
    (got,) = fd.execute([x, 1234567, 9])
    want = _uniform_ref(1234567, 9, int(np.prod(shape)), -2.0, 3.0).reshape(shape)
    np.testing.assert_array_equal(got, want)
    (as_written,) = fd.execute([x, 1234567, 9], as_written=True)
    np.testing.assert_array_equal(got, as_written)  # the schedule does not change the values


def test_seed_and_offset_select_the_stream() -> None:
    fd = _uniform_fd([4096], 0.0, 1.0)
    x = np.zeros(4096, np.float32)
    a, b, c, d = (fd.execute([x, s, o])[0] for s, o in [(1, 0), (1, 0), (2, 0), (1, 1)])
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.99 and (a != d).mean() > 0.99
    assert 0.0 <= a.min() and a.max() < 1.0
    assert abs(a.mean() - 0.5) < 0.02 and abs(a.var() - 1 / 12) < 0.01


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Double, DataType.Half])
def test_normal_statistics(dtype: DataType) -> None:
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.normal(3.0, 0.5, [200, 100], dtype, rng_seed=7, rng_offset=0))
    (z,) = fd.execute([])
    z64 = z.astype(np.float64)
    assert np.isfinite(z64).all()
    assert abs(z64.mean() - 3.0) < 0.01 and abs(z64.std() - 0.5) < 0.01
    # within one, two and three standard deviations: 68.3%, 95.4%, 99.7%
    for k, frac in [(1, 0.683), (2, 0.954), (3, 0.997)]:
        assert abs((np.abs(z64 - 3.0) < k * 0.5).mean() - frac) < 0.01


def _dropout_fd(p: float) -> FusionDefinition:
    # dropout + residual + LayerNorm statistics, as a transformer block writes it
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        res = fd.define_tensor([-1, -1])
        seed = fd.define_scalar(dtype=DataType.Int)
        keep = fd.ops.ge(fd.ops.rand_like(x, seed, 0), p)
        h = fd.ops.add(fd.ops.where(keep, fd.ops.mul(x, 1.0 / (1.0 - p)), 0.0), res)
        var, mean = fd.ops.var_mean(h, [1], correction=0, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(h, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(y)
        fd.add_output(keep)
    return fd


def _dropout_inputs(xp: Any) -> Tuple[Any, Any]:
    rng = np.random.default_rng(0)
    return (xp.asarray(rng.normal(size=(64, 512)).astype(np.float32)),
            xp.asarray(rng.normal(size=(64, 512)).astype(np.float32)))


def test_dropout_residual_layernorm() -> None:
    p = 0.1
    fd = _dropout_fd(p)
    x, res = _dropout_inputs(np)
    y, keep = fd.execute([x, res, 2024])
    assert abs(keep.mean() - (1 - p)) < 0.005  # 32768 draws: 5 standard deviations is 0.0083
    h = np.where(keep, x.astype(np.float64) / (1 - p), 0.0) + res
    want = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_iota_matches_arange() -> None:
    with FusionDefinition() as fd:
        n = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.iota(n, 3, -2, DataType.Int))
        fd.add_output(fd.ops.iota(n, 0.25, 0.1, DataType.Float))
        fd.add_output(fd.ops.iota(7, 1.0, 0.5, DataType.Double))
    ints, floats, doubles = fd.execute([33])
    np.testing.assert_array_equal(ints, 3 - 2 * np.arange(33))
    step = np.float64(np.float32(0.1))
    np.testing.assert_array_equal(floats, (0.25 + np.arange(33) * step).astype(np.float32))
    np.testing.assert_array_equal(doubles, 1.0 + 0.5 * np.arange(7))


def test_random_and_iota_refuse_bad_types() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        with pytest.raises(KilnError, match="uniform: dtype int64 is not a floating type"):
            fd.ops.uniform(0.0, 1.0, [4], DataType.Int)
        with pytest.raises(KilnError, match="normal: rng_seed has dtype double; expected Int"):
            fd.ops.normal(0.0, 1.0, [4], DataType.Float, rng_seed=1.5)
        with pytest.raises(KilnError, match="iota: dtype Bool"):
            fd.ops.iota(4, 0, 1, DataType.Bool)
        fd.add_output(x)


@pytest.mark.gpu
def test_gpu_gives_the_interpreters_bits() -> None:
    cp = cupy_or_skip()
    fd = _dropout_fd(0.25)
    x, res = _dropout_inputs(np)
    y_cpu, keep_cpu = fd.execute([x, res, 99])
    y_gpu, keep_gpu = fd.execute([cp.asarray(x), cp.asarray(res), 99])
    np.testing.assert_array_equal(cp.asnumpy(keep_gpu), keep_cpu)  # the mask bit for bit
    np.testing.assert_allclose(cp.asnumpy(y_gpu), y_cpu, rtol=1e-5, atol=1e-5)
    fd2 = _uniform_fd([3, 1000], -1.0, 1.0)
    (u_gpu,) = fd2.execute([cp.zeros((3, 1000), cp.float32), 5, 6])
    (u_cpu,) = fd2.execute([np.zeros((3, 1000), np.float32), 5, 6])
    np.testing.assert_array_equal(cp.asnumpy(u_gpu), u_cpu)
    with FusionDefinition() as fd3:
        fd3.add_output(fd3.ops.normal(0.0, 1.0, [4096], DataType.Float, rng_seed=3, rng_offset=1))
        fd3.add_output(fd3.ops.iota(4096, 0.5, 0.25, DataType.Float))
    n_cpu, i_cpu = fd3.execute([])
    n_gpu, i_gpu = (cp.asnumpy(o) for o in fd3.execute([], device="cuda"))
    np.testing.assert_allclose(n_gpu, n_cpu, rtol=2e-6, atol=2e-6)  # logf/cosf: a few ulp
    np.testing.assert_array_equal(i_gpu, i_cpu)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half, DataType.Float])
@pytest.mark.parametrize("bounds", [(0.0, 1.0), (-1.5, 3.7)])
def test_uniform_stays_below_its_upper_bound(dtype: DataType, bounds: Any) -> None:
    """Rounding to bfloat16 or half reaches ``maxval`` about once in 256 draws near it;
    ``[minval, maxval)`` stays half-open, as PyTorch's ``rand`` is."""
    lo, hi = bounds
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.uniform(lo, hi, [1 << 16], dtype=dtype))
    (got,) = fd.execute([])
    vals = _as_f64(got)
    assert vals.max() < np.float32(hi) and vals.min() >= np.float32(lo)
    assert vals.max() > hi - (hi - lo) / 64  # the clamp did not move the whole top


@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC wheels")
def test_uniform_below_compiles_for_every_float_type() -> None:
    for dt in (DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.uniform(0.0, 1.0, [64], dtype=dt))
        for k in fd.lower([]).kernels:
            compile_cubin(k.cuda_source, k.kernel_name, arch="sm_90")


def _as_f64(a: Any) -> np.ndarray:
    """An output as float64 (bfloat16 given as its uint16 bits where NumPy has no bfloat16)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@pytest.mark.parametrize("m,v", [(1, 1), (19, 50), (300, 7), (4, 1029)])
def test_one_hot_from_a_broadcast_iota_is_one_kernel(m: int, v: int) -> None:
    # ``labels[:, None] == arange(V)[None, :]``: the iota is made at the comparison's rank,
    # so it runs in the output's loops (it was a kernel of its own, written to memory).
    with FusionDefinition() as fd:
        lab = fd.define_tensor([-1], dtype=DataType.Int)
        io = fd.ops.iota(v, start=2, step=3, dtype=DataType.Int)
        hit = fd.ops.eq(
            fd.ops.broadcast_in_dim(lab, shape=[-1, -1], broadcast_dims=[0]),
            fd.ops.broadcast_in_dim(io, shape=[-1, -1], broadcast_dims=[1]),
        )
        fd.add_output(fd.ops.cast(hit, DataType.Float))
    labels = np.random.default_rng(m).integers(0, 3 * v + 2, m).astype(np.int64)
    assert len(fd.lower([labels]).kernels) == 1
    (got,) = fd.execute([labels])
    want = (labels[:, None] == 2 + 3 * np.arange(v)[None, :]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "dims,shape", [([0], [5, 1, 1]), ([1], [1, 9, 1]), ([2], [1, 1, 6]), ([0, 2], [5, 1, 6])]
)
def test_broadcast_random_and_iota_keep_their_values(dims: List[int], shape: List[int]) -> None:
    # Random numbers drawn for a [B] (or [B, H]) tensor and broadcast along the other axes
    # (stochastic depth's per-sample mask), and a reshaped float iota: made at the
    # broadcast's rank, each element keeps its row-major position and so its value.
    full = [5, 9, 6]
    src = [full[d] for d in dims]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        u = fd.ops.uniform(0.0, 1.0, src, rng_seed=11, rng_offset=3)
        io = fd.ops.iota(int(np.prod(src)), start=0.5, step=0.25, dtype=DataType.Float)
        iob = fd.ops.reshape(io, src)
        ub = fd.ops.broadcast_in_dim(u, shape=[-1, -1, -1], broadcast_dims=dims)
        ib = fd.ops.broadcast_in_dim(iob, shape=[-1, -1, -1], broadcast_dims=dims)
        keep = fd.ops.lt(ub, 0.7)
        fd.add_output(fd.ops.add(fd.ops.where(keep, fd.ops.mul(x, 1 / 0.7), 0.0), ib))
    x_ = np.random.default_rng(1).standard_normal(full).astype(np.float32)
    # (the reshaped iota is remade at its new shape too: no kernel of its own)
    assert len(fd.lower([x_]).kernels) == 1
    (got,) = fd.execute([x_])
    u_ = _uniform_ref(11, 3, int(np.prod(src)), 0.0, 1.0).reshape(shape)
    io_ = (0.5 + 0.25 * np.arange(int(np.prod(src)))).reshape(shape)
    want = np.where(u_ < 0.7, x_.astype(np.float64) / 0.7, 0.0) + io_
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_stepped_slice_of_an_iota_reshaped_keeps_its_positions() -> None:
    # slice(iota(12), step 2) then reshape composes into one remap named reshape; the iota
    # is not remade at the reshaped shape (that would drop the step).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        io = fd.ops.iota(12, start=1.0, step=1.0, dtype=DataType.Float)
        s = fd.ops.slice(io, [0], [12], [2])
        fd.add_output(fd.ops.add(x, fd.ops.reshape(s, [2, 3])))
    x_ = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (got,) = fd.execute([x_])
    np.testing.assert_allclose(got, x_ + (1.0 + np.arange(12.0))[::2].reshape(2, 3), rtol=1e-6)


_REMAPS = ["slice_from_3", "slice_step_2", "pad_after", "pad_both", "cat_rotate"]


def _remap_ref(name: str, v: np.ndarray, fill: float) -> np.ndarray:
    if name == "slice_from_3":
        return v[3:]
    if name == "slice_step_2":
        return v[1::2]
    if name == "pad_after":
        return np.concatenate([v, [fill]])
    if name == "pad_both":
        return np.concatenate([[fill, fill], v, [fill]])
    return np.concatenate([v[5:], v[:5]])


def _remap_fd(fd: FusionDefinition, t: Any, name: str, n: int, fill: float) -> Any:
    """The remap ``name`` of ``_REMAPS`` applied to the length-``n`` tensor ``t``."""
    if name == "slice_from_3":
        return fd.ops.slice(t, [3], [n])
    if name == "slice_step_2":
        return fd.ops.slice(t, [1], [n], [2])
    if name == "pad_after":
        return fd.ops.pad(t, [0, 1], fill)
    if name == "pad_both":
        return fd.ops.pad(t, [2, 1], fill)
    return fd.ops.cat([fd.ops.slice(t, [5], [n]), fd.ops.slice(t, [0], [5])], 0)


@pytest.mark.parametrize("remap", _REMAPS)
@pytest.mark.parametrize("dtype,rtol", [(DataType.Float, 3e-6), (DataType.Double, 1e-13),
                                        (DataType.Half, 4e-3)])
@pytest.mark.parametrize("with_input", [False, True])
def test_a_remapped_float_iota_is_made_in_its_readers_kernel(remap: str, dtype: DataType, rtol: float,
                                                             with_input: bool) -> None:
    # torch.linspace(...) then F.pad / a slice / torch.cat (Karras sigmas with a final zero,
    # mel filterbank edges): the float iota is remade at the remapped positions instead of
    # being stored by a kernel of its own.
    n, start, step, fill = 29, 0.25, 1.0 / 7.0, -2.0
    with FusionDefinition() as fd:
        io = fd.ops.iota(n, start=start, step=step, dtype=dtype)
        e = fd.ops.exp(fd.ops.mul(io, 0.5))
        r = _remap_fd(fd, e, remap, n, fill)
        if with_input:
            x = fd.define_tensor([-1], dtype)
            r = fd.ops.add(r, x)
        fd.add_output(r)
    ref = _remap_ref(remap, np.exp(0.5 * (start + step * np.arange(n))), fill)
    npdt = {DataType.Float: np.float32, DataType.Double: np.float64, DataType.Half: np.float16}[dtype]
    xs = [np.linspace(-1, 1, ref.size).astype(npdt)] if with_input else []
    if with_input:
        ref = ref + xs[0].astype(np.float64)
    (got,) = fd.execute(xs)
    assert got.dtype == npdt
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=rtol)
    assert len(fd.lower(xs).kernels) == 1


@pytest.mark.parametrize("remap", _REMAPS)
def test_math_on_runtime_scalars_read_through_a_remap_stays_in_one_kernel(remap: str) -> None:
    # k-diffusion's Karras sigmas: (smax ** (1/rho) + ramp * (smin ** (1/rho) - smax ** (1/rho))) ** rho,
    # then F.pad(sigmas, (0, 1)); the runtime-scalar math is remade at the remap's shape.
    n, rho, fill = 29, 7.0, -2.0
    with FusionDefinition() as fd:
        smin, smax = fd.define_scalar(dtype=DataType.Double), fd.define_scalar(dtype=DataType.Double)
        ramp = fd.ops.iota(n, 0.0, 1.0 / (n - 1), DataType.Float)
        lo, hi = fd.ops.pow(smin, 1.0 / rho), fd.ops.pow(smax, 1.0 / rho)
        s = fd.ops.pow(fd.ops.add(hi, fd.ops.mul(ramp, fd.ops.sub(lo, hi))), rho)
        r = _remap_fd(fd, s, remap, n, fill)
        fd.add_output(r)
    for a, b in [(0.002, 80.0), (0.03, 14.6)]:
        ramp_ = np.arange(n) / (n - 1)
        ref = _remap_ref(remap, (b ** (1 / rho) + ramp_ * (a ** (1 / rho) - b ** (1 / rho))) ** rho, fill)
        (got,) = fd.execute([a, b])
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-5, atol=1e-6)
    assert len(fd.lower([0.002, 80.0]).kernels) == 1
