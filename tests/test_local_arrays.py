"""Automatic schedules keep per-thread (Local) arrays small: a tensor that several
reductions read is computed per reader, not held for a thread's whole share of a long row
or column (which took local memory and minutes of NVRTC). Checked on the generated CUDA of
fusions from normalizations and statistics over long rows and columns, plus their values
against NumPy float64 at small sizes."""

from __future__ import annotations

import re
from typing import Callable, List, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, Tensor

# Vector width x unrolled steps x a row held in registers: far below a streamed share.
MAX_LOCAL_ELEMENTS = 256

Build = Callable[[FusionDefinition, Tensor], List[Tensor]]


def _bn1d_stats(fd: FusionDefinition, x: Tensor) -> List[Tensor]:
    # BatchNorm1d training statistics as E[x^2] - E[x]^2 over the batch (axis 0).
    n = fd.ops.size(x, 0)
    e = fd.ops.mul(x, 3.0)
    m = fd.ops.div(fd.ops.sum(e, dims=[0]), n)
    var = fd.ops.sub(fd.ops.div(fd.ops.sum(fd.ops.mul(e, e), dims=[0]), n), fd.ops.mul(m, m))
    return [m, var]


def _var_mean(axis: int, dtype: DataType) -> Build:
    def build(fd: FusionDefinition, x: Tensor) -> List[Tensor]:
        if dtype != DataType.Float:
            x = fd.ops.cast(x, dtype)
        v, m = fd.ops.var_mean(x, [axis], correction=1)
        return [v, m]
    return build


def _shared_exp_columns(fd: FusionDefinition, x: Tensor) -> List[Tensor]:
    e = fd.ops.exp(fd.ops.mul(x, 0.1))
    s1, s2 = fd.ops.sum(e, dims=[0]), fd.ops.sum(fd.ops.mul(e, e), dims=[0])
    return [fd.ops.div(s2, fd.ops.add(fd.ops.mul(s1, s1), 1.0))]


def _centered_columns(fd: FusionDefinition, x: Tensor) -> List[Tensor]:
    first = fd.ops.broadcast(fd.ops.select(x, 0, 0), [True, False])
    d = fd.ops.sub(x, first)
    s1, s2 = fd.ops.sum(d, dims=[0]), fd.ops.sum(fd.ops.mul(d, d), dims=[0])
    return [fd.ops.sub(s2, fd.ops.mul(s1, s1)), fd.ops.mul(fd.ops.sum(x, dims=[0]), 2.0)]


def _ref(name: str, a: np.ndarray) -> List[np.ndarray]:
    x = a.astype(np.float64)
    if name == "bn1d_stats":
        e = 3 * x
        return [e.mean(0), (e * e).mean(0) - e.mean(0) ** 2]
    if name.startswith("var_mean"):
        axis = int(name.split("_")[2])
        return [x.var(axis, ddof=1), x.mean(axis)]
    if name == "shared_exp_columns":
        e = np.exp(0.1 * x)
        return [(e * e).sum(0) / (e.sum(0) ** 2 + 1)]
    d = x - x[0:1]
    return [(d * d).sum(0) - d.sum(0) ** 2, 2 * x.sum(0)]


CASES: List[Tuple[str, Build]] = [
    ("bn1d_stats", _bn1d_stats),
    ("var_mean_0_float", _var_mean(0, DataType.Float)),
    ("var_mean_1_float", _var_mean(1, DataType.Float)),
    ("var_mean_0_double", _var_mean(0, DataType.Double)),
    ("var_mean_1_double", _var_mean(1, DataType.Double)),
    ("shared_exp_columns", _shared_exp_columns),
    ("centered_columns", _centered_columns),
]


def _fusion(build: Build) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        for o in build(fd, x):
            fd.add_output(o)
    return fd


def _largest_local_array(fd: FusionDefinition, a: np.ndarray) -> int:
    low = fd.lower([a])
    sizes = [int(n) for k in low.kernels for n in re.findall(r"\bT\d+\[(\d+)\];", k.cuda_source_for(False))]
    return max(sizes, default=0)


@pytest.mark.parametrize("shape", [(33000, 64), (64, 33000), (4096, 3)])
@pytest.mark.parametrize(("name", "build"), CASES, ids=[c[0] for c in CASES])
def test_long_reductions_keep_local_arrays_small(name: str, build: Build, shape: Tuple[int, int]) -> None:
    fd = _fusion(build)
    assert _largest_local_array(fd, np.zeros(shape, np.float32)) <= MAX_LOCAL_ELEMENTS


@pytest.mark.parametrize("shape", [(2000, 5), (7, 1), (5, 2000)])
@pytest.mark.parametrize(("name", "build"), CASES, ids=[c[0] for c in CASES])
def test_the_same_fusions_match_numpy(name: str, build: Build, shape: Tuple[int, int]) -> None:
    a = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    outs = _fusion(build).execute([a])
    for got, want in zip(outs, _ref(name, a)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
