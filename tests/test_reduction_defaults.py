"""Reductions without ``dims`` reduce every axis, as ``x.sum()`` in torch and ``ops.sum(x)``
in nvFuser do: sum, max, min, prod, mean, var, var_mean and logsumexp of tensors of rank 1
to 4, with and without ``keepdim``, against NumPy in float64."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError

Ref = Callable[[np.ndarray, bool], np.ndarray]

OPS: List[Tuple[str, Callable[[Any, Any, bool], Any], Ref]] = [
    ("sum", lambda fd, x, k: fd.ops.sum(x, keepdim=k), lambda a, k: a.sum(keepdims=k)),
    ("max", lambda fd, x, k: fd.ops.max(x, keepdim=k), lambda a, k: a.max(keepdims=k)),
    ("min", lambda fd, x, k: fd.ops.min(x, keepdim=k), lambda a, k: a.min(keepdims=k)),
    ("prod", lambda fd, x, k: fd.ops.prod(fd.ops.add(fd.ops.mul(x, 0.01), 1.0), keepdim=k),
     lambda a, k: np.prod(1 + 0.01 * a, keepdims=k)),
    ("mean", lambda fd, x, k: fd.ops.mean(x, keepdim=k), lambda a, k: a.mean(keepdims=k)),
    ("var", lambda fd, x, k: fd.ops.var(x, keepdim=k), lambda a, k: a.var(ddof=1, keepdims=k)),
    ("var_mean", lambda fd, x, k: fd.ops.var_mean(x, keepdim=k)[1], lambda a, k: a.mean(keepdims=k)),
    ("logsumexp", lambda fd, x, k: fd.ops.logsumexp(x, keepdim=k),
     lambda a, k: np.log(np.exp(a).sum(keepdims=k))),
]


@pytest.mark.parametrize("shape", [(9,), (4, 33), (3, 5, 7), (2, 3, 1, 6)])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", [o[0] for o in OPS])
def test_a_reduction_without_dims_reduces_every_axis(name: str, keepdim: bool,
                                                     shape: Tuple[int, ...]) -> None:
    _, build, ref = next(o for o in OPS if o[0] == name)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1] * len(shape))
        fd.add_output(build(fd, x, keepdim))
    a = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    (got,) = fd.execute([a])
    want = ref(a.astype(np.float64), keepdim)
    assert np.shape(got) == np.shape(want)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=1e-5)


def test_global_grad_norm_written_without_dims() -> None:
    """``torch.nn.utils.clip_grad_norm_`` of one tensor: ``g * min(1, c / (||g|| + 1e-6))``."""
    with FusionDefinition() as fd:
        g = fd.define_tensor([-1, -1])
        norm = fd.ops.sqrt(fd.ops.sum(fd.ops.mul(g, g)))
        coef = fd.ops.clamp(fd.ops.div(1.0, fd.ops.add(norm, 1e-6)), max=1.0)
        fd.add_output(fd.ops.mul(g, coef))
        fd.add_output(norm)
    a = np.random.default_rng(7).standard_normal((37, 129)).astype(np.float32)
    got, norm = fd.execute([a])
    n = np.sqrt((a.astype(np.float64) ** 2).sum())
    np.testing.assert_allclose(norm, n, rtol=1e-5)
    np.testing.assert_allclose(got, a * min(1.0, 1.0 / (n + 1e-6)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "logsumexp", "mean"])
@pytest.mark.parametrize("dt", ["float", "int"])
def test_a_rank_0_tensor_reduces_to_its_value(op: str, dt: str) -> None:
    """As ``torch.tensor(2.5).sum()``: every axis of a 0-d tensor is none, and the reduction
    of its one value is that value (an integer sum or product in Int, as for other ranks)."""
    kdt, v = {"float": (DataType.Float, np.float32(2.5)), "int": (DataType.Int32, np.int32(3))}[dt]
    if dt == "int" and op in ("logsumexp", "mean"):
        with pytest.raises(KilnError, match=rf"{op}: T0"), FusionDefinition() as fd:
            getattr(fd.ops, op)(fd.define_tensor([], dtype=kdt))
        return
    with FusionDefinition() as fd:
        fd.add_output(getattr(fd.ops, op)(fd.define_tensor([], dtype=kdt)))
    (got,) = fd.execute([np.array(v)])
    assert got.shape == ()
    assert float(got) == float(v)
    if dt == "int":
        assert got.dtype == (np.int64 if op in ("sum", "prod") else np.int32)


def test_an_explicit_empty_dims_list_is_refused() -> None:
    with pytest.raises(KilnError, match=r"sum: T0: no axes to reduce"), FusionDefinition() as fd:
        fd.ops.sum(fd.define_tensor([-1]), dims=[])
