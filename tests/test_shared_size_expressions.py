"""Sizes and axes that share their parts: an axis sliced again and again, a size computed
from itself twice per step, a cat of parts of one runtime size, an axis split and merged back
again and again. The scalar DAG and the id graph hold each part once; walks, dumps and the
generated CUDA must not spell it out as a tree (each step doubled the text and the time: 24
slices did not lower in a minute). Values checked against NumPy in float64 on the CPU
interpreter; the CUDA text is the kernel a GPU would compile."""

from __future__ import annotations

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

# Generous: each case's CUDA is a few KB when shared parts are spelled once.
CUDA_CHARS = 400_000


def _cuda_chars(fd: FusionDefinition, ins: list) -> int:
    return sum(len(k.cuda_source) for k in fd.lower(ins).kernels)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_an_axis_sliced_again_and_again(n: int) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        t = x
        for _ in range(n):
            t = fd.ops.slice(t, [1], [None])
        fd.add_output(fd.ops.mul(t, 2.0))
    a = np.random.default_rng(n).standard_normal(100).astype(np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a[n:].astype(np.float64) * 2.0, rtol=1e-6)
    assert _cuda_chars(fd, [a]) < CUDA_CHARS
    assert len(str(fd)) < CUDA_CHARS
    # Sliced past its end: empty, not an error.
    (short,) = fd.execute([a[: n // 2]])
    assert short.shape == (0,)


def test_a_size_computed_from_itself_twice_per_step() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        m = fd.ops.size(x, 0)
        for _ in range(30):
            m = fd.ops.div(fd.ops.add(m, m), 2)
        fd.add_output(fd.ops.add(x, fd.ops.full([m], 1.0, DataType.Float)))
    a = np.arange(5, dtype=np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, a.astype(np.float64) + 1.0)
    assert len(str(fd)) < CUDA_CHARS
    assert _cuda_chars(fd, [a]) < CUDA_CHARS


def test_a_slice_of_a_cat_of_itself_again_and_again() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        t = x
        for _ in range(24):
            t = fd.ops.slice(fd.ops.cat([t, t], 0), [0], [fd.ops.size(x, 0)])
        fd.add_output(t)
    a = np.random.default_rng(3).standard_normal(37).astype(np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_array_equal(got, a)
    assert _cuda_chars(fd, [a]) < CUDA_CHARS


@pytest.mark.parametrize("t", [6, 9, 16])
def test_an_unrolled_scan_of_one_wide_slices_joined_by_cat(t: int) -> None:
    # Every part has the runtime size min(i1, 1); the cat's size is t of them, spelled
    # as a product, not a sum of t copies in every bounds check. Each of the t (t + 1) / 2
    # slices is a read held in registers before the math: the pointwise scheduler counts
    # them against its register budget (16 steps in 4-wide vectors spilled 6.6 KB and took
    # NVRTC 41 s; the conftest compiles each kernel and fails on spills).
    b, c = 2, 5
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        acc, parts = None, []
        for k in range(t):
            s = fd.ops.slice(x, [0, k, 0], [b, k + 1, c])
            acc = s if acc is None else fd.ops.add(acc, s)
            parts.append(acc)
        fd.add_output(fd.ops.cat(parts, dim=1))
    a = np.random.default_rng(t).standard_normal((b, t, c)).astype(np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, np.cumsum(a.astype(np.float64), 1), rtol=1e-5, atol=1e-5)
    low = fd.lower([a])
    assert "+ min(i1, 1) + min(i1, 1)" not in "".join(k.kernel_ir for k in low.kernels)


def test_an_axis_split_and_merged_back_again_and_again() -> None:
    # A hand schedule: each split merged back shares its input between the merge's two
    # operands; walking every path of the id graph doubled with each pair (30 pairs: 30 s).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    for _ in range(40):
        y.split(1, 2)
        y.merge(1)
    a = np.random.default_rng(4).standard_normal((8, 63)).astype(np.float32)
    (got,) = fd.execute([a])
    np.testing.assert_allclose(got, np.exp(a.astype(np.float64)), rtol=1e-6)
