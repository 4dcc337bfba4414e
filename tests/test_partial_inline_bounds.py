"""A broadcast input read through a chain of casts whose readers sit in different loops of
one pointwise kernel (one of them feeds a vectorized output store): the chain is partly
inlined, computed in a loop of its own over the flattened output space, and its read of the
broadcast input must stop where that space ends. The interpreter reports any read past an
allocation, so the values here are checked only when no element is read out of bounds."""

from __future__ import annotations

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def _fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DataType.Float)
        b = fd.define_tensor([-1, -1], dtype=DataType.Float, contiguity=[True, True])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1, -1], broadcast_dims=[0, 1])
        wide = fd.ops.cast(fd.ops.cast(bb, DataType.Double), DataType.Float)
        below = fd.ops.lt(x, wide)
        fd.add_output(below)
        fd.add_output(fd.ops.where(fd.ops.gt(fd.ops.cast(below, DataType.Float), wide), 0.5, wide))
    return fd


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 3), (2, 3, 5), (3, 1, 7), (4, 5, 8)])
def test_a_partly_inlined_broadcast_chain_reads_inside_its_input(shape: tuple) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    b = rng.uniform(-1, 1, shape[:2]).astype(np.float32)
    below, out = _fusion().execute([x, b])
    wide = np.broadcast_to(b.astype(np.float64)[:, :, None], shape)
    want_below = x.astype(np.float64) < wide
    np.testing.assert_array_equal(below, want_below)
    np.testing.assert_allclose(out, np.where(want_below.astype(np.float64) > wide, 0.5, wide), rtol=1e-7)
