"""Shape ops around position-dependent sources and views, found by a random generator of
shape-op chains: a mask built from ``iota`` along one axis and then reshaped (a causal mask
viewed as ``[1, S, S]``) must keep each element's row, and an output that is only a view of
an input (``squeeze(broadcast_in_dim(x))``) is still written. Checked against NumPy.
"""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError


@pytest.mark.parametrize("shape", [[5, 1, 4], [5, 2, 2], [1, 5, 4], [20], [10, 2], None], ids=str)
@pytest.mark.parametrize("along", [0, 1])
def test_an_iota_mask_keeps_its_positions_through_a_reshape(shape: List[int], along: int) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        n = 5 if along == 0 else 4
        pos = fd.ops.broadcast_in_dim(fd.ops.iota(n), shape=[-1, -1], broadcast_dims=[along])
        y = fd.ops.where(fd.ops.lt(pos, 2), x, -1.0)
        fd.add_output(fd.ops.reshape(y, shape) if shape else y)
    a = np.arange(20, dtype=np.float32).reshape(5, 4)
    idx = np.arange(5)[:, None] if along == 0 else np.arange(4)[None, :]
    want = np.where(idx < 2, a, -1.0)
    np.testing.assert_array_equal(fd.execute([a])[0], want.reshape(shape) if shape else want)


def test_a_causal_mask_viewed_with_a_batch_axis_masks_the_softmax() -> None:
    s = 7
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.ops.broadcast_in_dim(fd.ops.iota(s), [-1, -1], [0])
        j = fd.ops.broadcast_in_dim(fd.ops.iota(s), [-1, -1], [1])
        y = fd.ops.reshape(fd.ops.where(fd.ops.ge(i, j), x, -1e9), [1, s, s])
        e = fd.ops.exp(fd.ops.sub(y, fd.ops.max(y, [2], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, [2], keepdim=True)))
    a = np.random.default_rng(0).standard_normal((s, s)).astype(np.float32)
    z = np.where(np.tril(np.ones((s, s), bool)), a.astype(np.float64), -1e9)
    want = np.exp(z - z.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    np.testing.assert_allclose(fd.execute([a])[0], want[None], rtol=1e-5, atol=1e-7)


def test_an_output_that_is_a_view_of_an_input_is_written() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.squeeze(fd.ops.broadcast_in_dim(x, [-1, 1, -1], [0, 2]), [1]))
        fd.add_output(fd.ops.squeeze(fd.ops.broadcast_in_dim(x, [1, -1, -1], [1, 2]), [0]))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    outs = fd.execute([a])
    assert len(outs) == 2
    for o in outs:
        np.testing.assert_array_equal(o, a)
    np.testing.assert_array_equal(fd.execute([a.T.copy()])[0], a.T)


# (start, stop) of a width-one slice of a runtime-sized axis: the first, a middle and the last.
WIDTH_ONE = [(0, 1), (2, 3), (-1, None)]


def _width_one(fd: FusionDefinition, x: object, axis: int, span: tuple) -> object:
    """``x[..., start:stop]`` along ``axis`` (``-1``: the last element)."""
    start, stop = span
    rank = 3
    starts = [0] * rank
    ends = [fd.ops.size(x, a) for a in range(rank)]
    if start == -1:
        starts[axis] = fd.ops.sub(fd.ops.size(x, axis), 1)
    else:
        starts[axis], ends[axis] = start, stop
    return fd.ops.slice(x, starts, ends)


@pytest.mark.parametrize("span", WIDTH_ONE, ids=str)
@pytest.mark.parametrize("how", ["expand", "broadcast_in_dim", "implicit"])
def test_a_width_one_slice_broadcasts_as_in_pytorch(span: tuple, how: str) -> None:
    """``x[:, :1].expand(-1, -1, n)``, ``x - x[:, -1:, :]`` (NLinear), a class token's column:
    a slice of one element of a runtime-sized axis broadcasts as PyTorch broadcasts it (the
    axis is checked to be one when the inputs are bound)."""
    a = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        first = _width_one(fd, x, 1, span)
        if how == "expand":
            y = fd.ops.expand(first, [-1, 5, -1])
        elif how == "broadcast_in_dim":
            y = fd.ops.broadcast_in_dim(first, shape=[2, 5, 4], broadcast_dims=[0, 1, 2])
        else:
            y = fd.ops.sub(x, first)
        fd.add_output(y)
    start, stop = span
    col = a[:, start:stop, :] if start != -1 else a[:, -1:, :]
    want = a - col if how == "implicit" else np.broadcast_to(col, a.shape)
    (got,) = fd.execute([a])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [5, 7])
def test_an_empty_slice_meets_an_empty_constant_shape(rows: int) -> None:
    """``x[5:5, ::2] - torch.full((0, k), c)``: an axis sliced to no elements (whose size the
    compiler cannot prove to be 0) meets a constant 0 as an equal size, not as a broadcast."""
    a = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.slice(x, [5, 2], [5, fd.ops.size(x, 1)], [1, 2])
        fd.add_output(fd.ops.sub(s, fd.ops.full([0, 2], -0.75, DataType.Float)))
    (got,) = fd.execute([a])
    assert got.shape == (0, 2)


@pytest.mark.parametrize("shape", [(1, 1, 1, 3), (2, 6, 2, 5)])
def test_a_slice_ending_at_zero_is_empty_not_a_broadcast(shape: tuple) -> None:
    """``t[:, :1, :0]`` of a slice: an axis whose size is ``min(n, 0)`` is always empty, so it
    meets the other operand's axis as an equal size (it was taken for a possible broadcast
    and refused at run time: "sizes 0 and 1 must be equal")."""
    a = np.random.default_rng(5).uniform(-1, 1, shape).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1, -1, -1])
        t3 = fd.ops.slice(t0, [0, 0, 2, 0], [None, fd.ops.size(t0, 1), None, 2], [1, 5, 1, 1])
        t6 = fd.ops.slice(t3, [0, 0, 0, 0], [None, 1, 0, 4])
        fd.add_output(fd.ops.add(t6, t3))
    t3n = a[:, ::5, 2:, :2]
    want = t3n[:, :1, :0, :4] + t3n
    (got,) = fd.execute([a])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_pad_past_64_bits_is_refused_by_name() -> None:
    """Pad widths whose sum overflows int64 are reported as such, not as a wrapped,
    negative size."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.pad(x, [2**62, 2**62, 0, 0]))
    with pytest.raises(KilnError, match=r"T1 axis 1: its size .* has no 64-bit value for these inputs"):
        fd.execute([np.ones((2, 3), np.float32)])
