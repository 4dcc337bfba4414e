"""PyTorch's semantics in corners a table-driven sweep over every op and dtype found wrong:
half and bfloat16 means (summed and divided in float, rounded once), reductions to a
narrower ``dtype`` (the input cast first), ``threshold`` of NaN, ``nextafter`` of half and
bfloat16 (a step of the narrow type), and the interpreter's
inverse hyperbolic functions at the edges of their domains. References are float64 NumPy
models of what PyTorch documents.
"""

from __future__ import annotations

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

try:
    import ml_dtypes

    NARROW = [(DataType.Half, np.float16), (DataType.BFloat16, ml_dtypes.bfloat16)]
except ImportError:  # bfloat16 arrays need ml_dtypes
    NARROW = [(DataType.Half, np.float16)]


@pytest.mark.parametrize("dt,np_dt", NARROW)
def test_a_narrow_mean_does_not_round_its_sum_first(dt: DataType, np_dt: type) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dt)
        fd.add_output(fd.ops.mean(x, [1]))
        fd.add_output(fd.ops.mean(x, [0, 1], keepdim=True))
    rng = np.random.default_rng(3)
    a = np.concatenate([np.full((1, 1000), 100.0), rng.uniform(0, 3, (5, 1000))]).astype(np_dt)
    rows, total = fd.execute([a])
    d = a.astype(np.float64)
    # Summed in float (exactly enough here), divided, then rounded once to the narrow type.
    for got, want in ((rows, d.mean(1)), (total, d.mean(keepdims=True))):
        got = np.asarray(got).astype(np.float64)
        np.testing.assert_array_equal(got, want.astype(np_dt).astype(np.float64))


def test_reducing_to_a_narrower_dtype_casts_the_input_first() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.sum(x, [0], dtype=DataType.Half))
        fd.add_output(fd.ops.mean(x, [0], dtype=DataType.Half))
    a = np.full(1000, 1.0003, np.float32)
    s, m = fd.execute([a])
    as_half = a.astype(np.float16).astype(np.float64)  # 1.0 each: the cast comes first
    assert float(np.asarray(s, np.float64)) == float(np.float16(as_half.sum()))
    big = np.full(3, 30000.0, np.float32)
    assert float(np.asarray(fd.execute([big])[1]).astype(np.float64)) == 30000.0  # not inf


def test_threshold_keeps_nan() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.threshold(x, 1.0, 7.0))
    got = fd.execute([np.array([np.nan, 0.5, 1.0, 2.0], np.float32)])[0]
    np.testing.assert_array_equal(got, [np.nan, 7.0, 7.0, 2.0])


@pytest.mark.parametrize("dt,np_dt", [(DataType.Float, np.float32), (DataType.Double, np.float64)])
def test_inverse_hyperbolics_at_the_edges_of_their_domains(dt: DataType, np_dt: type) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dt)
        for op in ("acosh", "asinh", "atanh"):
            fd.add_output(getattr(fd.ops, op)(x))
    big = 3e38 if np_dt is np.float32 else 1.7e308
    a = np.array([-100.0, 0.5, 1.0, 1.0005, big, -0.9918804, 0.999999, np.nan], np_dt)
    d = a.astype(np.float64)
    ulps = 4 if np_dt is np.float32 else 64
    with np.errstate(invalid="ignore", divide="ignore"):
        wants = (np.arccosh(d), np.arcsinh(d), np.arctanh(d))
    for got, want in zip(fd.execute([a]), wants):
        got = np.asarray(got, np.float64)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = np.isfinite(want)
        tol = ulps * np.spacing(np.abs(want[ok]).astype(np_dt)).astype(np.float64)
        assert np.all(np.abs(got[ok] - want[ok]) <= tol), (got, want)


@pytest.mark.parametrize("ranked,zero_dim,want", [
    (DataType.Int32, DataType.Double, np.float64),  # a higher category: the 0-d tensor's own dtype
    (DataType.Bool, DataType.Int32, np.int32),
    (DataType.Int32, DataType.Half, np.float16),
    (DataType.Half, DataType.Double, np.float16),  # the same category: the ranked operand's
    (DataType.Int32, DataType.Int, np.int32),
])
def test_a_zero_dim_tensor_promotes_as_pytorch(ranked: DataType, zero_dim: DataType, want: type) -> None:
    np_of = {DataType.Int32: np.int32, DataType.Bool: np.bool_, DataType.Half: np.float16,
             DataType.Double: np.float64, DataType.Int: np.int64}
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], ranked)
        s = fd.define_tensor([], zero_dim)
        fd.add_output(fd.ops.add(x, s))
    a = np.array([1, 0, 1], np_of[ranked])
    b = np.array(3, np_of[zero_dim])
    got = fd.execute([a, b])[0]
    assert got.dtype == want
    np.testing.assert_array_equal(got, (a.astype(np.float64) + float(b)).astype(want))


def test_tensors_meeting_a_half_are_rounded_to_half_first() -> None:
    # PyTorch converts every tensor operand to the common half type before the op: an
    # Int32 70000 becomes inf and 2049 becomes 2048; a 0-d float 0.3 becomes half(0.3).
    with FusionDefinition() as fd:
        i = fd.define_tensor([-1], DataType.Int32)
        h = fd.define_tensor([-1], DataType.Half)
        s = fd.define_tensor([], DataType.Float)
        fd.add_output(fd.ops.mul(i, h))
        fd.add_output(fd.ops.sub(i, h))
        fd.add_output(fd.ops.eq(h, s))
        fd.add_output(fd.ops.mul(h, s))
    iv = np.array([2049, 70000, 2049], np.int32)
    hv = np.array([1.5, 0.0, 2048], np.float16)
    sv = np.array(0.3, np.float32)
    mul, sub, eq, scaled = fd.execute([iv, hv, sv])
    with np.errstate(invalid="ignore", over="ignore"):  # 70000 is inf in half, as intended
        ih, sh = iv.astype(np.float16).astype(np.float32), np.float32(np.float16(sv))
        np.testing.assert_array_equal(mul, (ih * hv.astype(np.float32)).astype(np.float16))
        np.testing.assert_array_equal(sub, (ih - hv.astype(np.float32)).astype(np.float16))
    np.testing.assert_array_equal(eq, hv.astype(np.float32) == sh)
    np.testing.assert_array_equal(scaled, (hv.astype(np.float32) * sh).astype(np.float16))


def _narrow_nextafter_reference(x: np.ndarray, y: np.ndarray, np_dt: type) -> np.ndarray:
    """IEEE nextafter in the narrow type itself: one step of the 16-bit pattern."""
    out = np.empty(x.shape, np.float64)
    smallest = float(np.array([1], np.uint16).view(np_dt)[0])
    for i, (a, b, bits) in enumerate(zip(x.astype(np.float64), y.astype(np.float64), x.view(np.uint16))):
        if np.isnan(a) or np.isnan(b):
            out[i] = np.nan
        elif a == b:
            out[i] = b
        elif a == 0:
            out[i] = smallest if b > 0 else -smallest
        else:
            step = 1 if (b > a) == (a > 0) else -1
            out[i] = float(np.array([int(bits) + step], np.uint16).view(np_dt)[0])
    return out


@pytest.mark.parametrize("dt,np_dt", NARROW)
def test_nextafter_steps_in_the_narrow_type(dt: DataType, np_dt: type) -> None:
    # Computed in float, a half's neighbour rounded straight back to the half itself.
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1], dt)
        b = fd.define_tensor([-1], dt)
        fd.add_output(fd.ops.nextafter(a, b))
    bits = np.array([1, 0x8001], np.uint16).view(np_dt).astype(np.float64)  # +- smallest subnormal
    largest = float(np.array([0x7BFF if dt == DataType.Half else 0x7F7F], np.uint16).view(np_dt)[0])
    edges = [0.0, -0.0, 1.0, -1.0, 2.0, -0.5, 0.1, 3.0, 1000.0, largest, -largest, *bits,
             2.0 ** -14, 2.0 ** -126, np.inf, -np.inf, np.nan]
    rng = np.random.default_rng(11)
    spread = rng.standard_normal(300) * 10.0 ** rng.integers(-6, 4, 300)
    xs = np.concatenate([np.repeat(edges, len(edges)), spread])
    ys = np.concatenate([np.tile(edges, len(edges)), rng.standard_normal(300)])
    with np.errstate(over="ignore"):  # the infinities
        x, y = xs.astype(np_dt), ys.astype(np_dt)
    (got,) = fd.execute([x, y])
    got = np.asarray(got)
    got = (got.view(np_dt) if got.dtype == np.uint16 else got).astype(np.float64)
    want = _narrow_nextafter_reference(x, y, np_dt)
    np.testing.assert_array_equal(got, want)
    num = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[num]), np.signbit(want[num]))


@pytest.mark.parametrize("dts,common", [((DataType.Half, DataType.Float), np.float32),
                                        ((DataType.Int32, DataType.Double), np.float64),
                                        ((DataType.Bool, DataType.Int32), np.int32),
                                        ((DataType.Int, DataType.Half), np.float16)])
def test_cat_of_different_dtypes_joins_in_their_common_type(dts: tuple, common: type) -> None:
    """torch.cat promotes its parts to their common dtype (half and float give float)."""
    np_of = {DataType.Half: np.float16, DataType.Float: np.float32, DataType.Double: np.float64,
             DataType.Int32: np.int32, DataType.Int: np.int64, DataType.Bool: np.bool_}
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1], dts[0])
        b = fd.define_tensor([-1, -1], dts[1])
        out = fd.ops.cat([a, b], 1)
        fd.add_output(out)
    x = (np.arange(6).reshape(2, 3) % 3).astype(np_of[dts[0]])
    y = (np.arange(4).reshape(2, 2) * 7 + 1).astype(np_of[dts[1]])
    (got,) = fd.execute([x, y])
    want = np.concatenate([x.astype(common), y.astype(common)], axis=1)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_bool_inputs_count_any_nonzero_byte_as_true() -> None:
    # NumPy reads a bool array's bytes as true wherever they are nonzero (a uint8 mask viewed
    # as bool); the interpreter read them as Rust bools, whose only valid bytes are 0 and 1.
    raw = np.array([2, 0, 1, 255, 4, 0, 7], np.uint8)
    b = raw.view(np.bool_)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], DataType.Bool)
        fd.add_output(fd.ops.logical_not(t))
        fd.add_output(fd.ops.cast(t, DataType.Float))
        fd.add_output(fd.ops.sum(fd.ops.cast(t, DataType.Int), dims=[0]))
        fd.add_output(fd.ops.where(t, 1.5, -2.0))
    truth = raw != 0
    got_not, got_f, got_n, got_w = fd.execute([b])
    np.testing.assert_array_equal(got_not, ~truth)
    np.testing.assert_array_equal(got_f, truth.astype(np.float64))
    assert int(got_n) == int(truth.sum())
    np.testing.assert_array_equal(got_w, np.where(truth, 1.5, -2.0))


_AFTER = ["reshape", "slice", "pad", "select", "permute_out", "squeeze", "cat"]


@pytest.mark.parametrize("after", _AFTER)
@pytest.mark.parametrize("ranked,np_ranked", [(DataType.Float, np.float32), (DataType.Half, np.float16)])
def test_zero_dim_math_keeps_the_ranked_dtype_through_shape_ops(after: str, ranked: DataType,
                                                                np_ranked: type) -> None:
    # sqrt(|s| + 1) of a Double scalar is a 0-d Double tensor: beside a Float (Half) tensor the
    # result is Float (Half), also where the automatic schedule moves the op through a shape op.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 1], ranked)
        s = fd.define_scalar(dtype=DataType.Double)
        y = fd.ops.minimum(fd.ops.sqrt(fd.ops.add(fd.ops.abs(s), 1.0)), x)
        if after == "reshape":
            y = fd.ops.reshape(y, [-1])
        elif after == "slice":
            y = fd.ops.slice(y, [1, 0, 0], [None, None, None])
        elif after == "pad":
            y = fd.ops.pad(y, [0, 0, 1, 2])
        elif after == "select":
            y = fd.ops.select(y, 0, 1)
        elif after == "squeeze":
            y = fd.ops.squeeze(y, [2])
        elif after == "cat":
            y = fd.ops.cat([y, x], 1)
        if after == "permute_out":
            fd.add_output(fd.ops.permute(y, [1, 0, 2]))
        else:
            fd.add_output(y)
    a = np.random.default_rng(2).uniform(-3, 3, (4, 5, 1)).astype(np_ranked)
    s_val = -1.5
    ref = np.minimum(np.sqrt(2.5), a.astype(np.float64))
    ref = {"reshape": lambda r: r.reshape(-1), "slice": lambda r: r[1:], "select": lambda r: r[1],
           "pad": lambda r: np.pad(r, [(0, 0), (1, 2), (0, 0)]), "squeeze": lambda r: r[:, :, 0],
           "cat": lambda r: np.concatenate([r, a.astype(np.float64)], 1),
           "permute_out": lambda r: r.transpose(1, 0, 2)}[after](ref)
    got = fd.execute([a, s_val])[0]
    want_written = fd.execute([a, s_val], as_written=True)[0]
    assert got.dtype == np_ranked and want_written.dtype == np_ranked
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-3 if ranked == DataType.Half else 1e-6)


def _narrow_value(x: float, dtype: DataType) -> float:
    """``x`` rounded to half or bfloat16 (bfloat16: round to nearest even on the float bits)."""
    if dtype == DataType.Half:
        with np.errstate(over="ignore"):
            return float(np.float16(x))
    bits = int(np.array(x, np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits, np.uint32).view(np.float32))


@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16])
@pytest.mark.parametrize("value", [0.001, 0.1, 1 / 3, 1000.7, 70000.0, -3])
@pytest.mark.parametrize("runtime", [False, True])
def test_a_narrow_fill_holds_its_dtypes_value(dtype: DataType, value: float, runtime: bool) -> None:
    # torch.full(..., value, dtype=half) holds half(value): an intermediate fill read by float
    # math divides by that, not by the float constant (the rest of the half math stays float)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        v = fd.define_scalar(dtype=DataType.Double) if runtime else value
        fd.add_output(fd.ops.truediv(x, fd.ops.full([1], v, dtype)))
    a = np.array([-2.0, 1.0, 3.0], np.float32)
    args = [a, value] if runtime else [a]
    (got,) = fd.execute(args)
    with np.errstate(divide="ignore"):
        want = a.astype(np.float64) / _narrow_value(value, dtype)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16])
def test_a_narrow_iota_holds_its_dtypes_values(dtype: DataType) -> None:
    # torch.arange(0.1, ..., 0.1, dtype=half): each element a half value, read by float math
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.add_output(fd.ops.truediv(x, fd.ops.iota(fd.ops.size(x, 0), 0.1, 0.1, dtype)))
    a = np.full(37, 3.0, np.float32)
    (got,) = fd.execute([a])
    pos = np.float32(0.1) + np.arange(37, dtype=np.float32) * np.float32(0.1)
    want = 3.0 / np.array([_narrow_value(float(v), dtype) for v in pos])
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_a_comparison_with_a_0d_tensor_is_made_in_the_promoted_type(op: str) -> None:
    # A 0-d tensor takes part as a scalar (PyTorch): Int 0-d beside Int32 values compares as
    # Int32 (2**32 - 5 wraps to -5, as `add` reads it), Double 0-d beside Float as Float.
    ops = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal}
    with FusionDefinition() as fd:
        s = fd.define_tensor(shape=[], dtype=DataType.Int)
        x = fd.define_tensor(shape=[-1], dtype=DataType.Int32)
        d = fd.define_tensor(shape=[], dtype=DataType.Double)
        y = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        fd.add_output(getattr(fd.ops, op)(x, s))
        fd.add_output(getattr(fd.ops, op)(y, d))
    xs = np.array([-5, 0, -6], np.int32)
    ys = np.array([0.1, 0.0999, 0.1001], np.float32)
    got_i, got_f = fd.execute([np.array(2**32 - 5), xs, np.array(0.1), ys])
    np.testing.assert_array_equal(got_i, ops[op](xs, np.int32(-5)))
    np.testing.assert_array_equal(got_f, ops[op](ys, np.float32(0.1)))
