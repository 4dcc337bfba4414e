"""Fusions with row and column reductions of one element-wise prologue (LayerNorm's and
BatchNorm's backward, a bias gradient beside a row statistic) run as one kernel per class
of reductions, each computing the prologue from the inputs: no kernel writes the prologue to
Global memory for another to read back. Independent sums of the same axes are one
multi-output reduction split across blocks. Results are checked against NumPy in float64.
"""

from __future__ import annotations

import re
from typing import Any, Callable, List

import numpy as np
import pytest
from kiln import FusionDefinition

Build = Callable[[], FusionDefinition]


def _kernel_outputs(fd: FusionDefinition, inputs: List[Any]) -> List[List[str]]:
    text = str(fd.lower(inputs).host_program)
    return [re.findall(r"T\d+", m) for m in re.findall(r"outputs=\[([^\]]*)\]", text)]


def _ln_backward() -> FusionDefinition:
    """dx from row sums of ``g * xhat`` and ``g``; dw, db as column sums of ``dy * xhat``, dy."""
    with FusionDefinition() as fd:
        dy = fd.define_tensor([-1, -1])
        x = fd.define_tensor([-1, -1])
        mean = fd.define_tensor([-1])
        rstd = fd.define_tensor([-1])
        w = fd.define_tensor([-1])
        rb = fd.ops.broadcast_in_dim(rstd, [-1, -1], [0])
        xhat = fd.ops.mul(fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, [-1, -1], [0])), rb)
        g = fd.ops.mul(dy, fd.ops.broadcast_in_dim(w, [-1, -1], [1]))
        n = fd.ops.size(x, 1)
        c1 = fd.ops.div(fd.ops.sum(fd.ops.mul(g, xhat), dims=[1]), n)
        c2 = fd.ops.div(fd.ops.sum(g, dims=[1]), n)
        inner = fd.ops.add(fd.ops.mul(xhat, fd.ops.broadcast_in_dim(c1, [-1, -1], [0])),
                           fd.ops.broadcast_in_dim(c2, [-1, -1], [0]))
        fd.add_output(fd.ops.mul(fd.ops.sub(g, inner), rb))
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, xhat), dims=[0]))
        fd.add_output(fd.ops.sum(dy, dims=[0]))
    return fd


def _ln_backward_inputs(m: int, n: int) -> List[np.ndarray]:
    rng = np.random.default_rng(m * 7 + n)
    x = rng.standard_normal((m, n)).astype(np.float32)
    mean = x.mean(axis=1).astype(np.float32)
    rstd = (1.0 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32)
    return [rng.standard_normal((m, n)).astype(np.float32), x, mean, rstd,
            rng.standard_normal(n).astype(np.float32)]


def _ln_backward_ref(dy: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                     w: np.ndarray) -> List[np.ndarray]:
    dy, x, mean, rstd, w = (a.astype(np.float64) for a in (dy, x, mean, rstd, w))
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * w
    dx = rstd[:, None] * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return [dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)]


def _row_and_column_sums() -> FusionDefinition:
    """``e = exp(a - b)``: its row sums and its column sums, and ``e`` is not an output."""
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        e = fd.ops.exp(fd.ops.sub(a, b))
        fd.add_output(fd.ops.sum(e, dims=[1]))
        fd.add_output(fd.ops.sum(e, dims=[0]))
    return fd


@pytest.mark.parametrize("m, n", [(3, 5), (64, 257), (1031, 33), (17, 4099)])
def test_layernorm_backward_recomputes_xhat_per_kernel(m: int, n: int) -> None:
    fd = _ln_backward()
    ins = _ln_backward_inputs(m, n)
    outs = fd.execute(ins)
    for got, want in zip(outs, _ln_backward_ref(*ins)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4 * np.sqrt(m))
    kernels = _kernel_outputs(fd, ins)
    # Every kernel writes fusion outputs only: xhat is computed where it is read.
    assert len(kernels) <= 2 and sum(len(k) for k in kernels) == 3, kernels


@pytest.mark.parametrize("m, n", [(5, 7), (300, 129), (33, 2049)])
def test_row_and_column_sums_of_one_prologue(m: int, n: int) -> None:
    fd = _row_and_column_sums()
    rng = np.random.default_rng(n)
    a, b = (rng.standard_normal((m, n)).astype(np.float32) for _ in range(2))
    rows, cols = fd.execute([a, b])
    e = np.exp(a.astype(np.float64) - b)
    np.testing.assert_allclose(rows, e.sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(cols, e.sum(axis=0), rtol=1e-5)
    kernels = _kernel_outputs(fd, [a, b])
    assert sum(len(k) for k in kernels) == 2, kernels


def test_independent_column_sums_are_one_split_reduction() -> None:
    """dw and db of a linear layer's bias path: two sums of the same axes, neither reading
    the other, are one outer reduction (split across blocks), not a normalization."""
    with FusionDefinition() as fd:
        dy = fd.define_tensor([-1, -1])
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(fd.ops.mul(dy, x), dims=[0]))
        fd.add_output(fd.ops.sum(dy, dims=[0]))
    rng = np.random.default_rng(0)
    dy, x = (rng.standard_normal((4096, 96)).astype(np.float32) for _ in range(2))
    auto = fd._core.auto_program([list(dy.shape), list(x.shape)])
    assert auto.heuristic == "outer_reduction" and len(auto.program.kernels()) == 1
    dw, db = fd.execute([dy, x])
    np.testing.assert_allclose(dw, (dy.astype(np.float64) * x).sum(axis=0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(db, dy.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("shape", [(6, 40), (3, 1), (37, 129)])
def test_a_row_mean_and_a_row_max_as_outputs_are_one_kernel(shape) -> None:
    """Pooling heads return ``mean(x, 1)`` and ``max(x, 1)``: the max, an output nothing else
    reads, is stored where it completes instead of failing the schedule (two kernels)."""
    from kiln.execute import lowered_for

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mean(x, dims=[1]))
        fd.add_output(fd.ops.max(x, dims=[1]))
    x_ = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32)
    mean, mx = fd.execute([x_])
    np.testing.assert_allclose(mean, x_.astype(np.float64).mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(mx, x_.max(1))
    assert len(lowered_for(fd, [x_]).kernels) == 1


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("shape", [(8, 77), (1, 5), (33, 1000)])
def test_a_masked_mean_sums_the_mask_in_its_own_loops(divide: bool, shape) -> None:
    """``(loss * mask).sum() / mask.sum()``, every masked token loss: ``cast(mask)`` leads to
    both totals, so each total's loop nest computes its own copy (one kernel; shared, it was
    held whole per thread between the nests, or the division failed the schedule and two
    kernels wrote full-size intermediates)."""
    from kiln import DataType
    from kiln.execute import lowered_for

    with FusionDefinition() as fd:
        loss = fd.define_tensor([-1, -1])
        m = fd.ops.cast(fd.define_tensor([-1, -1], DataType.Bool), DataType.Float)
        num, den = fd.ops.sum(fd.ops.mul(loss, m), dims=[0, 1]), fd.ops.sum(m, dims=[0, 1])
        if divide:
            fd.add_output(fd.ops.div(num, den))
        else:
            fd.add_output(num)
            fd.add_output(den)
    rng = np.random.default_rng(sum(shape))
    loss_ = rng.standard_normal(shape).astype(np.float32)
    mask_ = rng.random(shape) < 0.7
    mask_.flat[0] = True
    got = fd.execute([loss_, mask_])
    ld, md = loss_.astype(np.float64), mask_.astype(np.float64)
    want = [(ld * md).sum() / md.sum()] if divide else [(ld * md).sum(), md.sum()]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    low = lowered_for(fd, [loss_, mask_])
    assert len(low.kernels) == 1
    # No Local array holds more than one step's vectors (the shared cast held [16, 4, 4]).
    big = fd._core.auto_program([[16384, 4096], [16384, 4096]]).program.kernels()[0]
    ir = big.kernel_ir() if callable(big.kernel_ir) else big.kernel_ir
    assert not re.search(r"ALLOCATE T\d+ Local \w+ \[\d+, \d+, \d+\]", ir), ir
