"""Time the automatic path's planning of a gradient clip over k tensors (``clip_grad_norm_``
written per parameter: k sums of squares, one coefficient, k scaled outputs), the largest
fusion shape that multi-tensor training code writes. CPU only: lowering, no launch.

    python benches/foreach_compile.py [K ...]      (default 8 32 128 256)

prints, per k, the seconds ``kiln.execute.lowered_for`` takes on fresh sizes (nothing cached)
and the kernels it plans.
"""

from __future__ import annotations

import sys
import time
from typing import List

import numpy as np
from kiln import DataType, FusionDefinition
from kiln.execute import lowered_for


def clip(k: int) -> FusionDefinition:
    """The clip over k rank-1 gradients."""
    with FusionDefinition() as fd:
        gs = [fd.define_tensor([-1], dtype=DataType.Float) for _ in range(k)]
        total = None
        for g in gs:
            s = fd.ops.sum(fd.ops.mul(g, g), dims=[0])
            total = s if total is None else fd.ops.add(total, s)
        coef = fd.ops.minimum(fd.ops.div(1.0, fd.ops.add(fd.ops.sqrt(total), 1e-6)), 1.0)
        for g in gs:
            fd.add_output(fd.ops.mul(g, coef))
    return fd


def main(ks: List[int]) -> None:
    """Print the planning time for each k."""
    print(f"{'k':>5} {'plan s':>8} {'kernels':>8}")
    for k in ks:
        fd = clip(k)
        inputs = [np.ones(1000 + 7 * i, np.float32) for i in range(k)]
        t = time.perf_counter()
        low = lowered_for(fd, inputs)
        print(f"{k:>5} {time.perf_counter() - t:>8.2f} {len(low.kernels):>8}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8, 32, 128, 256])
