"""Property test: an out-of-range gather index is reported as the user wrote the fusion.

Whatever the automatic schedule does to an index tensor (a vectorized cache of an input, a
copy broadcast to the output's rank, a recomputed chain of index arithmetic, a strided or
transposed array), the error names the index tensor of the definition (``T{n}`` as its
``Tensor.name``), the value, and the element by its row-major position in that tensor, and
the table by the definition's tensor. Runs in the CPU interpreter, on both the automatic path
and the fusion as written.
"""

from __future__ import annotations

import re
from typing import Any, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError

KINDS = ["index_select", "take_along_axis", "gather"]


def _name(t: Any) -> str:
    """Regex of a tensor's name, not matched by a longer number."""
    return rf"(?<![A-Za-z0-9]){re.escape(t.name)}(?!\d)"


def _build(kind: str, rank: int, dim: int, shift: int, index_shape: Tuple[int, ...]) -> Tuple[Any, Any, Any]:
    """A fusion gathering from x with an index tensor (an input, or ``input + shift`` when
    ``shift``); returns it, x and the index tensor as the definition named them."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        i = fd.define_tensor([-1] * len(index_shape), dtype=DataType.Int)
        idx = fd.ops.add(i, shift) if shift else i
        if kind == "index_select":
            out = fd.ops.index_select(x, idx, dim)
        elif kind == "take_along_axis":
            out = fd.ops.take_along_axis(x, idx, dim)
        else:
            out = fd.ops.gather(x, idx, dim)
        fd.add_output(fd.ops.mul(out, 2.0))
    return fd, x, idx


@st.composite
def cases(draw: Any) -> Tuple[Any, ...]:
    kind = draw(st.sampled_from(KINDS))
    rank = draw(st.integers(1, 3))
    dim = draw(st.integers(0, rank - 1))
    x_shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    if kind == "index_select":
        index_shape: Tuple[int, ...] = (draw(st.integers(1, 9)),)
    else:
        # Off `dim`, sizes equal x's (a definition of symbolic sizes cannot cut x to a smaller
        # gather index).
        index_shape = tuple(draw(st.integers(1, 7)) if a == dim else x_shape[a] for a in range(rank))
    shift = draw(st.sampled_from([0, 0, 3]))
    n = int(np.prod(index_shape))
    bad_at = draw(st.integers(0, n - 1))
    bad_value = draw(st.sampled_from([x_shape[dim], x_shape[dim] + 5, -1]))
    layout = draw(st.sampled_from(["contiguous", "reversed", "transposed"]))
    as_written = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return kind, rank, dim, x_shape, index_shape, shift, bad_at, bad_value, layout, as_written, seed


def _index_array(shape: Tuple[int, ...], extent: int, shift: int, bad_at: int, bad_value: int,
                 layout: str, rng: np.random.Generator) -> np.ndarray:
    """Valid indices (after ``+ shift``) everywhere but row-major element ``bad_at``, laid out
    as asked (the values by logical position are the same)."""
    vals = rng.integers(0, extent, size=shape) - shift
    flat = vals.reshape(-1)
    flat[bad_at] = bad_value - shift
    vals = flat.reshape(shape).astype(np.int64)
    if layout == "reversed" and vals.ndim >= 1:
        vals = np.ascontiguousarray(vals[::-1])[::-1]
    elif layout == "transposed" and vals.ndim >= 2:
        vals = np.ascontiguousarray(vals.T).T
    return vals


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_out_of_range_index_names_the_definitions_tensor_and_element(case: Tuple[Any, ...]) -> None:
    kind, rank, dim, x_shape, index_shape, shift, bad_at, bad_value, layout, as_written, seed = case
    rng = np.random.default_rng(seed)
    fd, x, idx = _build(kind, rank, dim, shift, index_shape)
    xs = rng.standard_normal(x_shape).astype(np.float32)
    ia = _index_array(index_shape, x_shape[dim], shift, bad_at, bad_value, layout, rng)
    with pytest.raises(KilnError) as info:
        fd.execute([xs, ia], as_written=as_written)
    msg = str(info.value)
    assert re.search(_name(idx), msg), f"index {idx.name} not named: {msg}"
    assert re.search(rf"holds {bad_value} at element {bad_at}\b", msg), (
        f"expected value {bad_value} at element {bad_at}: {msg}")
    assert re.search(_name(x), msg), f"table {x.name} not named: {msg}"


@pytest.mark.parametrize("as_written", [False, True], ids=["auto", "as_written"])
def test_valid_indices_of_every_layout_match_numpy(as_written: bool) -> None:
    # The same fusions with every index in range give NumPy's answer (the check above does
    # not pass by refusing everything).
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((4, 5, 6)).astype(np.float32)
    for layout in ("contiguous", "reversed", "transposed"):
        for shift in (0, 3):
            fd, _, _ = _build("take_along_axis", 3, 1, shift, (4, 7, 6))
            ia = _index_array((4, 7, 6), 5, shift, 0, 2, layout, rng)
            (out,) = fd.execute([xs, ia], as_written=as_written)
            want = np.take_along_axis(xs.astype(np.float64), ia + shift, 1) * 2.0
            np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
            fd2, _, _ = _build("index_select", 3, 2, shift, (9,))
            ib = _index_array((9,), 6, shift, 0, 1, "contiguous", rng)
            (out2,) = fd2.execute([xs, ib], as_written=as_written)
            want2 = np.take(xs.astype(np.float64), ib + shift, 2) * 2.0
            np.testing.assert_allclose(out2, want2, rtol=1e-6, atol=0)



@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("shift", [0, 3])
def test_gpu_error_word_reports_the_definitions_element(layout: str, shift: int) -> None:
    from gpu_util import cupy_or_skip  # noqa: PLC0415

    cp = cupy_or_skip()
    rng = np.random.default_rng(11)
    fd, x, idx = _build("take_along_axis", 2, 1, shift, (5, 9))
    xs = rng.standard_normal((5, 6)).astype(np.float32)
    ia = _index_array((5, 9), 6, shift, 23, 6, "contiguous", rng)
    dev = cp.asarray(ia) if layout == "contiguous" else cp.asarray(np.ascontiguousarray(ia.T)).T
    fd.execute([cp.asarray(xs), dev])
    with pytest.raises(KilnError) as info:
        fd.check_errors()
    msg = str(info.value)
    assert re.search(_name(idx), msg) and re.search(_name(x), msg), msg
    assert re.search(r"held 6 at element 23\b", msg), msg
