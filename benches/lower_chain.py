"""Lowering time of a chain of element-wise ops (``t = add(t, 1.0)`` N times): how the
automatic path scales with a fusion's depth. CPU only; prints seconds per ``fd.lower``.

Run::

    python benches/lower_chain.py [N ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kiln import FusionDefinition


def chain(n: int) -> FusionDefinition:
    """``x + 1.0 + 1.0 + ...`` (n adds) as one fusion."""
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1])
        for _ in range(n):
            t = fd.ops.add(t, 1.0)
        fd.add_output(t)
    return fd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="*", type=int, default=[100, 400, 2000, 8000])
    args = ap.parse_args()
    x = np.zeros(3, np.float32)
    for n in args.n:
        fd = chain(n)
        t0 = time.perf_counter()
        low = fd.lower([x])
        dt = time.perf_counter() - t0
        print(f"chain of {n:6d} adds: fd.lower {dt:8.3f} s, {len(low.kernels)} kernel(s)", flush=True)


if __name__ == "__main__":
    main()
