"""Sharded fusions on GPUs with NCCL: ranks started by torchrun, one process per GPU, each
checking its outputs against its part of the unsharded float64 result
(``tests/multidevice_worker.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gpu_util import cupy_or_skip

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multidevice_worker.py")


def run_ranks(n: int) -> str:
    """Start ``n`` ranks with torchrun; returns their output (fails on a non-zero exit)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER]
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), *sys.path]))
    env = dict(os.environ, PYTHONPATH=path)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    return out


def gpus() -> int:
    """CUDA devices visible to torch (0 without torch or a GPU)."""
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    return int(torch.cuda.device_count())


def test_one_rank_nccl_run_matches_and_shows_allreduce() -> None:
    """One rank on one GPU: NCCL collectives run, results match, the host program shows them."""
    if gpus() < 1:
        pytest.skip("no GPU")
    out = run_ranks(1)
    assert "ALL OK on 1 rank(s)" in out
    assert "Allreduce T1 -> T2 over mesh [0] (sum, in place) on the communication stream" in out
    assert "FAIL" not in out


@pytest.mark.parametrize("n", [2, 4])
def test_several_ranks_match_the_unsharded_result(n: int) -> None:
    """2 and 4 ranks (where the machine has that many GPUs) against the unsharded result."""
    if gpus() < n:
        pytest.skip(f"needs {n} GPUs")
    out = run_ranks(n)
    assert f"ALL OK on {n} rank(s)" in out
    assert "FAIL" not in out
