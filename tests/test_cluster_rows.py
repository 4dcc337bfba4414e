"""Rows too long for two blocks' Shared memory per SM, split over a thread-block cluster by the
``shared_normalization`` scheduler (sm_90+): each block of a cluster of C holds 1/C of the row,
copied in by one bulk copy, and the row's reductions combine the blocks through distributed
Shared memory. Also the canonical rewrite that computes softmax and log-softmax over such rows
from the log-sum-exp alone (no maximum, one reduction).

CPU: values of model families in the interpreter against float64 NumPy at cluster sizes 2 to
8, the schedule's parameters, the emitted kernel (cluster shape, bulk copy, barriers), the
rewrite over random ways of writing softmax and log-softmax (hypothesis), and the environment
switches in child processes. GPU (``-m gpu``): the same families on CuPy inputs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import pytest
from families import SPECS, output_f64
from family_checks import array_shapes as _shapes
from family_checks import check_outputs as _check
from family_checks import family_inputs as _inputs
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition

BUILDERS = {s.name: s.build for s in SPECS}

# float rows of 40000 (160 KB) to 131136 (512 KB) and half/bfloat16 rows of 65536 to 262144:
# more than two blocks' Shared memory per SM (227 KiB on sm_90), at most a cluster of eight.
FLOAT = ["layernorm", "rmsnorm_t5", "log_softmax", "softmax_long_rows", "layernorm_var_mean"]
# Two float row inputs: twice the bytes per row, up to what eight blocks hold.
TWO_INPUTS = ["bert_residual_layernorm", "softmax_backward"]
LOWP = ["layernorm_bf16", "rmsnorm_llama_half", "layernorm_half", "rmsnorm_gemma_bf16"]
CASES: List[Tuple[str, Tuple[int, int]]] = (
    [(name, sizes) for name in FLOAT for sizes in [(3, 40000), (2, 65536), (2, 131136)]]
    + [(name, sizes) for name in LOWP for sizes in [(2, 65536), (2, 131136), (1, 262144)]]
    + [(name, sizes) for name in TWO_INPUTS for sizes in [(3, 40000), (2, 65536)]]
)


@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{a}x{b}" for n, (a, b) in CASES])
def test_rows_split_over_a_cluster_match_numpy(name: str, sizes: Tuple[int, int]) -> None:
    fam = BUILDERS[name](sizes)
    inputs = _inputs(fam)
    auto = fam.fd._core.auto_program(_shapes(inputs))
    assert auto.heuristic == "shared_normalization", auto.heuristic
    vector, per_thread, threads, cluster = list(auto.params)[:4]
    assert cluster in (2, 4, 8), auto.params
    # Each block's part of the row: a whole number of vectors, at most 64 KiB of copies.
    part = sizes[1] // cluster
    assert part * cluster == sizes[1] and part % vector == 0
    assert threads * per_thread * vector >= part
    _check(fam, fam.fd.execute(inputs), fam.expected(inputs))


def _softmax(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        xf = fd.ops.cast(x, DataType.Float)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[1], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)), dtype))
    return fd


def test_the_kernel_copies_each_part_in_one_bulk_copy_and_reduces_over_the_cluster() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    fd = _softmax()
    x = np.random.default_rng(1).standard_normal((3, 65536)).astype(ml_dtypes.bfloat16)
    # Inputs that start 16-byte aligned (as the host finds NumPy's, CuPy's and torch's) take
    # bulk copies; others every thread's own vector copies (a bulk copy of an unaligned
    # address would be one thread's element loop).
    auto = fd._core.auto_program([[3, 65536]], aligned_bases=True)
    assert auto.heuristic == "shared_normalization" and list(auto.params)[:4] == [8, 16, 256, 2]
    plain = fd._core.auto_program([[3, 65536]], aligned_bases=False)
    assert list(plain.params)[:4] == [8, 8, 512, 2], plain.params
    (k,) = fd.lower([x]).kernels
    ir, src = k.kernel_ir, k.cuda_source
    # One bulk copy of the block's 32768 elements (64 KiB), one barrier, waited on before reads.
    assert re.search(r"ALLOCATE (T\d+) Shared bfloat16 \[32768\]", ir), ir
    bulk = r"BULK T\d+\[0\] <- T0\[blockIdx\.x \* 65536 \+ blockIdx\.y \* 32768\] x 32768"
    assert len(re.findall(bulk, ir)) == 1
    assert "MBARRIER_INIT" in ir and "MBARRIER_WAIT" in ir and "MBARRIER_INVAL" in ir
    # The softmax needs the log-sum-exp alone: one reduction, no maximum.
    assert len(re.findall(r"reduce_\w+", ir)) == 1 and "reduce_logsumexp" in ir
    assert "__cluster_dims__(1, 2, 1)" in src
    assert re.search(r"kiln::clusterAllReduce<true, false, false, 2>\(", src)
    # The kernel ends by waiting for the peers that may still read this block's partial.
    assert "kiln::clusterSettle(kiln_cluster_pending);\n}" in src
    assert k.launch["grid"] == ("i0", "2", "1") and k.launch["block"] == ("256", "1", "1")
    (got,) = fd.execute([x])
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(1, keepdims=True))
    np.testing.assert_allclose(output_f64(got), e / e.sum(1, keepdims=True), rtol=1e-2, atol=1e-6)


def test_a_total_over_the_rows_keeps_one_block_per_row() -> None:
    # A cluster's blocks would each hold the row's statistics; a total over the rows (a mean
    # loss) is planned on its own: no cluster where the fusion has one.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.max(x, dims=[1], keepdim=True)
        d = fd.ops.sub(x, m)
        y = fd.ops.div(fd.ops.exp(d), fd.ops.sum(fd.ops.exp(d), dims=[1], keepdim=True))
        fd.add_output(fd.ops.sum(fd.ops.sum(y, dims=[1]), dims=[0]))
    x = np.random.default_rng(2).standard_normal((3, 65536)).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, 3.0, rtol=1e-4)


# ----------------------------------------------------------------------------- the rewrite
@st.composite
def _softmax_variants(draw: Any) -> Tuple[str, bool, str, int, float]:
    kind = draw(st.sampled_from(["softmax", "log_softmax"]))
    keepdim = draw(st.booleans())
    log_order = draw(st.sampled_from(["log_of_broadcast", "broadcast_of_log"]))
    cols = draw(st.sampled_from([33000, 40000, 65536, 131072, 70001]))
    scale = draw(st.sampled_from([0.5, 4.0, 30.0]))
    return kind, keepdim, log_order, cols, scale


def _written(kind: str, keepdim: bool, log_order: str) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        if keepdim:
            m = fd.ops.max(x, dims=[1], keepdim=True)
        else:
            m = fd.ops.broadcast_in_dim(fd.ops.max(x, dims=[1]), shape=[-1, -1], broadcast_dims=[0])
        d = fd.ops.sub(x, m)
        e = fd.ops.exp(d)
        s = fd.ops.sum(e, dims=[1], keepdim=keepdim)

        def wide(v: Any) -> Any:
            return v if keepdim else fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[0])
        if kind == "softmax":
            fd.add_output(fd.ops.div(e, wide(s)))
        elif log_order == "log_of_broadcast":
            fd.add_output(fd.ops.sub(d, fd.ops.log(wide(s))))
        else:
            fd.add_output(fd.ops.sub(d, wide(fd.ops.log(s))))
    return fd


@settings(max_examples=int(os.environ.get("KILN_CLUSTER_ROWS_EXAMPLES", "12")), deadline=None, database=None)
@given(_softmax_variants())
def test_softmax_over_long_rows_needs_no_maximum(case: Tuple[str, bool, str, int, float]) -> None:
    kind, keepdim, log_order, cols, scale = case
    fd = _written(kind, keepdim, log_order)
    x = (np.random.default_rng(cols).standard_normal((2, cols)) * scale).astype(np.float32)
    x[1, 7] = 60.0  # a large outlier: exp(x - max) and exp(x - lse) differ in how they round
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1, keepdims=True)) + x64.max(1, keepdims=True)
    want = np.exp(x64 - lse) if kind == "softmax" else x64 - lse
    (got,) = fd.execute([x])
    # float32 sums over 33k-131k elements: about sqrt(n) ulps of the log-sum-exp.
    tol = (3e-5, 1e-9) if kind == "softmax" else (2e-5, 5e-5)
    np.testing.assert_allclose(got, want, rtol=tol[0], atol=tol[1])
    # The reductions computed (an unswitched tile and its remainder print one twice).
    reductions = {r for k in fd.lower([x]).kernels for r in re.findall(r"(T\d+ = reduce_\w+)\(", k.kernel_ir)}
    assert [r.split(" = ")[1] for r in reductions] == ["reduce_logsumexp_floored"], reductions


def test_a_maximum_with_another_reader_stays() -> None:
    # The max is also an output: its reduction stays, the softmax still reads only the lse.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mx = fd.ops.max(x, dims=[1])
        e = fd.ops.exp(fd.ops.sub(x, fd.ops.broadcast_in_dim(mx, shape=[-1, -1], broadcast_dims=[0])))
        s = fd.ops.sum(e, dims=[1])
        fd.add_output(fd.ops.div(e, fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])))
        fd.add_output(mx)
    x = np.random.default_rng(3).standard_normal((2, 65536)).astype(np.float32)
    y, mx = fd.execute([x])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-12)
    np.testing.assert_array_equal(mx, x.max(1))


# ----------------------------------------------------------------------------- switches
_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kiln import DataType, FusionDefinition
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))
    auto = fd._core.auto_program([[2, 65536]], aligned_bases=True)
    x = np.random.default_rng(4).standard_normal((2, 65536)).astype(np.float32)
    ir = fd.lower([x]).kernels[0].kernel_ir
    (y,) = fd.execute([x])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    ok = np.allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-12)
    print(auto.heuristic, list(auto.params)[:4], "BULK" in ir, ok)
    """
)


SWITCHES = [({}, "shared_normalization [4, 16, 256, 4] True True"),
            ({"KILN_BULK_ROWS": "0"}, "shared_normalization [4, 8, 512, 4] False True"),
            ({"KILN_CLUSTER_ROWS": "0"}, "looped_normalization")]


@pytest.mark.parametrize("env,want", SWITCHES)
def test_switches_pick_the_copy_and_the_cluster(env: dict, want: str) -> None:
    full = dict(os.environ)
    for k in ("KILN_BULK_ROWS", "KILN_CLUSTER_ROWS", "KILN_ROWS_IN_SHARED"):
        full.pop(k, None)
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=full, capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(want), line
    assert line.endswith("True"), line


# ----------------------------------------------------------------------------- GPU
# Two row inputs (a residual added before the LayerNorm, a softmax's backward) take two bulk
# copies per block, each on its own mbarrier.
GPU_CASES = [("softmax_long_rows", (5, 65536)), ("layernorm_bf16", (7, 131072)),
             ("rmsnorm_llama_half", (3, 262144)), ("log_softmax", (4, 131136)), ("layernorm", (6, 40000)),
             ("bert_residual_layernorm", (3, 65536)), ("prenorm_residual_layernorm_half", (2, 65536)),
             ("softmax_backward", (3, 65536))]


@pytest.mark.gpu
@pytest.mark.parametrize("name,sizes", GPU_CASES, ids=[f"{n}-{a}x{b}" for n, (a, b) in GPU_CASES])
def test_rows_split_over_a_cluster_on_the_gpu(name: str, sizes: Tuple[int, int]) -> None:
    cp = cupy_or_skip()
    fam = BUILDERS[name](sizes)
    inputs = _inputs(fam)
    auto = fam.fd._core.auto_program(_shapes(inputs))
    assert auto.heuristic == "shared_normalization" and list(auto.params)[3] > 1, auto.params
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in inputs]
    _check(fam, fam.fd.execute(dev), fam.expected(inputs))
