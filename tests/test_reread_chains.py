"""Chains that read each value more than once (an explicit Euler step
``x = x + h * (tanh(x) - x)``, Newton refinement of rsqrt, a Fibonacci-like pair, stacked
tanh-GELUs) ending in a pointwise output, a row sum, a column sum, a softmax or a LayerNorm:
the automatic path must lower them in time and code linear in their length (a DAG walked as a
tree, or a copy of every value per reader, grows 2^k or 3^k), and match float64 NumPy.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def euler(fd: Any, x: Any, k: int) -> Any:
    for _ in range(k):
        x = fd.ops.add(x, fd.ops.mul(fd.ops.sub(fd.ops.tanh(x), x), 0.1))
    return x


def newton(fd: Any, x: Any, k: int) -> Any:
    a = fd.ops.add(fd.ops.abs(x), 1.0)
    y = fd.ops.rsqrt(a)
    for _ in range(k):
        y = fd.ops.mul(y, fd.ops.sub(1.5, fd.ops.mul(fd.ops.mul(fd.ops.mul(a, 0.5), y), y)))
    return y


def pair(fd: Any, x: Any, k: int) -> Any:
    a, b = x, fd.ops.mul(x, 0.5)
    for _ in range(k):
        a, b = fd.ops.add(a, b), fd.ops.mul(fd.ops.tanh(a), b)
    return fd.ops.add(a, b)


def gelus(fd: Any, x: Any, k: int) -> Any:
    for _ in range(k):
        inner = fd.ops.add(x, fd.ops.mul(0.044715, fd.ops.mul(x, fd.ops.mul(x, x))))
        x = fd.ops.mul(fd.ops.mul(x, 0.5), fd.ops.add(1.0, fd.ops.tanh(fd.ops.mul(0.7978845608, inner))))
    return x


def euler_np(x: np.ndarray, k: int) -> np.ndarray:
    for _ in range(k):
        x = x + 0.1 * (np.tanh(x) - x)
    return x


def newton_np(x: np.ndarray, k: int) -> np.ndarray:
    a = np.abs(x) + 1.0
    y = 1 / np.sqrt(a)
    for _ in range(k):
        y = y * (1.5 - a * 0.5 * y * y)
    return y


def pair_np(x: np.ndarray, k: int) -> np.ndarray:
    a, b = x, x * 0.5
    for _ in range(k):
        a, b = a + b, np.tanh(a) * b
    return a + b


def gelus_np(x: np.ndarray, k: int) -> np.ndarray:
    for _ in range(k):
        x = x * 0.5 * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))
    return x


CHAINS: Dict[str, Tuple[Callable, Callable]] = {
    "euler": (euler, euler_np), "newton": (newton, newton_np),
    "pair": (pair, pair_np), "gelus": (gelus, gelus_np),
}


def _end(fd: Any, y: Any, kind: str) -> Any:
    if kind == "pointwise":
        return y
    if kind == "rowsum":
        return fd.ops.sum(y, dims=[1])
    if kind == "colsum":
        return fd.ops.sum(y, dims=[0])
    if kind == "softmax":
        e = fd.ops.exp(fd.ops.sub(y, fd.ops.max(y, dims=[1], keepdim=True)))
        return fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True))
    mean = fd.ops.mean(y, dims=[1], keepdim=True)
    return fd.ops.mul(fd.ops.sub(y, mean), fd.ops.rsqrt(fd.ops.add(fd.ops.var(y, dims=[1], keepdim=True,
                                                                              correction=0), 1e-5)))


def _end_np(y: np.ndarray, kind: str) -> np.ndarray:
    if kind == "pointwise":
        return y
    if kind == "rowsum":
        return y.sum(1)
    if kind == "colsum":
        return y.sum(0)
    if kind == "softmax":
        e = np.exp(y - y.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)
    return (y - y.mean(1, keepdims=True)) / np.sqrt(y.var(1, keepdims=True) + 1e-5)


def _build(chain: str, end: str, k: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(_end(fd, CHAINS[chain][0](fd, x, k), end))
    return fd


ENDS = ["pointwise", "rowsum", "colsum", "softmax", "layernorm"]
X = np.random.default_rng(0).standard_normal((48, 1000)).astype(np.float32)


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_rereading_chains_lower_linearly_and_match_numpy(chain: str, end: str) -> None:
    sizes = []
    for k in (8, 16, 24):
        fd = _build(chain, end, k)
        t0 = time.perf_counter()
        low = fd.lower([X])
        elapsed = time.perf_counter() - t0
        # Generous for a slow machine; a tree walk of 24 steps takes hours.
        assert elapsed < 20, f"{chain}/{end}: lowering {k} steps took {elapsed:.1f} s"
        sizes.append(sum(len(kk.cuda_source_for(False)) for kk in low.kernels))
    # Linear growth: the second 8 steps add about what the first did.
    assert sizes[2] - sizes[1] <= 2 * (sizes[1] - sizes[0]) + 2000, (chain, end, sizes)
    fd = _build(chain, end, 6)
    got = np.asarray(fd.execute([X])[0], np.float64)
    want = _end_np(CHAINS[chain][1](X.astype(np.float64), 6), end)
    n = X.shape[0 if end == "colsum" else 1]
    scale = 1.0 if end in ("pointwise", "softmax", "layernorm") else np.sqrt(n)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * scale)
