#!/usr/bin/env python3
"""What kiln's L2 evict_last hint buys a kernel, and what it costs the kernel that runs next.

Run on the H200::

    python3 benches/l2_hint.py [--rounds N]

kiln's automatic pointwise, normalization, gather and transpose schedules load their inputs
with an L2 evict_last hint unless ``KILN_L2_EVICT_LAST=0``, which kiln reads once per
process. So the script runs itself twice, in a child process per setting, and prints one table:

- *kernel*: kiln's layernorm, pointwise chain and index_select (the ``gpu_peers.py``
  workloads, M=16384, K=4096), each call timed alone after the L2 flush of ``gpu_peers.py``
  (a 256 MiB read and a reset of evict_last lines);
- *next kernel*: work that relies on L2, timed right after a kiln layernorm with nothing in
  between: six chained torch pointwise ops on 16 MB tensors (each reads the one before) and
  four sums of one 24 MB tensor. The layernorm's hinted input lines are what it meets in L2.

Times are medians over ``--rounds`` interleaved rounds of 20 calls, in µs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

RUNS = 20


def child(rounds: int) -> Dict[str, float]:
    """Medians of every case under this process's ``KILN_L2_EVICT_LAST``."""
    import torch  # noqa: PLC0415 - the parent only parses arguments and spawns

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_peers as gp  # noqa: PLC0415

    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    m, k = gp.M_FULL, gp.K
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(k, device="cuda", generator=g)
    b = torch.randn(k, device="cuda", generator=g)
    idx = torch.randint(0, m, (m,), device="cuda", dtype=torch.int64, generator=g)
    ln = gp.fusion_layernorm(k)
    pw = gp.fusion_pointwise(gp.DataType.Float)
    sel = gp.fusion_index_select()
    a = torch.randn(4 << 20, device="cuda", generator=g)
    r = torch.randn(6 << 20, device="cuda", generator=g)

    def chain() -> Any:
        t = a * 2.0
        for _ in range(5):
            t = t + 1.0
        return t

    def sums() -> Any:
        s = r.sum()
        for _ in range(3):
            s = s + r.sum()
        return s

    def run_ln() -> Any:
        return ln.execute([x, w, b])

    kernels: Dict[str, Callable[[], Any]] = {
        "kernel: layernorm": run_ln,
        "kernel: pointwise chain": lambda: pw.execute([x]),
        "kernel: index_select": lambda: sel.execute([x, idx]),
    }
    after: Dict[str, Callable[[], Any]] = {
        "next kernel: 6 chained 16 MB pointwise ops": chain,
        "next kernel: 4 sums of 24 MB": sums,
    }

    def timed_after(pre: Callable[[], Any], fn: Callable[[], Any]) -> float:
        for _ in range(gp.WARMUP):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
        for s, e in zip(starts, ends):
            gp.flush_l2()
            pre()
            torch.cuda._sleep(gp.SLEEP_CYCLES)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))

    for fn in [*kernels.values(), *after.values()]:
        fn()
    torch.cuda.synchronize()
    gp.warm_up_clocks(gp.CLOCK_WARMUP_S)
    per: Dict[str, List[float]] = {}
    names = list(kernels) + list(after)
    for rnd in range(rounds):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            if n in kernels:
                per.setdefault(n, []).append(statistics.median(gp.time_gpu_us(kernels[n], RUNS)))
            else:
                per.setdefault(n, []).append(timed_after(run_ln, after[n]))
    return {n: statistics.median(v) for n, v in per.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run both settings in child processes and print the table; 2 without a CUDA device."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of 20 calls (default 5)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.rounds)))
        return 0
    results: Dict[str, Dict[str, float]] = {}
    for setting in ("1", "0"):
        env = {**os.environ, "KILN_L2_EVICT_LAST": setting}
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            print(f"KILN_L2_EVICT_LAST={setting}: the run failed:\n{run.stderr.strip()[-2000:]}")
            return 2
        results[setting] = json.loads(run.stdout.strip().splitlines()[-1])
    width = max(len(n) for n in results["1"])
    print(f"\nkiln's L2 evict_last hint, median µs over {args.rounds} interleaved rounds of {RUNS} calls")
    print(f"{'case':{width}s} | hint on | hint off | on - off")
    print(f"{'-' * width}-+---------+----------+---------")
    for n, on in results["1"].items():
        off = results["0"][n]
        print(f"{n:{width}s} | {on:7.1f} | {off:8.1f} | {on - off:+7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
