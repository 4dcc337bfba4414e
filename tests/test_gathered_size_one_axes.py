"""Gathers read more than once, over inputs whose runtime sizes of one sit beside reshapes with
literal ones: the automatic path moves the reshape into each read of the gather, and the
copies' axes of one element iterate where the output's literal one is a broadcast. They share
the output's loops (``sub(g, g)`` was refused by every scheduler). Checked against NumPy in
float64 in the CPU interpreter."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

_TWICE = {
    "sub": (lambda o, g: o.sub(g, g), lambda g: g - g),
    "mul": (lambda o, g: o.mul(g, g), lambda g: g * g),
    "add_exp": (lambda o, g: o.add(g, o.exp(g)), lambda g: g + np.exp(g)),
    "silu": (lambda o, g: o.mul(g, o.sigmoid(g)), lambda g: g / (1.0 + np.exp(-g))),
}


@st.composite
def _cases(draw: st.DrawFn) -> Tuple[List[int], int, int, str, List[int]]:
    rank = draw(st.integers(2, 4))
    shape = [draw(st.sampled_from([1, 1, 2, 3, 5])) for _ in range(rank)]
    axis = draw(st.integers(0, rank - 1))
    n = draw(st.sampled_from([1, 4, 6, 16]))
    op = draw(st.sampled_from(sorted(_TWICE)))
    out = shape[:axis] + [n] + shape[axis + 1:]
    # the reshape: the gathered axis split in two where it divides, literal ones inserted
    new: List[int] = []
    for a, s in enumerate(out):
        if a == axis and n % 2 == 0 and draw(st.booleans()):
            new += [n // 2, 2]
        else:
            new.append(s)
        if draw(st.integers(0, 3)) == 0:
            new.append(1)
    return shape, axis, n, op, new


@settings(max_examples=80, deadline=None)
@given(_cases())
def test_a_gather_read_twice_then_reshaped_matches_numpy(case) -> None:  # noqa: ANN001
    shape, axis, n, op, new = case
    rng = np.random.default_rng(len(shape) * 7 + axis)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    idx = rng.integers(0, shape[axis], n).astype(np.int64)
    build, ref = _TWICE[op]
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1] * len(shape))
        i = fd.define_tensor([-1], dtype=DataType.Int)
        g = fd.ops.index_select(t, i, axis)
        fd.add_output(fd.ops.reshape(build(fd.ops, g), new))
    (got,) = fd.execute([x, idx])
    want = ref(np.take(x.astype(np.float64), idx, axis)).reshape(new)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
