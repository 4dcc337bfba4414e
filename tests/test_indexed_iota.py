"""An iota read through views that are not affine in one output position shares its
consumer's loops.

``arange(n)[:, None].expand(n, 2).reshape(2 * n)`` (torch's ``repeat_interleave`` of an
``arange``, as GPT-J's rotary embedding duplicates its angles), a tiled or transposed and
flattened ``arange``, reads the iota at positions such as ``o / 2`` or ``o % n``. The iota's
value there is computed element-wise from the output's positions, so the whole fusion is one
kernel where the iota used to be stored by a kernel of its own. Every result is checked
against NumPy in float64; a property test draws iota dtypes, starts, steps and chains of
views.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for

DTYPES = {
    "float": (DataType.Float, np.float32),
    "double": (DataType.Double, np.float64),
    "int32": (DataType.Int32, np.int32),
    "int64": (DataType.Int, np.int64),
    "half": (DataType.Half, np.float16),
}


def _arange(n: int, start: float, step: float, dt: str) -> np.ndarray:
    """The iota's values: integers exactly, floats as ``start + i * step`` in float (double
    for a double iota), then rounded to the dtype."""
    i = np.arange(n)
    if dt in ("int32", "int64"):
        return (int(start) + i * int(step)).astype(DTYPES[dt][1])
    if dt == "double":
        return start + i.astype(np.float64) * step
    return (np.float32(start) + i.astype(np.float32) * np.float32(step)).astype(DTYPES[dt][1])


def test_gptj_rotary_angles_duplicated_by_interleaving_are_one_kernel() -> None:
    """GPT-J's ``fixed_pos_embedding`` + ``duplicate_interleave`` + ``apply_rotary_pos_emb``
    (the sin half): positions and inverse frequencies are both iotas."""
    b, s, d = 2, 12, 16
    with FusionDefinition() as fd:
        q = fd.define_tensor([b, s, d])
        pos = fd.ops.iota(s, 0.0, 1.0, DataType.Float)
        expo = fd.ops.iota(d // 2, 0.0, 2.0 / d, DataType.Float)
        inv_freq = fd.ops.reciprocal(fd.ops.pow(10000.0, expo))
        ang = fd.ops.mul(fd.ops.broadcast_in_dim(pos, [s, d // 2], [0]),
                         fd.ops.broadcast_in_dim(inv_freq, [s, d // 2], [1]))
        sin = fd.ops.reshape(fd.ops.broadcast_in_dim(fd.ops.sin(ang), [s, d // 2, 2], [0, 1]), [s, d])
        fd.add_output(fd.ops.mul(q, fd.ops.broadcast_in_dim(sin, [b, s, d], [1, 2])))
    q0 = np.random.default_rng(0).standard_normal((b, s, d)).astype(np.float32)
    inv = 1.0 / 10000.0 ** (np.arange(d // 2) * (2.0 / d))
    want = q0 * np.repeat(np.sin(np.arange(s)[:, None] * inv[None]), 2, axis=1)[None]
    np.testing.assert_allclose(fd.execute([q0])[0], want, rtol=1e-5, atol=1e-5)
    assert len(lowered_for(fd, [q0]).kernels) == 1


def test_an_interleaved_arange_over_runtime_rows_is_one_kernel() -> None:
    """The consumer's sizes are symbolic: the positions mix a runtime extent."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 48])
        r = fd.ops.reshape(fd.ops.broadcast_in_dim(fd.ops.iota(16, 2, 3, DataType.Int), [16, 3], [0]), [48])
        fd.add_output(fd.ops.add(x, fd.ops.broadcast_in_dim(r, [fd.ops.size(x, 0), 48], [1])))
    x0 = np.random.default_rng(1).standard_normal((5, 48)).astype(np.float32)
    want = x0 + np.repeat(2 + 3 * np.arange(16), 3)[None]
    np.testing.assert_allclose(fd.execute([x0])[0], want, rtol=1e-6)
    assert len(lowered_for(fd, [x0]).kernels) == 1


VIEWS = ["interleave", "tile", "split", "transpose", "flatten", "slice"]


def _viewed(fd: FusionDefinition, v: Any, a: np.ndarray, view: str, r: int) -> Tuple[Any, np.ndarray]:
    sh = list(a.shape)
    if view == "interleave":
        v = fd.ops.broadcast_in_dim(v, sh + [r], list(range(len(sh))))
        return fd.ops.reshape(v, sh[:-1] + [sh[-1] * r]), np.repeat(a, r, axis=-1)
    if view == "tile":
        v = fd.ops.broadcast_in_dim(v, [r] + sh, list(range(1, len(sh) + 1)))
        return fd.ops.reshape(v, [r * sh[0]] + sh[1:]), np.concatenate([a] * r, axis=0)
    if view == "split" and sh[-1] % r == 0 and sh[-1] > r:
        new = sh[:-1] + [r, sh[-1] // r]
        return fd.ops.reshape(v, new), a.reshape(new)
    if view == "transpose" and len(sh) >= 2:
        p = list(range(len(sh)))
        p[-1], p[-2] = p[-2], p[-1]
        return fd.ops.permute(v, p), a.transpose(p)
    if view == "flatten":
        return fd.ops.reshape(v, [a.size]), a.reshape(-1)
    if view == "slice" and sh[0] >= 3:
        rank = len(sh)
        return fd.ops.slice(v, [1] + [0] * (rank - 1), sh, [2] + [1] * (rank - 1)), a[1::2]
    return v, a


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([6, 7, 12, 24, 30]),
    dt=st.sampled_from(sorted(DTYPES)),
    start=st.sampled_from([0, 1, -3, 0.5]),
    step=st.sampled_from([1, 2, -1, 0.25]),
    views=st.lists(st.tuples(st.sampled_from(VIEWS), st.sampled_from([2, 3])), min_size=1, max_size=4),
)
def test_viewed_iotas_match_numpy_in_one_kernel(n: int, dt: str, start: float, step: float,
                                                views: List[Tuple[str, int]]) -> None:
    if dt in ("int32", "int64"):
        start, step = int(start), int(step)
    with FusionDefinition() as fd:
        v = fd.ops.iota(n, start, step, DTYPES[dt][0])
        a = _arange(n, start, step, dt)
        for view, r in views:
            v, a = _viewed(fd, v, a, view, r)
        x = fd.define_tensor(list(a.shape))
        fd.add_output(fd.ops.add(fd.ops.cast(v, DataType.Double), x))
    x0 = np.random.default_rng(n).standard_normal(a.shape).astype(np.float32)
    want = a.astype(np.float64) + x0
    np.testing.assert_allclose(fd.execute([x0])[0], want, rtol=1e-6, atol=1e-6 * (1 + np.abs(a).max()))
    assert len(lowered_for(fd, [x0]).kernels) == 1


def test_a_float_iota_moved_by_a_pad_slice_or_cat_keeps_its_values() -> None:
    """A float iota read at shifted positions (a pad of 42, a slice from 3, a cat behind 5
    ones) takes the value the iota has there, ``start + i * step`` in float, to within one
    rounding: a start moved by ``42 * step`` first read 0 as -2.6e-7."""
    with FusionDefinition() as fd:
        it = fd.ops.iota(10, 0.5, -0.1, dtype=DataType.Float)
        fd.add_output(fd.ops.pad(it, [42, 0]))
        fd.add_output(fd.ops.slice(it, [3], [10]))
        fd.add_output(fd.ops.cat([fd.ops.full([5], 1.0, DataType.Float), it], 0))
    padded, sliced, cat = fd.execute([])
    a = np.float32(0.5) + np.arange(10).astype(np.float32) * np.float32(-0.1)
    tol = float(np.spacing(np.float32(0.5)))
    np.testing.assert_allclose(padded, np.concatenate([np.zeros(42), a]), rtol=0, atol=tol)
    np.testing.assert_allclose(sliced, a[3:], rtol=0, atol=tol)
    np.testing.assert_allclose(cat, np.concatenate([np.ones(5), a]), rtol=0, atol=tol)
    assert len(lowered_for(fd, []).kernels) == 1
