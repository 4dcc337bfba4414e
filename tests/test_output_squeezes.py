"""Squeezes that cannot sink to an input: the pick of an NLL loss,
``-log(probs.gather(1, labels[:, None]).squeeze(1)) * w``, and a gather of a computed tensor
(``(2 * x).gather(1, y[:, None]).squeeze(1)``). The squeeze and the element-wise ops after it
run at the gathered shape and the host hands the outputs back viewed, so each takes one
kernel, where the squeeze and its epilogue were a kernel of their own reading the gathered
column back. Checked against NumPy in float64 through the CPU interpreter."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition


def _pick(fd: FusionDefinition, x: Any, y: Any) -> Any:
    """``x.gather(1, y[:, None]).squeeze(1)`` for x [B, V] and int64 labels y [B]."""
    return fd.ops.squeeze(fd.ops.take_along_axis(x, fd.ops.broadcast_in_dim(y, [-1, -1], [0]), 1), [1])


def _weighted_nll(scaled: bool, also_picked: bool) -> FusionDefinition:
    """``-log(p[i, y[i]]) * w[i]`` (``p`` halved where ``scaled``), and the pick itself."""
    with FusionDefinition() as fd:
        pt = fd.define_tensor([-1, -1], DataType.Float)
        yt = fd.define_tensor([-1], DataType.Int)
        wt = fd.define_tensor([-1], DataType.Float)
        picked = _pick(fd, fd.ops.mul(pt, 0.5) if scaled else pt, yt)
        fd.add_output(fd.ops.mul(fd.ops.neg(fd.ops.log(picked)), wt))
        if also_picked:
            fd.add_output(picked)
    return fd


@pytest.mark.parametrize("shape", [(9, 13), (1, 1), (130, 7)])
@pytest.mark.parametrize("scaled", [False, True], ids=["input", "computed"])
def test_weighted_nll_pick_one_kernel(shape: tuple, scaled: bool) -> None:
    """``-log(p[i, y[i]]) * w[i]`` with the picked value as a second output: one kernel."""
    b, v = shape
    rng = np.random.default_rng(b * v)
    p = (rng.random(shape) + 0.1).astype(np.float32)
    y = rng.integers(0, v, b).astype(np.int64)
    w = rng.random(b).astype(np.float32)
    fd = _weighted_nll(scaled, also_picked=True)
    assert len(fd.lower([p, y, w]).kernels) == 1
    loss, got = fd.execute([p, y, w])
    want = p.astype(np.float64)[np.arange(b), y] * (0.5 if scaled else 1.0)
    assert got.shape == (b,) and loss.shape == (b,)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(loss, -np.log(want) * w, rtol=1e-5, atol=1e-6)


@st.composite
def _epilogues(draw: Any) -> Dict[str, Any]:
    return dict(
        b=draw(st.sampled_from([1, 4, 33])),
        v=draw(st.sampled_from([1, 5, 64])),
        source=draw(st.sampled_from(["input", "scaled", "exp"])),
        ops=draw(st.lists(st.sampled_from(["log", "neg", "weight", "total", "half"]), max_size=4)),
        also_picked=draw(st.booleans()),
    )


@settings(max_examples=50, deadline=None)
@given(_epilogues())
def test_random_epilogues_after_a_pick(p: Dict[str, Any]) -> None:
    """Random element-wise epilogues of a picked column (with a per-row weight, a 0-d total,
    a half round trip) give NumPy's values in one kernel."""
    b, v = p["b"], p["v"]
    rng = np.random.default_rng(b + 7 * v)
    x = (rng.random((b, v)) + 0.5).astype(np.float32)
    y = rng.integers(0, v, b).astype(np.int64)
    w = (rng.random(b) + 0.5).astype(np.float32)
    s = np.float32(1.25)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], DataType.Float)
        yt = fd.define_tensor([-1], DataType.Int)
        wt = fd.define_tensor([-1], DataType.Float)
        st_ = fd.define_tensor([], DataType.Float)
        sources = {"input": xt, "scaled": fd.ops.mul(xt, 2.0), "exp": fd.ops.exp(fd.ops.mul(xt, 0.1))}
        src = sources[p["source"]]
        t = picked = _pick(fd, src, yt)
        for op in p["ops"]:
            if op == "log":
                t = fd.ops.log(fd.ops.add(fd.ops.abs(t), 1.0))
            elif op == "neg":
                t = fd.ops.neg(t)
            elif op == "weight":
                t = fd.ops.mul(t, wt)
            elif op == "total":
                t = fd.ops.add(t, st_)
            else:
                t = fd.ops.cast(fd.ops.cast(t, DataType.Half), DataType.Float)
        fd.add_output(t)
        if p["also_picked"]:
            fd.add_output(picked)
    x64 = x.astype(np.float64)
    src_ref = {"input": x64, "scaled": 2 * x64, "exp": np.exp(0.1 * x64)}[p["source"]]
    ref = picked_ref = src_ref[np.arange(b), y]
    for op in p["ops"]:
        if op == "log":
            ref = np.log(np.abs(ref) + 1.0)
        elif op == "neg":
            ref = -ref
        elif op == "weight":
            ref = ref * w
        elif op == "total":
            ref = ref + 1.25
        else:
            ref = ref.astype(np.float16).astype(np.float64)
    arrays = [x, y, w, np.asarray(s)]
    assert len(fd.lower(arrays).kernels) == 1
    outs = fd.execute(arrays)
    tol = dict(rtol=2e-3, atol=2e-3) if "half" in p["ops"] else dict(rtol=1e-5, atol=1e-6)
    assert outs[0].shape == (b,)
    np.testing.assert_allclose(outs[0], ref, **tol)
    if p["also_picked"]:
        np.testing.assert_allclose(outs[1], picked_ref, rtol=1e-6)


@pytest.mark.gpu
def test_weighted_nll_pick_gpu() -> None:
    """The weighted NLL pick on the GPU: one kernel, NumPy's values, shape [B]."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    b, v = 4099, 1031
    rng = np.random.default_rng(9)
    p = (rng.random((b, v)) + 0.1).astype(np.float32)
    y = rng.integers(0, v, b).astype(np.int64)
    w = rng.random(b).astype(np.float32)
    fd = _weighted_nll(True, also_picked=False)
    assert len(fd.lower([p, y, w]).kernels) == 1
    (loss,) = fd.execute([cp.asarray(p), cp.asarray(y), cp.asarray(w)])
    want = -np.log(0.5 * p.astype(np.float64)[np.arange(b), y]) * w
    got = cp.asnumpy(loss)
    assert got.shape == (b,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
