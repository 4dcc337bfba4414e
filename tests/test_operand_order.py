"""The operand order of a commutative op (``self.weight * h`` or ``h * self.weight``) must not
change how a fusion is segmented. An element-wise op takes its output's sizes from its first
operand, so a weight of a runtime size written first gave the output that size where the other
operand had a constant one (a group size after a view), and the rewrite that computes a
viewed-back normalization at its source's shape no longer saw the same shape: two kernels in
one order, one in the other. Each fusion is checked in both orders against NumPy in float64.
Also: one broadcast read by two ops that give its new axis unrelated sizes takes one kernel."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition

Build = Callable[[FusionDefinition, Any, Any, Callable[[Any, Any], Any]], Any]
Ref = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _grouped_rmsnorm(groups: int, cols: int) -> Tuple[Build, Ref]:
    def build(fd: FusionDefinition, x: Any, w: Any, mul: Callable[[Any, Any], Any]) -> Any:
        xg = fd.ops.reshape(x, [-1, groups, cols // groups])
        v = fd.ops.mean(fd.ops.mul(xg, xg), dims=[2], keepdim=True)
        h = fd.ops.reshape(fd.ops.mul(xg, fd.ops.rsqrt(fd.ops.add(v, 1e-5))), [-1, cols])
        return mul(fd.ops.broadcast_in_dim(w, [-1, -1], [1]), h)

    def ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        xg = x.reshape(x.shape[0], groups, -1)
        return (xg / np.sqrt((xg * xg).mean(-1, keepdims=True) + 1e-5)).reshape(x.shape) * w
    return build, ref


def _group_norm_affine(groups: int, cols: int) -> Tuple[Build, Ref]:
    def build(fd: FusionDefinition, x: Any, w: Any, mul: Callable[[Any, Any], Any]) -> Any:
        xg = fd.ops.reshape(x, [-1, groups, cols // groups])
        mean = fd.ops.mean(xg, dims=[2], keepdim=True)
        d = fd.ops.sub(xg, mean)
        var = fd.ops.mean(fd.ops.mul(d, d), dims=[2], keepdim=True)
        h = fd.ops.reshape(fd.ops.div(d, fd.ops.sqrt(fd.ops.add(var, 1e-5))), [-1, cols])
        return fd.ops.add(mul(fd.ops.broadcast_in_dim(w, [-1, -1], [1]), h), 1.0)

    def ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        xg = x.reshape(x.shape[0], groups, -1)
        d = xg - xg.mean(-1, keepdims=True)
        h = (d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)).reshape(x.shape)
        return w * h + 1.0
    return build, ref


CASES = {
    "grouped_rmsnorm_4x128": _grouped_rmsnorm(4, 512),
    "grouped_rmsnorm_8x12": _grouped_rmsnorm(8, 96),
    "group_norm_affine_2x50": _group_norm_affine(2, 100),
}


def _kernels_and_output(build: Build, first: bool, x: np.ndarray, w: np.ndarray) -> Tuple[int, List[Any]]:
    def mul(a: Any, b: Any) -> Any:
        return fd.ops.mul(a, b) if first else fd.ops.mul(b, a)

    with FusionDefinition() as fd:
        tx = fd.define_tensor([-1, -1], DataType.Float)
        tw = fd.define_tensor([-1], DataType.Float)
        fd.add_output(build(fd, tx, tw, mul))
    return len(fd.lower([x, w]).kernels), fd.execute([x, w])


@pytest.mark.parametrize("name", sorted(CASES))
def test_commuted_operands_segment_alike_and_match_numpy(name: str) -> None:
    build, ref = CASES[name]
    cols = {"grouped_rmsnorm_4x128": 512, "grouped_rmsnorm_8x12": 96, "group_norm_affine_2x50": 100}[name]
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((37, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    want = ref(x.astype(np.float64), w.astype(np.float64))
    counts = []
    for first in (True, False):
        k, (got,) = _kernels_and_output(build, first, x, w)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        counts.append(k)
    assert counts == [1, 1]


def test_a_broadcast_read_with_two_unrelated_sizes_takes_one_kernel() -> None:
    # Mamba's discretisation: exp(dt)[..., None] times A [D, N] and times B [B, 1, N]; the two N
    # are different inputs' sizes, so each reader needs the broadcast in loops of its own.
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], DataType.Float)
        a = fd.define_tensor([-1, -1], DataType.Float)
        bm = fd.define_tensor([-1, -1], DataType.Float)
        dt = fd.ops.broadcast_in_dim(fd.ops.exp(x), [-1, -1, 1], [0, 1])
        fd.add_output(fd.ops.exp(fd.ops.mul(dt, fd.ops.broadcast_in_dim(a, [1, -1, -1], [1, 2]))))
        fd.add_output(fd.ops.mul(dt, fd.ops.broadcast_in_dim(bm, [-1, 1, -1], [0, 2])))
    rng = np.random.default_rng(5)
    b, d, n = 3, 37, 9
    xs = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in ([b, d], [d, n], [b, n])]
    got = fd.execute(xs)
    e = np.exp(xs[0].astype(np.float64))[..., None]
    np.testing.assert_allclose(got[0], np.exp(e * xs[1]), rtol=1e-5)
    np.testing.assert_allclose(got[1], e * xs[2][:, None, :], rtol=1e-5)
    assert len(fd.lower(xs).kernels) == 1
