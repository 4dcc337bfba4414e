"""Row fusions over inputs with static size-one axes that every tensor keeps size one (a batch
of one, ``define_tensor([1, S, H])``): the row schedules cache and vectorize such an input like a
full-size one (one wide load per element group, not element loads per reader), and an input
broadcast along a size-one axis that other tensors run is still read in place. Checked against
NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

import re
from typing import Callable, List

import numpy as np
import pytest
from kiln import FusionDefinition


def _layernorm(fd: FusionDefinition, x, n: int):  # noqa: ANN001 - definition handles
    last = len(fd_shape(x)) - 1
    mean = fd.ops.mul(fd.ops.sum(x, dims=[last], keepdim=True), 1.0 / n)
    d = fd.ops.sub(x, mean)
    var = fd.ops.mul(fd.ops.sum(fd.ops.mul(d, d), dims=[last], keepdim=True), 1.0 / n)
    return fd.ops.mul(d, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))


def fd_shape(t) -> List[int]:  # noqa: ANN001
    return list(t.shape)


def _np_layernorm(x: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5)


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softmax(fd: FusionDefinition, x, n: int):  # noqa: ANN001
    last = len(fd_shape(x)) - 1
    m = fd.ops.max(x, dims=[last], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(x, m))
    return fd.ops.div(e, fd.ops.sum(e, dims=[last], keepdim=True))


CASES = [
    ([1, 64, 768], _layernorm, _np_layernorm),
    ([1, 33, 1000], _softmax, _np_softmax),
    ([4, 1, 256], _layernorm, _np_layernorm),
    ([1, 1, 2048], _softmax, _np_softmax),
    ([1, 8, 1, 4096], _layernorm, _np_layernorm),
]


@pytest.mark.parametrize("shape,build,ref", CASES)
def test_kept_size_one_axes_are_cached_and_match_numpy(shape: List[int], build: Callable,
                                                       ref: Callable) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        fd.add_output(build(fd, x, shape[-1]))
    xs = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape).astype(np.float32)
    low = fd.lower([xs])
    assert len(low.kernels) == 1, low.program.segmentation()
    ir = low.kernels[0].kernel_ir
    # x (T0) is read once, by a wide copy into a register cache.
    reads = re.findall(r"(VECTOR x\d+ )?T\d+ = [a-z_]+\([^)]*\bT0\b", ir)
    assert reads and all(v for v in reads), ir
    out = fd.execute([xs])[0]
    np.testing.assert_allclose(out, ref(xs.astype(np.float64)), rtol=1e-5, atol=1e-5)


def test_an_input_broadcast_along_a_size_one_axis_is_read_in_place() -> None:
    # w [1, C, 1] scales x [N, C, H] after a normalization over H: w's size-one axes are run
    # by x, so w is not a full-size input (and the result is still right).
    n, c, h = 3, 5, 256
    with FusionDefinition() as fd:
        x = fd.define_tensor([n, c, h])
        w = fd.define_tensor([1, c, 1])
        y = _layernorm(fd, x, h)
        fd.add_output(fd.ops.mul(y, w))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, c, h)).astype(np.float32)
    ws = rng.standard_normal((1, c, 1)).astype(np.float32)
    out = fd.execute([xs, ws])[0]
    np.testing.assert_allclose(out, _np_layernorm(xs.astype(np.float64)) * ws, rtol=1e-5, atol=1e-5)


def test_a_reduction_over_a_size_one_axis_of_a_segment_input_runs() -> None:
    # max over [1, 1, 8, 42] along a size-one axis and a real one, added back: the reduced
    # size-one axis is not one that every tensor keeps, so the reduction's input is read in
    # place (caching it as full-size made the schedule unplaceable).
    a0 = np.random.default_rng(43368).uniform(-1, 1, (8, 42)).astype(np.float32)
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1])
        t1 = fd.ops.broadcast_in_dim(t0, shape=[-1, -1, -1, -1], broadcast_dims=[2, 3])
        t4 = fd.ops.max(t1, dims=[1, 3], keepdim=True)
        t5 = fd.ops.broadcast_in_dim(t4, shape=[-1, -1, -1, -1], broadcast_dims=[0, 1, 2, 3])
        fd.add_output(fd.ops.add(t1, t5))
    out = fd.execute([a0])[0]
    want = a0[None, None] + a0.max(axis=1)[None, None, :, None]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
