"""``kiln demo`` / ``python -m kiln``: define, schedule, lower and run a real multi-kernel
fusion (a row softmax in three kernels) and check it against NumPy."""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional

import numpy as np

from . import DataType, FusionDefinition, ParallelType, __version__


def build_demo() -> FusionDefinition:
    """Row softmax ``exp(x - max) / sum``, split into three kernels: row max, exp + row
    sum, normalise. The row max, exp and row sum cross kernels as Global intermediates."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        m = fd.ops.max(x, dims=[1])
        mb = fd.ops.broadcast_in_dim(m, shape=[-1, -1], broadcast_dims=[0])
        d = fd.ops.sub(x, mb)
        e = fd.ops.exp(d)
        s = fd.ops.sum(e, dims=[1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        y = fd.ops.div(e, sb)
        fd.add_output(y)
    # One block per row, 128 threads striding over the columns.
    for t in (m, mb, d, e, s, sb, y):
        t.split(1, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(-1).parallelize(ParallelType.TIDx)
    for t in (mb, d, sb):
        t.inline_at(-1)
    fd.segment_after(m)
    fd.segment_after(s)
    return fd


def reference(x: np.ndarray) -> np.ndarray:
    """NumPy float64 softmax over the last axis."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _cupy() -> Optional[Any]:
    try:
        import cupy as cp  # noqa: PLC0415

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        return cp
    except Exception:  # no CuPy, no driver or no device
        return None


def demo(rows: int = 64, cols: int = 1000) -> int:
    """Run the demo and return a process exit code."""
    fd = build_demo()
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    print(f"kiln {__version__}: fusion definition\n")
    print(fd)
    low = fd.lower([x])
    plan = low.plan([x])
    print(f"Allocation table for x[{rows}, {cols}] ({len(low.kernels)} kernels):\n")
    print(plan.table())
    print("\nHost program:\n")
    print(low.host_program)
    cp = _cupy()
    if cp is None:
        # No GPU: the same host program runs kernel by kernel in the CPU interpreter,
        # with every memory access bounds-checked.
        (got,) = fd.execute([x], device="cpu")
        where = "the CPU interpreter (no CUDA device or CuPy here; install kiln[cuda] on a GPU machine)"
    else:
        (out,) = fd.execute([cp.asarray(x)])
        got = cp.asnumpy(out)
        where = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    ref = reference(x)
    err = float(np.abs(got - ref).max())
    ok = bool(np.allclose(got, ref, rtol=1e-5, atol=1e-6))
    print(f"Ran {len(low.kernels)} kernels on {where}: "
          f"max |kiln - numpy float64| = {err:.3g} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


# The demo's [rows, cols] float32 input and its float64 reference live in host memory.
MAX_SIDE = 1 << 24
MAX_ELEMENTS = 1 << 28


def _positive(text: str) -> int:
    """An argument that must be an int of at least 1 (the softmax of an empty row is undefined)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {n}")
    if n > MAX_SIDE:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SIDE} (the demo's input is held in memory), "
                                         f"got {n}")
    return n


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``kiln`` command."""
    parser = argparse.ArgumentParser(prog="kiln", description="kiln fusion compiler")
    parser.add_argument("command", nargs="?", default="demo", choices=["demo"], help="what to run")
    parser.add_argument("--rows", type=_positive, default=64, help="rows of the demo's input (>= 1)")
    parser.add_argument("--cols", type=_positive, default=1000, help="columns of the demo's input (>= 1)")
    args = parser.parse_args(argv)
    if args.rows * args.cols > MAX_ELEMENTS:
        parser.error(f"--rows {args.rows} --cols {args.cols} is {args.rows * args.cols} elements; the demo "
                     f"takes at most {MAX_ELEMENTS} (its input and its float64 reference sit in host memory)")
    return demo(args.rows, args.cols)


if __name__ == "__main__":
    sys.exit(main())
