"""Permuted regions closed by the inverse permute are computed in their source's order.

``permute(f(permute(x, p)), p^-1)`` with element-wise ops and reductions ``f`` (timm's
LayerNorm2d, a channels-last activation between two transposes) is ``f`` over ``x``: the
automatic path drops both permutes, reduces over the axes ``p`` names and lays broadcast
operands out in ``x``'s order, so the fusion is one kernel instead of two transposes around
the rest. Regions whose tensors are also outputs, or whose operands have no form in ``x``'s
order, keep their permutes. A property test draws permutations, chains and readers; every
result is checked against NumPy in float64.
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def _inverse(p: List[int]) -> List[int]:
    inv = [0] * len(p)
    for i, a in enumerate(p):
        inv[a] = i
    return inv


def _check(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-5)


def test_channels_last_activation_between_transposes_is_one_kernel() -> None:
    rng = np.random.default_rng(1)
    x0, w0 = rng.standard_normal((2, 6, 5, 7)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1] * 4), fd.define_tensor([-1])
        xp = fd.ops.permute(x, [0, 2, 3, 1])
        y = fd.ops.mul(fd.ops.tanh(xp), fd.ops.broadcast_in_dim(w, [-1] * 4, [3]))
        fd.add_output(fd.ops.permute(y, [0, 3, 1, 2]))
    _check(fd.execute([x0, w0])[0], np.tanh(x0.astype(np.float64)) * w0[:, None, None])
    assert len(lowered_for(fd, [x0, w0]).kernels) == 1


def test_a_region_that_is_also_an_output_keeps_its_permutes() -> None:
    """The permuted tensor is handed back too: the region stays as written, and both outputs
    are right."""
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal((3, 4, 5)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 3)
        y = fd.ops.exp(fd.ops.permute(x, [2, 0, 1]))
        fd.add_output(y)
        fd.add_output(fd.ops.permute(fd.ops.mul(y, 2.0), [1, 2, 0]))
    got = fd.execute([x0])
    e = np.exp(x0.astype(np.float64))
    _check(got[0], e.transpose(2, 0, 1))
    _check(got[1], 2 * e)


N_EXAMPLES = int(os.environ.get("KILN_PERMUTE_EXAMPLES", "30"))

Drawn = Tuple[FusionDefinition, List[np.ndarray], List[np.ndarray], bool]


@st.composite
def regions(draw: Any) -> Drawn:
    """x of rank 3-4 permuted by a random p, then a chain of element-wise ops with operands
    broadcast along random axes, optionally a sum or max over random axes broadcast back and
    subtracted (a normalization's statistic), then permuted by p^-1 (closing the region) or
    by another permutation (leaving it open)."""
    rank = draw(st.integers(3, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    p = list(draw(st.permutations(range(rank))))
    pshape = [shape[a] for a in p]
    close = draw(st.booleans())
    q = _inverse(p) if close else list(draw(st.permutations(range(rank))))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(shape).astype(np.float32)
    ins = [x0]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        t = fd.ops.permute(x, p)
        ref = x0.astype(np.float64).transpose(p)
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["unary", "operand", "stat"]))
            if kind == "unary":
                t, ref = fd.ops.tanh(t), np.tanh(ref)
            elif kind == "operand":
                # A weight along a random subset of the permuted axes, in their order.
                axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank)))
                w0 = rng.standard_normal([pshape[a] for a in axes]).astype(np.float32)
                ins.append(w0)
                w = fd.define_tensor([-1] * len(axes))
                t = fd.ops.add(fd.ops.mul(t, 0.5), fd.ops.broadcast_in_dim(w, [-1] * rank, axes))
                bshape = [pshape[a] if a in axes else 1 for a in range(rank)]
                ref = ref * 0.5 + w0.astype(np.float64).reshape(bshape)
            else:
                axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank - 1)))
                kept = [a for a in range(rank) if a not in axes]
                op = draw(st.sampled_from(["sum", "max"]))
                s = getattr(fd.ops, op)(t, dims=axes)
                t = fd.ops.sub(t, fd.ops.broadcast_in_dim(s, [-1] * rank, kept))
                ref = ref - getattr(np, op)(ref, axis=tuple(axes), keepdims=True)
        fd.add_output(fd.ops.permute(t, q))
    return fd, ins, [ref.transpose(q)], close


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(regions())
def test_random_permuted_regions_match_numpy(drawn: Drawn) -> None:
    fd, ins, ref, _ = drawn
    _check(fd.execute(ins)[0], ref[0])


@pytest.mark.parametrize("shape", [(2, 8, 5, 7), (1, 3, 1, 33)])
def test_layernorm2d_is_one_kernel_at_every_size(shape: Tuple[int, ...]) -> None:
    import families

    fam = families.layernorm2d_permuted(shape)
    assert len(lowered_for(fam.fd, fam.stand_ins()).kernels) == 1


def test_an_output_read_back_through_two_permutes_is_a_buffer_of_its_own() -> None:
    """``permute(permute(t))`` of an output ``t`` is ``t`` again; each output still gets a
    buffer of its own in the plan, which is what the GPU path hands back (one buffer for
    both returned one array for two outputs there)."""
    from kiln.host import plan_program

    x0 = np.random.default_rng(3).standard_normal((3, 4, 5)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 3)
        t = fd.ops.exp(x)
        fd.add_output(t)
        fd.add_output(fd.ops.permute(fd.ops.permute(t, [2, 0, 1]), [1, 2, 0]))
    low = lowered_for(fd, [x0])
    names = list(low.program.output_names())
    assert len(set(names)) == 2, names
    plan = plan_program(low.program, [x0], [], "numpy")
    assert sorted(b.offset for b in plan.buffers if b.place == "output") == [0, 1]
    for got in fd.execute([x0]):
        _check(got, np.exp(x0.astype(np.float64)))


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (1, 1, 3, 5), (2, 1, 3, 70), (1, 1, 1, 200), (2, 3, 4, 5),
                                   (2, 1, 65, 67)])
@pytest.mark.parametrize("other", ["fill", "row", "col"])
def test_a_transpose_epilogue_reads_size_one_broadcasts_of_its_output(shape: tuple, other: str) -> None:
    # The transpose's output [B, S, D, 1] times a fill [1, 1, D, 1] (or an input broadcast so):
    # the fill's size-one axes are split and merged with the tile, and the loops that run it
    # are the output's. Every element it is read at must be computed (the permute also feeds
    # a reshape, so that the transpose schedule takes the product).
    rng = np.random.default_rng(sum(shape))
    a = rng.uniform(-1, 1, shape).astype(np.float32)
    p = [shape[i] for i in (0, 2, 3, 1)]
    bshape = [1, 1, p[2], 1] if other != "col" else [1, p[1], 1, p[3]]
    b = rng.uniform(-1, 1, bshape).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1])
        t = fd.ops.permute(x, [0, 2, 3, 1])
        fd.add_output(fd.ops.reshape(t, p + [1]))
        if other == "fill":
            w = fd.ops.full(bshape, 1.5, DataType.Float)
            inputs = [a]
            ref_w = np.full(bshape, 1.5)
        else:
            w = fd.ops.exp(fd.define_tensor([1, 1, -1, 1] if other == "row" else [1, -1, 1, -1]))
            inputs = [a, b]
            ref_w = np.exp(b.astype(np.float64))
        fd.add_output(fd.ops.mul(t, w))
    got = fd.execute(inputs)
    np.testing.assert_array_equal(got[0], a.transpose(0, 2, 3, 1).reshape(p + [1]))
    np.testing.assert_allclose(got[1], a.transpose(0, 2, 3, 1).astype(np.float64) * ref_w, rtol=1e-6)
