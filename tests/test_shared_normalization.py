"""Normalizations whose rows stay in Shared memory (the ``shared_normalization`` scheduler):
rows too long for registers but short enough for a block's Shared memory. Each full-size
input of a row is copied once into Shared memory, every pass over the row reads it there.

CPU: model families (tests/families.py) at such row lengths through ``fd.execute`` in the
interpreter, against float64 NumPy; the schedule picked at each length; golden checks on the
Shared allocation and the launch. GPU (``-m gpu``): the same families on CuPy inputs,
including rows of more than 48 KiB of Shared memory (the launch raises the kernel's limit).
"""

from __future__ import annotations

import re
from typing import List, Tuple

import numpy as np
import pytest
from families import SPECS, output_f64
from family_checks import array_shapes as _shapes
from family_checks import check_outputs as _check
from family_checks import family_inputs as _inputs
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition

BUILDERS = {s.name: s.build for s in SPECS}

# Families whose rows the register-persistent schedule cannot hold (or holds with too few
# loads in flight) at these lengths while two blocks' row copies fit in an SM's Shared
# memory (227 KiB on sm_90): one float input up to ~28k columns, one half or bfloat16 input
# up to ~56k.
FLOAT = ["layernorm", "layernorm_var_mean", "layernorm_div_after_broadcast", "layernorm_from_moments",
         "layernorm_keepdim", "rmsnorm_t5", "log_softmax", "softmax_with_row_max", "softmax_long_rows",
         "layernorm_long_rows"]
LOWP = ["layernorm_half", "layernorm_bf16", "rmsnorm_llama_half", "rmsnorm_gemma_bf16"]
CASES: List[Tuple[str, Tuple[int, int]]] = (
    [(name, sizes) for name in FLOAT for sizes in [(2, 20000), (3, 20011), (4, 1536)]]
    + [(name, sizes) for name in LOWP for sizes in [(2, 40000), (3, 40003), (5, 3000)]]
    # The logits and an int64 column index.
    + [("cross_entropy", (3, 20000)), ("cross_entropy", (4, 1000))]
)


@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{a}x{b}" for n, (a, b) in CASES])
def test_rows_held_in_shared_memory_match_numpy(name: str, sizes: Tuple[int, int]) -> None:
    fam = BUILDERS[name](sizes)
    inputs = _inputs(fam)
    assert fam.fd._core.auto_program(_shapes(inputs)).heuristic == "shared_normalization"
    _check(fam, fam.fd.execute(inputs), fam.expected(inputs))


@pytest.mark.parametrize("sizes", [(5, 3000), (3, 4096), (2, 3992)])
def test_two_row_inputs_at_one_vector_per_thread_stay_in_registers(sizes: Tuple[int, int]) -> None:
    # Every pass of the Shared schedule re-reads each row input from Shared memory: the
    # pre-LN residual LayerNorm (x + residual, half) ran 141.7 us in Shared memory against
    # 125.2 us in registers on the H200 at [16384, 4096], where one-input LayerNorm and
    # RMSNorm are faster in Shared memory.
    fam = BUILDERS["prenorm_residual_layernorm_half"](sizes)
    inputs = _inputs(fam)
    assert fam.fd._core.auto_program(_shapes(inputs)).heuristic == "normalization"
    _check(fam, fam.fd.execute(inputs), fam.expected(inputs))
    one = BUILDERS["layernorm_half"](sizes)
    assert one.fd._core.auto_program(_shapes(_inputs(one))).heuristic == "shared_normalization"


def _softmax(dtype: DataType = DataType.Float) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        xf = fd.ops.cast(x, DataType.Float)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[1], keepdim=True)))
        y = fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


@pytest.mark.parametrize("cols,kind", [(1000, "normalization"), (1536, "shared_normalization"),
                                       (4096, "normalization"), (20000, "shared_normalization"),
                                       (28000, "shared_normalization"), (30000, "normalization"),
                                       (40000, "shared_normalization"), (300_000, "looped_normalization")])
def test_the_row_goes_to_registers_then_shared_memory_then_memory(cols: int, kind: str) -> None:
    # Float rows: 250 vectors of 4 fit one per thread in registers (too short for Shared
    # memory to help); 384 vectors, one per thread, keep more loads in flight from Shared
    # memory; 1024 vectors are two per thread in registers; from 3585 vectors (eight and
    # more per thread) Shared memory again, while two blocks' rows fit in an SM's 232 448
    # bytes (28000 floats: 112 000 bytes each); past that, registers while they hold the row
    # (30000: fifteen vectors per thread), then split over a cluster's blocks in Shared memory
    # (40000: sm_90), then streamed from memory (300 000 floats: more than a cluster of eight
    # blocks holds with two blocks per SM).
    assert _softmax()._core.auto_program([[2, cols]]).heuristic == kind


def test_the_row_copy_is_allocated_once_and_read_without_a_barrier() -> None:
    fd = _softmax()
    x = np.random.default_rng(1).standard_normal((2, 20000)).astype(np.float32)
    (k,) = fd.lower([x]).kernels
    ir = k.kernel_ir
    # [p, T, v]: each thread's vectors where the input has them, so that 16-byte accesses of
    # consecutive threads are consecutive (no bank conflicts).
    m = re.search(r"ALLOCATE (T\d+) Shared float \[5, 1000, 4\]", ir)
    assert m, ir
    copy = m.group(1)
    assert len(re.findall(rf"VECTOR x4 {copy} = set\(T0\)", ir)) == 1  # one copy from memory
    assert len(re.findall(rf"VECTOR x4 T\d+ = set\({copy}\)", ir)) == 3  # one read per pass
    # Every thread reads back only what it copied: no barrier between the copy and the passes.
    assert "__syncthreads" not in ir and "SYNC" not in ir
    assert k.launch["block"] == ("1000", "1", "1")
    assert int(k.launch["smem_bytes"]) >= 80_000
    (got,) = fd.execute([x])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-9)


def test_an_odd_row_copies_element_by_element() -> None:
    fd = _softmax()
    x = np.random.default_rng(2).standard_normal((3, 20001)).astype(np.float32)
    auto = fd._core.auto_program([[3, 20001]])
    assert auto.heuristic == "shared_normalization" and auto.params[0] == 1  # no vectors
    (got,) = fd.execute([x])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-9)


# ----------------------------------------------------------------------------- GPU
GPU_SIZES: List[Tuple[int, int]] = [(3, 20000), (64, 40000), (5, 20011), (300, 1536), (100, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", GPU_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["layernorm", "layernorm_bf16", "rmsnorm_llama_half", "log_softmax",
                                  "cross_entropy", "softmax_long_rows", "prenorm_residual_layernorm_half"])
def test_rows_held_in_shared_memory_on_the_gpu(name: str, sizes: Tuple[int, int]) -> None:
    cp = cupy_or_skip()
    fam = BUILDERS[name](sizes)
    inputs = _inputs(fam)
    if fam.fd._core.auto_program(_shapes(inputs)).heuristic != "shared_normalization":
        pytest.skip(f"{name} at {sizes}: another schedule")  # e.g. float rows of 40000
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in inputs]
    _check(fam, fam.fd.execute(dev), fam.expected(inputs))


@pytest.mark.gpu
def test_a_bfloat16_softmax_over_40000_columns_on_the_gpu() -> None:
    # 80 KB of Shared memory per block: past the 48 KiB a kernel gets without asking.
    cp = cupy_or_skip()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(3).standard_normal((300, 40000)).astype(ml_dtypes.bfloat16)
    fd = _softmax(DataType.BFloat16)
    assert fd._core.auto_program([[300, 40000]]).heuristic == "shared_normalization"
    (got,) = fd.execute([cp.asarray(x)])
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(1, keepdims=True))
    np.testing.assert_allclose(output_f64(got), e / e.sum(1, keepdims=True), rtol=1e-2, atol=1e-6)


def _cross_entropy(dtype: DataType) -> FusionDefinition:
    """``F.cross_entropy(x.float(), labels, reduction='none')``: one float loss per row."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        labels = fd.define_tensor([-1], dtype=DataType.Int)
        xf = fd.ops.cast(x, DataType.Float)
        mx = fd.ops.max(xf, dims=[1])
        rows = [fd.ops.size(x, 0), fd.ops.size(x, 1)]
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.broadcast_in_dim(mx, rows, [0])))
        lse = fd.ops.add(fd.ops.log(fd.ops.sum(e, dims=[1])), mx)
        index = fd.ops.broadcast_in_dim(labels, [fd.ops.size(x, 0), 1], [0])
        picked = fd.ops.squeeze(fd.ops.take_along_axis(x, index, 1), [1])
        fd.add_output(fd.ops.sub(lse, fd.ops.cast(picked, DataType.Float)))
    return fd


@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16])
def test_a_float_result_per_row_keeps_the_rows_two_byte_vectors(dtype: DataType) -> None:
    # The loss is written once per row, not with the row's vectors: the rows move in vectors
    # of eight 2-byte elements, one warp per row of 1024, as softmax's do (a float per-row
    # output once halved them, and the narrower rows went to Shared memory).
    fd = _cross_entropy(dtype)
    auto = fd._core.auto_program([[16384, 1024], [16384]])
    assert (auto.heuristic, auto.params[0]) == ("normalization", 8)
    assert _softmax(dtype)._core.auto_program([[16384, 1024]]).params[0] == 8
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 1024)) * 2).astype(np.float16)
    labels = rng.integers(0, 1024, 64).astype(np.int64)
    if dtype == DataType.Half:
        (got,) = fd.execute([x, labels])
        x64 = x.astype(np.float64)
        m = x64.max(1, keepdims=True)
        want = np.log(np.exp(x64 - m).sum(1)) + m[:, 0] - x64[np.arange(64), labels]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
