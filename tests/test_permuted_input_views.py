"""Permutes of fusion inputs that keep the last axis last (or are read only under a new last
broadcast axis), read through the inputs' strides.

Where no scheduler covers the whole fusion with the permutes in it (a reduction or a
normalization of a permuted input, two permuted operands of one product), each permute of an
input that keeps the input's last axis last is read as a view of the input's buffer
(``Fusion::strided_views``): attention scores written as ``q.transpose(1, 2)`` times
``k.transpose(1, 2)`` broadcast and summed, a LayerNorm of Megatron's ``[S, B, H]`` seen as
``[B, S, H]``. Checked against NumPy in float64 on the CPU interpreter (and on the GPU with
``-m gpu``), for row-major and strided arrays."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition

Build = Callable[[FusionDefinition, List[Any]], List[Any]]
Ref = Callable[..., List[np.ndarray]]


def _bcast(fd: FusionDefinition, t: Any, rank: int, dims: Sequence[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, shape=[-1] * rank, broadcast_dims=list(dims))


def _fusion(ranks: Sequence[int], build: Build) -> FusionDefinition:
    with FusionDefinition() as fd:
        ts = [fd.define_tensor([-1] * r) for r in ranks]
        for o in build(fd, ts):
            fd.add_output(o)
    return fd


def _scores(fd: FusionDefinition, ts: List[Any]) -> List[Any]:
    # einsum("bshd,bthd->bhst") as a model writes it without a matmul.
    q = fd.ops.permute(ts[0], [0, 2, 1, 3])
    k = fd.ops.permute(ts[1], [0, 2, 1, 3])
    return [fd.ops.sum(fd.ops.mul(_bcast(fd, q, 5, [0, 1, 2, 4]), _bcast(fd, k, 5, [0, 1, 3, 4])), dims=[4])]


def _scores_np(q: np.ndarray, k: np.ndarray) -> List[np.ndarray]:
    return [np.einsum("bshd,bthd->bhst", q, k)]


def _layernorm(fd: FusionDefinition, ts: List[Any]) -> List[Any]:
    # Megatron keeps [S, B, H]; the norm runs on the [B, S, H] view.
    p = fd.ops.permute(ts[0], [1, 0, 2])
    mean = fd.ops.mul(fd.ops.sum(p, dims=[2]), 1.0 / 33)
    d = fd.ops.sub(p, _bcast(fd, mean, 3, [0, 1]))
    var = fd.ops.mul(fd.ops.sum(fd.ops.mul(d, d), dims=[2]), 1.0 / 33)
    inv = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
    return [fd.ops.add(fd.ops.mul(d, _bcast(fd, inv, 3, [0, 1])), _bcast(fd, ts[1], 3, [2]))]


def _layernorm_np(x: np.ndarray, b: np.ndarray) -> List[np.ndarray]:
    p = x.transpose(1, 0, 2)
    d = p - p.mean(2, keepdims=True)
    return [d / np.sqrt((d * d).mean(2, keepdims=True) + 1e-5) + b]


def _permuted_sum(fd: FusionDefinition, ts: List[Any]) -> List[Any]:
    # A permuted input added to another tensor, the result reduced over its rows and also
    # handed back: the sum and the element-wise output share one kernel.
    s = fd.ops.add(fd.ops.permute(ts[0], [0, 2, 1, 3]), ts[1])
    return [fd.ops.sum(s, dims=[3]), fd.ops.neg(s)]


def _permuted_sum_np(x: np.ndarray, y: np.ndarray) -> List[np.ndarray]:
    s = x.transpose(0, 2, 1, 3) + y
    return [s.sum(3), -s]


def _outer(fd: FusionDefinition, ts: List[Any]) -> List[Any]:
    # `x.T[..., None] * y`: the permute moves x's last axis, but each element it reads is
    # broadcast along a new last axis, so a strided read serves a whole row.
    xb = fd.ops.broadcast(fd.ops.permute(ts[0], [1, 0]), [False, False, True])
    return [fd.ops.mul(xb, ts[1])]


def _outer_np(x: np.ndarray, y: np.ndarray) -> List[np.ndarray]:
    return [x.T[..., None] * y]


def _normal(*shapes: Sequence[int]) -> Callable[[np.random.Generator], List[np.ndarray]]:
    return lambda r: [r.standard_normal(s) for s in shapes]


CASES = {
    "scores": ([4, 4], _scores, _scores_np, _normal((2, 7, 3, 16), (2, 5, 3, 16))),
    "layernorm": ([3, 1], _layernorm, _layernorm_np, _normal((5, 4, 33), (33,))),
    "sum": ([4, 4], _permuted_sum, _permuted_sum_np, _normal((2, 7, 3, 9), (2, 3, 7, 9))),
    "outer": ([2, 3], _outer, _outer_np, _normal((9, 6), (6, 9, 20))),
}


def _arrays(name: str, seed: int) -> List[np.ndarray]:
    return [a.astype(np.float32) for a in CASES[name][3](np.random.default_rng(seed))]


def _check(got: Sequence[Any], want: Sequence[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_permuted_input_that_keeps_its_last_axis_is_read_in_place(name: str) -> None:
    # Each was two to four kernels, a permuted copy of the input stored whole between them.
    ranks, build, ref, _ = CASES[name]
    fd = _fusion(ranks, build)
    xs = _arrays(name, 0)
    low = fd.lower(xs)
    assert len(low.kernels) == 1
    if name == "scores":
        assert "read through their strides: covered" in low.program.segmentation()
    _check(fd.execute(xs), ref(*[x.astype(np.float64) for x in xs]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_strided_arrays_behind_a_permuted_input(name: str) -> None:
    # The view reads the caller's strides, whatever they are: a transposed array, and a
    # slice with a step along the last axis.
    ranks, build, ref, _ = CASES[name]
    fd = _fusion(ranks, build)
    xs = _arrays(name, 1)
    first = np.ascontiguousarray(np.swapaxes(xs[0], 0, 1)).swapaxes(0, 1)
    wide = np.repeat(xs[0], 2, axis=-1)[..., ::2]
    for x0 in (first, wide):
        assert not x0.flags.c_contiguous and np.array_equal(x0, xs[0])
        ins = [x0] + xs[1:]
        _check(fd.execute(ins), ref(*[x.astype(np.float64) for x in ins]))


@settings(max_examples=40, deadline=None)
@given(
    rank=st.integers(2, 4),
    data=st.data(),
    reduce=st.sampled_from(["none", "last", "first", "softmax"]),
    other=st.booleans(),
)
def test_random_permutes_of_inputs_match_numpy(rank: int, data: Any, reduce: str, other: bool) -> None:
    # A random permutation of a random input (its last axis kept last or not), read beside
    # the input itself or not, then reduced along a random axis or normalized along the last.
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank))
    perm = data.draw(st.permutations(range(rank)))
    x = np.random.default_rng(rank * 7 + len(sizes)).standard_normal(sizes).astype(np.float32)
    out_sizes = [sizes[a] for a in perm]

    def build(fd: FusionDefinition, ts: List[Any]) -> List[Any]:
        p = fd.ops.permute(ts[0], list(perm))
        if other:
            p = fd.ops.add(p, fd.ops.permute(fd.ops.neg(ts[0]), list(perm)))
            p = fd.ops.add(p, fd.ops.exp(fd.ops.permute(ts[0], list(perm))))
        if reduce == "none":
            return [fd.ops.mul(p, 2.0)]
        if reduce in ("last", "first"):
            return [fd.ops.sum(p, dims=[rank - 1 if reduce == "last" else 0])]
        m = fd.ops.max(p, dims=[rank - 1])
        e = fd.ops.exp(fd.ops.sub(p, _bcast(fd, m, rank, range(rank - 1))))
        return [fd.ops.div(e, _bcast(fd, fd.ops.sum(e, dims=[rank - 1]), rank, range(rank - 1)))]

    def ref(x64: np.ndarray) -> List[np.ndarray]:
        p = x64.transpose(perm)
        if other:
            p = p - p + np.exp(p)
        if reduce == "none":
            return [p * 2.0]
        if reduce in ("last", "first"):
            return [p.sum(rank - 1 if reduce == "last" else 0)]
        e = np.exp(p - p.max(-1, keepdims=True))
        return [e / e.sum(-1, keepdims=True)]

    fd = _fusion([rank], build)
    got = fd.execute([x])
    want = ref(x.astype(np.float64))
    if reduce in ("none", "softmax"):
        assert list(np.shape(got[0])) == out_sizes
    _check(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_permuted_input_read_in_place_on_the_gpu(name: str) -> None:
    cp = cupy_or_skip()
    ranks, build, ref, _ = CASES[name]
    fd = _fusion(ranks, build)
    xs = _arrays(name, 2)
    want = ref(*[x.astype(np.float64) for x in xs])
    _check([cp.asnumpy(o) for o in fd.execute([cp.asarray(x) for x in xs])], want)
    # And a strided device array behind the permuted input.
    x0 = cp.repeat(cp.asarray(xs[0]), 2, axis=-1)[..., ::2]
    _check([cp.asnumpy(o) for o in fd.execute([x0] + [cp.asarray(x) for x in xs[1:]])], want)
