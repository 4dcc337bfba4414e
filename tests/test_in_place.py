"""In-place outputs (``fd.add_output(out, alias_input=inp)``): an AdamW step that updates its
parameter and moments in place, the host program showing the copies, and the refusals
(two outputs into one input, a non-input, dtype or rank mismatches); ``-m gpu`` on CuPy."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def _adamw() -> FusionDefinition:
    """torch.optim.AdamW's update for one parameter tensor, step count as a runtime scalar."""
    with FusionDefinition() as fd:
        p, g, m, v = (fd.define_tensor([-1]) for _ in range(4))
        step = fd.define_scalar(dtype=DataType.Int)
        o = fd.ops
        p_decayed = o.mul(p, 1.0 - LR * WD)
        m_new = o.add(o.mul(m, B1), o.mul(g, 1.0 - B1))
        v_new = o.add(o.mul(v, B2), o.mul(o.mul(g, g), 1.0 - B2))
        bc1 = o.sub(1.0, o.pow(B1, step))  # runtime scalar math: 0-d tensors
        bc2 = o.sub(1.0, o.pow(B2, step))
        denom = o.add(o.div(o.sqrt(v_new), o.sqrt(bc2)), EPS)
        p_new = o.sub(p_decayed, o.mul(o.div(m_new, denom), o.div(LR, bc1)))
        fd.add_output(p_new, alias_input=p)
        fd.add_output(m_new, alias_input=m)
        fd.add_output(v_new, alias_input=v)
    return fd


def _adamw_ref(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray,
               step: int) -> Tuple[np.ndarray, ...]:
    p, g, m, v = (x.astype(np.float64) for x in (p, g, m, v))
    p = p * (1 - LR * WD)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - B2**step) + EPS
    return p - LR / (1 - B1**step) * m / denom, m, v


def _state(n: int, xp: Any) -> List[Any]:
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=n), rng.normal(size=n), 0.1 * rng.normal(size=n), 0.01 * rng.random(n)]
    return [xp.asarray(a.astype(np.float32)) for a in arrays]


def test_adamw_updates_its_state_in_place() -> None:
    fd = _adamw()
    p, g, m, v = _state(1001, np)
    want = _adamw_ref(p, g, m, v, 3)
    ids = [id(x) for x in (p, m, v)]
    assert fd.execute([p, g, m, v, 3]) == []  # in-place outputs are not returned
    assert [id(x) for x in (p, m, v)] == ids
    for got, w in zip((p, m, v), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)
    # A second step reads the updated state.
    want2 = _adamw_ref(p, g, m, v, 4)
    fd.execute([p, g, m, v, 4])
    for got, w in zip((p, m, v), want2):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)


def test_host_program_shows_the_in_place_copies() -> None:
    fd = _adamw()
    text = fd.lower(_state(64, np) + [1]).host_program
    assert "CopyInPlace T" in text
    assert "-> input T0" in text and "-> input T2" in text and "-> input T3" in text
    assert len(fd.lower(_state(64, np) + [1]).kernels) == 1


def test_other_outputs_are_still_returned_in_order() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(fd.ops.sum(x, [1]))
        fd.add_output(y, alias_input=x)
        fd.add_output(fd.ops.neg(y))
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    before = a.copy()
    s, n = fd.execute([a])
    np.testing.assert_array_equal(s, before.sum(1))  # read before the in-place write
    np.testing.assert_array_equal(n, -2 * before)
    np.testing.assert_array_equal(a, 2 * before)


def test_in_place_refusals() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        z = fd.define_tensor([-1, -1])
        h = fd.define_tensor([-1], DataType.Half)
        y = fd.ops.add(x, 1.0)
        with pytest.raises(KilnError, match="alias_input T3 is not a fusion input"):
            fd.add_output(y, alias_input=y)
        with pytest.raises(KilnError, match="dtype float but alias_input T2 has dtype half"):
            fd.add_output(y, alias_input=h)
        with pytest.raises(KilnError, match="rank 1 but alias_input T1 has rank 2"):
            fd.add_output(y, alias_input=z)
        fd.add_output(y, alias_input=x)
        with pytest.raises(KilnError, match="both alias input T0"):
            fd.add_output(fd.ops.mul(x, 3.0), alias_input=x)


def test_in_place_shape_mismatch_leaves_the_input_untouched() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1])
        b = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(b, [1]), alias_input=a)
    x, y = np.zeros(3, np.float32), np.ones((4, 2), np.float32)
    msg = r"input 0 \(T0\): has shape \(3,\) but output 0, written into it in place, has shape \(4,\)"
    with pytest.raises(KilnError, match=msg):
        fd.execute([x, y])
    np.testing.assert_array_equal(x, 0)


@pytest.mark.gpu
def test_adamw_in_place_on_gpu() -> None:
    cp = cupy_or_skip()
    fd = _adamw()
    state = _state(1 << 20, cp)
    host = [cp.asnumpy(x) for x in state]
    for step in (1, 2, 3):  # the later calls take the cached launcher
        want = _adamw_ref(*host, step)
        assert fd.execute(state + [step]) == []
        host = [cp.asnumpy(state[0]), host[1], cp.asnumpy(state[2]), cp.asnumpy(state[3])]
        for got, w in zip((host[0], host[2], host[3]), want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)


def test_a_tensor_given_as_output_twice_comes_back_as_copies() -> None:
    """nvFuser returns one tensor twice (and beside an in-place update); kiln returns a
    fresh array for each."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        y = fd.ops.relu(x)
        fd.add_output(y, alias_input=x)
        fd.add_output(y)
        fd.add_output(y)
        fd.add_output(x)
        fd.add_output(x)
    a = np.array([-1.0, 2.0, -3.0], np.float32)
    outs = fd.execute([a])
    np.testing.assert_array_equal(a, [0.0, 2.0, 0.0])
    assert len(outs) == 4 and len({id(o) for o in outs}) == 4
    for o, want in zip(outs, ([0, 2, 0], [0, 2, 0], [-1, 2, -3], [-1, 2, -3])):
        np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("strides", [(0, 4), (4, 4), (8, 4)])
def test_in_place_into_overlapping_elements_is_refused(strides: Tuple[int, int]) -> None:
    """A view whose elements share memory (a broadcast, strides that do not nest) would keep
    only the last value written to each place: refused before anything runs, as PyTorch
    refuses in-place ops on such tensors."""
    with FusionDefinition() as fd:
        p = fd.define_tensor([-1, -1])
        g = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sub(p, g), alias_input=p)
    base = np.arange(8, dtype=np.float32)
    target = np.lib.stride_tricks.as_strided(base, shape=(2, 3), strides=strides, writeable=True)
    with pytest.raises(KilnError, match=r"input 0 \(T0\): output 0 is written into it in place.*axis [01] "):
        fd.execute([target, np.ones((2, 3), np.float32)])
    np.testing.assert_array_equal(base, np.arange(8))


def test_in_place_into_a_strided_view_writes_each_element() -> None:
    with FusionDefinition() as fd:
        p = fd.define_tensor([-1, -1])
        g = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sub(p, fd.ops.mul(g, 2.0)), alias_input=p)
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    want = base.astype(np.float64)
    target = base[::-2, 1::3].T  # negative, stepped and transposed, no element twice
    g = np.arange(target.size, dtype=np.float32).reshape(target.shape)
    want[::-2, 1::3] -= 2.0 * g.T
    assert fd.execute([target, g]) == []
    np.testing.assert_array_equal(base, want)
