"""Outputs stored in another order than their logical one (``fd.add_output(t,
stride_order=...)``, nvFuser's): the automatic schedules iterate in the stored order (a
permute undone by the storage order is a plain copy), the array handed back is a strided view
with the logical shape, and bad orders are KilnErrors. NumPy float64 references."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import pytest
from kiln import FusionDefinition, KilnError


def _strides(shape: List[int], order: List[int], itemsize: int = 4) -> tuple:
    """Byte strides of ``shape`` stored with nvFuser's ``stride_order`` (0: innermost)."""
    out = [0] * len(shape)
    acc = itemsize
    for axis in sorted(range(len(shape)), key=lambda a: order[a]):
        out[axis] = acc
        acc *= max(shape[axis], 1)
    return tuple(out)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize("shape", [(2, 5, 3, 8), (1, 7, 1, 4), (3, 2, 4, 1), (2, 33, 5, 12)])
def test_permute_stored_in_its_input_order_is_a_plain_copy(shape):
    # [B, S, H, D] -> [B, H, S, D] handed back as torch's transpose(1, 2) gives it: a view of
    # a tensor stored [B, S, H, D].
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 4)
        y = fd.ops.mul(fd.ops.exp(x), 2.0)
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]), stride_order=[3, 1, 2, 0])
    a = _rng().standard_normal(shape).astype(np.float32)
    sizes = [list(shape)]
    assert fd._core.auto_program(sizes).heuristic == "pointwise"
    assert not fd._core.manually_scheduled
    (out,) = fd.execute([a])
    want = (np.exp(a.astype(np.float64)) * 2.0).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    logical = [shape[0], shape[2], shape[1], shape[3]]
    assert out.shape == tuple(logical)
    assert out.strides == _strides(logical, [3, 1, 2, 0])


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1]])
def test_pointwise_output_in_any_stored_order(order):
    shape = (3, 5, 7)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1])
        y = fd.ops.add(fd.ops.relu(x), fd.ops.broadcast_in_dim(b, [3, 5, 7], [2]))
        fd.add_output(y, stride_order=order)
    a = _rng(1).standard_normal(shape).astype(np.float32)
    bias = _rng(2).standard_normal(7).astype(np.float32)
    (out,) = fd.execute([a, bias])
    np.testing.assert_allclose(np.asarray(out), np.maximum(a, 0) + bias, rtol=1e-6)
    assert out.strides == _strides(list(shape), order)


def test_reduction_output_stored_transposed():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s, stride_order=[0, 1])  # [A, C] stored as [C, A]
    a = _rng(3).standard_normal((4, 9, 6)).astype(np.float32)
    (out,) = fd.execute([a])
    np.testing.assert_allclose(np.asarray(out), a.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    assert out.shape == (4, 6) and out.strides == (4, 16)


def test_two_outputs_stored_in_different_orders():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(x), stride_order=[0, 1])
        fd.add_output(fd.ops.neg(x))
    a = _rng(4).standard_normal((6, 10)).astype(np.float32)
    e, n = fd.execute([a])
    np.testing.assert_allclose(np.asarray(e), np.exp(a.astype(np.float64)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(n), -a)
    assert e.strides == (4, 24) and n.strides == (40, 4)


@pytest.mark.parametrize("orders", [([1, 2, 0], [2, 1, 0], None), ([2, 1, 0], None, [1, 2, 0]),
                                    (None, [0, 1, 2], [2, 1, 0]), ([2, 0, 1], [1, 2, 0], [2, 0, 1])])
def test_one_tensor_output_several_times_keeps_each_order(orders):
    """Each ``add_output`` of the same tensor is its own output with its own stored order."""
    shape = (3, 5, 7)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        y = fd.ops.mul(fd.ops.exp(x), 2.0)
        for order in orders:
            fd.add_output(y, stride_order=order)
    a = _rng(7).standard_normal(shape).astype(np.float32)
    outs = fd.execute([a])
    ref = np.exp(a.astype(np.float64)) * 2.0
    assert len(outs) == len(orders)
    for got, order in zip(outs, orders):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6)
        assert got.strides == _strides(list(shape), order if order is not None else [2, 1, 0])


@pytest.mark.parametrize("order,match", [([0, 0], "not a permutation"), ([0, 1, 2], "not a permutation"),
                                         ([1], "not a permutation"), (["a", 0], "int")])
def test_bad_stride_orders_are_kiln_errors(order: List, match: str):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match=match):
            fd.add_output(fd.ops.exp(x), stride_order=order)
        fd.add_output(fd.ops.neg(x))


def test_stride_order_needs_a_computed_output_and_no_alias():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        with pytest.raises(KilnError, match="computed outputs"):
            fd.add_output(x, stride_order=[0, 1])
        with pytest.raises(KilnError, match="alias_input"):
            fd.add_output(y, alias_input=x, stride_order=[0, 1])
        fd.add_output(y)


def _rope(order: Optional[List[int]]) -> FusionDefinition:
    h, d = 3, 8
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        cos = fd.define_tensor([-1, -1])
        sin = fd.define_tensor([-1, -1])
        q = fd.ops.reshape(x, [fd.ops.size(x, 0), fd.ops.size(x, 1), h, d])
        x1 = fd.ops.slice(q, [0, 0, 0, 0], [None, None, None, d // 2])
        x2 = fd.ops.slice(q, [0, 0, 0, d // 2], [None, None, None, d])
        rot = fd.ops.cat([fd.ops.neg(x2), x1], -1)
        shape = [fd.ops.size(x, 0), fd.ops.size(x, 1), h, d]
        c = fd.ops.broadcast_in_dim(cos, shape, [1, 3])
        s = fd.ops.broadcast_in_dim(sin, shape, [1, 3])
        y = fd.ops.add(fd.ops.mul(q, c), fd.ops.mul(rot, s))
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]), stride_order=order)
    return fd


@pytest.mark.parametrize("b,s", [(2, 7), (1, 1), (3, 16)])
def test_rope_as_a_view_matches_the_materialized_transpose(b, s):
    r = _rng(5)
    xs = [r.standard_normal((b, s, 24)).astype(np.float32), r.standard_normal((s, 8)).astype(np.float32),
          r.standard_normal((s, 8)).astype(np.float32)]
    q = xs[0].reshape(b, s, 3, 8).astype(np.float64)
    rot = np.concatenate([-q[..., 4:], q[..., :4]], -1)
    want = (q * xs[1][None, :, None] + rot * xs[2][None, :, None]).transpose(0, 2, 1, 3)
    (plain,) = _rope(None).execute(xs)
    (view,) = _rope([3, 1, 2, 0]).execute(xs)
    for out in (plain, view):
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    assert plain.strides == _strides([b, 3, s, 8], [3, 2, 1, 0])
    assert view.strides == _strides([b, 3, s, 8], [3, 1, 2, 0])


# -- random fusions with random stored orders -------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _case(draw):
    rank = draw(st.integers(1, 4))
    shape = [draw(st.sampled_from([1, 2, 3, 5, 8, 13])) for _ in range(rank)]
    perm = draw(st.permutations(list(range(rank)))) if draw(st.booleans()) else None
    reduce_axis = draw(st.integers(0, rank - 1)) if rank > 1 and draw(st.booleans()) else None
    out_rank = rank - (reduce_axis is not None)
    order = draw(st.permutations(list(range(out_rank))))
    two_outputs = draw(st.booleans())
    # An op that reads the stored output (in a later kernel where the schedulers split there).
    reader = draw(st.sampled_from([None, "pointwise", "sum", "permute"]))
    return shape, perm, reduce_axis, order, two_outputs, reader


@settings(max_examples=80, deadline=None)
@given(_case())
def test_random_fusions_with_stored_orders_match_numpy(case):
    shape, perm, reduce_axis, order, two_outputs, reader = case
    rank = len(shape)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        b = fd.define_tensor([-1])
        t = fd.ops.add(fd.ops.exp(x), fd.ops.broadcast_in_dim(b, shape, [rank - 1]))
        if perm is not None:
            t = fd.ops.permute(t, perm)
        if reduce_axis is not None:
            t = fd.ops.sum(t, dims=[reduce_axis])
        fd.add_output(t, stride_order=order)
        if two_outputs:
            fd.add_output(fd.ops.neg(x))
        out_rank = len(order)
        if reader == "pointwise":
            fd.add_output(fd.ops.mul(fd.ops.sin(t), 3.0))
        elif reader == "sum":
            fd.add_output(fd.ops.sum(t, dims=[out_rank - 1]))
        elif reader == "permute":
            fd.add_output(fd.ops.add(fd.ops.permute(t, list(range(out_rank))[::-1]), 1.0))
    a = _rng(7).uniform(-1, 1, shape).astype(np.float32)
    bias = _rng(8).uniform(-1, 1, shape[-1]).astype(np.float32)
    want = np.exp(a.astype(np.float64)) + bias
    if perm is not None:
        want = want.transpose(perm)
    if reduce_axis is not None:
        want = want.sum(axis=reduce_axis)
    outs = fd.execute([a, bias])
    np.testing.assert_allclose(np.asarray(outs[0]), want, rtol=1e-5, atol=1e-5)
    assert outs[0].shape == want.shape
    stored = [st for st, n in zip(outs[0].strides, want.shape) if n > 1]  # (size-one axes: any stride)
    assert stored == [st for st, n in zip(_strides(list(want.shape), order), want.shape) if n > 1]
    if two_outputs:
        np.testing.assert_array_equal(np.asarray(outs[1]), -a)
    got = np.asarray(outs[-1])
    if reader == "pointwise":
        np.testing.assert_allclose(got, np.sin(want) * 3.0, rtol=1e-5, atol=1e-5)
    elif reader == "sum":
        np.testing.assert_allclose(got, want.sum(axis=-1), rtol=1e-5, atol=1e-5)
    elif reader == "permute":
        np.testing.assert_allclose(got, want.transpose() + 1.0, rtol=1e-5, atol=1e-5)  # axes reversed


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
@pytest.mark.parametrize("shape", [(2, 33, 5, 12), (4, 128, 8, 64)])
def test_stored_orders_on_the_gpu(lib, shape):
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * 4)
        y = fd.ops.mul(fd.ops.exp(x), 2.0)
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]), stride_order=[3, 1, 2, 0])
        fd.add_output(fd.ops.neg(x), stride_order=[0, 3, 2, 1])
    a = _rng(9).standard_normal(shape).astype(np.float32)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        outs = fd.execute([torch.as_tensor(a, device="cuda")])
        got = [o.cpu().numpy() for o in outs]
        strides = [tuple(s * 4 for s in o.stride()) for o in outs]
    else:
        outs = fd.execute([cp.asarray(a)])
        got = [cp.asnumpy(o) for o in outs]
        strides = [o.strides for o in outs]
    want = (np.exp(a.astype(np.float64)) * 2.0).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_array_equal(got[1], -a)
    assert strides[0] == _strides(list(want.shape), [3, 1, 2, 0])
    assert strides[1] == _strides(list(shape), [0, 3, 2, 1])


# -- stored orders on outputs reached through a view ------------------------------------------
VIEWS = ["reshape", "slice", "select", "squeeze", "new_axis", "pad", "cat", "none"]


@st.composite
def _viewed_case(draw):
    view = draw(st.sampled_from(VIEWS))
    shape = [draw(st.sampled_from([1, 2, 3, 4, 6])) for _ in range(3)]
    if view == "squeeze":
        shape[1] = 1
    normalized = draw(st.booleans())  # x - mean(x, -1): the view reads a reduction's result
    from_input = draw(st.booleans()) and not normalized
    out_rank = {"select": 2, "squeeze": 2, "new_axis": 4}.get(view, 3)
    order = draw(st.permutations(list(range(out_rank))))
    return view, shape, normalized, from_input, order


def _view(fd, t, a, view, shape):
    if view == "reshape":
        new = [shape[2], shape[0], shape[1]]
        return fd.ops.reshape(t, new), a.reshape(new)
    if view == "slice":
        return fd.ops.slice(t, [0, 0, shape[2] // 2], shape), a[:, :, shape[2] // 2:]
    if view == "select":
        return fd.ops.select(t, 1, shape[1] - 1), a[:, shape[1] - 1]
    if view == "squeeze":
        return fd.ops.squeeze(t, [1]), a[:, 0]
    if view == "new_axis":
        return fd.ops.broadcast_in_dim(t, [shape[0], 1, shape[1], shape[2]], [0, 2, 3]), a[:, None]
    if view == "pad":
        return fd.ops.pad(t, [1, 2]), np.pad(a, [(0, 0), (0, 0), (1, 2)])
    if view == "cat":
        return fd.ops.cat([t, t], 1), np.concatenate([a, a], 1)
    return t, a


@settings(max_examples=120, deadline=None)
@given(_viewed_case())
def test_outputs_through_views_keep_their_stored_order(case):
    """A stored order on an output that is a reshape, slice, select, squeeze, new axis, pad or
    cat of a computed tensor (or of an input) holds whatever the automatic path rewrites
    (a reshape was handed back row-major: its element-wise ops moved before it)."""
    view, shape, normalized, from_input, order = case
    with FusionDefinition() as fd:
        x = fd.define_tensor([1 if n == 1 else -1 for n in shape])
        xd = _rng(11).uniform(-1, 1, shape).astype(np.float32)
        a = xd.astype(np.float64)
        if from_input:
            t = x
        elif normalized:
            t = fd.ops.sub(x, fd.ops.mean(x, dims=[2], keepdim=True))
            a = a - a.mean(2, keepdims=True)
        else:
            t = fd.ops.mul(fd.ops.exp(x), 2.0)
            a = np.exp(a) * 2.0
        t, want = _view(fd, t, a, view, shape)
        if from_input and view in ("none", "squeeze", "new_axis", "reshape", "select", "slice"):
            t, want = fd.ops.add(t, 1.0), want + 1.0  # stride_order applies to computed outputs
        fd.add_output(t, stride_order=order)
    (out,) = fd.execute([xd])
    assert out.shape == want.shape
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    stored = [s for s, n in zip(out.strides, want.shape) if n > 1]  # (size-one axes: any stride)
    assert stored == [s for s, n in zip(_strides(list(want.shape), order), want.shape) if n > 1]
