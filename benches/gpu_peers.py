#!/usr/bin/env python3
"""kiln against the peers users would otherwise pick: torch eager, torch.compile and CuPy.

Issue 7, point 2. Run on the H200::

    python3 benches/gpu_peers.py [--quick] [--out DIR]

Each workload is defined once as a kiln ``FusionDefinition`` built with ``fd.ops`` and left
unscheduled, so kiln's automatic schedulers pick the schedule. Every peer runs the same math
on the same torch CUDA tensors (CuPy sees them zero-copy through ``cupy.asarray``).

Timing: the GPU first runs copies for about two seconds so that its clocks are up. Then,
per workload, kiln and the peers are timed in 5 interleaved rounds of 20 calls each (the
order rotates every round), so that a drift of clocks or temperature during the run falls
on all of them alike; each round starts with 3 warm-up calls (the first compiles). Every
call is bracketed by its own pair of CUDA events, and the median of all 100 calls
(``--quick``: 2 rounds of 5, and M=4096) is reported in microseconds. Before each timed
call a short ``torch.cuda._sleep`` kernel is queued so the host gets ahead of the GPU: the
events then time the GPU work of the call, not Python launch overhead. Before that, a
256 MiB buffer is read to flush L2, so each call starts from the same cache state whatever
ran before it (without it, a kiln call timed right after CuPy's layernorm, whose temporaries
leave L2 full of dirty lines, took 2 µs longer than one timed after torch.compile's). The
flush also calls ``cuCtxResetPersistingL2Cache``: lines loaded with an L2 evict_last hint
(kiln's automatic schedules and torch.compile's kernels both use it) survive a 256 MiB read,
and a plain layernorm timed right after one that left its input that way took 126.9 µs
instead of 129.6. Every input is larger than L2 (a warning is printed when one is not, e.g.
with ``--quick``).

Effective GB/s = minimum bytes (inputs read once + outputs written once) / median time. A
device-to-device copy of a 1 GiB tensor (bytes read + written / time) is the roofline that
each result is reported against, and ``kiln / best peer`` is the fastest peer's time divided
by kiln's (>= 1.0 means kiln is at least as fast as every peer; a peer whose result disagrees
with torch eager is left out of "best").

kiln's results are checked against torch eager; a mismatch is marked loudly and an exception
from kiln is recorded (its text goes into the JSON) and the run goes on. Writes
``gpu_peers.json`` and ``gpu_peers.png`` (when matplotlib imports) into ``--out`` and prints
the table last.

Exit status: 0 when every kiln result matches, 1 when any mismatches, 2 when none mismatches
but kiln raised on some workload (or there is no CUDA device).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import kiln
import torch
import torch.nn.functional as F
from kiln import DataType, FusionDefinition

M_FULL = 16384
M_QUICK = 4096
K = 4096
TRANSPOSE_N_FULL = 8192
TRANSPOSE_N_QUICK = 4096
ROUNDS_FULL, RUNS_PER_ROUND_FULL = 5, 20
ROUNDS_QUICK, RUNS_PER_ROUND_QUICK = 2, 5
WARMUP = 3
CLOCK_WARMUP_S = 2.0
COPY_BYTES = 1 << 30
FLUSH_BYTES = 256 << 20  # over four times the H200's L2
SLEEP_CYCLES = 2_000_000  # about 1 ms at H200 clocks: keeps the host ahead of the GPU
SEED = 0
LN_EPS = 1e-5
GELU_C = 0.7978845608
GELU_A = 0.044715
UNIT_ROUNDOFF_F32 = 2.0**-24
PEERS = ("eager", "compile", "cupy")
DEFAULT_OUT = "gpu_peers_out"

CUPY_POINTWISE = "y = fmaxf(x * 1.5f + 0.5f, 0.0f) * (1.0f / (1.0f + expf(-x)));"
CUPY_GELU = (f"float u = x + b; "
             f"y = 0.5f * u * (1.0f + tanhf({GELU_C}f * (u + {GELU_A}f * u * u * u)));")
# CuPy has no bfloat16 dtype: the kernel reads and writes the bf16 bits through int16 views,
# computes in fp32 and rounds to nearest even once (NaN payloads are not special-cased).
CUPY_POINTWISE_BF16 = (
    "float f = __uint_as_float(((unsigned int)(unsigned short)x) << 16); "
    "float r = fmaxf(f * 1.5f + 0.5f, 0.0f) * (1.0f / (1.0f + expf(-f))); "
    "unsigned int u = __float_as_uint(r); "
    "u += 0x7fffu + ((u >> 16) & 1u); "
    "y = (short)(u >> 16);"
)


@dataclass
class Workload:
    """One benchmark case: the kiln fusion, its inputs, the peers and how to check kiln."""

    name: str
    build: Callable[[], FusionDefinition]
    inputs: List[torch.Tensor]
    eager: Callable[..., torch.Tensor]
    bytes_moved: int
    rtol: float
    atol: float
    cupy_fn: Optional[Callable[[], Any]]
    cupy_to_torch: Callable[[Any], torch.Tensor]
    cupy_note: str = ""


# ----------------------------------------------------------------------------- kiln fusions
def _row_broadcast(fd: FusionDefinition, v: Any) -> Any:
    """A [K] tensor broadcast to [M, K] (broadcast along rows)."""
    return fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[1])


def fusion_pointwise(dtype: DataType) -> FusionDefinition:
    """relu(x*1.5+0.5)*sigmoid(x) on [M, K] of ``dtype``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=dtype)
        a = fd.ops.relu(fd.ops.add(fd.ops.mul(x, 1.5), 0.5))
        fd.add_output(fd.ops.mul(a, fd.ops.sigmoid(x)))
    return fd


def fusion_gelu_bias() -> FusionDefinition:
    """gelu_tanh(x + bias[K]) on [M, K]."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        u = fd.ops.add(x, _row_broadcast(fd, b))
        u3 = fd.ops.mul(fd.ops.mul(u, u), u)
        inner = fd.ops.mul(fd.ops.add(u, fd.ops.mul(u3, GELU_A)), GELU_C)
        y = fd.ops.mul(fd.ops.mul(u, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))
        fd.add_output(y)
    return fd


def fusion_softmax() -> FusionDefinition:
    """Softmax over the last axis of [M, K]."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        m = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        s = fd.ops.sum(e, dims=[1], keepdim=True)
        fd.add_output(fd.ops.div(e, s))
    return fd


def fusion_layernorm(k: int) -> FusionDefinition:
    """Layernorm over the last axis (size ``k``) of [M, K] with weight and bias."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        w = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1], keepdim=True), 1.0 / k)
        xc = fd.ops.sub(x, mean)
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1], keepdim=True), 1.0 / k)
        rstd = fd.ops.rsqrt(fd.ops.add(var, LN_EPS))
        y = fd.ops.mul(fd.ops.mul(xc, rstd), _row_broadcast(fd, w))
        fd.add_output(fd.ops.add(y, _row_broadcast(fd, b)))
    return fd


def fusion_sum(dims: Sequence[int]) -> FusionDefinition:
    """Sum of [M, K] over ``dims`` (keepdim False)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=list(dims)))
    return fd


def fusion_transpose() -> FusionDefinition:
    """[N, N] -> its transpose, materialized."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.permute(x, [1, 0]))
    return fd


def fusion_index_select() -> FusionDefinition:
    """Rows of a [M, K] table at an int64 index of length M."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        idx = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(x, idx, 0))
    return fd


# ----------------------------------------------------------------------------- torch peers
def eager_pointwise(x: torch.Tensor) -> torch.Tensor:
    """relu(x*1.5+0.5)*sigmoid(x)."""
    return torch.relu(x * 1.5 + 0.5) * torch.sigmoid(x)


def eager_gelu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + b)."""
    return F.gelu(x + b, approximate="tanh")


def eager_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis."""
    return torch.softmax(x, dim=1)


def eager_layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Layernorm over the last axis."""
    return F.layer_norm(x, (x.shape[1],), w, b, eps=LN_EPS)


def eager_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over K."""
    return x.sum(dim=1)


def eager_col_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over M."""
    return x.sum(dim=0)


def eager_full_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of everything (a 0-d tensor)."""
    return x.sum()


def eager_transpose(x: torch.Tensor) -> torch.Tensor:
    """Materialized transpose."""
    return x.t().contiguous()


def eager_index_select(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` at ``idx``."""
    return torch.index_select(x, 0, idx)


# ----------------------------------------------------------------------------- CuPy peers
def import_cupy() -> Optional[Any]:
    """CuPy, or None when it does not import."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def cupy_kernels(cp: Any) -> Dict[str, Any]:
    """The hand-written CuPy elementwise kernels."""
    return {
        "pointwise": cp.ElementwiseKernel("float32 x", "float32 y", CUPY_POINTWISE, "gpu_peers_pointwise"),
        "gelu_bias": cp.ElementwiseKernel("float32 x, float32 b", "float32 y", CUPY_GELU, "gpu_peers_gelu"),
        "pointwise_bf16": cp.ElementwiseKernel("int16 x", "int16 y", CUPY_POINTWISE_BF16,
                                               "gpu_peers_pointwise_bf16"),
    }


def cupy_softmax(cp: Any, x: Any) -> Any:
    """Softmax composed of CuPy ops (no fused softmax in CuPy)."""
    e = cp.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def cupy_layernorm(cp: Any, x: Any, w: Any, b: Any) -> Any:
    """Layernorm composed of CuPy ops (no fused layernorm in CuPy)."""
    xc = x - x.mean(axis=1, keepdims=True)
    var = (xc * xc).mean(axis=1, keepdims=True)
    return xc * cp.reciprocal(cp.sqrt(var + LN_EPS)) * w + b


def cupy_to_torch(a: Any) -> torch.Tensor:
    """A torch view of a CuPy array (zero-copy)."""
    return torch.as_tensor(a, device="cuda")


def cupy_bf16_to_torch(a: Any) -> torch.Tensor:
    """A torch bf16 view of a CuPy int16 array holding bf16 bits."""
    return torch.as_tensor(a, device="cuda").view(torch.bfloat16)


def cupy_stream_like_torch(cp: Any) -> Any:
    """The CuPy stream that is torch's current stream, so that CUDA events time kiln and CuPy too."""
    handle = torch.cuda.current_stream().cuda_stream
    return cp.cuda.Stream.null if handle == 0 else cp.cuda.ExternalStream(handle)


# ----------------------------------------------------------------------------- workloads
def reduction_atol(n_reduced: int) -> float:
    """Absolute tolerance of an fp32 sum of ``n_reduced`` standard-normal terms.

    A serial fp32 sum of n unit-variance terms has a typical error of about u*n/sqrt(2)
    (u the unit roundoff); 4*u*n leaves room for any summation order and still catches a
    dropped or doubled block of inputs."""
    return 4.0 * UNIT_ROUNDOFF_F32 * n_reduced


def make_workloads(m: int, n_t: int, cp: Optional[Any]) -> List[Workload]:
    """The ten workloads on fresh random inputs (M=``m``, K=``K``, transpose ``n_t``x``n_t``)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(SEED)
    x = torch.randn(m, K, device="cuda", generator=g)
    bias = torch.randn(K, device="cuda", generator=g)
    w = torch.randn(K, device="cuda", generator=g)
    b = torch.randn(K, device="cuda", generator=g)
    xt = torch.randn(n_t, n_t, device="cuda", generator=g)
    idx = torch.randint(0, m, (m,), device="cuda", dtype=torch.int64, generator=g)
    xh = x.to(torch.bfloat16)
    f4, mk = 4, m * K

    kern: Dict[str, Any] = {}
    xc = bc = wc = b2c = xtc = ic = xhc = None
    if cp is not None:
        kern = cupy_kernels(cp)
        xc, bc, wc, b2c, xtc, ic = (cp.asarray(t) for t in (x, bias, w, b, xt, idx))
        xhc = cp.asarray(xh.view(torch.int16))

    def cupy_or_none(fn: Callable[[], Any]) -> Optional[Callable[[], Any]]:
        return fn if cp is not None else None

    return [
        Workload("pointwise", lambda: fusion_pointwise(DataType.Float), [x], eager_pointwise,
                 2 * mk * f4, 1e-4, 1e-5, cupy_or_none(lambda: kern["pointwise"](xc)), cupy_to_torch,
                 "ElementwiseKernel"),
        Workload("gelu_bias", fusion_gelu_bias, [x, bias], eager_gelu_bias,
                 2 * mk * f4 + K * f4, 1e-4, 1e-5, cupy_or_none(lambda: kern["gelu_bias"](xc, bc)),
                 cupy_to_torch, "ElementwiseKernel"),
        Workload("softmax", fusion_softmax, [x], eager_softmax, 2 * mk * f4, 1e-4, 1e-7,
                 cupy_or_none(lambda: cupy_softmax(cp, xc)), cupy_to_torch, "composed CuPy ops"),
        Workload("layernorm", lambda: fusion_layernorm(K), [x, w, b], eager_layernorm,
                 2 * mk * f4 + 2 * K * f4, 1e-4, 1e-4,
                 cupy_or_none(lambda: cupy_layernorm(cp, xc, wc, b2c)), cupy_to_torch, "composed CuPy ops"),
        Workload("row_sum", lambda: fusion_sum([1]), [x], eager_row_sum, mk * f4 + m * f4, 1e-5,
                 reduction_atol(K), cupy_or_none(lambda: cp.sum(xc, axis=1)), cupy_to_torch, "cupy.sum"),
        Workload("col_sum", lambda: fusion_sum([0]), [x], eager_col_sum, mk * f4 + K * f4, 1e-5,
                 reduction_atol(m), cupy_or_none(lambda: cp.sum(xc, axis=0)), cupy_to_torch, "cupy.sum"),
        Workload("full_sum", lambda: fusion_sum([0, 1]), [x], eager_full_sum, mk * f4 + f4,
                 1e-5, reduction_atol(mk), cupy_or_none(lambda: cp.sum(xc)), cupy_to_torch, "cupy.sum"),
        Workload("transpose", fusion_transpose, [xt], eager_transpose, 2 * n_t * n_t * f4, 0.0, 0.0,
                 cupy_or_none(lambda: cp.ascontiguousarray(xtc.T)), cupy_to_torch, "ascontiguousarray(x.T)"),
        Workload("index_select", fusion_index_select, [x, idx], eager_index_select,
                 2 * mk * f4 + m * 8, 0.0, 0.0, cupy_or_none(lambda: cp.take(xc, ic, axis=0)),
                 cupy_to_torch, "cupy.take"),
        Workload("pointwise_bf16", lambda: fusion_pointwise(DataType.BFloat16), [xh], eager_pointwise,
                 2 * mk * 2, 2e-2, 1e-2, cupy_or_none(lambda: kern["pointwise_bf16"](xhc)),
                 cupy_bf16_to_torch, "ElementwiseKernel on int16 views (CuPy has no bfloat16)"),
    ]


# ----------------------------------------------------------------------------- timing
_FLUSH: List[torch.Tensor] = []


@functools.cache
def _reset_persisting_fn() -> Optional[Callable[[], int]]:
    """libcuda's ``cuCtxResetPersistingL2Cache``, or None where libcuda cannot be loaded."""
    try:
        import ctypes  # noqa: PLC0415

        return ctypes.CDLL("libcuda.so.1").cuCtxResetPersistingL2Cache
    except (OSError, AttributeError):
        return None


def reset_persisting_l2() -> bool:
    """Return L2 lines held with an evict_last (persisting) priority to normal, through the
    driver's ``cuCtxResetPersistingL2Cache``; False where libcuda cannot be loaded."""
    fn = _reset_persisting_fn()
    if fn is None:
        return False
    # The reset acts on the context at once, not in stream order: the GPU must be idle.
    torch.cuda.synchronize()
    rc = fn()
    if rc != 0:
        raise RuntimeError(f"cuCtxResetPersistingL2Cache failed with CUresult {rc}")
    return True


def flush_l2() -> None:
    """Read a buffer several times larger than L2, so that the next call finds L2 holding only
    clean, unrelated lines, whatever ran before it (another implementation's dirty output
    or its reads of the shared input would otherwise speed it up or slow it down), after
    returning lines kept with an evict_last hint to normal priority (a 256 MiB read does
    not evict them)."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda"))
    reset_persisting_l2()
    torch.sum(_FLUSH[0])


def time_gpu_us(fn: Callable[[], Any], runs: int) -> List[float]:
    """GPU time of ``fn`` in microseconds, one CUDA event pair per run, after ``WARMUP`` calls;
    L2 is flushed before every timed call."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for start, end in zip(starts, ends):
        flush_l2()
        if sleep is not None:
            sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]


def error_text(e: BaseException) -> str:
    """``Type: message`` of an exception."""
    return f"{type(e).__name__}: {e}".strip()


def first_line(text: str, width: int = 160) -> str:
    """The first line of ``text``, cut to ``width`` characters."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def measure(fn: Optional[Callable[[], Any]], runs: int, na_reason: str = "") -> Dict[str, Any]:
    """Median/min of ``fn``'s event-timed runs, or the error that stopped it (``fn`` None: n/a)."""
    return measure_interleaved({"fn": fn}, {"fn": na_reason}, 1, runs)["fn"]


def measure_interleaved(fns: Dict[str, Optional[Callable[[], Any]]], na: Dict[str, str], rounds: int,
                        per_round: int) -> Dict[str, Dict[str, Any]]:
    """Median/min of each implementation's event-timed calls over ``rounds`` rounds of
    ``per_round`` calls each, the order rotating every round; an implementation that raises
    (or is None: n/a, with its reason from ``na``) drops out with its error, the others go on."""
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    errors: Dict[str, Optional[str]] = {n: None if fns[n] is not None else (na.get(n) or "n/a")
                                        for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[n]
            if fn is None or errors[n] is not None:
                continue
            try:
                times[n].extend(time_gpu_us(fn, per_round))
            except Exception as e:  # a peer or kiln failing is a result, not the end of the run
                errors[n] = error_text(e)
    out = {}
    for n in names:
        t = times[n]
        if errors[n] is not None or not t:
            out[n] = {"median_us": None, "min_us": None, "runs": 0, "times_us": [],
                      "error": errors[n] or "n/a"}
        else:
            out[n] = {"median_us": statistics.median(t), "min_us": min(t), "runs": len(t), "times_us": t,
                      "error": None}
    return out


def warm_up_clocks(seconds: float) -> None:
    """Keep the GPU busy with copies for ``seconds`` so that its clocks are up before timing."""
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    busy_ms = 0.0
    while busy_ms < seconds * 1000.0:
        start.record()
        for _ in range(20):
            dst.copy_(src)
        end.record()
        end.synchronize()
        busy_ms += start.elapsed_time(end)


def copy_bandwidth(runs: int) -> Dict[str, Any]:
    """Device-to-device copy of a 1 GiB fp32 tensor: bytes read + written per second."""
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    res = measure(lambda: dst.copy_(src), runs)
    res["bytes"] = 2 * COPY_BYTES
    res["gbps"] = None if res["median_us"] is None else 2 * COPY_BYTES / res["median_us"] / 1e3
    return res


# ----------------------------------------------------------------------------- checking
def compare(out: Any, ref: torch.Tensor, rtol: float, atol: float) -> Dict[str, Any]:
    """Check ``out`` against ``ref``: ``{"status": "ok"|"MISMATCH", "detail": ...}`` (NaN fails)."""
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(out, device="cuda")
    if tuple(out.shape) != tuple(ref.shape):
        return {"status": "MISMATCH", "detail": f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"}
    if out.dtype != ref.dtype:
        return {"status": "MISMATCH", "detail": f"dtype {out.dtype}, expected {ref.dtype}"}
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    bad = ~(diff <= atol + rtol * r.abs())
    nbad = int(bad.sum().item())
    max_diff = float(diff.max().item()) if diff.numel() else 0.0
    if nbad:
        return {"status": "MISMATCH",
                "detail": f"{nbad}/{diff.numel()} elements off (max |diff| {max_diff:.3g}, "
                          f"rtol {rtol:g}, atol {atol:g})"}
    return {"status": "ok", "detail": f"max |diff| {max_diff:.3g}"}


def check_peer(fn: Callable[[], Any], to_torch: Callable[[Any], torch.Tensor], ref: torch.Tensor,
               w: Workload) -> Dict[str, Any]:
    """Check one peer's output against torch eager (a sanity check; not part of the exit status)."""
    try:
        return compare(to_torch(fn()), ref, w.rtol, w.atol)
    except Exception as e:  # report, don't stop
        return {"status": "ERROR", "detail": error_text(e)}


# ----------------------------------------------------------------------------- one workload
def prepare_kiln(w: Workload, ref: torch.Tensor) -> tuple:
    """Define, run once and check kiln: (call to time or None, check status, detail)."""
    try:
        fd = w.build()
        outs = fd.execute(list(w.inputs))
        if len(outs) != 1:
            check = {"status": "MISMATCH", "detail": f"{len(outs)} outputs, expected 1"}
        else:
            check = compare(outs[0], ref, w.rtol, w.atol)
        del outs
    except Exception as e:  # a kiln failure is a result: record it and go on
        return None, "ERROR", error_text(e)
    inputs = list(w.inputs)
    return (lambda: fd.execute(inputs)), check["status"], check["detail"]


def run_all(w: Workload, ref: torch.Tensor, rounds: int, per_round: int) -> tuple:
    """Time kiln, torch eager, torch.compile and CuPy on ``w`` in interleaved rounds; check
    kiln, compile and CuPy against eager. Returns (kiln result, peer results)."""
    inputs = list(w.inputs)
    kiln_fn, kiln_check, kiln_detail = prepare_kiln(w, ref)
    fns: Dict[str, Optional[Callable[[], Any]]] = {"kiln": kiln_fn, "eager": lambda: w.eager(*inputs)}
    na = {"kiln": kiln_detail if kiln_fn is None else "",
          "cupy": "CuPy does not import" if w.cupy_fn is None else ""}
    try:
        compiled = torch.compile(w.eager)
    except Exception as e:  # torch.compile unavailable: the peer is n/a
        fns["compile"], na["compile"] = None, error_text(e)
    else:
        fns["compile"] = lambda: compiled(*inputs)
    fns["cupy"] = w.cupy_fn
    res = measure_interleaved(fns, na, rounds, per_round)
    kl = res.pop("kiln")
    if kiln_fn is None:
        kl.update({"check": "ERROR", "check_detail": first_line(kiln_detail)})
    else:
        kl.update({"check": kiln_check if kl["error"] is None else "ERROR",
                   "check_detail": kiln_detail if kl["error"] is None else first_line(kl["error"])})
    peers = res
    peers["eager"]["check"] = "reference"
    if peers["compile"]["error"] is None:
        peers["compile"]["check"] = check_peer(lambda: compiled(*inputs), lambda t: t, ref, w)["status"]
    peers["cupy"]["note"] = w.cupy_note
    if w.cupy_fn is not None and peers["cupy"]["error"] is None:
        peers["cupy"]["check"] = check_peer(w.cupy_fn, w.cupy_to_torch, ref, w)["status"]
    return kl, peers


def gbps(bytes_moved: int, median_us: Optional[float]) -> Optional[float]:
    """Effective GB/s of ``bytes_moved`` in ``median_us`` (None when there is no time)."""
    return None if median_us is None else bytes_moved / median_us / 1e3


def run_workload(w: Workload, rounds: int, per_round: int, copy_gbps: Optional[float],
                 l2_bytes: Optional[int]) -> Dict[str, Any]:
    """All peers and kiln on one workload, with bandwidths, fractions of copy and kiln's ratio."""
    ref = w.eager(*w.inputs)
    largest = max(t.numel() * t.element_size() for t in w.inputs)
    if l2_bytes and largest <= l2_bytes:
        print(f"warning: {w.name}: largest input {largest / 2**20:.0f} MiB fits in L2 "
              f"({l2_bytes / 2**20:.0f} MiB)")
    kl, peers = run_all(w, ref, rounds, per_round)
    del ref
    for r in (kl, *peers.values()):
        r["gbps"] = gbps(w.bytes_moved, r["median_us"])
        r["fraction_of_copy"] = None if r["gbps"] is None or not copy_gbps else r["gbps"] / copy_gbps
    timed = {p: r["median_us"] for p, r in peers.items()
             if r["median_us"] is not None and r.get("check") not in ("MISMATCH", "ERROR")}
    best = min(timed, key=lambda p: timed[p]) if timed else None
    ratio = None
    if best is not None and kl["median_us"]:
        ratio = timed[best] / kl["median_us"]
    return {
        "name": w.name,
        "input_shapes": [list(t.shape) for t in w.inputs],
        "input_dtypes": [str(t.dtype).replace("torch.", "") for t in w.inputs],
        "bytes_moved": w.bytes_moved,
        "rtol": w.rtol,
        "atol": w.atol,
        "kiln": kl,
        "peers": peers,
        "best_peer": best,
        "best_peer_us": None if best is None else timed[best],
        "kiln_speedup_vs_best_peer": ratio,
    }


# ----------------------------------------------------------------------------- reporting
def environment(cp: Optional[Any], args: argparse.Namespace, m: int, n_t: int, rounds: int,
                per_round: int) -> Dict[str, Any]:
    """GPU, library versions and the run's parameters."""
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": None if cp is None else cp.__version__,
        "kiln": getattr(kiln, "__version__", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time_utc": datetime.now(timezone.utc).isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "quick": bool(args.quick),
        "M": m,
        "K": K,
        "transpose_n": n_t,
        "timed_runs": rounds * per_round,
        "rounds": rounds,
        "runs_per_round": per_round,
        "warmup_calls_per_round": WARMUP,
        "clock_warmup_s": CLOCK_WARMUP_S,
        "kiln_l2_evict_last": os.environ.get("KILN_L2_EVICT_LAST", "(unset: on)"),
        "timing": "median of per-call CUDA event pairs, L2 flushed before each call"
                  + (" (evict_last lines reset first)" if reset_persisting_l2() else
                     " (evict_last lines NOT reset: libcuda not loadable)")
                  + ("; host kept ahead with torch.cuda._sleep" if hasattr(torch.cuda, "_sleep") else ""),
    }


def write_png(results: List[Dict[str, Any]], copy_gbps: Optional[float], path: Path) -> str:
    """A grouped bar chart of effective GB/s per workload and implementation; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: skipping the PNG"
    series = ["kiln", *PEERS]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(14, 6))
    for i, s in enumerate(series):
        vals = [(r["kiln"] if s == "kiln" else r["peers"][s])["gbps"] or 0.0 for r in results]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(results))]
        ax.bar(xs, vals, width, label=s)
    if copy_gbps:
        ax.axhline(copy_gbps, linestyle="--", color="black", label=f"D2D copy {copy_gbps:.0f} GB/s")
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r["name"] for r in results], rotation=30, ha="right")
    ax.set_ylabel("effective GB/s (minimum bytes / median time)")
    ax.set_title("kiln vs peers (missing bar: error or n/a)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def fmt(v: Optional[float], spec: str, na: str = "n/a") -> str:
    """``v`` formatted with ``spec``, or ``na``."""
    return na if v is None else format(v, spec)


def table(results: List[Dict[str, Any]]) -> str:
    """The summary table, one row per workload."""
    cols = ["workload", "kiln µs", "eager µs", "compile µs", "cupy µs", "kiln GB/s", "% of copy",
            "kiln / best peer", "check"]
    rows = []
    for r in results:
        kl, p = r["kiln"], r["peers"]
        frac, ratio = kl["fraction_of_copy"], r["kiln_speedup_vs_best_peer"]
        rows.append([
            r["name"],
            fmt(kl["median_us"], ".1f", "ERR" if kl["check"] == "ERROR" else "n/a"),
            fmt(p["eager"]["median_us"], ".1f"),
            fmt(p["compile"]["median_us"], ".1f"),
            fmt(p["cupy"]["median_us"], ".1f"),
            fmt(kl["gbps"], ".0f"),
            fmt(None if frac is None else 100.0 * frac, ".1f"),
            "n/a" if ratio is None else f"{ratio:.3f}x ({r['best_peer']})",
            kl["check"],
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(wd) for c, wd in zip(cols, widths))
    sep = "-+-".join("-" * wd for wd in widths)
    body = [" | ".join(v.ljust(wd) if i == 0 else v.rjust(wd) for i, (v, wd) in enumerate(zip(row, widths)))
            for row in rows]
    return "\n".join([line, sep, *body])


def progress(r: Dict[str, Any]) -> None:
    """One line per finished workload (errors and failed checks spelled out)."""
    kl = r["kiln"]
    times = "  ".join(f"{p} {fmt(q['median_us'], '.1f')}" for p, q in [("kiln", kl), *r["peers"].items()])
    print(f"{r['name']:15s} {times}  check {kl['check']} ({kl['check_detail']})", flush=True)
    for p, q in r["peers"].items():
        if q["error"] is not None:
            print(f"    {p}: n/a: {first_line(q['error'])}", flush=True)
        if q.get("check") in ("MISMATCH", "ERROR"):
            print(f"    {p}: its result disagrees with torch eager ({q['check']})", flush=True)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{ROUNDS_QUICK * RUNS_PER_ROUND_QUICK} timed runs and M={M_QUICK}")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    ap.add_argument("--only", default="", help="comma-separated workload names to run (default: all)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every workload; 1 if any kiln result mismatches, 2 if none does but kiln raised."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on the GPU only")
        return 2
    m, n_t = (M_QUICK, TRANSPOSE_N_QUICK) if args.quick else (M_FULL, TRANSPOSE_N_FULL)
    quick = (ROUNDS_QUICK, RUNS_PER_ROUND_QUICK)
    rounds, per_round = quick if args.quick else (ROUNDS_FULL, RUNS_PER_ROUND_FULL)
    runs = rounds * per_round
    cp = import_cupy()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(cp, args, m, n_t, rounds, per_round)
    stream = contextlib.nullcontext() if cp is None else cupy_stream_like_torch(cp)
    with stream:
        warm_up_clocks(0.1 if args.quick else CLOCK_WARMUP_S)
        copy = copy_bandwidth(runs)
        copy_gbps = copy["gbps"]
        torch.cuda.empty_cache()  # give the copy's 2 GiB back before the workloads allocate
        print(f"device-to-device copy: {fmt(copy_gbps, '.0f')} GB/s ({env['gpu']})", flush=True)
        results = []
        only = {x for x in args.only.split(",") if x}
        for w in make_workloads(m, n_t, cp):
            if only and w.name not in only:
                continue
            print(f"running {w.name} ...", flush=True)
            results.append(run_workload(w, rounds, per_round, copy_gbps, env["l2_cache_bytes"]))
            progress(results[-1])
    (out_dir / "gpu_peers.json").write_text(json.dumps(
        {"environment": env, "copy": copy, "workloads": results}, indent=2) + "\n")
    print(f"wrote {out_dir / 'gpu_peers.json'}")
    print(write_png(results, copy_gbps, out_dir / "gpu_peers.png"))
    mismatched = [r["name"] for r in results if r["kiln"]["check"] == "MISMATCH"]
    errored = [r["name"] for r in results if r["kiln"]["check"] == "ERROR"]
    if errored:
        print(f"kiln raised on: {', '.join(errored)} (error text in the JSON)")
    if mismatched:
        print(f"!!!!! KILN RESULT MISMATCH on: {', '.join(mismatched)} !!!!!")
    print(f"\ncopy {fmt(copy_gbps, '.0f')} GB/s; kiln / best peer = best peer µs / kiln µs "
          f"(>= 1.000x: kiln as fast or faster); median of {runs} timed runs in {rounds} interleaved rounds, "
          f"M={m}, K={K}, transpose {n_t}x{n_t}")
    print(table(results))
    if mismatched:
        return 1
    return 2 if errored else 0


if __name__ == "__main__":
    sys.exit(main())
