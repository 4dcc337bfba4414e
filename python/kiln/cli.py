"""``kiln demo`` / ``python -m kiln``: define, schedule and inspect a real fusion."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import DataType, FusionDefinition, ParallelType, __version__


def build_demo() -> FusionDefinition:
    """Bias-add + GELU-ish activation + row sum, scheduled by hand for a GPU."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        bias = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        b2 = fd.ops.broadcast_in_dim(bias, shape=[-1, -1], broadcast_dims=[1])
        y = fd.ops.add(x, b2)
        act = fd.ops.mul(y, fd.ops.sigmoid(fd.ops.mul(y, 1.702)))
        rows = fd.ops.sum(act, dims=[1])
        fd.add_output(act)
        fd.add_output(rows)
    # One block per row, 128 threads striding over the columns.
    for t in (b2, y, act, rows):
        t.split(1, 128)
        t.axis(0).parallelize(ParallelType.BIDx)
        t.axis(-1).parallelize(ParallelType.TIDx)
    return fd


def demo() -> int:
    """Run the demo and return a process exit code."""
    fd = build_demo()
    print(f"kiln {__version__}: fusion definition\n")
    print(fd)
    print("Schedule of the activation tensor:")
    act = [t for t in _tensors(fd) if t.name == "T6"][0]
    act.print_transforms()
    print(
        "\nLowering, code generation and execution are not part of this build yet "
        "(see the README's status section); the definition and schedule above were checked."
    )
    return 0


def _tensors(fd: FusionDefinition) -> List:
    from .fusion import Tensor

    return [Tensor(fd, i) for i in range(fd._core.num_tensors)]


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``kiln`` command."""
    parser = argparse.ArgumentParser(prog="kiln", description="kiln fusion compiler")
    parser.add_argument("command", nargs="?", default="demo", choices=["demo"], help="what to run")
    parser.parse_args(argv)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
