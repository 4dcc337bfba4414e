"""Element-wise fusions of one output shape take one kernel, whatever their DAG: operands
broadcast along either axis and read by several ops that feed different outputs (an
operand reused by two outputs of the full size), outputs read again by later ops, and
concatenations of an input with a computed tensor. Such fusions used to be split in two
where the pointwise schedule placed a shared broadcast in the loops of one output only, or
a vectorized copy of an input closed the loop another operand of a ``where`` had opened.
Checked against NumPy in float64 through the CPU interpreter."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

TOL = dict(rtol=1e-5, atol=1e-5)

BINARY = ["add", "sub", "mul", "maximum", "where"]
UNARY = ["neg", "exp", "half_round_trip"]


@st.composite
def _dags(draw: Any) -> Dict[str, Any]:
    """A random element-wise DAG over a full [M, N] input, a second full input, a row vector
    [N] and a column vector [M] (each broadcast), with 1 to 4 outputs among its full-size
    nodes."""
    nodes: List[tuple] = []
    # Node kinds: ("in", name) leaves; ("un", op, a); ("bin", op, a, b).
    leaves = ["x", "y", "row", "col"]
    for name in leaves:
        nodes.append(("in", name))
    for _ in range(draw(st.integers(2, 9))):
        if draw(st.booleans()):
            op = draw(st.sampled_from(BINARY))
            a = draw(st.integers(0, len(nodes) - 1))
            b = draw(st.integers(0, len(nodes) - 1))
            nodes.append(("bin", op, a, b))
        else:
            nodes.append(("un", draw(st.sampled_from(UNARY)), draw(st.integers(0, len(nodes) - 1))))
    return dict(
        nodes=nodes,
        m=draw(st.sampled_from([1, 3, 7, 130])),
        n=draw(st.sampled_from([1, 5, 8, 33])),
        picks=draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=4)),
    )


def _full(nodes: List[tuple], i: int, memo: Dict[int, bool]) -> bool:
    """True when node ``i`` reads a full [M, N] input (so it has the outputs' shape)."""
    if i not in memo:
        k = nodes[i]
        memo[i] = (k[1] in ("x", "y")) if k[0] == "in" else any(_full(nodes, j, memo) for j in k[2:])
    return memo[i]


@settings(max_examples=120, deadline=None)
@given(_dags())
def test_elementwise_dags_take_one_kernel(p: Dict[str, Any]) -> None:
    """Any element-wise DAG whose outputs share one shape runs as one kernel and gives
    NumPy's values."""
    nodes, m, n = p["nodes"], p["m"], p["n"]
    memo: Dict[int, bool] = {}
    full = [i for i in range(len(nodes)) if _full(nodes, i, memo) and nodes[i][0] != "in"]
    if not full:
        return
    outs = sorted({full[k % len(full)] for k in p["picks"]})
    rng = np.random.default_rng(m * 100 + n)
    arrays = {
        "x": rng.standard_normal((m, n)).astype(np.float32),
        "y": rng.standard_normal((m, n)).astype(np.float32),
        "row": rng.standard_normal(n).astype(np.float32),
        "col": rng.standard_normal(m).astype(np.float32),
    }
    with FusionDefinition() as fd:
        ins = {
            "x": fd.define_tensor([-1, -1], DataType.Float),
            "y": fd.define_tensor([-1, -1], DataType.Float),
            "row": fd.define_tensor([-1], DataType.Float),
            "col": fd.define_tensor([-1], DataType.Float),
        }
        made: List[Any] = []
        for k in nodes:
            if k[0] == "in":
                t = ins[k[1]]
                if k[1] == "row":
                    t = fd.ops.broadcast_in_dim(t, [-1, -1], [1])
                elif k[1] == "col":
                    t = fd.ops.broadcast_in_dim(t, [-1, -1], [0])
                made.append(t)
            elif k[0] == "un":
                a = made[k[2]]
                if k[1] == "half_round_trip":
                    made.append(fd.ops.cast(fd.ops.cast(a, DataType.Half), DataType.Float))
                elif k[1] == "exp":
                    made.append(fd.ops.exp(fd.ops.mul(a, 0.1)))
                else:
                    made.append(fd.ops.neg(a))
            else:
                a, b = made[k[2]], made[k[3]]
                if k[1] == "where":
                    made.append(fd.ops.where(fd.ops.gt(a, b), a, b))
                else:
                    made.append(getattr(fd.ops, k[1])(a, b))
        for i in outs:
            fd.add_output(made[i])
    order = [arrays[k] for k in ("x", "y", "row", "col")]
    assert len(fd.lower(order).kernels) == 1
    got = fd.execute(order)

    ref: List[np.ndarray] = []
    f64 = {k: v.astype(np.float64) for k, v in arrays.items()}
    for k in nodes:
        if k[0] == "in":
            v = f64[k[1]]
            ref.append(v[None, :] if k[1] == "row" else v[:, None] if k[1] == "col" else v)
        elif k[0] == "un":
            a = ref[k[2]]
            if k[1] == "half_round_trip":
                ref.append(a.astype(np.float16).astype(np.float64))
            elif k[1] == "exp":
                ref.append(np.exp(a * 0.1))
            else:
                ref.append(-a)
        else:
            a, b = ref[k[2]], ref[k[3]]
            ref.append({"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
                        "where": np.maximum}[k[1]](a, b))
    for g, i in zip(got, outs):
        want = np.broadcast_to(ref[i], (m, n))
        # A half round trip of a float32 value may round the other way than of its float64
        # reference: compare at half's precision where one was taken.
        tol = dict(rtol=2e-3, atol=2e-3) if "half_round_trip" in str(nodes) else TOL
        np.testing.assert_allclose(g, want, **tol)


@st.composite
def _chains(draw: Any) -> Dict[str, Any]:
    """Element-wise ops over three full inputs of one rank where most intermediates are also
    outputs that later ops read (an optimizer step's ``v``, ``v_max`` and parameter)."""
    ops: List[tuple] = []
    for i in range(draw(st.integers(2, 7))):
        avail = 3 + i
        ops.append((draw(st.sampled_from(["add", "mul", "div", "maximum"])),
                    draw(st.integers(0, avail - 1)), draw(st.integers(0, avail - 1))))
    return dict(ops=ops, outs=draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops))),
                shape=draw(st.sampled_from([(1,), (2049,), (3, 5), (7, 130), (2, 3, 4)])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None)
@given(_chains())
def test_dags_reading_their_outputs_take_one_kernel(p: Dict[str, Any]) -> None:
    """Outputs read again by later ops, inputs read at both ends of a chain of outputs: one
    kernel, NumPy's values."""
    ops, shape = p["ops"], p["shape"]
    rng = np.random.default_rng(p["seed"])
    arrays = [(rng.random(shape) + 0.5).astype(np.float32) for _ in range(3)]
    np_ops = {"add": np.add, "mul": np.multiply, "div": np.divide, "maximum": np.maximum}
    with FusionDefinition() as fd:
        made: List[Any] = [fd.define_tensor([-1] * len(shape), DataType.Float) for _ in range(3)]
        for op, a, b in ops:
            made.append(getattr(fd.ops, op)(made[a], made[b]))
        outs = [3 + i for i, o in enumerate(p["outs"]) if o] + [len(made) - 1]
        outs = sorted(set(outs))
        for i in outs:
            fd.add_output(made[i])
    assert len(fd.lower(arrays).kernels) == 1
    got = fd.execute(arrays)
    ref = [a.astype(np.float64) for a in arrays]
    for op, a, b in ops:
        ref.append(np_ops[op](ref[a], ref[b]))
    for g, i in zip(got, outs):
        np.testing.assert_allclose(g, ref[i], rtol=1e-5)


@pytest.mark.gpu
def test_chained_outputs_on_gpu() -> None:
    """Adam's amsgrad shape, ``v2 = v + g``, ``m2 = max(m, v2)``, ``g / m2``, all outputs."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    rng = np.random.default_rng(5)
    g, v, m = ((rng.random(10_000_019) + 0.5).astype(np.float32) for _ in range(3))
    with FusionDefinition() as fd:
        gt, vt, mt = (fd.define_tensor([-1], DataType.Float) for _ in range(3))
        v2 = fd.ops.add(vt, gt)
        m2 = fd.ops.maximum(mt, v2)
        fd.add_output(fd.ops.div(gt, m2))
        fd.add_output(v2)
        fd.add_output(m2)
    assert len(fd.lower([g, v, m]).kernels) == 1
    outs = [cp.asnumpy(o) for o in fd.execute([cp.asarray(a) for a in (g, v, m)])]
    g64, v64, m64 = (a.astype(np.float64) for a in (g, v, m))
    want_m = np.maximum(m64, v64 + g64)
    for got, want in zip(outs, [g64 / want_m, v64 + g64, want_m]):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_shared_bias_two_outputs() -> None:
    """``r = a + b`` and ``r * b`` as outputs, ``b`` broadcast over rows: one kernel."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = (rng.random(7) + 0.5).astype(np.float32)
    with FusionDefinition() as fd:
        at, bt = fd.define_tensor([-1, -1], DataType.Float), fd.define_tensor([-1], DataType.Float)
        bb = fd.ops.broadcast_in_dim(bt, [-1, -1], [1])
        r = fd.ops.add(at, bb)
        fd.add_output(fd.ops.mul(r, bb))
        fd.add_output(r)
    assert len(fd.lower([a, b]).kernels) == 1
    y, r = fd.execute([a, b])
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(r, a64 + b64, **TOL)
    np.testing.assert_allclose(y, (a64 + b64) * b64, **TOL)


def test_floor_division_family_one_kernel() -> None:
    """torch's integer ``remainder``, floor division written as ``(a - remainder(a, b)) / b``,
    ``fmod`` and truncating division by a broadcast divisor, as four outputs: one kernel."""
    rng = np.random.default_rng(1)
    a = rng.integers(-50, 50, (5, 7)).astype(np.int64)
    b = np.array([3, -4, 7, -2, 5, 1, -9], np.int64)
    with FusionDefinition() as fd:
        at, bt = fd.define_tensor([-1, -1], DataType.Int), fd.define_tensor([-1], DataType.Int)
        bb = fd.ops.broadcast_in_dim(bt, [-1, -1], [1])
        rem = fd.ops.remainder(at, bb)
        fd.add_output(rem)
        fd.add_output(fd.ops.div(fd.ops.sub(at, rem), bb))
        fd.add_output(fd.ops.fmod(at, bb))
        fd.add_output(fd.ops.div(at, bb))
    assert len(fd.lower([a, b]).kernels) == 1
    outs = fd.execute([a, b])
    wants = [np.remainder(a, b), np.floor_divide(a, b), np.fmod(a, b), np.trunc(a / b).astype(np.int64)]
    for g, w in zip(outs, wants):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("computed", ["second", "first", "both"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 1), (130, 33, 9)])
def test_cat_of_input_and_computed(computed: str, shape: tuple) -> None:
    """``cat([x, 2 * y], 1)`` (an input beside a computed tensor, either order): one kernel."""
    m, n1, n2 = shape
    rng = np.random.default_rng(m + n1)
    x = rng.standard_normal((m, n1)).astype(np.float32)
    y = rng.standard_normal((m, n2)).astype(np.float32)
    with FusionDefinition() as fd:
        xt, yt = fd.define_tensor([-1, -1], DataType.Float), fd.define_tensor([-1, -1], DataType.Float)
        first = fd.ops.mul(xt, 3.0) if computed in ("first", "both") else xt
        second = fd.ops.mul(yt, 2.0) if computed in ("second", "both") else yt
        fd.add_output(fd.ops.cat([first, second], 1))
    assert len(fd.lower([x, y]).kernels) == 1
    (got,) = fd.execute([x, y])
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    want = np.concatenate([x64 * (3.0 if computed in ("first", "both") else 1.0),
                           y64 * (2.0 if computed in ("second", "both") else 1.0)], 1)
    np.testing.assert_allclose(got, want, **TOL)


def test_preemphasis_one_kernel() -> None:
    """Audio pre-emphasis ``cat([x[:, :1], x[:, 1:] - 0.97 * x[:, :-1]], 1)``: one kernel."""
    x = np.random.default_rng(2).standard_normal((3, 301)).astype(np.float32)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([-1, -1], DataType.Float)
        n = fd.ops.size(xt, 1)
        head = fd.ops.slice(xt, [0, 0], [None, 1])
        rest = fd.ops.sub(fd.ops.slice(xt, [0, 1], [None, None]),
                          fd.ops.mul(fd.ops.slice(xt, [0, 0], [None, fd.ops.sub(n, 1)]), 0.97))
        fd.add_output(fd.ops.cat([head, rest], 1))
    assert len(fd.lower([x]).kernels) == 1
    (got,) = fd.execute([x])
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got, np.concatenate([x64[:, :1], x64[:, 1:] - 0.97 * x64[:, :-1]], 1), **TOL)


def _gpu_cases() -> List[tuple]:
    """(name, builder, inputs, reference) of the fusions above at sizes that fill a GPU."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((513, 1031)).astype(np.float32)
    b = (rng.random(1031) + 0.5).astype(np.float32)
    y = rng.standard_normal((513, 77)).astype(np.float32)

    def shared_bias(fd: FusionDefinition) -> None:
        at, bt = fd.define_tensor([-1, -1], DataType.Float), fd.define_tensor([-1], DataType.Float)
        bb = fd.ops.broadcast_in_dim(bt, [-1, -1], [1])
        r = fd.ops.add(at, bb)
        fd.add_output(fd.ops.mul(r, bb))
        fd.add_output(r)

    def cat_computed(fd: FusionDefinition) -> None:
        xt, yt = fd.define_tensor([-1, -1], DataType.Float), fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.cat([xt, fd.ops.mul(yt, 2.0)], 1))

    def unrelated(fd: FusionDefinition) -> None:
        xt, yt = fd.define_tensor([-1, -1], DataType.Float), fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.neg(xt))
        fd.add_output(fd.ops.exp(yt))
        fd.add_output(fd.ops.mul(xt, 3.0))

    a64, b64, y64 = a.astype(np.float64), b.astype(np.float64), y.astype(np.float64)
    return [
        ("shared_bias", shared_bias, [a, b], [(a64 + b64) * b64, a64 + b64]),
        ("cat_computed", cat_computed, [a, y], [np.concatenate([a64, 2 * y64], 1)]),
        ("unrelated_sizes", unrelated, [a, a[:, ::-1].copy()], [-a64, np.exp(a64[:, ::-1]), 3 * a64]),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(3), ids=["shared_bias", "cat_computed", "unrelated_sizes"])
def test_dags_on_gpu(case: int) -> None:
    """The fusions above on the GPU, one kernel each, against NumPy."""
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    _name, build, arrays, wants = _gpu_cases()[case]
    with FusionDefinition() as fd:
        build(fd)
    assert len(fd.lower(arrays).kernels) == 1
    outs = fd.execute([cp.asarray(x) for x in arrays])
    for got, want in zip(outs, wants):
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-5)


def test_timestep_embedding_vectorizes_by_element_size() -> None:
    """DDPM's sinusoidal timestep embedding, ``cat([sin(t[:, None] * f), cos(...)], 1)`` with
    ``f = 1 / 10000 ** (arange(0, D, 2) / D)``: the int64 positions beside float data load
    element by element instead of failing a 32-byte vector (two kernels, was three: the
    positions themselves are computed once)."""
    t = (np.random.default_rng(3).random(7) * 1000).astype(np.float32)
    with FusionDefinition() as fd:
        tt = fd.define_tensor([-1], DataType.Float)
        e = fd.ops.div(fd.ops.cast(fd.ops.iota(10, 0, 2), DataType.Float), 20.0)
        fr = fd.ops.reciprocal(fd.ops.pow(10000.0, e))
        a = fd.ops.mul(fd.ops.broadcast_in_dim(tt, [-1, -1], [0]), fd.ops.broadcast_in_dim(fr, [-1, -1], [1]))
        fd.add_output(fd.ops.cat([fd.ops.sin(a), fd.ops.cos(a)], 1))
    assert len(fd.lower([t]).kernels) <= 2
    (got,) = fd.execute([t])
    a64 = t.astype(np.float64)[:, None] / 10000 ** (np.arange(0, 20, 2) / 20)
    np.testing.assert_allclose(got, np.concatenate([np.sin(a64), np.cos(a64)], 1), rtol=1e-4, atol=2e-3)
