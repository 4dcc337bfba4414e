"""Softmax and log-softmax of masked rows where the automatic schedules compute them from
one online log-sum-exp (rows longer than a block keeps on chip, and reductions over other
axes than the last): ``exp(x - lse)`` must give what ``exp(x - max) / sum`` gives in float64
for rows filled with mask values of any size (-1e4, -1e9, -1e18, -1e30, ``finfo.min``, -inf),
fully masked rows included (1/n each, not 1: float alone rounds ``-1e9 + log(n)`` to
``-1e9``, and past 1e16 so does double), log-softmax values of masked entries as large as the
mask, logits in the thousands, and rows holding +inf, -inf or NaN (NaN over the whole row, as
PyTorch gives).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

# (shape, reduced axes): long last-axis rows, and shorter rows over other axes.
LAYOUTS: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = [
    ((3, 33_000), (1,)),
    ((2, 40_000), (1,)),
    ((7, 4), (0,)),
    ((5, 7, 3), (1,)),
    ((2, 6, 5), (0, 2)),
    ((16, 8, 32), (1,)),
]
FINFO_MIN = float(np.finfo(np.float32).min)
FILLS = [-1e4, -1e9, -1e18, -1e30, FINFO_MIN, -np.inf]


def _fusion(rank: int, dims: Sequence[int], fill: float, log: bool) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank, DataType.Float)
        keep = fd.define_tensor([-1] * rank, DataType.Bool)
        s = fd.ops.where(keep, x, fill)
        m = fd.ops.max(s, dims=list(dims), keepdim=True)
        d = fd.ops.sub(s, m)
        e = fd.ops.exp(d)
        total = fd.ops.sum(e, dims=list(dims), keepdim=True)
        fd.add_output(fd.ops.sub(d, fd.ops.log(total)) if log else fd.ops.div(e, total))
    return fd


def _reference(x: np.ndarray, keep: np.ndarray, dims: Sequence[int], fill: float, log: bool) -> np.ndarray:
    s = np.where(keep, x.astype(np.float64), fill)
    ax = tuple(dims)
    with np.errstate(invalid="ignore", over="ignore"):
        d = s - s.max(axis=ax, keepdims=True)
        lsm = d - np.log(np.exp(d).sum(axis=ax, keepdims=True))
    return lsm if log else np.exp(lsm)


def _check(got: Any, want: np.ndarray, log: bool) -> None:
    got = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN positions differ"
    ok = ~np.isnan(want)
    if log:
        np.testing.assert_allclose(got[ok], want[ok], rtol=2e-6, atol=2e-4)
    else:
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-7)


def _plant_non_finite(x: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> None:
    """One +inf, one -inf and one NaN at random places of ``x``, nothing masked."""
    flat = x.reshape(-1)
    for v in (np.inf, -np.inf, np.nan):
        flat[rng.integers(0, flat.size)] = v
    keep[:] = True


@st.composite
def cases(draw: Any) -> Tuple[int, float, bool, str, int, float]:
    return (draw(st.integers(0, len(LAYOUTS) - 1)), draw(st.sampled_from(FILLS)), draw(st.booleans()),
            draw(st.sampled_from(["random", "fully_masked_slices", "special"])), draw(st.integers(0, 2**16)),
            draw(st.sampled_from([1.0, 30.0, 1000.0])))


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_masked_softmax_rows_match_float64(case: Tuple[int, float, bool, str, int, float]) -> None:
    layout, fill, log, mask_kind, seed, scale = case
    shape, dims = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    keep = rng.random(shape) < 0.7
    if mask_kind == "fully_masked_slices":
        # Every other slice along the first kept axis is masked whole.
        kept = [a for a in range(len(shape)) if a not in dims][0]
        sl = [slice(None)] * len(shape)
        sl[kept] = slice(0, None, 2)
        keep[tuple(sl)] = False
    elif mask_kind == "special":
        _plant_non_finite(x, keep, rng)
    fd = _fusion(len(shape), dims, fill, log)
    low = fd.lower([x, keep])
    src = "".join(k.cuda_source_for(False) for k in low.kernels)
    # These rows take the online log-sum-exp, finished in double (see canonical::online_logsumexp).
    assert "kiln::lseFinish<double>" in src, "the rows were not computed from a log-sum-exp"
    _check(fd.execute([x, keep])[0], _reference(x, keep, dims, fill, log), log)


@pytest.mark.parametrize("shape,dims", [((1, 3, 1), (1,)), ((1, 32_769), (1,)), ((3, 2), (0,))])
@pytest.mark.parametrize("fill", [-1e9, -1e18, FINFO_MIN])
def test_a_fully_masked_slice_is_uniform(shape: Tuple[int, ...], dims: Tuple[int, ...], fill: float) -> None:
    n = int(np.prod([shape[a] for a in dims]))
    ins = [np.zeros(shape, np.float32), np.zeros(shape, bool)]
    got = np.asarray(_fusion(len(shape), dims, fill, False).execute(ins)[0], np.float64)
    np.testing.assert_allclose(got, 1.0 / n, rtol=1e-6)
    got = np.asarray(_fusion(len(shape), dims, fill, True).execute(ins)[0], np.float64)
    np.testing.assert_allclose(got, -np.log(n), rtol=1e-6)


@pytest.mark.parametrize("shape,dims", [((2, 33_000), (1,)), ((4, 5, 3), (1,))])
def test_rows_of_masks_of_several_sizes(shape: Tuple[int, ...], dims: Tuple[int, ...]) -> None:
    """Masks of different sizes in one row (a padding mask of -1e9 beside a causal -inf or
    finfo.min): the largest value wins as in float64, and a log-softmax keeps each masked
    entry's own size. (Values that all lie below -2^32 count as equal: one mask size
    below that per row, see ir::LSE_FLOOR.)"""
    rng = np.random.default_rng(5)
    x = rng.choice(np.array([-1e9, FINFO_MIN, -np.inf], np.float32), size=shape)
    x[0, 0] = 2.0  # one real value in the first row (slice): the masks there are zero
    for log in (False, True):
        with FusionDefinition() as fd:
            t = fd.define_tensor([-1] * len(shape), DataType.Float)
            m = fd.ops.max(t, dims=list(dims), keepdim=True)
            d = fd.ops.sub(t, m)
            e = fd.ops.exp(d)
            total = fd.ops.sum(e, dims=list(dims), keepdim=True)
            fd.add_output(fd.ops.sub(d, fd.ops.log(total)) if log else fd.ops.div(e, total))
        want = _reference(x, np.ones(shape, bool), dims, 0.0, log)
        _check(fd.execute([x])[0], want, log)


@pytest.mark.parametrize("n", [16_385, 40_000])
def test_double_rows_past_the_chip_stay_exact(n: int) -> None:
    """A double row has no wider type to hold log(n) beside its maximum, so it keeps the
    written form (`x - max` is exact): softmax and log-softmax at logits near 1e8 agree with
    float64 NumPy to a few ulp (the online form lost eps64 * |max|, 8e-9 relative)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Double)
        z = fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True))
        total = fd.ops.sum(fd.ops.exp(z), dims=[1], keepdim=True)
        fd.add_output(fd.ops.div(fd.ops.exp(z), total))
        fd.add_output(fd.ops.sub(z, fd.ops.log(total)))
    a = np.random.default_rng(n).standard_normal((2, n)) * 3 + 1e8
    p, lp = fd.execute([a])
    d = a - a.max(1, keepdims=True)
    want_lp = d - np.log(np.exp(d).sum(1, keepdims=True))
    np.testing.assert_allclose(p, np.exp(want_lp), rtol=1e-13)
    np.testing.assert_allclose(lp, want_lp, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- GPU
# Long rows on the GPU take the floored log-sum-exp block by block (kiln::lseAddBlockRaised):
# a block's elements are raised to the floor only where the running maximum is near it, so
# rows masked whole, rows whose first half is masked (the maximum jumps from the mask to the
# logits), masks of several sizes and non-finite values must all give float64's answer.
# (shape, reduced axes); the mixed-mask case sets axis 1 of every row.
GPU_LAYOUTS = [((3, 33_000), (1,)), ((2, 131_072), (1,)), ((2, 300_000), (1,)), ((16, 8, 32), (1,))]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", range(len(GPU_LAYOUTS)))
@pytest.mark.parametrize("fill", [-1e9, -1e30, FINFO_MIN, -np.inf])
@pytest.mark.parametrize("mask_kind", ["random", "fully_masked", "masked_prefix", "mixed_masks", "special"])
@pytest.mark.parametrize("log", [False, True])
def test_masked_rows_on_the_gpu(layout: int, fill: float, mask_kind: str, log: bool) -> None:
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    shape, dims = GPU_LAYOUTS[layout]
    rng = np.random.default_rng(layout * 100 + len(mask_kind))
    x = (rng.standard_normal(shape) * 30.0).astype(np.float32)
    keep = rng.random(shape) < 0.7
    last = shape[-1]
    if mask_kind == "fully_masked":
        keep[0] = False
    elif mask_kind == "masked_prefix":
        keep[..., : last // 2] = False
        keep[..., last // 2:] = True
    elif mask_kind == "mixed_masks":
        x = rng.choice(np.array([-1e9, -1e30, FINFO_MIN, -np.inf], np.float32), size=shape)
        keep[:] = True
        # Every row holds a -1e9 (rows of different sizes all below -2^32 and nothing else
        # count them as equal, see LSE_FLOOR), the first one real value too.
        x[:, 1] = -1e9
        x[0, 0] = 2.0
    elif mask_kind == "special":
        _plant_non_finite(x, keep, rng)
    fd = _fusion(len(shape), dims, fill, log)
    got = fd.execute([cp.asarray(x), cp.asarray(keep)])[0]
    _check(cp.asnumpy(got), _reference(x, keep, dims, fill, log), log)
