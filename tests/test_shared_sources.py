"""A padded (or filled) tensor read by readers of different sizes in one kernel: `cat([t, t])`
beside `sum(t)`, whose flattened loop runs the cat's positions and the sum's. The pad's mask
(a source: it reads no memory) is computed at every position of that loop, so the cat's
positions past the sum's find it too. Static and symbolic sizes, several dtypes and readers,
against NumPy in float64 (integers exactly)."""

from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

DTYPES = {"float": (DataType.Float, np.float32), "int": (DataType.Int, np.int64),
          "int32": (DataType.Int32, np.int32)}

READERS: Dict[str, Callable[[Any, Any], Any]] = {
    "sum": lambda o, t: o.sum(t),
    "row_sum": lambda o, t: o.sum(t, [1]),
    "col_sum": lambda o, t: o.sum(t, [0]),
    "times_two": lambda o, t: o.mul(t, 2),
}

NP_READERS: Dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sum": lambda t: t.sum(),
    "row_sum": lambda t: t.sum(1),
    "col_sum": lambda t: t.sum(0),
    "times_two": lambda t: t * 2,
}


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cat_dim", [0, 1])
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("shape,widths",
                         [((8, 7), [0, 2]), ((3, 1), [1, 1]), ((5, 6), [2, 0]), ((4, 9), [1, 3])])
def test_a_pad_read_by_a_cat_and_a_reduction(static: bool, dtype: str, cat_dim: int, reader: str,
                                             shape: tuple, widths: list) -> None:
    dt, np_dt = DTYPES[dtype]
    with FusionDefinition() as fd:
        o = fd.ops
        x = fd.define_tensor(list(shape) if static else [-1, -1], dt)
        t = o.pad(x, widths, 1)
        fd.add_output(o.cat([t, t], cat_dim))
        fd.add_output(READERS[reader](o, t))
    a = (np.arange(np.prod(shape)).reshape(shape) % 11 - 4).astype(np_dt)
    got_cat, got_r = fd.execute([a])
    tp = np.pad(a.astype(np.float64), [(0, 0), (widths[0], widths[1])], constant_values=1)
    np.testing.assert_allclose(got_cat, np.concatenate([tp, tp], cat_dim))
    np.testing.assert_allclose(got_r, NP_READERS[reader](tp), rtol=1e-6)


@pytest.mark.parametrize("dtype", [DataType.Bool, DataType.Int32, DataType.Float])
@pytest.mark.parametrize("shape", [[3, 1], [4, 2], [1, 5]])
def test_a_fill_padded_and_summed(dtype: DataType, shape: list) -> None:
    with FusionDefinition() as fd:
        o = fd.ops
        t = o.full(shape, False if dtype == DataType.Bool else 2, dtype)
        fd.add_output(o.pad(t, [1, 1], True if dtype == DataType.Bool else 7))
        fd.add_output(o.sum(t, dims=[0, 1]))
    padded, total = fd.execute([])
    fill, edge = (0, 1) if dtype == DataType.Bool else (2, 7)
    want = np.full([shape[0], shape[1] + 2], edge, np.float64)
    want[:, 1:-1] = fill
    np.testing.assert_array_equal(padded.astype(np.float64), want)
    np.testing.assert_allclose(float(total), fill * shape[0] * shape[1])
