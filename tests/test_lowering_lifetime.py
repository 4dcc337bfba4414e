"""Lowered kernels live as long as their users hold them: a long-running process that lowers
many fusions must not keep every kernel it ever made."""

from __future__ import annotations

import gc
import weakref

import numpy as np
from kiln import FusionDefinition, lowering


def _lowered_kernel_ref() -> weakref.ref:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.relu(fd.ops.mul(x, 2.0)))
    a = np.ones((3, 5), dtype=np.float32)
    low = fd.lower([a])
    (out,) = fd.execute([a])
    np.testing.assert_array_equal(out, np.full((3, 5), 2.0, dtype=np.float32))
    return weakref.ref(low.kernels[0])


def test_lowered_kernels_are_freed_with_their_fusion():
    lowering.record_generated(False)
    try:
        ref = _lowered_kernel_ref()
        gc.collect()
        assert ref() is None, "a LoweredKernel outlived its fusion and every reference to it"
    finally:
        lowering.record_generated(True)
