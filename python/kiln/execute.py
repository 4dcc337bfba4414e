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
    kernel = fd._lowered() if fd._core.manually_scheduled else _auto_lowered(fd, inputs)
    if device == "cpu":
        from . import _core  # noqa: PLC0415

        if not hasattr(_core, "execute_cpu"):
            raise KilnError("this build of kiln has no CPU interpreter")
        return list(_core.execute_cpu(kernel._core, list(inputs)))
    return _run_gpu(kernel, inputs, "torch" in kinds)


def _auto_lowered(fd: Any, inputs: Sequence[Any]) -> Any:
    """The kernel the automatic schedulers pick for these input sizes (cached per sizes,
    and per heuristic: sizes that lead to the same schedule share one kernel)."""
    from .lowering import LoweredKernel  # noqa: PLC0415

    sizes = [list(x.shape) for x in inputs if _kind(x) != "scalar"]
    key = (fd._core.version, tuple(tuple(s) for s in sizes))
    cache = fd.__dict__.setdefault("_auto_cache", {})
    hit = cache.get(key)
    if hit is not None:
        return hit
    scheduled, kind, params = fd._core.auto_scheduled(sizes)
    hkey = (fd._core.version, kind, tuple(params))
    kernel = cache.get(hkey)
    if kernel is None:
        kernel = cache[hkey] = LoweredKernel(scheduled.lower())
    cache[key] = kernel
    return kernel


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
