#!/usr/bin/env python3
"""The model-family fusions of tests/families.py at model-like sizes on the GPU.

Run on a GPU machine (CuPy needed; torch too for the bfloat16 families, which CuPy cannot
hold)::

    python3 benches/families.py [--json out.json] [--only NAME ...] [--runs 20] [--no-flush-l2]

Each family is built unscheduled at its ``bench`` size (``tests/families.py`` ``SPECS``), its
NumPy inputs are made on the host and copied to the GPU, and one ``fd.execute`` on them is
checked against the family's float64 NumPy reference with the family's tolerances. Then
``--runs`` calls (after 3 warm-up calls) are timed as in benches/gpu_peers.py: each call
is bracketed by its own pair of CUDA events; before each, L2 is flushed (lines kept with an
evict_last hint are first returned to normal priority through ``cuCtxResetPersistingL2Cache``,
then a 256 MiB buffer is read) and a short spin kernel is queued so that the host gets ahead
of the GPU and the events time the GPU work of the call, not Python launch overhead. The
median is reported.

GB/s = the family's minimum traffic (inputs read once, outputs written once; a gather counts
only the rows it reads) / median time. Kernels = ``len(fd.lower(inputs).kernels)`` of the
automatic schedule, against the fewest that can do it.

Prints one line per family as it goes and the table last; ``--json`` writes every result.
Exit status: 0 when every family ran and matched, 1 when one mismatched, 2 when none
mismatched but some raised (or there is no CUDA device).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import families as fams  # noqa: E402

WARMUP = 3
RUNS = 20
FLUSH_BYTES = 256 << 20  # over four times the H200's L2
SPIN_CYCLES = 2_000_000  # about 1 ms at H200 clocks: keeps the host ahead of the GPU
SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}
"""


# ----------------------------------------------------------------------------- devices
def import_cupy() -> Optional[Any]:
    """CuPy with a CUDA device, or None."""
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # no CuPy, no driver
        return None
    return cupy


def import_torch() -> Optional[Any]:
    """torch with CUDA, or None."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def is_bf16(a: Any) -> bool:
    """A NumPy (ml_dtypes) bfloat16 array."""
    return isinstance(a, np.ndarray) and str(a.dtype) == "bfloat16"


def to_device(inputs: Sequence[Any], kind: str, cp: Any, torch: Optional[Any]) -> List[Any]:
    """NumPy inputs as CuPy arrays or torch CUDA tensors (Python scalars unchanged)."""
    out: List[Any] = []
    for a in inputs:
        if not isinstance(a, np.ndarray):
            out.append(a)
        elif kind == "cupy":
            out.append(cp.asarray(a))
        elif is_bf16(a):
            out.append(torch.from_numpy(a.astype(np.float32)).to(device="cuda", dtype=torch.bfloat16))
        else:
            out.append(torch.from_numpy(np.ascontiguousarray(a)).to("cuda"))
    return out


# ----------------------------------------------------------------------------- timing
@functools.cache
def _reset_persisting_fn() -> Optional[Callable[[], int]]:
    """libcuda's ``cuCtxResetPersistingL2Cache``, or None where libcuda cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1").cuCtxResetPersistingL2Cache
    except (OSError, AttributeError):
        return None


class Timer:
    """CUDA-event timing of one call at a time on CuPy's current stream (kiln launches CuPy
    inputs there, and torch inputs on torch's current stream: both the default stream here)."""

    def __init__(self, cp: Any, flush_l2: bool) -> None:
        self.cp = cp
        self.flush_l2 = flush_l2
        self._flush = cp.ones(FLUSH_BYTES // 4, dtype=cp.float32) if flush_l2 else None
        self._spin = cp.RawKernel(SPIN_SOURCE, "spin")
        self.resets_persisting = _reset_persisting_fn() is not None

    def flush(self) -> None:
        """Return evict_last lines to normal priority, then read a buffer larger than L2."""
        if self._flush is None:
            return
        fn = _reset_persisting_fn()
        if fn is not None:
            self.cp.cuda.runtime.deviceSynchronize()  # the reset acts at once, not in stream order
            rc = fn()
            if rc != 0:
                raise RuntimeError(f"cuCtxResetPersistingL2Cache failed with CUresult {rc}")
        self._flush.sum()

    def time_us(self, fn: Callable[[], Any], runs: int) -> List[float]:
        """GPU time of each of ``runs`` calls of ``fn`` in microseconds, after WARMUP calls."""
        cp = self.cp
        for _ in range(WARMUP):
            fn()
        cp.cuda.runtime.deviceSynchronize()
        starts = [cp.cuda.Event() for _ in range(runs)]
        ends = [cp.cuda.Event() for _ in range(runs)]
        for start, end in zip(starts, ends):
            self.flush()
            self._spin((1,), (1,), (np.int64(SPIN_CYCLES),))
            start.record()
            fn()
            end.record()
        cp.cuda.runtime.deviceSynchronize()
        return [cp.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in zip(starts, ends)]


# ----------------------------------------------------------------------------- one family
def error_text(e: BaseException) -> str:
    """``Type: message``, first line only."""
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def compare(fam: fams.Family, outs: Sequence[Any], wants: Sequence[np.ndarray]) -> Dict[str, Any]:
    """Worst error of the outputs as a multiple of the family's tolerance (<= 1 passes)."""
    if len(outs) != len(wants):
        return {"check": "MISMATCH", "detail": f"{len(outs)} outputs, expected {len(wants)}", "ratio": None}
    worst = 0.0
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = fams.output_f64(out)
        if got.shape != want.shape:
            return {"check": "MISMATCH", "detail": f"output {i}: shape {got.shape}, expected {want.shape}",
                    "ratio": None}
        rtol, atol = fam.tol(i)
        if got.size:
            with np.errstate(invalid="ignore", divide="ignore"):
                lim = atol + rtol * np.abs(want)
                err = np.abs(got - want)
                ratio = np.where(err == 0, 0.0, err / np.where(lim > 0, lim, np.inf))
                ratio = np.where(np.isnan(got) != np.isnan(want), np.inf, ratio)
            worst = max(worst, float(np.nanmax(ratio)))
    ok = worst <= 1.0
    return {"check": "ok" if ok else "MISMATCH", "detail": f"max error {worst:.3g} x tolerance",
            "ratio": worst}


def run_family(spec: fams.Spec, timer: Timer, cp: Any, torch: Optional[Any], runs: int) -> Dict[str, Any]:
    """Build, check and time one family at its bench size."""
    row: Dict[str, Any] = {"family": spec.name, "sizes": list(spec.bench), "inputs": None, "kernels": None,
                           "min_kernels": None, "median_us": None, "min_us": None, "runs": 0,
                           "bytes": None, "gbps": None, "check": "ERROR", "detail": "", "error": None}
    t0 = time.perf_counter()
    try:
        fam = spec.build(spec.bench)
        row["min_kernels"] = fam.kernels
        kind = "torch" if "BFloat16" in fam.dtypes else "cupy"
        if kind == "torch" and torch is None:
            row.update(check="n/a", detail="bfloat16 needs torch (CuPy has no bfloat16)")
            return row
        row["inputs"] = kind
        host = fam.inputs()
        dev = to_device(host, kind, cp, torch)
        row["kernels"] = len(fam.fd.lower(dev).kernels)
        outs = fam.fd.execute(dev)
        row["bytes"] = fam.bytes_moved(dev, outs)
        row.update(compare(fam, outs, fam.expected(host)))
        del outs, host
        times = timer.time_us(lambda: fam.fd.execute(dev), runs)
        row.update(median_us=statistics.median(times), min_us=min(times), runs=len(times), times_us=times)
        row["gbps"] = row["bytes"] / row["median_us"] / 1e3
    except Exception as e:  # a refusal or a failure is a result: record it and go on
        row.update(check="ERROR", error=error_text(e), detail=error_text(e))
    finally:
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- reporting
def fmt(v: Optional[float], spec: str) -> str:
    """``v`` formatted, or ``-``."""
    return "-" if v is None else format(v, spec)


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The results as a text table."""
    head = f"{'family':36s} {'sizes':24s} {'kernels':>9s} {'GPU us':>10s} {'GB/s':>8s}  check"
    lines = [head, "-" * len(head)]
    for r in rows:
        kern = "-" if r["kernels"] is None else f"{r['kernels']}/{r['min_kernels']}"
        check = r["check"] if r["check"] == "ok" else f"{r['check']}: {r['detail']}"
        lines.append(f"{r['family']:36s} {'x'.join(map(str, r['sizes'])):24s} {kern:>9s} "
                     f"{fmt(r['median_us'], '.1f'):>10s} {fmt(r['gbps'], '.0f'):>8s}  {check}")
    lines.append("kernels: automatic schedule / fewest that can do it; GPU us: median of per-call CUDA "
                 "events; GB/s: minimum traffic / median time")
    return "\n".join(lines)


def environment(cp: Any, torch: Optional[Any], args: argparse.Namespace, timer: Timer) -> Dict[str, Any]:
    """GPU, versions and the run's parameters."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    timing = "median of per-call CUDA event pairs after a spin kernel"
    if args.flush_l2:
        timing += ", L2 flushed before each call" + (
            " (evict_last lines reset first)" if timer.resets_persisting else " (evict_last lines NOT reset)")
    return {
        "gpu": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "l2_cache_bytes": props.get("l2CacheSize"),
        "cupy": cp.__version__,
        "torch": None if torch is None else torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "time_utc": datetime.now(timezone.utc).isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "runs": args.runs,
        "warmup_calls": WARMUP,
        "timing": timing,
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--only", nargs="*", default=None, help="family names (default: all)")
    p.add_argument("--runs", type=int, default=RUNS, help="timed calls per family")
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false",
                   help="do not flush L2 before each timed call")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the families, print the table, write the JSON; see the module docstring."""
    args = parse_args(argv)
    cp = import_cupy()
    if cp is None:
        print("no CUDA device (or no CuPy): nothing to run", file=sys.stderr)
        return 2
    torch = import_torch()
    specs = [s for s in fams.SPECS if not args.only or s.name in args.only]
    unknown = set(args.only or ()) - {s.name for s in fams.SPECS}
    if unknown:
        print(f"unknown families: {sorted(unknown)}; known: {[s.name for s in fams.SPECS]}", file=sys.stderr)
        return 2
    timer = Timer(cp, args.flush_l2)
    env = environment(cp, torch, args, timer)
    print(f"{env['gpu']}: {len(specs)} families, {env['timing']}", flush=True)
    rows = []
    for s in specs:
        r = run_family(s, timer, cp, torch, args.runs)
        rows.append(r)
        print(f"{r['family']:36s} {fmt(r['median_us'], '.1f'):>10s} us  {fmt(r['gbps'], '.0f'):>6s} GB/s  "
              f"kernels {r['kernels']}/{r['min_kernels']}  {r['check']} {r['detail']}  ({r['wall_s']} s)",
              flush=True)
    print()
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
        print(f"wrote {args.json}")
    if any(r["check"] == "MISMATCH" for r in rows):
        return 1
    return 2 if any(r["check"] == "ERROR" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
