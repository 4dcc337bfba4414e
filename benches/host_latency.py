"""Host latency: median per-call time of a cached one-kernel fusion on 1,024 elements
(``y = exp(x) * 2 - 1.5``) vs CuPy ElementwiseKernel and torch eager of the same math.

kiln is measured with its own launcher (``kiln._core.PreparedLaunch``, the default) and
with CuPy's ``Function.__call__`` (``KILN_LAUNCHER=cupy``, set while that fusion's
signature is first prepared), in one run, and replayed as a one-node CUDA graph
(the default), and with a fresh output every call (``KILN_REUSE_OUTPUTS=0``; by default a call
whose previous output nobody holds any more writes into it, as a loop that drops each result
does here). Goal (issue 18, point 3): a cached one-kernel ``fd.execute`` at
most 5 us of host time per call on CuPy and torch inputs, and a cached three-kernel program
replayed as a CUDA graph at most 2 us + 0.5 us per kernel (measured against the same program
launched kernel by kernel). The parts (signature key, recipe lookup, the generated ``_run``,
stream read, output allocation, one launch, one graph replay with and without a node update,
an empty call) are timed alone, in the same rounds.

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


def per_call_us(paths: Dict[str, Tuple[Callable[[], Any], Callable[[], None]]],
                ) -> Dict[str, Tuple[float, float]]:
    """Median microseconds per call of each ``name: (fn, sync)`` over REPEATS interleaved
    rounds of one BATCH of calls each: (host time, the batch's calls alone; wall time, the
    batch and the sync after it). Host time is the goal's measure; wall time exceeds it
    where the GPU, not the host, is the bottleneck."""
    for fn, sync in paths.values():
        warm(fn, sync)
    names = list(paths)
    host: Dict[str, List[float]] = {n: [] for n in names}
    wall: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(REPEATS):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn, sync = paths[n]
            t0 = time.perf_counter()
            for _ in range(BATCH):
                fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host[n].append((t1 - t0) / BATCH * 1e6)
            wall[n].append((t2 - t0) / BATCH * 1e6)
    return {n: (statistics.median(host[n]), statistics.median(wall[n])) for n in names}


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
    pl = r.direct.__globals__.get("_P0")  # the recipe's first PreparedLaunch, when it has one
    if r.launcher != "rust" or pl is None:
        return r.launcher
    how = "CuPy's C getter" if pl.stream_getter_used else "Python (get_current_stream)"
    graph = ", repeats replay a CUDA graph" if r.graph is not None else ", no CUDA graph"
    return f"rust, stream from {how}{graph}"


def chain3() -> FusionDefinition:
    """``softmax`` by rows as three kernels (exp | row sum | divide), scheduled by hand."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        a = fd.ops.exp(x)
        s = fd.ops.sum(a, dims=[1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.div(a, sb)
        fd.add_output(y)
    for t in (a, s, sb, y):
        t.split(1, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(-1).parallelize(ParallelType.TIDx)
    sb.inline_at(-1)
    fd.segment_after(a)
    fd.segment_after(s)
    return fd


def _with_env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with environment variable ``name`` set to ``value``."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _recipe(fd: FusionDefinition, kind: str = "cupy") -> Any:
    """The prepared recipe of ``fd`` for inputs of ``kind`` (the first such signature)."""
    for key, r in fd._lowered().evaluator()._recipes.items():
        torch_key = isinstance(key, tuple) and len(key) > 0 and key[0] == 2  # see signature_key
        if (kind == "torch") == torch_key:
            return r
    raise KeyError(kind)


Paths = Dict[str, Tuple[Callable[[], Any], Callable[[], None]]]


def main() -> None:
    """Measure and print the tables."""
    import cupy as cp
    from kiln import _core
    from kiln.compiled import compiled
    from kiln.host import launcher_kind, signature_key

    x = cp.asarray(np.random.default_rng(0).standard_normal(N).astype(np.float32))
    ref = np.exp(cp.asnumpy(x).astype(np.float64)) * 2.0 - 1.5
    sync = cp.cuda.Device().synchronize
    rust = launcher_kind() == "rust"
    tag = "Rust launcher" if rust else "CuPy launcher: libcuda did not load"

    def check(out: Any) -> None:
        got = out.cpu().numpy() if hasattr(out, "cpu") else cp.asnumpy(out)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

    fd = build()
    for _ in range(2):
        (out,) = fd.execute([x])
        check(out)
    print(f"kiln default launcher: {_launcher_of(fd)}")
    paths: Paths = {}
    paths[f"kiln fd.execute ({tag}, default)"] = (lambda: fd.execute([x]), sync)
    fd_plain = build()
    for _ in range(3):
        (out,) = _with_env("KILN_CUDA_GRAPHS", "0", lambda: fd_plain.execute([x]))
        check(out)
    paths["kiln fd.execute (cuLaunchKernel, KILN_CUDA_GRAPHS=0)"] = (lambda: fd_plain.execute([x]), sync)
    fd_fresh = build()
    for _ in range(3):
        (out,) = _with_env("KILN_REUSE_OUTPUTS", "0", lambda: fd_fresh.execute([x]))
        check(out)
    paths["kiln fd.execute (fresh outputs, KILN_REUSE_OUTPUTS=0)"] = (lambda: fd_fresh.execute([x]), sync)
    ev = fd._lowered().evaluator()
    paths[f"kiln HostEvaluator.run_cached ({tag})"] = (lambda: ev.run_cached([x]), sync)

    fd_cupy = build()
    (out,) = _with_launcher("cupy", lambda: fd_cupy.execute([x]))
    check(out)
    print(f"kiln A/B launcher: {_launcher_of(fd_cupy)}")
    paths["kiln fd.execute (KILN_LAUNCHER=cupy)"] = (lambda: fd_cupy.execute([x]), sync)

    ek = cp.ElementwiseKernel("float32 x", "float32 y", "y = expf(x) * 2.0f - 1.5f", "kiln_bench_ek")
    check(ek(x))
    paths["CuPy ElementwiseKernel"] = (lambda: ek(x), sync)

    torch: Any = None
    try:
        import torch
    except ImportError:
        pass
    if torch is not None:
        tx = torch.as_tensor(x, device="cuda")
        tsync = torch.cuda.synchronize
        paths["torch eager (3 ops)"] = (lambda: torch.exp(tx) * 2.0 - 1.5, tsync)
        (tout,) = fd.execute([tx])
        check(tout)
        paths["kiln fd.execute, torch in/out (default)"] = (lambda: fd.execute([tx]), tsync)
        for _ in range(2):
            (tout,) = _with_env("KILN_CUDA_GRAPHS", "0", lambda: fd_plain.execute([tx]))
            check(tout)
        paths["kiln fd.execute, torch in/out (cuLaunchKernel)"] = (lambda: fd_plain.execute([tx]), tsync)
        for _ in range(2):
            (tout,) = _with_env("KILN_REUSE_OUTPUTS", "0", lambda: fd_fresh.execute([tx]))
            check(tout)
        paths["kiln fd.execute, torch in/out (fresh outputs)"] = (lambda: fd_fresh.execute([tx]), tsync)

    # Where a cached call's time goes, part by part (each timed alone, in the same rounds).
    r = _recipe(fd)
    c = compiled(fd)
    key = signature_key([x])
    paths["  part: signature key (signature_key)"] = (lambda: signature_key([x]), sync)
    paths["  part: recipe lookup (signature key + launcher dict)"] = (
        lambda: c.launchers.get(signature_key([x])), sync)
    paths["  part: launcher dict lookup alone"] = (lambda: c.launchers.get(key), sync)
    version = fd._core.version

    def dispatch() -> Any:  # what fd.execute does before the launcher: version check, key, lookup
        cc = fd._compiled
        if cc is not None and cc.version == fd._core.version:
            return cc.launchers.get(signature_key([x]))
        return version

    paths["  part: fd.execute dispatch (version check + signature key + lookup)"] = (dispatch, sync)
    paths["  part: generated _run, graph replay (allocation + launch)"] = (lambda: r.fast([x], ev), sync)
    paths["  part: generated _run, cuLaunchKernel (allocation + launch)"] = (lambda: r.direct([x], ev), sync)
    paths["  part: stream read (cupy.cuda.get_current_stream().ptr)"] = (
        lambda: cp.cuda.get_current_stream().ptr, sync)
    paths["  part: output allocation (cupy.ndarray)"] = (lambda: cp.ndarray((N,), cp.float32), sync)
    if torch is not None:
        paths["  part: output allocation (torch.empty, device object)"] = (
            lambda: torch.empty((N,), dtype=torch.float32, device=tx.device), tsync)
        paths["  part: output allocation (torch.empty, device index)"] = (
            lambda: torch.empty((N,), dtype=torch.float32, device=0), tsync)
        paths["  part: output allocation (input.new_empty)"] = (lambda: tx.new_empty((N,)), tsync)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            paths["  part: stream read (torch current raw stream)"] = (lambda: raw(0), tsync)
    pl = r.direct.__globals__.get("_P0")
    if pl is not None:
        o = cp.empty_like(x)
        o2 = cp.empty_like(x)
        xp, op, op2 = x.data.ptr, o.data.ptr, o2.data.ptr
        paths["  part: stream read (CuPy's C getter, PreparedLaunch.stream)"] = (pl.stream, sync)
        launch = (lambda: pl.launch_current(xp, op)) if pl.stream_getter_used else (
            lambda: pl.launch(cp.cuda.get_current_stream().ptr, xp, op))
        paths["  part: one launch (kiln PreparedLaunch, cuLaunchKernel)"] = (launch, sync)
        g1 = _core.GraphLaunch([(pl, [0, 1])])
        stream = cp.cuda.get_current_stream().ptr
        g1.launch(stream, xp, op)
        paths["  part: one-node graph replay, same pointers"] = (lambda: g1.launch(stream, xp, op), sync)
        flip = [op, op2]

        def replay_new_output() -> None:
            flip.reverse()
            g1.launch(stream, xp, flip[0])

        paths["  part: one-node graph replay, output pointer changes (node update)"] = (
            replay_new_output, sync)
    paths["  part: empty Python call"] = (lambda: None, sync)
    rows = per_call_us(paths)
    rows.setdefault("torch eager (3 ops)", (float("nan"), float("nan")))

    kiln_us = next(iter(rows.values()))[0]
    ek_us = rows["CuPy ElementwiseKernel"][0]
    plain_us = rows["kiln fd.execute (cuLaunchKernel, KILN_CUDA_GRAPHS=0)"][0]
    print(f"goal (cached one-kernel fd.execute <= 5 us of host time, CuPy inputs): "
          f"{'met' if kiln_us <= 5.0 else 'NOT met'} ({kiln_us:.2f} us; {plain_us:.2f} us with "
          f"KILN_CUDA_GRAPHS=0; ElementwiseKernel {ek_us:.2f} us)")
    if torch is not None:
        t_us = rows["kiln fd.execute, torch in/out (default)"][0]
        print(f"goal (same, torch inputs): {'met' if t_us <= 5.0 else 'NOT met'} ({t_us:.2f} us)")
    three = multi_kernel(cp, torch)
    width = max(len(name) for name in list(rows) + list(three)) + 2
    lines: List[str] = [f"host latency, {N} float32 elements, median of {REPEATS} interleaved rounds "
                        f"of {BATCH} calls",
                        f"{'path':<{width}} {'host us':>8} {'wall us':>8}"]
    for name, (us, wall) in rows.items():
        lines.append(f"{name:<{width}} {us:>8.2f} {wall:>8.2f}")
    lines.append(f"three-kernel host program (exp | row sum | divide), {M}x{K} float32")
    for name, (us, wall) in three.items():
        lines.append(f"{name:<{width}} {us:>8.2f} {wall:>8.2f}")
    print("\n".join(lines))


M, K = 32, 256
PLAIN3 = "kiln fd.execute, 3 kernels, kernel by kernel (KILN_CUDA_GRAPHS=0)"


def multi_kernel(cp: Any, torch: Any) -> Dict[str, Tuple[float, float]]:
    """The three-kernel program replayed as a CUDA graph (the default) vs launched kernel by
    kernel (``KILN_CUDA_GRAPHS=0``), plus the raw graph replay and three raw launches."""
    x = cp.asarray(np.random.default_rng(1).standard_normal((M, K)).astype(np.float32))
    e = np.exp(cp.asnumpy(x).astype(np.float64))
    ref = e / e.sum(axis=1, keepdims=True)
    sync = cp.cuda.Device().synchronize

    def check(out: Any) -> None:
        got = out.cpu().numpy() if hasattr(out, "cpu") else cp.asnumpy(out)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)

    fd_graph, fd_plain = chain3(), chain3()
    for _ in range(3):
        check(fd_graph.execute([x])[0])
        check(_with_env("KILN_CUDA_GRAPHS", "0", lambda: fd_plain.execute([x]))[0])
    g = _recipe(fd_graph).graph
    assert g is not None and g.kernel_count == 3 and g.replays == 2, "the default must replay a graph"
    assert _recipe(fd_plain).graph is None
    paths: Paths = {
        "kiln fd.execute, 3 kernels, CUDA graph (default)": (lambda: fd_graph.execute([x]), sync),
        PLAIN3: (lambda: fd_plain.execute([x]), sync),
    }
    if torch is not None:
        tx = torch.as_tensor(x, device="cuda")
        tg, tp = chain3(), chain3()
        for _ in range(3):
            check(tg.execute([tx])[0])
            check(_with_env("KILN_CUDA_GRAPHS", "0", lambda: tp.execute([tx]))[0])
        tsync = torch.cuda.synchronize
        paths["kiln fd.execute, 3 kernels, torch, CUDA graph"] = (lambda: tg.execute([tx]), tsync)
        paths["kiln fd.execute, 3 kernels, torch, kernel by kernel"] = (lambda: tp.execute([tx]), tsync)
    # The launches alone: one graph replay vs three PreparedLaunch calls, same arguments.
    rp = _recipe(fd_plain)
    pls = [rp.direct.__globals__[f"_P{k}"] for k in range(3)]
    ev = fd_plain._lowered().evaluator()
    base = ev.arena_for(cp.cuda.Device().id).get(rp.arena_bytes)
    out = cp.empty_like(x)
    ptr = {"input": x.data.ptr, "output": out.data.ptr}
    args = []
    for _fn, _g, _b, _sm, argids, _sc, _ms in rp.launches:
        a = []
        for bid in argids:
            b = rp.plan.buffers[bid]
            a.append(ptr[b.place] if b.place in ptr else base + b.offset)
        args.append(tuple(a))
    stream = cp.cuda.get_current_stream().ptr
    flat: List[int] = []
    for a in args:
        flat += [p for p in a if p not in flat]
    graph = _core_graph([(pl, [flat.index(p) for p in a]) for pl, a in zip(pls, args)])

    def three_launches() -> None:
        for pl, a in zip(pls, args):
            pl.launch(stream, *a)

    three_launches()
    graph.launch(stream, *flat)
    sync()
    check(out)
    paths["  part: 3 x PreparedLaunch.launch"] = (three_launches, sync)
    paths["  part: GraphLaunch.launch of the 3 nodes, same pointers"] = (
        lambda: graph.launch(stream, *flat), sync)
    rows = per_call_us(paths)
    goal = 2.0 + 0.5 * 3
    us = rows["kiln fd.execute, 3 kernels, CUDA graph (default)"][0]
    met = "met" if us <= goal else "NOT met"
    print(f"goal (cached 3-kernel fd.execute as a graph <= {goal:.1f} us): {met} "
          f"({us:.2f} us vs {rows[PLAIN3][0]:.2f} us kernel by kernel, host time)")
    return rows


def _core_graph(nodes: List[Tuple[Any, List[int]]]) -> Any:
    """A ``kiln._core.GraphLaunch`` of ``nodes``."""
    from kiln import _core

    return _core.GraphLaunch(nodes)


if __name__ == "__main__":
    main()
