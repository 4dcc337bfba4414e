"""Automatic schedulers: unscheduled fusions pick a schedule from their shape and sizes.
CPU part: every schedule lowers and compiles (conftest compiles each kernel with NVRTC).
GPU part: results equal NumPy on awkward sizes (1, primes, not multiples of the vector
width, very wide and very tall)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError, MemoryType
from kiln.execute import _auto_lowered

SIZES = [(1, 1), (1, 7), (7, 1), (3, 5), (31, 997), (128, 4096), (1000, 3), (2, 65537), (4099, 13)]


def pointwise() -> Tuple[FusionDefinition, Callable]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.mul(fd.ops.relu(fd.ops.add(fd.ops.mul(x, 1.5), 0.5)), fd.ops.sigmoid(x))
        fd.add_output(y)
    return fd, lambda x: [np.maximum(x * 1.5 + 0.5, 0) / (1 + np.exp(-x))]


def bias_tanh() -> Tuple[FusionDefinition, Callable]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        fd.add_output(fd.ops.tanh(fd.ops.add(x, bb)))
    return fd, lambda x, b: [np.tanh(x + b[None, :])]


def row_scale() -> Tuple[FusionDefinition, Callable]:
    """A per-row scale (broadcast along columns): the 2-D pointwise schedule indexes it by row."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        s = fd.define_tensor([-1])
        ss = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        fd.add_output(fd.ops.add(fd.ops.mul(x, ss), 1.0))
    return fd, lambda x, s: [x * s[:, None] + 1.0]


def reduction(dims: List[int]) -> Callable[[], Tuple[FusionDefinition, Callable]]:
    def build() -> Tuple[FusionDefinition, Callable]:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            fd.add_output(fd.ops.neg(fd.ops.sum(fd.ops.mul(x, 2.0), dims=dims)) if dims != [0, 1]
                          else fd.ops.sum(fd.ops.mul(x, 2.0), dims=dims))
        sign = 1.0 if dims == [0, 1] else -1.0
        return fd, lambda x: [sign * (2.0 * x).sum(axis=tuple(dims))]
    build.__name__ = f"sum{dims}"
    return build


def transpose() -> Tuple[FusionDefinition, Callable]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]))
    return fd, lambda x: [x.T]


BUILDERS = [pointwise, bias_tanh, row_scale, reduction([1]), reduction([0]), reduction([0, 1]), transpose]


def make_inputs(build: Callable, m: int, n: int, xp: Any) -> List[Any]:
    rng = np.random.default_rng(m * 1000 + n)
    arrs = [rng.standard_normal((m, n)).astype(np.float32)]
    if build is bias_tanh:
        arrs.append(rng.standard_normal(n).astype(np.float32))
    if build is row_scale:
        arrs.append(rng.standard_normal(m).astype(np.float32))
    return [xp.asarray(a) for a in arrs]


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", SIZES[:5])
def test_auto_schedule_lowers_and_compiles(build, m, n):
    fd, _ = build()
    k = _auto_lowered(fd, make_inputs(build, m, n, np)).kernels[0]
    assert "kiln_kernel" in k.cuda_source
    assert not fd._core.manually_scheduled, "the user's fusion stays unscheduled"


def softmax() -> Tuple[FusionDefinition, Callable]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))

    def ref(x: np.ndarray) -> List[np.ndarray]:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return [e / e.sum(axis=1, keepdims=True)]
    return fd, ref


def layernorm() -> Tuple[FusionDefinition, Callable]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        b = fd.define_tensor([-1])
        k = fd.define_scalar(dtype=DataType.Double)  # 1 / row length, a runtime scalar
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1], keepdim=True), k)
        xm = fd.ops.sub(x, mean)
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xm, xm), dims=[1], keepdim=True), k)
        y = fd.ops.mul(xm, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        wb = fd.ops.broadcast_in_dim(w, shape=[-1, -1], broadcast_dims=[1])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        fd.add_output(fd.ops.add(fd.ops.mul(y, wb), bb))

    def ref(x: np.ndarray, w: np.ndarray, b: np.ndarray, k: float) -> List[np.ndarray]:
        mu = x.mean(axis=1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
        return [(x - mu) / np.sqrt(var + 1e-5) * w + b]
    return fd, ref


def rmsnorm() -> Tuple[FusionDefinition, Callable]:
    # The reduction reads x * x, the normalization reads x: found as a normalization all the same.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        w = fd.define_tensor([-1])
        k = fd.define_scalar(dtype=DataType.Double)
        ms = fd.ops.mul(fd.ops.sum(fd.ops.mul(x, x), dims=[1], keepdim=True), k)
        y = fd.ops.mul(x, fd.ops.rsqrt(fd.ops.add(ms, 1e-6)))
        fd.add_output(fd.ops.mul(y, fd.ops.broadcast_in_dim(w, shape=[-1, -1], broadcast_dims=[1])))

    def ref(x: np.ndarray, w: np.ndarray, k: float) -> List[np.ndarray]:
        return [x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w]
    return fd, ref


def norm_inputs(build: Callable, m: int, n: int, xp: Any) -> List[Any]:
    rng = np.random.default_rng(m + 7 * n)
    arrs: List[Any] = [xp.asarray(rng.standard_normal((m, n)).astype(np.float32))]
    if build in (layernorm, rmsnorm):
        weights = 2 if build is layernorm else 1
        arrs += [xp.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(weights)]
        arrs.append(1.0 / n)
    return arrs


@pytest.mark.parametrize("build", [softmax, layernorm, rmsnorm], ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", [(1, 1), (3, 7), (5, 100), (2, 4096), (4, 1031)])
def test_normalization_schedule_matches_numpy_in_the_interpreter(build, m, n):
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, ref = build()
    inputs = norm_inputs(build, m, n, np)
    low = _auto_lowered(fd, inputs)
    assert "normalization" in fd._core.auto_scheduled([list(np.shape(a)) for a in inputs
                                                       if not isinstance(a, float)]).heuristic
    (out,) = run_on_cpu(low, inputs, _core.execute_cpu)
    want = ref(*[a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in inputs])[0]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [softmax, layernorm, rmsnorm], ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", [(1, 1), (3, 7), (37, 1000), (128, 4096), (7, 8191)])
def test_normalization_matches_numpy_on_gpu(build, m, n):
    cp = cupy_or_skip()
    fd, ref = build()
    inputs = norm_inputs(build, m, n, cp)
    (out,) = fd.execute(inputs)
    host = [cp.asnumpy(a).astype(np.float64) if not isinstance(a, float) else a for a in inputs]
    np.testing.assert_allclose(cp.asnumpy(out), ref(*host)[0], rtol=1e-4, atol=1e-5)


def test_rows_too_long_for_registers_run_as_loops():
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, ref = softmax()
    x = np.random.default_rng(6).standard_normal((2, 300_000)).astype(np.float32)
    low = _auto_lowered(fd, [x])
    # One kernel, each pass (max, exp + sum, divide) a loop over the row: the row never
    # has to fit in registers.
    assert len(low.kernels) == 1
    assert fd._core.auto_program([[2, 300_000]]).heuristic == "looped_normalization"
    (out,) = run_on_cpu(low, [x], _core.execute_cpu)
    np.testing.assert_allclose(out, ref(x.astype(np.float64))[0], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("build", [bias_tanh, row_scale], ids=lambda b: b.__name__)
def test_broadcast_operands_get_the_2d_pointwise_schedule(build):
    fd, _ = build()
    auto = fd._core.auto_program([[300, 1000], [1000 if build is bias_tanh else 300]])
    assert auto.heuristic == "pointwise" and auto.params[3] == 2, auto.params
    # No per-element integer division to find the broadcast operand's element.
    src = _auto_lowered(fd, make_inputs(build, 300, 1000, np)).kernels[0].cuda_source
    assert "% i" not in src
    # Rows narrower than a warp of vectors keep the flat schedule.
    assert fd._core.auto_program([[300, 5], [5 if build is bias_tanh else 300]]).params[-1] == 1


@pytest.mark.parametrize("build", [bias_tanh, row_scale], ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", [(37, 64), (9, 100), (5, 257), (130, 72)])
def test_narrow_rows_share_a_block_in_the_2d_pointwise_schedule(build, m, n):
    # Rows of up to 128 vectors take several rows per block (TIDy) so a block has 128
    # threads; row counts that the block's rows do not divide leave a partial last block.
    fd, ref = build()
    auto = fd._core.auto_program([[m, n], [n if build is bias_tanh else m]])
    assert auto.heuristic == "pointwise" and auto.params[3] == 2, auto.params
    threads, rows = auto.params[1], auto.params[4]
    assert rows == max(1, 128 // threads), auto.params
    ins = make_inputs(build, m, n, np)
    (out,) = fd.execute(ins)
    np.testing.assert_allclose(out, ref(*[a.astype(np.float64) for a in ins])[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build", [bias_tanh, row_scale], ids=lambda b: b.__name__)
def test_a_new_row_count_is_not_a_new_2d_pointwise_plan(build):
    # The row length is a constant of the kernel; the row count (the length of a per-row
    # scale) must not be, or every batch size would compile a kernel of its own.
    fd, _ = build()
    def params(m: int, n: int) -> List[int]:
        return list(fd._core.auto_program([[m, n], [n if build is bias_tanh else m]]).params)
    assert params(300, 1000) == params(301, 1000) == params(517, 1000)
    assert params(300, 1000) != params(300, 1004)


@pytest.mark.parametrize("build", [bias_tanh, row_scale], ids=lambda b: b.__name__)
def test_rows_past_grid_dim_y_put_the_row_tiles_on_grid_dim_x(build):
    # 600,000 rows of 64 are 75,000 tiles of 8 rows: more than gridDim.y holds. The row
    # tiles go on x and the column tiles on y; the schedule stays 2-D (no per-element % K).
    fd, _ = build()
    m, n = 600_000, 64
    auto = fd._core.auto_program([[m, n], [n if build is bias_tanh else m]])
    # [vector, threads, unroll, 2 (2-D), rows per block, rows on x, specialized extents...]
    assert auto.heuristic == "pointwise" and auto.params[3] == 2 and auto.params[5] == 1, auto.params
    ins = [np.zeros((m, n), np.float32), np.zeros(n if build is bias_tanh else m, np.float32)]
    (k,) = _auto_lowered(fd, ins).kernels
    assert k.launch["grid"][1] == "1" and "blockIdx.y" in k.cuda_source
    assert "% i" not in k.cuda_source


@pytest.mark.gpu
@pytest.mark.parametrize("build", [bias_tanh, row_scale], ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", [(600_000, 64), (70_001, 96), (37, 64)])
def test_2d_pointwise_rows_per_block_and_grid_orientation_match_numpy_on_gpu(build, m, n):
    cp = cupy_or_skip()
    fd, ref = build()
    ins = make_inputs(build, m, n, np)
    (out,) = fd.execute([cp.asarray(a) for a in ins])
    np.testing.assert_allclose(cp.asnumpy(out), ref(*[a.astype(np.float64) for a in ins])[0], rtol=2e-6,
                               atol=2e-6)


@pytest.mark.parametrize(
    "shape, dims, kind",
    [
        ((3, 5, 7), [1], "outer_reduction"),  # [B, R, I]: mean over a sequence axis
        ((4, 33, 64), [1], "outer_reduction"),
        ((2, 9, 1), [1], "outer_reduction"),
        ((5, 3, 8), [0, 2], "inner_reduction"),  # last axis reduced: kept axis first
        ((3, 4, 6, 5), [1, 3], "inner_reduction"),
        ((3, 4, 6, 5), [0, 2], "outer_reduction"),
    ],
)
def test_reductions_over_axes_between_kept_ones_match_numpy_in_the_interpreter(shape, dims, kind):
    # The loop domains are permuted so the reduced axes lead or trail; the memory layout
    # stays. A pointwise op before and after the reduction rides along.
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        s = fd.ops.sum(fd.ops.mul(x, 2.0), dims=dims)
        fd.add_output(fd.ops.add(s, 1.0))
    a = np.random.default_rng(len(dims) + sum(shape)).standard_normal(shape).astype(np.float32)
    assert fd._core.auto_program([list(shape)]).heuristic == kind
    (out,) = run_on_cpu(_auto_lowered(fd, [a]), [a], _core.execute_cpu)
    want = (a.astype(np.float64) * 2.0).sum(axis=tuple(dims)) + 1.0
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


_BESIDE = {
    # name: (build(fd, x, b) -> outputs, reference(x, b) -> outputs, kind, bias length: "m"/"k"/None)
    "row sum, then x * 2": (lambda fd, x, b: [fd.ops.sum(x, dims=[1]), fd.ops.mul(x, 2.0)],
                            lambda x, b: [x.sum(1), x * 2], "inner_reduction", None),
    "x * 2, then row sum": (lambda fd, x, b: [fd.ops.mul(x, 2.0), fd.ops.sum(x, dims=[1])],
                            lambda x, b: [x * 2, x.sum(1)], "inner_reduction", None),
    "column sum and x * 2": (lambda fd, x, b: [fd.ops.sum(x, dims=[0]), fd.ops.mul(x, 2.0)],
                             lambda x, b: [x.sum(0), x * 2], "outer_reduction", None),
    "full sum and x * 2": (lambda fd, x, b: [fd.ops.sum(x, dims=[0, 1]), fd.ops.mul(x, 2.0)],
                           lambda x, b: [x.sum(), x * 2], "full_reduction", None),
    "row sum + bias": (lambda fd, x, b: [fd.ops.add(fd.ops.sum(x, dims=[1]), b)],
                       lambda x, b: [x.sum(1) + b], "inner_reduction", "m"),
    "column sum + bias": (lambda fd, x, b: [fd.ops.add(fd.ops.sum(x, dims=[0]), b)],
                          lambda x, b: [x.sum(0) + b], "outer_reduction", "k"),
    "row max and row sum": (lambda fd, x, b: [fd.ops.max(x, dims=[1]), fd.ops.sum(x, dims=[1])],
                            lambda x, b: [x.max(1), x.sum(1)], "inner_reduction", None),
}


def _beside(name: str) -> Tuple[FusionDefinition, Callable, str, Optional[str]]:
    build, ref, kind, bias = _BESIDE[name]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1]) if bias else None
        for o in build(fd, x, b):
            fd.add_output(o)
    return fd, ref, kind, bias


def _beside_inputs(bias: Optional[str], m: int, n: int, xp: Any) -> List[Any]:
    rng = np.random.default_rng(m * n)
    ins = [rng.standard_normal((m, n)).astype(np.float32)]
    if bias:
        ins.append(rng.standard_normal(m if bias == "m" else n).astype(np.float32))
    return [xp.asarray(a) for a in ins]


@pytest.mark.parametrize("name", list(_BESIDE))
@pytest.mark.parametrize("m,n", [(64, 256), (7, 13), (1000, 3), (1, 1)])
def test_ops_beside_a_reduction_share_its_kernel_in_the_interpreter(name, m, n):
    # Outputs computed from the reduction's input but not from its result (backward passes:
    # a bias gradient and an input gradient) and kept-rank operands of the result are
    # scheduled with the reduction, in one kernel.
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, ref, kind, bias = _beside(name)
    ins = _beside_inputs(bias, m, n, np)
    auto = fd._core.auto_program([list(a.shape) for a in ins])
    assert auto.heuristic == kind and len(auto.program.kernels()) == 1
    outs = run_on_cpu(_auto_lowered(fd, ins), ins, _core.execute_cpu)
    wants = ref(*[a.astype(np.float64) for a in ins], *([None] if not bias else []))
    for got, want in zip(outs, wants):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * max(1.0, np.sqrt(m * n) / 10))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_BESIDE))
def test_ops_beside_a_reduction_match_numpy_on_gpu(name):
    cp = cupy_or_skip()
    fd, ref, _, bias = _beside(name)
    ins = _beside_inputs(bias, 4099, 1031, cp)
    outs = fd.execute(ins)
    wants = ref(*[cp.asnumpy(a).astype(np.float64) for a in ins], *([None] if not bias else []))
    for got, want in zip(outs, wants):
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=2e-2)


def _batched_transpose(rank: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * rank)
        fd.add_output(fd.ops.permute(x, list(range(rank - 2)) + [rank - 1, rank - 2]))
    return fd


_EPILOGUES = {
    "x.T * 2": ((70, 130), [1, 0], [], lambda fd, p: fd.ops.mul(p, 2.0), lambda p: p * 2),
    "relu(x.T * 2 + 1)": ((70, 130), [1, 0], [],
                          lambda fd, p: fd.ops.relu(fd.ops.add(fd.ops.mul(p, 2.0), 1.0)),
                          lambda p: np.maximum(p * 2 + 1, 0)),
    "x.T + bias": ((70, 130), [1, 0], [(70,)],
                   lambda fd, p, b: fd.ops.add(p, fd.ops.broadcast_in_dim(b, [-1, -1], [1])),
                   lambda p, b: p + b),
    "x.T + y": ((70, 130), [1, 0], [(130, 70)], lambda fd, p, y: fd.ops.add(p, y), lambda p, y: p + y),
    "[H, B, S] * 2": ((3, 70, 5), [2, 0, 1], [], lambda fd, p: fd.ops.mul(p, 2.0), lambda p: p * 2),
    "[B, H, S] + bias": ((2, 70, 65), [0, 2, 1], [(70,)],
                         lambda fd, p, b: fd.ops.add(p, fd.ops.broadcast_in_dim(b, [-1, -1, -1], [2])),
                         lambda p, b: p + b),
}


def _epilogue(name: str) -> Tuple[FusionDefinition, List[Tuple[int, ...]], Callable]:
    shape, perm, extra, epi, ref = _EPILOGUES[name]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        ys = [fd.define_tensor([-1] * len(e)) for e in extra]
        fd.add_output(epi(fd, fd.ops.permute(x, perm), *ys))

    def want(a: np.ndarray, *es: np.ndarray) -> np.ndarray:
        return ref(np.transpose(a.astype(np.float64), perm), *[e.astype(np.float64) for e in es])
    return fd, [shape, *extra], want


@pytest.mark.parametrize("name", list(_EPILOGUES))
def test_ops_after_a_transpose_share_its_kernel_in_the_interpreter(name):
    # The permute's result is the Shared tile; the ops after it run on the output side, in
    # the output's order, before the vectorized store.
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, shapes, want = _epilogue(name)
    rng = np.random.default_rng(len(name))
    ins = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    auto = fd._core.auto_program([list(s) for s in shapes])
    assert auto.heuristic == "transpose" and len(auto.program.kernels()) == 1
    (out,) = run_on_cpu(_auto_lowered(fd, ins), ins, _core.execute_cpu)
    np.testing.assert_allclose(out, want(*ins), rtol=1e-6, atol=1e-6)


def test_a_bf16_cast_after_a_transpose_rounds_like_the_unscheduled_fusion():
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.permute(x, [1, 0]), 3.0), DataType.BFloat16))
    a = np.random.default_rng(5).standard_normal((64, 130)).astype(np.float32)
    (got,) = run_on_cpu(_auto_lowered(fd, [a]), [a], _core.execute_cpu)
    (ref,) = fd.execute([a])  # the interpreter on the unscheduled fusion (bf16 bits as uint16)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("shape, perm",
                         [((70, 130), [1, 0]), ((3, 33, 65), [0, 2, 1]), ((5, 2, 67), [2, 0, 1])])
def test_ops_before_a_transpose_run_in_its_kernel(shape, perm):
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        b = fd.define_tensor([-1])
        bb = fd.ops.broadcast_in_dim(b, shape=list(shape), broadcast_dims=[len(shape) - 1])
        pre = fd.ops.relu(fd.ops.add(fd.ops.mul(x, 2.0), bb))
        t = fd.ops.permute(pre, perm)
        fd.add_output(fd.ops.mul(t, fd.ops.sigmoid(t)))
    rng = np.random.default_rng(6)
    a = rng.standard_normal(shape).astype(np.float32)
    bias = rng.standard_normal(shape[-1]).astype(np.float32)
    low = _auto_lowered(fd, [a, bias])
    assert len(low.kernels) == 1
    (out,) = run_on_cpu(low, [a, bias], _core.execute_cpu)
    pre64 = np.maximum(a.astype(np.float64) * 2 + bias, 0).transpose(perm)
    np.testing.assert_allclose(out, pre64 / (1 + np.exp(-pre64)), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_EPILOGUES))
def test_ops_after_a_transpose_match_numpy_on_gpu(name):
    cp = cupy_or_skip()
    fd, shapes, want = _epilogue(name)
    rng = np.random.default_rng(len(name))
    ins = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    (out,) = fd.execute([cp.asarray(a) for a in ins])
    np.testing.assert_allclose(cp.asnumpy(out), want(*ins), rtol=1e-6, atol=1e-6)


_MOVING_LAST = [((3, 70, 5), p) for p in itertools.permutations(range(3)) if p[-1] != 2] + [
    ((2, 3, 4, 65), p) for p in itertools.permutations(range(4)) if p[-1] != 3]


@pytest.mark.parametrize("shape, perm", _MOVING_LAST)
def test_every_permute_that_moves_the_last_axis_is_a_tiled_transpose_in_the_interpreter(shape, perm):
    # The tiles span x's last axis and the output's last axis; the other axes are a batch.
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.permute(x, list(perm)))
    a = np.random.default_rng(len(perm)).standard_normal(shape).astype(np.float32)
    assert fd._core.auto_program([list(shape)]).heuristic == "transpose"
    (out,) = run_on_cpu(_auto_lowered(fd, [a]), [a], _core.execute_cpu)
    np.testing.assert_array_equal(out, np.transpose(a, perm))


@pytest.mark.parametrize("shape", [(2, 70, 130), (3, 2, 64, 64), (5, 7, 3), (2, 1, 3, 129, 65)])
def test_batched_transposes_match_numpy_in_the_interpreter(shape):
    # [B, S, H] -> [B, H, S]: the batch axes merge into one loop on BIDz around the 2-D tile
    # schedule, whose Shared tile keeps the transposed [64, 64] allocation (rows padded).
    from kiln import _core
    from kiln.host import run_on_cpu

    fd = _batched_transpose(len(shape))
    a = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    assert fd._core.auto_program([list(shape)]).heuristic == "transpose"
    low = _auto_lowered(fd, [a])
    (k,) = low.kernels
    assert k.launch["grid"][2] == " * ".join(f"i{i}" for i in range(len(shape) - 2))
    (tile,) = [x for x in k.allocations if x.memory_type == MemoryType.Shared]
    assert tile.extents == ("64", "64") and tile.strides == ("65", "1")
    (out,) = run_on_cpu(low, [a], _core.execute_cpu)
    np.testing.assert_array_equal(out, np.swapaxes(a, -1, -2))


def test_a_transpose_past_grid_dim_y_is_a_strided_copy():
    # x is 2 x 4,194,368: its last axis, the output's axis 0, needs 65,537 tiles on BIDy,
    # more than the tiled transpose takes; the strided element-wise copy covers it.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.permute(x, [1, 0]))
    assert fd._core.auto_scheduled([[2, 64 * 65537]]).heuristic == "strided_permute"


def test_a_batch_of_transposes_past_grid_dim_z_is_a_strided_copy():
    fd = _batched_transpose(3)
    a = np.random.default_rng(3).standard_normal((65536, 2, 2)).astype(np.float32)
    assert len(fd.lower([a]).kernels) == 1
    (out,) = fd.execute([a])
    np.testing.assert_array_equal(out, np.transpose(a, [0, 2, 1]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, perm", [((64, 512, 96), (2, 0, 1)), ((4, 128, 16, 64), (0, 3, 1, 2)),
                                         ((3, 5, 7), (1, 2, 0))])
def test_permutes_that_move_the_last_axis_match_numpy_on_gpu(shape, perm):
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.permute(x, list(perm)))
    a = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    (out,) = fd.execute([cp.asarray(a)])
    np.testing.assert_array_equal(cp.asnumpy(out), np.transpose(a, perm))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 1024, 2048), (3, 2, 65, 129), (1, 1, 1)])
def test_batched_transposes_match_numpy_on_gpu(shape):
    cp = cupy_or_skip()
    a = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    (out,) = _batched_transpose(len(shape)).execute([cp.asarray(a)])
    np.testing.assert_array_equal(cp.asnumpy(out), np.swapaxes(a, -1, -2))


def _permute_chain(shape: Tuple[int, ...], perm: List[int], bias: bool) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        p = fd.ops.permute(fd.ops.mul(x, 2.0), perm)
        if bias:
            b = fd.define_tensor([-1])
            p = fd.ops.add(p, fd.ops.broadcast_in_dim(b, [-1] * len(shape), [len(shape) - 1]))
        fd.add_output(fd.ops.add(p, 1.0))
    return fd


def _permute_inputs(shape: Tuple[int, ...], bias: bool, xp: Any) -> List[Any]:
    rng = np.random.default_rng(sum(shape))
    ins = [rng.standard_normal(shape).astype(np.float32)]
    if bias:
        ins.append(rng.standard_normal(shape[-1]).astype(np.float32))
    return [xp.asarray(a) for a in ins]


def _permute_reference(ins: List[np.ndarray], perm: List[int]) -> np.ndarray:
    want = np.transpose(ins[0].astype(np.float64) * 2.0, perm) + 1.0
    return want + ins[1] if len(ins) > 1 else want


@pytest.mark.parametrize(
    "shape, perm, bias",
    [
        ((3, 5, 8), [1, 0, 2], False),  # [B, S, H] -> [S, B, H]: vectors along H
        ((3, 5, 7), [1, 0, 2], False),  # H not a multiple of the vector width: scalar loads
        ((2, 3, 4, 8), [0, 2, 1, 3], False),  # [B, S, N, D] -> [B, N, S, D] (attention heads)
        ((2, 3, 4, 8), [2, 0, 1, 3], False),
        ((6, 5, 64), [1, 0, 2], True),  # with a bias: the 2-D schedule
        ((1, 1, 1), [1, 0, 2], False),
    ],
)
def test_permutes_that_keep_the_last_axis_are_pointwise_in_the_interpreter(shape, perm, bias):
    from kiln import _core
    from kiln.host import run_on_cpu

    fd = _permute_chain(shape, perm, bias)
    ins = _permute_inputs(shape, bias, np)
    auto = fd._core.auto_program([list(a.shape) for a in ins])
    assert auto.heuristic == "pointwise"
    params = auto.params
    assert params[0] == (4 if shape[-1] % 4 == 0 else 1), params  # vectors stay within a row
    (out,) = run_on_cpu(_auto_lowered(fd, ins), ins, _core.execute_cpu)
    np.testing.assert_allclose(out, _permute_reference(ins, perm), rtol=1e-6, atol=1e-6)


def test_a_tensor_needed_in_both_orders_splits_the_fusion_at_the_permute():
    # t is an output in its own order and permuted into another: no single loop order serves
    # both, so the pointwise schedule refuses (naming t) and the segmenter gives t a kernel
    # and the permute with the add after it another.
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        t = fd.ops.mul(x, 2.0)
        fd.add_output(fd.ops.add(fd.ops.permute(t, [1, 0, 2]), 1.0))
        fd.add_output(t)
    a = np.random.default_rng(8).standard_normal((3, 5, 8)).astype(np.float32)
    low = _auto_lowered(fd, [a])
    assert len(low.kernels) == 2
    got = run_on_cpu(low, [a], _core.execute_cpu)
    np.testing.assert_allclose(got[0], np.transpose(a.astype(np.float64) * 2, [1, 0, 2]) + 1, rtol=1e-6)
    np.testing.assert_allclose(got[1], a.astype(np.float64) * 2, rtol=1e-6)
    with FusionDefinition() as whole:  # the refusal itself, on the unsegmented fusion
        x = whole.define_tensor([-1, -1, -1])
        t = whole.ops.mul(x, 2.0)
        whole.add_output(whole.ops.add(whole.ops.permute(t, [1, 0, 2]), 1.0))
        whole.add_output(t)
    with pytest.raises(KilnError,
                       match=r"pointwise: outputs T3 \[5, 3, 8\] and T1 \[3, 5, 8\] differ in shape"):
        whole._core.auto_scheduled([[3, 5, 8]])


@pytest.mark.gpu
@pytest.mark.parametrize("shape, perm, bias", [((16, 512, 1024), [1, 0, 2], False),
                                               ((4, 128, 16, 64), [0, 2, 1, 3], True),
                                               ((5, 7, 3), [1, 0, 2], False)])
def test_permutes_that_keep_the_last_axis_match_numpy_on_gpu(shape, perm, bias):
    cp = cupy_or_skip()
    fd = _permute_chain(shape, perm, bias)
    ins = _permute_inputs(shape, bias, cp)
    (out,) = fd.execute(ins)
    want = _permute_reference([cp.asnumpy(a) for a in ins], perm)
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dims", [((16, 257, 1024), [1]), ((64, 8, 4096), [0, 2]), ((7, 3, 5), [1])])
def test_reductions_over_axes_between_kept_ones_match_numpy_on_gpu(shape, dims):
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.sum(x, dims=dims))
    a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (out,) = fd.execute([cp.asarray(a)])
    want = a.astype(np.float64).sum(axis=tuple(dims))
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-5, atol=1e-3)


def test_3d_broadcast_of_a_middle_axis_matches_numpy_in_the_interpreter():
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        b = fd.define_tensor([-1, -1])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1, -1], broadcast_dims=[0, 2])
        fd.add_output(fd.ops.sub(x, bb))
    rng = np.random.default_rng(3)
    a, c = rng.standard_normal((3, 5, 97)).astype(np.float32), rng.standard_normal((3, 97)).astype(np.float32)
    low = _auto_lowered(fd, [a, c])
    (out,) = run_on_cpu(low, [a, c], _core.execute_cpu)
    want = a.astype(np.float64) - c.astype(np.float64)[:, None, :]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_half_chain_rounds_once_in_the_interpreter():
    """Half/bf16 intermediates held in registers are computed in float: the result is the
    float32 value rounded once to bf16 (per-op rounding would be off by several ulps)."""
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Half)
        y = x
        for _ in range(6):
            y = fd.ops.add(fd.ops.mul(y, 1.01), 0.013)
        fd.add_output(y)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((33, 130)).astype(np.float16)
    (out,) = run_on_cpu(_auto_lowered(fd, [a]), [a], _core.execute_cpu)
    want = a.astype(np.float64)
    for _ in range(6):
        want = want * 1.01 + 0.013
    # Rounding once to half (11 significant bits) is within half an ulp: 2**-11 relative.
    assert out.dtype == np.float16
    err = np.abs(out.astype(np.float64) - want) / np.abs(want)
    assert err.max() <= 2.0**-11 * 1.001, err.max()


def test_same_heuristic_shares_one_kernel():
    fd, _ = pointwise()
    a = _auto_lowered(fd, [np.zeros((64, 64), np.float32)])
    b = _auto_lowered(fd, [np.zeros((32, 96), np.float32)])
    assert a is b


@pytest.mark.gpu
@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", SIZES)
def test_auto_schedule_matches_numpy_on_gpu(build, m, n):
    cp = cupy_or_skip()
    fd, ref = build()
    arrays = make_inputs(build, m, n, cp)
    outs = fd.execute(arrays)
    want = ref(*[cp.asnumpy(a).astype(np.float64) for a in arrays])
    for o, w in zip(outs, want):
        got = cp.asnumpy(o)
        assert got.shape == np.shape(w)
        tol = 1e-5 * max(1.0, float(np.abs(w).max())) * (1 + np.sqrt(m * n) / 100)
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=tol)


def _index_select_fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(x, i, 0))
    return fd


def test_gathered_rows_load_with_vectors():
    src = _auto_lowered(_index_select_fusion(), [np.zeros((300, 4096), np.float32),
                                                 np.zeros(300, np.int64)]).kernels[0].cuda_source
    # The row index is read once per vector, then the row slice moves in one 16-byte load
    # (with the L2 evict_last hint of the automatic schedules).
    assert "const kiln_index_t g0 = " in src, src
    assert "loadVecEvictLast<float, 4>(kiln_vec, &T0[kiln_ib])" in src, src


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,offset", [(1001, 37, 0), (1001, 64, 0), (513, 64, 1), (3, 4, 0)])
def test_index_select_and_bf16_pointwise_on_gpu(rows, width, offset):
    # offset 1: the table starts 4 bytes past an aligned address, so every vector falls back
    # to element-wise loads; width 37: rows alternate between aligned and not.
    cp = cupy_or_skip()
    fd = _index_select_fusion()
    flat = cp.asarray(np.random.default_rng(0).standard_normal(rows * width + offset).astype(np.float32))
    x = flat[offset:].reshape(rows, width)
    idx = cp.asarray(np.random.default_rng(1).integers(0, rows, 777))
    (out,) = fd.execute([x, idx])
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(x)[cp.asnumpy(idx)])


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("m,n", [(1, 1), (3, 5), (31, 97), (130, 70)])
def test_auto_schedule_matches_numpy_in_the_interpreter(build, m, n):
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, ref = build()
    arrays = make_inputs(build, m, n, np)
    outs = run_on_cpu(_auto_lowered(fd, arrays), arrays, _core.execute_cpu)
    for got, want in zip(outs, ref(*[a.astype(np.float64) for a in arrays])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_segmenter_falls_back_to_more_kernels():
    from kiln import _core
    from kiln.host import run_on_cpu

    a = np.random.default_rng(5).standard_normal((37, 300)).astype(np.float32)
    # A keepdim reduction with an op after it: one inner-reduction kernel.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(fd.ops.sum(x, dims=[1], keepdim=True), 2.0))
    low = _auto_lowered(fd, [a])
    assert len(low.kernels) == 1
    (out,) = run_on_cpu(low, [a], _core.execute_cpu)
    np.testing.assert_allclose(out, 2 * a.astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-4)
    # A permute feeding a reduction: transpose kernel, then reduction kernel.
    with FusionDefinition() as fd2:
        x = fd2.define_tensor([-1, -1])
        fd2.add_output(fd2.ops.sum(fd2.ops.permute(x, [1, 0]), dims=[1]))
    low = _auto_lowered(fd2, [a])
    assert len(low.kernels) == 2
    (out,) = run_on_cpu(low, [a], _core.execute_cpu)
    np.testing.assert_allclose(out, a.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_segmenter_fallback_matches_numpy_on_gpu():
    cp = cupy_or_skip()
    a = np.random.default_rng(6).standard_normal((37, 300)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(fd.ops.sum(x, dims=[1], keepdim=True), 2.0))
    (out,) = fd.execute([cp.asarray(a)])
    assert len(_auto_lowered(fd, [a]).kernels) == 1
    np.testing.assert_allclose(cp.asnumpy(out), 2 * a.astype(np.float64).sum(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-4)
    with FusionDefinition() as fd2:
        x = fd2.define_tensor([-1, -1])
        fd2.add_output(fd2.ops.sum(fd2.ops.permute(x, [1, 0]), dims=[1]))
    (out,) = fd2.execute([cp.asarray(a)])
    np.testing.assert_allclose(cp.asnumpy(out), a.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)


def test_independent_reductions_over_different_axes_get_a_kernel_each():
    from kiln import _core
    from kiln.host import run_on_cpu

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, dims=[1]))
        fd.add_output(fd.ops.max(fd.ops.mul(x, 2.0), dims=[0]))
    a = np.random.default_rng(8).standard_normal((37, 300)).astype(np.float32)
    low = _auto_lowered(fd, [a])
    assert len(low.kernels) == 2
    rows, cols = run_on_cpu(low, [a], _core.execute_cpu)
    np.testing.assert_allclose(rows, a.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(cols, 2 * a.astype(np.float64).max(axis=0), rtol=1e-6)


@pytest.mark.gpu
def test_independent_reductions_over_different_axes_on_gpu():
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, dims=[1]))
        fd.add_output(fd.ops.sum(x, dims=[0]))
    a = np.random.default_rng(9).standard_normal((1000, 3000)).astype(np.float32)
    rows, cols = fd.execute([cp.asarray(a)])
    np.testing.assert_allclose(cp.asnumpy(rows), a.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(cp.asnumpy(cols), a.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-3)


def test_a_permute_past_every_grid_limit_runs_as_a_strided_copy():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.relu(fd.ops.permute(x, [2, 0, 1])))
    # More transposes in the batch than gridDim.z takes: the strided copy covers the permute.
    a = np.random.default_rng(4).standard_normal((65536, 2, 2)).astype(np.float32)
    (out,) = fd.execute([a])
    np.testing.assert_array_equal(out, np.maximum(np.transpose(a, [2, 0, 1]), 0))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(build=st.sampled_from(BUILDERS + [softmax, layernorm]), m=st.integers(1, 70), n=st.integers(1, 300))
def test_every_scheduler_matches_numpy_on_random_sizes_in_the_interpreter(build, m, n):
    """Whatever the sizes (vector-width remainders, 2-D or 1-D pointwise, specialized row
    lengths, grid-split columns), the automatic schedule computes what NumPy computes."""
    from kiln import _core
    from kiln.host import run_on_cpu

    fd, ref = build()
    norm = build in (softmax, layernorm)
    arrays = (norm_inputs if norm else make_inputs)(build, m, n, np)
    outs = run_on_cpu(_auto_lowered(fd, arrays), arrays, _core.execute_cpu)
    want = ref(*[a if isinstance(a, float) else a.astype(np.float64) for a in arrays])
    # A float32 sum that cancels to near zero is off by about eps * the sum of |terms|, not
    # by eps * |result| (a 39x273 full sum came to 0.11761 against 0.117688).
    scale = ref(*[np.abs(a).astype(np.float64) for a in arrays]) if build.__name__.startswith("sum") else want
    for got, w, mag in zip(outs, want, scale):
        tol = 1e-5 * max(1.0, float(np.abs(w).max())) * (1 + n / 100)
        tol = max(tol, 1e-6 * float(np.abs(mag).max()))
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [pointwise, softmax], ids=lambda b: b.__name__)
def test_aligned_and_misaligned_inputs_get_their_own_kernels_on_gpu(build):
    cp = cupy_or_skip()
    fd, ref = build()
    host = np.random.default_rng(3).standard_normal(64 * 4096 + 1).astype(np.float32)
    flat = cp.asarray(host)
    aligned = cp.ascontiguousarray(flat[:-1]).reshape(64, 4096)
    odd = flat[1:].reshape(64, 4096)  # 4 bytes past a 16-byte boundary
    assert aligned.data.ptr % 16 == 0 and odd.data.ptr % 16 == 4
    for x in (aligned, odd, aligned, odd):  # the second round takes the cached fast path
        (out,) = fd.execute([x])
        (want,) = ref(cp.asnumpy(x).astype(np.float64))
        np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-6)
    assert _auto_lowered(fd, [aligned]).aligned_bases and not _auto_lowered(fd, [odd]).aligned_bases
    # A lowering compiled for aligned inputs refuses a misaligned one instead of faulting.
    ev = _auto_lowered(fd, [aligned]).evaluator()
    with pytest.raises(KilnError, match="not 16-byte aligned"):
        ev.run([odd])


HEURISTIC_SHAPES = [*SIZES, (3, 64), (5, 64), (3, 96), (300, 1000), (301, 1003), (129, 4096), (140000, 64),
                    (140001, 96)]


def _assert_equal_heuristics_mean_equal_kernels(fd: FusionDefinition, all_sizes: List[List[List[int]]]
                                                ) -> None:
    """fd.execute shares one lowering between input sizes whose heuristics are equal: a kernel
    may depend on a size only through what the heuristic records."""
    by_heuristic: dict = {}
    for sizes in all_sizes:
        try:
            auto = fd._core.auto_program(sizes, True)
        except KilnError:
            continue
        kind, params = auto.heuristic, auto.params
        cuda = tuple(k.cuda(False).source for k in auto.program.kernels())
        seen = by_heuristic.setdefault((kind, tuple(params)), (sizes, cuda))
        assert seen[1] == cuda, f"{kind}{params}: {seen[0]} and {sizes} share a heuristic, not a kernel"


@pytest.mark.parametrize("build", BUILDERS + [softmax], ids=lambda b: b.__name__)
def test_equal_heuristics_mean_equal_kernels(build):
    # Shapes include a row count past gridDim.y's limit (the 2-D pointwise falls back to 1-D).
    fd, _ = build()
    extra = {bias_tanh: lambda m, n: [[n]], row_scale: lambda m, n: [[m]]}.get(build, lambda m, n: [])
    _assert_equal_heuristics_mean_equal_kernels(fd, [[[m, n], *extra(m, n)] for m, n in HEURISTIC_SHAPES])


def test_equal_heuristics_mean_equal_kernels_for_norms_gathers_and_3d():
    fd, _ = layernorm()
    _assert_equal_heuristics_mean_equal_kernels(fd, [[[m, n], [n], [n]] for m, n in HEURISTIC_SHAPES])
    fd = _index_select_fusion()
    _assert_equal_heuristics_mean_equal_kernels(
        fd, [[[m + 5, n], [m]] for m, n in HEURISTIC_SHAPES if m * n < 10**7])
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DataType.BFloat16)
        b = fd.define_tensor([-1], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(b, shape=[-1, -1, -1], broadcast_dims=[2])))
    _assert_equal_heuristics_mean_equal_kernels(
        fd, [[[a, m, n], [n]] for a in (1, 3) for m, n in HEURISTIC_SHAPES if a * m * n < 10**8])


@pytest.mark.parametrize("n", [1, 7, 4099, 300_001])
def test_ops_after_a_full_reduction_share_its_kernel(n):
    """``sum(x) * (1/n) * s`` runs where the grid reduction finishes; ``sum(x) / sum(y)``
    needs both totals in one thread, which two grid reductions do not guarantee."""
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32) + 0.5
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1])
        s = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(fd.ops.mul(fd.ops.sum(a, dims=[0]), 1.0 / n), s))
    assert len(fd.lower([x, 3.0]).kernels) == 1
    (out,) = fd.execute([x, 3.0])
    np.testing.assert_allclose(out, x.astype(np.float64).mean() * 3.0, rtol=1e-4, atol=1e-5)
    with FusionDefinition() as fd2:
        a = fd2.define_tensor([-1])
        b = fd2.define_tensor([-1])
        fd2.add_output(fd2.ops.div(fd2.ops.sum(a, dims=[0]), fd2.ops.sum(b, dims=[0])))
    (out,) = fd2.execute([x, y])
    want = x.astype(np.float64).sum() / y.astype(np.float64).sum()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(4099, 13), (1000, 3), (257, 130), (2, 5)])
def test_ops_after_a_column_reduction_split_across_blocks(shape):
    """A column mean with a per-column epilogue (BatchNorm's running mean): the reduction
    is split over blocks and the epilogue runs where each column's grid reduction ends."""
    rng = np.random.default_rng(shape[0])
    x = rng.standard_normal(shape).astype(np.float32)
    rm = rng.standard_normal(shape[1]).astype(np.float32)
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        r = fd.define_tensor([-1])
        mean = fd.ops.mul(fd.ops.sum(a, dims=[0]), 1.0 / shape[0])
        fd.add_output(fd.ops.add(fd.ops.mul(r, 0.9), fd.ops.mul(mean, 0.1)))
    low = fd.lower([x, rm])
    assert len(low.kernels) == 1
    (out,) = fd.execute([x, rm])
    want = rm.astype(np.float64) * 0.9 + x.astype(np.float64).mean(axis=0) * 0.1
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, vocab, cols", [(5, 7, 3), (1, 2, 1), (64, 50, 1031), (1000, 31, 3)])
def test_a_computed_gather_index_runs_in_the_gathers_kernel(rows, vocab, cols):
    """``table[(ids * 2 + 1) % vocab] * 0.5``: the index chain runs in the output's loops."""
    rng = np.random.default_rng(rows * cols)
    table = rng.standard_normal((vocab, cols)).astype(np.float32)
    ids = rng.integers(0, vocab, rows).astype(np.int64)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1])
        i = fd.define_tensor([-1], dtype=DataType.Int)
        k = fd.ops.where(fd.ops.lt(fd.ops.add(i, 1), vocab), fd.ops.add(i, 1), 0)
        fd.add_output(fd.ops.mul(fd.ops.index_select(t, k, 0), 0.5))
    assert len(fd.lower([table, ids]).kernels) == 1
    (out,) = fd.execute([table, ids])
    k_ref = np.where(ids + 1 < vocab, ids + 1, 0)
    np.testing.assert_array_equal(out, table[k_ref] * np.float32(0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4099, 300_001, 10_000_019])
def test_ops_on_two_grid_reductions_match_numpy_on_gpu(n):
    """``sum(x) / sum(y)`` in one kernel runs where the second grid reduction finishes, which
    has seen the first one's result; repeated calls would expose a block that had not."""
    cp = cupy_or_skip()
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32) + 0.5
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1])
        b = fd.define_tensor([-1])
        fd.add_output(fd.ops.div(fd.ops.sum(a, dims=[0]), fd.ops.sum(b, dims=[0])))
    assert len(fd.lower([x, y]).kernels) == 1
    want = x.astype(np.float64).sum() / y.astype(np.float64).sum()
    xs, ys = cp.asarray(x), cp.asarray(y)
    for _ in range(50):
        (out,) = fd.execute([xs, ys])
        np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-5)


def test_reduction_reading_a_squeezed_statistic_twice() -> None:
    """A squeeze read by two ops of a row reduction's schedule is recomputed per reader like
    any element-wise op (found by tests/explore_auto.py, seed 555: an internal error)."""
    with FusionDefinition() as fd:
        t5 = fd.define_tensor([-1, 1, 1, -1])
        t23 = fd.ops.min(t5, dims=[1], keepdim=False)
        t24 = fd.ops.max(t23, dims=[2], keepdim=True)
        t25 = fd.ops.squeeze(t24, [2])
        t26 = fd.ops.broadcast_in_dim(t25, shape=[-1, -1, -1], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.add(t23, t26))
    a = np.random.default_rng(64347).uniform(-1, 1, (3, 1, 1, 13)).astype(np.float32)
    m = a.astype(np.float64).min(axis=1)
    want = m + m.max(axis=2, keepdims=True)
    for as_written in (False, True):
        (got,) = fd.execute([a], as_written=as_written)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# -- operands broadcast along some of the rows -------------------------------------------------------
def _partial_broadcast(kind: str) -> Tuple[FusionDefinition, Callable]:
    """x [B, S, D] with t [S, D] broadcast over B (RoPE's cos, a position table), or x
    [B, H, S, D] with t [H, 1, D] (per-head vectors) and two element-wise uses of t: both
    concretizing it, or one keeping the broadcast (``heads_exp``)."""
    with FusionDefinition() as fd:
        if kind == "rows":
            x, t = fd.define_tensor([-1, -1, -1]), fd.define_tensor([-1, -1])
            tb = fd.ops.broadcast_in_dim(t, shape=[-1, -1, -1], broadcast_dims=[1, 2])
            fd.add_output(fd.ops.add(fd.ops.mul(x, tb), 1.0))
            return fd, lambda x, t: [x * t[None] + 1.0]
        x, t = fd.define_tensor([-1, -1, -1, -1]), fd.define_tensor([-1, 1, -1])
        tb = fd.ops.broadcast_in_dim(t, shape=[-1, -1, -1, -1], broadcast_dims=[1, 2, 3])
        if kind == "heads":
            fd.add_output(fd.ops.sub(fd.ops.mul(x, tb), tb))
            return fd, lambda x, t: [x * t[None] - t[None]]
        # exp keeps the broadcast, the sub concretizes it: tb's loops run the concrete space
        # for both of its consumers
        fd.add_output(fd.ops.sub(fd.ops.mul(x, tb), fd.ops.exp(tb)))
        return fd, lambda x, t: [x * t[None] - np.exp(t[None])]


@pytest.mark.parametrize("kind,shapes", [
    ("rows", [(2, 3, 64), (3, 64)]), ("rows", [(3, 5, 67), (5, 67)]), ("rows", [(1, 1, 64), (1, 64)]),
    ("rows", [(4, 9, 128), (9, 128)]), ("rows", [(2, 129, 72), (129, 72)]), ("rows", [(3, 5, 7), (5, 7)]),
    ("heads", [(2, 3, 5, 64), (3, 1, 64)]), ("heads", [(1, 4, 7, 96), (4, 1, 96)]),
    ("heads_exp", [(2, 3, 5, 64), (3, 1, 64)]), ("heads_exp", [(2, 3, 5, 7), (3, 1, 7)]),
    ("heads_exp", [(1, 1, 1, 64), (1, 1, 64)]),
])
def test_an_operand_broadcast_along_some_rows_loads_vectors_and_matches(kind: str,
                                                                       shapes: List[tuple]) -> None:
    fd, ref = _partial_broadcast(kind)
    rng = np.random.default_rng(len(shapes[0]))
    ins = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    low = _auto_lowered(fd, ins)
    assert len(low.kernels) == 1
    src = low.kernels[0].cuda_source
    if shapes[0][-1] % 4 == 0 and shapes[0][-1] >= 64 and np.prod(shapes[0][:-1]) >= 2:
        # rows of columns (pointwise 2-D): the broadcast operand (T1) is read 16 bytes at a
        # time, in a loop of its own
        assert "(kiln_vec, &T1[kiln_ib])" in src, src
    (got,) = fd.execute(ins)
    (want,) = ref(*[a.astype(np.float64) for a in ins])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_dt,t_dt", [(DataType.Float, DataType.Double), (DataType.Double, DataType.Double),
                                       (DataType.Half, DataType.Float)])
def test_an_operand_broadcast_along_some_rows_of_a_wider_type_is_scheduled(x_dt: DataType,
                                                                           t_dt: DataType) -> None:
    # The vector width comes from the moved tensors; a wider broadcast operand must not get
    # a vector past 16 bytes (a Double table beside float rows was refused).
    np_of = {DataType.Float: np.float32, DataType.Double: np.float64, DataType.Half: np.float16}
    with FusionDefinition() as fd:
        x, t = fd.define_tensor([-1, -1, -1], dtype=x_dt), fd.define_tensor([-1, -1], dtype=t_dt)
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(t, shape=[-1, -1, -1], broadcast_dims=[1, 2])))
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((2, 33, 256)).astype(np_of[x_dt])
    ts = rng.standard_normal((33, 256)).astype(np_of[t_dt])
    assert len(_auto_lowered(fd, [xs, ts]).kernels) == 1
    (got,) = fd.execute([xs, ts])
    want = xs.astype(np.float64) * ts.astype(np.float64)[None]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3 if x_dt == DataType.Half else 1e-6)


@pytest.mark.parametrize("m,n", [(5, 3), (64, 7), (1000, 13), (300, 63), (7, 8), (8, 130)])
def test_a_broadcast_kept_by_two_consumers_is_read_where_it_was_written(m: int, n: int) -> None:
    # b is read by exp(b) and by b + b2, which both keep its broadcast until x concretizes
    # it: in the flat schedule b keeps a private loop of the vector width while its shared
    # loops run the flattened [m, n] space, so it is indexed through its consumer; its
    # consumers must read its private loop at their own loop positions (they read
    # (flat % n) % 4 where it was written at flat % 4: wrong values when n % 4 != 0).
    with FusionDefinition() as fd:
        x, c, c2 = fd.define_tensor([-1, -1]), fd.define_tensor([-1]), fd.define_tensor([-1])
        b = fd.ops.broadcast_in_dim(c, shape=[-1, -1], broadcast_dims=[1])
        b2 = fd.ops.broadcast_in_dim(c2, shape=[-1, -1], broadcast_dims=[1])
        y = fd.ops.mul(x, fd.ops.exp(b))
        fd.add_output(y)
        fd.add_output(fd.ops.mul(y, fd.ops.add(b, b2)))
    rng = np.random.default_rng(m * n)
    xs, cs, c2s = (rng.standard_normal(s).astype(np.float32) for s in ((m, n), (n,), (n,)))
    got_y, got_z = fd.execute([xs, cs, c2s])
    want_y = xs.astype(np.float64) * np.exp(cs.astype(np.float64))
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_z, want_y * (cs.astype(np.float64) + c2s), rtol=1e-5, atol=1e-5)
