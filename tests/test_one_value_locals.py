"""A Local value of one element read by consumers of different extents along one loop.

``m = max(x[:30])`` kept as ``[1]`` and read both by ``x[:30] + m`` (30 positions) and by
``x + m.expand(31)`` (31 positions) shares the thread loop of both: it is computed at every
position of that loop, not only where the consumer it is indexed through runs, so no reader
finds it unwritten (the interpreter reports any such read). Likewise a row sum of a ``[1, N]``
input in a loop of one iteration, read by every thread of a wider padded row. Each case
was found by a random-program fuzzer; results are checked against NumPy in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def _close(got: object, want: np.ndarray) -> None:
    g = np.asarray(got, np.float64)
    assert g.shape == want.shape
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_a_max_read_over_30_and_31_positions() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.define_tensor([-1, -1], dtype=DataType.Bool)  # an input nothing reads
        h = fd.ops.slice(x, [0], [30])
        m = fd.ops.max(h, [0], keepdim=True)
        t = fd.ops.add(h, m)
        fd.add_output(t)
        fd.add_output(fd.ops.sum(t, [0]))
        fd.add_output(fd.ops.add(x, fd.ops.expand(m, [31])))
    a = np.random.default_rng(0).normal(size=31).astype(np.float32)
    got = fd.execute([a, np.zeros((3, 4), bool)])
    a64 = a.astype(np.float64)
    mx = a64[:30].max()
    _close(got[0], a64[:30] + mx)
    _close(got[1], np.asarray((a64[:30] + mx).sum()))
    _close(got[2], a64 + mx)


def test_a_mean_read_by_a_quotient_and_a_wider_cat() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 1])
        s = fd.ops.sum(x, [0, 1])
        p = fd.ops.pad(s, [1, 1])
        b = fd.ops.broadcast_in_dim(fd.ops.sum(p, [0]), shape=[3], broadcast_dims=[])
        m = fd.ops.mean(b, 0, keepdim=True)
        d = fd.ops.div(b, fd.ops.broadcast_in_dim(m, shape=[-1], broadcast_dims=[0]))
        fd.add_output(fd.ops.sub(d, fd.ops.sum(d, [0])))
        fd.add_output(fd.ops.cat([m, p], 0))
    a = np.random.default_rng(1).uniform(0.5, 1.5, (5, 3, 1)).astype(np.float32)
    got = fd.execute([a])
    s = a.astype(np.float64).sum()
    p = np.array([0.0, s, 0.0])
    b = np.full(3, p.sum())
    m = b.mean(keepdims=True)
    d = b / m
    _close(got[0], d - d.sum())
    _close(got[1], np.concatenate([m, p]))


def test_a_row_sum_of_a_one_row_input_read_by_a_wider_padded_row() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, -1])
        one = fd.ops.broadcast_in_dim(fd.ops.iota(1, 1, 1, dtype=DataType.Int32), shape=[-1, -1],
                                      broadcast_dims=[1])
        y = fd.ops.add(x, one)
        z = fd.ops.add(y, fd.ops.broadcast_in_dim(fd.ops.sum(y, [-1]), shape=[-1, -1], broadcast_dims=[0]))
        p = fd.ops.pad(z, [1, 2, 2, 2], 1.5)
        fd.add_output(z)
        fd.add_output(fd.ops.mean(p, [0, 1], keepdim=True))
        fd.add_output(p)
    for n in (1, 5):
        a = np.random.default_rng(n).normal(size=(1, n)).astype(np.float32)
        got = fd.execute([a])
        y = a.astype(np.float64) + 1
        z = y + y.sum(-1, keepdims=True)
        p = np.pad(z, ((2, 2), (1, 2)), constant_values=1.5)
        _close(got[0], z)
        _close(got[1], p.mean(keepdims=True))
        _close(got[2], p)


def test_a_permute_then_a_new_axis_stored_in_any_order() -> None:
    """A broadcast adding an axis after a permute, the output stored in another order (the
    scheduler once indexed the output's order by the permute's rank and panicked)."""
    a = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32)
    for order in ([2, 1, 0], [0, 2, 1], [1, 2, 0]):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            y = fd.ops.broadcast_in_dim(fd.ops.permute(x, [1, 0]), shape=[-1, -1, -1], broadcast_dims=[0, 1])
            fd.add_output(fd.ops.exp(y), stride_order=order)
        (got,) = fd.execute([a])
        _close(got, np.exp(a.astype(np.float64)).T[:, :, None])


def test_a_no_op_cast_before_a_stepped_slice_and_a_normalization_lowers() -> None:
    """Widening a reduction over a size-one broadcast axis whose readers are not all moved to
    the widened copy once never ended (``fd.lower`` spun); each reduction is widened once."""
    a = np.random.default_rng(3).uniform(-2, 2, (3, 1, 37, 37)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.ops.cast(fd.define_tensor([-1, -1, -1, -1]), DataType.Float)
        s = fd.ops.slice(x, [1, 0, 2, 0], [8, None, 37, None], [2, 1, 2, 1])
        d = fd.ops.sub(s, fd.ops.broadcast_in_dim(fd.ops.sum(s, [0]), shape=[-1, -1, -1, -1],
                                                  broadcast_dims=[1, 2, 3]))
        fd.add_output(fd.ops.reshape(fd.ops.sum(d, [0], keepdim=True), [1, 1, -1, 37]))
    (got,) = fd.execute([a])
    s64 = a.astype(np.float64)[1:8:2, :, 2:37:2, :]
    d64 = s64 - s64.sum(0, keepdims=True)
    _close(got, d64.sum(0, keepdims=True).reshape(1, 1, -1, 37))


@pytest.mark.parametrize("n", [128, 512, 1024, 2048, 513])
@pytest.mark.parametrize("dt", ["float", "half"])
def test_a_one_block_nest_beside_a_wider_one_reads_in_bounds(n: int, dt: str) -> None:
    """``x - sum(x)`` (x of a static size that one block covers exactly) shares a kernel with
    ``cat([x, x])``, which runs twice the blocks: the narrower nest's single block iteration
    is a split of x's axis, not a size-one axis, so the extra blocks skip it instead of
    reading x past its end (the interpreter reported x read at index n)."""
    kdt, npdt = {"float": (DataType.Float, np.float32), "half": (DataType.Half, np.float16)}[dt]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=kdt)
        s = fd.ops.broadcast_in_dim(fd.ops.sum(x, dims=[0]), shape=[n], broadcast_dims=[])
        fd.add_output(fd.ops.cat([x, x], 0))
        fd.add_output(fd.ops.sub(x, s))
    a = np.random.default_rng(n).uniform(-1, 1, n).astype(npdt)
    cat, centred = fd.execute([a])
    ad = a.astype(np.float64)
    np.testing.assert_array_equal(cat, np.concatenate([a, a]))
    tol = 1e-5 if dt == "float" else 2e-2
    np.testing.assert_allclose(centred.astype(np.float64), ad - ad.sum(), rtol=tol,
                               atol=tol * max(1.0, abs(ad.sum())))
