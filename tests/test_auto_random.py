"""Property test of the AUTOMATIC schedule path: random unscheduled fusions over every public
op run through ``fd.execute`` (automatic schedulers + segmenter, then the host program in the
CPU interpreter, which checks every memory access) and must equal a float64 NumPy reference.

Each example is classified as one of
  ok        the outputs equal the reference (shape, dtype and values within tolerance)
  mismatch  an output's shape, dtype or values differ from the reference
  internal  ``KilnInternalError`` or any exception that is not a ``KilnError`` (a kiln bug)
  memfault  the interpreter found an out-of-bounds access, a Shared race, an uninitialized
            read, an output element never written, ... (a wrong schedule)
  refused   a ``KilnError`` while defining, lowering or running: the fusion is not covered
and the run of N examples (env ``KILN_AUTO_EXAMPLES``, default 300) must have no mismatch,
internal error or memory fault, and at most 2% refusals, each naming a tensor or an op.

Besides element-wise ops, reductions, broadcasts, permutes and gathers, the generator draws the
shape ops (``slice``, ``pad``, ``cat``, ``reshape``, ``select``, ``triu``, ``take_along_axis``,
``gather``) on inputs and, two times in three, on computed intermediates (``slice(exp(x))``,
``reshape`` of a sum, ``cat`` of computed tensors), so the automatic scheduler's passes that move
remaps through element-wise ops run on them. Each axis they make gets a new label of its size, or
now and then a label of that size already drawn, so their results combine with other tensors
(kiln then checks the extents equal when the fusion runs). Their references are NumPy's
(slicing, ``np.concatenate``, ``reshape``, ``np.triu``, ``np.take_along_axis``, and pad by its
position formula); they are exact, so the error bounds move with the elements (a pad value
rounded to the tensor's dtype adds its rounding).

The generator builds each fusion as Python source lines (executed one by one), so every
example has a runnable repro (``repro(case, outcome)``); ``tests/explore_auto.py`` draws fresh
examples with plain ``random`` and prints a report of the failures.

Tolerances are error bounds propagated op by op: every value carries a bound of its absolute
error (0 for inputs; each op adds its dtype's unit roundoff times |result|, more for
transcendental functions, and propagates its operands' bounds through its derivative;
reductions add ``u * sqrt(n)``-scaled terms of the sum of |terms|; a comparison whose operands
are within their error bounds of each other is ambiguous, so both branches of a ``where`` are
accepted there). The check is ``|got - ref| <= 4 * bound + 4 * u_out * |ref|``.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import kiln
import numpy as np
import pytest
import random_harness as harness
from hypothesis import HealthCheck, Phase, given, settings
from kiln import DataType, FusionDefinition, KilnError
from random_harness import RandomDraw

KilnInternalError: Any = getattr(kiln, "KilnInternalError", None) or getattr(
    getattr(kiln, "_errors", None), "KilnInternalError", RuntimeError)

N_EXAMPLES = int(os.environ.get("KILN_AUTO_EXAMPLES", "300"))
MAX_REFUSED_FRACTION = 0.02
SIZES = [1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 64, 97, 127, 128, 131, 255, 256, 300, 509, 1031, 2048, 4093]
# KILN_AUTO_MAX_ELEMENTS (explore_auto.py --max-elements) raises the size cap: schedulers pick
# other paths for long rows, many rows and whole waves of blocks (grid reductions, looped rows).
MAX_ELEMENTS = 4096
LARGE_SIZES = [4096, 4099, 8192, 12289, 16384, 32000, 50257, 65536, 131072, 262147]


def set_max_elements(n: int) -> None:
    """Cap inputs at ``n`` elements and draw extents up to it (model-sized rows and columns)."""
    global MAX_ELEMENTS, SIZES
    MAX_ELEMENTS = n
    SIZES = [s for s in SIZES if s < 4096] + [s for s in LARGE_SIZES if s <= n]


if "KILN_AUTO_MAX_ELEMENTS" in os.environ:
    set_max_elements(int(os.environ["KILN_AUTO_MAX_ELEMENTS"]))
INDEX_LENGTHS = [1, 2, 3, 5, 7, 16, 31]
CONSTS = [0.5, 2.0, -1.25, 3.0, 1.0, -0.75]
SCALAR_VALUES = {"Double": [0.75, -1.5, 0.3, 2.0], "Float": [0.25, -2.0, 1.5], "Int": [2, -3, 1]}
UNARY = ["abs", "neg", "sin", "cos", "tanh", "sigmoid", "relu", "exp_tanh", "exp_negabs", "log1p_abs",
         "sqrt_abs", "rsqrt_1p_abs", "reciprocal_1p_abs", "erf", "erfc", "atan", "asinh", "log1p",
         "expm1_tanh", "exp2_tanh", "sinh_tanh", "erfinv_tanh"]
BINARY = ["add", "sub", "mul", "maximum", "minimum", "div_1p_abs", "pow_1p_abs", "pow2"]
COMPARE = ["gt", "gt", "ge", "lt", "lt", "le", "eq", "ne"]
REDUCE = ["sum", "max", "min"]
OP_KINDS = (["unary"] * 4 + ["binary"] * 5 + ["where"] * 2 + ["cast"] * 2 + ["cast_bool"]
            + ["reduce"] * 4 + ["bcast"] * 2 + ["permute"] * 2 + ["index_select"] * 2 + ["idx_math"]
            + ["full"] + ["output"] * 2
            + ["slice"] * 2 + ["pad"] * 2 + ["cat"] * 2 + ["reshape"] * 2 + ["select"] + ["triu"]
            + ["take"] * 2)
CATEGORIES = ["ok", "mismatch", "internal", "memfault", "refused"]

_U = {DataType.Float: 2.0 ** -24, DataType.Double: 2.0 ** -53, DataType.Half: 2.0 ** -11,
      DataType.BFloat16: 2.0 ** -8}
# ops whose result is exactly representable (no rounding)
_EXACT = {"abs", "neg", "relu", "where", "permute", "broadcast_in_dim", "index_select", "maximum", "minimum",
          "max", "min", "squeeze", "slice", "pad", "cat", "reshape", "select", "triu", "take_along_axis",
          "gather"}
_NP = {DataType.Float: np.float32, DataType.Double: np.float64, DataType.Half: np.float16,
       DataType.Int: np.int64, DataType.Int32: np.int32, DataType.Bool: np.bool_}
_MEMFAULT = re.compile(
    r"out-of-bounds|out of bounds|memory race|\brace\b|uninitiali[sz]ed|never written|divergent barrier|"
    r"semaphore not zeroed|overflows or divides by zero|but its Allocate needs|has a bad size|"
    r"accessed before its Allocate", re.I)
_INTERNAL = re.compile(r"internal compiler error|\bpanic", re.I)
_NAMES_SOMETHING = re.compile(
    r"\bT\d+\b|\b(abs|neg|exp|log|sqrt|rsqrt|reciprocal|sin|cos|tanh|sigmoid|relu|add|sub|mul|div|pow|"
    r"erf|erfc|erfinv|atan|asinh|log1p|expm1|exp2|sinh|"
    r"maximum|minimum|eq|ne|lt|le|gt|ge|where|cast|sum|max|min|reduction|broadcast|broadcast_in_dim|"
    r"permute|transpose|index_select|gather|full|squeeze|slice|pad|cat|reshape|view|select|triu|"
    r"take_along_axis|remap|mask)\b", re.I)


# -- drawing ---------------------------------------------------------------------------------
def _erfinv(y: float) -> float:
    """erfinv by bisection on math.erf (an independent float64 reference)."""
    if y == 0:
        return y
    lo, hi = -6.0, 6.0
    for _ in range(1100):  # down to adjacent doubles (subnormals near 0)
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


# -- a case: plain data, so it prints and reproduces ---------------------------------------
@dataclass
class Case:
    sizes: List[int]
    seed: int
    static: bool = False
    fulls: List[Tuple[str, str]] = field(default_factory=list)  # (dtype, layout)
    biases: List[Tuple[Tuple[int, ...], str, str]] = field(default_factory=list)  # (axes, form, dtype)
    indices: List[Tuple[int, int, int, str]] = field(default_factory=list)  # (axis, length, offset, dtype)
    scalars: List[Tuple[str, Any]] = field(default_factory=list)  # (dtype, value)
    size_scalar: Optional[int] = None  # an Int runtime scalar = sizes[axis], used by full
    ops: List[tuple] = field(default_factory=list)


def gen_case(d: RandomDraw) -> Case:
    r = d.int(1, 4)
    sizes = [d.choice(SIZES) for _ in range(r)]
    while int(np.prod(sizes)) > MAX_ELEMENTS:
        i = int(np.argmax(sizes))
        sizes[i] = max(1, sizes[i] // 3)
    c = Case(sizes=sizes, seed=d.int(0, 2 ** 16), static=d.bool(0.12))
    for _ in range(d.int(1, 3)):
        dt = d.choice(["Float"] * 6 + ["Half"] * 2 + ["Double"])
        layout = d.choice(["contig"] * 10 + ["transposed", "strided", "expanded"]) if r > 1 else \
            d.choice(["contig"] * 10 + ["strided"])
        c.fulls.append((dt, layout))
    for _ in range(d.choice([0, 0, 1, 1, 2])):
        axes = tuple(a for a in range(r) if d.bool(0.5))
        c.biases.append((axes, d.choice(["low", "low", "ones"]), d.choice(["Float"] * 4 + ["Half"])))
    for _ in range(d.choice([0, 0, 1, 1, 2])):
        axis = d.int(0, r - 1)
        offset = min(d.choice([0, 0, 1, 2]), sizes[axis] - 1)
        c.indices.append((axis, d.choice(INDEX_LENGTHS), offset, d.choice(["Int", "Int32"])))
    for _ in range(d.choice([0, 0, 1, 2])):
        dt = d.choice(["Double", "Double", "Float", "Int"])
        c.scalars.append((dt, d.choice(SCALAR_VALUES[dt])))
    if d.bool(0.1):
        c.size_scalar = d.int(0, r - 1)
    for _ in range(d.int(1, 10)):
        kind = d.choice(OP_KINDS)
        a, b = d.int(0, 999), d.int(0, 999)
        if kind == "unary":
            op = (kind, d.choice(UNARY), a)
        elif kind == "binary":
            op = (kind, d.choice(BINARY), a, b, d.choice(["tt", "tt", "tt", "tc", "ct", "ts", "st"]))
        elif kind == "where":
            op = (kind, d.choice(COMPARE), a, b, d.choice(["ab", "half_a", "a_const", "const_b"]))
        elif kind == "cast":
            op = (kind, d.choice(["Half", "Half", "BFloat16", "Double", "Float"]), a, d.bool(0.3))
        elif kind == "cast_bool":
            op = (kind, d.choice(COMPARE), a, b)
        elif kind == "reduce":
            op = (kind, d.choice(REDUCE), a, d.int(1, 15), d.bool(0.5),
                  d.choice(["none", "bid", "combine", "combine"]), d.choice(["sub", "add", "mul"]))
        elif kind == "bcast":
            op = (kind, a, b, d.choice(["align", "align", "align", "random"]), d.int(0, 999), d.bool(0.6))
        elif kind == "permute":
            op = (kind, a, d.int(0, 23))
        elif kind == "index_select":
            op = (kind, a, b, d.int(0, 3))
        elif kind == "idx_math":
            op = (kind, a, d.choice(["cast", "add", "sub", "float_trip", "to_float", "count", "count"]))
        elif kind == "full":
            op = (kind, a, d.choice(["const", "scalar"]), d.choice(["Float", "Float", "Double"]),
                  d.bool(0.7))
        elif kind in ("slice", "pad", "select", "triu"):
            op = (kind, a, d.int(0, 2 ** 16))
        elif kind == "cat":
            op = (kind, a, b, d.int(0, 2 ** 16), d.choice(["split", "others", "others"]))
        elif kind == "reshape":
            op = (kind, a, d.choice(["split", "split", "merge", "flat", "refactor", "refactor"]),
                  d.int(0, 2 ** 16))
        elif kind == "take":
            op = (kind, a, d.int(0, 2 ** 16), d.choice(["take_along_axis", "take_along_axis", "gather"]),
                  d.choice(["plain", "plain", "cast", "slice"]))
        else:
            op = ("output", a)
        c.ops.append(op)
    return c


def cases() -> Any:
    """Hypothesis strategy of cases: a seed, expanded by ``gen_case``."""
    return harness.seeded_cases(gen_case)


# -- building: emit source lines, execute them, track reference and error bound ---------------
@dataclass
class Val:
    name: str
    kind: str  # "f" float, "b" bool, "i" integer
    # per axis: a base axis (int), "L<j>" (index j's length), "b" (broadcast) or "one" (extent 1)
    labels: Tuple[Any, ...]
    ref: np.ndarray
    err: np.ndarray  # absolute error bound ("f"), ambiguity mask ("b"), zeros ("i")
    dtype: DataType
    is_input: bool = False


@dataclass
class Program:
    case: Case
    fd: FusionDefinition
    inputs: List[Any]
    input_code: List[str]
    lines: List[str]
    outputs: List[Val]
    pool: List[Val]
    handles: Dict[str, Any]  # name -> kiln Tensor / Scalar


class _Builder:
    def __init__(self, case: Case) -> None:
        self.c = case
        self.fd = FusionDefinition()
        self.ns: Dict[str, Any] = {"fd": self.fd, "ops": self.fd.ops, "D": DataType}
        self.lines: List[str] = []
        self.pool: List[Val] = []
        self.outputs: List[Val] = []
        self.scalars: List[Tuple[str, Any, DataType]] = []  # (name, value, dtype)
        self.size_scalar: Optional[str] = None
        self.inputs: List[Any] = []
        self.input_code: List[str] = []
        self.n = 0
        self.lens: Dict[str, int] = {f"L{j}": idx[1] for j, idx in enumerate(case.indices)}
        self.env: Dict[str, Any] = {}

    # helpers -------------------------------------------------------------------------------
    def size(self, label: Any) -> int:
        if label in ("b", "one"):  # a broadcast axis; a concrete axis of extent 1 (full)
            return 1
        if isinstance(label, int):
            return self.c.sizes[label]
        return self.lens[label]

    def run(self, line: str) -> None:
        self.lines.append(line)
        exec(line, self.ns)

    def emit(self, expr: str, kind: str, labels: Sequence[Any], ref: np.ndarray, err: np.ndarray,
             transc: bool = False, exact: Optional[bool] = None) -> Val:
        name = f"t{self.n}"
        self.n += 1
        self.run(f"{name} = {expr}")
        dt = self.ns[name].dtype
        ref = np.asarray(ref)
        err = np.broadcast_to(np.asarray(err, dtype=np.float64), ref.shape).copy()
        m = re.match(r"ops\.(\w+)\(", expr)
        if exact is None:
            exact = bool(m and m.group(1) in _EXACT)
        if kind == "f" and not exact:  # the result's rounding (Half: also its subnormal spacing)
            err = err + _U.get(dt, 0.0) * np.abs(ref) * (4.0 if transc else 1.0)
            err = err + (2.0 ** -24 if dt == DataType.Half else 0.0)
        v = Val(name, kind, tuple(labels), ref, err, dt)
        return v

    def add(self, v: Val) -> Val:
        self.pool.append(v)
        return v

    def floats(self, pred: Callable[[Val], bool] = lambda v: True) -> List[Val]:
        return [v for v in self.pool if v.kind == "f" and v.dtype in _U and pred(v)]

    def compatible(self, a: Val, b: Val) -> bool:
        """Whether ``a`` and ``b`` combine element-wise, into at most 3 * MAX_ELEMENTS elements
        (broadcasts on both sides, more common since reshape makes size-one axes, can give an
        outer product of two long axes)."""
        return len(a.labels) == len(b.labels) and all(
            x == y or x == "b" or y == "b" for x, y in zip(a.labels, b.labels)) and int(np.prod(
                [self.size(lab) for lab in self.joined(a.labels, b.labels)])) <= 3 * MAX_ELEMENTS

    @staticmethod
    def joined(a: Sequence[Any], b: Sequence[Any]) -> Tuple[Any, ...]:
        return tuple(y if x == "b" else x for x, y in zip(a, b))

    def scalar_operand(self, k: int, runtime: bool) -> Tuple[str, float]:
        """A scalar operand: source text and value (a runtime scalar where there is one)."""
        if runtime and self.scalars:
            name, value, _ = self.scalars[k % len(self.scalars)]
            return name, float(value)
        value = CONSTS[k % len(CONSTS)]
        return repr(value), value

    def scalar_math(self, k: int) -> Optional[Tuple[str, float, float]]:
        """Math on scalars alone, a 0-d tensor read as a scalar operand (``log(float(x.size(d)))``,
        attention's ``rsqrt(float(d_k))``, ``sqrt(|s| + 1)`` of a runtime scalar): its source,
        value and error bound; None where there is nothing to compute it from."""
        form = (k // 3) % 3
        ins = [v for v in self.pool if v.is_input and v.kind == "f" and v.labels]
        if form < 2 and ins:
            v = ins[(k // 9) % len(ins)]
            ax = (k // 27) % len(v.labels)
            n = int(v.ref.shape[ax])
            size = f"ops.cast(ops.size({v.name}, {ax}), D.Float)"
            if form == 0:
                return f"ops.log({size})", math.log(n), 2.0 ** -22 * abs(math.log(n))
            return f"ops.rsqrt({size})", 1 / math.sqrt(n), 2.0 ** -22 / math.sqrt(n)
        floats = [(name, value) for name, value, dt in self.scalars
                  if dt in (DataType.Float, DataType.Double)]
        if not floats:
            return None
        name, value = floats[k % len(floats)]
        out = math.sqrt(abs(float(value)) + 1.0)
        return f"ops.sqrt(ops.add(ops.abs({name}), 1.0))", out, 2.0 ** -22 * out

    def fresh(self, size: int, rr: random.Random) -> Any:
        """The label of an axis of ``size`` a shape op made: now and then one of the labels of
        that size already drawn (its tensors then combine with the others of that label, and
        kiln must find the extents equal when the fusion runs), else a new one."""
        if size >= 2 and rr.random() < 0.5:
            same = [a for a, n in enumerate(self.c.sizes) if n == size] + sorted(
                lab for lab, n in self.lens.items() if n == size)
            if same:
                return rr.choice(same)
        label = f"N{len(self.lens)}"
        self.lens[label] = size
        return label

    # inputs ---------------------------------------------------------------------------------
    def make(self, code: str) -> Any:
        """An input array from ``code`` (drawn from the case's ``rng``), appended to the inputs."""
        name = f"a{len(self.inputs)}"
        self.input_code.append(f"{name} = {code}")
        arr = eval(code, self.env)
        self.inputs.append(arr)
        return arr

    def define_inputs(self) -> None:
        c, r = self.c, len(self.c.sizes)
        rng_src = f"np.random.default_rng({c.seed})"
        self.input_code.append(f"rng = {rng_src}")
        self.env = {"rng": np.random.default_rng(c.seed), "np": np}
        make = self.make

        def shape_src(shape: Sequence[int], labels: Sequence[Any]) -> str:
            dims = [str(s) if (c.static or lab == "b") else "-1" for s, lab in zip(shape, labels)]
            return "[" + ", ".join(dims) + "]"

        for dt, layout in c.fulls:
            np_dt = {"Float": "np.float32", "Half": "np.float16", "Double": "np.float64"}[dt]
            shape = list(c.sizes)
            if layout == "transposed":
                perm = list(range(r))[::-1]
                inv = list(np.argsort(perm))
                code = (f"rng.uniform(-1, 1, {tuple(shape[p] for p in perm)}).astype({np_dt})"
                        f".transpose({tuple(int(i) for i in inv)})")
            elif layout == "strided":
                big = list(shape)
                big[-1] *= 2
                sl = ", ".join([":"] * (r - 1) + ["::2"])
                code = f"rng.uniform(-1, 1, {tuple(big)}).astype({np_dt})[{sl}]"
            elif layout == "expanded":  # stride 0 along the first axis (np.broadcast_to)
                one = tuple([1] + shape[1:])
                code = f"np.broadcast_to(rng.uniform(-1, 1, {one}).astype({np_dt}), {tuple(shape)})"
            else:
                code = f"rng.uniform(-1, 1, {tuple(shape)}).astype({np_dt})"
            arr = make(code)
            labels = tuple(range(r))
            name = f"t{self.n}"
            self.n += 1
            self.run(f"{name} = fd.define_tensor({shape_src(shape, labels)}, dtype=D.{dt})")
            v = Val(name, "f", labels, arr.astype(np.float64), np.zeros(arr.shape), DataType(dt), True)
            if dt == "Half":  # half inputs are computed on in float
                v = self.emit(f"ops.cast({name}, D.Float)", "f", labels, v.ref, v.err)
            self.add(v)
        for axes, form, dt in c.biases:
            np_dt = {"Float": "np.float32", "Half": "np.float16"}[dt]
            if form == "low":
                shape = [c.sizes[a] for a in axes]
                labels: Tuple[Any, ...] = tuple(axes)
                # (a static size 1 is a broadcast axis: its contiguity is None)
                flags = ["None" if c.static and c.sizes[a] == 1 else "True" for a in axes]
                contig = ", contiguity=[" + ", ".join(flags) + "]" if len(axes) else ""
            else:
                shape = [c.sizes[a] if a in axes else 1 for a in range(r)]
                labels = tuple(a if a in axes else "b" for a in range(r))
                contig = ""
            if shape:
                arr = make(f"rng.uniform(-1, 1, {tuple(shape)}).astype({np_dt})")
            else:  # a 0-d array (uniform(size=()) gives a NumPy scalar)
                arr = make(f"np.array(rng.uniform(-1, 1), dtype={np_dt})")
            name = f"t{self.n}"
            self.n += 1
            self.run(f"{name} = fd.define_tensor({shape_src(shape, labels)}, dtype=D.{dt}{contig})")
            v = Val(name, "f", labels, arr.astype(np.float64), np.zeros(arr.shape), DataType(dt), True)
            if dt == "Half":
                v = self.emit(f"ops.cast({name}, D.Float)", "f", labels, v.ref, v.err)
            if form == "low" and len(axes) < r:  # a bias [C] broadcast onto the full shape
                shape_b = [self.size(a) if a in axes else 1 for a in range(r)]
                bd = list(axes)
                v = self.emit(f"ops.broadcast_in_dim({v.name}, shape={[-1] * r}, broadcast_dims={bd})", "f",
                              tuple(a if a in axes else "b" for a in range(r)),
                              v.ref.reshape(shape_b), v.err.reshape(shape_b))
            self.add(v)
        for j, (axis, length, offset, dt) in enumerate(c.indices):
            np_dt = {"Int": "np.int64", "Int32": "np.int32"}[dt]
            hi = max(1, c.sizes[axis] - offset)
            arr = make(f"rng.integers(0, {hi}, {length}).astype({np_dt})")
            name = f"t{self.n}"
            self.n += 1
            self.run(f"{name} = fd.define_tensor([{length if c.static else -1}], dtype=D.{dt})")
            self.add(Val(name, "i", (f"L{j}",), arr.astype(np.int64), np.zeros(arr.shape), DataType(dt),
                         True))
        for k, (dt, value) in enumerate(c.scalars):
            name = f"s{k}"
            self.run(f"{name} = fd.define_scalar(dtype=D.{dt})")
            self.inputs.append(value)
            self.input_code.append(f"a{len(self.inputs) - 1} = {value!r}")
            self.scalars.append((name, value, DataType(dt)))
        if c.size_scalar is not None:
            self.size_scalar = "n0"
            value = c.sizes[c.size_scalar]
            self.run("n0 = fd.define_scalar(dtype=D.Int)")
            self.inputs.append(value)
            self.input_code.append(f"a{len(self.inputs) - 1} = {value!r}")

    # ops --------------------------------------------------------------------------------------
    def unary(self, name: str, v: Val) -> Val:
        x, e, L = v.ref, v.err, v.labels
        if name in ("abs", "neg", "relu"):
            f = {"abs": np.abs, "neg": np.negative, "relu": lambda y: np.maximum(y, 0)}[name]
            return self.emit(f"ops.{name}({v.name})", "f", L, f(x), e)
        if name in ("sin", "cos", "tanh"):
            return self.emit(f"ops.{name}({v.name})", "f", L, getattr(np, name)(x), e, transc=True)
        if name == "sigmoid":
            return self.emit(f"ops.sigmoid({v.name})", "f", L, 1 / (1 + np.exp(-x)), 0.25 * e, transc=True)
        if name == "exp_tanh":
            t = self.unary("tanh", v)
            return self.emit(f"ops.exp({t.name})", "f", L, np.exp(t.ref), np.exp(t.ref) * t.err, transc=True)
        if name in ("erf", "erfc", "atan", "asinh"):
            # |f'| <= 2/sqrt(pi) for erf and erfc, <= 1 for atan and asinh.
            f = {"erf": np.vectorize(math.erf, otypes=[float]),  # (otypes: also on zero-size tensors)
                 "erfc": np.vectorize(math.erfc, otypes=[float]),
                 "atan": np.arctan, "asinh": np.arcsinh}[name]
            return self.emit(f"ops.{name}({v.name})", "f", L, f(x), 1.13 * e, transc=True)
        if name == "log1p":
            a = self.emit(f"ops.abs({v.name})", "f", L, np.abs(x), e)
            return self.emit(f"ops.log1p({a.name})", "f", L, np.log1p(a.ref), a.err, transc=True)
        if name in ("expm1_tanh", "exp2_tanh", "sinh_tanh", "erfinv_tanh"):
            t = self.unary("tanh", v)
            if name == "erfinv_tanh":  # keep erfinv's argument in [-0.5, 0.5]: |f'| <= 1.2
                t = self.emit(f"ops.mul({t.name}, 0.5)", "f", L, 0.5 * t.ref, 0.5 * t.err)
            f, slope = {"expm1_tanh": (np.expm1, np.exp(t.ref)), "exp2_tanh": (np.exp2, np.exp2(t.ref)),
                        "sinh_tanh": (np.sinh, np.cosh(t.ref)),
                        "erfinv_tanh": (np.vectorize(_erfinv, otypes=[float]), 1.2)}[name]
            op = name.split("_")[0]
            return self.emit(f"ops.{op}({t.name})", "f", L, f(t.ref), slope * t.err, transc=True)
        if name == "exp_negabs":
            a = self.emit(f"ops.neg(ops.abs({v.name}))", "f", L, -np.abs(x), e)
            return self.emit(f"ops.exp({a.name})", "f", L, np.exp(a.ref), np.exp(a.ref) * a.err, transc=True)
        p = self.emit(f"ops.add(ops.abs({v.name}), 1.0)", "f", L, np.abs(x) + 1, e)
        y, ey = p.ref, p.err
        if name == "log1p_abs":
            return self.emit(f"ops.log({p.name})", "f", L, np.log(y), ey / y, transc=True)
        if name == "rsqrt_1p_abs":
            return self.emit(f"ops.rsqrt({p.name})", "f", L, 1 / np.sqrt(y), 0.5 * ey * y ** -1.5,
                             transc=True)
        if name == "reciprocal_1p_abs":
            return self.emit(f"ops.reciprocal({p.name})", "f", L, 1 / y, ey / (y * y))
        assert name == "sqrt_abs", name
        a = self.emit(f"ops.abs({v.name})", "f", L, np.abs(x), e)
        with np.errstate(divide="ignore"):
            lin = np.where(a.ref > 0, a.err / (2 * np.sqrt(np.maximum(a.ref, 1e-300))), np.inf)
        return self.emit(f"ops.sqrt({a.name})", "f", L, np.sqrt(a.ref), np.minimum(lin, np.sqrt(a.err)),
                         transc=True)

    def binary(self, name: str, a: Val, b: Optional[Val], form: str, k: int) -> Val:
        """``a op b`` (tensor-tensor, ``form`` "tt"), or with a scalar operand: a constant
        ("tc"/"ct") or a runtime scalar ("ts"/"st"), right ("t?") or left ("?t") of ``a``."""
        if b is None and form == "tt":
            form = "tc"
        if form == "tt":
            assert b is not None
            x, ex, lhs = a.ref, a.err, a.name
            y, ey, rhs = b.ref, b.err, b.name
            L, x_t, y_t = self.joined(a.labels, b.labels), True, True
        else:
            math0d = self.scalar_math(k) if form in ("ts", "st") and k % 3 == 0 else None
            if math0d is not None:
                src, value, math_err = math0d
                s_ref, s_err = np.float64(value), np.float64(math_err + _U.get(a.dtype, 0.0) * abs(value))
            else:
                src, value = self.scalar_operand(k, runtime=form in ("ts", "st"))
                # a scalar is rounded to the tensor's dtype first (0.3 is not a float)
                s_ref, s_err = np.float64(value), np.float64(_U.get(a.dtype, 0.0) * _rounds(value))
            L = a.labels
            if form in ("ct", "st"):
                x, ex, lhs, x_t = s_ref, s_err, src, False
                y, ey, rhs, y_t = a.ref, a.err, a.name, True
            else:
                x, ex, lhs, x_t = a.ref, a.err, a.name, True
                y, ey, rhs, y_t = s_ref, s_err, src, False
        shape = np.broadcast(np.asarray(x), np.asarray(y)).shape
        if name in ("add", "sub", "mul", "maximum", "minimum"):
            f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
                 "minimum": np.minimum}[name]
            if name in ("add", "sub"):
                e = ex + ey
            elif name == "mul":
                e = np.abs(y) * ex + np.abs(x) * ey + ex * ey
            else:
                e = np.maximum(ex, ey)
            return self.emit(f"ops.{name}({lhs}, {rhs})", "f", L, np.broadcast_to(f(x, y), shape), e)
        if name == "div_1p_abs":  # x / (|y| + 1) for a tensor y, x / y for a (nonzero) scalar y
            if not y_t:
                if float(y) == 0.0:
                    y, rhs = np.float64(2.0), "2.0"
                return self.emit(f"ops.div({lhs}, {rhs})", "f", L, np.broadcast_to(x / y, shape),
                                 ex / abs(float(y)) + np.abs(x) * ey / (float(y) * float(y)))
            yv = a if not x_t or b is None else b
            den = self.unary("abs", yv)
            den = self.emit(f"ops.add({den.name}, 1.0)", "f", den.labels, den.ref + 1, den.err)
            q = np.broadcast_to(x / den.ref, shape)
            return self.emit(f"ops.div({lhs}, {den.name})", "f", L, q,
                             ex / den.ref + np.abs(x) * den.err / (den.ref * den.ref))
        if name == "pow_1p_abs":  # (|x| + 1) ** c for a constant c; c ** tanh(y) for a scalar c
            if not x_t:
                c = abs(float(x)) + 1.0
                t = self.unary("tanh", a)
                out = c ** t.ref
                return self.emit(f"ops.pow({c!r}, {t.name})", "f", a.labels, out,
                                 out * (math.log(c) * t.err + np.abs(t.ref) * ex / c), transc=True)
            c = [0.5, 2.0, -1.5][k % 3]
            base = self.unary("abs", a)
            base = self.emit(f"ops.add({base.name}, 1.0)", "f", a.labels, base.ref + 1, base.err)
            # The error over the base's whole interval (the base is at least 1): a linear bound
            # misses how fast a negative power grows where a large error reaches towards 1.
            out = base.ref ** c
            lo, hi = np.maximum(base.ref - base.err, 1.0), base.ref + base.err
            err = np.maximum(np.abs(lo ** c - out), np.abs(hi ** c - out))
            return self.emit(f"ops.pow({base.name}, {c!r})", "f", a.labels, out, err, transc=True)
        assert name == "pow2", name
        return self.emit(f"ops.pow({a.name}, 2.0)", "f", a.labels, a.ref * a.ref, 2 * np.abs(a.ref) * a.err
                         + a.err * a.err, transc=True)

    def compare(self, cmp: str, a: Val, b: Optional[Val], k: int) -> Val:
        x, ex = a.ref, a.err
        if b is not None:
            y, ey, rhs, L = b.ref, b.err, b.name, self.joined(a.labels, b.labels)
        else:
            src, value = self.scalar_operand(k, runtime=k % 2 == 1)
            y, ey, rhs, L = np.float64(value), _U.get(a.dtype, 0.0) * _rounds(value), src, a.labels
        f = {"gt": np.greater, "ge": np.greater_equal, "lt": np.less, "le": np.less_equal,
             "eq": np.equal, "ne": np.not_equal}[cmp]
        ref = f(x, y)
        amb = (np.abs(x - y) <= 2 * (ex + ey) + 1e-300) & ((ex + ey) > 0)
        shape = ref.shape
        amb = np.broadcast_to(amb, shape).astype(float)
        return self.emit(f"ops.{cmp}({a.name}, {rhs})", "b", L, ref, amb)

    def where(self, c: Val, a_src: str, a_ref: Any, a_err: Any, b_src: str, b_ref: Any, b_err: Any,
              labels: Sequence[Any]) -> Val:
        shape = np.broadcast(c.ref, np.asarray(a_ref), np.asarray(b_ref)).shape
        ref = np.where(c.ref, a_ref, b_ref)
        err = np.where(c.ref, a_err, b_err)
        amb = np.broadcast_to(c.err > 0, shape)
        err = np.where(amb, np.maximum(a_err, b_err) + np.abs(np.asarray(a_ref) - np.asarray(b_ref)), err)
        scalar_branch = not (np.ndim(a_ref) and np.ndim(b_ref))  # rounded to the result's dtype
        return self.emit(f"ops.where({c.name}, {a_src}, {b_src})", "f", labels, np.broadcast_to(ref, shape),
                         err, exact=not scalar_branch)

    def reduce(self, name: str, v: Val, dims: List[int], keepdim: bool) -> Val:
        f = {"sum": np.sum, "max": np.max, "min": np.min}[name]
        ax = tuple(dims)
        ref = f(v.ref, axis=ax, keepdims=keepdim)
        n = int(np.prod([v.ref.shape[d] for d in dims])) if dims else 1
        if name == "sum":
            u = _U.get(v.dtype, 2.0 ** -24)
            gamma = u * (8 * math.sqrt(n) + 2 * math.log2(max(n, 2)))
            err = np.sum(v.err, axis=ax, keepdims=keepdim) + gamma * np.sum(np.abs(v.ref), axis=ax,
                                                                            keepdims=keepdim)
        else:
            err = np.max(v.err, axis=ax, keepdims=keepdim)
        labels = tuple(("b" if keepdim else None) if i in dims else lab for i, lab in enumerate(v.labels))
        labels = tuple(lab for lab in labels if lab is not None)
        return self.emit(f"ops.{name}({v.name}, dims={dims}, keepdim={keepdim})", "f", labels, ref, err)

    def broadcast(self, v: Val, rank: int, positions: List[int], labels: Sequence[Any]) -> Val:
        shape = [1] * rank
        for i, p in enumerate(positions):
            shape[p] = v.ref.shape[i]
        return self.emit(f"ops.broadcast_in_dim({v.name}, shape={[-1] * rank}, broadcast_dims={positions})",
                         v.kind, labels, v.ref.reshape(shape), v.err.reshape(shape))

    # shape ops ------------------------------------------------------------------------------
    def shape_source(self, pick: int, pred: Callable[[Val], bool], ints: bool = False) -> Optional[Val]:
        """A tensor of the pool for a shape op (``ints``: 1-D index tensors too): a computed one
        two times in three where there is one, so the remaps sit on intermediates as often as
        on inputs."""
        cands = [w for w in self.pool if ((w.kind == "f" and w.dtype in _U)
                                          or (ints and w.kind == "i" and len(w.labels) == 1)) and pred(w)]
        computed = [w for w in cands if not w.is_input]
        if computed and pick % 3:
            cands = computed
        return cands[pick // 3 % len(cands)] if cands else None

    def int_scalars(self, pred: Callable[[int], bool]) -> List[Tuple[str, int]]:
        """The runtime Int scalars (source, value) whose value ``pred`` accepts."""
        found = [(name, int(value)) for name, value, dt in self.scalars
                 if dt == DataType.Int and pred(int(value))]
        if self.size_scalar is not None and pred(self.c.sizes[self.c.size_scalar or 0]):
            found.append((self.size_scalar, self.c.sizes[self.c.size_scalar or 0]))
        return found

    def end_form(self, v: Val, a: int, n: int, start: int, rr: random.Random) -> Tuple[str, Optional[int]]:
        """A slice end for axis ``a`` (size ``n``) of ``v``: source text and value (None: the size)."""
        form = rr.choice(["none", "int", "int", "past", "size", "size_1", "n0"])
        if form == "size":
            return f"ops.size({v.name}, {a})", n
        if form == "size_1" and n >= 1:
            return f"ops.sub(ops.size({v.name}, {a}), 1)", n - 1
        if form == "n0" and self.size_scalar is not None:  # a runtime Int scalar, clamped
            return self.size_scalar, self.c.sizes[self.c.size_scalar or 0]
        if form == "past":
            e = n + rr.choice([1, 3, 1000])
            return str(e), e
        if form == "int":
            e = rr.randint(min(start, n), n)
            return str(e), e
        return "None", None

    def slice_op(self, v: Val, rr: random.Random) -> Val:
        starts, ends, steps, labels, sl = [], [], [], [], []
        for a, (lab, n) in enumerate(zip(v.labels, v.ref.shape)):
            whole_axis = lab == "b" or rr.random() < 0.35
            if whole_axis:
                start, step = 0, 1
                end_src, end = ("None", None) if lab == "b" or rr.random() < 0.5 else \
                    rr.choice([(f"ops.size({v.name}, {a})", n), (str(n), n), (str(n + 2), n + 2)])
            else:
                start = max(0, rr.choice([0, 0, 1, 2, n // 2, n - 1, n, n + 1]))
                start_src = str(start)
                runtime = self.int_scalars(lambda k: k >= 0)
                if runtime and rr.random() < 0.2:  # a runtime start (past the end: empty)
                    start_src, start = rr.choice(runtime)
                step = rr.choice([1, 1, 1, 2, 3, 5])
                end_src, end = self.end_form(v, a, n, start, rr)
            starts.append("0" if whole_axis else start_src)
            ends.append(end_src)
            steps.append(step)
            sl.append(slice(start, end, step))
            size = len(range(*slice(start, end, step).indices(n)))
            whole = start == 0 and step == 1 and (end is None or end >= n)
            labels.append(lab if whole else self.fresh(size, rr))
        strides = f", {steps}" if any(st != 1 for st in steps) or rr.random() < 0.3 else ""
        key = tuple(sl)
        return self.emit(f"ops.slice({v.name}, [{', '.join(starts)}], [{', '.join(ends)}]{strides})", v.kind,
                         labels, v.ref[key], v.err[key], exact=True)

    def select_op(self, v: Val, rr: random.Random) -> Optional[Val]:
        dims = [a for a, n in enumerate(v.ref.shape) if n >= 1]
        if not dims:
            return None
        rank = len(v.labels)
        dim = rr.choice(dims)
        n = v.ref.shape[dim]
        index = rr.choice([0, n - 1, rr.randrange(n)])
        src = f"ops.sub(ops.size({v.name}, {dim}), 1)" if index == n - 1 and rr.random() < 0.3 else str(index)
        runtime = self.int_scalars(lambda k: 0 <= k < n)
        if runtime and rr.random() < 0.3:  # a runtime index, checked when the inputs are bound
            src, index = rr.choice(runtime)
        dim_src = dim - rank if rr.random() < 0.3 else dim
        labels = [lab for a, lab in enumerate(v.labels) if a != dim]
        return self.emit(f"ops.select({v.name}, {dim_src}, {src})", v.kind, labels,
                         np.take(v.ref, index, axis=dim), np.take(v.err, index, axis=dim), exact=True)

    def pad_op(self, v: Val, rr: random.Random) -> Val:
        rank = len(v.labels)
        pairs = [(0, 0)] * rank
        width_srcs: List[str] = []
        for j in range(rr.randint(1, rank)):
            a = rank - 1 - j
            n = v.ref.shape[a]
            lo, hi = rr.choice([0, 0, 1, 2, 3, -1, -2]), rr.choice([0, 0, 1, 2, 3, -1, -2])
            # Negative widths crop; together they may take at most the axis (as torch's pad).
            def crop(lo: int, hi: int) -> int:
                return max(-lo, 0) + max(-hi, 0)

            if crop(lo, hi) > n or (n + lo + hi == 0 and rr.random() < 0.7):
                lo, hi = abs(lo), abs(hi)
            lo_src = str(lo)
            runtime = [(src, k) for src, k in self.int_scalars(lambda k: True) if crop(k, hi) <= n]
            if runtime and rr.random() < 0.25:  # a runtime width (negative: crops)
                lo_src, lo = rr.choice(runtime)
            pairs[a] = (lo, hi)
            width_srcs += [lo_src, str(hi)]
        u = _U.get(v.dtype, 0.0)
        form = rr.choice(["none", "const", "const", "scalar"] if v.kind == "f" else ["none", "zero"])
        value: Any = 0.0 if v.kind == "f" else 0  # an index stays integer
        if form == "none":
            value_src, value_err = "", 0.0
        elif form == "zero":
            value_src, value_err = ", 0", 0.0
        else:
            src, value = self.scalar_operand(rr.randrange(12), runtime=form == "scalar")
            value_src, value_err = f", {src}", u * _rounds(value)
        labels = [lab if p == (0, 0) else self.fresh(n + p[0] + p[1], rr)
                  for lab, p, n in zip(v.labels, pairs, v.ref.shape)]
        ref = _pad_ref(v.ref, pairs, value)
        err = _pad_ref(v.err, pairs, value_err)
        return self.emit(f"ops.pad({v.name}, [{', '.join(width_srcs)}]{value_src})", v.kind, labels, ref, err,
                         exact=True)

    def cat_op(self, v: Val, pick: int, rr: random.Random, mode: str) -> Optional[Val]:
        rank = len(v.labels)
        dims = [a for a, lab in enumerate(v.labels) if lab != "b" and v.ref.shape[a] >= 2]
        if mode == "split" and dims:  # cut v along dim and join the pieces again: v itself
            dim = rr.choice(dims)
            n = v.ref.shape[dim]
            cuts = sorted(rr.sample(range(n + 1), rr.choice([1, 1, 2])))
            parts = []
            for lo, hi in zip([0] + cuts, cuts + [n]):
                ends = ["None"] * rank
                ends[dim] = str(hi)
                start = ["0"] * rank
                start[dim] = str(lo)
                key = tuple(slice(lo, hi) if a == dim else slice(None) for a in range(rank))
                labels = tuple(self.fresh(hi - lo, rr) if a == dim else lab for a, lab in enumerate(v.labels))
                src = f"ops.slice({v.name}, [{', '.join(start)}], [{', '.join(ends)}])"
                parts.append(self.add(self.emit(src, v.kind, labels, v.ref[key], v.err[key], exact=True)))
            dim_label = v.labels[dim]
        else:
            dim = rr.randrange(rank)
            same = [w for w in self.pool if w.kind == v.kind and w.dtype == v.dtype and len(w.labels) == rank
                    and all(x == y for a, (x, y) in enumerate(zip(w.labels, v.labels)) if a != dim)]
            computed = [w for w in same if not w.is_input]
            cands = computed if computed and pick % 2 else same
            parts = [v] + [cands[(pick + 7 * i) % len(cands)] for i in range(rr.choice([1, 1, 2]))]
            if v.kind == "f" and rr.random() < 0.3:  # a computed part made here
                w = self.add(self.unary(rr.choice(["neg", "sin", "exp_tanh"]), parts[-1]))
                if w.dtype == v.dtype:
                    parts[-1] = w
            rr.shuffle(parts)
            dim_label: Any = None
        total = sum(p.ref.shape[dim] for p in parts)
        if v.ref.size // max(1, v.ref.shape[dim]) * total > 3 * MAX_ELEMENTS:
            return None
        if dim_label is None:
            dim_label = self.fresh(total, rr)
        labels = [dim_label if a == dim else lab for a, lab in enumerate(v.labels)]
        dim_src = dim - rank if rr.random() < 0.3 else dim
        return self.emit(f"ops.cat([{', '.join(p.name for p in parts)}], {dim_src})", v.kind, labels,
                         np.concatenate([p.ref for p in parts], axis=dim),
                         np.concatenate([p.err for p in parts], axis=dim), exact=True)

    def reshape_op(self, v: Val, mode: str, rr: random.Random) -> Val:
        shape, rank = v.ref.shape, len(v.labels)
        numel = int(v.ref.size)
        # entries: (size, label, the source axis it keeps or None)
        entries: List[Tuple[int, Any, Optional[int]]] = []
        splittable = [a for a in range(rank) if shape[a] >= 2]
        if mode == "split" and splittable:
            a = rr.choice(splittable)
            n = shape[a]
            divs = [f for f in range(1, n + 1) if n % f == 0]
            f = rr.choice([x for x in divs if 1 < x < n] or divs)
            for k in range(rank):
                if k == a:
                    entries += [(f, self.fresh(f, rr), None), (n // f, self.fresh(n // f, rr), None)]
                else:
                    entries.append((shape[k], v.labels[k], k))
        elif mode == "merge" and rank >= 2:
            a = rr.randrange(rank - 1)
            for k in range(rank):
                if k == a:
                    p, q = shape[a], shape[a + 1]
                    lab = v.labels[a + 1] if p == 1 else v.labels[a] if q == 1 else self.fresh(p * q, rr)
                    entries.append((p * q, lab, None))
                elif k != a + 1:
                    entries.append((shape[k], v.labels[k], k))
        elif mode == "refactor" and numel > 1:
            left = numel
            for _ in range(rr.randint(1, 3)):
                divs = [f for f in range(1, min(left, 64) + 1) if left % f == 0]
                f = rr.choice(divs)
                entries.append((f, self.fresh(f, rr), None))
                left //= f
            entries.append((left, self.fresh(left, rr), None))
            rr.shuffle(entries)
        else:
            entries = [(numel, self.fresh(numel, rr), None)]
        srcs, labels = [], []
        for size, lab, kept in entries:
            if size == 1:  # a literal 1 is a broadcast axis
                srcs.append("1")
                labels.append("b")
                continue
            if kept is not None and not self.c.static and rr.random() < 0.4:
                srcs.append(f"ops.size({v.name}, {kept})")
            else:
                srcs.append(str(size))
            labels.append(lab)
        big = [i for i, (size, _, _) in enumerate(entries) if size > 1]
        if big and numel > 0 and rr.random() < 0.6:
            srcs[rr.choice(big)] = "-1"
        new = [size for size, _, _ in entries]
        return self.emit(f"ops.reshape({v.name}, [{', '.join(srcs)}])", v.kind, labels, v.ref.reshape(new),
                         v.err.reshape(new), exact=True)

    def take_op(self, v: Val, rr: random.Random, which: str, form: str) -> Optional[Val]:
        """``take_along_axis`` (index sizes off ``dim``: ``v``'s, or one) or ``gather`` (torch's:
        no larger than ``v``'s; the output has the index's shape) with an index input, used as
        it is, cast to the other integer type or sliced out of a larger one."""
        shape, rank = v.ref.shape, len(v.labels)
        dims = [a for a in range(rank) if shape[a] >= 1]
        if not dims:
            return None
        dim = rr.choice(dims)
        n = shape[dim]
        m = rr.choice([1, 2, 3, 5, 7, n])
        idx_shape = []
        for a in range(rank):
            if a == dim:
                idx_shape.append(m)
            elif shape[a] == 0:
                idx_shape.append(0)
            elif which == "gather" and self.c.static and shape[a] > 1 and rr.random() < 0.3:
                idx_shape.append(rr.randint(1, shape[a]))  # a static index smaller than x
            else:
                idx_shape.append(1 if rr.random() < 0.3 else shape[a])
        if int(np.prod(idx_shape)) > 3 * MAX_ELEMENTS or \
                (which == "take_along_axis" and int(np.prod(shape)) // n * m > 3 * MAX_ELEMENTS):
            return None
        dt = rr.choice(["Int", "Int32"])
        np_dt = {"Int": "np.int64", "Int32": "np.int32"}[dt]
        full = list(idx_shape)
        if form == "slice":
            full[dim] += 2
        arr = self.make(f"rng.integers(0, {n}, {tuple(full)}).astype({np_dt})")
        decl = ["1" if s == 1 else str(s) if self.c.static else "-1" for s in full]
        name = f"t{self.n}"
        self.n += 1
        self.run(f"{name} = fd.define_tensor([{', '.join(decl)}], dtype=D.{dt})")
        idx = Val(name, "i", tuple(range(rank)), arr.astype(np.int64), np.zeros(arr.shape), DataType(dt),
                  True)
        if form == "slice":
            key = tuple(slice(1, m + 1) if a == dim else slice(None) for a in range(rank))
            start = ["1" if a == dim else "0" for a in range(rank)]
            ends = [str(m + 1) if a == dim else "None" for a in range(rank)]
            idx = self.emit(f"ops.slice({name}, [{', '.join(start)}], [{', '.join(ends)}])", "i", idx.labels,
                            idx.ref[key], 0, exact=True)
        elif form == "cast":
            other = "Int32" if dt == "Int" else "Int"
            idx = self.emit(f"ops.cast({name}, D.{other})", "i", idx.labels, idx.ref, 0)
        # a literal 1 is a broadcast axis; a slice of one keeps its size symbolic
        dim_label = "b" if m == 1 and form != "slice" else self.fresh(m, rr)
        if which == "take_along_axis":
            labels = [dim_label if a == dim else lab for a, lab in enumerate(v.labels)]
            table, terr = v.ref, v.err
        else:
            labels = [dim_label if a == dim else lab if s == shape[a] else "b" if s == 1
                      else self.fresh(s, rr) for a, (lab, s) in enumerate(zip(v.labels, idx_shape))]
            key = tuple(slice(None) if a == dim else slice(0, s) for a, s in enumerate(idx_shape))
            table, terr = v.ref[key], v.err[key]
        dim_src = dim - rank if rr.random() < 0.3 else dim
        return self.emit(f"ops.{which}({v.name}, {idx.name}, {dim_src})", "f", labels,
                         np.take_along_axis(table, idx.ref, dim), np.take_along_axis(terr, idx.ref, dim),
                         exact=True)

    def shape_op(self, op: tuple) -> None:
        kind, pick = op[0], op[1]
        if kind == "cat":
            rr = random.Random(op[3])
            v = self.shape_source(pick, lambda w: len(w.labels) > 0, ints=True)
            out = self.cat_op(v, op[2], rr, op[4]) if v is not None else None
        elif kind == "reshape":
            rr = random.Random(op[3])
            v = self.shape_source(pick, lambda w: True)
            out = self.reshape_op(v, op[2], rr) if v is not None else None
        elif kind == "take":
            rr = random.Random(op[2])
            v = self.shape_source(pick, lambda w: len(w.labels) > 0)
            out = self.take_op(v, rr, op[3], op[4]) if v is not None else None
        else:
            rr = random.Random(op[2])
            need = 2 if kind == "triu" else 1
            v = self.shape_source(pick, lambda w: len(w.labels) >= need, ints=kind in ("slice", "pad"))
            if v is None:
                return
            if kind == "slice":
                out = self.slice_op(v, rr)
            elif kind == "pad":
                out = self.pad_op(v, rr)
            elif kind == "select":
                out = self.select_op(v, rr)
            else:
                diag = rr.choice([0, 0, 1, -1, 2, -2, 5, -5])
                src = f"ops.triu({v.name}, {diag})" if diag or rr.random() < 0.5 else f"ops.triu({v.name})"
                out = self.emit(src, "f", v.labels, np.triu(v.ref, diag), np.triu(v.err, diag), exact=True)
        if out is not None:
            self.add(out)
            if pick % 5 == 0 and out.kind == "f":
                self.output(out)

    def output(self, v: Val) -> None:
        if any(o.name == v.name for o in self.outputs):
            return
        if v.dtype == DataType.BFloat16:  # NumPy has no bfloat16 without ml_dtypes
            return
        self.run(f"fd.add_output({v.name})")
        self.outputs.append(v)

    def op(self, op: tuple) -> None:  # noqa: C901 - one branch per op kind
        kind = op[0]
        fl = self.floats()
        if kind == "unary":
            v = fl[op[2] % len(fl)]
            self.add(self.unary(op[1], v))
        elif kind == "binary":
            a = fl[op[2] % len(fl)]
            others = self.floats(lambda w: self.compatible(a, w))
            b = others[op[3] % len(others)] if others else None
            self.add(self.binary(op[1], a, b, op[4], op[3]))
        elif kind in ("where", "cast_bool"):
            a = fl[op[2] % len(fl)]
            others = self.floats(lambda w: self.compatible(a, w) and w.name != a.name)
            b = others[op[3] % len(others)] if others and op[3] % 4 else None  # else a scalar
            cond = self.compare(op[1], a, b, op[3])
            if kind == "cast_bool":
                self.add(self.emit(f"ops.cast({cond.name}, D.Float)", "f", cond.labels,
                                   cond.ref.astype(float), cond.err))
                if op[3] % 7 == 0:
                    self.output(cond)
                return
            labels = cond.labels
            br = b if b is not None else a
            mode = op[4]
            if mode == "ab":
                w = self.where(cond, a.name, a.ref, a.err, br.name, br.ref, br.err, labels)
            elif mode == "half_a":
                w = self.where(cond, f"ops.mul({a.name}, 0.5)", a.ref * 0.5, a.err * 0.5,
                               br.name, br.ref, br.err, labels)
            elif mode == "a_const":
                cv = CONSTS[op[3] % len(CONSTS)]
                w = self.where(cond, a.name, a.ref, a.err, repr(cv), cv, 0.0, labels)
            else:
                src, value = self.scalar_operand(op[3], runtime=True)
                w = self.where(cond, src, value, 0.0, br.name, br.ref, br.err, labels)
            self.add(w)
        elif kind == "cast":
            target, v, keep = op[1], fl[op[2] % len(fl)], op[3]
            if target in ("Half", "BFloat16") and v.ref.size and float(np.max(np.abs(v.ref))) > 1e4:
                v = self.unary("tanh", v)  # keep half in range
            if v.dtype == DataType(target):  # cast to its own type: a no-op cast
                self.add(self.emit(f"ops.cast({v.name}, D.{target})", "f", v.labels, v.ref, v.err))
                return
            mid = self.emit(f"ops.cast({v.name}, D.{target})", "f", v.labels, v.ref, v.err)
            if keep and target in ("Half", "Double"):
                self.add(mid)  # computed on (half arithmetic) or output as it is
                if op[2] % 3 == 0:
                    self.output(mid)
            back = v.dtype if v.dtype in (DataType.Float, DataType.Double) else DataType.Float
            self.add(self.emit(f"ops.cast({mid.name}, D.{back.name})", "f", v.labels, mid.ref, mid.err))
        elif kind == "reduce":
            name, code, keepdim, mode, comb = op[1], op[3], op[4], op[5], op[6]
            cands = self.floats(lambda w: w.dtype in (DataType.Float, DataType.Double) and len(w.labels) > 0
                                and (w.ref.size > 0 or name == "sum"))  # max of nothing: no identity
            if not cands:
                return
            v = cands[op[2] % len(cands)]
            rk = len(v.labels)
            dims = [i for i in range(rk) if code >> i & 1] or [code % rk]
            red = self.add(self.reduce(name, v, dims, keepdim))
            if mode == "none":
                return
            if keepdim and op[2] % 3 == 2:  # squeezed back to the reduced rank, then broadcast
                kept = [i for i in range(rk) if i not in dims]
                sq = self.add(self.emit(f"ops.squeeze({red.name}, {dims})", "f",
                                        tuple(red.labels[i] for i in kept), np.squeeze(red.ref, tuple(dims)),
                                        np.squeeze(red.err, tuple(dims))))
                labels = tuple(v.labels[i] if i in kept else "b" for i in range(rk))
                red = self.add(self.broadcast(sq, rk, kept, labels))
            elif keepdim:
                if mode == "bid" or op[2] % 2:
                    red = self.add(self.broadcast(red, rk, list(range(rk)), red.labels))
            else:
                kept = [i for i in range(rk) if i not in dims]
                labels = tuple(v.labels[i] if i in kept else "b" for i in range(rk))
                red = self.add(self.broadcast(red, rk, kept, labels))
            if mode == "combine":  # joins the full-shape tensor again (softmax / layernorm style)
                self.add(self.binary(comb, v, red, "tt", 0))
        elif kind == "bcast":
            src_pick, tgt_pick, mode, k, combine = op[1:]
            cands = [w for w in self.pool if w.kind == "f" and w.dtype in _U and len(w.labels) < 4]
            if not cands:
                return
            v = cands[src_pick % len(cands)]
            targets = []
            for w in self.floats(lambda w: len(w.labels) > len(v.labels)):
                pos = _embed(v.labels, w.labels)
                if pos is not None:
                    targets.append((w, pos))
            if mode == "align" and targets:
                w, pos = targets[tgt_pick % len(targets)]
                labels = tuple(v.labels[pos.index(i)] if i in pos else "b" for i in range(len(w.labels)))
                b = self.add(self.broadcast(v, len(w.labels), pos, labels))
                if combine:
                    self.add(self.binary(["add", "mul", "sub"][k % 3], w, b, "tt", 0))
            else:
                rank = min(4, len(v.labels) + 1 + k % 2)
                pos = sorted(random.Random(k).sample(range(rank), len(v.labels)))
                labels = tuple(v.labels[pos.index(i)] if i in pos else "b" for i in range(rank))
                self.add(self.broadcast(v, rank, pos, labels))
        elif kind == "permute":
            cands = [w for w in self.pool if w.kind == "f" and w.dtype in _U and len(w.labels) > 1]
            if not cands:
                return
            v = cands[op[1] % len(cands)]
            perms = list(itertools.permutations(range(len(v.labels))))
            perm = list(perms[op[2] % len(perms)])
            self.add(self.emit(f"ops.permute({v.name}, {perm})", "f", tuple(v.labels[p] for p in perm),
                               np.transpose(v.ref, perm), np.transpose(v.err, perm)))
        elif kind == "index_select":
            idxs = [w for w in self.pool if w.kind == "i" and len(w.labels) == 1 and w.ref.size]
            if not idxs:
                return
            idx = idxs[op[2] % len(idxs)]
            lo, hi = int(idx.ref.min()), int(idx.ref.max())
            pairs = [(w, dim) for w in fl for dim, lab in enumerate(w.labels)
                     if lab != "b" and lo >= 0 and hi < self.size(lab)]
            if not pairs:
                return
            v, dim = pairs[op[1] % len(pairs)]
            out_elems = v.ref.size // max(1, v.ref.shape[dim]) * idx.ref.size
            if out_elems > 3 * MAX_ELEMENTS:
                return
            labels = tuple(idx.labels[0] if i == dim else lab for i, lab in enumerate(v.labels))
            self.add(self.emit(f"ops.index_select({v.name}, {idx.name}, {dim})", "f", labels,
                               np.take(v.ref, idx.ref, axis=dim), np.take(v.err, idx.ref, axis=dim)))
        elif kind == "idx_math" and op[2] == "count":
            # An index that is a reduction's result (a count of positive entries per row, as
            # `mask.sum(1)` or an argmax is): its reduced axis stays in the IR's logical domain.
            srcs = [w for w in self.floats() if len(w.labels) == 2 and "b" not in w.labels
                    and not w.err.any() and w.ref.size]
            if not srcs:
                return
            w = srcs[op[1] % len(srcs)]
            pos = self.emit(f"ops.gt({w.name}, 0.0)", "b", w.labels, w.ref > 0, np.zeros(w.ref.shape, bool))
            ints = self.emit(f"ops.cast({pos.name}, D.Int)", "i", w.labels, (w.ref > 0).astype(np.int64), 0)
            self.add(self.emit(f"ops.sum({ints.name}, dims=[1])", "i", w.labels[:1],
                               (w.ref > 0).sum(1).astype(np.int64), 0))
        elif kind == "idx_math":
            idxs = [w for w in self.pool if w.kind == "i" and len(w.labels) == 1]
            if not idxs:
                return
            v, mode = idxs[op[1] % len(idxs)], op[2]
            other = {DataType.Int: "Int32", DataType.Int32: "Int"}.get(v.dtype, "Int")
            hi = int(v.ref.max()) if v.ref.size else 0
            fits = [lab for lab in range(len(self.c.sizes)) if self.c.sizes[lab] > hi + 1]
            if mode == "cast":
                self.add(self.emit(f"ops.cast({v.name}, D.{other})", "i", v.labels, v.ref, 0))
            elif mode == "add" and fits:
                self.add(self.emit(f"ops.add({v.name}, 1)", "i", v.labels, v.ref + 1, 0))
            elif mode == "sub" and v.ref.size and int(v.ref.min()) >= 1:
                self.add(self.emit(f"ops.sub({v.name}, 1)", "i", v.labels, v.ref - 1, 0))
            elif mode == "float_trip":  # exact for small integers
                f = self.emit(f"ops.cast({v.name}, D.Float)", "f", v.labels, v.ref.astype(float), 0)
                self.add(self.emit(f"ops.cast({f.name}, D.{other})", "i", v.labels, v.ref, 0))
            else:
                self.add(self.emit(f"ops.cast({v.name}, D.Float)", "f", v.labels, v.ref.astype(float), 0))
        elif kind in ("slice", "pad", "cat", "reshape", "select", "triu", "take"):
            self.shape_op(op)
        elif kind == "full":
            pick, vkind, dt, combine = op[1:]
            v = fl[pick % len(fl)]
            dims = []
            for lab in v.labels:
                if lab == self.c.size_scalar and self.size_scalar is not None and isinstance(lab, int):
                    dims.append(self.size_scalar)
                else:
                    dims.append(str(self.size(lab)))
            src, value = self.scalar_operand(pick, runtime=vkind == "scalar")
            shape = tuple(self.size(lab) for lab in v.labels)
            labels = tuple("one" if lab == "b" else lab for lab in v.labels)
            f = self.add(self.emit(f"ops.full([{', '.join(dims)}], {src}, D.{dt})", "f", labels,
                                   np.full(shape, value, dtype=np.float64), 0))
            if combine:
                self.add(self.binary(["add", "mul", "sub"][pick % 3], v, f, "tt", 0))
        else:
            cands = [w for w in self.pool if not w.is_input]
            if op[1] % 40 == 0:  # now and then an input itself is an output
                cands = [w for w in self.pool if w.is_input and w.kind == "f"]
            if cands:
                self.output(cands[op[1] % len(cands)])

    def finish(self) -> None:
        last = next((v for v in reversed(self.pool) if not v.is_input and v.dtype != DataType.BFloat16), None)
        if last is None:
            last = self.add(self.unary("sin", self.floats()[0]))
        self.output(last)


def _rounds(value: float) -> float:
    """|value| when a float32 cannot hold it exactly, else 0."""
    return 0.0 if float(np.float32(value)) == value else abs(float(value))


def _pad_ref(x: np.ndarray, pairs: Sequence[Tuple[int, int]], value: float) -> np.ndarray:
    """``x`` padded by ``(before, after)`` per axis (negative: cropped): output position ``o``
    holds ``x[o - before]`` where that is inside ``x``, else ``value``."""
    y = x
    for a, (lo, hi) in enumerate(pairs):
        n = y.shape[a]
        ext = n + lo + hi
        pos = np.arange(ext) - lo
        inside = (pos >= 0) & (pos < n)
        if n == 0:
            shape = list(y.shape)
            shape[a] = ext
            y = np.full(shape, value, dtype=np.result_type(y, np.asarray(value)))
            continue
        y = np.take(y, np.clip(pos, 0, n - 1), axis=a)
        y = np.where(inside.reshape([ext if k == a else 1 for k in range(y.ndim)]), y, value)
    return y


def _embed(src: Sequence[Any], tgt: Sequence[Any]) -> Optional[List[int]]:
    """Increasing positions of ``tgt`` whose labels match ``src`` in order ("b" matches any)."""
    pos: List[int] = []
    j = 0
    for lab in src:
        while j < len(tgt) and not (lab == tgt[j] or lab == "b"):
            j += 1
        if j == len(tgt):
            return None
        pos.append(j)
        j += 1
    return pos


def build(case: Case) -> Program:
    """Define the fusion of ``case`` (raises what kiln raises while defining)."""
    b = _Builder(case)
    b.define_inputs()
    for op in case.ops:
        b.op(op)
    b.finish()
    return Program(case, b.fd, b.inputs, b.input_code, b.lines, b.outputs, b.pool, b.ns)


# -- checking -----------------------------------------------------------------------------
@dataclass
class Outcome:
    category: str
    message: str = ""
    key: str = ""
    kernels: int = -1
    scheduler: str = ""


def normalize(msg: str) -> str:
    """The message with tensor names, ids and numbers stripped (for grouping)."""
    m = msg.splitlines()[0] if msg else ""
    m = m.replace("internal compiler error (please report): ", "")
    m = re.sub(r"i[A-Za-z.]*\d+\{[^}]*\}", "<id>", m)
    m = re.sub(r"\bT\d+\b", "T#", m)
    m = re.sub(r"\bkernel\d+\b", "kernel#", m)
    m = re.sub(r"<[^>]*>", "<..>", m)
    m = re.sub(r"\[[^\]]*\]", "[..]", m)
    m = re.sub(r"\d+", "#", m)
    return m[:160]


def classify_error(e: BaseException) -> str:
    msg = str(e)
    if KilnInternalError is not RuntimeError and isinstance(e, KilnInternalError):
        return "internal"
    if _INTERNAL.search(msg):
        return "internal"
    if isinstance(e, KilnError):
        return "memfault" if _MEMFAULT.search(msg) else "refused"
    return "internal"


def _check_output(i: int, v: Val, got: Any) -> Optional[str]:
    got = np.asarray(got)
    want_dtype = np.dtype(_NP[v.dtype]) if v.dtype in _NP else None
    if got.shape != v.ref.shape:
        return f"output {i} ({v.name}): shape {got.shape}, expected {v.ref.shape}"
    if want_dtype is not None and got.dtype != want_dtype:
        return f"output {i} ({v.name}): dtype {got.dtype}, expected {want_dtype}"
    if v.kind == "b":
        bad = (got != v.ref) & ~(v.err > 0)
    elif v.kind == "i":
        bad = got.astype(np.int64) != v.ref
    else:
        g = got.astype(np.float64)
        tol = 4 * v.err + 4 * _U.get(v.dtype, 2.0 ** -24) * np.abs(v.ref) + 1e-30
        bad = ~(np.abs(g - v.ref) <= tol)
    if not bad.any():
        return None
    at = tuple(int(j) for j in np.argwhere(bad)[0])
    return (f"output {i} ({v.name}): values differ at {int(bad.sum())} of {bad.size} elements, first at "
            f"{at}: got {got[at]!r}, expected {v.ref[at]!r}")


def _on_gpu(x: Any) -> Any:
    """A CuPy copy of array input ``x`` with its strides (scalars pass through)."""
    import cupy as cp

    if not isinstance(x, np.ndarray):
        return x
    if x.flags.c_contiguous or x.size == 0:
        return cp.asarray(np.array(x, order="C"))
    # The same view of a GPU copy of the whole base: the kernels run on these strides.
    base = x
    while isinstance(base.base, np.ndarray):
        base = base.base
    offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    flat = cp.asarray(np.ascontiguousarray(base).reshape(-1).view(np.uint8))
    return cp.ndarray(x.shape, x.dtype, flat.data + offset, strides=x.strides)


def run_case(case: Case, diagnose: bool = True, gpu: bool = False) -> Outcome:
    """Build, lower and run ``case`` on the automatic path (in the interpreter, or with
    ``gpu`` on CuPy copies of the inputs); classify what happened."""
    try:
        prog = build(case)
    except KilnError as e:
        return Outcome(classify_error(e), f"definition: {e}", "definition: " + normalize(str(e)))
    except RuntimeError as e:
        return Outcome("internal", f"definition: {e}", "definition: " + normalize(str(e)))
    stage, n_kernels = "lower", -1
    try:
        low = prog.fd.lower(prog.inputs)
        n_kernels, stage = len(low.kernels), "execute"
        if gpu:
            import cupy as cp

            outs = [cp.asnumpy(o) for o in prog.fd.execute([_on_gpu(x) for x in prog.inputs])]
        else:
            outs = prog.fd.execute(prog.inputs)
    except Exception as e:  # noqa: BLE001 - every failure of the compiler is classified
        cat = classify_error(e)
        key = f"{type(e).__name__}: {normalize(str(e))}"
        return Outcome(cat, f"{stage}: {type(e).__name__}: {e}", key, n_kernels,
                       _scheduler(prog) if diagnose and cat != "refused" else "")
    problems = []
    if len(outs) != len(prog.outputs):
        problems.append(f"{len(outs)} outputs, expected {len(prog.outputs)}")
    else:
        for i, (v, g) in enumerate(zip(prog.outputs, outs)):
            p = _check_output(i, v, g)
            if p:
                problems.append(p)
    if not problems:
        return Outcome("ok", kernels=n_kernels)
    kind = "shape" if "shape" in problems[0] else "dtype" if "dtype" in problems[0] else "values"
    sched = _scheduler(prog) if diagnose else ""
    written = ""
    if diagnose:  # does the unscheduled interpretation agree with the reference?
        try:
            ref_outs = prog.fd.execute(prog.inputs, as_written=True)
            bad = [i for i, (v, g) in enumerate(zip(prog.outputs, ref_outs)) if _check_output(i, v, g)]
            written = "; as_written also differs" if bad else "; as_written agrees with the reference"
        except Exception as e:  # noqa: BLE001
            written = f"; as_written fails: {type(e).__name__}"
    msg = "; ".join(problems[:3]) + written
    key = f"{kind} differ [{sched}, {n_kernels} kernel(s)]{written}"
    if diagnose and _contiguous_copies_agree(case, prog):
        key = f"{kind} differ only for non-contiguous inputs (contiguous copies agree){written}"
        msg += "; contiguous copies of the inputs give the reference"
    return Outcome("mismatch", msg, key, n_kernels, sched)


def _contiguous_copies_agree(case: Case, prog: Program) -> bool:
    """Whether a fresh build of ``case`` run on C-contiguous copies of its inputs is right."""
    if all(not hasattr(x, "flags") or x.flags.c_contiguous for x in prog.inputs):
        return False
    try:
        fresh = build(case)
        copies = [np.array(x, order="C") if hasattr(x, "flags") else x for x in fresh.inputs]
        outs = fresh.fd.execute(copies)
        return len(outs) == len(fresh.outputs) and not any(
            _check_output(i, v, g) for i, (v, g) in enumerate(zip(fresh.outputs, outs)))
    except Exception:  # noqa: BLE001 - fails for another reason: not this diagnosis
        return False


def _scheduler(prog: Program) -> str:
    """The scheduler kind the automatic path picks (for grouping failures)."""
    try:
        from kiln.execute import data_ptr

        arrays = [x for x in prog.inputs if hasattr(x, "shape")]
        aligned = all(data_ptr(x) % 16 == 0 for x in arrays)
        return str(prog.fd._core.auto_program([list(x.shape) for x in arrays], aligned).heuristic)
    except Exception:  # noqa: BLE001
        return "?"


def repro(case: Case, outcome: Optional[Outcome] = None) -> str:
    """A runnable Python snippet that rebuilds ``case`` and runs it on the automatic path
    (definitions no output needs left out; for a failure that raises, also the inputs it
    turns out not to need)."""
    try:
        prog = build(case)
    except Exception as e:  # noqa: BLE001
        return f"# could not rebuild: {e}\n# {case!r}"
    lines = live_lines(prog.lines)
    used = list(range(len(prog.inputs)))
    raises = outcome is not None and outcome.category != "mismatch" and not outcome.key.startswith(
        ("definition", "harness"))
    if raises:
        unused = _unused_inputs(lines)
        if unused:
            keep = [ln for i, ln in enumerate(lines) if i not in unused.values()]
            pruned = [k for k in used if k not in unused]
            if _raised_key(_snippet(prog.input_code, keep, pruned, False)) == outcome.key:
                lines, used = keep, pruned
    code = _snippet(prog.input_code, lines, used, outcome is not None and outcome.category == "mismatch")
    if outcome is not None and outcome.message:
        code += f"\n# {outcome.category}: {outcome.message.splitlines()[0][:300]}"
    return code


def _snippet(input_code: Sequence[str], lines: Sequence[str], used: Sequence[int], compare: bool) -> str:
    out = ["import numpy as np", "from kiln import DataType as D, FusionDefinition", ""]
    out += input_code
    out += ["with FusionDefinition() as fd:", "    ops = fd.ops"]
    out += ["    " + ln for ln in lines]
    out.append(f"inputs = [{', '.join(f'a{i}' for i in used)}]")
    if compare:
        out += ["outs = fd.execute(inputs)  # automatic schedule",
                "want = fd.execute(inputs, as_written=True)  # unscheduled interpretation",
                "for o, w in zip(outs, want):",
                "    print(o.shape, w.shape, np.max(np.abs(o.astype(np.float64) - w.astype(np.float64)))"
                " if o.shape == w.shape and o.size else '')"]
    else:
        out.append("print([o.shape for o in fd.execute(inputs)])  # automatic schedule")
    return "\n".join(out)


def _unused_inputs(lines: Sequence[str]) -> Dict[int, int]:
    """{input index: line index} of the inputs that no other line reads."""
    defs = [(i, ln.split(" = ")[0]) for i, ln in enumerate(lines) if "= fd.define_" in ln]
    text = "\n".join(ln for ln in lines if "= fd.define_" not in ln)
    return {k: i for k, (i, name) in enumerate(defs) if not re.search(rf"\b{name}\b", text)}


def _raised_key(code: str) -> Optional[str]:
    """The normalized error ``code`` raises (as ``run_case`` keys it), or None."""
    try:
        exec(compile(code, "<repro>", "exec"), {"print": lambda *a, **k: None})
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {normalize(str(e))}"
    return None


def live_lines(lines: Sequence[str]) -> List[str]:
    """``lines`` without the definitions no output depends on (inputs are all kept)."""
    need: set = set()
    keep = [False] * len(lines)
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        m = re.match(r"(\w+) = (.*)", ln)
        if m is None or "define_" in ln or m.group(1) in need:
            keep[i] = True
            need.update(re.findall(r"\b[tsn]\d+\b", m.group(2) if m else ln))
    return [ln for ln, k in zip(lines, keep) if k]


def case_size(case: Case) -> Tuple[int, int, int]:
    n_inputs = len(case.fulls) + len(case.biases) + len(case.indices) + len(case.scalars)
    return (len(case.ops), int(np.prod(case.sizes)), n_inputs)


def shrink(case: Case, key: str, budget: int = 150) -> Case:
    """Greedily remove ops and inputs and shrink sizes while the failure ``key`` persists."""
    tries = 0

    def same(c: Case) -> bool:
        nonlocal tries
        tries += 1
        try:
            return run_case(c).key == key
        except Exception:  # noqa: BLE001 - a harness failure on a shrunk case: not the same
            return False

    improved = True
    while improved and tries < budget:
        improved = False
        candidates: List[Case] = []
        for i in range(len(case.ops) - 1, -1, -1):
            candidates.append(replace(case, ops=case.ops[:i] + case.ops[i + 1:]))
        for attr in ("fulls", "biases", "indices", "scalars"):
            items = getattr(case, attr)
            lo = 1 if attr == "fulls" else 0
            for i in range(len(items)):
                if len(items) > lo:
                    candidates.append(replace(case, **{attr: items[:i] + items[i + 1:]}))
        for i, (dt, layout) in enumerate(case.fulls):
            for simpler in ({layout, "contig"} - {layout}) | ({dt, "Float"} - {dt}):
                fulls = list(case.fulls)
                fulls[i] = (dt, "contig") if simpler == "contig" else ("Float", layout)
                candidates.append(replace(case, fulls=fulls))
        if case.size_scalar is not None:
            candidates.append(replace(case, size_scalar=None))
        if case.static:
            candidates.append(replace(case, static=False))
        for i, s in enumerate(case.sizes):
            for smaller in sorted({x for x in SIZES if x < s})[-2:]:
                sizes = list(case.sizes)
                sizes[i] = smaller
                candidates.append(replace(case, sizes=sizes,
                                          indices=[(a, n, min(o, max(0, sizes[a] - 1)), dt)
                                                   for a, n, o, dt in case.indices]))
        for c in candidates:
            if tries >= budget:
                break
            if same(c):
                case, improved = c, True
                break
    return case


# -- the CI test ------------------------------------------------------------------------------
RESULTS: List[Tuple[Case, Outcome]] = []
_COLLECTED: List[Any] = []  # True once collected, or the exception collecting raised
# conftest NVRTC-compiles every kernel a test lowered (~1 s per example here, minutes for all
# of them): the kernels of every KILN_AUTO_COMPILE_EVERY-th example are kept for it (0: none).
_COMPILE_EVERY = int(os.environ.get("KILN_AUTO_COMPILE_EVERY", "10"))
_KEPT: list = []


def _collect() -> List[Tuple[Case, Outcome]]:
    """Run the N derandomized examples once per session (both tests below read the results)."""
    if _COLLECTED:
        if isinstance(_COLLECTED[0], BaseException):
            raise RuntimeError("running the examples failed (see the first test)") from _COLLECTED[0]
        return RESULTS
    from kiln import lowering

    @settings(max_examples=N_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(cases())
    def body(case: Case) -> None:
        lowering.take_generated()
        try:
            outcome = run_case(case)
        except Exception as e:  # noqa: BLE001 - the harness must not stop on one example
            outcome = Outcome("internal", f"harness: {type(e).__name__}: {e}",
                              f"harness: {normalize(str(e))}")
        RESULTS.append((case, outcome))
        kernels = lowering.take_generated()
        if _COMPILE_EVERY and len(RESULTS) % _COMPILE_EVERY == 0:
            _KEPT.extend(kernels)

    try:
        body()
    except BaseException as e:
        _COLLECTED.append(e)
        raise
    _COLLECTED.append(True)
    return RESULTS


def summarize(results: Sequence[Tuple[Case, Outcome]], shrink_budget: int = 0, max_groups: int = 12) -> str:
    """Counts per category, then per non-ok category the distinct messages with the smallest
    example of each as a runnable repro."""
    counts = {c: 0 for c in CATEGORIES}
    groups: Dict[Tuple[str, str], List[Tuple[Case, Outcome]]] = {}
    for case, o in results:
        counts[o.category] = counts.get(o.category, 0) + 1
        if o.category != "ok":
            groups.setdefault((o.category, o.key), []).append((case, o))
    total = max(1, len(results))
    lines = [f"{len(results)} examples: " + ", ".join(
        f"{c} {counts[c]} ({100.0 * counts[c] / total:.1f}%)" for c in CATEGORIES)]
    for cat in CATEGORIES[1:]:
        mine = sorted(((k, v) for k, v in groups.items() if k[0] == cat), key=lambda kv: -len(kv[1]))
        if not mine:
            continue
        lines.append(f"\n=== {cat}: {counts[cat]} examples, {len(mine)} distinct messages ===")
        for (_, key), items in mine:
            lines.append(f"  {len(items):4d}  {key}")
        for n, ((_, key), items) in enumerate(mine[:max_groups]):
            case, o = min(items, key=lambda co: case_size(co[0]))
            if shrink_budget:
                case = shrink(case, key, shrink_budget)
                o = run_case(case)
            lines.append(f"\n--- {cat} #{n + 1} ({len(items)}x): {key}")
            lines.append(f"# message: {o.message[:400]}")
            lines.append(f"# case: {case!r}")
            lines.append(repro(case, o))
    return "\n".join(lines)


def _bad(results: Sequence[Tuple[Case, Outcome]], cats: Sequence[str]) -> List[Tuple[Case, Outcome]]:
    return [(c, o) for c, o in results if o.category in cats]


def test_auto_random_fusions_match_numpy() -> None:
    results = _collect()
    bad = _bad(results, ["mismatch", "internal", "memfault"])
    report = summarize(results, shrink_budget=60) if bad else ""
    harness.hand_kept_kernels_to_conftest(_KEPT)  # (not the kernels of the shrinking above)
    if bad:
        pytest.fail(f"{len(bad)} of {len(results)} examples failed\n" + report, pytrace=False)


@pytest.mark.gpu
def test_auto_random_fusions_match_numpy_on_the_gpu() -> None:
    """The first ``KILN_AUTO_GPU_EXAMPLES`` (default 150) fusions the interpreter ran, on the
    GPU with CuPy inputs of the same strides."""
    harness.rerun_accepted_on_gpu(_collect, "KILN_AUTO_GPU_EXAMPLES", 150, _gpu_failure,
                                  lambda case, o: f"# {o.message[:400]}\n{repro(case, o)}", what="fusions")


def _gpu_failure(cp: Any, case: Case) -> Optional[Outcome]:
    """The outcome of ``case`` on the GPU (``run_case`` copies the inputs with CuPy) unless ok."""
    del cp
    o = run_case(case, diagnose=False, gpu=True)
    return o if o.category != "ok" else None


def test_auto_random_refusals_are_rare_and_named() -> None:
    results = _collect()
    harness.hand_kept_kernels_to_conftest(_KEPT)
    refused = _bad(results, ["refused"])
    unnamed = [(c, o) for c, o in refused if not _NAMES_SOMETHING.search(o.message)]
    if unnamed:
        pytest.fail("refusals must name a tensor or an op:\n" + summarize(unnamed), pytrace=False)
    limit = MAX_REFUSED_FRACTION * len(results)
    if len(refused) > limit:
        pytest.fail(f"{len(refused)} of {len(results)} examples refused (limit {limit:.0f})\n"
                    + summarize(refused), pytrace=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generator_builds_valid_definitions(seed: int) -> None:
    """The generator itself: definitions build, references are finite, repros rebuild."""
    rng = random.Random(seed)
    for _ in range(100):
        case = gen_case(RandomDraw(rng))
        try:
            prog = build(case)
        except KilnError:
            continue  # kiln refusing a definition is the property test's business
        for v in prog.pool + prog.outputs:
            # the generator's shapes agree with kiln's: rank, broadcast axes (1), dtype kind
            shape = prog.handles[v.name].shape
            kinds = {"f": set(_U), "i": {DataType.Int, DataType.Int32}, "b": {DataType.Bool}}
            assert v.dtype in kinds[v.kind], (case, v.name, v.dtype)
            assert len(shape) == len(v.labels) == v.ref.ndim, (case, v.name, shape, v.labels)
            for lab, n, k in zip(v.labels, v.ref.shape, shape):
                assert n == (1 if lab in ("b", "one") else n), (case, v.name)
                assert lab != "b" or k == 1, (case, v.name, shape, v.labels)
            if v.kind == "f":
                assert np.all(np.isfinite(v.ref)) and np.all(np.isfinite(v.err)), (case, v.name)
        compile(repro(case), "<repro>", "exec")
