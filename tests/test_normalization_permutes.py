"""Normalizations (softmax, LayerNorm, RMSNorm) with a permute of their row axes: the input
read through a permute (Megatron's ``[S, B, H] -> [B, S, H]`` before a LayerNorm), the
normalized rows written permuted (Swin's ``window_partition`` after ``norm1``), or both, with
a second output in the logical order. A permute that keeps the reduced (last) axis in place
moves whole rows, so the normalization schedules run it in their one kernel, each row read
once. Random shapes (size-one axes, rows from 1 to 20000 elements), orders and sizes
(symbolic or static), against NumPy in float64."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

ROWS = [1, 3, 64, 100, 1000, 4096, 20000]


@st.composite
def programs(draw: Any) -> Dict[str, Any]:
    rank = draw(st.integers(2, 4))
    row = draw(st.sampled_from(ROWS))
    budget = max(1, 60000 // row)
    outer: List[int] = []
    for _ in range(rank - 1):
        outer.append(draw(st.integers(1, max(1, min(6, budget)))))
        budget = max(1, budget // outer[-1])
    perm = draw(st.permutations(list(range(rank - 1)))) + [rank - 1]
    return {
        "shape": outer + [row],
        "perm": perm,
        "kind": draw(st.sampled_from(["softmax", "layernorm", "rmsnorm"])),
        "where": draw(st.sampled_from(["input", "output", "both", "middle"])),
        "static": draw(st.booleans()),
        "second": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _normalize(fd: FusionDefinition, x: Any, w: Any, kind: str, n: int) -> Any:
    o = fd.ops

    def back(t: Any) -> Any:
        return o.broadcast(t, [False] * (n - 1) + [True])

    if kind == "softmax":
        e = o.exp(o.sub(x, back(o.max(x, [n - 1]))))
        return o.div(e, back(o.sum(e, [n - 1])))
    if kind == "layernorm":
        var, mean = o.var_mean(x, [n - 1], correction=0, keepdim=True)
        y = o.mul(o.sub(x, mean), o.rsqrt(o.add(var, 1e-5)))
    else:
        y = o.mul(x, o.rsqrt(o.add(o.mean(o.mul(x, x), [n - 1], keepdim=True), 1e-6)))
    return o.mul(y, o.broadcast(w, [True] * (n - 1) + [False]))


def _reference(x: np.ndarray, w: np.ndarray, kind: str) -> np.ndarray:
    if kind == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == "layernorm":
        y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    else:
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return y * w


def _inverse(perm: List[int]) -> List[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _build(p: Dict[str, Any]) -> tuple:
    shape, perm, kind, where = p["shape"], p["perm"], p["kind"], p["where"]
    n = len(shape)
    rng = np.random.default_rng(p["seed"])
    # The input is given in the order the fusion permutes it from.
    in_shape = [shape[a] for a in _inverse(perm)] if where in ("input", "both") else list(shape)
    a = (rng.standard_normal(in_shape) * 2).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    with FusionDefinition() as fd:
        o = fd.ops
        x = fd.define_tensor(in_shape if p["static"] else [-1] * n)
        wt = fd.define_tensor([shape[-1]] if p["static"] else [-1])
        xin = o.permute(x, perm) if where in ("input", "both") else x
        if where == "middle":
            # the exp (or the centred input) permuted, the statistics taken over the permuted rows
            xin = o.permute(o.mul(xin, 1.0), perm)
        y = _normalize(fd, xin, wt, kind, n)
        out = o.permute(y, perm) if where in ("output", "both") else y
        fd.add_output(out)
        if p["second"]:
            fd.add_output(o.mul(y, 2.0))
    xa = a.astype(np.float64)
    if where in ("input", "both"):
        xa = xa.transpose(perm)
    if where == "middle":
        xa = xa.transpose(perm)
    y = _reference(xa, w.astype(np.float64), kind)
    wants = [y.transpose(perm) if where in ("output", "both") else y]
    if p["second"]:
        wants.append(2 * y)
    return fd, [a, w], wants


@settings(max_examples=60, deadline=None)
@given(programs())
def test_normalizations_through_permutes_of_their_rows_match_numpy(p: Dict[str, Any]) -> None:
    fd, inputs, wants = _build(p)
    got = fd.execute(inputs)
    assert len(got) == len(wants)
    for g, want in zip(got, wants):
        assert g.shape == want.shape, p
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-5, err_msg=str(p))


@pytest.mark.parametrize("where", ["input", "output", "both"])
def test_a_permute_of_the_rows_stays_in_the_normalization_kernel(where: str) -> None:
    p = {"shape": [5, 7, 256], "perm": [1, 0, 2], "kind": "layernorm", "where": where, "static": False,
         "second": True, "seed": 3}
    fd, inputs, wants = _build(p)
    got = fd.execute(inputs)
    for g, want in zip(got, wants):
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-5)
    assert len(fd.lower(inputs).kernels) == 1
    assert "normalization" in fd._core.auto_program([list(a.shape) for a in inputs]).heuristic


def test_half_rows_permuted_after_a_layernorm() -> None:
    # Swin: norm1 on [B, H*W, C] in half, viewed [B, H, W, C] and written as windows
    B, H, W, C, ws = 2, 4, 6, 48, 2
    with FusionDefinition() as fd:
        o = fd.ops
        x = fd.define_tensor([-1, -1, -1], DataType.Half)
        var, mean = o.var_mean(o.cast(x, DataType.Float), [2], correction=0, keepdim=True)
        y = o.mul(o.sub(o.cast(x, DataType.Float), mean), o.rsqrt(o.add(var, 1e-5)))
        y = o.reshape(o.cast(y, DataType.Half), [B, H // ws, ws, W // ws, ws, C])
        fd.add_output(o.reshape(o.permute(y, [0, 1, 3, 2, 4, 5]), [-1, ws * ws, C]))
    a = np.random.default_rng(5).standard_normal((B, H * W, C)).astype(np.float16)
    (got,) = fd.execute([a])
    xa = a.astype(np.float64)
    y = (xa - xa.mean(-1, keepdims=True)) / np.sqrt(xa.var(-1, keepdims=True) + 1e-5)
    want = y.reshape(B, H // ws, ws, W // ws, ws, C).transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)
