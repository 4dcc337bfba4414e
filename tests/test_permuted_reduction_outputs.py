"""A reduction's result handed back permuted is stored permuted by the reducing kernel.

``x.sum(-1).transpose(0, 1)`` and ``(x.sum(-1) * (1 / n)).permute(...)`` write each reduced
row's value at its permuted place: one kernel, where a transposing kernel used to follow the
reduction. Permutes of reduced results over fewer than 8 constant elements keep the extra
kernel (their scattered stores would write a large share of the input's bytes). Every
result is checked against NumPy in float64; a property test draws ranks, reduced axes,
epilogues and permutations.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def _check(got: Any, want: np.ndarray, tol: float = 1e-5) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def _sum_then_permute(dims: List[int], perm: List[int], rank: int = 3) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        fd.add_output(fd.ops.permute(fd.ops.sum(x, dims), perm))
    return fd


def test_row_sums_transposed_are_one_kernel() -> None:
    x0 = np.random.default_rng(0).standard_normal((6, 5, 40)).astype(np.float32)
    fd = _sum_then_permute([2], [1, 0])
    _check(fd.execute([x0])[0], x0.astype(np.float64).sum(-1).T)
    assert len(lowered_for(fd, [x0]).kernels) == 1


def test_mean_written_as_a_product_then_permuted_beside_the_plain_result() -> None:
    """BERT-style ``sum * (1/N)``, returned both as is and permuted."""
    x0 = np.random.default_rng(1).standard_normal((3, 4, 7, 33)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 4)
        m = fd.ops.mul(fd.ops.sum(x, [3]), 1.0 / 33)
        fd.add_output(m)
        fd.add_output(fd.ops.permute(fd.ops.sqrt(fd.ops.abs(m)), [2, 0, 1]))
    got = fd.execute([x0])
    want = x0.astype(np.float64).mean(-1)
    _check(got[0], want)
    _check(got[1], np.sqrt(np.abs(want)).transpose(2, 0, 1))
    assert len(lowered_for(fd, [x0]).kernels) == 1


def test_a_permuted_max_and_a_permuted_sum_of_one_row() -> None:
    x0 = np.random.default_rng(2).standard_normal((9, 2, 130)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 3)
        mx = fd.ops.max(x, [2])
        fd.add_output(fd.ops.permute(mx, [1, 0]))
        fd.add_output(fd.ops.permute(fd.ops.sub(fd.ops.sum(x, [2]), mx), [1, 0]))
    got = fd.execute([x0])
    x64 = x0.astype(np.float64)
    _check(got[0], x64.max(-1).T)
    _check(got[1], (x64.sum(-1) - x64.max(-1)).T)
    assert len(lowered_for(fd, [x0]).kernels) == 1


def test_a_permuted_sum_over_two_constant_elements_is_still_right() -> None:
    """Too few elements per reduced row to store scattered: right answer, any kernel count."""
    x0 = np.random.default_rng(3).standard_normal((50, 60, 2)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([50, 60, 2])
        fd.add_output(fd.ops.permute(fd.ops.sum(x, [2]), [1, 0]))
    _check(fd.execute([x0])[0], x0.astype(np.float64).sum(-1).T)


def test_half_row_sums_in_float_transposed() -> None:
    x0 = np.random.default_rng(4).standard_normal((4, 8, 64)).astype(np.float16)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 3, dtype=DataType.Half)
        s = fd.ops.sum(fd.ops.cast(x, DataType.Float), [2])
        fd.add_output(fd.ops.permute(s, [1, 0]))
    _check(fd.execute([x0])[0], x0.astype(np.float64).sum(-1).T, 1e-4)
    assert len(lowered_for(fd, [x0]).kernels) == 1


Drawn = Tuple[Tuple[int, ...], List[int], List[int], str, bool]


@st.composite
def _drawn(draw: Any) -> Drawn:
    rank = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    dims = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank - 1)))
    kept = rank - len(dims)
    perm = draw(st.permutations(list(range(kept))))
    epilogue = draw(st.sampled_from(["none", "scale", "exp", "minus_max"]))
    also_plain = draw(st.booleans())
    return shape, dims, list(perm), epilogue, also_plain


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_drawn())
def test_random_permuted_reduction_outputs_match_numpy(d: Drawn) -> None:
    shape, dims, perm, epilogue, also_plain = d
    x0 = np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)
    x64 = x0.astype(np.float64)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        s = fd.ops.sum(x, dims)
        want = x64.sum(tuple(dims))
        if epilogue == "scale":
            s, want = fd.ops.mul(s, 0.25), want * 0.25
        elif epilogue == "exp":
            s, want = fd.ops.exp(fd.ops.mul(s, 0.1)), np.exp(want * 0.1)
        elif epilogue == "minus_max":
            s, want = fd.ops.sub(s, fd.ops.max(x, dims)), want - x64.max(tuple(dims))
        if also_plain:
            fd.add_output(s)
        fd.add_output(fd.ops.permute(s, perm))
    got = fd.execute([x0])
    if also_plain:
        _check(got[0], want)
    _check(got[-1], want.transpose(perm))


@pytest.mark.gpu
def test_permuted_reduction_outputs_on_the_gpu() -> None:
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    for shape, dims, perm in [((64, 48, 1000), [2], [1, 0]), ((8, 16, 33, 257), [3], [2, 0, 1]),
                              ((5, 300, 7, 64), [1, 3], [1, 0])]:
        x0 = rng.standard_normal(shape).astype(np.float32)
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1] * len(shape))
            m = fd.ops.mul(fd.ops.sum(x, dims), 0.5)
            fd.add_output(fd.ops.permute(m, perm))
        got = fd.execute([cp.asarray(x0)])[0]
        _check(cp.asnumpy(got), (x0.astype(np.float64).sum(tuple(dims)) * 0.5).transpose(perm), 1e-4)
