"""Fusions from real model families (tests/families.py) against float64 NumPy references.

CPU: every builder on awkward sizes through ``fd.execute`` on NumPy inputs, which runs the
automatic schedulers and the segmenter and interprets the resulting host program; the same
fusions interpreted as written (no schedule), which checks the references themselves; and
the number of kernels the automatic schedule takes, against the fewest that can do it.
GPU (``-m gpu``): the same builders on CuPy inputs and on torch inputs, at awkward and
model-like sizes.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import pytest
from families import SPECS, Family, Spec, output_f64
from gpu_util import cupy_or_skip


def _id(sizes: Sequence[int]) -> str:
    return "x".join(str(s) for s in sizes)


CPU_CASES = [pytest.param(s, sizes, id=f"{s.name}-{_id(sizes)}") for s in SPECS for sizes in s.cpu]
GPU_CASES = [pytest.param(s, sizes, id=f"{s.name}-{_id(sizes)}") for s in SPECS for sizes in s.gpu]
BENCH_CASES = [pytest.param(s, s.bench, id=f"{s.name}-{_id(s.bench)}") for s in SPECS]


def _numpy_inputs(fam: Family) -> List[Any]:
    if "BFloat16" in fam.dtypes:
        pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 arrays need ml_dtypes")
    return fam.inputs()


def _check(fam: Family, outs: Sequence[Any], wants: Sequence[np.ndarray]) -> None:
    assert len(outs) == len(wants), f"{fam.name}: {len(outs)} outputs, expected {len(wants)}"
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = output_f64(out)
        assert got.shape == want.shape, f"{fam.name} output {i}: shape {got.shape}, expected {want.shape}"
        rtol, atol = fam.tol(i)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{fam.name} output {i}")


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("spec, sizes", CPU_CASES)
def test_family_matches_numpy_in_the_interpreter(spec: Spec, sizes):
    fam = spec.build(sizes)
    inputs = _numpy_inputs(fam)
    _check(fam, fam.fd.execute(inputs), fam.expected(inputs))


@pytest.mark.parametrize("spec, sizes", CPU_CASES)
def test_reference_matches_the_fusion_as_written(spec: Spec, sizes):
    # No schedule: the interpreter runs the definition op by op. A mismatch here is a wrong
    # reference (or fusion), not a compiler bug.
    fam = spec.build(sizes)
    inputs = _numpy_inputs(fam)
    _check(fam, fam.fd.execute(inputs, as_written=True), fam.expected(inputs))


# At the GPU tests' sizes too: lowering needs no data, and conftest compiles every kernel
# lowered here with NVRTC and fails a test whose kernel spills registers (a long-row
# LayerNorm once spilled at 4 x 131072 only, where the CPU sizes never reach).
@pytest.mark.parametrize("spec, sizes", CPU_CASES + GPU_CASES + BENCH_CASES)
def test_automatic_schedule_takes_the_fewest_kernels(spec: Spec, sizes):
    fam = spec.build(sizes)
    if "BFloat16" in fam.dtypes:
        pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 arrays need ml_dtypes")
    low = fam.fd.lower(fam.stand_ins())
    assert len(low.kernels) == fam.kernels, (
        f"{fam.name} {sizes}: {len(low.kernels)} kernels, expected {fam.kernels}\n{low.host_program}")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("spec, sizes", GPU_CASES)
def test_family_matches_numpy_on_gpu_with_cupy(spec: Spec, sizes):
    cp = cupy_or_skip()
    fam = spec.build(sizes)
    if "BFloat16" in fam.dtypes:
        pytest.skip("CuPy has no bfloat16 arrays (the torch test covers this family)")
    inputs = fam.inputs()
    outs = fam.fd.execute([cp.asarray(a) if isinstance(a, np.ndarray) else a for a in inputs])
    assert all(type(o).__module__.startswith("cupy") for o in outs)
    _check(fam, outs, fam.expected(inputs))


def _to_torch(torch: Any, a: Any) -> Any:
    if not isinstance(a, np.ndarray):
        return a
    if a.dtype.kind == "V" or str(a.dtype) == "bfloat16":  # ml_dtypes bfloat16: exact in float32
        return torch.from_numpy(a.astype(np.float32)).to(device="cuda", dtype=torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("spec, sizes", GPU_CASES)
def test_family_matches_numpy_on_gpu_with_torch(spec: Spec, sizes):
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    fam = spec.build(sizes)
    inputs = _numpy_inputs(fam)
    outs = fam.fd.execute([_to_torch(torch, a) for a in inputs])
    assert all(isinstance(o, torch.Tensor) and o.is_cuda for o in outs)
    _check(fam, outs, fam.expected(inputs))
