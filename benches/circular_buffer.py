"""Circular buffering on the GPU: a float32 row sum over [M, N] (M * N = 2^28 elements, 1 GiB)
for N from 4k to 256k, streamed through Shared memory by one hand schedule in five forms,
against kiln's automatic schedule and ``torch.sum``, in one run:

* ``shared``:   the row's tiles of 2048 floats copied to Shared memory by 256 threads, then
  summed (a barrier between, no pipelining);
* ``cb4``:      the same copy circular-buffered over 4 stages (prefetch 3), as asynchronous
  ``cp.async`` copies;
* ``bulk``:     each tile one bulk (TMA) copy by one thread, waited on through an mbarrier;
* ``bulk_cb4``: bulk copies circular-buffered over 4 stages (read-after-write and
  write-after-read mbarriers);
* ``auto``:     the unscheduled fusion (kiln's automatic schedule).

Device time per call (CUDA events, L2 flushed before each call, median of ``--runs``), GB/s of
the input read, and the fraction of a device-to-device copy measured in the same run. Run:
``python3 benches/circular_buffer.py`` (needs a GPU, CuPy and torch). Prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402
import torch  # noqa: E402
from gpu_peers import copy_bandwidth, time_gpu_us  # noqa: E402
from kiln import FusionDefinition, MemoryType, ParallelType  # noqa: E402

TILE, THREADS, STAGES = 2048, 256, 4
TOTAL = 1 << 28


def row_sum(kind: str) -> FusionDefinition:
    """``sum(x, 1)``, scheduled as ``kind`` (see the module docstring)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    if kind == "auto":
        return fd
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, s):
        t.split(1, TILE)  # [m, n / TILE, TILE]
        t.axis(0).parallelize(ParallelType.BIDx)
    # Thread t sums elements t, t + 256, ...: consecutive threads, consecutive banks.
    s.split(2, THREADS)
    s.axis(3).parallelize(ParallelType.TIDx)
    if kind.startswith("bulk"):
        c.axis(2).parallelize(ParallelType.Bulk)
    else:
        c.split(2, THREADS)
        c.axis(3).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    if kind.endswith("cb4"):
        c.circular_buffer(STAGES)
    return fd


KINDS = ["shared", "cb4", "bulk", "bulk_cb4", "auto"]


def main() -> None:
    """Measure every form at every row length and print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--cols", type=int, nargs="*", default=[4096, 16384, 65536, 262144])
    args = ap.parse_args()
    copy = copy_bandwidth(args.runs)["gbps"]
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    rows: List[Dict[str, Any]] = []
    for n in args.cols:
        m = TOTAL // n
        xt = torch.rand(m, n, device="cuda", dtype=torch.float32) - 0.5
        x = cp.asarray(xt)
        want = xt.double().sum(1)
        fns: Dict[str, Callable[[], Any]] = {"torch.sum": (lambda a: lambda: torch.sum(a, 1))(xt)}
        for kind in KINDS:
            fd = row_sum(kind)
            fns[kind] = (lambda f, a: lambda: f.execute([a]))(fd, x)
        for name, fn in fns.items():
            got = torch.as_tensor(fn()[0] if name != "torch.sum" else fn(), device="cuda").double()
            err = float((got - want).abs().max())
            ok = err <= 1e-3 * max(1.0, float(want.abs().max()))
            us = statistics.median(time_gpu_us(fn, args.runs))
            gbps = m * n * 4 / us / 1e3
            rows.append({"n": n, "m": m, "name": name, "us": us, "gbps": gbps, "copy": gbps / copy, "ok": ok})
            print(f"N={n:7d} {name:10s} {us:9.1f} us {gbps:7.0f} GB/s {gbps / copy:6.3f} of copy "
                  f"{'ok' if ok else f'MISMATCH {err:.3g}'}", flush=True)
    print()
    print(f"row sum float32, M x N = 2^28, device time (median of {args.runs}); copy {copy:.0f} GB/s")
    names = ["torch.sum", *KINDS]
    print(f"{'N':>7} " + " ".join(f"{k:>16}" for k in names))
    for n in args.cols:
        cells = []
        for k in names:
            r: Optional[Dict[str, Any]] = next((r for r in rows if r["n"] == n and r["name"] == k), None)
            cells.append(f"{r['us']:8.1f} ({r['copy']:.2f})" if r else "n/a")
        print(f"{n:>7} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
