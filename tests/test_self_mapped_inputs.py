"""An input read into two positions of one tensor: a pairwise distance of ``x`` with itself
(``x[:, None] - x[None]``), a packed-sequence mask (``doc[:, :, None] == doc[:, None, :]``), an
antisymmetric part ``x - x.T``. The pairs' axes map to each other through the input, which no
loop nest computes once for both; the automatic path reads the input through a view of its
buffer per position instead, so each takes one kernel (the pairs were a kernel and a Global
intermediate of their own). Checked against NumPy in float64 in the CPU interpreter."""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def _bc(fd: FusionDefinition, t: Any, rank: int, dims: List[int]) -> Any:
    return fd.ops.broadcast_in_dim(t, [-1] * rank, dims)


def _cdist() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        d = fd.ops.sub(_bc(fd, x, 3, [0, 2]), _bc(fd, x, 3, [1, 2]))
        fd.add_output(fd.ops.sqrt(fd.ops.sum(fd.ops.mul(d, d), [2])))
    return fd


def _ref_cdist(x: np.ndarray) -> List[np.ndarray]:
    return [np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))]


def _doc_mask_softmax() -> FusionDefinition:
    with FusionDefinition() as fd:
        s = fd.define_tensor([-1, -1, -1, -1], DataType.Float)
        doc = fd.define_tensor([-1, -1], DataType.Int32)
        keep = fd.ops.eq(_bc(fd, doc, 4, [0, 2]), _bc(fd, doc, 4, [0, 3]))
        x = fd.ops.where(keep, s, float("-inf"))
        e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, dims=[3], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[3], keepdim=True)))
    return fd


def _ref_doc_mask_softmax(s: np.ndarray, doc: np.ndarray) -> List[np.ndarray]:
    keep = doc[:, :, None] == doc[:, None, :]
    x = np.where(keep[:, None], s, -np.inf)
    e = np.exp(x - x.max(-1, keepdims=True))
    return [e / e.sum(-1, keepdims=True)]


def _antisymmetric() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        fd.add_output(fd.ops.mul(fd.ops.sub(x, fd.ops.permute(x, [1, 0])), 0.5))
    return fd


def _ref_antisymmetric(x: np.ndarray) -> List[np.ndarray]:
    return [(x - x.T) * 0.5]


def _inputs(name: str, n: int, rng: np.random.Generator) -> List[np.ndarray]:
    if name == "cdist":
        return [rng.standard_normal((n, 7)).astype(np.float32)]
    if name == "doc_mask_softmax":
        doc = np.sort(rng.integers(0, 3, size=(2, n)), axis=1).astype(np.int32)
        return [rng.standard_normal((2, 3, n, n)).astype(np.float32), doc]
    return [rng.standard_normal((n, n)).astype(np.float32)]


CASES = {
    "cdist": (_cdist, _ref_cdist),
    "doc_mask_softmax": (_doc_mask_softmax, _ref_doc_mask_softmax),
    "antisymmetric": (_antisymmetric, _ref_antisymmetric),
}


@pytest.mark.parametrize("n", [1, 5, 33, 130])
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_input_read_into_two_positions_takes_one_kernel(name: str, n: int) -> None:
    build, ref = CASES[name]
    fd: FusionDefinition = build()
    inputs = _inputs(name, n, np.random.default_rng(n))
    got = fd.execute([a.copy() for a in inputs])
    want: Callable[..., List[np.ndarray]] = ref
    for g, w in zip(got, want(*[a.astype(np.float64) if a.dtype.kind == "f" else a for a in inputs])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(fd.lower(inputs).kernels) == 1
