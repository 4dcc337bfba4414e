"""A small user program: ``mypy --strict`` must accept it against kiln's types."""

from typing import List

import numpy as np
from kiln import DataType, FusionDefinition, KilnError, ParallelType


def layernorm_rows(n_cols: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        mean = fd.ops.mul(fd.ops.sum(x, dims=[1]), 1.0 / n_cols)
        xc = fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, shape=[-1, -1], broadcast_dims=[0]))
        var = fd.ops.mul(fd.ops.sum(fd.ops.mul(xc, xc), dims=[1]), 1.0 / n_cols)
        rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
        fd.add_output(fd.ops.mul(xc, fd.ops.broadcast_in_dim(rstd, shape=[-1, -1], broadcast_dims=[0])))
    return fd


def scaled_copy() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1])
        y = fd.ops.mul(x, 2.0)
        fd.add_output(y)
    y.split(0, 128)
    y.axis(0).parallelize(ParallelType.BIDx)
    y.axis(1).parallelize(ParallelType.TIDx)
    return fd


def main() -> List[np.ndarray]:
    x = np.ones((4, 8), np.float32)
    fd = layernorm_rows(8)
    low = fd.lower([x])
    kernels: int = len(low.kernels)
    outs = fd.execute([x])
    try:
        scaled_copy().execute([np.ones(3, np.float64)])
    except KilnError as e:
        print(f"{kernels} kernel(s); refused: {e}")
    return [np.asarray(o) for o in outs]


if __name__ == "__main__":
    main()
