"""reshape, slice, pad, cat, select, triu, take_along_axis and gather against NumPy float64:
automatically scheduled and as written in the CPU interpreter, the kernel counts the
automatic path reaches, every kernel compiled by NVRTC, the errors bad shapes get, and (``-m
gpu``) the GPU against the same references."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

Case = Tuple[Callable[[], FusionDefinition], Callable[[np.random.Generator], List[np.ndarray]],
             Callable[[List[np.ndarray]], List[np.ndarray]], int]


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _d(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


# --- reshape ---------------------------------------------------------------------------------


def _group_norm(groups: int, out_dtype: DataType = DataType.Float) -> Callable[[], FusionDefinition]:
    # torch's group_norm as traced: x [N, C, H, W] viewed as [N, G, C/G, H, W], normalized
    # over the last three axes, viewed back, then the per-channel affine (and a cast). One
    # kernel: the output is computed at the grouped shape and handed back at [N, C, H, W].
    def build() -> FusionDefinition:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1, -1, -1])
            w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
            n, c, h, wd = (fd.ops.size(x, k) for k in range(4))
            xr = fd.ops.reshape(x, [n, groups, -1, h, wd])
            var, mean = fd.ops.var_mean(xr, [2, 3, 4], correction=0)
            stat = [0, 1]
            y = fd.ops.mul(fd.ops.sub(xr, fd.ops.broadcast_in_dim(mean, [-1] * 5, stat)),
                           fd.ops.broadcast_in_dim(fd.ops.rsqrt(fd.ops.add(var, 1e-5)), [-1] * 5, stat))
            y = fd.ops.reshape(y, [n, c, h, wd])
            y = fd.ops.add(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, [-1] * 4, [1])),
                           fd.ops.broadcast_in_dim(b, [-1] * 4, [1]))
            fd.add_output(fd.ops.cast(y, out_dtype) if out_dtype != DataType.Float else y)
        return fd
    return build


def _group_norm_ref(groups: int, dtype: Any = np.float64) -> Callable[[List[np.ndarray]], List[np.ndarray]]:
    def ref(a: List[np.ndarray]) -> List[np.ndarray]:
        x, w, b = (_d(t) for t in a)
        xr = x.reshape(x.shape[0], groups, -1)
        y = (xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)
        out = y.reshape(x.shape) * w[:, None, None] + b[:, None, None]
        return [out.astype(dtype)]
    return ref


def _stepped_slice_reshape_of_reduction() -> FusionDefinition:
    # The slice and the reshape compose into one remap named reshape: not a plain reshape,
    # so the output is not computed at the reduction's shape.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        m = fd.ops.min(x, [1], keepdim=True)
        s = fd.ops.slice(m, [0, 0, 0], [fd.ops.size(m, 0), None, None], [2, 1, 1])
        fd.add_output(fd.ops.reshape(s, [1, -1, 1]))
    return fd


def _instance_norm_flat() -> FusionDefinition:
    # [N, C, H, W] as [N*C, H*W] rows, normalized, reshaped back (no affine).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1])
        n, c, h, w = (fd.ops.size(x, k) for k in range(4))
        xr = fd.ops.reshape(x, [-1, fd.ops.mul(h, w)])
        var, mean = fd.ops.var_mean(xr, [1], correction=0)
        y = fd.ops.mul(fd.ops.sub(xr, fd.ops.broadcast_in_dim(mean, [-1, -1], [0])),
                       fd.ops.broadcast_in_dim(fd.ops.rsqrt(fd.ops.add(var, 1e-5)), [-1, -1], [0]))
        fd.add_output(fd.ops.reshape(y, [n, c, h, w]))
    return fd


def _instance_norm_ref(a: List[np.ndarray]) -> List[np.ndarray]:
    x = _d(a[0])
    xr = x.reshape(x.shape[0] * x.shape[1], -1)
    return [((xr - xr.mean(1, keepdims=True)) / np.sqrt(xr.var(1, keepdims=True) + 1e-5)).reshape(x.shape)]


def _reshape_split_heads() -> FusionDefinition:
    # [B, S, H*D] -> [B, S, H, D] with the sizes read from the input, then a transpose.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        b, s = fd.ops.size(x, 0), fd.ops.size(x, 1)
        y = fd.ops.reshape(fd.ops.mul(x, 2.0), [b, s, 3, -1])
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]))
    return fd


def _reshape_merge_then_sum() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        y = fd.ops.reshape(fd.ops.exp(x), [fd.ops.size(x, 0), -1])
        fd.add_output(fd.ops.sum(y, [1]))
    return fd


def _reshape_refactor() -> FusionDefinition:
    # [6, 10] -> [4, 15]: no axis survives, positions go through a division.
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 10])
        fd.add_output(fd.ops.add(fd.ops.reshape(x, [4, 15]), 1.0))
    return fd


def _reshape_of_reduction() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 12])
        r = fd.ops.sum(x, [0])
        fd.add_output(fd.ops.reshape(r, [3, 4]))
    return fd


# --- slice / select --------------------------------------------------------------------------

def _slice_steps() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.slice(fd.ops.neg(x), [1, 2], [None, 100], [2, 3]))
    return fd


def _slice_runtime_start() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        k = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.slice(x, [k, 0], [None, None]))
    return fd


def _select_middle() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.tanh(fd.ops.select(x, 1, 2)))
    return fd


def _causal_lm_shift() -> FusionDefinition:
    """HF's causal-LM loss shift, ``logits[:, :-1]`` against ``labels[:, 1:]``, negative
    indices as Python counts them."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        y = fd.define_tensor([-1, -1])
        shifted = fd.ops.slice(x, [0, 0, 0], [None, -1, None])
        nxt = fd.ops.slice(y, [0, 1], [None, None])
        shape = [fd.ops.size(x, 0), fd.ops.size(nxt, 1), fd.ops.size(x, 2)]
        fd.add_output(fd.ops.mul(shifted, fd.ops.broadcast_in_dim(nxt, shape, [0, 1])))
    return fd


def _last_token_and_window() -> FusionDefinition:
    """Last-token pooling ``h[:, -1]`` and a sliding window ``k[:, -3:]`` of one input."""
    with FusionDefinition() as fd:
        h = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.exp(fd.ops.select(h, 1, -1)))
        fd.add_output(fd.ops.slice(h, [0, -3, -100], [None, None, -2]))
    return fd


# --- pad / cat -------------------------------------------------------------------------------

def _pad_value() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.pad(fd.ops.exp(x), [1, 2, 3, 0], -1.5))
    return fd


def _pad_crop() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.pad(x, [-1, 2]))
    return fd


def _pad_int() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], DataType.Int32)
        fd.add_output(fd.ops.pad(x, [2, 1], 7))
    return fd


def _cat_three() -> FusionDefinition:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        c = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.cat([fd.ops.sin(a), b, fd.ops.mul(c, 3.0)], 1))
    return fd


def _cat_rows_then_sum() -> FusionDefinition:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        y = fd.ops.cat([a, b], 0)
        fd.add_output(fd.ops.sum(y, [0]))
    return fd


# --- triu / take_along_axis / gather ---------------------------------------------------------

def _triu(diagonal: int) -> Callable[[], FusionDefinition]:
    def build() -> FusionDefinition:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1, -1])
            fd.add_output(fd.ops.triu(fd.ops.add(x, 1.0), diagonal))
        return fd
    return build


def _take_along_axis() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1, -1], DataType.Int)
        fd.add_output(fd.ops.take_along_axis(x, i, 1))
    return fd


def _gather_smaller() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 7])
        i = fd.define_tensor([3, 4], DataType.Int)
        fd.add_output(fd.ops.gather(x, i, 0))
    return fd


# --- the LLaMA attention pre-processing --------------------------------------------------------

def _llama_rope() -> FusionDefinition:
    # q = x.view(B, S, H, D); q = q * cos + rotate_half(q) * sin; q.transpose(1, 2)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        cos = fd.define_tensor([-1, -1])
        sin = fd.define_tensor([-1, -1])
        b, s = fd.ops.size(x, 0), fd.ops.size(x, 1)
        q = fd.ops.reshape(x, [b, s, 4, 8])
        x1 = fd.ops.slice(q, [0, 0, 0, 0], [None, None, None, 4])
        x2 = fd.ops.slice(q, [0, 0, 0, 4], [None, None, None, 8])
        rot = fd.ops.cat([fd.ops.neg(x2), x1], -1)
        c = fd.ops.broadcast_in_dim(cos, [-1, -1, 4, 8], [1, 3])
        sn = fd.ops.broadcast_in_dim(sin, [-1, -1, 4, 8], [1, 3])
        y = fd.ops.add(fd.ops.mul(q, c), fd.ops.mul(rot, sn))
        fd.add_output(fd.ops.permute(y, [0, 2, 1, 3]))
    return fd


def _rope_ref(a: List[np.ndarray]) -> List[np.ndarray]:
    x, cos, sin = (_d(t) for t in a)
    q = x.reshape(x.shape[0], x.shape[1], 4, 8)
    rot = np.concatenate([-q[..., 4:], q[..., :4]], -1)
    return [(q * cos[None, :, None, :] + rot * sin[None, :, None, :]).transpose(0, 2, 1, 3)]


def _index(rng: np.random.Generator, n: int, shape: Tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, n, size=shape).astype(np.int64)


# --- remaps broadcast into a larger tensor's loops ------------------------------------------


def _positions_added() -> FusionDefinition:
    """GPT-2's learned positions as `x + wpe[:S]`, the slice broadcast over the batch."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        wpe = fd.define_tensor([-1, -1])
        pos = fd.ops.slice(wpe, [0, 0], [6, 5])
        fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(pos, [-1, -1, -1], [1, 2])))
    return fd


def _padded_scale() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1])
        p = fd.ops.pad(fd.ops.exp(b), [1, 2], 0.5)
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(p, [-1, -1, -1], [1, 2])))
    return fd


def _cat_broadcast() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.define_tensor([-1])
        b = fd.define_tensor([-1])
        c = fd.ops.cat([a, fd.ops.neg(b)], 0)
        fd.add_output(fd.ops.sub(x, fd.ops.broadcast_in_dim(c, [-1, -1], [1])))
    return fd


def _slice_broadcast_row_sum() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        ws = fd.ops.slice(w, [1], [8], [2])
        fd.add_output(fd.ops.sum(fd.ops.mul(x, fd.ops.broadcast_in_dim(ws, [-1, -1], [1])), [1]))
    return fd


def _qkv_split() -> FusionDefinition:
    """A fused QKV projection split into q, k, v heads: reshape, permute, then a squeezed
    slice per output."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        p = fd.ops.permute(fd.ops.reshape(x, [2, 3, 3, 2, 4]), [2, 0, 3, 1, 4])
        for k in range(3):
            fd.add_output(fd.ops.squeeze(fd.ops.slice(p, [k, 0, 0, 0, 0], [k + 1, 2, 2, 3, 4]), [0]))
    return fd


def _qkv_ref(a: List[np.ndarray]) -> List[np.ndarray]:
    p = _d(a[0]).reshape(2, 3, 3, 2, 4).transpose(2, 0, 3, 1, 4)
    return [p[0], p[1], p[2]]


CASES: Dict[str, Case] = {
    "reshape_split_heads": (_reshape_split_heads, lambda r: [_f32(r, 2, 5, 12)],
                            lambda a: [(2 * _d(a[0])).reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)], 1),
    "reshape_merge_then_sum": (_reshape_merge_then_sum, lambda r: [_f32(r, 3, 4, 5)],
                               lambda a: [np.exp(_d(a[0])).reshape(3, -1).sum(1)], 1),
    "reshape_refactor": (_reshape_refactor, lambda r: [_f32(r, 6, 10)],
                         lambda a: [_d(a[0]).reshape(4, 15) + 1.0], 1),
    "reshape_of_reduction": (_reshape_of_reduction, lambda r: [_f32(r, 9, 12)],
                             lambda a: [_d(a[0]).sum(0).reshape(3, 4)], 1),
    "slice_steps": (_slice_steps, lambda r: [_f32(r, 9, 11)], lambda a: [-_d(a[0])[1::2, 2::3]], 1),
    "causal_lm_shift": (_causal_lm_shift, lambda r: [_f32(r, 2, 6, 5), _f32(r, 2, 6)],
                        lambda a: [_d(a[0])[:, :-1] * _d(a[1])[:, 1:, None]], 1),
    "last_token_and_window": (_last_token_and_window, lambda r: [_f32(r, 3, 7, 6)],
                              lambda a: [np.exp(_d(a[0])[:, -1]), _d(a[0])[:, -3:, -100:-2]], 1),
    "select_middle": (_select_middle, lambda r: [_f32(r, 3, 4, 5)], lambda a: [np.tanh(_d(a[0])[:, 2])], 1),
    "pad_value": (_pad_value, lambda r: [_f32(r, 4, 5)],
                  lambda a: [np.pad(np.exp(_d(a[0])), ((3, 0), (1, 2)), constant_values=-1.5)], 1),
    "pad_crop": (_pad_crop, lambda r: [_f32(r, 3, 6)],
                 lambda a: [np.pad(_d(a[0])[:, 1:], ((0, 0), (0, 2)))], 1),
    "pad_int": (_pad_int, lambda r: [r.integers(-9, 9, size=6).astype(np.int32)],
                lambda a: [np.pad(a[0], (2, 1), constant_values=7)], 1),
    "cat_three": (_cat_three, lambda r: [_f32(r, 4, 3), _f32(r, 4, 5), _f32(r, 4, 2)],
                  lambda a: [np.concatenate([np.sin(_d(a[0])), _d(a[1]), 3 * _d(a[2])], 1)], 1),
    "cat_rows_then_sum": (_cat_rows_then_sum, lambda r: [_f32(r, 3, 7), _f32(r, 5, 7)],
                          lambda a: [np.concatenate([_d(a[0]), _d(a[1])], 0).sum(0)], 1),
    "triu_0": (_triu(0), lambda r: [_f32(r, 2, 5, 6)], lambda a: [np.triu(_d(a[0]) + 1.0, 0)], 1),
    "triu_neg": (_triu(-2), lambda r: [_f32(r, 2, 5, 6)], lambda a: [np.triu(_d(a[0]) + 1.0, -2)], 1),
    "triu_pos": (_triu(3), lambda r: [_f32(r, 2, 5, 6)], lambda a: [np.triu(_d(a[0]) + 1.0, 3)], 1),
    "take_along_axis": (_take_along_axis, lambda r: [_f32(r, 4, 6), _index(r, 6, (4, 9))],
                        lambda a: [np.take_along_axis(_d(a[0]), a[1], 1)], 1),
    "gather_smaller": (_gather_smaller, lambda r: [_f32(r, 5, 7), _index(r, 5, (3, 4))],
                       lambda a: [np.take_along_axis(_d(a[0])[:, :4], a[1], 0)], 1),
    "llama_rope": (_llama_rope, lambda r: [_f32(r, 2, 6, 32), _f32(r, 6, 8), _f32(r, 6, 8)], _rope_ref, 1),
    "group_norm": (_group_norm(4), lambda r: [_f32(r, 3, 12, 5, 7), _f32(r, 12), _f32(r, 12)],
                   _group_norm_ref(4), 1),
    "group_norm_one_group": (_group_norm(1), lambda r: [_f32(r, 2, 6, 3, 3), _f32(r, 6), _f32(r, 6)],
                             _group_norm_ref(1), 1),
    "group_norm_per_channel": (_group_norm(5), lambda r: [_f32(r, 2, 5, 1, 9), _f32(r, 5), _f32(r, 5)],
                               _group_norm_ref(5), 1),
    "group_norm_half_out": (_group_norm(2, DataType.Half),
                            lambda r: [_f32(r, 2, 8, 4, 4), _f32(r, 8), _f32(r, 8)],
                            _group_norm_ref(2, np.float16), 1),
    "instance_norm_flat": (_instance_norm_flat, lambda r: [_f32(r, 2, 3, 5, 6)], _instance_norm_ref, 1),
    "positions_added": (_positions_added, lambda r: [_f32(r, 3, 6, 5), _f32(r, 10, 7)],
                        lambda a: [_d(a[0]) + _d(a[1])[:6, :5][None]], 1),
    "padded_scale": (_padded_scale, lambda r: [_f32(r, 2, 4, 7), _f32(r, 4, 4)],
                     lambda a: [_d(a[0]) * np.pad(np.exp(_d(a[1])), ((0, 0), (1, 2)),
                                                  constant_values=0.5)[None]], 1),
    "cat_broadcast": (_cat_broadcast, lambda r: [_f32(r, 5, 7), _f32(r, 3), _f32(r, 4)],
                      lambda a: [_d(a[0]) - np.concatenate([_d(a[1]), -_d(a[2])])[None]], 1),
    "slice_broadcast_row_sum": (_slice_broadcast_row_sum, lambda r: [_f32(r, 6, 4), _f32(r, 9)],
                                lambda a: [(_d(a[0]) * _d(a[1])[1:8:2][None]).sum(1)], 1),
    "qkv_split": (_qkv_split, lambda r: [_f32(r, 2, 3, 24)], _qkv_ref, 1),
    "stepped_slice_reshape_of_reduction": (
        _stepped_slice_reshape_of_reduction, lambda r: [_f32(r, 5, 3, 1)],
        lambda a: [_d(a[0]).min(1, keepdims=True)[::2].reshape(1, -1, 1)], 2),
}


def _check(got: List[Any], want: List[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_auto_matches_numpy(name: str) -> None:
    build, inputs, ref, _ = CASES[name]
    fd = build()
    a = inputs(np.random.default_rng(1))
    _check(fd.execute(a), ref(a))


@pytest.mark.parametrize("name", sorted(CASES))
def test_as_written_matches_numpy(name: str) -> None:
    build, inputs, ref, _ = CASES[name]
    fd = build()
    a = inputs(np.random.default_rng(2))
    _check(fd.execute(a, as_written=True), ref(a))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_count(name: str) -> None:
    """Remaps read fusion inputs in their consumers' kernel: only a reduction, or a table
    narrowed before a gather, is a kernel boundary. An output reshaped after a reduction
    is computed at its source's shape and handed back reshaped."""
    build, inputs, _, kernels = CASES[name]
    low = build().lower(inputs(np.random.default_rng(3)))
    assert len(low.kernels) == kernels, low.host_program


def test_runtime_slice_start() -> None:
    fd = _slice_runtime_start()
    x = _f32(np.random.default_rng(4), 7, 3)
    for k in (0, 3, 7, 9):
        (got,) = fd.execute([x, k])
        np.testing.assert_array_equal(got, x[k:])


def test_runtime_pad_widths() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        w = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.pad(x, [w, 1], 2.0))
    x = _f32(np.random.default_rng(5), 5)
    for w in (0, 3):
        (got,) = fd.execute([x, w])
        np.testing.assert_array_equal(got, np.pad(x, (w, 1), constant_values=2.0))


def test_size_arithmetic_stays_a_scalar() -> None:
    """A sequence padded to a multiple of 8 as models compute it from its size, `(8 - s % 8)
    % 8` (remainder with Python's sign), and the sizes `neg`, `abs` and `fmod` give: Scalars
    usable in shapes, one definition for every size."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        d = fd.define_scalar(dtype=DataType.Int)
        s = fd.ops.size(x, 1)
        pad = fd.ops.remainder(fd.ops.sub(8, fd.ops.remainder(s, 8)), 8)
        fd.add_output(fd.ops.pad(x, [0, pad], 0.0))
        # `remainder` of a negative runtime scalar takes the divisor's sign; `fmod` truncates.
        fd.add_output(fd.ops.iota(fd.ops.remainder(d, 5), 0, 1, DataType.Int))
        fd.add_output(fd.ops.iota(fd.ops.add(fd.ops.fmod(d, 5), 5), 0, 1, DataType.Int))
        fd.add_output(fd.ops.iota(fd.ops.abs(d), 0, 1, DataType.Int))
        fd.add_output(fd.ops.full([fd.ops.add(fd.ops.neg(s), 20)], 1.5, DataType.Float))
    rng = np.random.default_rng(6)
    for cols, dv in [(5, -7), (8, 3), (13, -12), (16, 9)]:
        xv = _f32(rng, 3, cols)
        got = fd.execute([xv, dv])
        pad = (8 - cols % 8) % 8
        want = [np.pad(xv, ((0, 0), (0, pad))), np.arange(dv % 5), np.arange(int(np.fmod(dv, 5)) + 5),
                np.arange(abs(dv)), np.full(20 - cols, 1.5)]
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_half_and_bool_keep_their_dtype() -> None:
    with FusionDefinition() as fd:
        h = fd.define_tensor([-1], DataType.Half)
        b = fd.define_tensor([-1], DataType.Bool)
        fd.add_output(fd.ops.pad(h, [1, 1], 0.5))
        fd.add_output(fd.ops.cat([b, b], 0))
    h = np.arange(4).astype(np.float16)
    b = np.array([True, False, True])
    got_h, got_b = fd.execute([h, b])
    assert got_h.dtype == np.float16 and got_b.dtype == np.bool_
    np.testing.assert_array_equal(got_h, np.pad(h, 1, constant_values=0.5))
    np.testing.assert_array_equal(got_b, np.concatenate([b, b]))


def test_slice_of_reshape_of_slice_composes() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.slice(x, [1, 0], [5, None])
        z = fd.ops.reshape(y, [2, -1])
        fd.add_output(fd.ops.slice(z, [0, 3], [2, None], [1, 2]))
    x = _f32(np.random.default_rng(6), 7, 6)
    (got,) = fd.execute([x])
    np.testing.assert_array_equal(got, x[1:5].reshape(2, -1)[:, 3::2])
    assert len(fd.lower([x]).kernels) == 1


def test_strided_input_views() -> None:
    fd = _llama_rope()
    rng = np.random.default_rng(7)
    base = _f32(rng, 2, 32, 6).transpose(0, 2, 1)
    a = [base, _f32(rng, 6, 8), _f32(rng, 6, 8)]
    _check(fd.execute(a), _rope_ref(a))


def test_empty_inputs() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.cat([a, b], 1))
        fd.add_output(fd.ops.pad(a, [1, 1]))
    a, b = np.zeros((3, 0), np.float32), _f32(np.random.default_rng(8), 3, 2)
    got_cat, got_pad = fd.execute([a, b])
    np.testing.assert_array_equal(got_cat, b)
    np.testing.assert_array_equal(got_pad, np.zeros((3, 2), np.float32))


@pytest.mark.parametrize("as_written", [False, True])
def test_reshape_of_an_empty_tensor_then_pad(as_written: bool) -> None:
    """A reshape of a tensor with a zero extent divides by no extent: the padded lanes read
    nothing (found by tests/explore_auto.py, seed 1234)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        r = fd.ops.reshape(fd.ops.slice(x, [0, 1, 0], [2, 1, 4]), [0])
        fd.add_output(fd.ops.pad(r, [1, 2], 2.0))
        fd.add_output(fd.ops.reshape(x, [-1, 4]))
    a = _f32(np.random.default_rng(9), 2, 3, 4)
    got_pad, got_flat = fd.execute([a], as_written=as_written)
    np.testing.assert_array_equal(got_pad, np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(got_flat, a.reshape(-1, 4))
    (empty,) = fd.execute([np.zeros((2, 0, 4), np.float32)], as_written=as_written)[1:]
    assert empty.shape == (0, 4)


def test_stepped_slice_to_empty_then_reshape_and_pad() -> None:
    """The program tests/explore_auto.py found (seed 1234): a stepped slice of runtime-sized
    axes that is empty when it runs, reshaped and padded."""
    with FusionDefinition() as fd:
        t0 = fd.define_tensor([-1, -1, -1, -1])
        t10 = fd.ops.slice(t0, [0, 1, 2, 0], [1, None, 1, None], [3, 3, 1, 1])
        fd.add_output(fd.ops.pad(fd.ops.reshape(t10, [0]), [0, 3], 2.0))
    a = _f32(np.random.default_rng(10), 1, 1, 1, 1)
    for as_written in (False, True):
        (got,) = fd.execute([a], as_written=as_written)
        np.testing.assert_array_equal(got, np.full(3, 2.0, np.float32))


# --- errors ----------------------------------------------------------------------------------

def test_reshape_count_mismatch_is_refused() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        with pytest.raises(KilnError, match="24 elements"):
            fd.ops.reshape(x, [5, 5])
        with pytest.raises(KilnError, match="only one size may be -1"):
            fd.ops.reshape(x, [-1, -1])
        fd.add_output(x)


def test_reshape_runtime_mismatch_names_the_tensor() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.reshape(x, [3, -1]))
    with pytest.raises(KilnError, match="reshape of T0"):
        fd.execute([np.zeros((2, 5), np.float32)])
    with pytest.raises(KilnError, match="reshape of T0"):
        fd.lower([np.zeros((2, 5), np.float32)])
    (got,) = fd.execute([np.arange(12, dtype=np.float32).reshape(2, 6)])
    np.testing.assert_array_equal(got, np.arange(12).reshape(3, 4))


def test_cat_errors() -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        c = fd.define_tensor([-1, -1], DataType.Half)
        with pytest.raises(KilnError, match="rank"):
            fd.ops.cat([a, b], 0)
        del c  # (a half part is promoted, as torch.cat does: test_dtype_semantics.py)
        d = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.cat([a, d], 1))
    with pytest.raises(KilnError, match="axis 0 of T3 must have the size of axis 0 of T0"):
        fd.execute([np.zeros((2, 3), np.float32), np.zeros(1, np.float32), np.zeros((1, 1), np.float16),
                    np.zeros((4, 3), np.float32)])


def test_select_out_of_range() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, -1])
        with pytest.raises(KilnError, match="out of range"):
            fd.ops.select(x, 0, 3)
        k = fd.define_scalar(dtype=DataType.Int)
        fd.add_output(fd.ops.select(x, 1, k))
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(KilnError, match="select"):
        fd.execute([x, 4])
    (got,) = fd.execute([np.arange(12, dtype=np.float32).reshape(3, 4), 2])
    np.testing.assert_array_equal(got, [2, 6, 10])


def test_pad_and_slice_argument_errors() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(KilnError, match="even number"):
            fd.ops.pad(x, [1, 2, 3])
        with pytest.raises(KilnError, match="stride"):
            fd.ops.slice(x, [0, 0], [None, None], [1, 0])
        with pytest.raises(KilnError, match="one entry per axis"):
            fd.ops.slice(x, [0], [None])
        with pytest.raises(KilnError, match="rank"):
            fd.ops.triu(fd.ops.sum(x, [0]))
        fd.add_output(x)


def test_take_along_axis_errors() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 5])
        with pytest.raises(KilnError, match="rank"):
            fd.ops.take_along_axis(x, fd.define_tensor([-1], DataType.Int), 0)
        with pytest.raises(KilnError, match="dtype"):
            fd.ops.take_along_axis(x, fd.define_tensor([-1, -1]), 0)
        with pytest.raises(KilnError, match="must agree"):
            fd.ops.take_along_axis(x, fd.define_tensor([2, 3], DataType.Int), 0)
        i = fd.define_tensor([-1, 5], DataType.Int)
        fd.add_output(fd.ops.take_along_axis(x, i, 0))
    with pytest.raises(KilnError, match="index"):
        fd.execute([np.zeros((4, 5), np.float32), np.zeros(4, np.int64), np.zeros((4, 5), np.float32),
                    np.zeros((2, 3), np.int64), np.full((2, 5), 4, np.int64)])


# --- NVRTC and the GPU -----------------------------------------------------------------------

@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC wheels (see DEVELOPERS.md)")
def test_every_kernel_compiles() -> None:
    for name in sorted(CASES):
        build, inputs, _, _ = CASES[name]
        low = build().lower(inputs(np.random.default_rng(9)))
        for k in low.kernels:
            compile_cubin(k.cuda_source, k.kernel_name, arch="sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_numpy(name: str) -> None:
    cp = cupy_or_skip()
    build, inputs, ref, _ = CASES[name]
    fd = build()
    a = inputs(np.random.default_rng(10))
    got = fd.execute([cp.asarray(x) for x in a])
    _check([cp.asnumpy(g) for g in got], ref(a))


@pytest.mark.gpu
def test_gpu_rope_large_matches_the_interpreter() -> None:
    cp = cupy_or_skip()
    fd = _llama_rope()
    rng = np.random.default_rng(11)
    a = [_f32(rng, 4, 257, 32), _f32(rng, 257, 8), _f32(rng, 257, 8)]
    (got,) = fd.execute([cp.asarray(x) for x in a])
    (cpu,) = fd.execute(a)
    # The GPU contracts q * cos + rot * sin into fused multiply-adds: the last bit may differ.
    np.testing.assert_allclose(cp.asnumpy(got), cpu, rtol=1e-6, atol=1e-6)


def test_runtime_positions_are_checked() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        k = fd.define_scalar(dtype=DataType.Int)
        f = fd.define_scalar(dtype=DataType.Double)
        with pytest.raises(KilnError, match="Int scalars"):
            fd.ops.slice(x, [f], [None])
        with pytest.raises(KilnError, match="Int scalars"):
            fd.ops.pad(x, [f, 0])
        with pytest.raises(KilnError, match="Int scalars"):
            fd.ops.reshape(x, [f])
        fd.add_output(fd.ops.slice(x, [k], [None]))
    # A negative runtime start counts from the end, as in Python.
    (got,) = fd.execute([np.arange(4, dtype=np.float32), -1, 0.5])
    np.testing.assert_array_equal(got, [3])
    (got,) = fd.execute([np.arange(4, dtype=np.float32), 1, 0.5])
    np.testing.assert_array_equal(got, [1, 2, 3])


def test_gather_size_one_index_axis_keeps_the_index_shape() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([1, -1], DataType.Int)
        t = fd.ops.gather(x, i, 1)
        fd.add_output(t)
    assert t.shape == (1, -1)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    i = np.array([[0, 5, 2]])
    (got,) = fd.execute([x, i])
    np.testing.assert_array_equal(got, np.take_along_axis(x[:1], i, 1))


def test_segments_receive_the_inputs_their_sizes_come_from() -> None:
    # A sliced table of a gather, and a slice of a reduction next to an unrelated output:
    # the kernel that reads the remapped tensor needs the size of an input it does not read.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        i = fd.define_tensor([-1], DataType.Int)
        fd.add_output(fd.ops.index_select(fd.ops.slice(x, [1], [None]), i, 0))
    x = np.arange(3, dtype=np.float32)
    (got,) = fd.execute([x, np.array([1, 0], np.int64)])
    np.testing.assert_array_equal(got, x[1:][[1, 0]])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.slice(fd.ops.sum(y, [1]), [1], [None]))
        fd.add_output(fd.ops.add(x, y))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    got_s, got_a = fd.execute([a, a])
    np.testing.assert_array_equal(got_s, a.sum(1)[1:])
    np.testing.assert_array_equal(got_a, a + a)


def test_empty_numpy_arrays_are_contiguous() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], contiguity=[True, True, True])
        fd.add_output(fd.ops.exp(x))
    (got,) = fd.execute([np.zeros((2, 0, 3), np.float32)])
    assert got.shape == (2, 0, 3)


def test_index_select_with_a_0d_index_keeps_the_axis() -> None:
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        i = fd.define_tensor([], DataType.Int)
        fd.add_output(fd.ops.index_select(t, i, 0))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    (got,) = fd.execute([x, np.array(2)])
    np.testing.assert_array_equal(got, x[[2]])


@pytest.mark.parametrize("half", [8, 6])
def test_cat_of_halves_reads_each_vector_whole_or_pads_it(half: int) -> None:
    """rotate_half (RoPE): ``cat([-x[:, h:], x[:, :h]])`` times a weight, plus x. Where the halves
    meet at a multiple of the vector width each vector of a half is read whole or is all padding
    (no element loop in the kernel); otherwise the element loop stays. Values against NumPy,
    and the CUDA compiles where NVRTC is installed."""
    d = 2 * half
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, d])
        c = fd.define_tensor([d])
        a = fd.ops.slice(x, [0, 0], [None, half])
        b = fd.ops.slice(x, [0, half], [None, d])
        rot = fd.ops.cat([fd.ops.neg(b), a], -1)
        fd.add_output(fd.ops.add(x, fd.ops.mul(rot, fd.ops.broadcast(c, [True, False]))))
    rng = np.random.default_rng(3)
    xv, cv = _f32(rng, 37, d), _f32(rng, d)
    (got,) = fd.execute([xv, cv])
    x64 = _d(xv)
    want = x64 + np.concatenate([-x64[:, half:], x64[:, :half]], -1) * _d(cv)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    low = fd.lower([xv, cv])
    text = "\n".join(k.kernel_ir for k in low.kernels)
    aligned = "else zeros if" in text
    assert aligned == (half % 4 == 0), text
    if nvrtc_available():
        for k in low.kernels:
            compile_cubin(k.cuda_source, "k.cu", arch="sm_90")
