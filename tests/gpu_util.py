"""Skip helper for GPU tests: they run only where CuPy sees a CUDA device."""

from __future__ import annotations

import pytest


def cupy_or_skip():  # noqa: ANN201 - returns the cupy module
    """Import CuPy and check for a device, else skip the test."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:  # CUDA driver missing
        pytest.skip(f"no CUDA device: {e}")
    return cp
