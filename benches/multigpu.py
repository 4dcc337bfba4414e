"""Sharded fusions across GPUs against their parts: kiln's whole per-rank program (local
kernels + NCCL collectives) versus the sum of its local kernels' time alone and its
collectives' time alone, measured in the same run.

    python -m torch.distributed.run --standalone --nproc_per_node=N benches/multigpu.py [--json F]

Workloads: LayerNorm over a sharded hidden axis (x [8192, 16384] float32, weight and bias
sharded, two Allreduces of the row statistics), and a data-parallel step (each rank's
float32 gradient of 64M parameters averaged by an Allreduce, then a fused AdamW update).
Times are per call, back to back on the rank's stream (CUDA events, host overhead
included), the slowest rank's; "host" is the host time to issue one call, and "no comm" the
whole program with collectives that do nothing. The collective alone is torch.distributed's NCCL call on
buffers of the same size; its bus bandwidth is NCCL's definition (allreduce:
bytes * 2(n-1)/n / time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kiln import DeviceMesh  # noqa: E402
from kiln.multidevice import Work, mesh_run  # noqa: E402
from test_multidevice import adamw_ddp, layer_norm, part  # noqa: E402


def timed(fn: Callable[[], Any], iters: int = 20, warm: int = 3) -> float:
    """Microseconds per call of ``fn``, back to back, the slowest rank's."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) * 1e3 / iters], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class NoComm:
    """A communicator whose collectives do nothing: the program's time without them."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def allreduce(self, x: Any, op: str) -> Work:
        """Skip the reduction."""
        return Work()

    def allgather(self, out: Any, x: Any) -> Work:
        """Skip the gather."""
        return Work()

    def reduce_scatter(self, out: Any, x: Any, op: str) -> Work:
        """Skip the reduce-scatter."""
        return Work()


def host_us(fn: Callable[[], Any], iters: int = 20) -> float:
    """Microseconds of host time per call of ``fn`` (issue only, no synchronisation inside)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / iters


def parts(fd: Any, inputs: List[Any]) -> Dict[str, float]:
    """Time the whole program, each local stage alone, and each collective alone."""
    run = mesh_run(fd)
    captured: List[List[Any]] = []
    for st in run.stages:
        real = st.execute

        def record(args: Any, device: Any = None, _real: Any = real, **kw: Any) -> Any:
            captured.append(list(args))
            return _real(args, device=device, **kw)

        st.execute = record  # type: ignore[method-assign]
    fd.execute(inputs)
    for st in run.stages:
        del st.execute
    torch.cuda.synchronize()
    whole = timed(lambda: fd.execute(inputs))
    host = host_us(lambda: fd.execute(inputs))
    nocomm = NoComm(dist.get_rank(), dist.get_world_size())
    without = timed(lambda: fd.execute(inputs, comm=nocomm))
    kernels = sum(timed(lambda st=st, a=a: st.execute(a)) for st, a in zip(run.stages, captured))
    comm = 0.0
    comm_bytes = 0
    for kind, _op, src, _dst, _in_place in run.comms:
        shape = run.shapes(inputs)[src]
        buf = torch.empty(shape, dtype=torch.float32, device="cuda")
        comm_bytes += buf.numel() * buf.element_size()
        if kind == "Allreduce":
            comm += timed(lambda b=buf: dist.all_reduce(b))
        elif kind == "Allgather":
            out = torch.empty([dist.get_world_size(), *shape], device="cuda")
            comm += timed(lambda b=buf, o=out: dist.all_gather_into_tensor(o, b))
        else:
            out = torch.empty(shape[1:], device="cuda")
            comm += timed(lambda b=buf, o=out: dist.reduce_scatter_tensor(o, b))
    n = dist.get_world_size()
    busbw = comm_bytes * 2 * (n - 1) / n / (comm * 1e-6) / 1e9 if comm > 0 and n > 1 else 0.0
    return {"kiln_us": whole, "host_us": host, "no_comm_us": without, "kernels_us": kernels,
            "comm_us": comm, "comm_bytes": comm_bytes, "busbw_GBps": busbw,
            "ratio": whole / (kernels + comm)}


def main() -> None:
    """Run both workloads on every rank; rank 0 prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here (rank 0)")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = DeviceMesh(range(n))
    rng = np.random.default_rng(0)
    rows: Dict[str, Dict[str, float]] = {}

    rows_, hidden = 8192, 16384
    x = torch.from_numpy(part(rng.standard_normal((rows_, hidden), dtype=np.float32), 1, rank, n)).cuda()
    w = torch.from_numpy(part(rng.standard_normal(hidden, dtype=np.float32), 0, rank, n)).cuda()
    b = torch.from_numpy(part(rng.standard_normal(hidden, dtype=np.float32), 0, rank, n)).cuda()
    rows[f"layernorm sharded hidden [{rows_}, {hidden}]"] = parts(layer_norm(mesh), [x, w, b])
    del x, w, b

    p = 1 << 26
    g = torch.randn(1, p, device="cuda")
    prm, m, v = torch.randn(p, device="cuda"), torch.randn(p, device="cuda"), torch.rand(p, device="cuda")
    rows[f"grad allreduce + AdamW [{p}]"] = parts(adamw_ddp(mesh), [g, prm, m, v])

    if rank == 0:
        print(f"{n} rank(s), {torch.cuda.get_device_name()}")
        head = (f"{'workload':44s} {'kiln us':>9s} {'host':>9s} {'no comm':>9s} {'kernels':>9s} "
                f"{'comm':>9s} {'busbw GB/s':>10s} {'ratio':>6s}")
        print(head)
        for name, r in rows.items():
            print(f"{name:44s} {r['kiln_us']:9.1f} {r['host_us']:9.1f} {r['no_comm_us']:9.1f} "
                  f"{r['kernels_us']:9.1f} {r['comm_us']:9.1f} {r['busbw_GBps']:10.1f} {r['ratio']:6.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": n, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
