"""Slices, pads and cats of index vectors and inputs run in their readers' kernel.

Position encodings, grids and shifted sequences take an ``arange`` and slice, pad or
concatenate it (``cat([x + arange(W), x], 1)``, ``arange(S)[1:]``, a grid padded at its
border); losses sum a slice of an input (``x[1:].sum()``, total variation). The remapped
``arange`` is an ``arange`` again, with its start and step moved, so it is made in the
readers' loops instead of stored whole for a remap to read; a full reduction keeps reading
a sliced input from memory instead of from a register copy that the slice cannot index.
Each case is checked against NumPy in float64 and must take one kernel.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

F32, I64 = DataType.Float, DataType.Int


def _one_kernel(fd: FusionDefinition, ins: List[np.ndarray], want: List[np.ndarray],
                tol: float = 1e-5) -> None:
    kernels = len(fd.lower(ins).kernels)
    outs = fd.execute(ins)
    for o, w in zip(outs, want):
        np.testing.assert_allclose(np.asarray(o, dtype=np.float64), w, rtol=tol, atol=tol)
    assert kernels == 1, f"{kernels} kernels"


def test_cat_of_input_plus_arange() -> None:
    x = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], F32)
        v = fd.ops.broadcast_in_dim(fd.ops.cast(fd.ops.iota(fd.ops.size(xt, 1)), F32), [-1, -1], [1])
        fd.add_output(fd.ops.cat([fd.ops.add(xt, v), xt], 1))
    x64 = x.astype(np.float64)
    _one_kernel(fd, [x], [np.concatenate([x64 + np.arange(16), x64], 1)])


def test_interleaved_positions_from_sliced_arange() -> None:
    """``pos[0::2]`` and ``pos[1::2]`` of an arange, scaled and added to two halves."""
    x = np.random.default_rng(1).standard_normal((4, 10)).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], F32)
        pos = fd.ops.iota(20, 3, 2)
        even = fd.ops.cast(fd.ops.slice(pos, [0], [None], [2]), F32)
        odd = fd.ops.cast(fd.ops.slice(pos, [1], [None], [2]), F32)
        sin = fd.ops.sin(fd.ops.mul(fd.ops.broadcast_in_dim(even, [-1, -1], [1]), 0.1))
        cos = fd.ops.cos(fd.ops.mul(fd.ops.broadcast_in_dim(odd, [-1, -1], [1]), 0.1))
        fd.add_output(fd.ops.add(xt, fd.ops.mul(sin, cos)))
    p = 3 + 2 * np.arange(20)
    want = x.astype(np.float64) + np.sin(p[0::2] * 0.1) * np.cos(p[1::2] * 0.1)
    _one_kernel(fd, [x], [want])


@pytest.mark.parametrize("shape", [(37,), (1,), (5, 9)])
def test_full_sum_of_a_slice(shape: Tuple[int, ...]) -> None:
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1] * len(shape), F32)
        s = fd.ops.slice(xt, [min(1, shape[0])] + [0] * (len(shape) - 1), [None] * len(shape))
        fd.add_output(fd.ops.sum(s, dims=list(range(len(shape)))))
    _one_kernel(fd, [x], [np.asarray(x.astype(np.float64)[1:].sum())])


def test_total_variation_loss() -> None:
    """``|x[:, 1:] - x[:, :-1]|.sum() + |x[1:] - x[:-1]|.sum()`` over an image."""
    x = np.random.default_rng(3).standard_normal((17, 23)).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], F32)
        h, w = fd.ops.size(xt, 0), fd.ops.size(xt, 1)
        right = fd.ops.slice(xt, [0, 0], [None, fd.ops.sub(w, 1)])
        below = fd.ops.slice(xt, [0, 0], [fd.ops.sub(h, 1), None])
        dw = fd.ops.abs(fd.ops.sub(fd.ops.slice(xt, [0, 1], [None, None]), right))
        dh = fd.ops.abs(fd.ops.sub(fd.ops.slice(xt, [1, 0], [None, None]), below))
        fd.add_output(fd.ops.add(fd.ops.sum(dw, dims=[0, 1]), fd.ops.sum(dh, dims=[0, 1])))
    x64 = x.astype(np.float64)
    want = np.abs(np.diff(x64, axis=1)).sum() + np.abs(np.diff(x64, axis=0)).sum()
    lowered = fd.lower([x])
    np.testing.assert_allclose(np.asarray(fd.execute([x])[0], dtype=np.float64), want, rtol=1e-5)
    # Two full sums of different shapes: one kernel each at most.
    assert len(lowered.kernels) <= 2


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    start=st.integers(-5, 5),
    step=st.integers(-3, 3),
    kind=st.sampled_from(["slice", "pad", "cat_first", "cat_second"]),
    a=st.integers(0, 6),
    b=st.integers(1, 3),
    rows=st.integers(1, 5),
)
def test_remapped_arange_property(n: int, start: int, step: int, kind: str, a: int, b: int,
                                  rows: int) -> None:
    """An arange sliced (start ``a``, stride ``b``), padded (``a`` before, ``b`` after) or
    concatenated with zeros, added to a full input of the result's width."""
    ref = start + step * np.arange(n, dtype=np.int64)
    if kind == "slice":
        want = ref[min(a, n)::b]
    elif kind == "pad":
        want = np.concatenate([np.full(a, 7), ref, np.full(b, 7)])
    elif kind == "cat_first":
        want = np.concatenate([ref, np.zeros(a + 1)])
    else:
        want = np.concatenate([np.zeros(a + 1), ref])
    if len(want) == 0:
        return
    with FusionDefinition() as fd:
        it = fd.ops.iota(n, start, step)
        if kind == "slice":
            r = fd.ops.slice(it, [min(a, n)], [None], [b])
        elif kind == "pad":
            r = fd.ops.pad(it, [a, b], 7)
        else:
            z = fd.ops.full([a + 1], 0, I64)
            r = fd.ops.cat([it, z] if kind == "cat_first" else [z, it], 0)
        xt = fd.define_tensor([-1, -1], F32)
        fd.add_output(fd.ops.add(xt, fd.ops.broadcast_in_dim(fd.ops.cast(r, F32), [-1, -1], [1])))
    x = np.random.default_rng(n).standard_normal((rows, len(want))).astype(np.float32)
    _one_kernel(fd, [x], [x.astype(np.float64) + want.astype(np.float64)[None, :]])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 17)])
def test_remapped_sources_on_gpu(shape: Tuple[int, ...]) -> None:
    """``cat([x + arange(W), x], 1)`` and ``x[1:].sum()`` on the GPU."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    x64 = x.astype(np.float64)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], F32)
        v = fd.ops.broadcast_in_dim(fd.ops.cast(fd.ops.iota(fd.ops.size(xt, 1)), F32), [-1, -1], [1])
        fd.add_output(fd.ops.cat([fd.ops.add(xt, v), xt], 1))
    assert len(fd.lower([x]).kernels) == 1
    got = cp.asnumpy(fd.execute([cp.asarray(x)])[0])
    np.testing.assert_allclose(got, np.concatenate([x64 + np.arange(shape[1]), x64], 1), rtol=1e-5, atol=1e-5)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], F32)
        fd.add_output(fd.ops.sum(fd.ops.slice(xt, [1, 0], [None, None]), dims=[0, 1]))
    assert len(fd.lower([x]).kernels) == 1
    got = cp.asnumpy(fd.execute([cp.asarray(x)])[0])
    np.testing.assert_allclose(got, x64[1:].sum(), rtol=1e-4, atol=1e-3)
