"""Thread-block clusters (``fd.set_cluster``): a reduction over the clusters' block dimension
combines the cluster's blocks through distributed Shared memory and leaves the result in
every block. Values through the interpreter against NumPy (float64), the CUDA it emits,
the KilnErrors of schedules a cluster cannot run, the automatic normalization's cluster
path (``KILN_CLUSTER_ROWS=1``) in a child process, and the same on the GPU (``-m gpu``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import DataType, FusionDefinition, KilnError, ParallelType

RNG = np.random.default_rng(5)
ROOT = Path(__file__).resolve().parent.parent


def scaled_rows(rows: int, cols: int, cluster: int, threads: int, op: str = "sum",
                along: ParallelType = ParallelType.BIDy) -> FusionDefinition:
    """``y = x * reduce(x * x, 1)[:, None]`` over [rows, cols]: the row split over a cluster of
    ``cluster`` blocks along ``along`` (``[rows, cluster, threads, rest]``), each thread
    holding its cells of ``x`` in registers across the cluster reduction."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, cols], dtype=DataType.Float)
        sq = fd.ops.mul(x, x)
        s = getattr(fd.ops, op)(sq, [1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.mul(x, sb)
        fd.add_output(y)
    xc = x.cache_after()
    for t in (xc, sq, s, sb, y):
        t.split(1, cluster, inner_split=False)  # [rows, C, cols / C]
        t.split(2, threads, inner_split=False)  # [rows, C, T, rest]
        t.axis(0).parallelize(ParallelType.BIDx if along != ParallelType.BIDx else ParallelType.BIDy)
        t.axis(1).parallelize(along)
        t.axis(2).parallelize(ParallelType.TIDx)
    fd.set_cluster(along, cluster)
    xc.inline_at(3)
    sq.inline_at(-1)
    s.inline_at(1)
    sb.inline_at(-1)
    return fd


def reference(x: np.ndarray, op: str) -> np.ndarray:
    x64 = x.astype(np.float64)
    r = getattr(np, op)(x64 * x64, axis=1, keepdims=True)
    return x64 * r


@pytest.mark.parametrize("rows, cols, cluster, threads, op", [
    (3, 1000, 4, 32, "sum"),
    (2, 4096, 2, 128, "sum"),
    (5, 777, 8, 32, "max"),
    (1, 96, 3, 32, "sum"),
    (4, 2048, 8, 64, "min"),
])
def test_cluster_reduction_values(rows: int, cols: int, cluster: int, threads: int, op: str) -> None:
    """Every block of a row's cluster computes the row's whole reduction: odd sizes, a cluster
    of 3, sizes the split does not divide (the last block's part is short)."""
    fd = scaled_rows(rows, cols, cluster, threads, op)
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, reference(x, op), rtol=2e-5, atol=1e-5)


@settings(max_examples=int(os.environ.get("KILN_CLUSTER_EXAMPLES", "25")), deadline=None, database=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 3000), cluster=st.integers(2, 8),
       threads=st.sampled_from([32, 64, 96, 128, 256]), op=st.sampled_from(["sum", "max", "min"]),
       along=st.sampled_from([ParallelType.BIDx, ParallelType.BIDy]))
def test_random_cluster_reductions(rows: int, cols: int, cluster: int, threads: int, op: str,
                                   along: ParallelType) -> None:
    """Any row length, cluster size, block size and reduction: every block of a cluster holds
    its row's reduction, whichever parts of the row are empty (more blocks or threads than
    cells). The CUDA compiles (tests/conftest.py compiles what the tests generate)."""
    fd = scaled_rows(rows, cols, cluster, threads, op, along)
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, reference(x, op), rtol=2e-5, atol=1e-5)


def test_cluster_along_bidx() -> None:
    """The clusters may run along BIDx (rows then on BIDy)."""
    fd = scaled_rows(3, 512, 4, 32, along=ParallelType.BIDx)
    x = RNG.standard_normal((3, 512)).astype(np.float32)
    (got,) = fd.execute([x])
    np.testing.assert_allclose(got, reference(x, "sum"), rtol=2e-5, atol=1e-5)
    (k,) = fd.lower([x]).kernels
    assert "__cluster_dims__(4, 1, 1)" in k.cuda_source


def test_emitted_cuda() -> None:
    """The kernel declares its cluster shape and block size, reduces with clusterAllReduce,
    and needs no Global work buffers or semaphores (those of a grid reduction)."""
    fd = scaled_rows(3, 1000, 4, 32)
    x = np.zeros((3, 1000), np.float32)
    low = fd.lower([x])
    (k,) = low.kernels
    src = k.cuda_source
    assert "__cluster_dims__(1, 4, 1) kiln_kernel(" in src
    assert re.search(r"kiln::clusterAllReduce<true, false, false, \d+>\(", src)
    assert "gridReduce" not in src.split("#endif  // KILN_RUNTIME_CUH")[1]
    assert "_sync" not in str(low.host_program) and "_work" not in str(low.host_program)


def test_bad_cluster_requests_are_kiln_errors() -> None:
    """A thread dimension, a size outside 2..8, or a non-ParallelType is refused at once."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 64], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, [1]))
    with pytest.raises(KilnError, match=r"TIDx is not a block dimension"):
        fd.set_cluster(ParallelType.TIDx, 2)
    for size in (0, 1, 9, 16):
        with pytest.raises(KilnError, match=rf"a cluster of {size} blocks along BIDy; expected 2 to 8"):
            fd.set_cluster(ParallelType.BIDy, size)
    with pytest.raises(KilnError, match=r"pt must be a ParallelType"):
        fd.set_cluster("BIDy", 2)  # type: ignore[arg-type]
    with pytest.raises(KilnError, match=r"size must be an int"):
        fd.set_cluster(ParallelType.BIDy, 2.0)  # type: ignore[arg-type]


def test_grid_must_be_one_cluster() -> None:
    """A grid along the clusters' dimension other than the cluster size is a KilnError naming
    the axis, raised when the fusion is lowered (before anything runs)."""
    fd = scaled_rows(3, 1000, 4, 32)
    fd.set_cluster(ParallelType.BIDy, 2)  # the schedule splits the row into 4 blocks
    x = np.zeros((3, 1000), np.float32)
    msg = r"clusters of 2 blocks along BIDy.*must be 2 blocks.*launches 4 \(T\d+ axis 1"
    with pytest.raises(KilnError, match=msg):
        fd.execute([x])


def _child(code: str) -> str:
    env = dict(os.environ, KILN_CLUSTER_ROWS="1")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, cwd=str(ROOT), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_automatic_clusters_for_long_rows() -> None:
    """With ``KILN_CLUSTER_ROWS=1`` the register-persistent normalization splits rows longer
    than 2048 vectors over the smallest cluster whose blocks' parts are at most that long
    (softmax, RMSNorm with a weight, LayerNorm: one, one and two reductions), values against
    float64 NumPy; shorter rows keep one block per row."""
    out = _child("""
        import numpy as np
        from kiln import DataType, FusionDefinition
        from kiln.execute import lowered_for
        rng = np.random.default_rng(0)
        def rows(fd, v):
            return fd.ops.broadcast_in_dim(v, shape=[-1, -1], broadcast_dims=[0])
        def clusters(fd, ins):
            srcs = [k.cuda_source_for(False) for k in lowered_for(fd, ins).kernels]
            return [s[s.index("__cluster_dims__("):].split(")")[0] + ")" if "__cluster_dims__(" in s else "-"
                    for s in srcs]
        def softmax():
            with FusionDefinition() as fd:
                x = fd.define_tensor([-1, -1], dtype=DataType.Float)
                e = fd.ops.exp(fd.ops.sub(x, rows(fd, fd.ops.max(x, [1]))))
                fd.add_output(fd.ops.div(e, rows(fd, fd.ops.sum(e, [1]))))
            return fd
        def rmsnorm():
            with FusionDefinition() as fd:
                x = fd.define_tensor([-1, -1], dtype=DataType.Float)
                w = fd.define_tensor([-1], dtype=DataType.Float)
                ms = fd.ops.mean(fd.ops.mul(x, x), [1])
                h = fd.ops.mul(x, rows(fd, fd.ops.rsqrt(fd.ops.add(ms, 1e-6))))
                fd.add_output(fd.ops.mul(h, fd.ops.broadcast_in_dim(w, shape=[-1, -1], broadcast_dims=[1])))
            return fd
        def layernorm():
            with FusionDefinition() as fd:
                x = fd.define_tensor([-1, -1], dtype=DataType.Float)
                d = fd.ops.sub(x, rows(fd, fd.ops.mean(x, [1])))
                var = fd.ops.mean(fd.ops.mul(d, d), [1])
                fd.add_output(fd.ops.mul(d, rows(fd, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))))
            return fd
        for m, n in [(3, 65536), (2, 20480), (4, 8192), (3, 40000)]:
            x = rng.standard_normal((m, n)).astype(np.float32)
            h = x.astype(np.float64)
            e = np.exp(h - h.max(1, keepdims=True))
            fd = softmax()
            np.testing.assert_allclose(fd.execute([x])[0], e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-8)
            print("softmax", n, clusters(fd, [x]))
            w = rng.standard_normal(n).astype(np.float32)
            fd = rmsnorm()
            ref = w * (h / np.sqrt((h * h).mean(1, keepdims=True) + 1e-6))
            np.testing.assert_allclose(fd.execute([x, w])[0], ref, rtol=1e-4, atol=1e-5)
            print("rmsnorm", n, clusters(fd, [x, w]))
            fd = layernorm()
            dd = h - h.mean(1, keepdims=True)
            ref = dd / np.sqrt((dd * dd).mean(1, keepdims=True) + 1e-5)
            np.testing.assert_allclose(fd.execute([x])[0], ref, rtol=1e-4, atol=1e-4)
            print("layernorm", n, clusters(fd, [x]))
    """)
    got = {" ".join(line.split()[:2]): line.split(None, 2)[2] for line in out.splitlines()}
    want = {65536: "['__cluster_dims__(1, 8, 1)']", 20480: "['__cluster_dims__(1, 4, 1)']", 8192: "['-']",
            40000: "['__cluster_dims__(1, 8, 1)']"}
    for name in ("softmax", "rmsnorm", "layernorm"):
        for n, w in want.items():
            assert got[f"{name} {n}"] == w, (name, n, got)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols, cluster, threads, op", [
    (64, 65536, 4, 256, "sum"),
    (7, 4099, 8, 32, "max"),
    (33, 12288, 2, 128, "sum"),
])
def test_cluster_reduction_on_gpu(rows: int, cols: int, cluster: int, threads: int, op: str) -> None:
    """The cluster reduction on the GPU against NumPy."""
    cp = cupy_or_skip()
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("clusters need sm_90")
    fd = scaled_rows(rows, cols, cluster, threads, op)
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    (got,) = fd.execute([cp.asarray(x)])
    np.testing.assert_allclose(cp.asnumpy(got), reference(x, op), rtol=2e-5, atol=1e-5)
