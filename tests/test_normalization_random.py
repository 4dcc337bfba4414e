"""Property test of normalizations over any axes: random softmax, log-softmax, LayerNorm and
RMSNorm fusions (ranks 1-4, every non-empty subset of reduced axes, keepdim or rank-reduced
statistics, weights over the kept or the reduced axes, statistics and a mean over the rows
as extra outputs, rows too long for registers) run through the automatic schedule in the CPU
interpreter against float64 NumPy.

Besides matching NumPy, a normalization over some but not all axes takes one kernel
(register-persistent, or looped when the rows are too long or the reduced axes are not
trailing), and so does a mean over the rows of a per-row statistic when the last axis is
reduced (a grid reduction of the rows in the same kernel).

CI runs ``KILN_NORM_EXAMPLES`` (default 40) derandomized examples.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition, KilnError

N_EXAMPLES = int(os.environ.get("KILN_NORM_EXAMPLES", "40"))
SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 97, 128, 257]
MAX_ELEMENTS = 6000
KINDS = ["softmax", "log_softmax", "layernorm", "layernorm_moments", "rmsnorm"]


@dataclass(frozen=True)
class Case:
    shape: Tuple[int, ...]
    dims: Tuple[int, ...]
    kind: str
    keepdim: bool
    weight: str  # "none" | "kept" | "reduced"
    stat_output: bool
    row_mean_output: bool
    seed: int


def _long_row(seed: int) -> Tuple[int, ...]:
    rng = np.random.default_rng(seed)
    # 40000 and 65536 and 131072 split over clusters (sm_90); odd lengths are streamed.
    return (int(rng.integers(1, 3)), int(rng.choice([33_001, 40_000, 65_537, 65_536, 131_072])))


@st.composite
def cases(draw: Any) -> Case:
    if draw(st.integers(0, 9)) == 0:
        shape = _long_row(draw(st.integers(0, 2**16)))
        dims: Tuple[int, ...] = (1,)
    else:
        rank = draw(st.integers(1, 4))
        shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(rank))
        while math.prod(shape) > MAX_ELEMENTS:
            shape = tuple(max(1, s // 2) for s in shape)
        dims = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    kind = draw(st.sampled_from(KINDS))
    partial = len(dims) < len(shape)
    return Case(shape=shape, dims=dims, kind=kind, keepdim=draw(st.booleans()),
                weight=draw(st.sampled_from(["none", "kept", "reduced"])),
                stat_output=draw(st.booleans()),
                row_mean_output=partial and draw(st.integers(0, 3)) == 0,
                seed=draw(st.integers(0, 2**16)))


def _bcast(fd: FusionDefinition, t: Any, shape: Sequence[int], kept: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=list(shape), broadcast_dims=list(kept))


def build(case: Case) -> Tuple[FusionDefinition, Callable[..., List[np.ndarray]], List[np.ndarray]]:
    """The fusion, its float64 NumPy reference and its inputs."""
    shape, dims = case.shape, list(case.dims)
    rank = len(shape)
    kept = [a for a in range(rank) if a not in dims]
    n = math.prod(shape[a] for a in dims)
    rng = np.random.default_rng(case.seed)
    x = np.asarray(rng.standard_normal(shape) * 2, dtype=np.float32)
    wshape = tuple(shape[a] for a in (kept if case.weight == "kept" else dims))
    w = np.asarray(rng.standard_normal(wshape) * 0.5 + 1, dtype=np.float32)
    inputs = [x] + ([w] if case.weight != "none" else [])

    with FusionDefinition() as fd:
        tx = fd.define_tensor(shape=[-1] * rank)
        tw = fd.define_tensor(shape=[-1] * len(wshape)) if case.weight != "none" else None

        def back(stat: Any) -> Any:
            # A statistic broadcast back onto x's shape, from keepdim or rank-reduced form.
            return stat if case.keepdim else _bcast(fd, stat, shape, kept)

        def red(op: str, t: Any) -> Any:
            return getattr(fd.ops, op)(t, dims=dims, keepdim=case.keepdim)

        if case.kind in ("softmax", "log_softmax"):
            mx = red("max", tx)
            xs = fd.ops.sub(tx, back(mx))
            s = red("sum", fd.ops.exp(xs))
            y = (fd.ops.div(fd.ops.exp(xs), back(s)) if case.kind == "softmax"
                 else fd.ops.sub(xs, back(fd.ops.log(s))))
            stat = s
        elif case.kind == "rmsnorm":
            ms = fd.ops.mul(red("sum", fd.ops.mul(tx, tx)), 1.0 / n)
            stat = fd.ops.rsqrt(fd.ops.add(ms, 1e-5))
            y = fd.ops.mul(tx, back(stat))
        else:
            mean = fd.ops.mul(red("sum", tx), 1.0 / n)
            xc = fd.ops.sub(tx, back(mean))
            if case.kind == "layernorm":
                var = fd.ops.mul(red("sum", fd.ops.mul(xc, xc)), 1.0 / n)
            else:
                var = fd.ops.sub(fd.ops.mul(red("sum", fd.ops.mul(tx, tx)), 1.0 / n), fd.ops.mul(mean, mean))
            stat = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
            y = fd.ops.mul(xc, back(stat))
        if tw is not None:
            y = fd.ops.mul(y, _bcast(fd, tw, shape, kept if case.weight == "kept" else dims))
        fd.add_output(y)
        if case.stat_output:
            fd.add_output(stat)
        if case.row_mean_output:
            flat = stat if not case.keepdim else fd.ops.sum(stat, dims=dims)  # drop the size-one axes
            fd.add_output(fd.ops.mul(fd.ops.sum(flat, dims=list(range(len(kept)))), 1.0 / math.prod(
                shape[a] for a in kept)))

    def ref(x: np.ndarray, *w: np.ndarray) -> List[np.ndarray]:
        x = x.astype(np.float64)
        ax = tuple(dims)
        if case.kind in ("softmax", "log_softmax"):
            xs = x - x.max(axis=ax, keepdims=True)
            s = np.exp(xs).sum(axis=ax, keepdims=True)
            y = np.exp(xs) / s if case.kind == "softmax" else xs - np.log(s)
            stat = s
        elif case.kind == "rmsnorm":
            stat = 1 / np.sqrt((x * x).mean(axis=ax, keepdims=True) + 1e-5)
            y = x * stat
        else:
            mean = x.mean(axis=ax, keepdims=True)
            stat = 1 / np.sqrt(((x - mean) ** 2).mean(axis=ax, keepdims=True) + 1e-5)
            y = (x - mean) * stat
        if w:
            along = kept if case.weight == "kept" else dims
            y = y * w[0].astype(np.float64).reshape([shape[a] if a in along else 1 for a in range(rank)])
        outs = [y]
        flat = stat.reshape([shape[a] for a in kept])
        if case.stat_output:
            outs.append(stat if case.keepdim else flat)
        if case.row_mean_output:
            outs.append(np.asarray(flat.mean()))
        return outs

    return fd, ref, inputs


def tolerances(case: Case, inputs: List[np.ndarray]) -> Tuple[float, float]:
    """(rtol, atol): float32 statistics over n terms round like sqrt(n); exp/log add ulps."""
    n = math.prod(case.shape[a] for a in case.dims)
    rtol = 2e-4
    if case.kind == "layernorm_moments":
        # mean(x²) - mean² cancels: its float32 rounding is relative to mean(x²), not to var.
        x = inputs[0].astype(np.float64)
        var = x.var(axis=case.dims, keepdims=True)
        ratio = (x * x).mean(axis=case.dims, keepdims=True) / (var + 1e-5)
        rtol = max(rtol, 16 * 2.0 ** -24 * float(ratio.max()))
    return rtol, 2e-5 * max(1.0, math.sqrt(n))


def check(case: Case) -> None:
    fd, ref, inputs = build(case)
    low = fd.lower(inputs)
    outs = fd.execute(inputs)
    expected = ref(*inputs)
    rtol, atol = tolerances(case, inputs)
    assert len(outs) == len(expected), case
    for i, (got, want) in enumerate(zip(outs, expected)):
        got = np.asarray(got, dtype=np.float64)
        assert got.shape == want.shape, (case, i, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{case} output {i}")
    partial = len(case.dims) < len(case.shape)
    # A mean over the rows runs in the row kernel when the rows are on the blocks (the last
    # axis reduced), at most four waves of them (132 SMs on the default target), and the
    # statistic is rank-reduced; otherwise the total takes a second kernel.
    rows = math.prod(s for a, s in enumerate(case.shape) if a not in case.dims)
    total_in_kernel = case.dims[-1] == len(case.shape) - 1 and not case.keepdim and rows <= 4 * 132
    if partial and (not case.row_mean_output or total_in_kernel):
        assert len(low.kernels) == 1, f"{case}: {len(low.kernels)} kernels\n{low.host_program}"


@settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_normalizations_match_numpy_in_one_kernel(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("case", [
    Case((7, 5), (0,), "softmax", True, "kept", True, False, 1),  # softmax over the first axis
    Case((3, 4, 5, 6), (0, 2, 3), "layernorm", False, "kept", True, False, 2),  # BatchNorm2d
    Case((4, 5, 6), (1,), "layernorm_moments", True, "reduced", False, False, 3),  # middle axis
    Case((2, 40_000), (1,), "log_softmax", False, "none", True, True, 4),  # rows past registers
    Case((5, 33), (1,), "layernorm", False, "kept", False, True, 5),  # mean over the rows too
    # Statistics broadcast back to a fixed shape with size-one axes on both sides.
    Case((1, 1, 2), (0,), "softmax", False, "reduced", True, False, 6),
], ids=["softmax_dim0", "batchnorm_nchw", "middle_axis", "long_rows", "row_mean", "size_one_axes"])
def test_named_normalizations(case: Case) -> None:
    check(case)


# Shapes with size-one axes in every position, every kind,
# keepdim, weight and statistic output: a weight broadcast to the fixed shape [1, R, N]
# expands its size-one axes, and the rows must still be one loop with x's [B, R] rows.
# (Four of the twelve forms per shape: each NVRTC-compiles its kernels after the test.)
SIZE_ONE_SHAPES = [(1, 3, 2), (2, 1, 2), (5, 1, 64), (1, 2, 1, 3), (2, 1, 1)]
FORMS = [(True, "reduced", True), (False, "kept", True), (True, "kept", False), (False, "reduced", False)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SIZE_ONE_SHAPES, ids=str)
def test_size_one_axes_in_every_form_stay_one_kernel(kind: str, shape: Tuple[int, ...]) -> None:
    for r in range(1, len(shape)):
        for dims in combinations(range(len(shape)), r):
            for keepdim, weight, stat in FORMS:
                check(Case(shape, dims, kind, keepdim, weight, stat, False, 7))


def test_an_expanded_weight_still_fixes_its_axis_and_broadcasts_the_others() -> None:
    case = Case((5, 1, 64), (2,), "rmsnorm", True, "reduced", True, False, 8)
    fd, ref, (x, w) = build(case)
    with pytest.raises(KilnError, match=r"axis 0 has size 6 but the definition fixes it to 5"):
        fd.execute([np.ones((6, 1, 64), np.float32), w])
    # The weight was broadcast to [5, 1, 64]: its size-one axis meets any size of x's.
    x2 = np.random.default_rng(9).standard_normal((5, 3, 64)).astype(np.float32)
    got = fd.execute([x2, w])
    d = x2.astype(np.float64)
    rstd = 1 / np.sqrt((d * d).mean(2, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(got[0], np.float64), d * rstd * w.astype(np.float64), rtol=2e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1], np.float64), rstd, rtol=2e-5)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_normalizations_match_numpy_on_gpu(case: Case) -> None:
    from gpu_util import cupy_or_skip  # noqa: PLC0415

    cp = cupy_or_skip()
    fd, ref, inputs = build(case)
    outs = fd.execute([cp.asarray(a) for a in inputs])
    rtol, atol = tolerances(case, inputs)
    for i, (got, want) in enumerate(zip(outs, ref(*inputs))):
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=rtol, atol=atol,
                                   err_msg=f"{case} output {i}")
