"""Axes a schedule merges that lie contiguously in memory are indexed as one: a row of
``[C/G, H, W]`` (GroupNorm), or the last two axes of a LayerNorm or an InstanceNorm, is read at
``row * (C/G * H * W) + position``, not at a division and a remainder per axis. The offsets stay
affine in the loop indices, which vector loads and bulk copies of the row need (GroupNorm over
NCHW took the looped schedule, reading its input twice, because the Shared-memory schedule's
bulk copy saw ``idx / 64 % 64 * 64 + idx % 64``). Values are checked against NumPy in float64
through the CPU interpreter, with contiguous and strided inputs (whose axes must not be
joined)."""

from __future__ import annotations

import re
from typing import Any, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition


def _reads_of(src: str, tensor: str) -> List[str]:
    """The offset expressions the CUDA source reads `tensor` at (vector or element loads)."""
    offsets, last = [], None
    for line in src.splitlines():
        m = re.search(r"kiln_ib = (.*);$", line.strip())
        if m:
            last = m.group(1)
        if f"&{tensor}[kiln_ib]" in line and last is not None:
            offsets.append(last)
        offsets += [o for o in re.findall(rf"\b{tensor}\[([^\]]*)\]", line) if o != "kiln_ib"]
    return offsets


@pytest.mark.parametrize("shape, dims",
                         [((8, 64, 64), [1, 2]), ((4, 6, 32, 16), [1, 2, 3]), ((3, 5, 7), [1, 2])])
def test_a_row_of_contiguous_axes_is_read_without_divisions(shape: tuple, dims: List[int]) -> None:
    """A sum over trailing contiguous axes reads its input at offsets with no `/` or `%`."""
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.sum(t, dims=dims))
    low = fd.lower([x])
    assert len(low.kernels) == 1
    reads = _reads_of(low.kernels[0].cuda_source_for(True), "T0")
    assert reads, "no read of the input found"
    for r in reads:
        assert "/" not in r and "%" not in r, r
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, x.astype(np.float64).sum(axis=tuple(dims)), rtol=1e-5, atol=1e-4)


def test_group_norm_keeps_its_rows_in_shared_memory() -> None:
    """GroupNorm(32) over NCHW [16, 512, 64, 64]: rows of 16 x 64 x 64 contiguous elements are
    copied whole into Shared memory (one read of the input), not streamed twice."""
    n, c, h, w = 16, 512, 64, 64
    g = 32
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 4)
        xr = fd.ops.reshape(x, [n, g, c // g, h, w])
        var, mean = fd.ops.var_mean(xr, dims=[2, 3, 4], correction=0)
        y = fd.ops.mul(
            fd.ops.sub(xr, fd.ops.broadcast_in_dim(mean, [-1] * 5, [0, 1])),
            fd.ops.rsqrt(fd.ops.broadcast_in_dim(fd.ops.add(var, 1e-5), [-1] * 5, [0, 1])),
        )
        fd.add_output(fd.ops.reshape(y, [n, c, h, w]))
    stand_in = np.zeros((n, c, h, w), np.float32)
    low = fd.lower([stand_in])
    assert len(low.kernels) == 1
    k = low.kernels[0]
    assert int(k.launch["smem_bytes"]) >= 16 * 1024, k.launch  # the row's part is held in Shared memory
    src = k.cuda_source_for(True)
    assert "bulk" in src.lower(), "the row is not copied in bulk"


@st.composite
def _cases(draw: Any) -> Any:
    rank = draw(st.integers(2, 4))
    shape = [draw(st.sampled_from([1, 2, 3, 5, 8, 16, 33])) for _ in range(rank)]
    k = draw(st.integers(1, rank - 1))  # reduce the last k axes
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    op = draw(st.sampled_from(["sum", "layernorm"]))
    return shape, k, layout, op


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_merged_rows_match_numpy_for_any_layout(case: Any) -> None:
    """Row reductions and normalizations over trailing axes of contiguous, strided (a slice
    with a step) and transposed inputs: the values match NumPy (strided axes are not joined)."""
    shape, k, layout, op = case
    rng = np.random.default_rng(sum(shape) * 7 + k)
    if layout == "strided":
        base = rng.standard_normal(shape[:-1] + [shape[-1] * 2]).astype(np.float32)
        x = base[..., ::2]
    elif layout == "transposed":
        base = rng.standard_normal(shape[::-1]).astype(np.float32)
        x = base.transpose(list(range(len(shape)))[::-1])
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    dims = list(range(len(shape) - k, len(shape)))
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1] * len(shape))  # the layout is the array's
        if op == "sum":
            fd.add_output(fd.ops.sum(t, dims=dims))
        else:
            var, mean = fd.ops.var_mean(t, dims=dims, correction=0, keepdim=True)
            fd.add_output(fd.ops.mul(fd.ops.sub(t, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5))))
    (got,) = fd.execute([x])
    xd = x.astype(np.float64)
    if op == "sum":
        want = xd.sum(axis=tuple(dims))
    else:
        mu = xd.mean(axis=tuple(dims), keepdims=True)
        want = (xd - mu) / np.sqrt(xd.var(axis=tuple(dims), keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
