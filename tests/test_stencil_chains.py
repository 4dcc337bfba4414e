"""Chained stencils (repeated pooling written as pads and shifted slices, unrolled finite
differences): the automatic path moves each slice into the ops it reads, recomputing them, and
k-tap stencils chained n deep would recompute k^n reads per element (a 3-tap chain 12 deep lowered
for hours). Past a budget of recomputed ops a computed tensor is kept and read by the next
kernels. Checked against NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from kiln import FusionDefinition


def _max_pool_chain(depth: int, rows: int, width: int) -> FusionDefinition:
    """``depth`` times F.max_pool1d(y, 3, 1, padding=1) of exp(x), as a pad and three slices."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, width])
        y = fd.ops.exp(x)
        for _ in range(depth):
            p = fd.ops.pad(y, [1, 1], float("-inf"))
            taps = [fd.ops.slice(p, [0, k], [rows, width + k]) for k in range(3)]
            y = fd.ops.maximum(fd.ops.maximum(taps[0], taps[1]), taps[2])
        fd.add_output(y)
    return fd


def _max_pool_chain_np(x: np.ndarray, depth: int) -> np.ndarray:
    y = np.exp(x.astype(np.float64))
    for _ in range(depth):
        p = np.pad(y, ((0, 0), (1, 1)), constant_values=-np.inf)
        y = np.maximum(np.maximum(p[:, :-2], p[:, 1:-1]), p[:, 2:])
    return y


@pytest.mark.parametrize("depth", [2, 10])
def test_a_chain_of_max_pools_lowers_to_bounded_kernels_and_matches_numpy(depth: int) -> None:
    rows, width = 4, 40
    fd = _max_pool_chain(depth, rows, width)
    x = np.random.default_rng(depth).random((rows, width)).astype(np.float32)
    kernels = fd.lower([x]).kernels
    # each kernel carries the runtime header; what the chain adds stays linear in its depth
    body = sum(len(k.cuda_source.split("typedef int64_t kiln_index_t;")[-1]) for k in kernels)
    assert len(kernels) <= 2 * depth and body < 40_000 * depth
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, _max_pool_chain_np(x, depth), rtol=1e-6)


def test_taps_of_one_padded_axis_share_one_extent() -> None:
    """3x3 min-pooling (an erosion) written as pads and shifted slices: the slices' sizes,
    `min(i + 2, 26) - 2` and `min(i + 2, 25) - 1` as written, are a few extents in the
    kernel (binding checks they agree), so its bounds checks and index divisions are shared."""
    rows, cols = 20, 24

    def pool(fd: FusionDefinition, y, axis: int):  # noqa: ANN001, ANN202 - kiln tensors
        p = fd.ops.pad(y, [0, 0, 1, 1] if axis == 0 else [1, 1, 0, 0], float("-inf"))
        taps = []
        for k in range(3):
            start, end = [0, 0], [rows, cols]
            start[axis] += k
            end[axis] += k
            taps.append(fd.ops.slice(p, start, end))
        return fd.ops.maximum(fd.ops.maximum(taps[0], taps[1]), taps[2])

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        for _ in range(2):
            a = fd.ops.neg(pool(fd, fd.ops.neg(y), 0))
            b = fd.ops.neg(pool(fd, fd.ops.neg(y), 1))
            y = fd.ops.minimum(a, b)
        fd.add_output(y)
    xs = np.random.default_rng(3).random((rows, cols)).astype(np.float32)
    src = fd.lower([xs]).kernels[0].cuda_source
    body = src.split("typedef int64_t kiln_index_t;")[-1]
    # With each slice's size spelled as written, the kernel's code was 436 kB (its bounds
    # checks repeated per slice); with one size per aligned axis it is 188 kB.
    assert len(body) < 250_000, len(body)
    want = np.exp(xs.astype(np.float64))
    for _ in range(2):
        pr = np.pad(-want, ((1, 1), (0, 0)), constant_values=-np.inf)
        pc = np.pad(-want, ((0, 0), (1, 1)), constant_values=-np.inf)
        a = -np.maximum(np.maximum(pr[:-2], pr[1:-1]), pr[2:])
        b = -np.maximum(np.maximum(pc[:, :-2], pc[:, 1:-1]), pc[:, 2:])
        want = np.minimum(a, b)
    (got,) = fd.execute([xs])
    np.testing.assert_allclose(got, want, rtol=1e-6)
