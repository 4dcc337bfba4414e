"""Gathers whose table is a prefix slice of an input or an input that is not row-major read the
input's buffer through its strides (``canonical::view_strided_gather_tables``): HF's causal-LM
loss picks each label's logit from ``logits[:, :-1]``, a tied embedding gathers rows of a
transposed weight. Before, the whole table was copied by a kernel of its own first. Values are
checked against NumPy in float64 on the CPU interpreter (and on the GPU with ``-m gpu``)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

F32, I64 = DataType.Float, DataType.Int


def _lse(x: np.ndarray, axis: int) -> np.ndarray:
    m = x.max(axis, keepdims=True)
    return np.squeeze(np.log(np.exp(x - m).sum(axis, keepdims=True)) + m, axis)


def _causal_lm_loss(dtype: DataType = F32) -> FusionDefinition:
    """HF ``ForCausalLMLoss``: ``logits[..., :-1, :].float()`` against ``labels[..., 1:]``,
    cross-entropy with ignore_index -100, mean over the counted tokens."""
    with FusionDefinition() as fd:
        x, y = fd.define_tensor([-1, -1, -1], dtype), fd.define_tensor([-1, -1], I64)
        s = fd.ops.size(x, 1)
        lg = fd.ops.cast(fd.ops.slice(x, [0, 0, 0], [None, fd.ops.sub(s, 1), None]), F32)
        lb = fd.ops.slice(y, [0, 1], [None, None])
        valid = fd.ops.ne(lb, -100)
        safe = fd.ops.where(valid, lb, 0)
        lse = fd.ops.logsumexp(lg, dims=[2])
        idx = fd.ops.broadcast_in_dim(safe, [-1, -1, 1], [0, 1])
        tgt = fd.ops.squeeze(fd.ops.take_along_axis(lg, idx, 2), [2])
        vf = fd.ops.cast(valid, F32)
        loss = fd.ops.sum(fd.ops.mul(fd.ops.sub(lse, tgt), vf), dims=[0, 1])
        fd.add_output(fd.ops.div(loss, fd.ops.sum(vf, dims=[0, 1])))
    return fd


def _causal_lm_inputs(b: int, s: int, v: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((b, s, v)) * 2).astype(np.float32)
    y = rng.integers(0, v, (b, s)).astype(np.int64)
    y[0, s - s // 3:] = -100
    return x, y


def _causal_lm_ref(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    lg, lb = x.astype(np.float64)[:, :-1], y[:, 1:]
    valid = lb != -100
    safe = np.where(valid, lb, 0)
    nll = _lse(lg, 2) - np.take_along_axis(lg, safe[..., None], 2)[..., 0]
    return np.asarray((nll * valid).sum() / valid.sum())


@pytest.mark.parametrize("b,s,v", [(2, 9, 31), (1, 2, 5), (3, 17, 128), (4, 33, 1000)])
def test_causal_lm_loss_reads_the_logits_in_place(b: int, s: int, v: int) -> None:
    fd = _causal_lm_loss()
    x, y = _causal_lm_inputs(b, s, v, b * s + v)
    low = fd.lower([x, y])
    assert len(low.kernels) == 1
    assert "through its strides" in str(low)
    np.testing.assert_allclose(np.asarray(fd.execute([x, y])[0], np.float64), _causal_lm_ref(x, y), rtol=1e-5,
                               atol=1e-6)


def test_causal_lm_loss_of_strided_logits() -> None:
    """Logits that are themselves a view (every other vocabulary entry, a transposed batch)."""
    fd = _causal_lm_loss()
    x, y = _causal_lm_inputs(3, 11, 64, 7)
    for view in (x[:, :, ::2], np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2), x[:, :, ::-1],
                 x[:, ::-1], np.broadcast_to(x[:1], x.shape)):
        yy = np.where(y >= 0, np.minimum(y, view.shape[2] - 1), y)
        got = np.asarray(fd.execute([view, yy])[0], np.float64)
        np.testing.assert_allclose(got, _causal_lm_ref(view, yy), rtol=1e-5, atol=1e-6)


def _embedding() -> FusionDefinition:
    """ATen's embedding, ``index_select(w, ids.view(-1), 0).view(B, S, E)``, plus positions."""
    with FusionDefinition() as fd:
        w, ids, pos = fd.define_tensor([-1, -1]), fd.define_tensor([-1, -1], I64), fd.define_tensor([-1, -1])
        b, s = fd.ops.size(ids, 0), fd.ops.size(ids, 1)
        e = fd.ops.reshape(fd.ops.index_select(w, fd.ops.reshape(ids, [-1]), 0), [b, s, fd.ops.size(w, 1)])
        fd.add_output(fd.ops.add(e, fd.ops.broadcast_in_dim(pos, shape=[-1, -1, -1], broadcast_dims=[1, 2])))
    return fd


@pytest.mark.parametrize("layout", ["transposed", "stepped", "sliced"])
def test_embedding_rows_of_a_strided_table(layout: str) -> None:
    rng = np.random.default_rng(11)
    b, s, e, v = 4, 7, 16, 37
    base = rng.standard_normal((e, 2 * v)).astype(np.float32)
    table = {"transposed": base[:, :v].T, "stepped": base.T[::2], "sliced": base.T[3:3 + v]}[layout]
    assert table.shape == (v, e) and not table.flags.c_contiguous
    ids = rng.integers(0, v, (b, s)).astype(np.int64)
    pos = rng.standard_normal((s, e)).astype(np.float32)
    fd = _embedding()
    assert len(fd.lower([table, ids, pos]).kernels) == 1
    got = np.asarray(fd.execute([table, ids, pos])[0], np.float64)
    np.testing.assert_allclose(got, table.astype(np.float64)[ids] + pos[None], rtol=1e-6, atol=1e-6)


def test_slice_from_a_nonzero_start_is_still_right() -> None:
    """``logits[:, 1:]`` shifts every address: not viewed, and the pick is right."""
    with FusionDefinition() as fd:
        x, idx = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1, -1], I64)
        sl = fd.ops.slice(x, [0, 1, 0], [None, None, None])
        fd.add_output(fd.ops.add(fd.ops.take_along_axis(sl, idx, 2), fd.ops.max(sl, dims=[2], keepdim=True)))
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((2, 6, 9)).astype(np.float32)
    ids = rng.integers(0, 9, (2, 5, 1)).astype(np.int64)
    sl = xs.astype(np.float64)[:, 1:]
    want = np.take_along_axis(sl, ids, 2) + sl.max(2, keepdims=True)
    np.testing.assert_allclose(np.asarray(fd.execute([xs, ids])[0], np.float64), want, rtol=1e-6)


@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC wheels (see DEVELOPERS.md)")
def test_index_error_position_sizes_are_kernel_parameters() -> None:
    """The element position an out-of-range index reports is computed from the index tensor's
    own sizes; where the loops read other sizes (the slice's), those still reach the kernel
    as parameters (the CUDA failed to compile: an undefined ``i4``)."""
    with FusionDefinition() as fd:
        x, i = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1, -1], I64)
        sl = fd.ops.slice(x, [0, 0, 0], [1, 4, 1])
        fd.add_output(fd.ops.mul(fd.ops.take_along_axis(sl, i, 2), fd.ops.sum(sl, dims=[2], keepdim=True)))
    xs = np.random.default_rng(3).standard_normal((1, 6, 1)).astype(np.float32)
    ids = np.zeros((1, 4, 1), np.int64)
    for k in fd.lower([xs, ids]).kernels:
        for index32 in (False, True):
            compile_cubin(k.cuda_source_for(index32), "kiln_kernel", "sm_90")
    want = xs.astype(np.float64)[:, :4] * xs.astype(np.float64)[:, :4]
    np.testing.assert_allclose(np.asarray(fd.execute([xs, ids])[0], np.float64), want, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    data=st.data(),
    layout=st.sampled_from(["contiguous", "transposed", "stepped", "reversed"]),
)
def test_random_gathers_from_prefix_slices_match_numpy(shape: List[int], data: st.DataObject,
                                                       layout: str) -> None:
    """take_along_axis of a prefix slice of an input (each axis cut to a random length, the
    gathered one kept whole), beside a reduction of the same slice."""
    rank = len(shape)
    axis = data.draw(st.integers(0, rank - 1))
    ends = [shape[a] if a == axis else data.draw(st.integers(1, shape[a])) for a in range(rank)]
    rng = np.random.default_rng(sum(shape) * 31 + axis)
    if layout == "transposed":
        xs = np.ascontiguousarray(rng.standard_normal(shape[::-1]).astype(np.float32)).transpose()
    elif layout == "stepped":
        xs = rng.standard_normal([*shape[:-1], 2 * shape[-1]]).astype(np.float32)[..., ::2]
    elif layout == "reversed":
        xs = rng.standard_normal(shape).astype(np.float32)[::-1, ..., ::-1]
    else:
        xs = rng.standard_normal(shape).astype(np.float32)
    ishape = [1 if a == axis else ends[a] for a in range(rank)]
    ids = rng.integers(0, shape[axis], ishape).astype(np.int64)
    with FusionDefinition() as fd:
        x, i = fd.define_tensor([-1] * rank), fd.define_tensor([-1] * rank, I64)
        sl = fd.ops.slice(x, [0] * rank, ends)
        picked = fd.ops.take_along_axis(sl, i, axis)
        fd.add_output(fd.ops.mul(picked, fd.ops.sum(sl, dims=[axis], keepdim=True)))
    s64 = xs.astype(np.float64)[tuple(slice(0, e) for e in ends)]
    want = np.take_along_axis(s64, ids, axis) * s64.sum(axis, keepdims=True)
    np.testing.assert_allclose(np.asarray(fd.execute([xs, ids])[0], np.float64), want, rtol=1e-5, atol=1e-6)


def _gpu(cp: Any, xs: Sequence[np.ndarray]) -> List[Any]:
    return [cp.asarray(a) for a in xs]


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,v", [(8, 1024, 32000), (2, 513, 50257), (3, 17, 128)])
def test_causal_lm_loss_on_the_gpu(b: int, s: int, v: int) -> None:
    cp = cupy_or_skip()
    fd = _causal_lm_loss()
    x, y = _causal_lm_inputs(b, s, v, 5)
    low = fd.lower([x, y])
    # Many rows take their total in a second kernel (faster than a grid-wide wait); the
    # logits are read in place either way.
    assert "through its strides" in str(low)
    assert len(low.kernels) == (1 if b * (s - 1) <= 4 * 132 else 2)
    got = float(cp.asnumpy(fd.execute(_gpu(cp, [x, y]))[0]))
    np.testing.assert_allclose(got, _causal_lm_ref(x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["reversed_vocab", "reversed_seq", "stepped", "broadcast"])
def test_causal_lm_loss_of_strided_logits_on_the_gpu(layout: str) -> None:
    cp = cupy_or_skip()
    fd = _causal_lm_loss()
    x, y = _causal_lm_inputs(4, 65, 3000, 9)
    dev = cp.asarray(x)
    host, view = {
        "reversed_vocab": (x[:, :, ::-1], dev[:, :, ::-1]),
        "reversed_seq": (x[:, ::-1], dev[:, ::-1]),
        "stepped": (x[:, :, ::2], dev[:, :, ::2]),
        "broadcast": (np.broadcast_to(x[:1], x.shape), cp.broadcast_to(dev[:1], x.shape)),
    }[layout]
    yy = np.where(y >= 0, np.minimum(y, host.shape[2] - 1), y)
    got = float(cp.asnumpy(fd.execute([view, cp.asarray(yy)])[0]))
    np.testing.assert_allclose(got, _causal_lm_ref(host, yy), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transposed", "stepped"])
def test_embedding_rows_of_a_strided_table_on_the_gpu(layout: str) -> None:
    cp = cupy_or_skip()
    rng = np.random.default_rng(12)
    b, s, e, v = 8, 512, 768, 5000
    base = rng.standard_normal((e, 2 * v)).astype(np.float32)
    ids = rng.integers(0, v, (b, s)).astype(np.int64)
    pos = rng.standard_normal((s, e)).astype(np.float32)
    dev = cp.asarray(base)
    table = dev[:, :v].T if layout == "transposed" else dev.T[::2]
    host = base[:, :v].T if layout == "transposed" else base.T[::2]
    got = cp.asnumpy(_embedding().execute([table, cp.asarray(ids), cp.asarray(pos)])[0])
    np.testing.assert_allclose(got, host.astype(np.float64)[ids] + pos[None], rtol=1e-6, atol=1e-6)
