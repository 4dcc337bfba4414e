"""``fd.execute``: pick the device from the inputs, validate, run, return outputs of the
same kind as the inputs."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ._errors import KilnError, KilnTypeError
from .lowering import check_inputs


def _kind(x: Any) -> str:
    mod = type(x).__module__
    if mod.startswith("numpy"):
        return "numpy"
    if mod.startswith("cupy"):
        return "cupy"
    if mod.startswith("torch"):
        return "torch"
    return "scalar" if isinstance(x, (int, float, bool)) else "other"


def execute(fd: Any, inputs: Sequence[Any], device: Optional[str]) -> List[Any]:
    """Run ``fd`` on ``inputs``; ``device`` is ``"cpu"``, ``"cuda"`` or None (from the inputs)."""
    check_inputs(fd, inputs)
    kinds = {_kind(x) for x in inputs if _kind(x) != "scalar"}
    if device is None:
        device = "cpu" if kinds <= {"numpy"} else "cuda"
    if device not in ("cpu", "cuda"):
        raise KilnError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and "numpy" in kinds:
        raise KilnTypeError("device='cuda' needs CuPy arrays or torch CUDA tensors, got NumPy arrays")
    if len(kinds) > 1:
        raise KilnTypeError(f"all inputs must be of one kind (NumPy, CuPy or torch), got {sorted(kinds)}")
    kernel = fd._lowered()
    if device == "cpu":
        from . import _core  # noqa: PLC0415

        if not hasattr(_core, "execute_cpu"):
            raise KilnError("this build of kiln has no CPU interpreter")
        return list(_core.execute_cpu(kernel._core, list(inputs)))
    if not fd._core.manually_scheduled:
        raise KilnError("automatic scheduling is not available in this build: schedule the fusion by hand "
                        "(split/parallelize/inline_at) before running it on the GPU")
    return _run_gpu(kernel, inputs, "torch" in kinds)


def _run_gpu(kernel: Any, inputs: Sequence[Any], torch_out: bool) -> List[Any]:
    from .runtime.executor import as_cupy  # noqa: PLC0415
    from .runtime.kernel_executor import KernelExecutor  # noqa: PLC0415

    ex = getattr(kernel, "_executor", None)
    if ex is None:
        ex = KernelExecutor(kernel)
        kernel._executor = ex
    arrays = [as_cupy(x) for x in inputs if _kind(x) != "scalar"]
    scalars = [x for x in inputs if _kind(x) == "scalar"]
    outs = ex.run(arrays, scalars)
    if torch_out:
        import torch  # noqa: PLC0415

        return [torch.as_tensor(o, device="cuda") for o in outs]
    return outs
