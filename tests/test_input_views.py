"""A row-major reshape of an input is read as a view of the input's buffer
(``Fusion::input_views``): no kernel and no index arithmetic, vector loads like any input.
Checked against NumPy in float64 for row-major, strided and shared inputs, symbolic and
constant shapes, and with the reshaped tensor also read directly."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest
from families import group_norm_nchw
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition


def _row_norm_of_view(shape: List[int], new: List[int]) -> FusionDefinition:
    """x reshaped to ``new``, each row (last axis) normalized by its sum of squares."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape), DataType.Float)
        v = fd.ops.reshape(x, new)
        ss = fd.ops.sum(fd.ops.mul(v, v), dims=[len(new) - 1], keepdim=True)
        fd.add_output(fd.ops.div(v, fd.ops.add(fd.ops.sqrt(ss), 1.0)))
    return fd


def _row_norm_ref(x: np.ndarray, new: List[int]) -> np.ndarray:
    v = x.astype(np.float64).reshape(new)
    return v / (np.sqrt((v * v).sum(-1, keepdims=True)) + 1.0)


def test_a_reshaped_input_is_a_view_in_the_host_program() -> None:
    x = np.random.default_rng(0).standard_normal((4, 6, 32)).astype(np.float32)
    fd = _row_norm_of_view([4, 6, 32], [24, 32])
    text = fd.lower([x]).host_program
    assert "View T1 = T0 as [24, 32] (no copy)" in text, text
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, _row_norm_ref(x, [24, 32]), rtol=1e-5, atol=1e-6)


def test_a_strided_input_is_not_viewed_and_still_correct() -> None:
    base = np.random.default_rng(1).standard_normal((6, 4, 32)).astype(np.float32)
    x = base.transpose(1, 0, 2)  # [4, 6, 32], not row-major
    fd = _row_norm_of_view([4, 6, 32], [24, 32])
    assert "View" not in fd.lower([x]).host_program
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, _row_norm_ref(x, [24, 32]), rtol=1e-5, atol=1e-6)
    # The same definition, row-major again: a plan of its own, with the view.
    y = np.ascontiguousarray(x)
    assert "View" in fd.lower([y]).host_program
    (got,) = fd.execute([y])
    np.testing.assert_allclose(got, _row_norm_ref(y, [24, 32]), rtol=1e-5, atol=1e-6)


def test_a_view_with_symbolic_sizes_binds_them_from_the_input() -> None:
    # reshape to [-1, H]: the view's sizes are expressions of x's; the kernel reads only it.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], DataType.Float)
        v = fd.ops.reshape(x, [-1, fd.ops.size(x, 2)])
        fd.add_output(fd.ops.sum(fd.ops.exp(v), dims=[1]))
    for shape in [(3, 5, 7), (2, 1, 64), (1, 9, 1)]:
        x_ = np.random.default_rng(2).uniform(-1, 1, shape).astype(np.float32)
        (got,) = fd.execute([x_])
        want = np.exp(x_.astype(np.float64)).reshape(-1, shape[2]).sum(1)
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_an_input_read_directly_and_as_a_view() -> None:
    # GroupNorm's residual form: the grouped statistics of x, applied to x itself.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1], DataType.Float)
        g = fd.ops.reshape(x, [2, 4, 3 * 5 * 6])
        m = fd.ops.sum(g, dims=[2], keepdim=True)
        mb = fd.ops.reshape(fd.ops.expand(m, [2, 4, 90]), [2, 12, 5, 6])
        fd.add_output(fd.ops.add(x, fd.ops.mul(mb, 1.0 / 90)))
    x_ = np.random.default_rng(3).standard_normal((2, 12, 5, 6)).astype(np.float32)
    (got,) = fd.execute([x_])
    g64 = x_.astype(np.float64).reshape(2, 4, 90)
    want = x_ + np.broadcast_to(g64.mean(2, keepdims=True), (2, 4, 90)).reshape(2, 12, 5, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_reshape_of_a_reduction_broadcast_against_a_larger_operand() -> None:
    # min(t1, keepdim) reshaped to [1] then compared with t0 of [N]: the output holds N
    # elements, not the reshape's one, so it is not computed at the reshape's source shape.
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1], dtype=DataType.Float)
        t1 = fd.define_tensor([-1], dtype=DataType.Float)
        m = fd.ops.reshape(fd.ops.min(t1, dims=[0], keepdim=True), [1])
        fd.add_output(fd.ops.cast(fd.ops.ge(t0, m), DataType.Float))
    rng = np.random.default_rng(4)
    for n in (1, 2, 7):
        a, b = rng.uniform(-1, 1, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)
        (got,) = fd.execute([a, b])
        np.testing.assert_array_equal(got, (a >= b.min()).astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 3), st.booleans(),
       st.sampled_from(["row_major", "transposed", "sliced"]))
def test_random_reshapes_of_inputs_match_numpy(shape: List[int], split: int, also_direct: bool,
                                               layout: str) -> None:
    # Flatten the axes from `split` on, reduce the last axis of the view; optionally add x's
    # own total too. Layouts that are not row-major must not be viewed.
    split = min(split, len(shape) - 1)
    new = shape[:split] + [int(np.prod(shape[split:]))]
    rng = np.random.default_rng(len(shape) * 10 + split)
    if layout == "transposed" and len(shape) >= 2:
        x = np.ascontiguousarray(rng.standard_normal(shape[::-1]).astype(np.float32)).T
    elif layout == "sliced":
        x = rng.standard_normal(shape[:-1] + [shape[-1] * 2]).astype(np.float32)[..., ::2]
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1] * len(shape), DataType.Float)
        v = fd.ops.reshape(t, new)
        r = fd.ops.sum(fd.ops.mul(v, 2.0), dims=[len(new) - 1])
        fd.add_output(r)
        if also_direct:
            fd.add_output(fd.ops.sum(t, dims=list(range(len(shape)))))
    outs: List[Any] = fd.execute([x])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(outs[0], (2 * x64).reshape(new).sum(-1), rtol=1e-5, atol=1e-5)
    if also_direct:
        np.testing.assert_allclose(outs[1], x64.sum(), rtol=1e-5, atol=1e-5)
    if not x.flags.c_contiguous:
        assert "View" not in fd.lower([x]).host_program


@pytest.mark.parametrize("shape", [(2, 64, 3, 5), (1, 32, 7, 1), (3, 32, 16, 16)])
def test_group_norm_reads_x_as_a_view(shape: Any) -> None:
    fam = group_norm_nchw(shape)
    ins = fam.inputs()
    low = fam.fd.lower(ins)
    assert "View" in low.host_program, low.host_program
    outs = fam.fd.execute(ins)
    want = fam.reference(*[np.asarray(a, np.float64) for a in ins])
    np.testing.assert_allclose(outs[0], want[0], rtol=fam.rtol, atol=fam.atol)
