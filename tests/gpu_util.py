"""Helpers for GPU tests: the skip check (they run only where CuPy sees a CUDA device) and a
plan rewrite that stands in for a kernel whose semaphore is not reset."""

from __future__ import annotations

from typing import Any

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


def plan_without_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the host evaluator plan every zeroed-pool buffer as if its kernel left it dirty:
    ``resets_to_zero`` off, placed in the workspace arena and zeroed before each launch
    that uses it (what the Rust planner does for such a buffer; kiln's own grid reductions
    all reset their semaphores, so this is how the per-launch zeroing path gets run)."""
    from kiln import host

    real = host.plan_program

    def rewrite(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        moved = []
        for bid, b in enumerate(plan.buffers):
            if b.place == "zero_pool":
                offset = (plan.arena_bytes + 255) // 256 * 256
                plan.arena_bytes = offset + b.nbytes
                plan.buffers[bid] = b._replace(resets_to_zero=False, place="arena", offset=offset)
                moved.append(bid)
        plan.zero_pool_bytes = 0
        plan.launches = [la._replace(memsets=la.memsets + tuple(b for b in moved if b in la.args))
                         for la in plan.launches]
        return plan

    monkeypatch.setattr(host, "plan_program", rewrite)
