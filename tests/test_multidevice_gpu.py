"""Sharded fusions on GPUs with NCCL: ranks started by torchrun, one process per GPU, each
checking its outputs against its part of the unsharded float64 result
(``tests/multidevice_worker.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DeviceMesh
from kiln.multidevice import TorchCommunicator
from test_multidevice import layer_norm, layer_norm_ref

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


class _DelayedWork:
    """A collective's completion: an event on the side stream it ran on."""

    def __init__(self, torch: Any, stream: Any) -> None:
        self._torch, self._event = torch, torch.cuda.Event()
        self._event.record(stream)

    def wait(self) -> None:
        """Make the current stream wait for the collective (as NCCL's work does)."""
        self._torch.cuda.current_stream().wait_event(self._event)


class _TwinRankDist:
    """A stand-in for ``torch.distributed`` on one GPU: rank 0 of two ranks that hold the same
    data, whose collectives run late on a stream of their own (a spin of about a millisecond
    first), after the work of the stream current at issue, as ProcessGroupNCCL orders them. An
    in-place sum doubles its buffer; max and min leave it. A result read before its wait, or
    a buffer read by the collective before its producer wrote it, gives wrong values."""

    class ReduceOp:
        SUM, MAX, MIN, PRODUCT = "sum", "max", "min", "prod"

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def all_reduce(self, t: Any, op: str, group: Any = None, async_op: bool = True) -> _DelayedWork:
        torch = self._torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
            if op == "sum":
                t.mul_(2)
            elif op == "prod":
                t.mul_(t)
        return _DelayedWork(torch, side)


@pytest.mark.parametrize("kind", ["torch", "cupy", "cupy_stream"])
def test_collectives_on_a_late_stream_are_waited_for(kind: str) -> None:
    """LayerNorm over a hidden axis sharded over two ranks that hold the same slice, with the
    Allreduces running late on a side stream: every stage must wait for them (torch's stream,
    CuPy's null stream or a CuPy stream of the user's), so the result is LayerNorm of the slice
    itself. (CuPy on its null stream gave wrong values from the second call on: the collectives
    were ordered after a torch pool stream instead of the legacy default stream.)"""
    cp = cupy_or_skip()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")

    comm = TorchCommunicator.__new__(TorchCommunicator)
    comm._torch, comm._dist = torch, _TwinRankDist(torch)
    comm.rank, comm.size, comm.group = 0, 2, None
    comm._ops = {op: op for op in ("sum", "max", "min", "prod")}
    fd = layer_norm(DeviceMesh([0, 1]))
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((256, 1024)) * 2 + 1).astype(np.float32)
    w, b = rng.standard_normal(1024).astype(np.float32), rng.standard_normal(1024).astype(np.float32)
    want = layer_norm_ref(x, w, b)
    conv = (lambda a: torch.from_numpy(a).cuda()) if kind == "torch" else cp.asarray
    stream = cp.cuda.Stream(non_blocking=True) if kind == "cupy_stream" else contextlib.nullcontext()
    with stream:
        for _ in range(3):  # the first call (compiling: slow enough to hide a race), then cached ones
            (y,) = fd.execute([conv(x), conv(w), conv(b)], comm=comm)
            got = y.cpu().numpy() if kind == "torch" else cp.asnumpy(y)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
