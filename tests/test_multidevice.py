"""Sharded fusions on the CPU: host programs with their collectives, and simulated N-rank
runs (interpreter kernels, collectives in NumPy) against the unsharded NumPy result."""

from __future__ import annotations

import re
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np
import pytest
from kiln import DataType, DeviceMesh, FusionDefinition, KilnError, ParallelType
from kiln.multidevice import LocalCommunicator, simulate

RNG = np.random.default_rng(7)


def shard(t: Any, axis: int, mesh: DeviceMesh) -> None:
    """Put ``t`` on ``mesh`` and shard logical axis ``axis`` over DIDx (nvFuser's recipe)."""
    t.set_device_mesh(mesh)
    t.split(axis, mesh.size, inner_split=False)
    t.axis(axis).parallelize(ParallelType.DIDx)


def part(a: np.ndarray, axis: int, r: int, d: int) -> np.ndarray:
    """Rank ``r``'s slice of ``a`` along ``axis`` on a mesh of ``d``."""
    return np.ascontiguousarray(np.split(a, d, axis=axis)[r])


def row_sum(mesh: DeviceMesh) -> Tuple[FusionDefinition, Any]:
    """``sum(x, [1])`` with x's axis 1 sharded."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, [1]))
    shard(x, 1, mesh)
    return fd, x


def layer_norm(mesh: DeviceMesh) -> FusionDefinition:
    """LayerNorm over a sharded hidden axis, written as models write it (``mean`` of the
    global size), with sharded weight and bias."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        b = fd.define_tensor([-1])
        mean = fd.ops.mean(x, [1], keepdim=True)
        xc = fd.ops.sub(x, mean)
        var = fd.ops.mean(fd.ops.mul(xc, xc), [1], keepdim=True)
        y = fd.ops.mul(xc, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        shape = [fd.ops.size(x, 0), fd.ops.size(x, 1)]
        y = fd.ops.add(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, shape=shape, broadcast_dims=[1])),
                       fd.ops.broadcast_in_dim(b, shape=shape, broadcast_dims=[1]))
        fd.add_output(y)
    for t, axis in ((x, 1), (w, 0), (b, 0)):
        shard(t, axis, mesh)
    return fd


def layer_norm_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Float64 LayerNorm."""
    x = x.astype(np.float64)
    mu = x.mean(1, keepdims=True)
    var = ((x - mu) ** 2).mean(1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def adamw_ddp(mesh: DeviceMesh, lr: float = 1e-3, wd: float = 1e-2) -> FusionDefinition:
    """Data-parallel step: each rank's gradient (a [1, P] slice of [d, P]) is averaged over
    the mesh, then a fused AdamW update of replicated parameters and moments."""
    d = mesh.size
    with FusionDefinition() as fd:
        g = fd.define_tensor([-1, -1])
        p = fd.define_tensor([-1])
        m = fd.define_tensor([-1])
        v = fd.define_tensor([-1])
        gs = fd.ops.mul(fd.ops.sum(g, [0]), 1.0 / d)
        m2 = fd.ops.add(fd.ops.mul(m, 0.9), fd.ops.mul(gs, 0.1))
        v2 = fd.ops.add(fd.ops.mul(v, 0.999), fd.ops.mul(fd.ops.mul(gs, gs), 0.001))
        step = fd.ops.div(m2, fd.ops.add(fd.ops.sqrt(v2), 1e-8))
        p2 = fd.ops.sub(fd.ops.mul(p, 1.0 - lr * wd), fd.ops.mul(step, lr))
        fd.add_output(p2)
        fd.add_output(m2)
        fd.add_output(v2)
    shard(g, 0, mesh)
    return fd


def adamw_ref(g: np.ndarray, p: np.ndarray, m: np.ndarray, v: np.ndarray,
              lr: float = 1e-3, wd: float = 1e-2) -> List[np.ndarray]:
    """Float64 reference of ``adamw_ddp``."""
    gs = g.astype(np.float64).mean(0)
    m2 = 0.9 * m + 0.1 * gs
    v2 = 0.999 * v + 0.001 * gs * gs
    return [p * (1 - lr * wd) - lr * m2 / (np.sqrt(v2) + 1e-8), m2, v2]


def instructions(text: str) -> List[str]:
    """The top-level instruction lines of a mesh program's text (stage bodies dropped)."""
    return [ln.strip() for ln in text.splitlines()[1:] if ln.startswith("  ") and not ln.startswith("    ")]


def check_lifetimes(text: str) -> None:
    """No tensor is used after its Deallocate, and each is deallocated once."""
    freed: set = set()
    for line in instructions(text):
        names = set(re.findall(r"\bT\d+\b", line))
        if line.startswith("Deallocate"):
            (t,) = names
            assert t not in freed, f"{t} deallocated twice"
            freed.add(t)
        else:
            assert not names & freed, f"{line!r} uses a deallocated tensor {names & freed}"


# -- host programs ------------------------------------------------------------------------


def test_row_sum_over_sharded_axis_is_local_sum_then_allreduce() -> None:
    """A sum over the sharded axis: a local reduction, an in-place Allreduce, a Wait."""
    mesh = DeviceMesh([0, 1])
    fd, _ = row_sum(mesh)
    text = fd.lower([np.zeros((6, 4), np.float32)]).host_program
    ins = instructions(text)
    assert text.startswith("MeshProgram(T0) -> (T2) over mesh [0, 1]: 1 stage(s), 1 communication(s)")
    assert ins[0] == "Stage 0(T0) -> (T1):"
    assert ins[1] == "Allreduce T1 -> T2 over mesh [0, 1] (sum, in place) on the communication stream"
    assert ins[2] == "Wait T2"
    assert "LaunchKernel" in text
    check_lifetimes(text)


def test_layer_norm_over_sharded_hidden_axis_has_two_allreduces() -> None:
    """LayerNorm over a sharded hidden axis: the mean's and the variance's Allreduce, each
    waited for before the stage that reads it; the weights' broadcasts join the last kernel."""
    mesh = DeviceMesh([0, 1])
    fd = layer_norm(mesh)
    low = fd.lower([np.zeros((4, 8), np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32)])
    ins = instructions(low.host_program)
    comms = [i for i in ins if i.startswith("Allreduce")]
    assert len(comms) == 2 and all("(sum, in place)" in c for c in comms)
    assert sum(i.startswith("Stage") for i in ins) == 3
    for c in comms:
        out = c.split()[3]
        assert ins.index(f"Wait {out}") > ins.index(c)
    assert len(low.kernels) == 3
    check_lifetimes(low.host_program)
    assert "T0 (axis 1 sharded over DIDx)" in low.sharding


def test_gradient_allreduce_then_fused_adamw() -> None:
    """Data-parallel AdamW: one Allreduce of the gradient, then one fused update kernel."""
    mesh = DeviceMesh([0, 1])
    fd = adamw_ddp(mesh)
    low = fd.lower([np.zeros((1, 64), np.float32)] + [np.zeros(64, np.float32)] * 3)
    ins = instructions(low.host_program)
    assert [i.split()[0] for i in ins if not i.startswith(("Deallocate", "Stage"))] == \
        ["Allreduce", "Wait"]
    assert len(low.stages) == 2 and len(low.stages[1].kernels) == 1
    check_lifetimes(low.host_program)


def test_allgather_buffer_is_allocated_and_freed_after_its_last_use() -> None:
    """An output declared replicated is gathered into a buffer the program allocates; the
    gathered slices are put in place by the next stage, then the buffer is freed."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    shard(x, 1, mesh)
    y.set_device_mesh(mesh)
    text = fd.lower([np.zeros((3, 4), np.float32)]).host_program
    ins = instructions(text)
    alloc = next(i for i in ins if i.startswith("Allocate"))
    gather = next(i for i in ins if i.startswith("Allgather"))
    assert alloc.startswith("Allocate T2 [2, i0, i1] float")
    assert gather.startswith("Allgather T1 -> T2 over mesh [0, 1]")
    assert ins.index(alloc) < ins.index(gather) < ins.index("Wait T2") < ins.index("Deallocate T2")
    check_lifetimes(text)


def test_sum_into_sharded_output_is_reduce_scatter() -> None:
    """A sum over the sharded axis into an output sharded on a kept axis: ReduceScatter."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        s = fd.ops.sum(x, [0])
        fd.add_output(s)
    shard(x, 0, mesh)
    shard(s, 1, mesh)
    text = fd.lower([np.zeros((1, 4, 3), np.float32)]).host_program
    assert re.search(r"ReduceScatter T\d+ -> T\d+ over mesh \[0, 1\] \(sum, scatters axis 0 of T1\)", text)
    check_lifetimes(text)


# -- simulated ranks ----------------------------------------------------------------------


def run_ranks(fd: FusionDefinition, d: int, inputs: Sequence[np.ndarray],
              axes: Sequence[int | None]) -> List[List[np.ndarray]]:
    """Simulate ``d`` ranks, slicing input ``i`` along ``axes[i]`` (None: replicated)."""
    per = [[x if a is None else part(x, a, r, d) for x, a in zip(inputs, axes)] for r in range(d)]
    return simulate(fd, per)


MESHES = [1, 2, 3, 4]


@pytest.mark.parametrize("d", MESHES)
def test_simulated_row_sum(d: int) -> None:
    """Row sum over a sharded axis: every rank holds the whole sum."""
    fd, _ = row_sum(DeviceMesh(range(d)))
    x = RNG.standard_normal((5, 3 * d)).astype(np.float32)
    for outs in run_ranks(fd, d, [x], [1]):
        np.testing.assert_allclose(outs[0], x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_layer_norm(d: int) -> None:
    """LayerNorm over a sharded hidden axis: rank r holds slice r of the normalized rows."""
    fd = layer_norm(DeviceMesh(range(d)))
    x = RNG.standard_normal((6, 4 * d)).astype(np.float32) * 3 + 1
    w = RNG.standard_normal(4 * d).astype(np.float32)
    b = RNG.standard_normal(4 * d).astype(np.float32)
    outs = run_ranks(fd, d, [x, w, b], [1, 0, 0])
    got = np.concatenate([o[0] for o in outs], axis=1)
    np.testing.assert_allclose(got, layer_norm_ref(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_adamw_after_gradient_allreduce(d: int) -> None:
    """Data-parallel AdamW: every rank ends with the same update of the averaged gradient."""
    fd = adamw_ddp(DeviceMesh(range(d)))
    n = 1000
    g = RNG.standard_normal((d, n)).astype(np.float32)
    p, m = (RNG.standard_normal(n).astype(np.float32) for _ in range(2))
    v = RNG.random(n).astype(np.float32)
    ref = adamw_ref(g, p, m, v)
    for outs in run_ranks(fd, d, [g, p, m, v], [0, None, None, None]):
        for got, want in zip(outs, ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_softmax_over_sharded_axis(d: int) -> None:
    """Softmax over a sharded axis: a max Allreduce, then a sum Allreduce."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, [1], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)))
    shard(x, 1, mesh)
    x = (RNG.standard_normal((4, 5 * d)) * 4).astype(np.float32)
    outs = run_ranks(fd, d, [x], [1])
    got = np.concatenate([o[0] for o in outs], axis=1)
    x64 = x.astype(np.float64)
    ref = np.exp(x64 - x64.max(1, keepdims=True))
    np.testing.assert_allclose(got, ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    if d > 1:
        text = fd.lower([part(x, 1, 0, d)]).host_program
        assert "(max, in place)" in text and "(sum, in place)" in text


@pytest.mark.parametrize("d", MESHES)
@pytest.mark.parametrize("axis", [0, 1])
def test_simulated_allgather_of_output(d: int, axis: int) -> None:
    """A sharded result declared replicated is gathered in mesh order on every rank."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.tanh(x)
        fd.add_output(y)
    shard(x, axis, mesh)
    y.set_device_mesh(mesh)
    x = RNG.standard_normal((2 * d, 3 * d)).astype(np.float32)
    for outs in run_ranks(fd, d, [x], [axis]):
        np.testing.assert_allclose(outs[0], np.tanh(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_gather_before_reshape_of_sharded_axis(d: int) -> None:
    """A reshape reads its input whole: a sharded input is gathered first."""
    mesh = DeviceMesh(range(d))
    rows, cols = 2 * d, 3
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.exp(fd.ops.reshape(x, [rows * cols])))
    shard(x, 0, mesh)
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    for outs in run_ranks(fd, d, [x], [0]):
        np.testing.assert_allclose(outs[0], np.exp(x.astype(np.float64)).reshape(-1), rtol=1e-5)


@pytest.mark.parametrize("d", MESHES)
@pytest.mark.parametrize("out_axis", [1, 2])
def test_simulated_reduce_scatter(d: int, out_axis: int) -> None:
    """Sequence-parallel sum: rank r holds slice r of the sum along the scattered axis."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        s = fd.ops.sum(x, [0])
        fd.add_output(fd.ops.mul(s, 0.5))
    shard(x, 0, mesh)
    shard(s, out_axis, mesh)
    x = RNG.standard_normal((2 * d, 2 * d, 3 * d)).astype(np.float32)
    outs = run_ranks(fd, d, [x], [0])
    got = np.concatenate([o[0] for o in outs], axis=out_axis - 1)
    np.testing.assert_allclose(got, 0.5 * x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_reduce_scatter_of_an_uneven_axis_is_a_kiln_error() -> None:
    """A scattered axis must split evenly over the mesh; the error names tensor and axis."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.ops.sum(x, [0])
        fd.add_output(s)
    shard(x, 0, mesh)
    shard(s, 1, mesh)
    x = np.ones((2, 5), np.float32)
    with pytest.raises(KilnError, match=r"T1: axis 0 has 5 elements, which do not split evenly over the 2"):
        run_ranks(fd, 2, [x], [0])


@pytest.mark.parametrize("d", MESHES)
@pytest.mark.parametrize("op", ["mean", "logsumexp", "var"])
def test_simulated_statistic_over_sharded_axis_into_sharded_output(d: int, op: str) -> None:
    """A mean, logsumexp or variance over the sharded axis, declared sharded on a kept axis: the
    statistic is finished on every rank (an Allreduce, or gathered partial results) and each rank
    keeps its slice of it."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = getattr(fd.ops, op)(x, [1])
        fd.add_output(s)
    shard(x, 1, mesh)
    shard(s, 0, mesh)
    x = RNG.standard_normal((4 * d, 3 * d)).astype(np.float32)
    x64 = x.astype(np.float64)
    m = x64.max(1, keepdims=True)
    want = {"mean": x64.mean(1), "var": x64.var(1, ddof=1),
            "logsumexp": (m + np.log(np.exp(x64 - m).sum(1, keepdims=True)))[:, 0]}[op]
    outs = run_ranks(fd, d, [x], [1])
    for r, o in enumerate(outs):
        np.testing.assert_allclose(o[0], part(want, 0, r, d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_replicated_value_into_sharded_output(d: int) -> None:
    """A value computed whole on every rank (from replicated inputs) declared sharded: each rank
    keeps its slice, with no collective, and readers inside the fusion read that slice."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.tanh(x)
        fd.add_output(fd.ops.sum(y, [1]))  # a reader of the slice: a sum of this rank's rows
    shard(y, 0, mesh)
    x = RNG.standard_normal((2 * d, 5)).astype(np.float32)
    if d == 2:
        text = fd.lower([x]).host_program
        assert "Allreduce" not in text and "Allgather" not in text, text
    want = np.tanh(x.astype(np.float64)).sum(1)
    for r, o in enumerate(run_ranks(fd, d, [x], [None])):
        np.testing.assert_allclose(o[0], part(want, 0, r, d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", MESHES)
def test_simulated_sharding_moved_to_another_axis(d: int) -> None:
    """x sharded on axis 0, its exp declared sharded on axis 1: an Allgather, then each rank
    keeps its slice along axis 1."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    shard(x, 0, mesh)
    shard(y, 1, mesh)
    x = RNG.standard_normal((2 * d, 3 * d)).astype(np.float32)
    if d == 2:
        assert "Allgather" in fd.lower([part(x, 0, 0, d)]).host_program
    want = np.exp(x.astype(np.float64))
    for r, o in enumerate(run_ranks(fd, d, [x], [0])):
        np.testing.assert_allclose(o[0], part(want, 1, r, d), rtol=1e-5, atol=1e-6)


def test_sharded_output_of_an_uneven_whole_value_is_a_kiln_error() -> None:
    """A whole value declared sharded on an axis the mesh does not divide: a KilnError naming it."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.tanh(x)
        fd.add_output(y)
    shard(y, 0, mesh)
    with pytest.raises(KilnError, match=r"T1 is declared sharded on axis 0: that axis must split evenly"):
        run_ranks(fd, 2, [np.ones((3, 4), np.float32)], [None])


def test_one_device_mesh_runs_without_a_process_group() -> None:
    """A mesh of one device runs through ``fd.execute`` with the local communicator."""
    fd = layer_norm(DeviceMesh([0]))
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    w, b = RNG.standard_normal(8).astype(np.float32), RNG.standard_normal(8).astype(np.float32)
    (y,) = fd.execute([x, w, b])
    np.testing.assert_allclose(y, layer_norm_ref(x, w, b), rtol=1e-4, atol=1e-4)
    (y,) = fd.execute([x, w, b], comm=LocalCommunicator())
    np.testing.assert_allclose(y, layer_norm_ref(x, w, b), rtol=1e-4, atol=1e-4)


# -- errors ---------------------------------------------------------------------------------


def expect_error(build: Callable[[], Any], match: str) -> None:
    """``build()`` raises a KilnError matching ``match``."""
    with pytest.raises(KilnError, match=match):
        build()


def test_ops_on_differently_sharded_inputs_name_both() -> None:
    """Two inputs of one op sharded on different axes: a KilnError naming both."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(x, y))
    shard(x, 0, mesh)
    shard(y, 1, mesh)
    expect_error(lambda: fd.lower([np.zeros((1, 4), np.float32), np.zeros((2, 2), np.float32)]),
                 r"T2: its inputs are sharded differently: T0 \(axis 0 sharded over DIDx\) and T1 \(axis 1")


@pytest.mark.parametrize("d", [1, 2, 4])
def test_whole_weight_meeting_sharded_axis_is_read_slice_by_slice(d: int) -> None:
    """A replicated weight read beside a sharded axis: each rank reads its own slice of it
    (the rank is a runtime argument of the stage), no collective."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        wb = fd.ops.broadcast_in_dim(w, shape=[fd.ops.size(x, 0), fd.ops.size(x, 1)], broadcast_dims=[1])
        y = fd.ops.mul(x, wb)
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, [1]))
    shard(x, 1, mesh)
    xs = RNG.standard_normal((3, 4 * d)).astype(np.float32)
    ws = RNG.standard_normal(4 * d).astype(np.float32)
    outs = run_ranks(fd, d, [xs, ws], [1, None])
    ref = xs.astype(np.float64) * ws
    np.testing.assert_allclose(np.concatenate([o[0] for o in outs], 1), ref, rtol=1e-6)
    for o in outs:
        np.testing.assert_allclose(o[1], ref.sum(1), rtol=1e-5, atol=1e-5)
    text = fd.lower([part(xs, 1, 0, d), ws]).host_program
    assert text.count("Allreduce") == 1 and "Allgather" not in text
    bad = [[part(xs, 1, r, d), np.ones(4 * d + 1, np.float32)] for r in range(d)]
    with pytest.raises(KilnError, match=r"T1"):
        simulate(fd, bad)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        fd.add_output(fd.ops.add(x, fd.ops.broadcast(w, [True, False])))
    shard(x, 1, mesh)
    outs = run_ranks(fd, d, [xs, ws], [1, None])
    np.testing.assert_allclose(np.concatenate([o[0] for o in outs], 1), xs + ws, rtol=1e-6)
    with pytest.raises(KilnError, match=r"T2 is whole on every device and read beside a sharded axis"):
        simulate(fd, bad)


def test_bad_mesh_schedules_are_kiln_errors() -> None:
    """Wrong split factor, DIDx without a mesh, a split left unparallelized, bad meshes."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.add(x, y))
    x.set_device_mesh(DeviceMesh([0, 1]))
    expect_error(lambda: x.split(1, 3, inner_split=False),
                 r"T0: an outer split .* its factor must be 2, got 3")
    expect_error(lambda: y.axis(0).parallelize(ParallelType.DIDx), r"T1: DIDx needs a device mesh")
    x.split(1, 2, inner_split=False)
    assert x.axis(1).extent == "2"
    expect_error(lambda: fd.lower([np.zeros((2, 2), np.float32)] * 2),
                 r"T0: logical axis 1 was split by the mesh size but its outer part was not parallelized")
    x.axis(1).parallelize(ParallelType.DIDx)
    assert x.axis(1).parallel_type == ParallelType.DIDx
    y.set_device_mesh(DeviceMesh([0, 2]))
    expect_error(lambda: fd.lower([np.zeros((2, 2), np.float32)] * 2), r"a fusion runs on one mesh")
    expect_error(lambda: DeviceMesh([0, 0]), r"listed twice")
    expect_error(lambda: DeviceMesh([]), r"no devices")


def test_sharded_fusion_cannot_also_be_scheduled_by_hand() -> None:
    """A sharded fusion is scheduled automatically; a hand schedule is a KilnError."""
    mesh = DeviceMesh([0, 1])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.exp(x)
        fd.add_output(y)
    shard(x, 1, mesh)
    y.split(0, 4)
    expect_error(lambda: fd.lower([np.zeros((2, 2), np.float32)]), r"scheduled automatically")


def test_multi_rank_execute_needs_a_process_group_and_simulate_checks_ranks() -> None:
    """Without torch.distributed, a 2-device fusion says how to start ranks; simulate
    wants one input list per rank; as_written is refused."""
    fd, _ = row_sum(DeviceMesh([0, 1]))
    x = np.ones((2, 2), np.float32)
    expect_error(lambda: fd.execute([x]), r"start one process per device with torchrun")
    expect_error(lambda: simulate(fd, [[x]]), r"pass one input list per rank \(2\), got 1")
    expect_error(lambda: fd.execute([x], as_written=True), r"a sharded fusion runs per rank")


def test_wrong_local_shapes_are_caught_before_any_stage_runs() -> None:
    """A weight slice that does not match the activation's slice: a KilnError from binding."""
    mesh = DeviceMesh([0, 1])
    fd = layer_norm(mesh)
    x = np.ones((2, 4), np.float32)
    bad = [x, np.ones(4, np.float32), np.ones(3, np.float32)]
    with pytest.raises(KilnError, match=r"T2"):
        simulate(fd, [bad, bad])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_simulated_logsumexp_over_sharded_axis_gathers_partial_results(d: int) -> None:
    """No collective combines log-sum-exps: each rank's partial result is gathered and every
    rank finishes the reduction (vocabulary-parallel cross-entropy's normalizer)."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        lse = fd.ops.logsumexp(x, [1])
        fd.add_output(fd.ops.sub(lse, 1.0))
    shard(x, 1, mesh)
    x = (RNG.standard_normal((3, 5 * d)) * 10).astype(np.float32)
    x64 = x.astype(np.float64)
    m = x64.max(1)
    ref = m + np.log(np.exp(x64 - m[:, None]).sum(1)) - 1.0
    for outs in run_ranks(fd, d, [x], [1]):
        np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-5)
    if d > 1:
        text = fd.lower([part(x, 1, 0, d)]).host_program
        assert "Allgather" in text and "partial results of T1, reduced on every rank" in text
