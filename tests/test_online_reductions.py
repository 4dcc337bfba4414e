"""One pass over a row for the statistics users compute over long rows.

- ``fd.ops.logsumexp``: a reduction with a running maximum, checked against NumPy in
  float64, with infinities and NaN as torch gives them.
- The automatic path rewrites ``sum(exp(x - max(x)))`` into ``exp(logsumexp(x) - max(x))``
  and takes per-row terms out of masked sums (``sum(where(c, x - max, 0))``), and lowering
  fuses sibling loops, so that softmax-like fusions over rows too long to keep on chip read
  the row once for their statistics. The tests count the passes over the row in the CUDA
  the schedule emits and compare every result with NumPy.
"""

from __future__ import annotations

import re
from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition, KilnError
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available

LONG = 70001  # columns: past what the register-persistent schedules hold, odd


def _lse_ref(x: np.ndarray, axis: Any, keepdims: bool = False) -> np.ndarray:
    """torch.logsumexp in float64: -inf for all -inf, +inf where one is +inf, NaN with a NaN."""
    x = x.astype(np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    finite = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        r = np.log(np.sum(np.exp(x - finite), axis=axis, keepdims=True)) + finite
    r = np.where(np.isinf(m), m, r)
    return r if keepdims else np.squeeze(r, axis=axis)


def _passes(fd: FusionDefinition, inputs: List[Any]) -> List[int]:
    """Serial loops directly inside each kernel's block-per-row scope: one per pass over a row."""
    low = fd.lower(inputs)
    out = []
    for k in low.kernels:
        body = k.cuda_source[k.cuda_source.index("kiln_kernel("):]
        out.append(len(re.findall(r"^    for \(kiln_index_t idx\d+ = 0;", body, re.M)))
    return out


@pytest.mark.parametrize("as_written", [False, True])
@pytest.mark.parametrize("shape,dims,keepdim", [((3, 7), [1], False), ((2, 5, 9), [0, 2], True),
                                                ((4, 1031), [-1], False), ((6, 5), [0], False)])
def test_logsumexp_matches_numpy(shape: Tuple[int, ...], dims: List[int], keepdim: bool,
                                 as_written: bool) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(fd.ops.logsumexp(x, dims=dims, keepdim=keepdim))
    a = (np.random.default_rng(0).standard_normal(shape) * 30).astype(np.float32)
    (got,) = fd.execute([a], as_written=as_written)
    want = _lse_ref(a, tuple(d % len(shape) for d in dims), keepdim)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("as_written", [False, True])
def test_logsumexp_infinities_and_nan(as_written: bool) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.logsumexp(x, dims=[1]))
    a = np.random.default_rng(1).standard_normal((6, 33)).astype(np.float32)
    a[0, :] = -np.inf  # an empty softmax row
    a[1, 5] = np.inf
    a[2, 7] = np.nan
    a[3, [1, 9]] = np.inf
    a[4, ::2] = -np.inf
    a[5, 0] = 80.0  # exp overflows float32 without the running maximum
    (got,) = fd.execute([a], as_written=as_written)
    want = _lse_ref(a, 1)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5, equal_nan=True)
    assert got[0] == -np.inf and got[1] == np.inf and np.isnan(got[2]) and got[3] == np.inf


def test_logsumexp_half_accumulates_in_float() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Half)
        fd.add_output(fd.ops.logsumexp(x, dims=[1]))
    a = np.random.default_rng(2).standard_normal((5, 4099)).astype(np.float16)
    (got,) = fd.execute([a])
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), _lse_ref(a, 1), rtol=2e-3)


def test_logsumexp_refuses_integers() -> None:
    with pytest.raises(KilnError, match="logsumexp.*floating-point"):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1], dtype=DataType.Int)
            fd.add_output(fd.ops.logsumexp(x, dims=[1]))


# ---------------------------------------------------------------------------------- long rows
def _logsumexp_written_out(keepdim: bool) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mx = fd.ops.max(x, dims=[1], keepdim=keepdim)
        mb = mx if keepdim else fd.ops.broadcast_in_dim(mx, [-1, -1], [0])
        s = fd.ops.sum(fd.ops.exp(fd.ops.sub(x, mb)), dims=[1])
        m1 = fd.ops.squeeze(mx, [1]) if keepdim else mx
        fd.add_output(fd.ops.add(fd.ops.log(s), m1))
    return fd


def _log_softmax() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        xs = fd.ops.sub(x, mx)
        lse = fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1], keepdim=True))
        fd.add_output(fd.ops.sub(xs, lse))
    return fd


def _softmax() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mx = fd.ops.broadcast_in_dim(fd.ops.max(x, dims=[1]), [-1, -1], [0])
        e = fd.ops.exp(fd.ops.sub(x, mx))
        fd.add_output(fd.ops.div(e, fd.ops.broadcast_in_dim(fd.ops.sum(e, dims=[1]), [-1, -1], [0])))
    return fd


def _cross_entropy_masked_sum() -> FusionDefinition:
    """The label's log-probability picked by a one-hot mask, as a masked sum of ``x - max``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        labels = fd.define_tensor([-1], dtype=DataType.Int)
        cols = fd.define_tensor([-1], dtype=DataType.Int)
        mx = fd.ops.max(x, dims=[1])
        xs = fd.ops.sub(x, fd.ops.broadcast_in_dim(mx, [-1, -1], [0]))
        lse = fd.ops.log(fd.ops.sum(fd.ops.exp(xs), dims=[1]))
        hot = fd.ops.eq(fd.ops.broadcast_in_dim(cols, [-1, -1], [1]),
                        fd.ops.broadcast_in_dim(labels, [-1, -1], [0]))
        picked = fd.ops.sum(fd.ops.where(hot, xs, 0.0), dims=[1])
        fd.add_output(fd.ops.sub(lse, picked))
    return fd


def _masked_mean_shifted() -> FusionDefinition:
    """Mean of ``x - max`` over a random mask (many selected elements per row)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
        mx = fd.ops.broadcast_in_dim(fd.ops.max(x, dims=[1]), [-1, -1], [0])
        s = fd.ops.sum(fd.ops.where(m, 0.0, fd.ops.sub(mx, x)), dims=[1])
        fd.add_output(fd.ops.div(s, fd.ops.sum(fd.ops.cast(m, DataType.Float), dims=[1])))
    return fd


def _two_sums() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sum(x, dims=[1]))
        fd.add_output(fd.ops.sum(fd.ops.mul(x, x), dims=[1]))
    return fd


def _centered_variance() -> FusionDefinition:
    """``sum((x - mean)^2)``: accumulated as ``sum(x^2)`` and ``sum(x)`` in double beside the
    mean, one pass."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1]), 1.0 / LONG)
        xc = fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, [-1, -1], [0]))
        fd.add_output(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]))
    return fd


def _batchnorm_variance() -> FusionDefinition:
    """BatchNorm's statistics over (N, H, W) of NCHW and the normalized output: the input
    read twice (statistics, then the output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1, -1])
        n = 2 * 190 * 190
        mean = fd.ops.div(fd.ops.sum(x, dims=[0, 2, 3]), float(n))
        xc = fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, [-1, -1, -1, -1], [1]))
        var = fd.ops.div(fd.ops.sum(fd.ops.mul(xc, xc), dims=[0, 2, 3]), float(n))
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        fd.add_output(fd.ops.mul(xc, fd.ops.broadcast_in_dim(rstd, [-1, -1, -1, -1], [1])))
        fd.add_output(var)
    return fd


def _nchw(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((2, 3, 190, 190)) * 3 + 40.0).astype(np.float32)


def _batchnorm_ref(x: np.ndarray) -> List[np.ndarray]:
    x = _d(x)
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    return [(x - mean) / np.sqrt(var + 1e-5), var.reshape(-1)]


def _rows(rng: np.random.Generator, rows: int = 3) -> np.ndarray:
    a = (rng.standard_normal((rows, LONG)) * 4).astype(np.float32)
    a[0, 17] = 60.0  # exp(x) overflows float32 without the maximum
    return a


def _ce_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    x = _rows(rng, 4)
    return [x, rng.integers(0, LONG, size=4).astype(np.int64), np.arange(LONG, dtype=np.int64)]


def _ce_ref(x: np.ndarray, labels: np.ndarray, cols: np.ndarray) -> List[np.ndarray]:
    x = x.astype(np.float64)
    return [_lse_ref(x, 1) - x[np.arange(len(labels)), labels]]


def _masked_inputs(rng: np.random.Generator) -> List[np.ndarray]:
    return [_rows(rng), rng.random((3, LONG)) < 0.3]


def _masked_ref(x: np.ndarray, m: np.ndarray) -> List[np.ndarray]:
    x = x.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    return [np.where(m, 0.0, mx - x).sum(axis=1) / m.sum(axis=1)]


def _d(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


Case = Tuple[Callable[[], FusionDefinition], Callable[[np.random.Generator], List[np.ndarray]],
             Callable[..., List[np.ndarray]], int]

# name: (build, inputs, float64 reference, passes over the row)
CASES = {
    "logsumexp_written_out": (lambda: _logsumexp_written_out(False), lambda r: [_rows(r)],
                              lambda x: [_lse_ref(x, 1)], 1),
    "logsumexp_keepdim_max": (lambda: _logsumexp_written_out(True), lambda r: [_rows(r)],
                              lambda x: [_lse_ref(x, 1)], 1),
    "log_softmax": (_log_softmax, lambda r: [_rows(r)], lambda x: [_d(x) - _lse_ref(x, 1, True)], 2),
    "softmax": (_softmax, lambda r: [_rows(r)], lambda x: [np.exp(_d(x) - _lse_ref(x, 1, True))], 2),
    "cross_entropy_masked_sum": (_cross_entropy_masked_sum, _ce_inputs, _ce_ref, 1),
    "masked_mean_shifted": (_masked_mean_shifted, _masked_inputs, _masked_ref, 1),
    "two_sums": (_two_sums, lambda r: [_rows(r)], lambda x: [_d(x).sum(1), (_d(x) ** 2).sum(1)], 1),
    "centered_variance": (_centered_variance, lambda r: [_rows(r)],
                          lambda x: [((_d(x) - _d(x).mean(1, keepdims=True)) ** 2).sum(1)], 1),
    # A mean 2500 standard deviations from zero: the double sums keep the variance.
    "centered_variance_offset": (_centered_variance, lambda r: [(_rows(r) * 0.1 + 1000.0).astype(np.float32)],
                                 lambda x: [((_d(x) - _d(x).mean(1, keepdims=True)) ** 2).sum(1)], 1),
    "batchnorm_variance": (_batchnorm_variance, lambda r: [_nchw(r)], _batchnorm_ref, 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_long_rows_match_numpy(name: str) -> None:
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(3))
    got = build().execute(a)
    for g, w in zip(got, ref(*a)):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_long_rows_read_once_per_pass(name: str) -> None:
    """Statistics that do not read each other share one pass over the row."""
    build, inputs, _, passes = CASES[name]
    assert _passes(build(), inputs(np.random.default_rng(4))) == [passes]


@pytest.mark.parametrize("cols,passes", [(20000, 0), (32000, 1), (50257, 1), (80000, 1)])
def test_rows_the_registers_cannot_hold_are_read_once(cols: int, passes: int) -> None:
    """Rows that the register-persistent schedule refuses (cross-entropy's one-hot mask
    compares an int64 column index, and the row is kept twice) are copied once into Shared
    memory while two blocks' rows fit there (no pass over memory inside the block); longer ones are
    streamed from memory, planned again with the one-pass statistics: the row kernel reads
    the logits once instead of once for the max and again for the sum."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, cols)) * 4).astype(np.float32)
    x[1, 3] = 70.0
    labels = rng.integers(0, cols, size=4).astype(np.int64)
    a = [x, labels, np.arange(cols, dtype=np.int64)]
    fd = _cross_entropy_masked_sum()
    assert _passes(fd, a) == [passes]
    (got,) = fd.execute(a)
    np.testing.assert_allclose(got.astype(np.float64), _ce_ref(*a)[0], rtol=2e-5, atol=2e-5)


# The fewest passes over a streamed row: the statistics in one, the output (if any) in a second.
ONE_PASS = {"logsumexp_written_out": 1, "cross_entropy_masked_sum": 1, "log_softmax": 2, "softmax": 2}


@pytest.mark.parametrize("cols", [12289, 24576, 32000, 50257])
@pytest.mark.parametrize("name", sorted(ONE_PASS))
def test_rows_are_held_on_chip_or_read_the_fewest_times(name: str, cols: int) -> None:
    """Whatever the row's length, a softmax-family row kernel either holds the row in
    registers (no pass over memory inside the block) or streams it with the statistics in one
    pass; lengths around where the register-persistent schedule gives up included."""
    build, inputs, ref, _ = CASES[name]
    rng = np.random.default_rng(cols)
    a = inputs(rng)
    a[0] = (rng.standard_normal((a[0].shape[0], cols)) * 4).astype(np.float32)
    if name == "cross_entropy_masked_sum":
        a[1] = rng.integers(0, cols, size=a[0].shape[0]).astype(np.int64)
        a[2] = np.arange(cols, dtype=np.int64)
    assert _passes(build(), a)[0] in (0, ONE_PASS[name])
    for g, w in zip(build().execute(a), ref(*a)):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5)


def test_a_row_weight_loads_with_the_rows_vectors() -> None:
    """An input broadcast along the rows and read along them (the int64 column index of a
    one-hot cross-entropy) loads with the same vectors as the streamed logits: its
    element-by-element loads, strided by the logits' vectors, kept L1 busy."""
    cols = 32000
    rng = np.random.default_rng(10)
    a = [rng.standard_normal((3, cols)).astype(np.float32), np.array([5, 31999, 0], np.int64),
         np.arange(cols, dtype=np.int64)]
    (k,) = _cross_entropy_masked_sum().lower(a).kernels
    assert re.search(r"loadVec\w*<int64_t, 2>", k.cuda_source)
    assert re.search(r"loadVec\w*<float, 2>", k.cuda_source)


def test_fully_masked_softmax_row_is_nan_as_in_numpy() -> None:
    a = _rows(np.random.default_rng(5))
    a[1, :] = -np.inf
    (got,) = _softmax().execute([a])
    assert np.isnan(got[1]).all()
    np.testing.assert_allclose(got[[0, 2]], np.exp(_d(a[[0, 2]]) - _lse_ref(a[[0, 2]], 1, True)), rtol=2e-5,
                               atol=1e-7)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC is not installed")
@pytest.mark.parametrize("name", sorted(CASES))
def test_long_row_kernels_compile(name: str) -> None:
    build, inputs, _, _ = CASES[name]
    for k in build().lower(inputs(np.random.default_rng(6))).kernels:
        compile_cubin(k.cuda_source, k.kernel_name, arch="sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_long_rows_match_numpy(name: str) -> None:
    cp = cupy_or_skip()
    build, inputs, ref, _ = CASES[name]
    a = inputs(np.random.default_rng(7))
    got = build().execute([cp.asarray(x) for x in a])
    for g, w in zip(got, ref(*a)):
        np.testing.assert_allclose(cp.asnumpy(g).astype(np.float64), w, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [32000, 50257, 128256])
def test_gpu_streamed_cross_entropy_rows_match_numpy(cols: int) -> None:
    cp = cupy_or_skip()
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((300, cols)) * 4).astype(np.float32)
    x[7, 11] = 75.0
    x[8, :] = -np.inf
    x[8, 3] = 2.0  # one finite logit: log-probability 0
    labels = rng.integers(0, cols, size=300).astype(np.int64)
    labels[8] = 3
    a = [x, labels, np.arange(cols, dtype=np.int64)]
    (got,) = _cross_entropy_masked_sum().execute([cp.asarray(v) for v in a])
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), _ce_ref(*a)[0], rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_gpu_logsumexp_infinities_and_nan() -> None:
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.logsumexp(x, dims=[1]))
    a = np.random.default_rng(8).standard_normal((6, 100003)).astype(np.float32)
    a[0, :] = -np.inf
    a[1, 5] = np.inf
    a[2, 7] = np.nan
    a[3, 99999] = 85.0
    a[4, [3, 70000]] = np.inf  # +inf twice: inf, not inf - inf
    a[5, [10, 50000]] = [np.inf, np.nan]  # a NaN after +inf: NaN
    (got,) = fd.execute([cp.asarray(a)])
    np.testing.assert_allclose(cp.asnumpy(got), _lse_ref(a, 1), rtol=2e-6, atol=1e-5, equal_nan=True)


# ------------------------------------------------------------------- variants users write
def _variant(kind: str, dtype: DataType, keepdim: bool, masked: bool) -> FusionDefinition:
    """A softmax-family fusion over the last axis as model code writes it: an optional
    causal-style mask filled with -inf, the max with or without keepdim."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        if masked:
            m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
            x = fd.ops.where(m, x, float("-inf"))
        mx = fd.ops.max(x, dims=[1], keepdim=keepdim)
        mb = mx if keepdim else fd.ops.broadcast_in_dim(mx, [-1, -1], [0])
        xs = fd.ops.sub(x, mb)
        s = fd.ops.sum(fd.ops.exp(xs), dims=[1], keepdim=True)
        if kind == "softmax":
            fd.add_output(fd.ops.div(fd.ops.exp(xs), s))
        elif kind == "log_softmax":
            fd.add_output(fd.ops.sub(xs, fd.ops.log(s)))
        else:  # logsumexp, [rows]
            lse = fd.ops.add(fd.ops.log(s), mb)
            fd.add_output(fd.ops.squeeze(lse, [1]))
    return fd


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Double])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_variants_match_numpy(kind: str, dtype: DataType, keepdim: bool, masked: bool) -> None:
    rng = np.random.default_rng(11)
    npd = np.float32 if dtype == DataType.Float else np.float64
    cols = LONG if dtype == DataType.Float else LONG // 2 + 1  # past the on-chip row either way
    x = (rng.standard_normal((3, cols)) * 5).astype(npd)
    ins: List[Any] = [x]
    xm = x.astype(np.float64)
    if masked:
        m = rng.random((3, cols)) < 0.7
        m[:, 0] = True
        ins.append(m)
        xm = np.where(m, xm, -np.inf)
    lse = _lse_ref(xm, 1, True)
    want = {"softmax": np.exp(xm - lse), "log_softmax": xm - lse, "logsumexp": lse[:, 0]}[kind]
    (got,) = _variant(kind, dtype, keepdim, masked).execute(ins)
    got = np.asarray(got, np.float64)
    if kind == "log_softmax":  # -inf where masked, on both sides
        assert np.array_equal(np.isneginf(got), np.isneginf(want))
        got, want = np.where(np.isneginf(want), 0.0, got), np.where(np.isneginf(want), 0.0, want)
    # float32: the log-sum-exp (about 12 here) is good to a few ulps, which log-softmax's
    # values near 0 see as an absolute error.
    tol = (2e-5, 5e-5) if dtype == DataType.Float else (1e-10, 1e-12)
    np.testing.assert_allclose(got, want, rtol=tol[0], atol=tol[1])



def _tile_order(source: str) -> List[Tuple[int, int]]:
    """For each tile of `source` (the body of an Unswitch loop): (line of its last vector
    load, line of its first accumulation)."""
    lines = source.splitlines()
    tiles = []
    for i, line in enumerate(lines):
        if not re.search(r"// [ri]US\d+\{", line):
            continue
        depth, body = 0, []
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            body.append((j, lines[j]))
            if depth == 0:
                break
        loads = [j for j, s in body if "kiln::loadVec" in s]
        # An accumulation: into the register, or staged for a block of log-sum-exp elements.
        acc = r"kiln_acc\d+ = kiln::\w+\(\)\(|kiln_blk\d+\[\w+\] = kiln::cast"
        accs = [j for j, s in body if re.search(acc, s)]
        if loads and accs:
            tiles.append((max(loads), min(accs)))
    return tiles


@pytest.mark.parametrize("name", ["ce_80000", "softmax_300000", "log_softmax_300000", "row_sum_4096"])
def test_a_long_rows_tile_issues_its_loads_before_its_math(name: str) -> None:
    # The rule: over a long row, every vector load of an unswitched tile comes before the
    # tile's first accumulation, so that all of them are in flight together (interleaved,
    # ptxas issued some after the first steps' math, and their latency was paid in the tile).
    if name == "ce_80000":  # too long for Shared memory: streamed
        fd, cols = _cross_entropy_masked_sum(), 80000
        ins: List[Any] = [np.zeros((4, cols), np.float32), np.zeros(4, np.int64),
                          np.arange(cols, dtype=np.int64)]
    elif name == "softmax_300000":  # too long for a cluster's Shared memory: streamed
        fd, cols = _softmax(), 300000
        ins = [np.zeros((4, cols), np.float32)]
    elif name == "log_softmax_300000":
        fd, cols = _log_softmax(), 300000
        ins = [np.zeros((4, cols), np.float32)]
    else:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            fd.add_output(fd.ops.sum(x, dims=[1]))
        ins = [np.zeros((4, 4096), np.float32)]
    tiles = [t for k in fd.lower(ins).kernels for t in _tile_order(k.cuda_source)]
    assert tiles, f"{name}: no unswitched tile with loads and accumulations"
    for last_load, first_acc in tiles:
        assert last_load < first_acc, f"{name}: a load at line {last_load} after math at line {first_acc}"


@pytest.mark.parametrize("shape, axis", [((2, 2, 2), 0), ((7, 3, 3), 0), ((5, 4, 6), 0), ((3, 5, 5), 2),
                                         ((1, 4, 4), 0), ((4, 9, 9), 1)])
@pytest.mark.parametrize("mask", ["triu", "tril", "cond_on_last_two"])
@pytest.mark.parametrize("term", ["plus", "minus", "from"])
def test_a_masked_sum_with_a_mask_broadcast_along_the_reduced_axis(shape: Tuple[int, ...], axis: int,
                                                                   mask: str, term: str) -> None:
    """``sum(triu(x + r), 0)`` of a 3-D ``x``, ``r`` a per-row term broadcast over the reduced
    axis: the term taken out of the masked sum is counted once per masked element of every
    reduced row, though the mask itself (``triu`` of the last two axes) is a broadcast along
    that axis (the count summed one row: ``[[8, 12], [0, 20]]`` for ``[[12, 18], [0, 30]]``)."""
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 7.0
    keep = [a for a in range(3) if a != axis]
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1, -1])
        r = fd.ops.broadcast_in_dim(fd.ops.sum(t, dims=[axis]), [-1, -1, -1], keep)
        v = {"plus": fd.ops.add(t, r), "minus": fd.ops.sub(t, r), "from": fd.ops.sub(r, t)}[term]
        if mask == "triu":
            m = fd.ops.triu(v)
        elif mask == "tril":
            m = fd.ops.tril(v) if hasattr(fd.ops, "tril") else fd.ops.triu(v, 1)
        else:
            cond = fd.ops.broadcast_in_dim(fd.ops.gt(fd.ops.sum(t, dims=[0]), 10.0), [-1, -1, -1], [1, 2])
            m = fd.ops.where(cond, v, 0.0)
        fd.add_output(fd.ops.sum(m, dims=[axis]))
    xd = x.astype(np.float64)
    rd = np.expand_dims(xd.sum(axis), axis)
    vd = {"plus": xd + rd, "minus": xd - rd, "from": rd - xd}[term]
    if mask == "triu":
        md = np.triu(vd)
    elif mask == "tril":
        md = np.tril(vd) if hasattr(fd.ops, "tril") else np.triu(vd, 1)
    else:
        md = np.where((xd.sum(0) > 10.0)[None], vd, 0.0)
    np.testing.assert_allclose(fd.execute([x])[0], md.sum(axis), rtol=1e-5, atol=1e-4)
