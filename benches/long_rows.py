"""Row-wise bfloat16 workloads over [2^30 / N, N] for N from 1k to 262k columns, written the
way models write them (bfloat16 storage, float math), kiln's automatic schedule against
``torch.compile(dynamic=False)``:

* ``softmax``: ``softmax(x.float(), 1).to(bfloat16)``, output bfloat16 [M, N];
* ``cross_entropy``: ``F.cross_entropy(x.float(), labels, reduction='none')`` with int64
  labels [M], i.e. ``logsumexp(x[i].float()) - x[i, labels[i]].float()``, output float [M]
  (the label's logit is picked with ``take_along_axis``);
* ``rmsnorm``: LLaMA's RMSNorm (HF ``LlamaRMSNorm``): ``h = x.float(); h = h *
  rsqrt(mean(h², -1, keepdim) + 1e-6); w * h.to(bfloat16)`` with a bfloat16 weight [N],
  output bfloat16 [M, N].

For every workload and N, kiln's result is checked against torch eager (the maximum absolute
error is printed; a line says MISMATCH when it is out of tolerance), then kiln and torch.compile are
timed: device time per call (CUDA events, L2 flushed before each call, median of ``--runs``),
the fraction of a device-to-device copy of the minimum traffic (softmax: read x, write y;
cross_entropy: read x, labels, write loss; rmsnorm: read x and w, write y; the copy's bandwidth
is measured once per run) and kiln / torch.compile (> 1: kiln is faster). One line per
(workload, N), then a table of both ratios (rows workloads, columns N).

Run (needs a GPU, torch and kiln; each input is 2 GiB)::

    python3 benches/long_rows.py [N ...] [--only softmax,rmsnorm] [--runs 10]

Without a GPU, ``python3 benches/long_rows.py --cpu-check`` builds the same three fusions and
checks them on small NumPy inputs (bfloat16 from ``ml_dtypes``) against a float64 NumPy
reference; it does not import torch.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
from kiln import DataType, FusionDefinition

sys.path.insert(0, str(Path(__file__).resolve().parent))

COLS = [1024, 4096, 16384, 65536, 131072, 262144]
ELEMENTS = 1 << 30  # M * N: every input is 2 GiB of bfloat16
RMS_EPS = 1e-6
CPU_SHAPES: List[Tuple[int, int]] = [(4, 1000), (3, 4096), (2, 1031)]


# ----------------------------------------------------------------------------- the fusions
def _rows(fd: FusionDefinition, v: Any) -> Any:
    """A rank-1 per-row statistic [M] broadcast to [M, N]."""
    return fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[0])


def softmax() -> FusionDefinition:
    """``softmax(x.float(), 1).to(bfloat16)`` as a fusion."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        xf = fd.ops.cast(x, DataType.Float)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[1], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)), DataType.BFloat16))
    return fd


def cross_entropy() -> FusionDefinition:
    """``F.cross_entropy(x.float(), labels, reduction='none')`` as a fusion."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        labels = fd.define_tensor([-1], dtype=DataType.Int)
        xf = fd.ops.cast(x, DataType.Float)
        mx = fd.ops.max(xf, dims=[1])
        e = fd.ops.exp(fd.ops.sub(xf, _rows(fd, mx)))
        lse = fd.ops.add(fd.ops.log(fd.ops.sum(e, dims=[1])), mx)
        # x.gather(1, labels.unsqueeze(1)).squeeze(1).float(): the label's logit of each row
        index = fd.ops.broadcast_in_dim(labels, shape=[-1, 1], broadcast_dims=[0])
        picked = fd.ops.squeeze(fd.ops.take_along_axis(x, index, 1), [1])
        fd.add_output(fd.ops.sub(lse, fd.ops.cast(picked, DataType.Float)))
    return fd


def rmsnorm(n: int) -> FusionDefinition:
    """LLaMA RMSNorm in bfloat16 for rows of ``n`` (``1 / n`` baked in, as a tracer does)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        w = fd.define_tensor([-1], dtype=DataType.BFloat16)
        h = fd.ops.cast(x, DataType.Float)
        variance = fd.ops.mul(fd.ops.sum(fd.ops.mul(h, h), dims=[1], keepdim=True), 1.0 / n)
        h = fd.ops.mul(h, fd.ops.rsqrt(fd.ops.add(variance, RMS_EPS)))
        w2 = fd.ops.broadcast_in_dim(w, shape=[-1, -1], broadcast_dims=[1])
        fd.add_output(fd.ops.mul(w2, fd.ops.cast(h, DataType.BFloat16)))
    return fd


# ----------------------------------------------------------------------------- the workloads
@dataclass(frozen=True)
class Workload:
    """One row-wise workload: its fusion, its minimum traffic, its output and its tolerance."""

    name: str
    build: Callable[[int], FusionDefinition]  # N -> the unscheduled fusion
    min_bytes: Callable[[int, int], int]  # (M, N) -> bytes read once + written once
    out_dtype: str  # NumPy's and torch's name of the output's dtype
    rtol: float
    atol: float


WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("softmax", lambda n: softmax(), lambda m, n: 2 * m * n * 2, "bfloat16", 0.0, 1e-2),
        Workload("cross_entropy", lambda n: cross_entropy(), lambda m, n: m * n * 2 + m * 8 + m * 4,
                 "float32", 2e-2, 2e-2),
        Workload("rmsnorm", rmsnorm, lambda m, n: 2 * m * n * 2 + n * 2, "bfloat16", 1e-2, 5e-2),
    )
}


def numpy_inputs(name: str, m: int, n: int, seed: int = 0) -> List[np.ndarray]:
    """Small bfloat16 (``ml_dtypes``) NumPy inputs of workload ``name``."""
    import ml_dtypes  # noqa: PLC0415

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, n)) * (2.0 if name == "cross_entropy" else 1.0)).astype(bf16)
    if name == "cross_entropy":
        return [x, rng.integers(0, n, size=m).astype(np.int64)]
    if name == "rmsnorm":
        return [x, (1.0 + 0.1 * rng.standard_normal(n)).astype(bf16)]
    return [x]


def numpy_reference(name: str, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Workload ``name`` in float64 (no intermediate rounding) from NumPy ``inputs``."""
    x = inputs[0].astype(np.float64)
    if name == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if name == "cross_entropy":
        mx = x.max(axis=1)
        lse = np.log(np.exp(x - mx[:, None]).sum(axis=1)) + mx
        return lse - x[np.arange(x.shape[0]), inputs[1]]
    w = inputs[1].astype(np.float64)
    return w * (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + RMS_EPS))


def cpu_check(names: Sequence[str], shapes: Sequence[Tuple[int, int]]) -> int:
    """Run each fusion with ``fd.execute`` on NumPy inputs; the number of mismatches."""
    bad = 0
    for name in names:
        w = WORKLOADS[name]
        for m, n in shapes:
            inputs = numpy_inputs(name, m, n)
            out = np.asarray(w.build(n).execute(list(inputs))[0])
            ref = numpy_reference(name, inputs)
            ok = out.shape == ref.shape and out.dtype.name == w.out_dtype
            diff = np.abs(out.astype(np.float64) - ref) if ok else np.full(1, np.inf)
            err = float(diff.max())
            ok = ok and bool(np.all(diff <= w.atol + w.rtol * np.abs(ref)))
            bad += not ok
            print(f"{'ok' if ok else 'MISMATCH'} {name:13s} [{m}, {n}] {out.dtype} max error {err:.2e} "
                  f"(rtol {w.rtol:g}, atol {w.atol:g})", flush=True)
    return bad


# ----------------------------------------------------------------------------- the GPU run
def torch_functions() -> Dict[str, Callable[..., Any]]:
    """The torch code of each workload, as models write it (imports torch)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415

    def softmax_t(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.float(), dim=1).to(torch.bfloat16)

    def cross_entropy_t(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), labels, reduction="none")

    def rmsnorm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + RMS_EPS)
        return w * h.to(x.dtype)

    return {"softmax": softmax_t, "cross_entropy": cross_entropy_t, "rmsnorm": rmsnorm_t}


def torch_inputs(name: str, m: int, n: int) -> List[Any]:
    """CUDA inputs of workload ``name`` for [m, n] (imports torch)."""
    import torch  # noqa: PLC0415

    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if name == "cross_entropy":
        return [x.mul_(2.0), torch.randint(0, n, (m,), device="cuda", dtype=torch.int64)]
    if name == "rmsnorm":
        return [x, (1.0 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)]
    return [x]


def median_us(fn: Callable[[], Any], runs: int) -> float:
    """Median GPU time of ``fn`` in microseconds (``gpu_peers.time_gpu_us``)."""
    from gpu_peers import time_gpu_us  # noqa: PLC0415

    return statistics.median(time_gpu_us(fn, runs))


def measure(name: str, n: int, runs: int, copy: float) -> Tuple[float, float]:
    """Check and time workload ``name`` at N = ``n``; (kiln / copy, torch.compile / kiln)."""
    import torch  # noqa: PLC0415
    import torch._dynamo  # noqa: PLC0415

    w = WORKLOADS[name]
    m = ELEMENTS // n
    inputs = torch_inputs(name, m, n)
    eager = torch_functions()[name]
    torch._dynamo.reset()  # a fresh compile per shape, clear of dynamo's recompile limit
    compiled: Any = torch.compile(eager, dynamic=False)
    fd = w.build(n)
    out = fd.execute(list(inputs))[0]
    ref = eager(*inputs)
    if out.shape != ref.shape or out.dtype != getattr(torch, w.out_dtype):
        raise AssertionError(f"{name} N={n}: kiln's output is {out.dtype} {tuple(out.shape)}, torch's "
                             f"{ref.dtype} {tuple(ref.shape)}")
    ref = ref.float()
    diff = (out.float() - ref).abs()
    err = float(diff.max())
    ok = bool((diff <= w.atol + w.rtol * ref.abs()).all())
    del out, ref, diff
    if not ok:  # reported on the line, and the run goes on to the other sizes
        print(f"MISMATCH {name} N={n}: kiln's max error {err:.2e} against torch eager is out of "
              f"tolerance (rtol {w.rtol:g}, atol {w.atol:g})", flush=True)
    k = median_us(functools.partial(fd.execute, list(inputs)), runs)
    t = median_us(functools.partial(compiled, *inputs), runs)
    frac = [w.min_bytes(m, n) / us / 1e3 / copy for us in (k, t)]
    print(f"{name:13s} N={n:7d} kiln {k:8.1f} us {frac[0]:.3f} of copy | torch.compile {t:8.1f} us "
          f"{frac[1]:.3f} | kiln / torch.compile {t / k:.3f} | max error {err:.2e}", flush=True)
    del inputs, fd, compiled
    torch.cuda.empty_cache()
    return frac[0], t / k


def table(title: str, results: Dict[Tuple[str, int], Tuple[float, float]], names: Sequence[str],
          cols: Sequence[int], which: int) -> str:
    """Rows = workloads, columns = N, cells = entry ``which`` of each result."""
    lines = [f"{title:18s}" + "".join(f"{n:>9d}" for n in cols)]
    for name in names:
        lines.append(f"{name:18s}" + "".join(
            f"{results[(name, n)][which]:9.3f}" if (name, n) in results else f"{'-':>9s}" for n in cols))
    return "\n".join(lines)


def gpu_run(names: Sequence[str], cols: Sequence[int], runs: int) -> None:
    """Measure every workload at every N and print the lines and the table."""
    from gpu_peers import copy_bandwidth  # noqa: PLC0415

    copy = copy_bandwidth(runs)["gbps"]
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    results: Dict[Tuple[str, int], Tuple[float, float]] = {}
    for name in names:
        for n in cols:
            results[(name, n)] = measure(name, n, runs, copy)
    print()
    print(table("kiln / copy", results, names, cols, 0))
    print()
    print(table("kiln/torch.compile", results, names, cols, 1))
    print("(kiln/torch.compile: torch.compile's time over kiln's; > 1 means kiln is faster)")


def parse_only(text: str) -> List[str]:
    """The comma-separated workload names of ``--only``, checked."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return names


def main() -> None:
    """Parse the arguments; run the CPU check or the GPU measurement."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cols", type=int, nargs="*", default=COLS, help="row lengths N (M = 2^30 / N)")
    ap.add_argument("--only", type=parse_only, default=list(WORKLOADS),
                    help=f"comma-separated workloads (default all: {','.join(WORKLOADS)})")
    ap.add_argument("--runs", type=int, default=10, help="timed calls per measurement (median)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="check the fusions on small NumPy inputs against NumPy (no GPU, no torch)")
    args = ap.parse_args()
    if args.cpu_check:
        bad = cpu_check(args.only, CPU_SHAPES)
        print("cpu check: all ok" if not bad else f"cpu check: {bad} MISMATCH(ES)")
        sys.exit(1 if bad else 0)
    gpu_run(args.only, args.cols, args.runs)


if __name__ == "__main__":
    main()
