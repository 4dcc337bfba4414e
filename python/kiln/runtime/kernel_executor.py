"""Run one lowered kernel on the GPU: plan (cached per input signature), allocate outputs
and global buffers, launch.

The executor allocates the kernel's global buffers itself when the caller passes none
(zero_init buffers zeroed); a host program passes its own. Parameter order is the
kernel's: inputs, outputs, global buffers, then scalars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import DTYPE_NUMPY_NAMES
from .._errors import KilnError, KilnTypeError
from . import executor

if TYPE_CHECKING:
    from .._core import KernelPlan


def np_dtype(name: str) -> Any:
    """The NumPy/CuPy dtype of a kiln dtype name (bfloat16 needs ml_dtypes or torch)."""
    numpy_name = DTYPE_NUMPY_NAMES[name]
    if numpy_name == "bfloat16":  # not a NumPy type: ml_dtypes provides it
        try:
            import ml_dtypes  # noqa: PLC0415

            return ml_dtypes.bfloat16
        except ImportError as e:
            raise KilnTypeError("BFloat16 buffers need the ml_dtypes package (or torch inputs)") from e
    return np.dtype(numpy_name).type


def np_scalar(value: Any, dtype: str) -> Any:
    """A NumPy scalar of kiln dtype ``dtype``, passed by value to a kernel (its bytes are
    what the kernel's parameter of that type holds)."""
    if dtype == "BFloat16":  # a __nv_bfloat16 parameter: its 16 bits, rounded to nearest even
        with np.errstate(over="ignore"):  # beyond float32's range is beyond bfloat16's: inf
            bits = int(np.float32(value).view(np.uint32))
        if (bits & 0x7FFFFFFF) > 0x7F800000:
            return np.uint16((bits >> 16) | 0x40)  # NaN stays a (quiet) NaN
        return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return np_dtype(dtype)(value)


class KernelExecutor:
    """Compiles a lowered kernel once and launches it for CuPy inputs."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel  # kiln.lowering.LoweredKernel
        self._compiled: Dict[Tuple[bool, int], Any] = {}
        self._plans: Dict[Tuple, KernelPlan] = {}
        params = [p for p in kernel.params if p.kind in ("scalar", "extent", "stride")]
        # Sizes and strides take the kernel's index type; scalar inputs keep their dtype.
        self._scalar_dtypes = {
            idx32: [("Int32" if idx32 and p.kind != "scalar" else p.dtype) for p in params]
            for idx32 in (False, True)
        }
        self.launches = 0

    def compiled(self, index32: bool = False, threads: int = 0) -> Any:
        """The loaded CUDA function for blocks of ``threads`` (compiled on first use, cached in
        memory and on disk)."""
        hit = self._compiled.get((index32, threads))
        if hit is None:
            src = self.kernel.cuda_source_for(index32)
            hit = executor.load_module(src, self.kernel.kernel_name, threads=threads)
            self._compiled[(index32, threads)] = hit
        return hit

    def plan(self, arrays: Sequence[Any], scalars: Sequence[Any]) -> KernelPlan:
        """The launch plan for these inputs; cached per (dtype, shape, strides, scalars)."""
        key = tuple((a.dtype.str, a.shape, a.strides) for a in arrays) + tuple(scalars)
        hit = self._plans.get(key)
        if hit is None:
            sizes = [list(a.shape) for a in arrays]
            strides = [[s // a.itemsize for s in a.strides] for a in arrays]
            hit = self.kernel._core.plan(sizes, strides, list(scalars))
            self._plans[key] = hit
        return hit

    def run(self, arrays: Sequence[Any], scalars: Sequence[Any] = (),
            buffers: Optional[Sequence[Any]] = None) -> List[Any]:
        """Launch on CuPy ``arrays``; returns the outputs (CuPy, logical order)."""
        import cupy as cp  # noqa: PLC0415

        plan = self.plan(arrays, scalars)
        grid, block = plan.grid, plan.block
        outputs = []
        for o in plan.outputs:
            layout = o.layout
            stored = cp.empty([o.sizes[a] for a in layout], dtype=np_dtype(o.dtype))
            inverse = [layout.index(a) for a in range(len(layout))]
            outputs.append(stored.transpose(inverse) if layout != sorted(layout) else stored)
        bufs_plan = plan.buffers
        if buffers is None:
            bufs = []
            for bp in bufs_plan:
                alloc = cp.zeros if bp.zero_init else cp.empty
                bufs.append(alloc(max(bp.elements, 1), dtype=np_dtype(bp.dtype)))
        else:
            bufs = list(buffers)
            if len(bufs) != len(bufs_plan):
                raise KilnError(f"the kernel needs {len(bufs_plan)} global buffers "
                                f"({[bp.name for bp in bufs_plan]}) but {len(bufs)} were passed")
            for b, bp in zip(bufs, bufs_plan):
                if np.dtype(b.dtype) != np.dtype(np_dtype(bp.dtype)):
                    raise KilnTypeError(f"global buffer {bp.name}: dtype {b.dtype} but the kernel needs "
                                        f"{bp.dtype}")
                if b.size < bp.elements:
                    raise KilnError(f"global buffer {bp.name}: {b.size} elements but the kernel needs "
                                    f"{bp.elements}")
        if min(grid) == 0 or min(block) == 0:
            return outputs  # empty tensors: nothing to compute
        args: List[Any] = [*arrays, *outputs, *bufs]
        args += [np_scalar(v, d) for v, d in zip(plan.scalar_args, self._scalar_dtypes[plan.index32])]
        threads = int(block[0]) * int(block[1]) * int(block[2])
        executor.launch(self.compiled(plan.index32, threads), grid, block, int(plan.smem_bytes), args)
        self.launches += 1
        return outputs
