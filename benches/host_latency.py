"""Host latency: median per-call time of a cached one-kernel fusion on 1,024 elements
(``y = exp(x) * 2 - 1.5``) vs CuPy ElementwiseKernel and torch eager of the same math.

kiln is measured with its own launcher (``kiln._core.PreparedLaunch``, the default) and
with CuPy's ``Function.__call__`` (``KILN_LAUNCHER=cupy``, set while that fusion's
signature is first prepared), in one run. Goal (issue 5, point 9): ``fd.execute`` at most
8 us per call and below the ElementwiseKernel.

Per-call time = wall time of a batch of back-to-back calls (launches are asynchronous,
the GPU work is ~2 us) divided by the batch size; the median over repeats is reported. The
paths are timed in interleaved rounds (one batch of each per round, the order rotating), so
that a drift of the host's clock during the run falls on all of them alike.
Run: ``python benches/host_latency.py`` on a GPU machine. Prints a table last.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from kiln import FusionDefinition, ParallelType

N = 1024
BATCH = 200
REPEATS = 30


def build() -> FusionDefinition:
    """``exp(x) * 2 - 1.5`` on a 1-D tensor, 128 threads per block."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        a = fd.ops.exp(x)
        b = fd.ops.mul(a, 2.0)
        c = fd.ops.sub(b, 1.5)
        fd.add_output(c)
    for t in (a, b, c):
        t.split(0, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(1).parallelize(ParallelType.TIDx)
    a.inline_at(-1)
    b.inline_at(-1)
    return fd


def warm(fn: Callable[[], Any], sync: Callable[[], None]) -> None:
    """50 untimed calls."""
    for _ in range(50):
        fn()
    sync()


def per_call_us(paths: Dict[str, Tuple[Callable[[], Any], Callable[[], None]]]) -> Dict[str, float]:
    """Median microseconds per call of each ``name: (fn, sync)`` over REPEATS interleaved
    rounds of one BATCH of calls each."""
    for fn, sync in paths.values():
        warm(fn, sync)
    names = list(paths)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(REPEATS):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn, sync = paths[n]
            t0 = time.perf_counter()
            for _ in range(BATCH):
                fn()
            sync()
            samples[n].append((time.perf_counter() - t0) / BATCH * 1e6)
    return {n: statistics.median(samples[n]) for n in names}


def _with_launcher(kind: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with ``KILN_LAUNCHER=kind`` (signatures prepared meanwhile keep it)."""
    old = os.environ.get("KILN_LAUNCHER")
    os.environ["KILN_LAUNCHER"] = kind
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["KILN_LAUNCHER"]
        else:
            os.environ["KILN_LAUNCHER"] = old


def _launcher_of(fd: FusionDefinition) -> str:
    """Which launcher the (one) prepared signature of ``fd`` uses, and how it reads the stream."""
    (r,) = fd._lowered().evaluator()._recipes.values()
    pl = r.fast.__globals__.get("_P0")  # the recipe's first PreparedLaunch, when it has one
    if r.launcher != "rust" or pl is None:
        return r.launcher
    how = "CuPy's C getter" if pl.stream_getter_used else "Python (get_current_stream)"
    return f"rust, stream from {how}"


def main() -> None:
    """Measure and print the table."""
    import cupy as cp
    from kiln.host import launcher_kind

    x = cp.asarray(np.random.default_rng(0).standard_normal(N).astype(np.float32))
    ref = np.exp(cp.asnumpy(x).astype(np.float64)) * 2.0 - 1.5
    sync = cp.cuda.Device().synchronize
    rust = launcher_kind() == "rust"
    tag = "Rust launcher" if rust else "CuPy launcher: libcuda did not load"

    fd = build()
    (out,) = fd.execute([x])
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-5)
    print(f"kiln default launcher: {_launcher_of(fd)}")
    paths: Dict[str, Tuple[Callable[[], Any], Callable[[], None]]] = {}
    paths[f"kiln fd.execute ({tag})"] = (lambda: fd.execute([x]), sync)
    ev = fd._lowered().evaluator()
    paths[f"kiln HostEvaluator.run_cached ({tag})"] = (lambda: ev.run_cached([x]), sync)

    fd_cupy = build()
    (out,) = _with_launcher("cupy", lambda: fd_cupy.execute([x]))
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-5)
    print(f"kiln A/B launcher: {_launcher_of(fd_cupy)}")
    paths["kiln fd.execute (KILN_LAUNCHER=cupy)"] = (lambda: fd_cupy.execute([x]), sync)

    ek = cp.ElementwiseKernel("float32 x", "float32 y", "y = expf(x) * 2.0f - 1.5f", "kiln_bench_ek")
    np.testing.assert_allclose(cp.asnumpy(ek(x)), ref, rtol=1e-5, atol=1e-5)
    paths["CuPy ElementwiseKernel"] = (lambda: ek(x), sync)

    try:
        import torch

        tx = torch.as_tensor(x, device="cuda")
        paths["torch eager (3 ops)"] = (lambda: torch.exp(tx) * 2.0 - 1.5, torch.cuda.synchronize)
        (tout,) = fd.execute([tx])
        np.testing.assert_allclose(tout.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)
        paths["kiln fd.execute, torch in/out"] = (lambda: fd.execute([tx]), torch.cuda.synchronize)
    except ImportError:
        pass

    # Where a kiln call's time goes: the output allocation and the launch alone.
    paths["  part: output allocation (cupy.ndarray)"] = (lambda: cp.ndarray((N,), cp.float32), sync)
    r = next(iter(fd._lowered().evaluator()._recipes.values()))  # the CuPy signature, prepared first
    pl = r.fast.__globals__.get("_P0")
    if pl is not None:
        o = cp.empty_like(x)
        xp, op = x.data.ptr, o.data.ptr
        launch = (lambda: pl.launch_current(xp, op)) if pl.stream_getter_used else (
            lambda: pl.launch(cp.cuda.get_current_stream().ptr, xp, op))
        paths["  part: one launch (kiln PreparedLaunch)"] = (launch, sync)
    paths["  part: empty Python call"] = (lambda: None, sync)
    rows = per_call_us(paths)
    rows.setdefault("torch eager (3 ops)", float("nan"))

    kiln_us = next(iter(rows.values()))
    ek_us = rows["CuPy ElementwiseKernel"]
    ok = kiln_us <= 8.0 and kiln_us < ek_us
    print(f"goal (fd.execute <= 8 us and < CuPy ElementwiseKernel): {'met' if ok else 'NOT met'} "
          f"({kiln_us:.2f} us vs {ek_us:.2f} us)")
    width = max(len(name) for name in rows) + 2
    lines: List[str] = [f"host latency, {N} float32 elements, median of {REPEATS} interleaved rounds "
                        f"of {BATCH} calls",
                        f"{'path':<{width}} {'us/call':>8}"]
    for name, us in rows.items():
        lines.append(f"{name:<{width}} {us:>8.2f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
