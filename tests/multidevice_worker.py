"""One rank of the multi-GPU checks: run with
``python -m torch.distributed.run --nproc_per_node=N tests/multidevice_worker.py``.

Each rank builds the same sharded fusions, runs them on its local slices (torch CUDA
tensors, and CuPy arrays for one of them) with NCCL doing the collectives, and compares its
outputs with its part of the unsharded float64 NumPy result. Prints ``RANK r OK name`` per
check and ``ALL OK`` on rank 0 when every rank passed; exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, List, Sequence

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kiln import DeviceMesh, FusionDefinition  # noqa: E402
from test_multidevice import adamw_ddp, adamw_ref, layer_norm, layer_norm_ref, part, row_sum, shard  # noqa: E402


def main() -> int:
    """Run every check on this rank; returns the process exit code."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = DeviceMesh(range(world))
    rng = np.random.default_rng(1234)  # same global data on every rank
    failures: List[str] = []

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def check(name: str, got: Sequence[Any], want: Sequence[np.ndarray], rtol: float, atol: float) -> None:
        try:
            for g, w in zip(got, want):
                g = g.cpu().numpy() if isinstance(g, torch.Tensor) else np.asarray(g.get())
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
            print(f"RANK {rank} OK {name}", flush=True)
        except AssertionError as e:
            failures.append(name)
            print(f"RANK {rank} FAIL {name}: {e!r}\n{traceback.format_exc()}", flush=True)

    # Row sum over a sharded axis.
    fd, _ = row_sum(mesh)
    x = rng.standard_normal((64, 96 * world)).astype(np.float32)
    (s,) = fd.execute([dev(part(x, 1, rank, world))])
    check("row_sum", [s], [x.astype(np.float64).sum(1)], 1e-4, 1e-4)
    if rank == 0:
        print(fd.lower([dev(part(x, 1, 0, world))]).host_program, flush=True)

    # LayerNorm over a sharded hidden axis (torch and CuPy inputs), twice (cached path).
    fd = layer_norm(mesh)
    x = (rng.standard_normal((128, 256 * world)) * 2 + 1).astype(np.float32)
    w = rng.standard_normal(256 * world).astype(np.float32)
    b = rng.standard_normal(256 * world).astype(np.float32)
    ref = part(layer_norm_ref(x, w, b), 1, rank, world)
    ins = [dev(part(x, 1, rank, world)), dev(part(w, 0, rank, world)), dev(part(b, 0, rank, world))]
    for it in range(2):
        (y,) = fd.execute(ins)
        check(f"layer_norm[{it}]", [y], [ref], 1e-4, 1e-4)
    try:
        import cupy  # noqa: PLC0415

        (y,) = fd.execute([cupy.asarray(t.cpu().numpy()) for t in ins])
        check("layer_norm_cupy", [y], [ref], 1e-4, 1e-4)
    except ImportError:
        pass

    # Gradient allreduce + fused AdamW.
    fd = adamw_ddp(mesh)
    n = 1 << 20
    g = rng.standard_normal((world, n)).astype(np.float32)
    p, m = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    v = rng.random(n).astype(np.float32)
    outs = fd.execute([dev(part(g, 0, rank, world)), dev(p), dev(m), dev(v)])
    check("adamw_ddp", outs, adamw_ref(g, p, m, v), 1e-5, 1e-6)

    # Allgather (output declared replicated) and ReduceScatter.
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1])
        yt = fd.ops.tanh(xt)
        fd.add_output(yt)
    shard(xt, 1, mesh)
    yt.set_device_mesh(mesh)
    x = rng.standard_normal((32, 48 * world)).astype(np.float32)
    (y,) = fd.execute([dev(part(x, 1, rank, world))])
    check("allgather", [y], [np.tanh(x.astype(np.float64))], 1e-5, 1e-6)

    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1, -1])
        st = fd.ops.sum(xt, [0])
        fd.add_output(st)
    shard(xt, 0, mesh)
    shard(st, 2, mesh)
    x = rng.standard_normal((world, 16, 8 * world)).astype(np.float32)
    (y,) = fd.execute([dev(part(x, 0, rank, world))])
    check("reduce_scatter", [y], [part(x.astype(np.float64).sum(0), 1, rank, world)], 1e-5, 1e-5)

    # A whole weight read beside a sharded axis (each rank reads its slice), and a
    # logsumexp over the sharded axis (partial results gathered, finished on every rank).
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1])
        wt = fd.define_tensor([-1])
        yt = fd.ops.mul(xt, fd.ops.broadcast(wt, [True, False]))
        fd.add_output(yt)
        fd.add_output(fd.ops.logsumexp(yt, [1]))
    shard(xt, 1, mesh)
    x = rng.standard_normal((64, 40 * world)).astype(np.float32)
    w = rng.standard_normal(40 * world).astype(np.float32)
    y64 = x.astype(np.float64) * w
    m = y64.max(1)
    lse = m + np.log(np.exp(y64 - m[:, None]).sum(1))
    outs = fd.execute([dev(part(x, 1, rank, world)), dev(w)])
    check("whole_weight_and_logsumexp", outs, [part(y64, 1, rank, world), lse], 1e-5, 1e-5)

    ok = torch.tensor([0 if failures else 1], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0 and int(ok.item()) == 1:
        print(f"ALL OK on {world} rank(s)", flush=True)
    dist.destroy_process_group()
    return 0 if int(ok.item()) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

