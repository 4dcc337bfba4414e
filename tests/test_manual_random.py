"""Property test of MANUAL schedules: random pointwise fusions (ranks 1-3, sizes with 1 and
primes, unary and binary ops, broadcast inputs and ``broadcast_in_dim``) scheduled by hand at
random (splits by 1-257, merges, reorders, BIDx/BIDy/TIDx/TIDy/Unroll/Vectorize on random axes,
inline positions, Shared/Local intermediates, ``cache_after`` / ``cache_before``), run by
``fd.execute`` on NumPy arrays (the manual schedule in the CPU interpreter, which checks every
access) against a float64 NumPy reference.

Every example must be one of
  ok        the outputs equal the reference
  refused   a ``KilnError`` from ``fd.lower`` (validation, before anything runs) or from
            codegen, naming a tensor
and never
  mismatch  an output differs from the reference
  memfault  the interpreter found an out-of-bounds access, a race, an uninitialized read, an
            element never written, a divergent barrier (the schedule was accepted but is wrong)
  internal  an internal compiler error, or any exception that is not a ``KilnError``
  late      any other ``KilnError`` raised while running (refusals must come before; the
            launch limits, which need the input sizes, are checked by ``fd.execute`` before
            any kernel runs and count as refusals).
A scheduling primitive that raises ``KilnError`` leaves the fusion unchanged (it is part of the
contract); the example goes on without it, and the repro leaves the line out.

The generator emits each example as Python source lines (``repro`` prints a runnable program).
CI runs ``KILN_MANUAL_EXAMPLES`` (default 300) derandomized examples;
``python tests/test_manual_random.py 2000 [--seed S]`` draws fresh ones and prints the counts,
the refusal messages' distribution and every failure kind with a repro. The hypothesis
collection, the report and the explorer's loop are tests/random_harness.py's.
"""

from __future__ import annotations

import os
import random
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import random_harness as harness
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType
from random_harness import RandomDraw

N_EXAMPLES = int(os.environ.get("KILN_MANUAL_EXAMPLES", "300"))
# The kernels of every N-th accepted example are compiled with NVRTC by conftest (0: none).
COMPILE_EVERY = int(os.environ.get("KILN_MANUAL_COMPILE_EVERY", "10"))
# The derandomized profile's seed: the examples CI runs (each module its own).
_CI_SEED = 1
SIZES = [1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64, 97, 127, 128, 131, 257]
MAX_ELEMENTS = 2048
FACTORS = [1, 2, 2, 3, 4, 4, 5, 7, 8, 16, 31, 32, 64, 128, 257]
UNARY = ["abs", "neg", "sin", "cos", "tanh", "sigmoid", "relu"]
BINARY = ["add", "sub", "mul", "maximum", "minimum"]
PTYPES = ["BIDx", "BIDx", "TIDx", "TIDx", "TIDx", "TIDy", "BIDy", "Unroll", "Vectorize", "Vectorize"]
CATEGORIES = ["ok", "refused", "mismatch", "memfault", "internal", "late"]
FAILURES = ("mismatch", "memfault", "internal", "late")

_MEMFAULT = re.compile(
    r"out-of-bounds|out of bounds|memory race|\brace\b|uninitiali[sz]ed|never written|divergent barrier|"
    r"semaphore|overflows or divides by zero|has a bad size|accessed before its Allocate", re.I)
_INTERNAL = re.compile(r"internal compiler error|\bpanic", re.I)
# Launch limits depend on the input sizes, so they are checked when ``fd.execute`` binds the
# inputs, before any kernel runs (on the GPU and in the interpreter alike): a refusal too.
_LAUNCH_LIMIT = re.compile(r"the schedule launches .* (threads per block|threads;|blocks;)"
                           r"|bytes of Shared memory per")
_NAMES_TENSOR = re.compile(r"\bT\d+\b")
_REF_UNARY = {"abs": np.abs, "neg": np.negative, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
              "sigmoid": lambda y: 1 / (1 + np.exp(-y)), "relu": lambda y: np.maximum(y, 0)}
_REF_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
               "minimum": np.minimum}


# -- drawing (with random_harness.RandomDraw) -----------------------------------------------------
@dataclass
class Case:
    """A fusion and a schedule as plain data; axes and tensors are resolved modulo what exists."""

    sizes: List[int]
    seed: int
    static: bool = False
    # per extra input: ("full",) | ("sub", axes) | ("ones", axes): a lower-rank input over
    # `axes`, or a full-rank input with size-one broadcast axes at `axes`
    inputs: List[tuple] = field(default_factory=list)
    ops: List[tuple] = field(default_factory=list)
    extra_output: Optional[int] = None
    caches: List[tuple] = field(default_factory=list)  # ("after"|"before", k)
    memory: List[tuple] = field(default_factory=list)  # (k, "Shared"|"Local")
    base: List[tuple] = field(default_factory=list)  # transforms shared by "base" tensors
    base_parallel: List[tuple] = field(default_factory=list)  # (axis, ptype)
    per_tensor: List[tuple] = field(default_factory=list)  # (mode, own transforms, own parallel)
    inline: List[tuple] = field(default_factory=list)  # (k, position)


def _transforms(d: RandomDraw, n: int) -> List[tuple]:
    out = []
    for _ in range(n):
        kind = d.choice(["split", "split", "split", "merge", "merge", "reorder"])
        if kind == "split":
            f = d.choice(FACTORS) if d.bool(0.8) else d.int(1, 257)
            out.append(("split", d.int(0, 99), f, d.bool(0.85)))
        elif kind == "merge":
            out.append(("merge", d.int(0, 99)))
        else:
            out.append(("reorder", d.int(0, 10 ** 6)))
    return out


def _parallel(d: RandomDraw) -> List[tuple]:
    n = d.choice([0, 1, 1, 2, 2, 3])
    return [(d.choice([0, 0, 1, -1, -1, 2, -2]), d.choice(PTYPES)) for _ in range(n)]


def gen_case(d: RandomDraw) -> Case:
    r = d.int(1, 3)
    sizes = [d.choice(SIZES) for _ in range(r)]
    while int(np.prod(sizes)) > MAX_ELEMENTS:
        i = int(np.argmax(sizes))
        sizes[i] = max(1, sizes[i] // 3)
    c = Case(sizes=sizes, seed=d.int(0, 2 ** 16), static=d.bool(0.15))
    for _ in range(d.choice([0, 1, 1, 2])):
        kind = d.choice(["full", "sub", "sub", "ones"])
        axes = tuple(a for a in range(r) if d.bool(0.5))
        if kind == "sub" and len(axes) == r:
            axes = axes[1:]
        c.inputs.append((kind, axes) if kind != "full" else ("full",))
    for _ in range(d.int(1, 6)):
        kind = d.choice(["unary", "unary", "binary", "binary", "binary", "const", "bcast", "bcast"])
        a, b = d.int(0, 999), d.int(0, 999)
        if kind == "unary":
            c.ops.append(("unary", d.choice(UNARY), a))
        elif kind == "binary":
            c.ops.append(("binary", d.choice(BINARY), a, b))
        elif kind == "const":
            c.ops.append(("const", d.choice(["add", "mul", "sub"]), a, d.choice([0.5, -1.5, 2.0])))
        else:
            c.ops.append(("bcast", a, b))
    if d.bool(0.3):
        c.extra_output = d.int(0, 999)
    for _ in range(d.choice([0, 0, 1, 2])):
        c.caches.append((d.choice(["after", "after", "before"]), d.int(0, 999)))
    for _ in range(d.choice([0, 0, 1, 2, 3])):
        c.memory.append((d.int(0, 999), d.choice(["Shared", "Shared", "Local"])))
    c.base = _transforms(d, d.choice([0, 1, 2, 2, 3, 4]))
    c.base_parallel = _parallel(d)
    for _ in range(12):
        mode = d.choice(["base"] * 6 + ["perturbed"] * 2 + ["own"] * 2 + ["none"] * 2)
        c.per_tensor.append((mode, _transforms(d, d.choice([0, 1, 2, 3])), _parallel(d)))
    for _ in range(d.choice([0, 2, 4, 6, 8, 10])):
        c.inline.append((d.int(0, 999), d.choice([-1, -1, -1, 0, 1, 2, 3, 4])))
    return c


def cases() -> Any:
    """Hypothesis strategy of cases: a seed, expanded by ``gen_case``."""
    return harness.seeded_cases(gen_case)


# -- building ------------------------------------------------------------------------------------
@dataclass
class Val:
    name: str
    axes: Tuple[int, ...]  # base axes it covers, in order
    bcast: Tuple[bool, ...]  # per axis: a broadcast (size-one) axis
    ref: np.ndarray
    is_input: bool = False


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


class _Builder:
    def __init__(self, case: Case) -> None:
        self.case = case
        self.r = len(case.sizes)
        self.ns: Dict[str, Any] = {"DataType": DataType, "P": ParallelType, "M": MemoryType}
        self.vals: List[Val] = []
        self.input_code: List[str] = []
        self.def_lines: List[str] = []
        self.sched_lines: List[str] = []
        self.refused: List[Tuple[str, str]] = []
        self.arrays: List[np.ndarray] = []
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"t{self.n - 1}"

    def define(self, line: str) -> None:
        exec(line, self.ns)
        self.def_lines.append(line)

    def add_input(self, axes: Tuple[int, ...], bcast: Tuple[bool, ...]) -> None:
        name = self.fresh()
        shape = []
        for a, b in zip(axes, bcast):
            if b:
                shape.append(1)
            else:
                shape.append(self.case.sizes[a] if self.case.static else -1)
        # a static size of one is a broadcast axis
        bcast = tuple(b or (self.case.static and self.case.sizes[a] == 1) for a, b in zip(axes, bcast))
        real = [1 if b else self.case.sizes[a] for a, b in zip(axes, bcast)]
        k = len(self.arrays)
        # drawn as the repro draws it, so a printed repro runs on the same values
        arr = np.random.default_rng(self.case.seed + k).uniform(-1, 1, real).astype(np.float32)
        self.arrays.append(arr)
        self.input_code.append(f"a{k} = np.random.default_rng({self.case.seed + k}).uniform(-1, 1, {real})"
                               f".astype(np.float32)")
        self.define(f"{name} = fd.define_tensor(shape={shape}, dtype=DataType.Float)")
        self.vals.append(Val(name, axes, bcast, arr.astype(np.float64), is_input=True))

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
        for op in c.ops:
            vals = self.vals
            if op[0] == "unary":
                src = vals[op[2] % len(vals)]
                self.emit(f"fd.ops.{op[1]}({src.name})", src.axes, src.bcast, _REF_UNARY[op[1]](src.ref))
            elif op[0] == "const":
                src = vals[op[2] % len(vals)]
                ref = _REF_BINARY[op[1]](src.ref, op[3]) if op[1] != "mul" else src.ref * op[3]
                self.emit(f"fd.ops.{op[1]}({src.name}, {op[3]})", src.axes, src.bcast, ref)
            elif op[0] == "binary":
                a = vals[op[2] % len(vals)]
                partners = [v for v in vals if v.axes == a.axes]
                b = partners[op[3] % len(partners)]
                bc = tuple(x and y for x, y in zip(a.bcast, b.bcast))
                self.emit(f"fd.ops.{op[1]}({a.name}, {b.name})", a.axes, bc, _REF_BINARY[op[1]](a.ref, b.ref))
            else:
                lower = [v for v in vals if len(v.axes) < r]
                if not lower:
                    continue
                src = lower[op[1] % len(lower)]
                dims = list(src.axes)
                bc = tuple(True if a not in src.axes else src.bcast[src.axes.index(a)] for a in range(r))
                ref = np.expand_dims(src.ref, tuple(a for a in range(r) if a not in src.axes))
                self.emit(f"fd.ops.broadcast_in_dim({src.name}, shape={[-1] * r}, broadcast_dims={dims})",
                          tuple(range(r)), bc, ref)
                # join a full-rank tensor, so the broadcast axes are concretized
                fulls = [v for v in self.vals if v.axes == tuple(range(r)) and v is not self.vals[-1]]
                if fulls and op[2] % 3:
                    other = fulls[op[2] % len(fulls)]
                    b = self.vals[-1]
                    bc2 = tuple(x and y for x, y in zip(b.bcast, other.bcast))
                    self.emit(f"fd.ops.add({b.name}, {other.name})", b.axes, bc2, b.ref + other.ref)
        computed = [v for v in self.vals if not v.is_input]
        if not computed:
            src = self.vals[0]
            self.emit(f"fd.ops.neg({src.name})", src.axes, src.bcast, -src.ref)
            computed = [self.vals[-1]]
        outs = [computed[-1]]
        if c.extra_output is not None:
            extra = computed[c.extra_output % len(computed)]
            if extra is not outs[0]:
                outs.append(extra)
        for o in outs:
            self.define(f"fd.add_output({o.name})")
        self.outputs = outs

    def emit(self, expr: str, axes: Tuple[int, ...], bcast: Tuple[bool, ...], ref: np.ndarray) -> None:
        name = self.fresh()
        self.define(f"{name} = {expr}")
        self.vals.append(Val(name, axes, bcast, ref))

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

    def build_schedule(self) -> None:
        c = self.case
        inputs = [v.name for v in self.vals if v.is_input]
        outputs = [v.name for v in self.outputs]
        tensors = [v.name for v in self.vals if not v.is_input]
        for kind, k in c.caches:
            src = (inputs if kind == "after" else outputs)[k % len(inputs if kind == "after" else outputs)]
            name = self.fresh()
            if self.call(f"{name} = {src}.cache_{kind}()"):
                tensors.append(name)
        intermediates = [t for t in tensors if t not in outputs]
        if intermediates:
            for k, mt in c.memory:
                self.call(f"{intermediates[k % len(intermediates)]}.set_memory_type(M.{mt})")
        rank = {v.name: len(v.axes) for v in self.vals}
        for i, t in enumerate(tensors):
            mode, own, own_par = c.per_tensor[i % len(c.per_tensor)]
            full = rank.get(t, self.loop_rank(t)) == self.r and self.loop_rank(t) == self.r
            if mode == "none":
                continue
            if mode in ("base", "perturbed") and full:
                self.apply_transforms(t, c.base)
                par = list(c.base_parallel)
                if mode == "perturbed":
                    par = par[1:] + own_par[:1]
                self.apply_parallel(t, par)
            else:
                self.apply_transforms(t, own)
                self.apply_parallel(t, own_par)
        inlinable = [t for t in tensors if t not in outputs]
        if inlinable:
            for k, pos in c.inline:
                self.call(f"{inlinable[k % len(inlinable)]}.inline_at({pos})")


def build(case: Case) -> Program:
    """Define and schedule ``case``; scheduling calls that raise ``KilnError`` are left out."""
    b = _Builder(case)
    fd = FusionDefinition()
    b.ns["fd"] = fd
    fd.__enter__()
    try:
        b.build_definition()
    finally:
        fd.__exit__(None, None, None)
    b.build_schedule()
    return Program(case, b.input_code, b.def_lines, b.sched_lines, b.refused, fd, b.arrays, b.outputs)


# -- running and classifying -----------------------------------------------------------------------
@dataclass
class Outcome:
    category: str
    message: str = ""
    key: str = ""
    kernels: list = field(default_factory=list)


def normalize(msg: str) -> str:
    """The message's first line with tensor names, ids and numbers stripped (for grouping)."""
    m = msg.splitlines()[0] if msg else ""
    m = m.replace("internal compiler error (please report): ", "")
    m = re.sub(r"[ib][A-Za-z.]*\d+\{[^}]*\}", "<id>", m)
    m = re.sub(r"\bT\d+\b", "T#", m)
    m = re.sub(r"\bkernel\d+\b", "kernel#", m)
    m = re.sub(r"\([^()]*\)", "(..)", m)
    m = re.sub(r"\[[^\]]*\]", "[..]", m)
    m = re.sub(r"-?\d+", "#", m)
    return m[:150]


def classify(e: BaseException, running: bool) -> str:
    msg = str(e)
    if not isinstance(e, KilnError) or _INTERNAL.search(msg):
        return "internal"
    if _MEMFAULT.search(msg):
        return "memfault"
    return "late" if running and not _LAUNCH_LIMIT.search(msg) else "refused"


def check_output(v: Val, got: Any) -> Optional[str]:
    got = np.asarray(got)
    if got.shape != v.ref.shape:
        return f"{v.name}: shape {got.shape}, expected {v.ref.shape}"
    scale = 1.0 + float(np.max(np.abs(v.ref))) if v.ref.size else 1.0
    bad = ~(np.abs(got.astype(np.float64) - v.ref) <= 1e-4 * np.abs(v.ref) + 1e-5 * scale)
    if not bad.any():
        return None
    at = tuple(int(j) for j in np.argwhere(bad)[0])
    return (f"{v.name}: values differ at {int(bad.sum())} of {bad.size} elements, first at {at}: "
            f"got {got[at]!r}, expected {v.ref[at]!r}")


def run_case(case: Case) -> Outcome:
    """Build, lower and run ``case`` in the interpreter; classify what happened."""
    try:
        prog = build(case)
    except Exception as e:  # noqa: BLE001 - a non-KilnError from a primitive is a kiln bug
        return Outcome("internal", f"schedule: {type(e).__name__}: {e}", "schedule: " + normalize(str(e)))
    try:
        low = prog.fd.lower(prog.arrays)
        for k in low.kernels:
            _ = k.cuda_source  # codegen refusals count as refusals before running
    except Exception as e:  # noqa: BLE001 - every failure of the compiler is classified
        cat = classify(e, running=False)
        return Outcome(cat, f"lower: {type(e).__name__}: {e}", normalize(str(e)))
    try:
        outs = prog.fd.execute(prog.arrays)
    except Exception as e:  # noqa: BLE001
        cat = classify(e, running=True)
        return Outcome(cat, f"execute: {type(e).__name__}: {e}", normalize(str(e)))
    problems = [p for v, g in zip(prog.outputs, outs) if (p := check_output(v, g))]
    if len(outs) != len(prog.outputs):
        problems.insert(0, f"{len(outs)} outputs, expected {len(prog.outputs)}")
    if problems:
        kind = "shape" if "shape" in problems[0] else "values"
        return Outcome("mismatch", "; ".join(problems[:3]), f"{kind} differ", list(low.kernels))
    return Outcome("ok", kernels=list(low.kernels))


def repro(case: Case, outcome: Optional[Outcome] = None) -> str:
    """A runnable program that rebuilds ``case`` (accepted scheduling calls only) and runs it."""
    try:
        prog = build(case)
    except Exception as e:  # noqa: BLE001
        return f"# could not rebuild: {e}\n# {case!r}"
    out = ["import numpy as np", "from kiln import DataType, FusionDefinition, MemoryType as M, "
           "ParallelType as P", ""]
    out += prog.input_code
    out += ["with FusionDefinition() as fd:"] + ["    " + ln for ln in prog.def_lines]
    out += prog.sched_lines
    out.append(f"outs = fd.execute([{', '.join(f'a{i}' for i in range(len(prog.arrays)))}])")
    if outcome is not None and outcome.message:
        out.append(f"# {outcome.category}: {outcome.message.splitlines()[0][:300]}")
    return "\n".join(out)


def case_size(case: Case) -> Tuple[int, int]:
    return (len(case.ops) + len(case.inline) + len(case.base), int(np.prod(case.sizes)))


RULES = [  # (rule, pattern of its refusal messages), for the explorer's distribution
    ("read from another thread/block (Local, or across blocks)", r"would read it from another"),
    ("block sync inside a partial thread loop", r"needs a block sync inside"),
    ("one parallel type per loop (loop group)", r"inconsistent parallelization"),
    ("each thread/block dimension once per tensor", r"both run on"),
    ("codegen: Local allocation of non-constant size", r"not a constant size"),
    ("launch limits", r"the schedule launches"),
    ("reduction consumer inside its reduction loop", r"reads the reduction"),
    ("inline / loop placement", r"cannot place|cannot promote|concretized loop|inline_at"),
]


def refusal_rule(msg: str) -> str:
    """The rule a refusal message comes from (``RULES``), or ``other``."""
    return next((name for name, pat in RULES if re.search(pat, msg)), "other")


def summarize(results: Sequence[Tuple[Case, Outcome]], max_groups: int = 12) -> str:
    """Counts per category, the refusal messages' distribution, and a repro per failure kind."""
    return "\n".join(harness.summary_lines(results, CATEGORIES, case_size, repro, max_groups, refusal_rule))


# -- the CI test ----------------------------------------------------------------------------------
RESULTS: List[Tuple[Case, Outcome]] = []
_KEPT: list = []


def _collect() -> List[Tuple[Case, Outcome]]:
    return harness.collect(RESULTS, _KEPT, cases(), run_case, N_EXAMPLES, COMPILE_EVERY, _CI_SEED)


@pytest.mark.may_spill  # a random hand schedule may hold thousands of Local elements per thread
def test_manual_random_schedules_are_refused_or_correct() -> None:
    results = _collect()
    harness.hand_kept_kernels_to_conftest(_KEPT)  # conftest compiles them with NVRTC
    bad = [(c, o) for c, o in results if o.category in FAILURES]
    if bad:
        pytest.fail(f"{len(bad)} of {len(results)} examples failed\n" + summarize(results), pytrace=False)


def test_manual_random_refusals_name_a_tensor() -> None:
    results = _collect()
    assert sum(o.category == "ok" for _, o in results) >= len(results) // 4, summarize(results)
    unnamed = [(c, o) for c, o in results if o.category == "refused" and not _NAMES_TENSOR.search(o.message)]
    if unnamed:
        pytest.fail("refusals must name a tensor:\n" + summarize(unnamed), pytrace=False)


@pytest.mark.gpu
def test_accepted_random_schedules_match_numpy_on_the_gpu() -> None:
    """The schedules the interpreter accepted, run on the GPU (``KILN_MANUAL_GPU_EXAMPLES``)."""
    # These kernels are compiled for the GPU they run on; a random hand schedule (a wide unroll)
    # may spill registers, which is its author's choice, not a compiler error.
    harness.rerun_accepted_on_gpu(_collect, "KILN_MANUAL_GPU_EXAMPLES", 120,
                                  lambda cp, case: harness.gpu_mismatch(cp, build(case), check_output),
                                  lambda case, msg: f"# {msg}\n{repro(case)}")


# -- explorer --------------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
    p = harness.explorer_parser("Explore random manual schedules in the interpreter.", 2000)
    args = p.parse_args(argv)
    results = harness.explore(args, "manual-schedule", __file__, gen_case, run_case)
    print(summarize(results, max_groups=args.groups))
    return 1 if any(o.category in FAILURES for _, o in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
