"""Slices of cats on the automatic path: a recurrence that keeps its state as a ``cat`` of
columns and slices it every step (explicit ODE solvers, unrolled scans), and random slices of
random cats. A slice that falls inside one part reads that part alone (the ``where`` over the
parts picks its branch from the slice's positions, pinned to the sizes at hand where only
they decide it), and a part of size one that a cat places is read as computed, not recomputed
at the cat's positions. Checked against NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition


def _lorenz(steps: int, width: int) -> FusionDefinition:
    """``steps`` explicit Euler steps of the Lorenz system on a [B, 3] state (``width``: -1
    for a runtime width), each splitting the state into columns and joining the update."""
    with FusionDefinition() as fd:
        s = fd.define_tensor([-1, width])
        for _ in range(steps):
            x = fd.ops.slice(s, [0, 0], [None, 1])
            y = fd.ops.slice(s, [0, 1], [None, 2])
            z = fd.ops.slice(s, [0, 2], [None, 3])
            dx = fd.ops.mul(fd.ops.sub(y, x), 10.0)
            dy = fd.ops.sub(fd.ops.mul(x, fd.ops.sub(28.0, z)), y)
            dz = fd.ops.sub(fd.ops.mul(x, y), fd.ops.mul(z, 8.0 / 3.0))
            s = fd.ops.add(s, fd.ops.mul(fd.ops.cat([dx, dy, dz], 1), 0.01))
        fd.add_output(s)
    return fd


def _lorenz_np(s: np.ndarray, steps: int) -> np.ndarray:
    s = s.astype(np.float64)
    for _ in range(steps):
        x, y, z = s[:, :1], s[:, 1:2], s[:, 2:3]
        s = s + 0.01 * np.concatenate([10 * (y - x), x * (28 - z) - y, x * y - z * 8 / 3], 1)
    return s


def test_an_unrolled_recurrence_on_a_cat_state_is_one_kernel() -> None:
    # Each step's slices read the previous step's parts; moving every cat's remaps through
    # all the earlier steps made the fusion exponential in the steps (4 steps took 5 s and
    # 4 kernels, 12 steps did not finish in 10 minutes).
    steps = 24
    fd = _lorenz(steps, 3)
    s0 = np.random.default_rng(0).standard_normal((37, 3)).astype(np.float32)
    assert len(fd.lower([s0]).kernels) == 1
    (got,) = fd.execute([s0])
    np.testing.assert_allclose(got, _lorenz_np(s0, steps), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_recurrence_on_a_cat_state_of_runtime_width(steps: int) -> None:
    # The parts' sizes are runtime sizes here: the slices' branches are decided for the
    # width at hand (the plan is pinned to it), and a second width plans again.
    fd = _lorenz(steps, -1)
    for rows in (5, 64):
        s0 = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        (got,) = fd.execute([s0])
        np.testing.assert_allclose(got, _lorenz_np(s0, steps), rtol=1e-5, atol=1e-5)


def test_an_unrolled_scan_of_slices_joined_by_cat() -> None:
    # cumsum along axis 1 written as running adds of one-wide slices, joined by a cat (the
    # scanned axis of a fixed length, as an unrolled loop has).
    t = 12
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, t, -1])
        acc, parts = None, []
        for k in range(t):
            s = fd.ops.slice(x, [0, k, 0], [None, k + 1, None])
            acc = s if acc is None else fd.ops.add(acc, s)
            parts.append(acc)
        fd.add_output(fd.ops.cat(parts, 1))
    xs = np.random.default_rng(1).standard_normal((3, t, 5)).astype(np.float32)
    (got,) = fd.execute([xs])
    np.testing.assert_allclose(got, np.cumsum(xs.astype(np.float64), 1), rtol=1e-5, atol=1e-5)


# (part widths, rows, slices as (start, end) along the cat, runtime widths?)
CatCase = Tuple[List[int], int, List[Tuple[int, int]], bool]


@st.composite
def _cat_and_slices(draw: st.DrawFn) -> CatCase:
    widths = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    rows = draw(st.integers(1, 5))
    total = sum(widths)
    # slices inside one part and across parts, with their start and end in [0, total]
    cuts = []
    for _ in range(draw(st.integers(1, 3))):
        a = draw(st.integers(0, total - 1))
        b = draw(st.integers(a + 1, total))
        cuts.append((a, b))
    return widths, rows, cuts, draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(_cat_and_slices())
def test_slices_of_a_cat_of_computed_parts_match_numpy(case: CatCase) -> None:
    widths, rows, cuts, runtime = case
    with FusionDefinition() as fd:
        parts = [fd.define_tensor([-1, -1 if runtime else w]) for w in widths]
        c = fd.ops.cat([fd.ops.mul(fd.ops.exp(p), float(i + 1)) for i, p in enumerate(parts)], 1)
        for a, b in cuts:
            fd.add_output(fd.ops.neg(fd.ops.slice(c, [0, a], [None, b])))
        fd.add_output(fd.ops.add(c, 1.0))
    rng = np.random.default_rng(len(widths) * 31 + rows)
    xs = [rng.standard_normal((rows, w)).astype(np.float32) for w in widths]
    ref = np.concatenate([np.exp(x.astype(np.float64)) * (i + 1) for i, x in enumerate(xs)], 1)
    got = fd.execute(xs)
    for (a, b), g in zip(cuts, got):
        np.testing.assert_allclose(g, -ref[:, a:b], rtol=1e-5)
    np.testing.assert_allclose(got[-1], ref + 1.0, rtol=1e-5)
    if runtime:
        # Other widths: a plan pinned to the widths at hand is not reused for them.
        ws = [w % 4 + 1 for w in widths]
        if sum(ws) >= max(b for _, b in cuts):
            ys = [rng.standard_normal((rows, w)).astype(np.float32) for w in ws]
            ref2 = np.concatenate([np.exp(y.astype(np.float64)) * (i + 1) for i, y in enumerate(ys)], 1)
            got2 = fd.execute(ys)
            for (a, b), g in zip(cuts, got2):
                np.testing.assert_allclose(g, -ref2[:, a:b], rtol=1e-5)


@pytest.mark.parametrize("n", [1, 5])
def test_a_first_element_slice_beside_its_input_of_one_element(n: int) -> None:
    # `x[0:1]` of a runtime size n is n's computed size `min(1, n)`: where n is 1 it reads x
    # unchanged, but its size is not x's (a squeeze may take the slice's as one, not x's).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        first = fd.ops.slice(x, [0], [1])
        fd.add_output(first)
        fd.add_output(fd.ops.div(x, fd.ops.add(fd.ops.abs(first), 1.0)))
    xs = np.random.default_rng(n).uniform(-1, 1, n).astype(np.float32)
    got_first, got = fd.execute([xs])
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(got_first, x64[:1], rtol=1e-7)
    np.testing.assert_allclose(got, x64 / (np.abs(x64[:1]) + 1.0), rtol=1e-6)
