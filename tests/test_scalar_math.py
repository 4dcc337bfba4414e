"""Arithmetic on scalars (constants fold, runtime scalars give 0-d tensors or integer
scalars), 0-d tensors broadcasting against ranked ones, and tensor sizes as values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError
from kiln.fusion import Scalar, Tensor


def test_constants_fold_to_scalars() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.ops.sub(1.0, 0.25)
        b = fd.ops.mul(3, 4)
        c = fd.ops.exp(0.5)
        d = fd.ops.lt(2, 3.5)
        e = fd.ops.div(-7, 2)  # truncating, as nvFuser
        for s in (a, b, c, d, e):
            assert isinstance(s, Scalar)
        assert b.dtype == DataType.Int and d.dtype == DataType.Bool and a.dtype == DataType.Double
        out = fd.ops.add(fd.ops.add(fd.ops.mul(x, a), fd.ops.mul(x, c)), fd.ops.add(b, e))
        fd.add_output(out)
        fd.add_output(fd.ops.where(d, x, fd.ops.neg(x)))
    v = np.linspace(-2, 2, 9).astype(np.float32)
    got, sel = fd.execute([v])
    v64 = v.astype(np.float64)
    np.testing.assert_allclose(got, v64 * 0.75 + v64 * math.exp(0.5) + (12 - 3), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(sel, v)


@pytest.mark.parametrize("beta", [0.0, 0.9, 0.999])
def test_runtime_scalar_math_is_a_0d_tensor(beta: float) -> None:
    # An optimizer's bias correction: (1 - beta) * g + beta * m, 1 / (1 - beta**t).
    with FusionDefinition() as fd:
        g, m = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1])
        b = fd.define_scalar(dtype=DataType.Double)
        t = fd.define_scalar(dtype=DataType.Int)
        one_minus = fd.ops.sub(1.0, b)
        assert isinstance(one_minus, Tensor) and one_minus.ndim == 0
        new_m = fd.ops.add(fd.ops.mul(g, one_minus), fd.ops.mul(m, b))
        corr = fd.ops.reciprocal(fd.ops.sub(1.0, fd.ops.pow(b, t)))
        fd.add_output(new_m)
        fd.add_output(fd.ops.mul(new_m, corr))
    rng = np.random.default_rng(0)
    gv, mv = rng.normal(size=(5, 7)).astype(np.float32), rng.normal(size=(5, 7)).astype(np.float32)
    nm, corrected = fd.execute([gv, mv, beta, 3])
    assert nm.dtype == np.float32  # a 0-d double does not widen float32 tensors
    want = (1 - beta) * gv.astype(np.float64) + beta * mv.astype(np.float64)
    np.testing.assert_allclose(nm, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(corrected, want / (1 - beta**3), rtol=1e-5, atol=1e-5)


def test_full_reduction_broadcasts_as_a_0d_tensor() -> None:
    # Gradient-norm clipping: g * min(1, max_norm / ||g||).
    with FusionDefinition() as fd:
        g = fd.define_tensor([-1, -1])
        norm = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(g, g), dims=[0, 1]))
        assert norm.ndim == 0
        scale = fd.ops.minimum(fd.ops.div(1.5, fd.ops.add(norm, 1e-6)), 1.0)
        fd.add_output(fd.ops.mul(g, scale))
    gv = np.random.default_rng(1).normal(size=(33, 65)).astype(np.float32)
    (got,) = fd.execute([gv])
    g64 = gv.astype(np.float64)
    want = g64 * min(1.0, 1.5 / (np.sqrt((g64 * g64).sum()) + 1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_0d_input_tensor_broadcasts() -> None:
    with FusionDefinition() as fd:
        s = fd.define_tensor([], DataType.Float)
        x = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.sub(x, s))
    xv = np.random.default_rng(2).normal(size=(2, 3, 4)).astype(np.float32)
    (got,) = fd.execute([np.array(0.5, np.float32), xv])
    np.testing.assert_allclose(got, xv - 0.5, rtol=0, atol=0)


def test_sizes_are_scalars_usable_in_shapes_and_math() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        rows, cols = fd.ops.shape(x)
        n = fd.ops.mul(rows, cols)
        assert isinstance(n, Scalar) and n.dtype == DataType.Int
        ones = fd.ops.full([rows, fd.ops.size(x, -1)], 1.0, DataType.Float)
        mean = fd.ops.div(fd.ops.sum(x, dims=[0, 1]), fd.ops.cast(n, DataType.Float))
        fd.add_output(fd.ops.add(ones, fd.ops.sub(x, mean)))
    xv = np.random.default_rng(3).normal(size=(6, 10)).astype(np.float32)
    (got,) = fd.execute([xv])
    np.testing.assert_allclose(got, 1 + xv - xv.astype(np.float64).mean(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [2, -3])
def test_size_of_a_missing_axis_is_an_error(dim: int) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match=f"size: axis {dim} is out of range for T0 of rank 2"):
            fd.ops.size(x, dim)
        fd.add_output(x)


def test_scalar_ops_without_a_form_are_refused() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        with pytest.raises(KilnError, match="bitwise_not: .* is not defined"):
            fd.ops.bitwise_not(1.5)
        fd.add_output(x)


@pytest.mark.parametrize("dtype, np_dtype", [(DataType.Float, np.float32), (DataType.Double, np.float64),
                                             (DataType.Half, np.float16)])
def test_full_takes_a_computed_0d_value(dtype: DataType, np_dtype: type) -> None:
    # torch.full_like(denom, step_size) where the step size is math on runtime scalars
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        lr = fd.define_scalar(dtype=DataType.Double)
        step = fd.ops.div(fd.ops.mul(lr, 2.0), fd.ops.sqrt(fd.ops.add(lr, 1.0)))
        assert isinstance(step, Tensor) and step.ndim == 0
        f = fd.ops.full(fd.ops.shape(x), step, dtype)
        fd.add_output(f)
        fd.add_output(fd.ops.mul(fd.ops.cast(f, DataType.Float), x))
    a = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    fill, prod = fd.execute([a, 0.3])
    want = 0.6 / math.sqrt(1.3)
    assert fill.shape == (5, 7) and fill.dtype == np_dtype
    np.testing.assert_allclose(fill.astype(np.float64), np.full((5, 7), np_dtype(want)), rtol=0)
    np.testing.assert_allclose(prod, a.astype(np.float64) * float(np_dtype(want)), rtol=2e-7, atol=1e-7)


def test_full_refuses_a_ranked_fill_value_by_name() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match=r"full: the fill value T0 has rank 2; expected a scalar"):
            fd.ops.full([2], x, DataType.Float)
        fd.add_output(x)


def test_a_float_scalar_input_is_rounded_to_float_once_wherever_it_is_read() -> None:
    """A ``Float`` scalar input is a 32-bit kernel parameter: an iota's start and a fill read
    the same rounded value (the interpreter read an iota's start at double precision)."""
    with FusionDefinition() as fd:
        s = fd.define_scalar(dtype=DataType.Float)
        fd.add_output(fd.ops.iota(2, s, 1.0, DataType.Double))
        fd.add_output(fd.ops.full([2], s, DataType.Double))
        fd.add_output(fd.ops.add(fd.ops.full([2], 0.0, DataType.Double), s))
    it, fu, ad = fd.execute([0.001])
    r = float(np.float32(0.001))
    assert it[0] == r and fu[0] == r and ad[0] == r
    assert it[1] == r + 1.0
