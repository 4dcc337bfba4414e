"""Lowering time of a chain of element-wise ops (``t = add(t, 1.0)`` N times): how the
automatic path scales with a fusion's depth. CPU only; prints seconds per ``fd.lower``.
``--scalar`` chains a Double scalar input instead (``s * 1.0001 + 1.0 ...``), then adds it
to a tensor.

Run::

    python benches/lower_chain.py [N ...] [--scalar]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kiln import DataType, FusionDefinition


def chain(n: int) -> FusionDefinition:
    """``x + 1.0 + 1.0 + ...`` (n adds) as one fusion."""
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1])
        for _ in range(n):
            t = fd.ops.add(t, 1.0)
        fd.add_output(t)
    return fd


def scalar_chain(n: int) -> FusionDefinition:
    """``x + (s * 1.0001 + 1.0 ...)`` (n scalar ops) as one fusion."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        t = fd.define_scalar(dtype=DataType.Double)
        for i in range(n):
            t = fd.ops.add(t, 1.0) if i % 2 else fd.ops.mul(t, 1.0001)
        fd.add_output(fd.ops.add(x, t))
    return fd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="*", type=int, default=[100, 400, 2000, 8000])
    ap.add_argument("--scalar", action="store_true", help="chain scalar ops, not tensor ops")
    args = ap.parse_args()
    x = np.zeros(3, np.float32)
    for n in args.n:
        fd = scalar_chain(n) if args.scalar else chain(n)
        inputs = [x, 0.5] if args.scalar else [x]
        t0 = time.perf_counter()
        low = fd.lower(inputs)
        dt = time.perf_counter() - t0
        what = "scalar ops" if args.scalar else "adds"
        print(f"chain of {n:6d} {what}: fd.lower {dt:8.3f} s, {len(low.kernels)} kernel(s)", flush=True)


if __name__ == "__main__":
    main()
