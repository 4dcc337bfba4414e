"""Reductions over axes with no elements: a sum is 0 and a product 1 everywhere in its output,
whatever the sizes of the other axes (a maximum or minimum is refused, as NumPy refuses it);
one fusion called with sizes that empty different axes gives each call its own answer."""

from __future__ import annotations

import itertools
from typing import Any, Callable, List, Sequence

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError

IDENTITY = {"sum": 0.0, "prod": 1.0}
NUMPY = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


def _reduce(op: str, x: np.ndarray, axes: Sequence[int], keepdim: bool) -> np.ndarray:
    """NumPy's reduction in float64, the identity where the reduced axes are empty."""
    xd = x.astype(np.float64)
    if any(x.shape[a] == 0 for a in axes):
        shape = [1 if a in axes else n for a, n in enumerate(x.shape)] if keepdim else \
            [n for a, n in enumerate(x.shape) if a not in axes]
        return np.full(shape, IDENTITY[op])
    return NUMPY[op](xd, axis=tuple(axes), keepdims=keepdim)


def _fusion(op: str, rank: int, axes: List[int], keepdim: bool) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank, dtype=DataType.Float)
        r = getattr(fd.ops, op)(fd.ops.mul(x, 2.0), dims=axes, keepdim=keepdim)
        fd.add_output(fd.ops.add(r, 1.0))
    return fd


CASES = [(op, shape, axes, keepdim)
         for op in ("sum", "prod", "max", "min")
         for shape, axes in [((5, 0), [1]), ((5, 0), [0, 1]), ((0, 7), [1]), ((0, 7), [0]),
                             ((3, 0, 4), [1]), ((3, 0, 4), [0, 2]), ((2, 3, 0), [0, 1, 2])]
         for keepdim in (False, True)]


@pytest.mark.parametrize("op, shape, axes, keepdim", CASES)
def test_reduction_over_an_empty_axis_is_its_identity(
        op: str, shape: Any, axes: List[int], keepdim: bool) -> None:
    fd = _fusion(op, len(shape), axes, keepdim)
    x = np.ones(shape, np.float32)
    if op in ("max", "min") and any(shape[a] == 0 for a in axes):
        # As in NumPy, the extreme of no elements is undefined: refused before any launch.
        with pytest.raises(KilnError, match=rf"T\d+ = {op}\(.*axis \d+ it reduces has size 0"):
            fd.execute([x])
        return
    got = fd.execute([x])[0]
    want = _reduce(op, x * 2.0, axes, keepdim) + 1.0
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_one_fusion_called_with_different_empty_axes(op: str) -> None:
    """The plan made when one axis is empty is not reused when another one is."""
    fd = _fusion(op, 2, [1], False)
    rng = np.random.default_rng(0)
    for shape in [(4, 0), (0, 3), (4, 3), (4, 0), (6, 0), (0, 0), (4, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(fd.execute([x])[0], _reduce(op, x * 2.0, [1], False) + 1.0,
                                   rtol=1e-5, atol=1e-5)


def test_empty_reduction_beside_a_full_one() -> None:
    """A fusion with an empty input and a reduction of a non-empty one computes the latter."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        y = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[1]))
        fd.add_output(fd.ops.sum(y, dims=[0]))
    rng = np.random.default_rng(1)
    for xs, ys in itertools.product([(3, 5), (3, 0), (0, 5)], [(2, 4), (0, 4), (2, 0)]):
        x = rng.standard_normal(xs).astype(np.float32)
        y = rng.standard_normal(ys).astype(np.float32)
        a, b = fd.execute([x, y])
        np.testing.assert_allclose(a, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, y.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)


def test_no_loop_over_the_other_axis_of_an_empty_input() -> None:
    """sum over both axes of a [2^24, 0] array is 0 without visiting the 2^24 rows (the
    interpreter would take seconds)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[0, 1]))
    run: Callable[[], Any] = lambda: fd.execute([np.empty((1 << 24, 0), np.float32)])[0]  # noqa: E731
    assert float(run()) == 0.0
    program = str(fd.lower([np.empty((1 << 24, 0), np.float32)]))
    launches = [line for line in program.splitlines() if "LaunchKernel" in line]
    assert launches and all("inputs=[]" in line for line in launches), program


@pytest.mark.parametrize("shape", [(3, 0), (3, 5), (0, 4), (1, 1)])
def test_welford_over_an_empty_axis(shape: Any) -> None:
    """welford's var_sum over no elements is 0 (a sum of nothing); its mean is NaN, as a mean
    of nothing is, and its count 0."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        for t in fd.ops.welford(x, dims=[1]):
            fd.add_output(t)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    mean, var_sum, n = fd.execute([x])
    xd = x.astype(np.float64)
    assert n.tolist() == [shape[1]] * shape[0]
    np.testing.assert_allclose(var_sum, ((xd - xd.mean(1, keepdims=True)) ** 2).sum(1) if shape[1] else
                               np.zeros(shape[0]), rtol=1e-5, atol=1e-6)
    if shape[1]:
        np.testing.assert_allclose(mean, xd.mean(1), rtol=1e-5, atol=1e-6)
    else:
        assert np.isnan(mean).all()


@pytest.mark.parametrize("n, m", [(0, 0), (0, 1), (0, 4), (1, 3), (5, 3)])
def test_a_width_one_slice_broadcasts_against_an_empty_axis(n: int, m: int) -> None:
    """``y[:1] + x`` broadcasts ``y[:1]`` over ``x`` as NumPy does, also when ``x`` is empty
    (then ``y[:1]`` may be empty too); against a non-empty ``x`` an empty ``y`` is refused."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DataType.Float)
        y = fd.define_tensor([-1], dtype=DataType.Float)
        fd.add_output(fd.ops.add(fd.ops.slice(y, [0], [1]), x))
        fd.add_output(fd.ops.mul(fd.ops.slice(x, [0], [1]), x))
    rng = np.random.default_rng(4)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(m).astype(np.float32)
    a, b = fd.execute([x, y])
    np.testing.assert_allclose(a, y[:1].astype(np.float64) + x, rtol=1e-6)
    np.testing.assert_allclose(b, x[:1].astype(np.float64) * x, rtol=1e-6)
    with pytest.raises(KilnError, match=r"axis 0 of T\d+ must have size one to broadcast against size i\d+"):
        fd.execute([np.ones(3, np.float32), np.ones(0, np.float32)])
