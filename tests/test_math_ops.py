"""Every element-wise op of the op table, against NumPy float64 references (SciPy-free):
values on the CPU interpreter, result dtypes, refusals, NVRTC compiles of each op for each
dtype it takes, and the GPU against the interpreter (``-m gpu``).

The op list comes from ``kiln._core.elementwise_ops()``, so an op added to the table
without a reference here fails ``test_every_op_has_a_reference``."""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError, KilnTypeError, _core
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

F = np.float64


def _vec(fn: Callable[..., float]) -> Callable[..., np.ndarray]:
    return lambda *xs: np.vectorize(fn, otypes=[F])(*xs)


def _erfinv_ref(y: float) -> float:
    """erfinv by bisection on math.erf (independent of kiln's Newton refinement)."""
    if math.isnan(y) or abs(y) > 1:
        return math.nan
    if abs(y) == 1:
        return math.copysign(math.inf, y)
    if y == 0:
        return y
    lo, hi = -6.0, 6.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.erf(mid) < y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _erfcinv_ref(y: float) -> float:
    if math.isnan(y) or not 0 <= y <= 2:
        return math.nan
    if y == 0:
        return math.inf
    if y == 2:
        return -math.inf
    lo, hi = -27.0, 27.0  # erfc is decreasing
    for _ in range(300):
        mid = (lo + hi) / 2
        if math.erfc(mid) > y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _sign(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x
    s = np.sign(x)
    return np.where(np.isnan(x), 0, s) if x.dtype.kind == "f" else s


def _remainder(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        m = np.fmod(a, b)
        return np.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, np.mod(a, np.where(b == 0, 1, b)))


def _idiv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C truncating division, 0 for a zero divisor."""
    if a.dtype.kind == "f":
        with np.errstate(divide="ignore", invalid="ignore"):
            return a / b
    safe = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(safe) * np.sign(a) * np.sign(safe)
    return np.where(b == 0, 0, q)


def _ifmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return np.fmod(a, b)
    safe = np.where(b == 0, 1, b)
    return np.where(b == 0, 0, np.fmod(a, safe))


def _shl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    ok = (b >= 0) & (b < bits)
    return np.where(ok, np.left_shift(a, np.where(ok, b, 0)), 0)


def _shr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    return np.right_shift(a, np.where((b >= 0) & (b < bits), b, bits - 1))


def _lgamma(x: float) -> float:
    try:
        return math.lgamma(x)
    except ValueError:  # poles
        return math.inf


# name -> (reference on float64 / integer arrays, domain of test values)
UNARY: Dict[str, Tuple[Callable[[np.ndarray], np.ndarray], Tuple[float, float]]] = {
    "abs": (np.abs, (-4, 4)), "neg": (np.negative, (-4, 4)), "relu": (lambda x: np.maximum(x, 0), (-4, 4)),
    "exp": (np.exp, (-6, 6)), "exp2": (np.exp2, (-6, 6)), "expm1": (np.expm1, (-2, 2)),
    "log": (np.log, (0.01, 50)), "log2": (np.log2, (0.01, 50)), "log10": (np.log10, (0.01, 50)),
    "log1p": (np.log1p, (-0.9, 5)), "sqrt": (np.sqrt, (0, 50)),
    "rsqrt": (lambda x: 1 / np.sqrt(x), (0.01, 50)),
    "reciprocal": (lambda x: 1 / x, (0.1, 5)), "sin": (np.sin, (-6, 6)), "cos": (np.cos, (-6, 6)),
    "tan": (np.tan, (-1.4, 1.4)), "asin": (np.arcsin, (-1, 1)), "acos": (np.arccos, (-1, 1)),
    "atan": (np.arctan, (-8, 8)), "sinh": (np.sinh, (-4, 4)), "cosh": (np.cosh, (-4, 4)),
    "tanh": (np.tanh, (-4, 4)), "asinh": (np.arcsinh, (-8, 8)), "acosh": (np.arccosh, (1, 9)),
    "atanh": (np.arctanh, (-0.95, 0.95)), "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), (-8, 8)),
    "erf": (_vec(math.erf), (-3, 3)), "erfc": (_vec(math.erfc), (-3, 3)),
    "erfinv": (_vec(_erfinv_ref), (-0.999, 0.999)),
    "erfcinv": (_vec(_erfcinv_ref), (0.001, 1.999)),
    "lgamma": (_vec(_lgamma), (0.1, 12)),
    "floor": (np.floor, (-5, 5)), "ceil": (np.ceil, (-5, 5)), "round": (np.round, (-5, 5)),
    "trunc": (np.trunc, (-5, 5)), "frac": (lambda x: x - np.trunc(x), (-5, 5)), "sign": (_sign, (-3, 3)),
    "signbit": (np.signbit, (-3, 3)), "isnan": (np.isnan, (-3, 3)), "isinf": (np.isinf, (-3, 3)),
    "isfinite": (np.isfinite, (-3, 3)), "isposinf": (np.isposinf, (-3, 3)),
    "isneginf": (np.isneginf, (-3, 3)), "logical_not": (np.logical_not, (-2, 2)),
    "bitwise_not": (np.invert, (-50, 50)),
}

BINARY: Dict[str, Tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], Tuple[float, float]]] = {
    "add": (np.add, (-4, 4)), "sub": (np.subtract, (-4, 4)), "mul": (np.multiply, (-4, 4)),
    "div": (_idiv, (0.5, 4)), "truediv": (lambda a, b: a / b, (0.5, 4)), "pow": (np.power, (0.5, 3)),
    "maximum": (np.maximum, (-4, 4)), "minimum": (np.minimum, (-4, 4)), "fmod": (_ifmod, (-9, 9)),
    "remainder": (_remainder, (-9, 9)), "atan2": (np.arctan2, (-4, 4)), "nextafter": (np.nextafter, (-4, 4)),
    "bitwise_and": (np.bitwise_and, (-50, 50)), "bitwise_or": (np.bitwise_or, (-50, 50)),
    "bitwise_xor": (np.bitwise_xor, (-50, 50)), "bitwise_left_shift": (_shl, (0, 70)),
    "bitwise_right_shift": (_shr, (-70, 70)), "gcd": (np.gcd, (-60, 60)),
    "logical_and": (np.logical_and, (-2, 2)), "logical_or": (np.logical_or, (-2, 2)),
    "logical_xor": (np.logical_xor, (-2, 2)),
    "eq": (np.equal, (-2, 2)), "ne": (np.not_equal, (-2, 2)), "lt": (np.less, (-2, 2)),
    "le": (np.less_equal, (-2, 2)), "gt": (np.greater, (-2, 2)), "ge": (np.greater_equal, (-2, 2)),
}

OPS = {op.name: op for op in _core.elementwise_ops()}
INT_ONLY = {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift",
            "gcd", "bitwise_not"}
FLOAT_ONLY = {"frac", "nextafter"}
# Results whose type is Bool.
BOOL_RESULT = {"signbit", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "logical_not",
               "logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge"}
# Float math: integer operands compute in Float (as PyTorch).
KEEP_TYPE = {"abs", "neg", "relu", "floor", "ceil", "round", "trunc", "frac", "sign", "bitwise_not"}
TO_FLOAT = {n for n in UNARY if n not in KEEP_TYPE | BOOL_RESULT} | {"truediv", "atan2"}
# Exactly rounded in IEEE arithmetic (and in CUDA): the interpreter matches to the last bit.
EXACT = KEEP_TYPE | BOOL_RESULT | {"add", "sub", "mul", "maximum", "minimum", "fmod", "nextafter", "sqrt"}


def test_every_op_has_a_reference() -> None:
    assert sorted(n for n, o in OPS.items() if o.arity == 1) == sorted(UNARY)
    assert sorted(n for n, o in OPS.items() if o.arity == 2) == sorted(BINARY)
    for op in OPS.values():
        assert op.doc and getattr(FusionDefinition().ops, op.name).__doc__ == op.doc


def _values(name: str, lo: float, hi: float, n: int, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, n).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(n) < 0.5
    x = rng.uniform(lo, hi, n)
    if name in {"floor", "ceil", "round", "trunc", "frac", "sign", "remainder", "fmod"}:
        x[: n // 4] = np.round(x[: n // 4] * 2) / 2  # halves and integers: the rounding edge cases
    if name in {"sign", "signbit", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "logical_not",
                "abs", "neg", "relu", "maximum", "minimum"}:
        x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30]
    return x.astype(dtype)


def _run(name: str, arity: int, arrays: List[np.ndarray]) -> np.ndarray:
    dt = {np.dtype(np.float32): DataType.Float, np.dtype(np.float64): DataType.Double,
          np.dtype(np.int32): DataType.Int32, np.dtype(np.int64): DataType.Int,
          np.dtype(np.bool_): DataType.Bool}
    with FusionDefinition() as fd:
        xs = [fd.define_tensor([-1], dt[a.dtype]) for a in arrays]
        fd.add_output(getattr(fd.ops, name)(*xs))
    return fd.execute(arrays)[0]


def _check(name: str, got: np.ndarray, want: np.ndarray, dtype: Any) -> None:
    if name in BOOL_RESULT:
        assert got.dtype == np.bool_
        np.testing.assert_array_equal(got, want.astype(bool))
        return
    if np.dtype(dtype).kind in "iub" and name not in TO_FLOAT:
        np.testing.assert_array_equal(got, want.astype(got.dtype))
        return
    want = want.astype(F)
    if name in EXACT:
        np.testing.assert_array_equal(got, want.astype(got.dtype))
        return
    # CUDA documents at most a few ulp for these in float32 (lgamma more near its zeros);
    # the interpreter's libm is within 1-2 ulp: 8 ulp of float32 at the reference's scale.
    tol = 8 * np.finfo(np.float32).eps if got.dtype == np.float32 else 1e-13
    scale = np.maximum(np.abs(want), 1.0 if name in {"lgamma", "sin", "cos", "tan", "atan2"} else 1e-3)
    err = np.abs(got.astype(F) - want)
    ok = np.isclose(got.astype(F), want, rtol=0, atol=0, equal_nan=True) | (err <= tol * scale)
    assert ok.all(), f"{name}: {got[~ok][:5]} vs {want[~ok][:5]}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_matches_numpy(name: str, dtype: Any) -> None:
    ref, (lo, hi) = UNARY[name]
    if name in INT_ONLY:
        with pytest.raises(KilnError, match=f"{name}: .* is not defined"):
            _run(name, 1, [np.ones(3, dtype)])
        return
    x = _values(name, lo, hi, 257, dtype, np.random.default_rng(zlib.crc32(name.encode())))
    with np.errstate(all="ignore"):
        want = ref(x.astype(F))
    _check(name, _run(name, 1, [x]), want, dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_], ids=["i32", "i64", "bool"])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_on_integers_and_bool(name: str, dtype: Any) -> None:
    ref, (lo, hi) = UNARY[name]
    x = _values(name, max(lo, -40), max(hi, 3), 101, dtype, np.random.default_rng(7))
    refused = name in FLOAT_ONLY or (dtype == np.bool_ and name == "neg")
    if refused:
        with pytest.raises(KilnError, match=f"{name}: .* is not defined"):
            _run(name, 1, [x])
        return
    got = _run(name, 1, [x])
    if name in TO_FLOAT:
        assert got.dtype == (np.bool_ if name in BOOL_RESULT else np.float32)
    elif name not in BOOL_RESULT:
        assert got.dtype == x.dtype
    with np.errstate(all="ignore"):
        want = ref(x) if name in INT_ONLY or name not in TO_FLOAT else ref(x.astype(F))
    if dtype == np.bool_ and name == "bitwise_not":
        want = np.logical_not(x)
    _check(name, got, want, np.float32 if name in TO_FLOAT else dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64],
                         ids=["f32", "f64", "i32", "i64"])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_matches_numpy(name: str, dtype: Any) -> None:
    ref, (lo, hi) = BINARY[name]
    is_int = np.dtype(dtype).kind == "i"
    rng = np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))
    a = _values(name, lo, hi, 203, dtype, rng)
    b = _values(name, lo, hi, 203, dtype, rng)
    if (is_int and name in FLOAT_ONLY) or (not is_int and name in INT_ONLY):
        with pytest.raises(KilnError, match=f"{name}: .* is not defined"):
            _run(name, 2, [a, b])
        return
    if name in {"div", "fmod", "remainder"} and is_int:
        b[:3] = 0  # integer division by zero gives 0
        a[3:6], b[3:6] = [-7, 7, -7], [2, -2, -2]  # C truncation toward zero
    if name == "bitwise_left_shift" and is_int:
        a = rng.integers(-50, 50, a.size).astype(dtype)
    if name == "pow" and is_int:
        a, b = rng.integers(-4, 5, a.size).astype(dtype), rng.integers(0, 6, b.size).astype(dtype)
    got = _run(name, 2, [a, b])
    with np.errstate(all="ignore"):
        want = ref(a, b) if is_int and name not in TO_FLOAT else ref(a.astype(F), b.astype(F))
        if not is_int and name in {"div", "nextafter"}:
            want = ref(a, b).astype(F)  # nextafter steps in the operand's own precision
    _check(name, got, want, np.float32 if (is_int and name in TO_FLOAT) else dtype)


def test_integer_division_truncates_and_truediv_divides() -> None:
    a = np.array([7, -7, 7, -7, 5, np.iinfo(np.int64).min], np.int64)
    b = np.array([2, 2, -2, -2, 0, -1], np.int64)
    np.testing.assert_array_equal(_run("div", 2, [a, b]), [3, -3, -3, 3, 0, np.iinfo(np.int64).min])
    got = _run("truediv", 2, [a[:4], b[:4]])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [3.5, -3.5, -3.5, 3.5])


def _nvrtc_source(name: str, dtype: DataType, arity: int) -> str:
    with FusionDefinition() as fd:
        xs = [fd.define_tensor([-1], dtype) for _ in range(arity)]
        fd.add_output(getattr(fd.ops, name)(*xs))
    np_dt = {DataType.Float: np.float32, DataType.Double: np.float64, DataType.Half: np.float16,
             DataType.Int32: np.int32, DataType.Int: np.int64, DataType.Bool: np.bool_}[dtype]
    return fd.lower([np.ones(64, np_dt)] * arity).kernels[0].cuda_source


def _compile_cases() -> List[Tuple[str, DataType]]:
    cases = []
    for name in sorted(OPS):
        for dt in (DataType.Float, DataType.Double, DataType.Half, DataType.Int32, DataType.Int,
                   DataType.Bool):
            kind = "f" if dt in (DataType.Float, DataType.Double, DataType.Half) else "i"
            if (kind == "f" and name in INT_ONLY) or (kind == "i" and name in FLOAT_ONLY):
                continue
            no_bool = {"neg", "sub", "bitwise_left_shift", "bitwise_right_shift", "gcd", "fmod", "remainder"}
            if dt == DataType.Bool and name in no_bool:
                continue
            cases.append((name, dt))
    return cases


@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC wheels (see DEVELOPERS.md)")
def test_every_op_compiles_for_every_dtype_it_takes() -> None:
    failures = []
    for name, dt in _compile_cases():
        src = _nvrtc_source(name, dt, OPS[name].arity)
        try:
            compile_cubin(src, "kiln_kernel", arch="sm_90")
        except KilnError as e:
            failures.append(f"{name} {dt.name}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64],
                         ids=["f32", "f64", "i32", "i64"])
def test_gpu_matches_the_interpreter(dtype: Any) -> None:
    cp = cupy_or_skip()
    is_int = np.dtype(dtype).kind == "i"
    mismatches = []
    for name, op in sorted(OPS.items()):
        if (is_int and name in FLOAT_ONLY) or (not is_int and name in INT_ONLY):
            continue
        ref, (lo, hi) = (UNARY if op.arity == 1 else BINARY)[name]
        rng = np.random.default_rng(11)
        arrays = [_values(name, lo, hi, 4099, dtype, rng) for _ in range(op.arity)]
        cpu = _run(name, op.arity, arrays)
        with FusionDefinition() as fd:
            xs = [fd.define_tensor([-1], DataType.Int32 if dtype == np.int32 else DataType.Int if is_int
                                   else DataType.Float if dtype == np.float32 else DataType.Double)
                  for _ in arrays]
            fd.add_output(getattr(fd.ops, name)(*xs))
        gpu = cp.asnumpy(fd.execute([cp.asarray(a) for a in arrays])[0])
        if name in EXACT or is_int and name not in TO_FLOAT:
            same = gpu == cpu
            if gpu.dtype.kind == "f":
                same |= np.isnan(gpu) & np.isnan(cpu)
        else:
            tol = 8 * np.finfo(gpu.dtype).eps
            same = np.isclose(gpu, cpu, rtol=tol, atol=tol, equal_nan=True)
        if not np.all(same):
            mismatches.append(f"{name}: gpu {gpu[~same][:3]} cpu {cpu[~same][:3]}")
    assert not mismatches, "\n".join(mismatches)


def test_compositions_clamp_lerp_addcmul_threshold() -> None:
    rng = np.random.default_rng(3)
    x, y, w = (rng.uniform(-3, 3, 97).astype(np.float32) for _ in range(3))
    x[:2] = [np.nan, np.inf]
    with FusionDefinition() as fd:
        tx, ty, tw = (fd.define_tensor([-1]) for _ in range(3))
        fd.add_output(fd.ops.clamp(tx, -1.0, 2.0))
        fd.add_output(fd.ops.lerp(tx, ty, tw))
        fd.add_output(fd.ops.lerp(tx, ty, 0.75))
        fd.add_output(fd.ops.addcmul(tx, ty, tw, 0.5))
        fd.add_output(fd.ops.threshold(tx, 0.5, -7.0))
    clamp, lerp, lerp_c, addcmul, thr = fd.execute([x, y, w])
    x64, y64, w64 = x.astype(F), y.astype(F), w.astype(F)
    np.testing.assert_array_equal(clamp, np.clip(x, -1, 2))
    with np.errstate(invalid="ignore"):  # torch.lerp's two formulas, by |weight|
        want = np.where(np.abs(w64) < 0.5, x64 + w64 * (y64 - x64), y64 - (y64 - x64) * (1 - w64))
    np.testing.assert_allclose(lerp, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(lerp_c, y64 - (y64 - x64) * 0.25, rtol=1e-5, atol=1e-5, equal_nan=True)
    np.testing.assert_allclose(addcmul, x64 + 0.5 * y64 * w64, rtol=1e-5, atol=1e-5, equal_nan=True)
    # ATen's threshold kernel: `x <= threshold ? value : x`, so NaN stays NaN.
    np.testing.assert_array_equal(thr, np.where(x <= 0.5, -7.0, x).astype(np.float32))


def test_clamp_with_one_bound_open_as_torch() -> None:
    x = np.array([np.nan, -np.inf, -2.0, 0.25, 3.0, np.inf], np.float32)
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1])
        fd.add_output(fd.ops.clamp(tx, None, 0.5))
        fd.add_output(fd.ops.clamp(tx, min=-1.0))
    hi, lo = fd.execute([x])
    np.testing.assert_array_equal(hi, np.minimum(x, 0.5))
    np.testing.assert_array_equal(lo, np.maximum(x, -1.0))
    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1])
        with pytest.raises(KilnTypeError, match="at least one of min and max"):
            fd.ops.clamp(tx)
        fd.add_output(tx)


@pytest.mark.parametrize("k", [2.0, 3.0, 4, 2.5])
def test_small_integer_powers_are_multiplications(k: Any) -> None:
    """``pow(x, 3.0)`` (GPT-2's GELU) runs as ``x * x * x`` in the automatic schedule: no
    ``powf`` in the kernel, and at least powf's accuracy against float64."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.pow(fd.ops.add(x, 0.5), k))
    a = np.random.default_rng(3).uniform(-3, 3, size=(5, 7)).astype(np.float32)
    (got,) = fd.execute([a])
    want = (a.astype(np.float64) + 0.5) ** k
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=1e-6)
    src = fd.lower([a]).kernels[0].cuda_source
    body = src[src.index("__global__"):]
    assert ("kiln::pow(" in body) == (k == 2.5)


@pytest.mark.parametrize("k,root", [(0.5, "sqrt"), (-0.5, "rsqrt")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_half_powers_are_roots(k: float, root: str, dtype: str) -> None:
    """``x ** 0.5`` and ``x ** -0.5`` run as ``sqrt`` and ``rsqrt`` in the automatic schedule,
    as PyTorch computes a scalar power of a tensor: -inf gives NaN (powf gives +inf and +0),
    negative numbers NaN, and no ``powf`` is left in the kernel."""
    dt = DataType.Float if dtype == "float32" else DataType.Double
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dt)
        fd.add_output(fd.ops.pow(x, k))
    a = np.array([-np.inf, -2.0, 0.0, 0.25, 1.0, 3.0, 1e30, np.inf, np.nan], dtype=dtype)
    (got,) = fd.execute([a])
    with np.errstate(invalid="ignore", divide="ignore"):
        want = np.sqrt(a.astype(F)) if k > 0 else 1.0 / np.sqrt(a.astype(F))
    rtol = 2e-7 if dtype == "float32" else 1e-15
    np.testing.assert_allclose(np.asarray(got, F), want, rtol=rtol, equal_nan=True)
    body = fd.lower([a]).kernels[0].cuda_source
    body = body[body.index("__global__"):]
    assert "kiln::pow(" not in body and f"{root}(" in body
