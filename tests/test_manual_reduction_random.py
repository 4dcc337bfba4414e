"""Property test of MANUAL schedules of REDUCTIONS: random fusions (ranks 1-3, sizes with 1 and
primes) with a pointwise prologue, one to three reductions (sum, max, min, mean as sum times a
constant, a softmax; over one or several axes, keepdim or not, two reductions of one input,
a reduction of a reduction) and an epilogue that broadcasts a reduction back against a
full-size tensor (``x - max(x)``), with reduction and pointwise outputs, scheduled by hand at
random: splits of reduced and iteration axes by 1-257 (inner and outer), merges, reorders,
BIDx/BIDy/TIDx/TIDy/Unroll (some Vectorize and Unswitch) on random axes (a reduced axis on TIDx
is a block reduction, on BIDx/BIDy a grid reduction), ``set_serial_grid_reduction``,
``fd.segment_after`` (a kernel of its own for a reduction's readers), inline positions,
``cache_after`` / ``cache_before`` (of inputs, outputs and reductions) with Shared / Local /
Global memory, a schedule applied to every tensor, perturbed on some or left off others.
Most schedules follow a template (block, grid or per-thread reduction; random parallel types)
compiled for each tensor from the axes it covers, so that the reduction, its producers and its
consumers agree; the rest are random like tests/test_manual_random.py's.

The examples run by ``fd.execute`` on NumPy arrays (the CPU interpreter, which checks every
access, race, uninitialized read and divergent barrier) against a float64 NumPy reference; the
tolerance grows with a bound of the float32 rounding each reduction may add (its order is the
schedule's). The outcome contract is tests/test_manual_random.py's: every example is ``ok`` or
``refused`` (a ``KilnError`` naming a tensor from ``fd.lower``, codegen or the launch limits),
never ``mismatch``, ``memfault``, ``internal`` or ``late``. A scheduling primitive that raises
``KilnError`` leaves the fusion unchanged; the example goes on without it.

CI runs ``KILN_MANUAL_REDUCTION_EXAMPLES`` (default 800) derandomized examples;
``python tests/test_manual_reduction_random.py 2000 [--seed S]`` draws fresh ones and prints the
counts, the refusal messages' distribution and every failure kind with a runnable repro. The
hypothesis collection, the report and the explorer's loop are tests/random_harness.py's.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import random_harness as harness
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType
from kiln.fusion import Tensor
from random_harness import RandomDraw
from test_manual_random import (
    _NAMES_TENSOR,
    _REF_BINARY,
    _REF_UNARY,
    BINARY,
    CATEGORIES,
    FACTORS,
    FAILURES,
    SIZES,
    UNARY,
    Outcome,
    classify,
    normalize,
    refusal_rule,
)

N_EXAMPLES = int(os.environ.get("KILN_MANUAL_REDUCTION_EXAMPLES", "800"))
# The kernels of every N-th accepted example are compiled with NVRTC by conftest (0: none).
COMPILE_EVERY = int(os.environ.get("KILN_MANUAL_REDUCTION_COMPILE_EVERY", "20"))
# The derandomized profile's seed: the examples CI runs (each module its own).
_CI_SEED = 2
MAX_ELEMENTS = 2048
REDUCTIONS = ["sum", "sum", "max", "min", "mean"]
PTYPES = ["BIDx", "BIDx", "BIDy", "TIDx", "TIDx", "TIDx", "TIDy", "Unroll", "Unroll", "Vectorize", "Unswitch"]
RANDOM_SLOT = [None, None, None, "BIDx", "BIDy", "TIDx", "TIDx", "TIDy", "Unroll", "Vectorize", "Unswitch"]
EPS = 2.0 ** -23  # float32's unit roundoff, twice over
_RED_RULES = [  # reduction-specific refusals, before the pointwise test's rules
    ("grid reduction: its result in one block, one kernel", r"across blocks|grid reduction"),
    ("reduction consumer inside its reduction loop", r"reads the reduction"),
    ("loop promotion (siblings iterate different spaces)", r"cannot promote loop axis"),
]


# -- drawing -----------------------------------------------------------------------------------
@dataclass
class Case:
    """A fusion and a schedule as plain data; values and tensors are resolved modulo what exists."""

    sizes: List[int]
    seed: int
    static: bool = False
    # per extra input: ("full",) | ("sub", axes) | ("ones", axes), as in test_manual_random
    inputs: List[tuple] = field(default_factory=list)
    ops: List[tuple] = field(default_factory=list)
    extra_outputs: List[tuple] = field(default_factory=list)  # ("red"|"any", k)
    caches: List[tuple] = field(default_factory=list)  # ("after"|"before", k)
    memory: List[tuple] = field(default_factory=list)  # (k, "Shared"|"Local"|"Global")
    # (reduction k, order "IR"|"RI", merge I, merge R, split R, split I, ((slot, ptype), ...));
    # a split is (factor, inner) or None; slots: I/I0/Io/Ii and R/R0/Ro/Ri (see apply_template)
    template: Optional[tuple] = None
    base: List[tuple] = field(default_factory=list)  # random transforms, when there is no template
    base_parallel: List[tuple] = field(default_factory=list)  # (axis, ptype)
    per_tensor: List[tuple] = field(default_factory=list)  # (mode, own transforms, own parallel, perturb)
    serial_grid: List[int] = field(default_factory=list)
    segments: List[tuple] = field(default_factory=list)  # ("red"|"any", k): fd.segment_after
    inline: List[tuple] = field(default_factory=list)  # (k, position: < 0 as is, 4 as is, else mod rank + 1)


def _transforms(d: RandomDraw, n: int) -> List[tuple]:
    out = []
    for _ in range(n):
        kind = d.choice(["split", "split", "split", "merge", "merge", "reorder"])
        if kind == "split":
            f = d.choice(FACTORS) if d.bool(0.8) else d.int(1, 257)
            out.append(("split", d.int(0, 99), f, d.bool(0.8)))
        elif kind == "merge":
            out.append(("merge", d.int(0, 99)))
        else:
            out.append(("reorder", d.int(0, 10 ** 6)))
    return out


def _parallel(d: RandomDraw) -> List[tuple]:
    n = d.choice([0, 1, 1, 2, 2, 3])
    return [(d.choice([0, 0, 1, -1, -1, 2, -2]), d.choice(PTYPES)) for _ in range(n)]


def _split(d: RandomDraw, factors: Sequence[int], inner_p: float = 0.8) -> tuple:
    f = d.choice(factors) if d.bool(0.85) else d.int(1, 257)
    return (f, d.bool(inner_p))


def _template(d: RandomDraw) -> tuple:
    """A schedule shape for every tensor: its reduced axes (R) and the others (I), each group
    ordered, merged, split and parallelized alike (the slots name the parts)."""
    fam = d.choice(["block", "block", "block", "grid", "grid", "thread", "thread", "random"])
    order = "IR" if d.bool(0.85) else "RI"
    merge_i, merge_r = d.bool(0.7), d.bool(0.75)
    slots: Dict[str, Optional[str]] = {}
    split_i: Optional[tuple] = None
    if fam == "block":  # the reduced axis (its inner or outer part) on threads, rows on blocks
        split_r: Optional[tuple] = _split(d, [2, 4, 8, 16, 32, 32, 64, 128, 3, 5, 7]) if d.bool(0.8) else None
        tid = "TIDx" if d.bool(0.8) else "TIDy"
        other = d.choice([None, None, None, "Unroll"])
        inner = split_r is None or split_r[1]
        slots.update(R=tid, Ri=tid if inner else other, Ro=other if inner else tid)
        slots.update(I="BIDx", Io="BIDx", I0=d.choice([None, "BIDy"]))
        if d.bool(0.3):
            split_i = _split(d, [1, 2, 4, 8])
            slots["Ii"] = "TIDy" if tid == "TIDx" else "TIDx"
            if d.bool(0.3):
                slots["Ii"] = None
    elif fam == "grid":  # the reduced axis (a part of it) on blocks
        split_r = _split(d, [2, 4, 8, 16, 32, 64, 3, 7]) if d.bool(0.75) else None
        bid = d.choice(["BIDx", "BIDx", "BIDy"])
        thread = d.choice(["TIDx", "TIDx", "TIDy", None, "Unroll"])
        outer_on_blocks = d.bool(0.5)
        slots.update(R=bid, Ro=bid if outer_on_blocks else thread, Ri=thread if outer_on_blocks else bid)
        rest = [p for p in ("BIDx", "BIDy", "TIDx", "TIDy") if p not in (bid, thread)]
        slots.update(I=d.choice(rest + [None]), I0=None)
        if d.bool(0.25):
            split_i = _split(d, [2, 4, 32])
            slots.update(Io=d.choice(rest + [None]), Ii=None)
    elif fam == "thread":  # a thread per row (or rows on blocks), the reduced axis serial
        split_r = _split(d, [2, 3, 4, 8, 16]) if d.bool(0.4) else None
        slots.update(R=None, Ro=None, Ri=d.choice([None, "Unroll"]))
        split_i = _split(d, [1, 2, 4, 8, 32, 64, 128, 5]) if d.bool(0.8) else None
        slots.update(I=d.choice(["TIDx", "BIDx"]), Io="BIDx", Ii=d.choice(["TIDx", "TIDx", "TIDy"]),
                     I0=d.choice([None, "BIDy"]))
    else:
        split_r = _split(d, FACTORS) if d.bool(0.6) else None
        split_i = _split(d, FACTORS) if d.bool(0.5) else None
        for s in ("I", "I0", "Io", "Ii", "R", "R0", "Ro", "Ri"):
            slots[s] = d.choice(RANDOM_SLOT)
    items = tuple((k, v) for k, v in slots.items() if v is not None)
    return (d.int(0, 99), order, merge_i, merge_r, split_r, split_i, items)


def _pointwise_op(d: RandomDraw, src: int) -> tuple:
    kind = d.choice(["unary", "unary", "binary", "binary", "const", "bcast"])
    if kind == "unary":
        return ("unary", d.choice(UNARY), src)
    if kind == "binary":
        return ("binary", d.choice(BINARY), src, d.int(0, 999))
    if kind == "const":
        return ("const", d.choice(["add", "mul", "sub"]), src, d.choice([0.5, -1.5, 2.0]))
    return ("bcast", d.int(0, 999), d.int(0, 999))


def gen_case(d: RandomDraw) -> Case:
    r = d.int(1, 3)
    sizes = [d.choice(SIZES) for _ in range(r)]
    while int(np.prod(sizes)) > MAX_ELEMENTS:
        i = int(np.argmax(sizes))
        sizes[i] = max(1, sizes[i] // 3)
    c = Case(sizes=sizes, seed=d.int(0, 2 ** 16), static=d.bool(0.6))
    # (drawn first: a grid reduction's result is read by its epilogue only in a kernel of its
    # own, so grid schedules get fewer epilogues)
    if d.bool(0.75):
        c.template = _template(d)
    grid = c.template is not None and dict(c.template[-1]).get("R", "").startswith("BID")
    if d.bool(0.5 if grid else 0.1):  # a kernel of its own for what reads a (grid) reduction
        c.segments.append(("red", c.template[0] if grid and d.bool(0.7) else d.int(0, 99)))
    if d.bool(0.1):
        c.segments.append(("any", d.int(0, 999)))
    if grid and d.bool(0.3):
        c.memory.append((-1, "Global"))  # the grid reduction into Global
    for _ in range(d.choice([0, 0, 1, 1, 2])):
        kind = d.choice(["full", "full", "sub", "ones"])
        axes = tuple(a for a in range(r) if d.bool(0.5))
        if kind == "sub" and len(axes) == r:
            axes = axes[1:]
        c.inputs.append((kind, axes) if kind != "full" else ("full",))
    for _ in range(d.choice([0, 0, 1, 1, 2, 3])):  # the prologue
        c.ops.append(_pointwise_op(d, d.int(0, 999)))
    for j in range(d.choice([1, 1, 1, 2, 2, 3])):
        mask = tuple(d.bool(0.4) for _ in range(3))
        same = j > 0 and d.bool(0.35)  # two reductions of one tensor
        if d.bool(0.12):
            c.ops.append(("softmax", "max", d.int(0, 999), mask, d.int(0, 2), True, same))
        else:
            red = d.choice(REDUCTIONS)
            c.ops.append(("reduce", red, d.int(0, 999), mask, d.int(0, 2), d.bool(0.35), same))
        if d.bool(0.3):
            c.ops.append(d.choice([("unary", d.choice(UNARY), -1),
                                   ("const", d.choice(["add", "mul"]), -1, d.choice([0.5, -1.5, 2.0]))]))
        if d.bool(0.25 if grid and not c.segments else 0.65):  # the epilogue: a reduction broadcast back
            c.ops.append(("back", d.int(0, 999), d.choice(["sub", "sub", "add", "mul", "maximum", "minimum"]),
                          d.bool(0.3)))
            if d.bool(0.3):
                c.ops.append(_pointwise_op(d, -1))
    for _ in range(d.choice([0, 1, 1, 2])):
        c.extra_outputs.append((d.choice(["red", "red", "any"]), d.int(0, 999)))
    for _ in range(d.choice([0, 0, 1, 2])):
        c.caches.append((d.choice(["after", "after", "before"]), d.int(0, 999)))
    for _ in range(d.choice([0, 0, 1, 2, 3])):
        c.memory.append((d.int(0, 999), d.choice(["Shared", "Shared", "Local", "Local", "Global"])))
    if c.template is None:
        c.base = _transforms(d, d.choice([0, 1, 2, 2, 3, 4]))
        c.base_parallel = _parallel(d)
    for _ in range(12):
        mode = d.choice(["base"] * 8 + ["perturbed"] * 2 + ["own"] + ["none"] * 2)
        perturb = (d.choice(["I", "Io", "Ii", "R", "Ro", "Ri"]), d.choice(RANDOM_SLOT))
        c.per_tensor.append((mode, _transforms(d, d.choice([0, 1, 2, 3])), _parallel(d), perturb))
    if d.bool(0.2):
        c.serial_grid.append(d.int(0, 99))
    for _ in range(d.choice([0, 2, 4, 6, 8, 10])):
        c.inline.append((d.int(0, 999), d.choice([-1, -1, -1, -2, 0, 1, 2, 3, 4])))
    return c


def cases() -> Any:
    """Hypothesis strategy of cases: a seed, expanded by ``gen_case``."""
    return harness.seeded_cases(gen_case)


# -- building ------------------------------------------------------------------------------------
@dataclass
class Val:
    name: str
    axes: Tuple[int, ...]  # base axes of its logical domain, in order
    bcast: Tuple[bool, ...]  # per axis: a broadcast (size-one) axis
    ref: np.ndarray
    err: np.ndarray  # an estimated bound of the float32 rounding error of ``ref``'s computation
    is_input: bool = False
    from_reduction: bool = False  # a reduction or computed from one
    is_reduction: bool = False  # the output of a reduction op (its loop domain has reduced axes)
    operand: bool = True  # may be read by later ops (the reduction under a keepdim is not)
    source: Optional[str] = None  # a reduction's input


@dataclass
class Program:
    case: Case
    input_code: List[str]
    def_lines: List[str]
    sched_lines: List[str]  # the scheduling calls that were accepted, in order
    refused_lines: List[Tuple[str, str]]  # (line, message) of scheduling calls that raised
    fd: Any
    arrays: List[np.ndarray]
    outputs: List[Val]


def _binary_err(op: str, a: Val, b: Val, out: np.ndarray) -> np.ndarray:
    if op in ("add", "sub"):
        e = a.err + b.err
    elif op == "mul":
        e = np.abs(a.ref) * b.err + np.abs(b.ref) * a.err + a.err * b.err
    elif op == "div":
        e = (a.err + np.abs(out) * b.err) / np.maximum(np.abs(b.ref) - b.err, 1e-30)
    else:
        e = np.maximum(a.err, b.err)
    return e + EPS * np.abs(out)


class _Builder:
    def __init__(self, case: Case) -> None:
        self.case = case
        self.r = len(case.sizes)
        self.ns: Dict[str, Any] = {"DataType": DataType, "P": ParallelType, "M": MemoryType, "Tensor": Tensor}
        self.vals: List[Val] = []
        self.input_code: List[str] = []
        self.def_lines: List[str] = []
        self.sched_lines: List[str] = []
        self.refused: List[Tuple[str, str]] = []
        self.arrays: List[np.ndarray] = []
        self.outputs: List[Val] = []
        # per schedulable tensor: the base axes of its loop domain and which of them it reduces
        self.loops: Dict[str, Tuple[Tuple[int, ...], FrozenSet[int]]] = {}
        self.used: set = set()  # tensors that others read
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"t{self.n - 1}"

    def define(self, line: str) -> None:
        exec(line, self.ns)
        self.def_lines.append(line)
        if " = " in line:
            self.used.update(re.findall(r"\bt\d+\b", line.split(" = ", 1)[1].split("#")[0]))

    def add(self, v: Val, loop: Optional[Tuple[int, ...]] = None, red: FrozenSet[int] = frozenset()) -> Val:
        self.vals.append(v)
        if not v.is_input:
            self.loops[v.name] = (v.axes if loop is None else loop, red)
        return v

    def emit(self, expr: str, axes: Tuple[int, ...], bcast: Tuple[bool, ...], ref: np.ndarray,
             err: np.ndarray, from_reduction: bool) -> Val:
        name = self.fresh()
        self.define(f"{name} = {expr}")
        return self.add(Val(name, axes, bcast, ref, err, from_reduction=from_reduction))

    def add_input(self, axes: Tuple[int, ...], bcast: Tuple[bool, ...]) -> None:
        name = self.fresh()
        shape = [1 if b else (self.case.sizes[a] if self.case.static else -1) for a, b in zip(axes, bcast)]
        bcast = tuple(b or (self.case.static and self.case.sizes[a] == 1) for a, b in zip(axes, bcast))
        real = [1 if b else self.case.sizes[a] for a, b in zip(axes, bcast)]
        k = len(self.arrays)
        # drawn as the repro draws it, so a printed repro runs on the same values
        arr = np.random.default_rng(self.case.seed + k).uniform(-1, 1, real).astype(np.float32)
        self.arrays.append(arr)
        self.input_code.append(f"a{k} = np.random.default_rng({self.case.seed + k}).uniform(-1, 1, {real})"
                               f".astype(np.float32)")
        self.define(f"{name} = fd.define_tensor(shape={shape}, dtype=DataType.Float)")
        self.add(Val(name, axes, bcast, arr.astype(np.float64), np.zeros(arr.shape), is_input=True))

    def operands(self) -> List[Val]:
        return [v for v in self.vals if v.operand]

    def pick(self, k: int, among: Optional[List[Val]] = None) -> Val:
        vals = self.operands() if among is None else among
        return vals[k % len(vals)]

    # -- ops --
    def unary(self, op: str, src: Val) -> Val:
        ref = _REF_UNARY[op](src.ref)
        return self.emit(f"fd.ops.{op}({src.name})", src.axes, src.bcast, ref,
                         src.err + EPS * np.abs(ref), src.from_reduction)

    def const(self, op: str, src: Val, c: float) -> Val:
        ref = src.ref * c if op == "mul" else _REF_BINARY[op](src.ref, c)
        err = (abs(c) if op == "mul" else 1.0) * src.err + EPS * np.abs(ref)
        return self.emit(f"fd.ops.{op}({src.name}, {c!r})", src.axes, src.bcast, ref, err, src.from_reduction)

    def binary(self, op: str, a: Val, b: Val) -> Val:
        fn = _REF_BINARY.get(op, np.divide)
        ref = fn(a.ref, b.ref)
        bc = tuple(x and y for x, y in zip(a.bcast, b.bcast))
        return self.emit(f"fd.ops.{op}({a.name}, {b.name})", a.axes, bc, ref, _binary_err(op, a, b, ref),
                         a.from_reduction or b.from_reduction)

    def broadcast_full(self, src: Val) -> Val:
        r = self.r
        bc = tuple(True if a not in src.axes else src.bcast[src.axes.index(a)] for a in range(r))
        expand = tuple(a for a in range(r) if a not in src.axes)
        expr = f"fd.ops.broadcast_in_dim({src.name}, shape={[-1] * r}, broadcast_dims={list(src.axes)})"
        return self.emit(expr, tuple(range(r)), bc, np.expand_dims(src.ref, expand),
                         np.expand_dims(src.err, expand), src.from_reduction)

    def reduce(self, op: str, src: Val, dims: List[int], keepdim: bool) -> Val:
        axis = tuple(dims)
        red = frozenset(src.axes[d] for d in dims)
        n = int(np.prod([src.ref.shape[d] for d in dims]))
        fn = {"sum": np.sum, "max": np.max, "min": np.min}[op]
        ref = fn(src.ref, axis=axis, keepdims=keepdim)
        if op == "sum":  # any order: a bound of float32 sums' rounding, and the inputs' errors
            err = np.sum(src.err, axis=axis, keepdims=keepdim) + EPS * (2 + 2 * math.sqrt(n)) * np.sum(
                np.abs(src.ref), axis=axis, keepdims=keepdim)
        else:
            err = np.max(src.err, axis=axis, keepdims=keepdim)
        expr = f"fd.ops.{op}({src.name}, dims={dims}{', keepdim=True' if keepdim else ''})"
        if not keepdim:
            kept = tuple(a for a in src.axes if a not in red)
            kb = tuple(b for a, b in zip(src.axes, src.bcast) if a not in red)
            name = self.fresh()
            self.define(f"{name} = {expr}")
            v = Val(name, kept, kb, ref, err, from_reduction=True, is_reduction=True, source=src.name)
            return self.add(v, loop=src.axes, red=red)
        # keepdim: the handle is a broadcast of the reduction, which is named for scheduling
        hidden, name = self.fresh(), self.fresh()
        self.define(f"{name} = {expr}")
        rid = self.ns[name]._id - 1
        self.define(f"{hidden} = Tensor(fd, {rid})  # the reduction under the keepdim broadcast")
        self.used.add(hidden)  # (read by the broadcast)
        if not any(ax.is_reduction for ax in self.ns[hidden].loop_domain):
            raise AssertionError(f"generator: T{rid} is not the reduction under {name}")
        kept = tuple(a for a in src.axes if a not in red)
        kb = tuple(b for a, b in zip(src.axes, src.bcast) if a not in red)
        self.add(Val(hidden, kept, kb, np.squeeze(ref, axis=axis), np.squeeze(err, axis=axis),
                     from_reduction=True, is_reduction=True, operand=False, source=src.name),
                 loop=src.axes, red=red)
        bc = tuple(b or a in red for a, b in zip(src.axes, src.bcast))
        return self.add(Val(name, src.axes, bc, ref, err, from_reduction=True))

    def reduction_source(self, k: int, same: bool) -> Optional[Val]:
        if same:
            prev = [v for v in self.vals if v.is_reduction]
            if prev:
                src = next(v for v in self.vals if v.name == prev[-1].source)
                return src
        cands = [v for v in self.operands() if v.axes]
        full = [v for v in cands if len(v.axes) == self.r]
        if full and k % 4:
            return full[k % len(full)]
        return cands[k % len(cands)] if cands else None

    def build_definition(self) -> None:
        c, r = self.case, self.r
        self.add_input(tuple(range(r)), (False,) * r)
        for spec in c.inputs:
            if spec[0] == "full":
                self.add_input(tuple(range(r)), (False,) * r)
            elif spec[0] == "sub":
                self.add_input(tuple(spec[1]), (False,) * len(spec[1]))
            else:
                self.add_input(tuple(range(r)), tuple(a in spec[1] for a in range(r)))
        last_source: Optional[Val] = None
        for op in c.ops:
            if op[0] == "unary":
                self.unary(op[1], self.pick(op[2]))
            elif op[0] == "const":
                self.const(op[1], self.pick(op[2]), op[3])
            elif op[0] == "binary":
                a = self.pick(op[2])
                b = self.pick(op[3], [v for v in self.operands() if v.axes == a.axes])
                self.binary(op[1], a, b)
            elif op[0] == "bcast":
                lower = [v for v in self.operands() if len(v.axes) < r]
                if not lower:
                    continue
                bb = self.broadcast_full(lower[op[1] % len(lower)])
                fulls = [v for v in self.operands() if v.axes == tuple(range(r)) and v is not bb]
                if fulls and op[2] % 3:
                    self.binary("add", bb, fulls[op[2] % len(fulls)])
            elif op[0] in ("reduce", "softmax"):
                src = self.reduction_source(op[2], op[-1])
                if src is None:
                    continue
                mask, first = op[3], op[4]
                dims = [i for i in range(len(src.axes)) if mask[i % 3]] or [first % len(src.axes)]
                last_source = src
                if op[0] == "softmax":
                    m = self.reduce("max", src, dims, True)
                    e = self.binary("sub", src, m)
                    ex = self.emit(f"fd.ops.exp({e.name})", e.axes, e.bcast, np.exp(e.ref),
                                   np.exp(e.ref) * (e.err + EPS), True)
                    s = self.reduce("sum", ex, dims, True)
                    self.binary("div", ex, s)
                elif op[1] == "mean":
                    s = self.reduce("sum", src, dims, op[5])
                    n = int(np.prod([src.ref.shape[d] for d in dims]))
                    self.const("mul", s, 1.0 / n)
                else:
                    self.reduce(op[1], src, dims, op[5])
            elif op[0] == "back":
                reds = [v for v in self.operands() if v.from_reduction]
                if not reds:
                    continue
                a = reds[-1]
                if len(a.axes) < r:
                    a = self.broadcast_full(a)
                fulls = [v for v in self.operands() if v.axes == tuple(range(r)) and v is not a]
                if not fulls:
                    continue
                b = fulls[op[1] % len(fulls)]
                if last_source is not None and last_source in fulls and op[1] % 3 == 0:
                    b = last_source  # x - max(x)
                self.binary(op[2], *((a, b) if op[3] else (b, a)))
        computed = [v for v in self.vals if not v.is_input]
        if not computed:
            src = self.vals[0]
            self.reduce("sum", src, [0], False)
            computed = [v for v in self.vals if not v.is_input]
        outs = [computed[-1]]
        for kind, k in c.extra_outputs:
            pool = [v for v in computed if v.from_reduction] if kind == "red" else computed
            if pool and pool[k % len(pool)] not in outs:
                outs.append(pool[k % len(pool)])
        for o in outs:
            self.define(f"fd.add_output({o.name})")
        self.outputs = outs

    # -- scheduling --
    def call(self, line: str) -> bool:
        try:
            exec(line, self.ns)
        except KilnError as e:
            self.refused.append((line, str(e)))
            return False
        self.sched_lines.append(line)
        return True

    def loop_rank(self, name: str) -> int:
        return len(self.ns[name].loop_domain)

    def apply_transforms(self, name: str, transforms: Sequence[tuple]) -> None:
        for tr in transforms:
            n = self.loop_rank(name)
            if n == 0:
                return
            if tr[0] == "split":
                inner = "" if tr[3] else ", inner_split=False"
                self.call(f"{name}.split({tr[1] % n}, {tr[2]}{inner})")
            elif tr[0] == "merge" and n > 1:
                self.call(f"{name}.merge({tr[1] % (n - 1)})")
            elif tr[0] == "reorder" and n > 1:
                perm = list(range(n))
                random.Random(tr[1]).shuffle(perm)
                if perm != list(range(n)):
                    self.call(f"{name}.reorder({dict(enumerate(perm))})")

    def apply_parallel(self, name: str, par: Sequence[tuple]) -> None:
        for ax, pt in par:
            n = self.loop_rank(name)
            if not -n <= ax < n:
                continue
            self.call(f"{name}.axis({ax}).parallelize(P.{pt})")

    def apply_template(self, name: str, tpl: tuple, reduced: FrozenSet[int],
                       perturb: Optional[tuple] = None) -> None:
        """Order ``name``'s loop axes I (not in ``reduced``) then R (or R then I), merge each
        group, split its last axis, and parallelize the parts by the template's slots: the
        last axis of a group is slot I (R), its first of several I0 (R0), a split's parts Io/Ii
        (Ro/Ri)."""
        _, order, merge_i, merge_r, split_r, split_i, items = tpl
        loop = self.loops[name][0]
        if self.loop_rank(name) != len(loop):
            return
        labels = ["R" if a in reduced else "I" for a in loop]
        first = "R" if order == "RI" else "I"
        perm = sorted(range(len(labels)), key=lambda p: (labels[p] != first, p))  # perm[new] = old
        moves = {old: new for new, old in enumerate(perm) if old != new}
        if moves and self.call(f"{name}.reorder({moves})"):
            labels = [labels[old] for old in perm]
        for lab, on in (("I", merge_i), ("R", merge_r)):
            while on:
                ps = [p for p, x in enumerate(labels) if x == lab]
                if len(ps) < 2 or ps[1] != ps[0] + 1 or not self.call(f"{name}.merge({ps[0]})"):
                    break
                del labels[ps[0] + 1]
        for lab, sp in (("R", split_r), ("I", split_i)):
            ps = [p for p, x in enumerate(labels) if x == lab]
            if sp is None or not ps:
                continue
            if self.call(f"{name}.split({ps[-1]}, {sp[0]}{'' if sp[1] else ', inner_split=False'})"):
                labels[ps[-1]:ps[-1] + 1] = [lab + "o", lab + "i"]
        slots = dict(items)
        if perturb is not None:
            slots[perturb[0]] = perturb[1]
        names = list(labels)
        for lab in ("I", "R"):
            ps = [p for p, x in enumerate(labels) if x == lab]
            if len(ps) > 1:
                names[ps[0]] = lab + "0"
        for p, slot in enumerate(names):
            pt = slots.get(slot)
            if pt is not None:
                self.call(f"{name}.axis({p}).parallelize(P.{pt})")

    def build_schedule(self) -> None:
        c, r = self.case, self.r
        axes = {v.name: v.axes for v in self.vals}  # logical axes, by tensor
        inputs = [v.name for v in self.vals if v.is_input]
        outputs = [v.name for v in self.outputs]
        reductions = [v.name for v in self.vals if v.is_reduction]
        tensors = [v.name for v in self.vals if not v.is_input]
        for kind, k in c.caches:
            pool = inputs + reductions if kind == "after" else outputs + reductions
            src = pool[k % len(pool)]
            name = self.fresh()
            if not self.call(f"{name} = {src}.cache_{kind}()"):
                continue
            tensors.append(name)
            self.used.update((src, name))
            axes[name] = axes[src]
            if kind == "after":
                self.loops[name] = (axes[src], frozenset())
            else:  # the new tensor takes over the definition; the old one becomes its copy
                self.loops[name] = self.loops[src]
                self.loops[src] = (axes[src], frozenset())
                if src in reductions:
                    reductions.append(name)
        main = reductions[c.template[0] % len(reductions)] if c.template is not None and reductions else None
        intermediates = [t for t in tensors if t not in outputs]
        for k, mt in c.memory:
            if k == -1 and main is not None:  # (the template's reduction)
                self.call(f"{main}.set_memory_type(M.{mt})")
            elif k >= 0 and intermediates:
                self.call(f"{intermediates[k % len(intermediates)]}.set_memory_type(M.{mt})")
        for kind, k in c.segments:
            pool = reductions if kind == "red" else tensors
            if pool:
                self.call(f"fd.segment_after({pool[k % len(pool)]})")
        reduced: FrozenSet[int] = frozenset() if main is None else self.loops[main][1]
        for i, t in enumerate(tensors):
            mode, own, own_par, perturb = c.per_tensor[i % len(c.per_tensor)]
            if mode == "none":
                continue
            if mode in ("base", "perturbed") and c.template is not None:
                self.apply_template(t, c.template, reduced, perturb if mode == "perturbed" else None)
                continue
            if mode in ("base", "perturbed") and self.loop_rank(t) == r:
                self.apply_transforms(t, c.base)
                par = list(c.base_parallel)
                if mode == "perturbed":
                    par = par[1:] + own_par[:1]
                self.apply_parallel(t, par)
            else:
                self.apply_transforms(t, own)
                self.apply_parallel(t, own_par)
        for k in c.serial_grid:
            if reductions:
                self.call(f"{reductions[k % len(reductions)]}.set_serial_grid_reduction()")
        # (outputs too: an output read by later tensors may be computed inside their loops)
        inlinable = [t for t in tensors if t in self.used]
        if inlinable:
            for k, pos in c.inline:
                t = inlinable[k % len(inlinable)]
                n = self.loop_rank(t)
                # (a position past the loop axes now and then: its refusal is part of the contract)
                self.call(f"{t}.inline_at({pos if pos < 0 or pos == 4 else pos % (n + 1)})")


def build(case: Case) -> Program:
    """Define and schedule ``case``; scheduling calls that raise ``KilnError`` are left out."""
    b = _Builder(case)
    fd = FusionDefinition()
    b.ns["fd"] = fd
    fd.__enter__()
    try:
        with np.errstate(over="ignore", under="ignore"):  # (sigmoid of a large sum: exp overflows to 0)
            b.build_definition()
    except BaseException as e:
        fd.__exit__(type(e), e, e.__traceback__)
        raise
    fd.__exit__(None, None, None)
    b.build_schedule()
    return Program(case, b.input_code, b.def_lines, b.sched_lines, b.refused, fd, b.arrays, b.outputs)


# -- running and classifying -----------------------------------------------------------------------
@dataclass
class ROutcome(Outcome):
    """An outcome and the messages of the scheduling calls that raised (left out of the example)."""

    calls_refused: List[str] = field(default_factory=list)


def check_output(v: Val, got: Any) -> Optional[str]:
    """``got`` against the reference, within 1e-4 relative, 1e-5 of the output's scale and
    twice the bound of the float32 rounding of the reductions that led to it."""
    got = np.asarray(got)
    if got.shape != v.ref.shape:
        return f"{v.name}: shape {got.shape}, expected {v.ref.shape}"
    scale = 1.0 + float(np.max(np.abs(v.ref))) if v.ref.size else 1.0
    tol = 1e-4 * np.abs(v.ref) + 1e-5 * scale + 2 * v.err
    bad = ~(np.abs(got.astype(np.float64) - v.ref) <= tol)
    if not bad.any():
        return None
    at = tuple(int(j) for j in np.argwhere(bad)[0])
    return (f"{v.name}: values differ at {int(bad.sum())} of {bad.size} elements, first at {at}: "
            f"got {got[at]!r}, expected {v.ref[at]!r}")


def run_case(case: Case) -> ROutcome:
    """Build, lower and run ``case`` in the interpreter; classify what happened."""
    try:
        prog = build(case)
    except Exception as e:  # noqa: BLE001 - a non-KilnError from a primitive is a kiln bug
        return ROutcome("internal", f"build: {type(e).__name__}: {e}", "build: " + normalize(str(e)))
    calls = [msg for _, msg in prog.refused_lines]
    try:
        low = prog.fd.lower(prog.arrays)
        for k in low.kernels:
            _ = k.cuda_source  # codegen refusals count as refusals before running
    except Exception as e:  # noqa: BLE001 - every failure of the compiler is classified
        return ROutcome(classify(e, running=False), f"lower: {type(e).__name__}: {e}", normalize(str(e)),
                        calls_refused=calls)
    try:
        with np.errstate(all="ignore"):
            outs = prog.fd.execute(prog.arrays)
    except Exception as e:  # noqa: BLE001
        return ROutcome(classify(e, running=True), f"execute: {type(e).__name__}: {e}", normalize(str(e)),
                        calls_refused=calls)
    problems = [p for v, g in zip(prog.outputs, outs) if (p := check_output(v, g))]
    if len(outs) != len(prog.outputs):
        problems.insert(0, f"{len(outs)} outputs, expected {len(prog.outputs)}")
    if problems:
        kind = "shape" if "shape" in problems[0] else "values"
        return ROutcome("mismatch", "; ".join(problems[:3]), f"{kind} differ", list(low.kernels),
                        calls_refused=calls)
    return ROutcome("ok", kernels=list(low.kernels), calls_refused=calls)


def repro(case: Case, outcome: Optional[Outcome] = None) -> str:
    """A runnable program that rebuilds ``case`` (accepted scheduling calls only) and runs it."""
    try:
        prog = build(case)
    except Exception as e:  # noqa: BLE001
        return f"# could not rebuild: {e}\n# {case!r}"
    out = ["import numpy as np", "from kiln import DataType, FusionDefinition, MemoryType as M, "
           "ParallelType as P", "from kiln.fusion import Tensor", ""]
    out += prog.input_code
    out += ["with FusionDefinition() as fd:"] + ["    " + ln for ln in prog.def_lines]
    out += prog.sched_lines
    out.append(f"outs = fd.execute([{', '.join(f'a{i}' for i in range(len(prog.arrays)))}])")
    if outcome is not None and outcome.message:
        out.append(f"# {outcome.category}: {outcome.message.splitlines()[0][:300]}")
    return "\n".join(out)


def case_size(case: Case) -> Tuple[int, int]:
    return (len(case.ops) + len(case.inline) + len(case.caches) + len(case.memory), int(np.prod(case.sizes)))


def reduction_refusal_rule(msg: str) -> str:
    """The rule a refusal message comes from: a reduction's own, else test_manual_random's."""
    return next((name for name, pat in _RED_RULES if re.search(pat, msg)), None) or refusal_rule(msg)


def summarize(results: Sequence[Tuple[Case, ROutcome]], max_groups: int = 12, calls: int = 0) -> str:
    """Counts per category, the refusal messages' distribution, and a repro per failure kind;
    with ``calls``, the ``calls`` most frequent messages of the scheduling calls that raised."""
    lines = harness.summary_lines(results, CATEGORIES, case_size, repro, max_groups, reduction_refusal_rule)
    if calls:
        refused = Counter(normalize(m) for _, o in results for m in o.calls_refused)
        lines.append(f"\n=== scheduling calls refused (left out): {sum(refused.values())} calls ===")
        lines += [f"  {n:5d}  {key}" for key, n in refused.most_common(calls)]
    return "\n".join(lines)


# -- the CI test ----------------------------------------------------------------------------------
RESULTS: List[Tuple[Case, ROutcome]] = []
_KEPT: list = []


def _collect() -> List[Tuple[Case, ROutcome]]:
    return harness.collect(RESULTS, _KEPT, cases(), run_case, N_EXAMPLES, COMPILE_EVERY, _CI_SEED)


@pytest.mark.may_spill  # a random hand schedule may hold thousands of Local elements per thread
def test_manual_reduction_schedules_are_refused_or_correct() -> None:
    results = _collect()
    harness.hand_kept_kernels_to_conftest(_KEPT)  # conftest compiles them with NVRTC
    bad = [(c, o) for c, o in results if o.category in FAILURES]
    if bad:
        pytest.fail(f"{len(bad)} of {len(results)} examples failed\n" + summarize(results), pytrace=False)


def test_manual_reduction_refusals_name_a_tensor() -> None:
    results = _collect()
    ok = sum(o.category == "ok" for _, o in results)
    # A floor on the share of accepted schedules (28-31% across hypothesis versions and
    # environments, whose example sequences differ): the generator must keep drawing mostly
    # valid schedules, or the refusal checks below test little.
    assert ok >= len(results) // 4, f"only {ok} accepted\n" + summarize(results)
    unnamed = [(c, o) for c, o in results if o.category == "refused" and not _NAMES_TENSOR.search(o.message)]
    if unnamed:
        pytest.fail("refusals must name a tensor:\n" + summarize(unnamed), pytrace=False)
    calls = sorted({m for _, o in results for m in o.calls_refused if not _NAMES_TENSOR.search(m)})
    assert not calls, "scheduling calls must name the tensor when they refuse:\n" + "\n".join(calls[:20])


@pytest.mark.gpu
def test_accepted_random_reduction_schedules_match_numpy_on_the_gpu() -> None:
    """The schedules the interpreter accepted, run on the GPU (``KILN_MANUAL_GPU_EXAMPLES``)."""
    # (compiled for the GPU they run on; spills are the schedule's cost)
    harness.rerun_accepted_on_gpu(_collect, "KILN_MANUAL_GPU_EXAMPLES", 120,
                                  lambda cp, case: harness.gpu_mismatch(cp, build(case), check_output),
                                  lambda case, msg: f"# {msg}\n{repro(case)}")


# -- explorer --------------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
    p = harness.explorer_parser("Explore random manual reduction schedules in the interpreter.", 2000)
    p.add_argument("--calls", type=int, default=25, help="messages of refused scheduling calls to list")
    args = p.parse_args(argv)
    results = harness.explore(args, "manual reduction-schedule", __file__, gen_case, run_case)
    print(summarize(results, max_groups=args.groups, calls=args.calls))
    return 1 if any(o.category in FAILURES for _, o in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
