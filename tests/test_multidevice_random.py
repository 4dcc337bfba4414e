"""Property test of sharded fusions: random fusions written on global shapes as a user writes
them (a main input sharded along one axis over a mesh of 1-4 devices, extra inputs sharded
the same way, replicated and broadcast along the sharded axis, or replicated and holding it
whole (read slice by slice), a chain of unary, scalar, binary and keepdim reduction ops
(logsumexp included), an optional rank-reducing reduction at the end whose output may be
declared replicated or sharded on a kept axis, and maybe an intermediate handed back too)
simulated rank by rank with ``kiln.multidevice.simulate`` and checked against float64 NumPy of
the unsharded fusion.

Every rank's output is checked: a sharded output's slices are concatenated in mesh order, a
replicated one must be the whole result on every rank. The tolerance is a running bound of
float32 rounding error carried along the NumPy reference (sums scale it by their length).

Deterministic tests cover the KilnErrors of bad shardings and pin the bugs the property test
found (fixed since; a bug still open would be a strict xfail here).

CI runs ``KILN_MULTIDEVICE_EXAMPLES`` (default 50) derandomized examples.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kiln import DeviceMesh, FusionDefinition, KilnError, ParallelType
from kiln.multidevice import simulate
from test_multidevice import part, shard

N_EXAMPLES = int(os.environ.get("KILN_MULTIDEVICE_EXAMPLES", "50"))
UNARY = ("exp", "neg", "abs", "tanh", "sigmoid")
BINARY = ("add", "sub", "mul")
REDUCE = ("sum", "max", "min", "mean", "logsumexp")
SCALARS = (-1.5, -0.5, 0.25, 1.0, 2.0)
INPUT_BOUND = 2.0  # inputs are uniform in [-2, 2]
EXP_BOUND = 3.0  # exp only of values known to lie in [-3, 3]
MAX_BOUND = 1e9  # no value grows past this (float32 holds the results)
# A float32 op's rounding error, relative to its result (a few units in the last place, for
# the transcendental functions too).
EPS = 4 * 2.0**-24

# How a tensor's values lie along the main input's sharded axis ``a`` (the model of
# propagation the generator keeps, so that it writes only fusions kiln accepts):
# "sharded": sharded along a; "bcast": replicated with a broadcast (size one) axis a;
# "uniform": replicated, axis a expanded to its global size by broadcast_in_dim from
# broadcast values only (kiln lets each rank make its slice of it); "whole": replicated with
# a real axis a (a sharded operand beside it reads it slice by slice).
SHARDED, BCAST, UNIFORM, WHOLE = "sharded", "bcast", "uniform", "whole"


# -- the cases ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Extra:
    """An extra input holding the main input's axes ``axes`` (in order); sharded the same way
    when it holds the sharded axis, unless ``whole`` (then replicated: every rank passes all of
    it); a replicated one may also be declared on the mesh (``on_mesh``)."""

    axes: Tuple[int, ...]
    on_mesh: bool
    whole: bool = False

    def state(self, a: int, style: str) -> str:
        """Its state along the sharded axis ``a`` once broadcast to the main rank by ``style``."""
        if a in self.axes:
            return WHOLE if self.whole else SHARDED
        return UNIFORM if style == "size" else BCAST


# Steps: ("unary", name) | ("scalar", op, c, scalar_first) | ("binary", op, extra, cur_first, style)
# | ("reduce", op, axes, style, combine, cur_first): ``style`` is how a lower-rank operand is
# broadcast back to the main input's rank: "keepdim" (reductions only), "implicit"
# (broadcast_in_dim to [-1] * rank: size-one axes) or "size" (broadcast_in_dim to the main
# input's sizes from fd.ops.size: expanded axes); ``combine`` None makes the (broadcast)
# reduction the current tensor, else ``combine(cur, r)`` is.
Step = Tuple[Any, ...]


@dataclass(frozen=True)
class Final:
    """A rank-reducing reduction ending the chain (``op`` over ``axes``, keepdim False) whose
    output is declared ``decl`` (None, "replicated", or ("shard", logical axis k)), then an
    optional pointwise ``post`` step, whose output may be declared replicated (``post_repl``)."""

    op: str
    axes: Tuple[int, ...]
    decl: Any
    post: Optional[Step]
    post_repl: bool


@dataclass(frozen=True)
class Case:
    d: int
    shape: Tuple[int, ...]
    axis: int
    extras: Tuple[Extra, ...]
    steps: Tuple[Step, ...]
    final: Optional[Final]
    out_repl: bool  # without a final reduction: the output is declared replicated
    seed: int
    also_out: Optional[int] = None  # the result of this step is handed back too (a second output)


def _combine_state(s: str, t: str) -> str:
    """The spread state of a pointwise op of operands in states ``s`` and ``t``."""
    for state in (SHARDED, WHOLE, UNIFORM):
        if state in (s, t):
            return state
    return BCAST


def _reduced_state(s: str, a_reduced: bool, style: str) -> str:
    """The state of a reduction (broadcast back by ``style``) of a tensor in state ``s``."""
    if a_reduced or s == BCAST:
        return UNIFORM if style == "size" else BCAST
    return SHARDED if s == SHARDED else WHOLE


def _pointwise_bound(op: str, b: float, c: float) -> float:
    return b * c if op == "mul" else b + c


def _reduced_bound(op: str, b: float, n: int) -> float:
    """A bound of ``op`` over ``n`` values bounded by ``b``."""
    return b * n if op == "sum" else b + math.log(n) if op == "logsumexp" else b


def _ops_within(ops: Sequence[str], b: float, c: float) -> List[str]:
    """The ops of ``ops`` whose result of operands bounded by ``b`` and ``c`` stays far from
    float32's range."""
    return [op for op in ops if _pointwise_bound(op, b, c) <= MAX_BOUND]


@st.composite
def cases(draw: Any) -> Case:
    d = draw(st.sampled_from([2, 3, 4, 2, 3, 4, 1]))  # a mesh of one is the easy case
    rank = draw(st.sampled_from([2, 3]))
    a = draw(st.integers(0, rank - 1))
    # Other axes: small, half the time multiples of d (a reduce-scatter's axis splits evenly).
    shape = tuple(d * draw(st.integers(1, 4)) if i == a
                  else d * draw(st.integers(1, 2)) if draw(st.booleans()) else draw(st.integers(1, 5))
                  for i in range(rank))
    extras = []
    for _ in range(draw(st.integers(1, 2))):
        axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        whole = a in axes and draw(st.integers(0, 2)) == 0
        extras.append(Extra(tuple(sorted(axes)), draw(st.booleans()), whole))
    n_ops = draw(st.integers(2, 6))
    with_final = draw(st.booleans())
    state, cur, bound = SHARDED, list(shape), INPUT_BOUND
    steps: List[Step] = []
    while len(steps) < n_ops - int(with_final):
        kind = draw(st.sampled_from(["unary", "scalar", "binary", "binary", "reduce", "reduce"]))
        if kind == "unary":
            name = draw(st.sampled_from([u for u in UNARY if u != "exp" or bound <= EXP_BOUND]))
            steps.append(("unary", name))
            if name == "exp":
                bound = math.exp(bound)
            elif name in ("tanh", "sigmoid"):
                bound = 1.0
        elif kind == "scalar":
            c = draw(st.sampled_from(SCALARS))
            op = draw(st.sampled_from(_ops_within(BINARY, bound, abs(c))))
            steps.append(("scalar", op, c, draw(st.booleans())))
            bound = _pointwise_bound(op, bound, abs(c))
        elif kind == "binary":
            op = draw(st.sampled_from(_ops_within(BINARY, bound, INPUT_BOUND)))
            i = draw(st.integers(0, len(extras) - 1))
            style = draw(st.sampled_from(["implicit", "size"]))
            steps.append(("binary", op, i, draw(st.booleans()), style))
            axes = extras[i].axes
            state = _combine_state(state, extras[i].state(a, style))
            full = [s if (j in axes or style == "size") else 1 for j, s in enumerate(shape)]
            cur = list(np.broadcast_shapes(tuple(cur), tuple(full)))
            bound = _pointwise_bound(op, bound, INPUT_BOUND)
        else:
            axes = tuple(sorted(draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank,
                                               unique=True))))
            n = math.prod(cur[j] for j in axes)
            op = draw(st.sampled_from([r for r in REDUCE if r != "sum" or bound * n <= MAX_BOUND]))
            rbound = _reduced_bound(op, bound, n)
            style = draw(st.sampled_from(["keepdim", "implicit", "size"]))
            combine = draw(st.sampled_from([None, *_ops_within(BINARY, bound, rbound)]))
            steps.append(("reduce", op, axes, style, combine, draw(st.booleans())))
            rstate = _reduced_state(state, a in axes, style)
            rshape = list(shape) if style == "size" else [1 if j in axes else s for j, s in enumerate(cur)]
            if combine is None:
                state, cur, bound = rstate, rshape, rbound
            else:
                state = _combine_state(state, rstate)
                cur = list(np.broadcast_shapes(tuple(cur), tuple(rshape)))
                bound = _pointwise_bound(combine, bound, rbound)
    final = None
    if with_final:
        # (Not a size-one axis: after a keepdim reduction it is a broadcast, which kiln does not shard.)
        can_scatter = [k for k in range(rank) if k != a and cur[k] % d == 0 and cur[k] > 1]
        decl: Any = draw(st.sampled_from([None, "replicated"]))
        if can_scatter and draw(st.integers(0, 3)) > 0:
            # An output declared sharded on a kept axis whose global size splits evenly: a
            # ReduceScatter of a sum, max or min over the sharded axis; the rank's slice of a
            # mean or logsumexp finished on every rank, of a value computed whole, or of one
            # still sharded on the other axis (gathered first).
            op = draw(st.sampled_from(REDUCE))
            k = draw(st.sampled_from(can_scatter))
            axes = [j for j in range(rank) if j not in (a, k) and draw(st.booleans())]
            if not axes or draw(st.integers(0, 3)) > 0:
                axes.append(a)
            decl = ("shard", k)
        else:
            op = draw(st.sampled_from(REDUCE))
            # Over the sharded axis more often than not, and over few others.
            axes = [j for j in range(rank) if j != a and draw(st.integers(0, 2)) == 0]
            if not axes or draw(st.integers(0, 3)) > 0:
                axes.append(a)
        axes = tuple(sorted(axes))
        post: Optional[Step] = None
        if draw(st.booleans()):
            if draw(st.booleans()):
                rbound = _reduced_bound(op, bound, math.prod(cur[j] for j in axes))
                names = [u for u in UNARY if u != "exp" or rbound <= EXP_BOUND]
                post = ("unary", draw(st.sampled_from(names)))
            else:
                post = ("scalar", draw(st.sampled_from(BINARY)), draw(st.sampled_from(SCALARS)),
                        draw(st.booleans()))
        final = Final(op, axes, decl, post, post is not None and draw(st.booleans()))
    out_repl = final is None and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    # An intermediate handed back too (not the last tensor: that is the output already).
    last = len(steps) - (final is None)
    also_out = draw(st.none() | st.integers(0, last - 1)) if last > 0 else None
    return Case(d, shape, a, tuple(extras), tuple(steps), final, out_repl, seed, also_out)


# -- the float64 reference, with a bound of the float32 rounding error -------------------------


@dataclass
class Ref:
    """A float64 value and a bound of the absolute error a float32 computation of it has."""

    v: np.ndarray
    e: np.ndarray


def ref_unary(name: str, x: Ref) -> Ref:
    """``name(x)`` and its error (the input's error through the function's slope)."""
    if name == "exp":
        v = np.exp(x.v)
        return Ref(v, v * np.expm1(x.e) + EPS * v)
    if name == "neg":
        return Ref(-x.v, x.e)
    if name == "abs":
        return Ref(np.abs(x.v), x.e)
    if name == "tanh":
        v = np.tanh(x.v)
        return Ref(v, x.e + EPS * np.abs(v))
    v = 1.0 / (1.0 + np.exp(-x.v))
    return Ref(v, x.e / 4 + EPS * v)


def ref_binary(op: str, x: Ref, y: Ref) -> Ref:
    """``op(x, y)`` with NumPy broadcasting and its error."""
    if op == "mul":
        v = x.v * y.v
        e = np.abs(x.v) * y.e + np.abs(y.v) * x.e + x.e * y.e
    else:
        v = x.v + y.v if op == "add" else x.v - y.v
        e = x.e + y.e
    return Ref(v, e + EPS * np.abs(v))


def ref_reduce(op: str, x: Ref, axes: Tuple[int, ...]) -> Ref:
    """``op`` over ``axes`` with keepdims, and its error (a sum of n terms rounds n times; a
    logsumexp's slopes are softmax weights, which sum to one)."""
    n = math.prod(x.v.shape[j] for j in axes)
    if op == "logsumexp":
        m = x.v.max(axes, keepdims=True)
        v = m + np.log(np.exp(x.v - m).sum(axes, keepdims=True))
        return Ref(v, np.broadcast_to(x.e, x.v.shape).max(axes, keepdims=True) + n * EPS * (np.abs(v) + 1))
    if op in ("max", "min"):
        v = x.v.max(axes, keepdims=True) if op == "max" else x.v.min(axes, keepdims=True)
        return Ref(v, np.broadcast_to(x.e, x.v.shape).max(axes, keepdims=True))
    v = x.v.sum(axes, keepdims=True)
    e = np.broadcast_to(x.e, x.v.shape).sum(axes, keepdims=True)
    e = e + n * EPS * np.abs(x.v).sum(axes, keepdims=True)
    if op == "mean":
        return Ref(v / n, e / n + EPS * np.abs(v / n))
    return Ref(v, e)


def exact(a: np.ndarray) -> Ref:
    """An input: float32 values, exact in float64."""
    return Ref(a.astype(np.float64), np.zeros(a.shape))


# -- building and running ----------------------------------------------------------------------


@dataclass
class Built:
    fd: FusionDefinition
    inputs: List[np.ndarray]
    in_axes: List[Optional[int]]  # the sharded axis of each input (None: replicated)
    refs: List[Ref]
    out_axes: List[Optional[int]]  # each output's sharded axis (None: replicated on every rank)


def build(case: Case) -> Built:
    """The fusion of ``case``, its global inputs and the NumPy reference of its output."""
    mesh = DeviceMesh(range(case.d))
    rng = np.random.default_rng(case.seed)
    rank, a = len(case.shape), case.axis
    xv = rng.uniform(-INPUT_BOUND, INPUT_BOUND, case.shape).astype(np.float32)
    evs = [rng.uniform(-INPUT_BOUND, INPUT_BOUND, [case.shape[j] for j in e.axes]).astype(np.float32)
           for e in case.extras]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        ets = [fd.define_tensor([-1] * len(e.axes)) for e in case.extras]
        sizes = [fd.ops.size(x, j) for j in range(rank)]

        def full(t: Any, kept: Sequence[int], style: str) -> Any:
            """``t`` (holding main axes ``kept``) broadcast back to the main input's rank."""
            if len(kept) == rank:
                return t
            shape = sizes if style == "size" else [-1] * rank
            return fd.ops.broadcast_in_dim(t, shape=shape, broadcast_dims=list(kept))

        def ref_full(r: Ref, kept: Sequence[int], style: str) -> Ref:
            """The reference of ``full``: size-one axes, or expanded ones for "size"."""
            shape = [r.v.shape[kept.index(j)] if j in kept else 1 for j in range(rank)]
            v, e = r.v.reshape(shape), np.broadcast_to(r.e, r.v.shape).reshape(shape)
            if style == "size":
                target = np.broadcast_shapes(tuple(shape), case.shape)
                v, e = np.broadcast_to(v, target), np.broadcast_to(e, target)
            return Ref(v, e)

        def pointwise(step: Step, t: Any, r: Ref) -> Tuple[Any, Ref]:
            if step[0] == "unary":
                return getattr(fd.ops, step[1])(t), ref_unary(step[1], r)
            _, op, c, scalar_first = step
            cr = Ref(np.float64(c), np.zeros(()))
            if scalar_first:
                return getattr(fd.ops, op)(c, t), ref_binary(op, cr, r)
            return getattr(fd.ops, op)(t, c), ref_binary(op, r, cr)

        cur, ref = x, exact(xv)
        trail: List[Tuple[Any, Ref]] = []  # each step's result
        for step in case.steps:
            if step[0] in ("unary", "scalar"):
                cur, ref = pointwise(step, cur, ref)
            elif step[0] == "binary":
                _, op, i, cur_first, style = step
                kept = case.extras[i].axes
                other, oref = full(ets[i], kept, style), ref_full(exact(evs[i]), kept, style)
                if cur_first:
                    cur, ref = getattr(fd.ops, op)(cur, other), ref_binary(op, ref, oref)
                else:
                    cur, ref = getattr(fd.ops, op)(other, cur), ref_binary(op, oref, ref)
            else:
                _, op, axes, style, combine, cur_first = step
                kept = [j for j in range(rank) if j not in axes]
                rref = ref_reduce(op, ref, axes)
                if style == "keepdim":
                    r = getattr(fd.ops, op)(cur, list(axes), keepdim=True)
                else:
                    r = full(getattr(fd.ops, op)(cur, list(axes)), kept, style)
                    rref = ref_full(Ref(rref.v.squeeze(axes), rref.e.squeeze(axes)), kept, style)
                if combine is None:
                    cur, ref = r, rref
                elif cur_first:
                    cur, ref = getattr(fd.ops, combine)(cur, r), ref_binary(combine, ref, rref)
                else:
                    cur, ref = getattr(fd.ops, combine)(r, cur), ref_binary(combine, rref, ref)
            trail.append((cur, ref))
        states = spread(case)
        state = states[-1] if states else SHARDED
        out_axis: Optional[int] = a if state == SHARDED else None
        out = cur
        f = case.final
        if f is not None:
            s = getattr(fd.ops, f.op)(cur, list(f.axes))
            rref = ref_reduce(f.op, ref, f.axes)
            ref = Ref(rref.v.squeeze(f.axes), rref.e.squeeze(f.axes))
            out_axis = None
            if state == SHARDED and a not in f.axes:
                out_axis = a - sum(j < a for j in f.axes)
            if f.decl == "replicated":
                s.set_device_mesh(mesh)
                out_axis = None
            elif f.decl is not None:
                k = f.decl[1]
                # A reduction's loop domain keeps the reduced axes; a mean's (a division
                # after the sum) has only the kept ones.
                loop_k = k if len(s.loop_domain) > s.ndim else k - sum(j < k for j in f.axes)
                shard(s, loop_k, mesh)
                out_axis = k - sum(j < k for j in f.axes)
            out = s
            if f.post is not None:
                out, ref = pointwise(f.post, s, ref)
                if f.post_repl:
                    out.set_device_mesh(mesh)
                    out_axis = None
        elif case.out_repl:
            out.set_device_mesh(mesh)
            out_axis = None
        fd.add_output(out)
        refs, out_axes = [ref], [out_axis]
        if case.also_out is not None:
            t, r = trail[case.also_out]
            fd.add_output(t)
            refs.append(r)
            out_axes.append(a if states[case.also_out] == SHARDED else None)
    shard(x, a, mesh)
    in_axes: List[Optional[int]] = [a]
    for e, t in zip(case.extras, ets):
        if a in e.axes and not e.whole:
            shard(t, e.axes.index(a), mesh)
            in_axes.append(e.axes.index(a))
        else:
            if e.on_mesh:
                t.set_device_mesh(mesh)
            in_axes.append(None)
    return Built(fd, [xv, *evs], in_axes, refs, out_axes)


def spread(case: Case) -> List[str]:
    """The state of each step's result along the sharded axis (as ``cases`` tracks it)."""
    state, states = SHARDED, []
    for step in case.steps:
        if step[0] == "binary":
            state = _combine_state(state, case.extras[step[2]].state(case.axis, step[4]))
        elif step[0] == "reduce":
            rstate = _reduced_state(state, case.axis in step[2], step[3])
            state = rstate if step[4] is None else _combine_state(state, rstate)
        states.append(state)
    return states


def run_ranks(b: Built, d: int) -> List[List[np.ndarray]]:
    """``simulate`` with each rank's slices of the sharded inputs and the replicated ones whole."""
    return simulate(b.fd, [[x if ax is None else part(x, ax, r, d) for x, ax in zip(b.inputs, b.in_axes)]
                           for r in range(d)])


def check(got: np.ndarray, ref: Ref, what: str) -> None:
    """``got`` is ``ref.v`` within a few times its error bound."""
    want = np.broadcast_to(ref.v, ref.v.shape)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    tol = 1e-6 + 1e-5 * np.abs(want) + 8 * np.broadcast_to(ref.e, want.shape)
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at "
                           f"{np.argwhere(bad)[0].tolist()}: got {got[tuple(np.argwhere(bad)[0])]}, "
                           f"expected {want[tuple(np.argwhere(bad)[0])]}\ngot {got}\nexpected {want}")


def check_ranks(outs: List[List[np.ndarray]], refs: Sequence[Ref], out_axes: Sequence[Optional[int]]) -> None:
    """Every rank's output k: slice r of ``refs[k]`` along ``out_axes[k]``, or all of it."""
    assert all(len(o) == len(refs) for o in outs), [len(o) for o in outs]
    for k, (ref, out_axis) in enumerate(zip(refs, out_axes)):
        if out_axis is None:
            for r, o in enumerate(outs):
                check(np.asarray(o[k]), ref, f"output {k}, rank {r} (replicated)")
            continue
        for r, o in enumerate(outs):
            local = list(ref.v.shape)
            local[out_axis] //= len(outs)
            assert tuple(np.shape(o[k])) == tuple(local), \
                f"output {k}, rank {r}: shape {np.shape(o[k])}, expected {local} (sharded on {out_axis})"
        check(np.concatenate([np.asarray(o[k]) for o in outs], axis=out_axis), ref,
              f"output {k}: ranks concatenated along axis {out_axis}")


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_sharded_fusions_match_numpy(case: Case) -> None:
    """Random sharded fusions: every simulated rank's output matches the unsharded float64 NumPy."""
    b = build(case)
    # What the examples cover (pytest --hypothesis-show-statistics).
    event(f"mesh of {case.d}")
    if case.final is not None and isinstance(case.final.decl, tuple):
        state = (spread(case) or [SHARDED])[-1]
        if state != SHARDED:
            event("output sharded from a value computed whole")
        elif case.axis not in case.final.axes:
            event("output sharding moved to another axis")
        elif case.final.op in ("mean", "logsumexp"):
            event(f"{case.final.op} over the sharded axis into a sharded output")
        else:
            event("reduce-scatter")
    if any(e.whole for e in case.extras):
        event("whole extra input read slice by slice")
    if any(step[0] == "reduce" and case.axis in step[2] for step in case.steps):
        event("keepdim reduction over the sharded axis")
    event("sharded main output" if b.out_axes[0] is not None else "replicated main output")
    check_ranks(run_ranks(b, case.d), b.refs, b.out_axes)


# -- deterministic cases -------------------------------------------------------------------------


def test_generator_model_matches_a_layer_norm_like_chain() -> None:
    """A hand-written case through the same builder: x sharded on 1, mean over it, a sharded weight."""
    case = Case(d=2, shape=(3, 4), axis=1, extras=(Extra((1,), False),),
                steps=(("reduce", "mean", (1,), "keepdim", "sub", True), ("binary", "mul", 0, True, "size")),
                final=None, out_repl=False, seed=1)
    b = build(case)
    assert b.out_axes == [1]
    check_ranks(run_ranks(b, 2), b.refs, b.out_axes)


def test_differently_sharded_operands_of_one_op_are_a_kiln_error() -> None:
    """Two operands of one op sharded on different axes: a KilnError naming both."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(x, y))
    shard(x, 1, mesh)
    shard(y, 0, mesh)
    with pytest.raises(KilnError, match=r"T2: its inputs are sharded differently: T0 \(axis 1 sharded over "
                                        r"DIDx\) and T1 \(axis 0 sharded over DIDx\)"):
        simulate(fd, [[np.ones((4, 2), np.float32), np.ones((2, 4), np.float32)]] * 2)


def test_replicated_real_axis_meeting_a_sharded_one_is_read_slice_by_slice() -> None:
    """A whole [rows, cols] input beside x sharded on cols is read by slices; a wrong size is a KilnError."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(x, w))
    shard(x, 1, mesh)
    w.set_device_mesh(mesh)
    xs = np.arange(12, dtype=np.float32).reshape(3, 4)
    ws = np.arange(12, dtype=np.float32).reshape(3, 4) * 10
    outs = simulate(fd, [[np.ascontiguousarray(xs[:, 2 * r:2 * r + 2]), ws] for r in range(2)])
    np.testing.assert_allclose(np.concatenate([o[0] for o in outs], 1), xs + ws)
    with pytest.raises(KilnError, match=r"T1 is whole on every device and read beside a sharded axis"):
        simulate(fd, [[np.ones((3, 2), np.float32), np.ones((3, 5), np.float32)]] * 2)


def test_a_value_read_whole_elsewhere_is_not_made_slice_by_slice() -> None:
    """Property-test find: an expanded sum read whole by a second reduction, then beside the sharded axis."""
    case = Case(d=2, shape=(2, 1), axis=0, extras=(Extra(axes=(0,), on_mesh=False),),
                steps=(("reduce", "sum", (0,), "size", None, False),
                       ("reduce", "sum", (0,), "keepdim", "add", False),
                       ("unary", "neg"), ("unary", "neg"), ("binary", "add", 0, False, "implicit")),
                final=None, out_repl=False, seed=0)
    b = build(case)
    check_ranks(run_ranks(b, 2), b.refs, b.out_axes)


@pytest.mark.parametrize("variant", ["sum first", "mul first", "exp output"])
def test_expanded_weight_read_whole_and_beside_the_sharded_axis(variant: str) -> None:
    """An expanded replicated weight read whole (by a reduction, as an output) and beside x's shards."""
    # Was a KilnError from a stage ("T5 axis 1 and its input T4 (T5 = reduce_sum(T4)): sizes 2 and 4
    # must be equal") whenever the whole read came first: the weight was made slice by slice for
    # the later read under the earlier one.
    d = 2
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        e = fd.define_tensor([-1])
        u = fd.ops.broadcast_in_dim(e, shape=[fd.ops.size(x, 0), fd.ops.size(x, 1)], broadcast_dims=[0])
        if variant == "exp output":
            fd.add_output(fd.ops.exp(u))
            fd.add_output(fd.ops.mul(u, x))
        else:
            s = fd.ops.sum(u, [1], keepdim=True) if variant == "sum first" else None
            p = fd.ops.mul(u, x)
            s = fd.ops.sum(u, [1], keepdim=True) if s is None else s
            fd.add_output(fd.ops.add(p, s))
    shard(x, 1, mesh)
    xs = np.arange(8, dtype=np.float32).reshape(2, 4)
    es = np.array([1.0, 10.0], np.float32)
    uu = np.broadcast_to(es[:, None], xs.shape)
    outs = simulate(fd, [[part(xs, 1, r, d), es] for r in range(d)])
    got = np.concatenate([o[-1] for o in outs], axis=1)
    if variant == "exp output":
        np.testing.assert_allclose(got, uu * xs)
        for o in outs:  # whole on every rank, or this rank's slice of it
            want = np.exp(uu) if o[0].shape == xs.shape else np.exp(uu[:, :2])
            np.testing.assert_allclose(o[0], want, rtol=1e-6)
    else:
        np.testing.assert_allclose(got, uu * xs + uu.sum(1, keepdims=True))


def test_reduce_scatter_with_a_whole_weight_and_a_second_output() -> None:
    """A max over the sharded axis scattered on a kept axis, after a whole weight; an intermediate output."""
    case = Case(d=3, shape=(6, 3, 2), axis=1, extras=(Extra((0, 1), False, whole=True), Extra((1,), True)),
                steps=(("binary", "mul", 0, True, "size"),
                       ("reduce", "logsumexp", (1,), "keepdim", "sub", True),
                       ("binary", "add", 1, False, "implicit")),
                final=Final("max", (1, 2), ("shard", 0), ("unary", "tanh"), False), out_repl=False, seed=3,
                also_out=1)
    b = build(case)
    assert b.out_axes == [0, 1]
    check_ranks(run_ranks(b, 3), b.refs, b.out_axes)


def test_split_by_other_than_the_mesh_size_is_a_kiln_error() -> None:
    """An outer split by 3 of a tensor on a 2-device mesh: the factor must be the mesh size."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.neg(x))
    x.set_device_mesh(DeviceMesh([0, 1]))
    with pytest.raises(KilnError, match=r"T0: an outer split .* its factor must be 2, got 3"):
        x.split(1, 3, inner_split=False)


def test_didx_without_a_mesh_is_a_kiln_error() -> None:
    """Parallelizing over DIDx a tensor that is on no mesh: a KilnError."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.neg(x))
    with pytest.raises(KilnError, match=r"T0: DIDx needs a device mesh"):
        x.axis(0).parallelize(ParallelType.DIDx)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_simulate_wants_one_input_list_per_rank(n: int) -> None:
    """``simulate`` of a 2-device fusion given other than two rank input lists: a KilnError."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [1]))
    shard(x, 1, mesh)
    with pytest.raises(KilnError, match=rf"the fusion's mesh is DeviceMesh\(\[0, 1\]\); pass one input list "
                                        rf"per rank \(2\), got {n}"):
        simulate(fd, [[np.ones((2, 2), np.float32)]] * n)
