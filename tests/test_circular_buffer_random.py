"""Property test of circular buffering (rule 9 of the allocation seed) and bulk copies: random
programs that stream a fusion input through a circular-buffered Shared copy, under random
schedules, run by ``fd.execute`` in the CPU interpreter (which checks bounds, uninitialised
reads, Shared-memory races and the mbarrier protocol) against NumPy in float64.

Programs: ``x`` of shape ``[m, n]`` or ``[b, m, n]`` (float32, symbolic or static sizes), a chain
of 0-3 element-wise ops on it (exp, neg, abs, tanh, sigmoid, multiplication by a constant, the
addition of a second input broadcast along the rows ``[n]`` or along the columns ``[m]`` /
``[b, m]``), ending as an element-wise output ``y``, a sum or max ``s`` over the last axis, or
both (``s`` then reads ``y``, and is sometimes inlined into it).

Schedules: the copy ``c = x.cache_after()`` in Shared memory (or, where every reader runs the
copy's thread mapping and the copy is not a Bulk one, in Local memory: register stages) and every
scheduled tensor split
by a tile of 16, 32, 64 or 128 along the last axis (or not split: whole rows); the leading axes
on blocks (BIDx, BIDy), as serial loops around the pipeline, or merged first; for element-wise
outputs, sometimes the tiles on a block dimension too. ``c`` is inlined at the tile loop (or the
rows) and circular-buffered with 2-4 stages and a prefetch of 1 to ``stages - 1`` (or the
default). The copy is plain (the tile on TIDx, or split so each thread copies 2 or 4 elements,
consecutive or strided) or one Bulk copy per tile; each output reads the tile on TIDx with the
copy's mapping or another (split by 2 or 4, inner or outer), so threads read what others loaded.
The intermediates between the copy and the outputs get their reader's split and parallel types
and ``inline_at(-1)``, or (one example in seven) are left to the propagation. Sizes: ``m`` in
1..5, ``b`` in 1..3, ``n`` in 1..700, drawn around the tile and the prefetch distance (a partial
tile, fewer tiles than the prefetch, ``n == 1``); a symbolic fusion runs at 1-3 sizes.

Every example must be ``ok`` (outputs within tolerance of the reference: rtol 1e-5, and an atol
scaled by the magnitudes the values went through, and for sums by the sum of |terms|) or
``refused`` with the ``KilnError`` a documented rule predicts (``expected_refusal``: rule 9
needs a serial, non-trivial loop left of the copy's inline position); anything else (another
refusal, an accepted schedule that should have been refused, a mismatch, an interpreter error,
an internal error) fails with a runnable repro. The kernels of every ``COMPILE_EVERY``-th
accepted example are also compiled with NVRTC by conftest.

Schedules that run into a compiler issue (``KNOWN_ISSUES``: the rules accept them, the compiler
gets them wrong or refuses them for no documented reason) are told apart by ``known_issue`` and
checked by strict xfail tests, with the smallest examples below: fix the compiler, and they pass
and must be taken out of ``KNOWN_ISSUES``.

``python tests/test_circular_buffer_random.py N [--seed S]`` draws N fresh examples and prints
the counts per category, a repro per failure kind and what the accepted examples covered. The
hypothesis collection, the report and the explorer's loop are tests/random_harness.py's.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import random_harness as harness
from kiln import FusionDefinition, KilnError, MemoryType, ParallelType
from random_harness import RandomDraw

N_EXAMPLES = int(os.environ.get("KILN_CB_EXAMPLES", "1000"))
# The kernels of every N-th accepted example are compiled with NVRTC by conftest (0: none).
COMPILE_EVERY = int(os.environ.get("KILN_CB_COMPILE_EVERY", "10"))
# The derandomized profile's seed: the examples CI runs (each module its own).
_CI_SEED = 3
TILES = [16, 32, 64, 128]
OUTER = {2: ["bx", "bx", "serial"],
         3: ["by_bx", "bx_serial", "serial_bx", "serial", "merge_bx", "merge_serial"]}
UNARY = ["exp", "neg", "abs", "tanh", "sigmoid"]
CONSTS = [2.0, -0.5, 3.0, -1.25]
EXP_BOUND = 20.0  # exp of a value that may exceed this is drawn as sigmoid (no float overflow)
CATEGORIES = ["ok", "refused", "unexplained", "mismatch", "memfault", "internal"]
FAILURES = ("unexplained", "mismatch", "memfault", "internal")
# Schedules the documented rules accept (or do not refuse) that the compiler gets wrong; the
# examples that run into one are checked by a strict xfail test of their own.
KNOWN_ISSUES: Dict[str, str] = {}

_REF_UNARY = {"exp": np.exp, "neg": np.negative, "abs": np.abs, "tanh": np.tanh,
              "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
_MEMFAULT = re.compile(r"out-of-bounds|out of bounds|race|uninitiali[sz]ed|never written|mbarrier|"
                       r"write-after-read|before the bulk copy|divergent barrier|can never complete", re.I)
_INTERNAL = re.compile(r"internal compiler error|\bpanic", re.I)


# -- drawing (with random_harness.RandomDraw) -----------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    """How a tensor runs a tile: ``bulk``, one Bulk copy; otherwise the tile split by ``split``
    (1: not split), TIDx on ``tile / split`` threads each taking ``split`` consecutive elements
    (``inner``), or on ``tile / split`` threads taking elements ``tile / split`` apart."""

    bulk: bool = False
    split: int = 1
    inner: bool = True


@dataclass
class Case:
    """A program, its schedule and the sizes it runs at, as plain data."""

    rank: int  # 2: x is [m, n]; 3: [b, m, n]
    outer: str  # how the leading axes run (OUTER)
    ops: List[Tuple[str, Any]]  # ("unary", name) | ("mul", const) | ("addrow",) | ("addcol",)
    out: str  # "pointwise" | "reduce" | "both"
    reduce_op: str  # "sum" | "max"
    tile: int  # 0: no split, the whole row is the tile
    stages: int
    prefetch: Optional[int]  # None: the default (stages - 1)
    copy: Mapping
    read_y: Mapping  # the element-wise output's mapping
    read_s: Mapping  # the reduction's mapping
    tiles_on_blocks: bool  # the tiles' axis on a block dimension, not a serial loop
    intermediates: str  # "scheduled": like their reader and inlined at -1; "untouched"
    inline_y: bool  # with both outputs, y inlined into the reduction
    static: bool
    sizes: List[Tuple[int, ...]]  # x's shapes, one run each
    seed: int = 0
    local: bool = False  # the copy in Local memory (register stages) instead of Shared


def _mapping(d: Any, copy: bool, like: Optional[Mapping] = None) -> Mapping:
    if like is not None and d.bool(0.4):
        return like
    if copy and d.bool(0.4):
        return Mapping(bulk=True)
    split = d.choice([1, 1, 2, 4]) if copy else d.choice([1, 2, 2, 4])
    return Mapping(split=split, inner=d.bool(0.6) if split > 1 else True)


def _extent(d: Any, tile: int, prefetch: int, stages: int, lo: int = 1) -> int:
    if tile == 0:
        n = d.choice([1, 2, 3, 4, 31, 32, 33, d.int(1, 700)])
    else:
        n = d.choice([1, 2, tile - 1, tile, tile + 1, tile * prefetch - 1, tile * prefetch + 1,
                      tile * (stages + 1) + 3, d.int(1, 700), d.int(1, 700)])
    return min(max(n, lo), 700)


def gen_case(d: RandomDraw) -> Case:
    rank = d.choice([2, 2, 3])
    outer = d.choice(OUTER[rank])
    ops: List[Tuple[str, Any]] = []
    out = d.choice(["pointwise", "reduce", "both"])
    for _ in range(d.int(0 if out == "reduce" else 1, 3)):
        kind = d.choice(["unary", "unary", "unary", "mul", "addrow", "addcol"])
        if kind == "unary":
            ops.append(("unary", d.choice(UNARY)))
        elif kind == "mul":
            ops.append(("mul", d.choice(CONSTS)))
        else:
            ops.append((kind, None))
    tile = d.choice(TILES + [0])
    if tile == 0 and "serial" not in outer:  # whole rows: the leading loops are the pipeline
        outer = d.choice([o for o in OUTER[rank] if "serial" in o])
    stages = d.int(2, 4)
    prefetch = None if d.bool(0.3) else d.int(1, stages - 1)
    copy = _mapping(d, copy=True)
    read_y = _mapping(d, copy=False, like=None if copy.bulk else copy)
    read_s = read_y if d.bool(0.6) else _mapping(d, copy=False)
    static = d.bool(0.2) or (tile == 0 and copy.bulk)  # a Bulk box has a constant size
    p = prefetch if prefetch is not None else stages - 1
    runs = 1 if static else d.int(1, 3)
    lo = 2 if static else 1  # a static extent of one is a broadcast axis
    sizes = []
    for _ in range(runs):
        n = _extent(d, tile, p, stages, lo)
        if tile == 0 and copy.bulk:
            n = -(-n // 4) * 4  # 16-byte rows
        m = d.int(lo, 5)
        sizes.append((d.int(lo, 3), m, n) if rank == 3 else (m, n))
    # a reduction over the tiles' blocks inside a serial loop is a grid reduction per iteration,
    # which needs ``set_serial_grid_reduction``: tiles on blocks only for element-wise outputs
    tiles_on_blocks = out == "pointwise" and tile > 0 and d.bool(0.2)
    intermediates = "untouched" if d.bool(0.15) else "scheduled"
    inline_y = read_s == read_y and d.bool(0.5)
    case = Case(rank, outer, ops, out, d.choice(["sum", "max"]), tile, stages, prefetch, copy, read_y,
                read_s, tiles_on_blocks, intermediates, inline_y, static, sizes, seed=d.int(0, 2 ** 16))
    # Register stages: only where every reader runs the copy's mapping (a thread reads only
    # what it loaded) and the copy is not a Bulk one (which lands in Shared memory).
    readers = [read_y] if out == "pointwise" else [read_s] if out == "reduce" else [read_y, read_s]
    same = all(r == copy for r in readers) and not copy.bulk
    case.local = same and intermediates == "scheduled" and d.bool(0.35)
    return case


def cases() -> Any:
    """Hypothesis strategy of cases: a seed, expanded by ``gen_case`` (as in test_manual_random,
    so CI draws from the explorer's distribution)."""
    return harness.seeded_cases(gen_case)


# -- building the program as source lines -----------------------------------------------------
@dataclass
class Program:
    lines: List[str]  # definition and schedule, runnable after the imports
    outputs: List[str]  # which reference each output is: "y" or "s"
    extra_inputs: List[str]  # "row" ([n]) | "col" ([m] or [b, m])
    untouched_reader: bool  # the copy's reader is an intermediate left to the propagation


def _exp_safe(ops: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """``ops`` with exp replaced by sigmoid where its operand may exceed ``EXP_BOUND``."""
    bound, safe = 1.0, []
    for op in ops:
        if op == ("unary", "exp") and bound > EXP_BOUND:
            op = ("unary", "sigmoid")
        safe.append(op)
        if op[0] == "unary":
            bound = {"exp": float(np.exp(bound)), "tanh": 1.0, "sigmoid": 1.0}.get(op[1], bound)
        elif op[0] == "mul":
            bound *= abs(op[1])
        else:
            bound += 1.0
    return safe


def _shape(case: Case, dims: Sequence[int], size: Tuple[int, ...]) -> List[int]:
    return [size[a] if case.static else -1 for a in dims]


def _schedule_tile(lines: List[str], t: str, m: Mapping, axis: int) -> None:
    """Map tile axis ``axis`` of ``t`` as ``m`` says."""
    if m.bulk:
        lines.append(f"{t}.axis({axis}).parallelize(P.Bulk)")
    elif m.split == 1:
        lines.append(f"{t}.axis({axis}).parallelize(P.TIDx)")
    elif m.inner:
        lines.append(f"{t}.split({axis}, {m.split})")
        lines.append(f"{t}.axis({axis}).parallelize(P.TIDx)")
    else:
        lines.append(f"{t}.split({axis}, {m.split}, inner_split=False)")
        lines.append(f"{t}.axis({axis + 1}).parallelize(P.TIDx)")


def _blocks(case: Case) -> Dict[int, str]:
    """The loop axes left of the tile that run on blocks (after the merge, if any): the
    leading axes as ``case.outer`` says and, with ``tiles_on_blocks``, the tiles' axis on the
    first block dimension left."""
    blocks = {"bx": {0: "BIDx"}, "by_bx": {0: "BIDy", 1: "BIDx"}, "bx_serial": {0: "BIDx"},
              "serial_bx": {1: "BIDx"}, "merge_bx": {0: "BIDx"}}.get(case.outer, {})
    if case.tiles_on_blocks:
        lead = 1 if case.outer.startswith("merge") else case.rank - 1
        blocks[lead] = next(b for b in ("BIDx", "BIDy", "BIDz") if b not in blocks.values())
    return blocks


def program(case: Case) -> Program:
    r, size = case.rank, case.sizes[0]
    last = r - 1
    lines = ["with FusionDefinition() as fd:",
             f"    x = fd.define_tensor({_shape(case, range(r), size)})"]
    extra: List[str] = []
    v, k = "x", 0
    for op in _exp_safe(case.ops):
        k += 1
        if op[0] == "unary":
            expr = f"fd.ops.{op[1]}({v})"
        elif op[0] == "mul":
            expr = f"fd.ops.mul({v}, {op[1]})"
        else:
            name = f"w{len(extra)}"
            extra.append("row" if op[0] == "addrow" else "col")
            dims = [last] if op[0] == "addrow" else list(range(last))
            lines.append(f"    {name} = fd.define_tensor({_shape(case, dims, size)})")
            expr = (f"fd.ops.add({v}, fd.ops.broadcast_in_dim({name}, shape={_shape(case, range(r), size)}, "
                    f"broadcast_dims={dims}))")
        lines.append(f"    t{k} = {expr}")
        v = f"t{k}"
    outputs, scheduled = [], []
    path = [f"t{i}" for i in range(1, k + 1)]  # the tensors between the copy and the outputs
    if case.out in ("pointwise", "both"):
        lines.append(f"    y = {v}")
        lines.append("    fd.add_output(y)")
        outputs.append("y")
        scheduled.append(("y", case.read_y))
        path = path[:-1]
    if case.out in ("reduce", "both"):
        lines.append(f"    s = fd.ops.{case.reduce_op}({v}, dims=[{last}])")
        lines.append("    fd.add_output(s)")
        outputs.append("s")
        scheduled.append(("s", case.read_s))
    if case.intermediates == "scheduled":
        # each runs its tile like the tensor that reads it last (y, else s): Local registers
        # are not read across threads
        scheduled += [(t, case.read_y if "y" in outputs else case.read_s) for t in path]
    lines += ["c = x.cache_after()", f"c.set_memory_type(M.{'Local' if case.local else 'Shared'})"]
    merge = case.outer.startswith("merge")
    tiles = 1 if merge else last  # the tile loop's axis, after the split
    inline = tiles + 1 if case.tile else tiles
    for t, m in [("c", case.copy)] + scheduled:
        if merge:
            lines.append(f"{t}.merge(0)")
        if case.tile:
            lines.append(f"{t}.split({tiles}, {case.tile})")
        for a, pt in _blocks(case).items():
            lines.append(f"{t}.axis({a}).parallelize(P.{pt})")
        _schedule_tile(lines, t, m, inline)
    if case.intermediates == "scheduled":
        lines += [f"{t}.inline_at(-1)" for t in reversed(path)]
    if case.inline_y and "y" in outputs and "s" in outputs:
        lines.append("y.inline_at(-1)")
    lines.append(f"c.inline_at({inline})")
    pf = "" if case.prefetch is None else f", {case.prefetch}"
    lines.append(f"c.circular_buffer({case.stages}{pf})")
    return Program(lines, outputs, extra, bool(path) and case.intermediates == "untouched")


def shared_loops(case: Case, size: Tuple[int, ...]) -> List[Tuple[str, int, str]]:
    """The copy's loops left of its inline position, outermost first: (what, extent, parallel
    type or "serial"); the extent is -1 where it is symbolic."""
    merge = case.outer.startswith("merge")
    lead = [int(np.prod(size[:-1]))] if merge else list(size[:-1])
    names = ["rows"] if merge else ["batches", "rows"][-len(lead):]
    if case.tile:
        names.append("tiles")
        lead.append(-(-size[-1] // case.tile))
    blocks = _blocks(case)
    return [(what, e if case.static else -1, blocks.get(a, "serial"))
            for a, (what, e) in enumerate(zip(names, lead))]


def pipelined_loop(case: Case, size: Tuple[int, ...]) -> Optional[int]:
    """Which of ``shared_loops`` rule 9 pipelines: the innermost serial one that is not trivial
    (a static extent of one is folded away), or None."""
    loops = shared_loops(case, size)
    return next((i for i in reversed(range(len(loops))) if loops[i][2] == "serial" and loops[i][1] != 1),
                None)


def inputs(case: Case, prog: Program, size: Tuple[int, ...], seed: int) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-1, 1, size).astype(np.float32)]
    for kind in prog.extra_inputs:
        shape = size[-1:] if kind == "row" else size[:-1]
        arrays.append(rng.uniform(-1, 1, shape).astype(np.float32))
    return arrays


def reference(case: Case, arrays: List[np.ndarray]) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """Each output's float64 value and its absolute tolerance (per element)."""
    v = arrays[0].astype(np.float64)
    scale = np.abs(v)  # the largest magnitude each element's value went through
    extra = iter(arrays[1:])
    for op in _exp_safe(case.ops):
        if op[0] == "unary":
            v = _REF_UNARY[op[1]](v)
        elif op[0] == "mul":
            v = v * op[1]
        elif op[0] == "addrow":
            v = v + next(extra).astype(np.float64)
        else:
            v = v + next(extra).astype(np.float64)[..., None]
        scale = np.maximum(scale * (np.abs(op[1]) if op[0] == "mul" else 1), np.abs(v))
    out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {"y": (v, 1e-6 * (1 + scale) + 1e-5 * np.abs(v))}
    if case.reduce_op == "sum":
        s = v.sum(-1)
        out["s"] = (s, 1e-5 * (1 + np.abs(v).sum(-1) + scale.max(-1)))
    else:
        s = v.max(-1)
        out["s"] = (s, 1e-6 * (1 + scale.max(-1)) + 1e-5 * np.abs(s))
    return out


def expected_refusal(case: Case, size: Tuple[int, ...]) -> Optional[str]:
    """The pattern of the refusal a documented rule gives this schedule, or None.

    Rule 9 needs a serial loop left of the inline position. A static row of at most one tile
    (a trivial tile loop) has one of one iteration: nothing to overlap, so the copy runs as a
    plain one, as the same schedule with runtime sizes runs its pipeline once."""
    loops = shared_loops(case, size)
    if pipelined_loop(case, size) is None and not any(kind == "serial" for _, _, kind in loops):
        return r"no serial loop to pipeline"
    return None


def known_issue(case: Case, prog: Program) -> Optional[str]:
    """Which of ``KNOWN_ISSUES`` this schedule runs into, or None."""
    del case, prog
    return None


# -- running and classifying --------------------------------------------------------------------
@dataclass
class Outcome:
    category: str
    message: str = ""
    key: str = ""
    size: Optional[Tuple[int, ...]] = None
    kernels: list = field(default_factory=list)
    issue: Optional[str] = None  # the KNOWN_ISSUES entry the schedule runs into


def normalize(msg: str) -> str:
    """The message's first line with tensor names and numbers stripped (for grouping)."""
    m = msg.splitlines()[0] if msg else ""
    m = re.sub(r"\bT\d+\b", "T#", m)
    m = re.sub(r"\bkernel\d+\b", "kernel#", m)
    m = re.sub(r"\[[^\]]*\]", "[..]", m)
    m = re.sub(r"-?\d+", "#", m)
    return m[:160]


def _namespace() -> Dict[str, Any]:
    return {"FusionDefinition": FusionDefinition, "M": MemoryType, "P": ParallelType}


def _error(e: BaseException, case: Case, size: Tuple[int, ...], where: str) -> Outcome:
    msg = f"{where}: {type(e).__name__}: {e}"
    if not isinstance(e, KilnError) or _INTERNAL.search(str(e)):
        return Outcome("internal", msg, normalize(str(e)), size)
    want = expected_refusal(case, size)
    if want is not None and where != "execute" and re.search(want, str(e)):
        return Outcome("refused", msg, normalize(str(e)), size)
    if _MEMFAULT.search(str(e)):
        return Outcome("memfault", msg, normalize(str(e)), size)
    return Outcome("unexplained", msg, normalize(str(e)), size)


def run_case(case: Case) -> Outcome:
    """Build ``case``, run it at each of its sizes; the first thing that is not ok."""
    prog = program(case)
    o = _run(case, prog)
    o.issue = known_issue(case, prog)
    return o


def _run(case: Case, prog: Program) -> Outcome:
    kernels: list = []
    ns = _namespace()
    try:
        exec("\n".join(prog.lines), ns)
    except Exception as e:  # noqa: BLE001 - every failure of the compiler is classified
        return _error(e, case, case.sizes[0], "schedule")
    fd = ns["fd"]
    for i, size in enumerate(case.sizes):
        arrays = inputs(case, prog, size, case.seed + i)
        try:
            low = fd.lower(arrays)
            for k in low.kernels:
                _ = k.cuda_source
            kernels += list(low.kernels)
        except Exception as e:  # noqa: BLE001
            return _error(e, case, size, "lower")
        try:
            got = fd.execute(arrays)
        except Exception as e:  # noqa: BLE001
            return _error(e, case, size, "execute")
        want_refusal = expected_refusal(case, size)
        if want_refusal is not None:
            return Outcome("unexplained", f"accepted, but expected a refusal matching {want_refusal!r}",
                           "accepted a schedule expected to be refused", size)
        wrong = check(case, prog, size, arrays, got)
        if wrong is not None:
            return wrong
    return Outcome("ok", kernels=kernels)


def check(case: Case, prog: Program, size: Tuple[int, ...], arrays: List[np.ndarray],
          got: Sequence[Any]) -> Optional[Outcome]:
    """A mismatch of the outputs ``got`` (NumPy arrays) against the reference, or None."""
    ref = reference(case, arrays)
    if len(got) != len(prog.outputs):
        return Outcome("mismatch", f"{len(got)} outputs, expected {len(prog.outputs)}", "outputs", size)
    for name, g in zip(prog.outputs, got):
        want, tol = ref[name]
        g = np.asarray(g)
        if g.shape != want.shape:
            return Outcome("mismatch", f"{name}: shape {g.shape}, expected {want.shape}", "shape", size)
        bad = ~(np.abs(g.astype(np.float64) - want) <= tol)
        if bad.any():
            at = tuple(int(j) for j in np.argwhere(bad)[0])
            msg = (f"{name}: {int(bad.sum())} of {bad.size} elements differ, first at {at}: "
                   f"got {g[at]!r}, expected {want[at]!r}")
            return Outcome("mismatch", msg, f"{name} values differ", size)
    return None


def repro(case: Case, outcome: Optional[Outcome] = None) -> str:
    """A runnable program: the definition, the schedule and the run that failed."""
    prog = program(case)
    size = outcome.size if outcome is not None and outcome.size is not None else case.sizes[0]
    i = case.sizes.index(size) if size in case.sizes else 0
    rng = f"np.random.default_rng({case.seed + i})"
    out = ["import numpy as np", "from kiln import FusionDefinition, MemoryType as M, ParallelType as P", ""]
    out += prog.lines
    out.append(f"rng = {rng}")
    out.append(f"args = [rng.uniform(-1, 1, {size}).astype(np.float32)]")
    for kind in prog.extra_inputs:
        shape = size[-1:] if kind == "row" else size[:-1]
        out.append(f"args.append(rng.uniform(-1, 1, {shape}).astype(np.float32))")
    out.append("outs = fd.execute(args)")
    if outcome is not None and outcome.message:
        out.append(f"# {outcome.category}: {outcome.message.splitlines()[0][:400]}")
    return "\n".join(out)


def case_size(case: Case) -> Tuple[int, int]:
    return (len(case.ops) + len(case.sizes), sum(int(np.prod(s)) for s in case.sizes))


def summarize(results: Sequence[Tuple[Case, Outcome]], max_groups: int = 12) -> str:
    """The examples clear of ``KNOWN_ISSUES``, then those of each issue, each by category."""
    lines = harness.summary_lines([r for r in results if r[1].issue is None], CATEGORIES, case_size, repro,
                                  max_groups)
    for issue, what in KNOWN_ISSUES.items():
        mine = [r for r in results if r[1].issue == issue]
        if mine:
            lines.append(f"\n##### known issue: {issue} ({what})")
            lines += harness.summary_lines(mine, CATEGORIES, case_size, repro, 3)
    return "\n".join(lines)


def coverage(results: Sequence[Tuple[Case, Outcome]]) -> str:
    """What the accepted examples exercised (for the explorer's report)."""
    feats: Counter = Counter()
    for c, o in results:
        if o.category != "ok":
            continue
        feats[f"copy={'bulk' if c.copy.bulk else f'plain/{c.copy.split}'}"] += 1
        feats[f"out={c.out}"] += 1
        feats[f"outer={c.outer}"] += 1
        feats[f"stages={c.stages},prefetch={c.prefetch}"] += 1
        feats[f"static={c.static}"] += 1
        feats[f"intermediates={c.intermediates if c.ops else 'none'}"] += 1
        if c.inline_y and c.out == "both":
            feats["y inlined into s"] += 1
        p = pipelined_loop(c, c.sizes[0])
        feats[f"pipelined={shared_loops(c, c.sizes[0])[p][0] if p is not None else None}"] += 1
        pf = c.prefetch or c.stages - 1
        for sz in c.sizes if c.tile else []:
            tiles = -(-sz[-1] // c.tile)
            feats["n<tile" if sz[-1] < c.tile else "n%tile!=0" if sz[-1] % c.tile else "n%tile==0"] += 1
            if tiles < pf:
                feats["tiles<prefetch"] += 1
            if sz[-1] == 1:
                feats["n==1"] += 1
        if c.read_y != c.copy or c.read_s != c.copy:
            feats["reads across threads"] += 1
    return "accepted examples cover: " + ", ".join(f"{k} {v}" for k, v in sorted(feats.items()))


# -- the CI tests ---------------------------------------------------------------------------------
RESULTS: List[Tuple[Case, Outcome]] = []
_KEPT: list = []


def _collect() -> List[Tuple[Case, Outcome]]:
    return harness.collect(RESULTS, _KEPT, cases(), run_case, N_EXAMPLES, COMPILE_EVERY, _CI_SEED,
                           accepted=_accepted, phases=None)


def _accepted(o: Outcome) -> bool:
    return o.category == "ok" and o.issue is None


def test_random_circular_buffers_are_correct_or_refused_by_a_documented_rule() -> None:
    results = _collect()
    harness.hand_kept_kernels_to_conftest(_KEPT)  # conftest compiles them with NVRTC
    clear = [(c, o) for c, o in results if o.issue is None]
    bad = [(c, o) for c, o in clear if o.category in FAILURES]
    if bad:
        pytest.fail(f"{len(bad)} of {len(clear)} examples failed\n" + summarize(clear), pytrace=False)
    assert sum(o.category == "ok" for _, o in clear) >= 0.85 * len(clear), summarize(clear)


@pytest.mark.parametrize("issue", list(KNOWN_ISSUES))
@pytest.mark.xfail(strict=True, reason="a compiler issue (KNOWN_ISSUES); XPASS: fixed, remove it from there")
def test_random_circular_buffers_of_known_issues(issue: str) -> None:
    mine = [(c, o) for c, o in _collect() if o.issue == issue]
    assert mine, f"no example runs into {issue!r}"
    bad = [(c, o) for c, o in mine if o.category != "ok"]
    assert not bad, f"{len(bad)} of {len(mine)} examples failed\n" + summarize(bad)


@pytest.mark.gpu
def test_accepted_random_circular_buffers_match_numpy_on_the_gpu() -> None:
    """The schedules the interpreter accepted, run on the GPU (``KILN_CB_GPU_EXAMPLES``)."""
    harness.rerun_accepted_on_gpu(_collect, "KILN_CB_GPU_EXAMPLES", 150, _run_on_gpu, repro,
                                  accepted=_accepted)


def _run_on_gpu(cp: Any, case: Case) -> Optional[Outcome]:
    """Run ``case`` at each of its sizes on the GPU: the first thing that is not ok, or None."""
    prog = program(case)
    ns = _namespace()
    exec("\n".join(prog.lines), ns)
    for i, size in enumerate(case.sizes):
        arrays = inputs(case, prog, size, case.seed + i)
        try:
            got = [cp.asnumpy(g) for g in ns["fd"].execute([cp.asarray(a) for a in arrays])]
        except Exception as e:  # noqa: BLE001 - every failure on the GPU is reported
            return Outcome("internal", f"{type(e).__name__}: {e}", normalize(str(e)), size)
        wrong = check(case, prog, size, arrays, got)
        if wrong is not None:
            return wrong
    return None


# -- smallest examples of issues found by this test ------------------------------------------------
def _rows_around_tiles(static: bool, bulk: bool, cross: bool, reduce: bool) -> Tuple[Any, np.ndarray]:
    """The rows a serial loop; each row's tiles of 32 on BIDx (``static``: x is [3, 32], one
    tile, the tile loop serial but trivial), so rule 9 pipelines the rows loop, which encloses the
    loop of the tiles that the copy shares with its reader."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 32] if static else [-1, -1])
        y = fd.ops.sum(x, dims=[1]) if reduce else fd.ops.neg(x)
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 32)
        if not static:
            t.axis(1).parallelize(ParallelType.BIDx)
    c.axis(2).parallelize(ParallelType.Bulk if bulk else ParallelType.TIDx)
    if cross:
        y.split(2, 2)
    y.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(2)
    return fd, np.random.default_rng(0).uniform(-1, 1, (3, 32 if static else 70)).astype(np.float32)


# The pipelined loop encloses a loop the copy shares with its reader: once it put the whole
# body among the loads (wrong values with no error, Shared races, reads before the bulk copy
# completed, a register accumulator used before its declaration). The pipeline now moves inside
# block loops, and a loop of one iteration is its body.
@pytest.mark.parametrize("static,bulk,cross,reduce", [
    (False, False, False, False),
    (False, False, True, False),
    (False, True, False, False),
    (True, False, False, False),
    (True, False, False, True),
    (True, True, False, False),
])
def test_pipelining_a_loop_that_encloses_a_shared_loop(static: bool, bulk: bool, cross: bool,
                                                       reduce: bool) -> None:
    fd, x = _rows_around_tiles(static, bulk, cross, reduce)
    want = x.astype(np.float64).sum(1) if reduce else -x.astype(np.float64)
    np.testing.assert_allclose(fd.execute([x])[0], want, rtol=1e-5, atol=1e-5)


def test_inlining_the_copy_into_an_untouched_intermediate() -> None:
    # Lowering gives exp(x) the schedule of neg (README: untouched tensors follow their
    # consumer), which c's inline position matches: inline_at leaves the check to lowering
    # (it used to refuse the position against exp(x)'s unscheduled axes).
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.neg(fd.ops.exp(x))
        fd.add_output(y)
    c = x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    for t in (c, y):
        t.split(1, 32)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(2).parallelize(ParallelType.TIDx)
    c.inline_at(2)
    c.circular_buffer(2)
    x_ = np.random.default_rng(0).uniform(-1, 1, (3, 100)).astype(np.float32)
    np.testing.assert_allclose(fd.execute([x_])[0], -np.exp(x_.astype(np.float64)), rtol=1e-5, atol=1e-6)


# -- explorer --------------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
    p = harness.explorer_parser("Explore random circular-buffer schedules in the interpreter.", 1000)
    args = p.parse_args(argv)
    os.environ.setdefault("KILN_VERIFY", "1")  # as conftest: verify the kernel IR after each pass
    results = harness.explore(args, "circular-buffer", __file__, gen_case, run_case)
    print(summarize(results, max_groups=args.groups))
    print(coverage(results))
    return 1 if any(o.category in FAILURES and o.issue is None for _, o in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
