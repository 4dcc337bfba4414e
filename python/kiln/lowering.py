"""Inspection of device lowering: ``fd.lower(inputs)`` and its kernels."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ._core import RuntimeArg
from ._env import dump_after, dump_enabled, verify_passes
from ._errors import KilnError, KilnTypeError
from .enums import DataType, MemoryType

if TYPE_CHECKING:
    from ._core import CudaSource

_RUNTIME_END = "#endif  // KILN_RUNTIME_CUH"


def kernel_part(source: str) -> str:
    """``source`` without the runtime header that every generated translation unit starts with."""
    at = source.find(_RUNTIME_END)
    return source if at < 0 else source[at + len(_RUNTIME_END):].lstrip("\n")


@dataclass(frozen=True)
class AllocationInfo:
    """How one tensor is laid out and where it is allocated in the kernel."""

    tensor: str
    memory_type: MemoryType
    ids: Tuple[str, ...]
    extents: Tuple[str, ...]
    strides: Tuple[str, ...]
    contiguity: Tuple[bool, ...]
    position: int
    zero_init: bool
    resets_to_zero: bool
    # Buffers of this layout the kernel allocates: a circular-buffered tensor's stages
    # (its Allocate's outer dimension), else 1. Indexing reads one buffer's layout.
    stages: int = 1


class ParamInfo(NamedTuple):
    """One kernel parameter, in parameter order (a tuple: ``p[1]`` is its kind)."""

    name: str
    kind: str  # "input", "output", "buffer", "scalar", "extent" or "stride"
    number: int  # input/output/buffer number, scalar s{n} or extent i{n} number, a stride's tensor id
    axis: int  # a stride's axis (0 otherwise)
    dtype: str  # kiln dtype name


@dataclass(frozen=True)
class GlobalBuffer:
    """A Global buffer a kernel needs besides its inputs and outputs (KernelSummary)."""

    name: str
    dtype: DataType
    shape: Tuple[str, ...]
    zero_init: bool
    resets_to_zero: bool


_LOWER_OPTIONS: Optional[Tuple[Tuple[str, ...], bool]] = None


def configure_lowering() -> None:
    """Hand ``KILN_DUMP=after:<pass>`` and ``KILN_VERIFY`` to the core before it lowers."""
    global _LOWER_OPTIONS
    want = (tuple(dump_after()), verify_passes())
    if want != _LOWER_OPTIONS:
        from . import _core  # noqa: PLC0415

        _core.set_lower_options(list(want[0]), want[1])
        _LOWER_OPTIONS = want


class LoweredKernel:
    """One kernel of a lowered fusion."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.kernel_ir: str = core.kernel_ir()
        # Kernel IR after the passes KILN_DUMP=after:<pass> named when this kernel was lowered.
        self.pass_dumps: List[Tuple[str, str]] = core.pass_dumps()
        self.allocations: List[AllocationInfo] = [
            AllocationInfo(tensor=a.tensor, memory_type=MemoryType(a.memory_type), ids=tuple(a.ids),
                           extents=tuple(a.extents), strides=tuple(a.strides), contiguity=tuple(a.contiguity),
                           position=a.position, zero_init=a.zero_init, resets_to_zero=a.resets_to_zero,
                           stages=a.stages)
            for a in core.allocations()
        ]
        self.global_allocations: List[GlobalBuffer] = [
            GlobalBuffer(name=b.name, dtype=DataType(b.dtype), shape=tuple(b.shape), zero_init=b.zero_init,
                         resets_to_zero=b.resets_to_zero)
            for b in core.global_allocations()
        ]
        self._cuda: Dict[bool, CudaSource] = {}
        self._params: Optional[List[ParamInfo]] = None
        if _RECORDING:
            _GENERATED.append(self)

    def _codegen(self, index32: bool = False) -> CudaSource:
        hit = self._cuda.get(index32)
        if hit is None:
            hit = self._cuda[index32] = self._core.cuda(index32)

            if dump_enabled("cuda"):
                print(f"// {hit.name}, {32 if index32 else 64}-bit indexing (runtime header left out)")
                print(kernel_part(hit.source))
        return hit

    def cuda_source_for(self, index32: bool) -> str:
        """The CUDA source with 32-bit (``True``) or 64-bit index arithmetic."""
        from .schedule import flag

        return self._codegen(flag(index32, "cuda_source_for: index32")).source

    @property
    def launch(self) -> dict:
        """Launch configuration as expressions of input sizes: grid, block, shared memory bytes."""
        la = self._core.launch()
        return {"grid": tuple(la.grid), "block": tuple(la.block), "smem_bytes": la.smem_bytes}

    @property
    def cuda_source(self) -> str:
        """The CUDA C++ translation unit (runtime header + kernel), 64-bit indexing."""
        return self._codegen().source

    @property
    def kernel_name(self) -> str:
        """Name of the ``__global__`` function in :attr:`cuda_source`."""
        return self._codegen().name

    @property
    def params(self) -> List[ParamInfo]:
        """Kernel parameters in order: (name, kind, number, axis, dtype); both index variants
        take the same parameters."""
        if self._params is None:
            params = self._codegen().params
            self._params = [ParamInfo(p.name, p.kind, p.number, p.axis, p.dtype) for p in params]
        return self._params

    def allocation(self, tensor: str) -> AllocationInfo:
        """The AllocationInfo of tensor ``tensor`` (e.g. ``"T3"``)."""
        for a in self.allocations:
            if a.tensor == tensor:
                return a
        known = [a.tensor for a in self.allocations]
        raise KilnError(f"{tensor} has no allocation in this kernel (known: {known})")

    @property
    def allocations_text(self) -> str:
        """The allocation table as text."""
        return str(self._core.allocations_text())

    def __repr__(self) -> str:
        return self.kernel_ir


# Kernels lowered while recording is on, so test suites can compile every one of them.
# Off by default: a long-running process would otherwise keep every kernel alive.
_GENERATED: List[LoweredKernel] = []
_RECORDING = False


def record_generated(on: bool = True) -> None:
    """Keep (or stop keeping) every kernel lowered from now on for ``take_generated``."""
    global _RECORDING
    _RECORDING = on
    if not on:
        _GENERATED.clear()


def take_generated() -> List[LoweredKernel]:
    """Kernels lowered since the last call (and forget them)."""
    out = list(_GENERATED)
    _GENERATED.clear()
    return out


class LoweredFusion:
    """Result of ``fd.lower(inputs)``: the kernels of a fusion (one per segment) and the
    host program that allocates their buffers and launches them."""

    def __init__(self, kernels: List[LoweredKernel], program: Any = None, fd: Any = None) -> None:
        self.kernels = kernels
        self.program = program  # kiln._core.HostProgram
        self._fd = fd  # the FusionDefinition, whose input contract `plan` checks
        self._evaluator: Any = None
        # Compiled for tensor inputs that start 16-byte aligned (vector accesses check
        # only their offsets): the evaluator refuses inputs that do not.
        self.aligned_bases = False

    @property
    def host_program(self) -> str:
        """The host program as text (Allocate / LaunchKernel / Deallocate)."""
        if self.program is None:
            raise KilnError("this lowering has no host program")
        return str(self.program.text())

    def plan(self, inputs: Sequence[Any]) -> Any:
        """The concrete plan (buffer sizes and places, launches, planned peak bytes) for
        arrays like ``inputs`` (NumPy arrays may stand in for GPU ones)."""
        from .host import plan_program  # noqa: PLC0415

        if not isinstance(inputs, (list, tuple)):
            raise KilnTypeError(f"plan: inputs must be a list of arrays and numbers, "
                                f"got {type(inputs).__name__}")
        if self._fd is not None:
            # NumPy numbers as fd.execute takes them (a 0-d array or the Python number).
            inputs = plain_numbers(self._fd, inputs)
            check_inputs(self._fd, inputs)
        arrays = [x for x in inputs if not isinstance(x, (bool, int, float))]
        scalars = [x for x in inputs if isinstance(x, (bool, int, float))]
        kind = "torch" if any(type(x).__module__.startswith("torch") for x in arrays) else "numpy"
        return plan_program(self.program, arrays, scalars, kind)

    def evaluator(self) -> Any:
        """The GPU evaluator of this lowering (created once)."""
        if self._evaluator is None:
            from .host import HostEvaluator  # noqa: PLC0415

            self._evaluator = HostEvaluator(self)
        return self._evaluator

    def __repr__(self) -> str:
        return self.host_program if self.program is not None else repr(self.kernels)


def _arg(x: Any) -> RuntimeArg:
    """One runtime argument as the core's input contract takes it."""
    if isinstance(x, (bool, int, float)):
        if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
            return RuntimeArg("bigint", str(x))
        return RuntimeArg("scalar", scalar=x)
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        return RuntimeArg("other", type(x).__name__)
    is_torch = callable(getattr(x, "stride", None)) and type(x).__module__.startswith("torch")
    raw = None if is_torch else getattr(x, "strides", None)
    try:
        # Sizes and strides are integers: anything else (a duck array's ("a", "b") or NaN
        # sizes) is not an array the core can take, named as such rather than failing in int().
        shape = [operator.index(n) for n in shape]
        raw = None if raw is None else [operator.index(s) for s in raw]
    except TypeError:
        return RuntimeArg("other", f"a {type(x).__name__} whose shape or strides are not integers")
    name = str(x.dtype).replace("torch.", "")
    if is_torch:
        # Only dense tensors with memory have strides (a sparse tensor's x.stride() raises,
        # a meta tensor has no data).
        layout = str(getattr(x, "layout", "torch.strided"))
        device = getattr(getattr(x, "device", None), "type", "")
        if layout != "torch.strided" or device == "meta":
            what = f"layout {layout}" if layout != "torch.strided" else "no data (device 'meta')"
            return RuntimeArg("other", f"a torch tensor of {what}")
        lazy = [getattr(x, m, None) for m in ("is_neg", "is_conj")]
        if any(callable(f) and f() for f in lazy):
            # Its memory holds the values before a lazy negation (x.conj().imag): read as it
            # is, every element would come out negated.
            return RuntimeArg("other", "a torch tensor with its negative or conjugate bit set (a lazy view; "
                                       "pass x.resolve_neg() or x.resolve_conj())")
        strides = [int(s) for s in x.stride()]
    else:
        # NumPy and CuPy arrays carry byte strides and an item size; anything else with a
        # shape and a dtype (a definition's own Tensor handle, say) is not an array.
        item = getattr(x, "itemsize", None) or getattr(x.dtype, "itemsize", None)
        if raw is None or not isinstance(item, int) or item <= 0:
            return RuntimeArg("other", type(x).__name__)
        odd = [k for k, (n, s) in enumerate(zip(shape, raw)) if int(n) > 1 and int(s) % item]
        if odd:
            # A field of a structured array, say: no element stride describes it.
            k = odd[0]
            return RuntimeArg("other", f"an array whose axis {k} stride of {int(raw[k])} bytes is not a "
                                       f"multiple of its {item}-byte elements (pass a copy, "
                                       f"np.ascontiguousarray(x))")
        strides = [int(s) // item for s in raw]
    return RuntimeArg("tensor", name, [int(s) for s in shape], strides)


def plain_numbers(fd: Any, inputs: Any) -> Any:
    """``inputs`` with NumPy scalars (``np.float32(2.0)``) as what the fusion takes there: a
    0-d array for a tensor input, the Python number for a scalar input; and subclasses of
    ``np.ndarray`` as plain arrays (views of the same memory)."""
    if not isinstance(inputs, (list, tuple)) or not any(
            isinstance(x, np.generic) or (isinstance(x, np.ndarray) and type(x) is not np.ndarray)
            for x in inputs):
        return inputs
    kinds = [spec.kind for spec in fd._core.input_specs()]

    def plain(i: int, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return x.view(np.ndarray)
        if not isinstance(x, np.generic):
            return x
        if i < len(kinds) and kinds[i] == "tensor":
            return np.asarray(x)
        # (A longdouble's item() is itself; the fusion's Double takes it as a float.)
        return float(x) if isinstance(x, np.floating) else x.item()

    return [plain(i, x) for i, x in enumerate(inputs)]


def check_inputs(fd: Any, inputs: Sequence[Any], any_layout: Optional[bool] = None) -> List[RuntimeArg]:
    """Validate arrays and numbers against the fusion's inputs (the core's one contract:
    count, kind, dtype, rank, sizes, sizes the definition makes equal, strides, scalars).
    ``any_layout`` (default: the fusion is scheduled automatically): inputs without
    declared contiguity may have any strides, kernels being compiled for them. Returns the
    inputs as the core read them (kind, dtype, sizes, strides), for the plan that follows."""
    if not isinstance(inputs, (list, tuple)):
        raise KilnTypeError(f"inputs must be a list of arrays, got {type(inputs).__name__}")
    if any_layout is None:
        any_layout = not fd._core.manually_scheduled
    args = [_arg(x) for x in inputs]
    fd._core.check_inputs(args, any_layout)
    return args
