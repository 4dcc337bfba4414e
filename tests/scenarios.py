"""The allocation issue's scenarios a)–h) as runnable fusions with NumPy float64 references.

Each builder returns a Scenario: a scheduled FusionDefinition, a function making its inputs
with a given array module (NumPy or CuPy), and the reference. Shapes are chosen so every
Local allocation has a constant size (a requirement of CUDA codegen); several are not
multiples of the split factors, so predicates are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List

import numpy as np
from kiln import DataType, FusionDefinition, MemoryType, ParallelType


@dataclass
class Scenario:
    name: str
    fd: FusionDefinition
    make_inputs: Callable[[Any], List[Any]]
    reference: Callable[[List[np.ndarray]], List[np.ndarray]]


def _rand(xp: Any, *shape: int, seed: int = 0) -> Any:
    a = np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)
    return xp.asarray(a)


def a_pointwise() -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        b = fd.ops.mul(a, 2.0)
        c = fd.ops.sub(b, 1.5)
        fd.add_output(c)
    for t in (a, b, c):
        t.merge(0)
        t.split(0, 128)
        t.split(1, 4)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(2)
    b.inline_at(-1)
    return Scenario("a_pointwise", fd, lambda xp: [_rand(xp, 37, 129)],
                    lambda i: [np.exp(i[0].astype(np.float64)) * 2.0 - 1.5])


def _cache(mem: MemoryType) -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 300])
        y = fd.ops.sigmoid(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(mem)
    for t in (c, y):
        t.split(1, 128)
        t.reorder({2: 1})
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    return Scenario(f"b_cache_{mem.value}", fd, lambda xp: [_rand(xp, 3, 300)],
                    lambda i: [1 / (1 + np.exp(-i[0].astype(np.float64)))])


def b_shared() -> Scenario:
    return _cache(MemoryType.Shared)


def b_local() -> Scenario:
    return _cache(MemoryType.Local)


def c_inlined_unroll(symbolic: bool = False) -> Scenario:
    """``symbolic``: sizes are run-time extents instead of the constants 6 and 5."""
    with FusionDefinition() as fd:
        x0 = fd.define_tensor([-1] if symbolic else [6])
        x1 = fd.define_tensor([-1, -1] if symbolic else [6, 5])
        t2 = fd.ops.exp(x0)
        t3 = fd.ops.broadcast_in_dim(t2, shape=[-1, -1], broadcast_dims=[0])
        t4 = fd.ops.add(t3, x1)
        fd.add_output(t4)
    for t in (t3, t4):
        t.merge(0)
        t.split(0, 4, inner_split=False)
        t.axis(0).parallelize(ParallelType.Unroll)
    t2.split(0, 4, inner_split=False)
    t2.inline_at(2)
    t3.inline_at(2)
    return Scenario("c_inlined_unroll", fd, lambda xp: [_rand(xp, 6), _rand(xp, 6, 5, seed=1)],
                    lambda i: [np.exp(i[0].astype(np.float64))[:, None] + i[1]])


def d_non_contiguous() -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, False])
        y = fd.ops.neg(x)
        fd.add_output(y)
    for t in (y,):
        t.split(1, 32)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)

    def inputs(xp: Any) -> List[Any]:
        # Stride 3 along the last axis; rows stay packed (row stride 102 = 3 * 34), as
        # contiguity [True, False] says.
        return [_rand(xp, 9, 102)[:, ::3]]

    return Scenario("d_non_contiguous", fd, inputs, lambda i: [-i[0].astype(np.float64)])


def e_nhwc() -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 8, 3, 5])
        y = fd.ops.relu(x)
        fd.add_output(y)
    y.set_allocation_domain([0, 2, 3, 1], [True, True, True, True])
    c = y.cache_before()
    y.reorder({1: 3})
    y.split(3, 4)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(4).parallelize(ParallelType.Vectorize)
    c.split(1, 4)
    c.reorder({2: 4})
    c.axis(0).parallelize(ParallelType.BIDx)
    c.axis(4).parallelize(ParallelType.Vectorize)
    c.inline_at(1)
    return Scenario("e_nhwc", fd, lambda xp: [_rand(xp, 2, 8, 3, 5)],
                    lambda i: [np.maximum(i[0].astype(np.float64), 0)])


def f_transpose(m: int = 64, n: int = 96) -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        t = fd.ops.permute(x, [1, 0])
        fd.add_output(t)
    s = t.cache_before()
    s.set_memory_type(MemoryType.Shared)
    t.split(0, 32)
    t.split(2, 32)
    t.reorder({1: 2})
    t.merge(2, 3)
    t.split(2, 4)
    t.axis(0).parallelize(ParallelType.BIDy)
    t.axis(1).parallelize(ParallelType.BIDx)
    t.axis(2).parallelize(ParallelType.TIDx)
    t.axis(3).parallelize(ParallelType.Vectorize)
    s.split(0, 32)
    s.split(2, 32)
    s.reorder({1: 3, 3: 2})
    s.merge(2, 3)
    s.split(2, 4)
    s.axis(0).parallelize(ParallelType.BIDy)
    s.axis(1).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.TIDx)
    s.inline_at(2)
    return Scenario(f"f_transpose_{m}x{n}", fd, lambda xp: [_rand(xp, m, n)],
                    lambda i: [i[0].T.astype(np.float64)])


def g_index_select() -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([10, -1])
        idx = fd.define_tensor([-1], dtype=DataType.Int)
        t1 = fd.ops.exp(x)
        t2 = fd.ops.index_select(t1, idx, 0)
        fd.add_output(t2)
    t1.reorder({0: 1})
    t1.split(1, 4)
    t2.reorder({0: 1})
    t2.axis(0).parallelize(ParallelType.BIDx)
    t1.inline_at(1)

    def inputs(xp: Any) -> List[Any]:
        return [_rand(xp, 10, 7), xp.asarray(np.array([3, 0, 9, 3, 5], dtype=np.int64))]

    return Scenario("g_index_select", fd, inputs, lambda i: [np.exp(i[0].astype(np.float64))[i[1]]])


def h_block_row_sum() -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    s.split(1, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(2).parallelize(ParallelType.TIDx)
    acc = s.cache_before()
    s.axis(0).parallelize(ParallelType.BIDx)
    acc.inline_at(1)
    return Scenario("h_block_row_sum", fd, lambda xp: [_rand(xp, 7, 1000)],
                    lambda i: [i[0].astype(np.float64).sum(axis=1)])


def _column_sum(serial: bool) -> Scenario:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(s)
    s.split(0, 4)
    s.split(2, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(1).parallelize(ParallelType.TIDy)
    s.axis(2).parallelize(ParallelType.BIDy)
    s.axis(3).parallelize(ParallelType.TIDx)
    if serial:
        s.set_serial_grid_reduction()
    return Scenario(f"h_grid_column_sum{'_serial' if serial else ''}", fd, lambda xp: [_rand(xp, 61, 300)],
                    lambda i: [i[0].astype(np.float64).sum(axis=0)])


def h_grid_column_sum_hoisted() -> Scenario:
    """Column sum across blocks with a serial reduction loop inside each block (hoisted)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[0])
        fd.add_output(s)
    s.split(0, 16)  # [r ceilDiv(i0, 16), r 16, i1]
    s.split(1, 4)  # [.., r 4 (TIDy), r 4 (serial), i1]
    s.split(3, 128)
    s.axis(0).parallelize(ParallelType.BIDx)
    s.axis(1).parallelize(ParallelType.TIDy)
    s.axis(3).parallelize(ParallelType.BIDy)
    s.axis(4).parallelize(ParallelType.TIDx)
    return Scenario("h_grid_column_sum_hoisted", fd, lambda xp: [_rand(xp, 250, 300)],
                    lambda i: [i[0].astype(np.float64).sum(axis=0)])


def h_row_sum_partial_hoist() -> Scenario:
    """Row sums whose outermost reduction loop encloses the row loop: the block reduction,
    hoisted out of the inner serial loop, yields a partial sum per outer step that the
    output accumulates (so its write must add to the running value, not overwrite it)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    s.split(1, 64)  # [i0, r ceilDiv(i1, 64), r 64]
    s.split(1, 2)  # [i0, r ceilDiv(i1, 128), r 2, r 64]
    s.reorder({1: 0})  # [r ceilDiv(i1, 128), i0 (serial), r 2 (serial), r 64]
    s.axis(3).parallelize(ParallelType.TIDx)
    return Scenario("h_row_sum_partial_hoist", fd, lambda xp: [_rand(xp, 5, 300)],
                    lambda i: [i[0].astype(np.float64).sum(axis=1)])


def h_grid_column_sum() -> Scenario:
    return _column_sum(False)


def h_serial_grid_column_sum() -> Scenario:
    return _column_sum(True)


def v_vectorized(m: int = 64, n: int = 256) -> Scenario:
    """Pointwise chain with 16-byte vectorized load and store (nvFuser's pointwise schedule)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(fd.ops.relu(fd.ops.add(fd.ops.mul(x, 1.5), 0.5)), fd.ops.sigmoid(x))
        fd.add_output(y)
    xc = x.cache_after()
    yc = y.cache_before()
    from kiln.fusion import Tensor

    every = [Tensor(fd, i) for i in range(fd._core.num_tensors) if i != x._id]
    for t in every:
        t.merge(0)
        t.split(0, 4)
        t.split(0, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    xc.axis(2).parallelize(ParallelType.Vectorize)
    y.axis(2).parallelize(ParallelType.Vectorize)
    for t in every:
        if t._id != y._id:
            t.inline_at(-1)
    _ = yc

    def ref(i: List[np.ndarray]) -> List[np.ndarray]:
        a = i[0].astype(np.float64)
        return [np.maximum(a * 1.5 + 0.5, 0) * (1 / (1 + np.exp(-a)))]

    return Scenario(f"v_vectorized_{m}x{n}", fd, lambda xp: [_rand(xp, m, n)], ref)


def i_partial_broadcast() -> Scenario:
    """RoPE's operand shape: t [S, D] broadcast over x [B, S, D], every tensor [B*S/2 (BIDx), 2,
    D/4 (TIDx), 4]; t's broadcast copy is inlined at 3 and keeps its own vector loop while the
    loops it shares run the concretized B*S space (indexed through its consumer)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        t = fd.define_tensor([-1, -1])
        tb = fd.ops.broadcast_in_dim(t, shape=[-1, -1, -1], broadcast_dims=[1, 2])
        o = fd.ops.mul(x, tb)
        fd.add_output(o)
    for v in (tb, o):
        v.merge(0)
        v.split(0, 2)
        v.split(2, 4)
        v.axis(0).parallelize(ParallelType.BIDx)
        v.axis(2).parallelize(ParallelType.TIDx)
    tb.inline_at(3)
    tb.axis(3).parallelize(ParallelType.Vectorize)
    return Scenario("i_partial_broadcast", fd, lambda xp: [_rand(xp, 3, 5, 12), _rand(xp, 5, 12, seed=1)],
                    lambda i: [i[0].astype(np.float64) * i[1][None]])


ALL = [a_pointwise, b_shared, b_local, c_inlined_unroll, d_non_contiguous, e_nhwc, f_transpose,
       lambda: f_transpose(50, 70), g_index_select, h_block_row_sum, h_grid_column_sum,
       h_serial_grid_column_sum, h_grid_column_sum_hoisted, h_row_sum_partial_hoist, v_vectorized,
       lambda: v_vectorized(37, 129), i_partial_broadcast]


def empty_axis_row_sum() -> FusionDefinition:
    """``sum(x, 1) + 1`` with the reduced axis on TIDx and the rows on BIDx, for inputs whose
    reduced axis may have no elements (not in ``ALL``: built for sizes given at run time)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        o = fd.ops.add(s, 1.0)
        fd.add_output(o)
    s.axis(1).parallelize(ParallelType.TIDx)
    s.axis(0).parallelize(ParallelType.BIDx)
    o.axis(0).parallelize(ParallelType.BIDx)
    s.inline_at(1)
    return fd


def empty_axis_column_sum() -> FusionDefinition:
    """``sum(x, 0) + 1`` with the reduced rows on BIDx (a grid reduction into Global) and the
    columns on TIDx, for inputs that may have no rows."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        c = fd.ops.sum(x, dims=[0])
        p = fd.ops.add(c, 1.0)
        fd.add_output(p)
    c.set_memory_type(MemoryType.Global)
    c.axis(0).parallelize(ParallelType.BIDx)
    c.axis(1).parallelize(ParallelType.TIDx)
    p.axis(0).parallelize(ParallelType.TIDx)
    return fd
