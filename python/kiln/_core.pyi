"""Type stubs of ``kiln._core``, the Rust extension module (PyO3). The public API is the
``kiln`` package; these are the boundary it converts to and from. Tensors and scalars of a
``Fusion`` are passed as integer ids."""

from typing import Any, Dict, List, Optional, Tuple, Union, final

# An operand: (is_tensor, tensor id or scalar id).
Operand = Tuple[bool, int]
# A runtime scalar argument.
ScalarArg = Union[bool, int, float]

DTYPES: List[str]
# kiln dtype name -> NumPy / torch dtype name (``"Float"`` -> ``"float32"``).
DTYPE_NUMPY_NAMES: Dict[str, str]

class Fusion:
    def __init__(self) -> None: ...
    def define_tensor(
        self, shape: List[int], dtype: str, contiguity: Optional[List[Optional[bool]]] = ...
    ) -> int:
        """Declare a tensor input; returns its tensor id."""
    def define_scalar(self, dtype: str) -> int:
        """Declare a runtime scalar input; returns its scalar id."""
    def const_int(self, v: int) -> int:
        """An integer constant scalar."""
    def const_float(self, v: float) -> int:
        """A float constant scalar."""
    def const_bool(self, v: bool) -> int:
        """A bool constant scalar."""
    def unary(self, op: str, x: Operand) -> int:
        """Element-wise unary op by name."""
    def unary_value(self, op: str, x: Operand) -> Operand:
        """Element-wise unary op on any operand: (is_tensor, id) of the result."""
    def binary_value(self, op: str, a: Operand, b: Operand) -> Operand:
        """Element-wise binary op on any operands: (is_tensor, id) of the result."""
    def axis_size(self, t: int, dim: int) -> int:
        """The size of axis ``dim`` of tensor ``t`` as a scalar id."""
    def binary(self, op: str, a: Operand, b: Operand) -> int:
        """Element-wise binary op by name."""
    def where_(self, c: Operand, a: Operand, b: Operand) -> int:
        """`where(cond, a, b)`."""
    def cast(self, x: Operand, dtype: str) -> int:
        """Cast to a dtype."""
    def reduction(self, op: str, x: int, dims: List[int], keepdim: bool, dtype: Optional[str] = ...) -> int:
        """Reduction (`sum`, `max`, `min`) over dims."""
    def broadcast_in_dim(self, x: int, shape: List[int], broadcast_dims: List[int]) -> int:
        """nvFuser-style broadcast_in_dim."""
    def permute(self, x: int, dims: List[int]) -> int:
        """Permute axes."""
    def squeeze(self, x: int, dims: List[int]) -> int:
        """Drop size-one axes."""
    def index_select(self, x: int, index: int, dim: int) -> int:
        """index_select along dim."""
    def reshape(self, x: int, shape: List[Optional[int]]) -> int:
        """`x` in a new shape (scalar ids; `None` is the inferred size)."""
    def require_shape(self, x: int, sizes: List[Optional[int]], op: str) -> None:
        """Requires `x`'s sizes to be `sizes` (scalar ids; `None` is not checked), as `op` was told."""
    def slice(self, x: int, start: List[int], end: List[Optional[int]], step: List[int]) -> int:
        """`x[start:end:step]` per axis (scalar ids; an end of `None` is the size)."""
    def pad(self, x: int, widths: List[Tuple[int, int]], value: Operand) -> int:
        """`x` padded by (before, after) scalar ids per axis, with `value`."""
    def select(self, x: int, dim: int, index: int) -> int:
        """`x` at `index` (a scalar id) of axis `dim`, that axis removed."""
    def cat(self, xs: List[int], dim: int) -> int:
        """`xs` joined along `dim`."""
    def triu(self, x: int, diagonal: int) -> int:
        """The upper triangle of the last two axes."""
    def take_along_axis(self, x: int, index: int, dim: int) -> int:
        """`x` read along `dim` at `index`'s positions; `index` has `x`'s rank (size-one axes broadcast)."""
    def full(self, shape: List[int], value: Operand, dtype: str) -> int:
        """A filled tensor; `shape` holds scalar ids of the extents."""
    def iota(self, length: int, start: Operand, step: Operand, dtype: str) -> int:
        """``length`` (a scalar id) elements ``start + i * step``."""
    def random(self, dist: str, shape: List[int], a: Operand, b: Operand, seed: Operand, offset: Operand,
               dtype: str) -> int:
        """Random numbers (``dist`` "uniform" or "normal"); ``shape`` holds scalar ids."""
    def add_output(self, t: int) -> None:
        """Mark a tensor as output."""
    def add_output_alias(self, t: int, inp: int) -> None:
        """Mark ``t`` as an output written into input ``inp``'s buffer."""
    def aliases(self) -> List[Tuple[int, int]]:
        """In-place outputs: (output position, input position) pairs."""
    def tv_dtype(self, t: int) -> str:
        """Dtype name of a tensor."""
    def scalar_dtype(self, v: int) -> str:
        """Dtype name of a scalar."""
    def scalar_text(self, v: int) -> str:
        """A scalar as the fusion prints it."""
    def tv_shape(self, t: int) -> List[int]:
        """Shape of a tensor: -1 symbolic, 1 broadcast, n static (reduced axes dropped)."""
    def tv_loop(self, t: int) -> List[int]:
        """Loop domain ids of a tensor."""
    def tv_logical(self, t: int) -> List[int]:
        """Logical domain ids of a tensor."""
    def tv_memory(self, t: int) -> TensorMemory:
        """Memory type and inline position of a tensor."""
    def id_info(self, i: int) -> IterDomainInfo:
        """Extent, iter type, parallel type and label of an id."""
    def math(self) -> str:
        """The math dump."""
    def transforms(self, t: int) -> str:
        """The transform dump of one tensor."""
    def tv_label(self, t: int) -> str:
        """Label of a tensor (`T3_l_float[...]`)."""
    def input_specs(self) -> List[InputSpec]:
        """Each input's kind, name, dtype and shape, in order."""
    def check_inputs(self, args: List[RuntimeArg], any_layout: bool = ...) -> None:
        """Check runtime arguments against the definition, the input contract of every path."""
    @property
    def version(self) -> int:
        """Mutation counter (changes whenever the definition or schedule changes)."""
    @property
    def num_outputs(self) -> int:
        """Number of outputs marked so far."""
    @property
    def num_tensors(self) -> int:
        """Number of tensors created so far (the next tensor is `T{n}`)."""
    @property
    def manually_scheduled(self) -> bool:
        """True once a scheduling primitive was used."""
    def set_device_mesh(self, t: int, devices: List[int]) -> None:
        """Put tensor `t` on a device mesh (replicated until an axis is parallelized over DIDx)."""
    def tv_mesh(self, t: int) -> Optional[Tuple[List[int], Optional[int]]]:
        """Tensor `t`'s mesh devices and DIDx-sharded logical axis, if it is on a mesh."""
    @property
    def has_mesh(self) -> bool:
        """True when some tensor is on a device mesh (the fusion then runs per rank)."""
    def mesh_program(self) -> MeshProgram:
        """The sharded fusion decomposed into local stages and collectives."""
    def split(self, t: int, axis: int, factor: int, inner_split: bool) -> None:
        """Split a loop axis."""
    def merge(self, t: int, a: int, b: int) -> None:
        """Merge two loop axes."""
    def reorder(self, t: int, moves: List[Tuple[int, int]]) -> None:
        """Reorder loop axes."""
    def parallelize(self, t: int, axis: int, pt: str) -> None:
        """Parallelize a loop axis."""
    def set_memory_type(self, t: int, mt: str) -> None:
        """Set the memory type."""
    def cache_after(self, t: int) -> int:
        """Read cache."""
    def cache_before(self, t: int) -> int:
        """Write cache."""
    def inline_at(self, t: int, pos: int) -> None:
        """Inline at a position."""
    def set_allocation_domain(self, t: int, ids: List[int], contiguity: List[Optional[bool]]) -> None:
        """Set the allocation domain from id numbers."""
    def add_output_ordered(self, t: int, stride_order: List[int]) -> None:
        """Mark `t` as an output stored dense in `stride_order`."""
    def auto_scheduled(self, sizes: List[List[int]]) -> AutoSchedule:
        """A copy of the fusion scheduled automatically for inputs of `sizes`, with the"""
    def auto_program(
        self,
        sizes: List[List[int]],
        aligned_bases: bool = ...,
        device: Optional[Tuple[int, int, int, int, int]] = ...,
        scalars: List[Optional[int]] = ...,
        strides: List[List[int]] = ...,
    ) -> AutoProgram:
        """The host program the automatic schedulers (and, failing them, the segmenter) pick"""
    def shape_scalars(self) -> List[int]:
        """Positions of the runtime scalar inputs that some tensor shape reads."""
    def lower(self) -> Kernel:
        """Lower the fusion to one kernel."""
    def segment_after(self, t: int) -> None:
        """Start a new segment (kernel) after the definition of tensor `t`."""
    def set_cluster(self, pt: str, size: int) -> None:
        """Launch the kernel's blocks in clusters along a block dimension."""
    def lower_program(self) -> HostProgram:
        """Lower the fusion to its kernels (one per segment) and host program."""
    def set_streaming_load(self, t: int) -> None:
        """Mark a copy of a fusion input as read once (its vector loads skip L1)."""
    def set_evict_last(self, t: int) -> None:
        """Mark a tensor that reads a fusion input directly as kept in L2 (evict_last loads)."""
    def set_serial_grid_reduction(self, t: int) -> None:
        """Request the serial grid-reduction protocol."""
    def circular_buffer(self, t: int, stages: int, prefetch: Optional[int] = None) -> None:
        """Circular-buffer a tensor."""

class MeshProgram:
    """A sharded fusion decomposed into local stages and collectives."""

    @property
    def devices(self) -> List[int]:
        """Device ids of the mesh, in mesh order."""
    @property
    def num_stages(self) -> int:
        """Number of local stages."""
    @property
    def num_communications(self) -> int:
        """Number of collectives."""
    @property
    def takes_rank(self) -> bool:
        """True when the stages take the rank's position in the mesh as a last scalar input."""
    def stage_fusion(self, k: int) -> Fusion:
        """Stage `k` as a fusion of its own (automatically scheduled like any definition)."""
    def stage_inputs(self, k: int) -> List[int]:
        """Tensor ids of stage `k`'s tensor inputs, in its order."""
    def stage_outputs(self, k: int) -> List[int]:
        """Tensor ids of stage `k`'s outputs, in its order."""
    def instructions(self) -> List[Tuple[str, int]]:
        """The host program as (kind, index): run / allocate / comm / wait / free."""
    def communication(self, c: int) -> Optional[Tuple[str, str, int, int, bool]]:
        """Collective `c`: (kind, reduction op or "", input tensor, output tensor, in place)."""
    def inputs(self) -> List[int]:
        """Tensor ids of the fusion's tensor inputs, in order."""
    def outputs(self) -> List[int]:
        """Tensor ids handed back, in output order."""
    def name(self, t: int) -> str:
        """Name of tensor `t` (`T5`)."""
    def dtype(self, t: int) -> str:
        """Dtype of tensor `t` (the enum name)."""
    def shapes(self, sizes: List[List[int]], scalars: List[Optional[int]]) -> List[Tuple[int, List[int]]]:
        """Sizes of every tensor the program moves, for local input `sizes` and scalar values."""
    def text(self, stage_texts: List[str]) -> str:
        """The program as text, with each stage's host program inlined."""
    def spreads(self) -> str:
        """How each tensor of the definition is spread over the mesh."""

class Kernel:
    def kernel_ir(self) -> str:
        """Kernel IR as text."""
    def pass_dumps(self) -> List[Tuple[str, str]]:
        """Kernel IR after the passes lowering was asked to dump: (pass, text) in pass order."""
    def cuda(self, index32: bool = ...) -> CudaSource:
        """CUDA source (runtime header + kernel), kernel name and parameters."""
    def plan(self, sizes: List[List[int]], strides: List[List[int]], scalars: List[ScalarArg]) -> KernelPlan:
        """Concrete launch plan for input sizes/strides (elements) and scalar inputs."""
    def launch(self) -> LaunchConfig:
        """Launch configuration as expressions of the input sizes."""
    def allocations_text(self) -> str:
        """The allocation table as text."""
    def allocations(self) -> List[Allocation]:
        """The allocation record of every tensor the kernel allocates, in tensor order."""
    def gathers(self) -> List[Gather]:
        """The kernel's gathers (`index_select` sites)."""
    def global_allocations(self) -> List[GlobalBuffer]:
        """The Global buffers the kernel needs besides its inputs and outputs (KernelSummary)."""

@final
class Allocation:
    """How one tensor is laid out and where the kernel allocates it."""
    @property
    def tensor(self) -> str: ...
    @property
    def memory_type(self) -> str: ...
    @property
    def ids(self) -> List[str]:
        """Allocated ids (after loop promotion), outermost first."""
    @property
    def extents(self) -> List[str]: ...
    @property
    def strides(self) -> List[str]: ...
    @property
    def contiguity(self) -> List[bool]: ...
    @property
    def position(self) -> int: ...
    @property
    def stages(self) -> int:
        """Buffers of this layout the kernel allocates (circular-buffer stages; 1 otherwise)."""
    @property
    def zero_init(self) -> bool: ...
    @property
    def resets_to_zero(self) -> bool: ...

@final
class GlobalBuffer:
    """A Global buffer a kernel needs besides its inputs and outputs."""
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> List[str]: ...
    @property
    def zero_init(self) -> bool: ...
    @property
    def resets_to_zero(self) -> bool: ...

@final
class TensorMemory:
    """Where a tensor lives and how far it is inlined into its consumers' loops."""
    @property
    def memory_type(self) -> str:
        """Memory type name (`Local`, `Shared`, `Global`)."""
    @property
    def inline_position(self) -> int:
        """How many outer loop axes the tensor shares with its consumers."""

@final
class IterDomainInfo:
    """One iter domain of a fusion."""
    @property
    def extent(self) -> str:
        """The symbolic extent as text (`ceilDiv(i1, 128)`)."""
    @property
    def iter_type(self) -> str:
        """`Iteration`, `Reduction` or `Broadcast`."""
    @property
    def parallel_type(self) -> str:
        """The parallel type name the axis is mapped to (`Serial` when none)."""
    @property
    def label(self) -> str:
        """The id as the dumps print it."""

@final
class InputSpec:
    """One input of a fusion definition."""
    @property
    def kind(self) -> str:
        """`tensor` or `scalar`."""
    @property
    def name(self) -> str:
        """The tensor's name (`T0`) or the scalar's (`s0`)."""
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> List[int]:
        """Per axis: -1 symbolic, 1 broadcast, n static (empty for a scalar)."""

@final
class RuntimeArg:
    """One runtime argument as `Fusion.check_inputs` takes it."""
    def __init__(
        self,
        kind: str,
        text: str = ...,
        sizes: List[int] = ...,
        strides: List[int] = ...,
        scalar: Optional[ScalarArg] = ...,
    ) -> None: ...
    @property
    def kind(self) -> str:
        """`tensor`, `scalar`, `bigint` (an int beyond 64 bits) or `other` (anything else)."""
    @property
    def text(self) -> str:
        """A tensor's dtype name, a bigint's digits or another argument's type name (empty for a scalar)."""
    @property
    def sizes(self) -> List[int]:
        """A tensor's sizes (empty otherwise)."""
    @property
    def strides(self) -> List[int]:
        """A tensor's element strides (empty otherwise)."""
    @property
    def scalar(self) -> Optional[ScalarArg]:
        """A scalar's value (None otherwise)."""

@final
class AutoSchedule:
    """`Fusion.auto_scheduled`'s result: the scheduled copy and its heuristic."""
    @property
    def fusion(self) -> Fusion:
        """A copy of the fusion with the automatic schedule applied."""
    @property
    def heuristic(self) -> str:
        """The heuristic's kind (`pointwise`, `normalization`, ...)."""
    @property
    def params(self) -> List[int]:
        """The heuristic's parameters (what kernels may depend on besides the kind)."""

@final
class AutoProgram:
    """`Fusion.auto_program`'s result: the program, its heuristic and the input layout."""
    @property
    def program(self) -> HostProgram: ...
    @property
    def heuristic(self) -> str:
        """The heuristic's kind (`pointwise`, `normalization`, ...)."""
    @property
    def params(self) -> List[int]:
        """The heuristic's parameters (what kernels may depend on besides the kind)."""
    @property
    def contiguity(self) -> List[List[Optional[bool]]]:
        """The contiguity each tensor input was compiled for, in input order."""

@final
class KernelParam:
    """One parameter of a generated kernel, in parameter order."""
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str:
        """`input`, `output`, `buffer`, `scalar`, `extent` or `stride`."""
    @property
    def number(self) -> int:
        """Input, output or buffer number, scalar `s{n}` or extent `i{n}` number, or a stride's tensor id."""
    @property
    def axis(self) -> int:
        """A stride's axis (0 for the other kinds)."""
    @property
    def dtype(self) -> str: ...

@final
class CudaSource:
    """A kernel's generated CUDA."""
    @property
    def source(self) -> str:
        """The translation unit: runtime header + kernel."""
    @property
    def name(self) -> str:
        """Name of the `__global__` function."""
    @property
    def params(self) -> List[KernelParam]: ...

@final
class LaunchConfig:
    """A kernel's launch configuration as expressions of the input sizes."""
    @property
    def grid(self) -> List[str]: ...
    @property
    def block(self) -> List[str]: ...
    @property
    def smem_bytes(self) -> str:
        """Dynamic shared memory bytes."""

@final
class Gather:
    """One `index_select` site of a kernel."""
    @property
    def site(self) -> int:
        """The site id an out-of-range index is reported under."""
    @property
    def index(self) -> str:
        """The index tensor."""
    @property
    def table(self) -> str:
        """The tensor selected from."""

@final
class OutputPlan:
    """How to allocate one output of a kernel launch."""
    @property
    def sizes(self) -> List[int]:
        """Logical sizes."""
    @property
    def layout(self) -> List[int]:
        """Storage order: `layout[k]` is the logical axis stored k-th (outermost first)."""
    @property
    def dtype(self) -> str: ...

@final
class GlobalBufferPlan:
    """A Global buffer of a kernel launch, sized for concrete inputs."""
    @property
    def name(self) -> str: ...
    @property
    def elements(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def zero_init(self) -> bool: ...
    @property
    def resets_to_zero(self) -> bool: ...

@final
class KernelPlan:
    """One kernel's launch plan for concrete inputs (`Kernel.plan`)."""
    @property
    def outputs(self) -> List[OutputPlan]: ...
    @property
    def buffers(self) -> List[GlobalBufferPlan]:
        """The Global buffers in parameter order."""
    @property
    def scalar_args(self) -> List[Any]:
        """Values of the scalar parameters in parameter order (after the tensor parameters)."""
    @property
    def grid(self) -> Tuple[int, int, int]: ...
    @property
    def block(self) -> Tuple[int, int, int]: ...
    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory bytes."""
    @property
    def index32(self) -> bool:
        """Every offset fits in 32 bits: the 32-bit index variant of the kernel is safe."""

@final
class Instruction:
    """One instruction of a host program."""
    @property
    def op(self) -> str:
        """`Allocate`, `Deallocate` or `LaunchKernel`."""
    @property
    def kernel(self) -> Optional[int]:
        """The kernel a LaunchKernel launches (None otherwise)."""
    @property
    def buffer(self) -> Optional[str]:
        """The buffer an Allocate or Deallocate names (None for a LaunchKernel)."""
    @property
    def inputs(self) -> List[str]:
        """A LaunchKernel's input buffers (empty otherwise)."""
    @property
    def outputs(self) -> List[str]:
        """A LaunchKernel's output buffers (empty otherwise)."""
    @property
    def intermediates(self) -> List[str]:
        """A LaunchKernel's intermediate (work) buffers (empty otherwise)."""

@final
class BufferAlloc:
    """One buffer of a host program's concrete plan."""
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def sizes(self) -> List[int]:
        """Logical sizes (outputs and intermediates) or `[elements]` (kernel buffers)."""
    @property
    def layout(self) -> List[int]:
        """Storage order of `sizes` (`layout[k]` is the axis stored k-th)."""
    @property
    def elements(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def zero_init(self) -> bool: ...
    @property
    def resets_to_zero(self) -> bool: ...
    @property
    def place(self) -> str:
        """`input`, `output`, `arena`, `zero_pool` or `error` (an error word)."""
    @property
    def offset(self) -> int:
        """Byte offset in the arena or zeroed pool; input, output or error word number."""

@final
class KernelLaunch:
    """One kernel launch of a host program's concrete plan."""
    @property
    def kernel(self) -> int:
        """The kernel (index into `HostProgram.kernels()`)."""
    @property
    def args(self) -> List[int]:
        """Buffer ids (indices into `HostPlan.buffers`) in kernel parameter order."""
    @property
    def memsets(self) -> List[int]:
        """Buffer ids to zero right before the launch (`zero_init` without `resets_to_zero`)."""
    @property
    def scalars(self) -> List[Tuple[Any, str]]:
        """(value, dtype) of every scalar parameter, in parameter order."""
    @property
    def grid(self) -> Tuple[int, int, int]: ...
    @property
    def block(self) -> Tuple[int, int, int]: ...
    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory bytes."""
    @property
    def index32(self) -> bool:
        """The launch uses the kernel's 32-bit index variant."""

@final
class HostPlan:
    """A host program evaluated for concrete inputs (`HostProgram.plan`)."""
    @property
    def buffers(self) -> List[BufferAlloc]: ...
    @property
    def launches(self) -> List[KernelLaunch]: ...
    @property
    def peak_bytes(self) -> int:
        """Largest total of simultaneously live buffers (bytes, unaligned), outputs included."""
    @property
    def arena_bytes(self) -> int:
        """Bytes of the workspace arena."""
    @property
    def zero_pool_bytes(self) -> int:
        """Bytes of the zeroed pool."""

class HostProgram:
    def text(self) -> str:
        """The program as text."""
    def segmentation(self) -> str:
        """How the automatic segmenter grouped the fusion (empty for the user's segments)."""
    def kernels(self) -> List[Kernel]:
        """The kernels, one per segment, in launch order."""
    def instructions(self) -> List[Instruction]:
        """The program's instructions, in order."""
    def input_names(self) -> List[str]:
        """Names of the fusion's tensor inputs, in order."""
    def output_names(self) -> List[str]:
        """Names of the fusion's outputs, in order."""
    def input_views(self, sizes: List[List[int]], strides: List[List[int]],
                    scalars: List[Any]) -> List[Tuple[str, int, List[int], Optional[List[Optional[int]]]]]:
        """Tensors that read an input at another shape: (name, input position, shape, axes); axes
        is None for a row-major view, else the input axis each view axis reads through its
        stride (None: a new size-one axis)."""
        ...
    def output_layouts(self) -> List[Optional[List[int]]]:
        """Per output, the logical axis each stored axis is, where it is handed back in its stored order."""
    def output_views(self, sizes: List[List[int]], scalars: List[Any]) -> List[Optional[List[int]]]:
        """The shape each output is handed back in where its kernel computes it at another."""
    @property
    def plan_misses(self) -> int:
        """Number of plans evaluated so far (misses of the per-signature cache)."""
    def plan(self, sizes: List[List[int]], strides: List[List[int]], scalars: List[ScalarArg]) -> HostPlan:
        """Concrete plan for input sizes/strides (elements) and scalar inputs; cached per signature."""

class PreparedLaunch:
    def __init__(
        self,
        function: int,
        grid: Tuple[int, int, int],
        block: Tuple[int, int, int],
        smem: int,
        params: List[Optional[Any]],
        memsets: List[Tuple[int, int]] = ...,
        device: int = ...,
        stream_getter: Optional[Any] = ...,
    ) -> None:
        """Pack a launch: ``params`` has one entry per kernel parameter, ``None`` for a device"""
    def launch(self, stream: int, *args: Any) -> None:
        """Launch on ``stream`` (a CUstream handle; 0 is the legacy default stream) with the"""
    def launch_current(self, *args: Any) -> None:
        """Launch on CuPy's current stream (read through CuPy's C API, as CuPy's own launches do)."""
    def zero(self, stream: int, *pointers: Any) -> None:
        """Zero the ``memsets`` buffers on ``stream`` (``cuMemsetD8Async``), before a launch;"""
    def zero_current(self, *pointers: Any) -> None:
        """``zero`` on CuPy's current stream."""
    def stream(self) -> int:
        """CuPy's current stream as ``launch_current`` reads it (a test hook)."""
    def packed(self, *args: Any) -> bytes:
        """The parameter buffer a launch with these per-call arguments passes, read back through"""
    @property
    def layout(self) -> List[Tuple[int, int]]:
        """(offset, size) of every kernel parameter in the packed buffer."""
    @property
    def pointer_count(self) -> int:
        """Device pointers a call takes."""
    @property
    def scalar_count(self) -> int:
        """Per-call scalars a call takes (after, or among, the pointers in parameter order)."""
    @property
    def stream_getter_used(self) -> bool:
        """Whether ``launch_current`` can read CuPy's current stream itself."""
    @property
    def dims(self) -> Tuple[Tuple[int, int, int], Tuple[int, int, int], int]:
        """(grid, block, dynamic shared memory bytes)."""
    def verify(self) -> Optional[List[Tuple[int, int]]]:
        """The kernel's own parameter layout, [(offset, size)] from ``cuFuncGetParamInfo``"""

@final
class GraphLaunch:
    """Several prepared launches replayed as one CUDA graph (node parameters updated per call)."""
    def __init__(self, nodes: List[Tuple[PreparedLaunch, List[int]]]) -> None:
        """A graph of ``nodes``: (``PreparedLaunch``, argument indices) pairs in launch order."""
    def launch(self, stream: int, *args: Any) -> None:
        """Launch the graph on ``stream`` with this call's arguments."""
    def launch_current(self, *args: Any) -> None:
        """Launch the graph on CuPy's current stream."""
    def packed(self, *args: Any) -> List[bytes]:
        """The parameter buffer of each kernel node for these call arguments (a test hook)."""
    @property
    def stream_getter_used(self) -> bool:
        """Whether ``launch_current`` can read CuPy's current stream itself."""
    @property
    def argument_count(self) -> int:
        """Arguments a call takes."""
    @property
    def kernel_count(self) -> int:
        """Kernel nodes of the graph."""
    @property
    def instantiations(self) -> int:
        """Times the graph was built and instantiated."""
    @property
    def node_updates(self) -> int:
        """Node parameter updates made so far (kernel and memset nodes)."""
    @property
    def replays(self) -> int:
        """Graph launches so far."""
    @property
    def memsets(self) -> List[List[Tuple[int, int]]]:
        """(argument index, bytes) of each memset node, per kernel node."""

def set_lower_options(dump_after: List[str], verify: bool) -> None:
    """Set what every later lowering records: IR dumps after the named passes, and whether the
    kernel-IR verifier runs after every pass."""
def lower_passes() -> List[str]:
    """The names of the kernel-IR passes, in order."""

@final
class ElementwiseOp:
    """One element-wise op of the op table, as ``fd.ops`` exposes it."""
    @property
    def name(self) -> str: ...
    @property
    def arity(self) -> int:
        """Number of operands (1 or 2)."""
    @property
    def doc(self) -> str: ...

def elementwise_ops() -> List[ElementwiseOp]:
    """The element-wise ops of the op table, unary first, in table order."""
def load_cuda_driver() -> None: ...
def stream_is_capturing(stream: int) -> bool:
    """Whether raw stream ``stream`` is being captured into a CUDA graph."""
    ...
def exchange_capture_mode(mode: int) -> Optional[int]:
    """Set this thread's stream-capture mode (0 global, 1 thread-local, 2 relaxed); return the old one."""
    ...
def execute_cpu(kernel: Kernel, inputs: List[Any]) -> List[Any]: ...
