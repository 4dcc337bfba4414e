"""A bfloat16 softmax over [2^30 / N, N] for N from 1k to 262k columns (computed in float, as
models write it), kiln's automatic schedule against ``torch.compile(dynamic=False)``: device
time per call (CUDA events, L2 flushed before each call, median of ``--runs``), the fraction
of a device-to-device copy of the minimum traffic (read the input once, write the output
once, measured in the same run) and kiln / torch.compile. Run: ``python3 benches/long_rows.py
[N ...]`` (needs a GPU, torch and kiln). Prints one line per N."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_peers import copy_bandwidth, time_gpu_us  # noqa: E402
from kiln import DataType, FusionDefinition  # noqa: E402


def softmax() -> FusionDefinition:
    """``softmax(x.float(), 1).to(bfloat16)`` as a fusion."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        xf = fd.ops.cast(x, DataType.Float)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[1], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)), DataType.BFloat16))
    return fd


def main() -> None:
    """Measure every row length and print the lines."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("cols", type=int, nargs="*", default=[1024, 4096, 16384, 65536, 131072, 262144])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    copy = copy_bandwidth(args.runs)["gbps"]
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    compiled: Any = torch.compile(lambda x: torch.softmax(x.float(), dim=1).to(torch.bfloat16), dynamic=False)
    for n in args.cols:
        m = (1 << 30) // n
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        fd = softmax()
        err = float((fd.execute([x])[0].float() - torch.softmax(x.float(), 1)).abs().max())
        k = statistics.median(time_gpu_us((lambda f, a: lambda: f.execute([a]))(fd, x), args.runs))
        t = statistics.median(time_gpu_us((lambda a: lambda: compiled(a))(x), args.runs))
        frac = [2 * m * n * 2 / us / 1e3 / copy for us in (k, t)]
        print(f"N={n:7d} kiln {k:8.1f} us {frac[0]:.3f} of copy | torch.compile {t:8.1f} us {frac[1]:.3f} "
              f"| kiln / torch.compile {t / k:.3f} | max error {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
