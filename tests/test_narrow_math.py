"""Float math whose results end as half/bfloat16 values uses the hardware approximations.

A value computed in float whose every use, through value-carrying ops, ends in a cast to
half/bfloat16 or a 2-byte float tensor in memory is rounded to 2^-11 (half) or 2^-8 (bf16)
before anyone sees it. Its ``exp``, ``sigmoid`` and division then use ``ex2.approx`` and
``div.full`` (error at most 2 + 1.173|x| float ulp and 2 ulp), well below that rounding.
A value that also reaches a float output, a comparison or an index keeps the exact
functions. The tests read the CUDA the automatic schedule emits, compile it with NVRTC, and
on a GPU compare the results with NumPy in float64 at the 2-byte type's rounding.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import families as fams
import numpy as np
import pytest
from gpu_util import cupy_or_skip
from kiln import DataType, FusionDefinition
from kiln.runtime.nvrtc import compile_cubin, nvrtc_available


def _half_softmax(dtype: DataType) -> FusionDefinition:
    """``softmax(x.float() * 0.125).to(dtype)`` over the last axis."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        w = fd.ops.mul(fd.ops.cast(x, DataType.Float), 0.125)
        mx = fd.ops.max(w, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(w, mx))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)), dtype))
    return fd


def _float_softmax() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mx = fd.ops.max(x, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, mx))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))
    return fd


def _exp_to_half_and(second: str) -> Callable[[], FusionDefinition]:
    """exp(x) to half, and the same value unrounded in a second output: ``"float"`` (times 2,
    a float output) or ``"compared"`` (``> 1.5``: a near tie must not flip)."""
    def build() -> FusionDefinition:
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            e = fd.ops.exp(x)
            fd.add_output(fd.ops.cast(e, DataType.Half))
            fd.add_output(fd.ops.mul(e, 2.0) if second == "float" else fd.ops.gt(e, 1.5))
        return fd
    build.__name__ = f"exp_to_half_and_{second}"
    return build


def _bf16_silu_div() -> FusionDefinition:
    """``(x * sigmoid(x)) / y`` in float from bf16 inputs, out in bf16."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        y = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        xf = fd.ops.cast(x, DataType.Float)
        s = fd.ops.mul(xf, fd.ops.sigmoid(xf))
        fd.add_output(fd.ops.cast(fd.ops.div(s, fd.ops.cast(y, DataType.Float)), DataType.BFloat16))
    return fd


def _sources(fd: FusionDefinition, inputs: List[Any]) -> str:
    return "\n".join(k.cuda_source for k in fd.lower(inputs).kernels)


def _bodies(fd: FusionDefinition, inputs: List[Any]) -> str:
    """The kernels without the runtime header (which defines every function)."""
    return "\n".join(k.cuda_source.split('extern "C" __global__', 1)[1] for k in fd.lower(inputs).kernels)


def _bf16_pair() -> List[np.ndarray]:
    """Two bfloat16 arrays (ml_dtypes), for lowering on the CPU."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    return [(_rows(np.float32) + k).astype(bf16) for k in (0.0, 20.0)]


def _rows(dtype: Any, shape: Tuple[int, int] = (5, 700)) -> np.ndarray:
    return (np.random.default_rng(3).standard_normal(shape) * 6.0).astype(dtype)


def test_half_and_bf16_softmax_use_the_approximations() -> None:
    body = _bodies(_half_softmax(DataType.Half), [_rows(np.float16)])
    assert "kiln::expNarrow(" in body and "kiln::divNarrow(" in body, body
    assert "kiln::exp(" not in body, body


def test_bf16_silu_and_division_use_the_approximations() -> None:
    body = _bodies(_bf16_silu_div(), _bf16_pair())
    assert "kiln::sigmoidNarrow(" in body and "kiln::divNarrow(" in body, body


@pytest.mark.parametrize("build, inputs", [
    (_float_softmax, lambda: [_rows(np.float32)]),
    (_exp_to_half_and("float"), lambda: [_rows(np.float32)]),
    (_exp_to_half_and("compared"), lambda: [_rows(np.float32)]),
], ids=["float softmax", "exp also a float output", "exp compared"])
def test_values_seen_in_float_keep_the_exact_functions(build: Callable[[], FusionDefinition],
                                                       inputs: Callable[[], List[Any]]) -> None:
    body = _bodies(build(), inputs())
    assert "Narrow(" not in body, body
    assert "kiln::exp(" in body, body


def test_interpreter_results_match_numpy() -> None:
    """The CPU interpreter computes in float64 whatever the kernels use."""
    x = _rows(np.float16)
    (got,) = _half_softmax(DataType.Half).execute([x])
    w = x.astype(np.float64) * 0.125
    e = np.exp(w - w.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2 ** -10, atol=1e-7)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC is not installed")
def test_approximations_compile_for_sm90() -> None:
    for k in _half_softmax(DataType.Half).lower([_rows(np.float16)]).kernels:
        compile_cubin(k.cuda_source, k.kernel_name, arch="sm_90")
    assert "kiln::expNarrow" in _sources(_half_softmax(DataType.Half), [_rows(np.float16)])


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [7, 1024, 4099, 70001])
def test_gpu_half_softmax_within_half_rounding(cols: int) -> None:
    cp = cupy_or_skip()
    x = _rows(np.float16, (33, cols)) * np.float16(4.0)  # scores up to about +-100
    (got,) = _half_softmax(DataType.Half).execute([cp.asarray(x)])
    w = x.astype(np.float64) * 0.125
    e = np.exp(w - w.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    # Half rounding of the result (2^-11 relative), plus the approximations (< 2^-16).
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=2 ** -10, atol=2 ** -24)


@pytest.mark.gpu
def test_gpu_bf16_silu_div_within_bf16_rounding() -> None:
    """On torch tensors: CuPy has no bfloat16 arrays."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    x = _rows(np.float32, (65, 1031))
    y = np.abs(_rows(np.float32, (65, 1031))) + 0.5
    xt, yt = (torch.from_numpy(a).to(device="cuda", dtype=torch.bfloat16) for a in (x, y))
    (got,) = _bf16_silu_div().execute([xt, yt])
    xf, yf = (t.float().cpu().numpy().astype(np.float64) for t in (xt, yt))
    want = xf / (1.0 + np.exp(-xf)) / yf
    np.testing.assert_allclose(fams.output_f64(got), want, rtol=2 ** -7, atol=1e-30)
