"""Run named benches/models.py workloads a few times each, kiln and torch.compile, for a profiler.

Meant to run under Nsight Compute, which then reports every kernel of both (kiln's kernels are
named ``kiln_*``, torch.compile's ``triton_*``)::

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \\
        --section Occupancy --section WarpStateStats -k regex:'kiln|triton' --launch-skip 2 \\
        python3 benches/profile_kernels.py gpt2_causal_softmax_half layernorm_backward

Each workload runs ``--calls`` times after a warm-up call that compiles, inside an NVTX range
``timed <workload> <kiln|compile>`` (``--nvtx --nvtx-include 'regex:timed .*/'`` keeps
torch.compile's autotuning launches out of the profile); ``--no-peer`` leaves
torch.compile out. ``--dump`` prints kiln's host program and CUDA source of each workload.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    """See the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("names", nargs="+", help="workload names of benches/models.py")
    ap.add_argument("--calls", type=int, default=2, help="calls per workload after the warm-up")
    ap.add_argument("--no-peer", action="store_true", help="run kiln only")
    ap.add_argument("--dump", action="store_true", help="print kiln's host program and CUDA source")
    args = ap.parse_args(argv)
    if not models.import_torch():
        print("torch is not importable")
        return 2
    torch = models.torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(models.SEED)
    for w in models.select(args.names):
        fam, ins = models.gpu_inputs(w, w.sizes, gen)
        low = fam.fd.lower(ins)
        print(f"== {w.name} {'x'.join(map(str, w.sizes))}: {len(low.kernels)} kernel(s): "
              + ", ".join(k.kernel_name for k in low.kernels), flush=True)
        if args.dump:
            print(low.host_program)
            for k in low.kernels:
                print(k.cuda_source)
        runs: List[Tuple[str, Callable[[], Any]]] = [("kiln", functools.partial(fam.fd.execute, ins))]
        if not args.no_peer:
            eager_fn, peer_args = w.peer(ins)
            compiled = torch.compile(eager_fn, dynamic=False)
            runs.append(("compile", functools.partial(compiled, *peer_args)))
        for name, fn in runs:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.nvtx.range_push(f"timed {w.name} {name}")
            start.record()
            for _ in range(args.calls):
                fn()
            end.record()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"   {name}: {start.elapsed_time(end) * 1000 / args.calls:.1f} µs per call "
                  "(back to back, L2 not flushed)", flush=True)
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
