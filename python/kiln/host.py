"""Host program evaluator: runs a lowered fusion's host program on the GPU with CuPy.

The Rust core turns input sizes/strides into a concrete plan once per input signature
(``HostProgram.plan``); this module turns that plan into a *recipe* (pointer sources,
pre-converted size and stride arguments, loaded kernels) and then, per call, only allocates
the outputs, fills in pointers and the scalar inputs' values and launches on the current
stream of the inputs' framework: CuPy's for CuPy arrays, torch's for torch tensors (so that
a call inside ``with torch.cuda.stream(s)`` is ordered after the work that produced its
inputs on ``s``, and its outputs belong to ``s`` in torch's allocator). A signature holds
the scalar inputs' Python types, not their values: a scalar that changes every call (a
learning rate, a step counter) reuses one recipe. Only a fusion whose plan reads an int or
bool scalar's value (a ``full`` shape) keys on those values.

Buffers, following seed 004:
* fusion outputs: arrays of the inputs' kind (CuPy or torch), handed back: fresh ones, or
  (``KILN_REUSE_OUTPUTS``, outputs of at most ``REUSE_MAX_BYTES``) the previous call's
  when nothing outside kiln references them any more and the stream is the same;
* ``zero_init`` + ``resets_to_zero`` (semaphores that kernels leave at zero): regions of
  a :class:`ZeroedPool` that is zeroed once and reused by every later call;
* ``zero_init`` only: regions of the workspace arena, zeroed (``memsetAsync``) right
  before the launch that uses them;
* everything else: regions of the workspace arena, where a region freed by a
  ``Deallocate`` is reused by later ``Allocate``s of the same call (liveness plan).

The arena and pool persist across calls of one evaluator, one of each per device, and are
used in stream order on the stream of the call; calls of one evaluator from different
streams must be ordered by the caller.

Launches go through kiln's own launcher (``kiln._core.PreparedLaunch``: ``cuLaunchKernel``
from libcuda, everything but the device pointers packed once per recipe) on that stream;
where libcuda cannot be loaded, or with ``KILN_LAUNCHER=cupy`` (read when a signature is
first prepared), they go through CuPy's ``Function.__call__``.

CUDA graphs (``KILN_CUDA_GRAPHS``, default on, kiln's launcher only): the first call of a
signature launches kernel by kernel; from the second on, the whole program (its kernels, and
the memsets of zero_init buffers as memset nodes right before their kernel) is one
``kiln._core.GraphLaunch``, built and instantiated at its first launch, whose call updates
only the nodes whose device pointers or scalar values differ from the last call's
(``cuGraphExecKernelNodeSetParams``) and launches the graph on the call's stream. New sizes
or strides are a new signature, with its own recipe and graph. A graph launch costs the
host less than one ``cuLaunchKernel`` (see ``benches/host_latency.py``), so even one-kernel
programs are replayed as graphs.

Calls inside a caller's CUDA graph capture (``torch.cuda.graph``, CuPy's stream capture) are
recorded like any other stream work: a ``GraphLaunch`` on a capturing stream enqueues its
kernels and memsets one by one, and a recipe with a workspace or zeroed buffers runs on
memory of its own, kept as long as the evaluator, since the caller's graph replays at those
addresses (``HostEvaluator.run_captured``). A signature's first call may itself happen inside
such a capture: it is prepared (modules loaded, error words allocated) with this thread's
capture mode relaxed (``relaxed_capture``), so those driver calls do not invalidate it.

``run_on_cpu`` walks the same host program with a per-kernel CPU launcher (the
interpreter's ``kiln._core.execute_cpu(kernel, inputs)``).
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from typing import Any, Callable, DefaultDict, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ._core import DTYPE_NUMPY_NAMES as _ITEMSIZE_NAMES
from ._core import HostPlan
from ._env import cuda_graphs_choice, launcher_choice, reuse_outputs
from ._errors import KilnError, KilnTypeError

# A recipe's specialised launcher, called as ``launcher(inputs, evaluator)``.
Launcher = Callable[[Sequence[Any], "HostEvaluator"], List[Any]]


class PlannedBuffer(NamedTuple):
    """One buffer of a concrete plan (``kiln._core.BufferAlloc`` as a tuple the recipe reads)."""

    name: str
    dtype: str
    sizes: Tuple[int, ...]
    layout: Tuple[int, ...]
    elements: int
    nbytes: int
    zero_init: bool
    resets_to_zero: bool
    place: str  # "input", "output", "arena", "zero_pool", "error"
    offset: int  # byte offset (arena / zero_pool) or input/output/error word index


class PlannedLaunch(NamedTuple):
    """One kernel launch of a concrete plan (``kiln._core.KernelLaunch`` as a tuple)."""

    kernel: int
    args: Tuple[int, ...]  # buffer ids in parameter order
    memsets: Tuple[int, ...]  # buffers zeroed right before the launch
    scalars: Tuple[Tuple[Any, str], ...]  # (value, dtype) of every non-pointer parameter
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    smem: int
    index32: bool  # the launch uses the kernel's 32-bit index variant


class ProgramPlan:
    """A host program evaluated for concrete input sizes (see ``HostProgram.plan``), read
    out of the core's ``HostPlan`` once per signature into plain tuples."""

    def __init__(self, raw: HostPlan) -> None:
        self.buffers = [PlannedBuffer(b.name, b.dtype, tuple(b.sizes), tuple(b.layout), b.elements, b.nbytes,
                                      b.zero_init, b.resets_to_zero, b.place, b.offset)
                        for b in raw.buffers]
        self.launches = [PlannedLaunch(la.kernel, tuple(la.args), tuple(la.memsets), tuple(la.scalars),
                                       la.grid, la.block, la.smem_bytes, la.index32)
                         for la in raw.launches]
        self.peak_bytes: int = raw.peak_bytes
        self.arena_bytes: int = raw.arena_bytes
        self.zero_pool_bytes: int = raw.zero_pool_bytes

    def buffer(self, name: str) -> PlannedBuffer:
        """The planned buffer called ``name``."""
        for b in self.buffers:
            if b.name == name:
                return b
        raise KilnError(f"no buffer {name} in this plan (known: {[b.name for b in self.buffers]})")

    def table(self) -> str:
        """The allocation table as text."""
        rows = [f"{'buffer':<12} {'dtype':<8} {'sizes':<16} {'bytes':>10}  {'place':<10} "
                f"{'offset':>8}  zero_init resets_to_zero"]
        for b in self.buffers:
            rows.append(f"{b.name:<12} {b.dtype:<8} {str(list(b.sizes)):<16} {b.nbytes:>10}  {b.place:<10} "
                        f"{b.offset:>8}  {str(b.zero_init):<9} {b.resets_to_zero}")
        rows.append(f"planned peak {self.peak_bytes} bytes; workspace arena {self.arena_bytes} bytes; "
                    f"zeroed pool {self.zero_pool_bytes} bytes")
        return "\n".join(rows)


def elem_strides(x: Any, kind: str) -> List[int]:
    """Strides of an array in elements (``kind``: "torch", else NumPy/CuPy byte strides)."""
    if kind == "torch":
        return list(x.stride())
    item = x.itemsize
    return [s // item for s in x.strides]


def plan_program(program: Any, arrays: Sequence[Any], scalars: Sequence[Any],
                 kind: str = "cupy") -> ProgramPlan:
    """Evaluate ``program`` (a ``kiln._core.HostProgram``) for arrays like ``arrays``."""
    sizes = [[int(s) for s in x.shape] for x in arrays]
    strides = [elem_strides(x, kind) for x in arrays]
    return ProgramPlan(program.plan(sizes, strides, list(scalars)))


# Allocates ``nbytes`` device bytes (zeroed when asked) in the order of a raw stream
# pointer (None: the current one); returns the object that owns the memory and its pointer.
Allocator = Callable[[int, bool, Optional[int]], Tuple[Any, int]]


def _cupy_alloc(nbytes: int, zeroed: bool, stream: Optional[int]) -> Tuple[Any, int]:
    """Device memory from CuPy's pool, allocated on raw stream ``stream``."""
    import cupy as cp  # noqa: PLC0415

    # On the caller's stream, so that CuPy's pool hands memory freed by a growth to
    # nobody before that stream's kernels are done with it.
    with on_stream(stream):
        mem = (cp.zeros if zeroed else cp.empty)(nbytes, dtype=cp.uint8)
    return mem, int(mem.data.ptr)


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """Relax this thread's stream-capture mode for the block: preparing a signature loads
    modules, allocates host-mapped error words and asks the driver for free memory, calls
    that a caller's capture in global mode (torch.cuda.graph's default) would otherwise be
    invalidated by when the first call of a signature happens inside it."""
    from . import _core  # noqa: PLC0415

    old = _core.exchange_capture_mode(_RELAXED)
    try:
        yield
    finally:
        if old is not None:
            _core.exchange_capture_mode(old)


_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


def torch_allocator(device: int) -> Allocator:
    """Device memory of ``device`` from torch's allocator: the one a torch.cuda.graph capture
    may allocate from (CuPy's pool cannot allocate while torch captures; torch keeps the
    graph's memory in the graph's own pool)."""

    def alloc(nbytes: int, zeroed: bool, stream: Optional[int]) -> Tuple[Any, int]:
        import torch  # noqa: PLC0415

        mem = (torch.zeros if zeroed else torch.empty)(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return mem, int(mem.data_ptr())

    return alloc


class ZeroedPool:
    """Device memory zeroed once and reused across calls by buffers whose kernels leave
    them at zero (``zero_init`` and ``resets_to_zero``). Grows (and re-zeroes) only when
    a plan needs more than it holds."""

    def __init__(self, alloc: Allocator = _cupy_alloc) -> None:
        self._alloc = alloc
        self._mem: Any = None
        self._ptr = 0
        self.capacity = 0
        self.zero_fills = 0  # memsets of the pool (once per growth)
        self.zeroed_bytes = 0
        self.reuses = 0  # calls served without zeroing

    def get(self, nbytes: int, stream: Optional[int] = None) -> int:
        """Device pointer of at least ``nbytes`` zeroed bytes, zeroed in the order of
        ``stream`` (a raw stream pointer; None: the current stream)."""
        if nbytes > self.capacity:
            self._mem, self._ptr = self._alloc(nbytes, True, stream)
            self.capacity = nbytes
            self.zero_fills += 1
            self.zeroed_bytes += nbytes
        else:
            self.reuses += 1
        return self._ptr

    def stats(self) -> Dict[str, int]:
        """Pool statistics: capacity, zero_fills, zeroed_bytes, reuses."""
        return {"capacity": self.capacity, "zero_fills": self.zero_fills,
                "zeroed_bytes": self.zeroed_bytes, "reuses": self.reuses}


class Workspace:
    """Device memory of one device reused by every call: the arena that intermediates and
    work buffers are planned into. Grows only when a plan needs more than it holds."""

    def __init__(self, alloc: Allocator = _cupy_alloc) -> None:
        self._alloc = alloc
        self.mem: Any = None
        self._ptr = 0
        self.nbytes = 0

    def get(self, nbytes: int, stream: Optional[int] = None) -> int:
        """Device pointer of at least ``nbytes`` bytes, allocated (and the old memory freed)
        in the order of raw stream ``stream`` when it grows."""
        if nbytes > self.nbytes:
            self.mem, self._ptr = self._alloc(nbytes, False, stream)
            self.nbytes = nbytes
        return self._ptr


class ErrorWords:
    """Pinned host memory that kernels with gathers write an out-of-range index into
    (four int64 per kernel: site + 1, element, value, table extent). With unified
    addressing the device writes it directly, so the host reads it at the next call with
    no sync; :meth:`HostEvaluator.check_errors` synchronizes first."""

    def __init__(self, slots: int) -> None:
        import cupy as cp  # noqa: PLC0415

        self._mem = cp.cuda.alloc_pinned_memory(32 * max(slots, 1))
        self.words = np.frombuffer(self._mem, np.int64, 4 * max(slots, 1))
        self.words[:] = 0
        self.ptr = int(self._mem.ptr)


class _Recipe:
    __slots__ = ("arena", "arena_bytes", "device", "direct", "error_kernels", "errors", "fast", "graph",
                 "inputs", "launcher", "launches", "nbufs", "outputs", "plan", "reuse", "torch_mode", "zero",
                 "zero_bytes")


# Signatures whose outputs total at most this many bytes hand back the previous call's
# outputs when nothing else references them (``KILN_REUSE_OUTPUTS``): allocating costs
# 1.4-3 us of host time, which matters only where the kernels are that short, and a larger
# output kept alive between calls would hold memory that the caller has let go.
REUSE_MAX_BYTES = 1 << 20


_SEQUENCES = (list, tuple)
_SCALARS = (bool, int, float)


_KINDS: Dict[type, int] = {}  # array type -> 1 CuPy, 2 torch, 0 anything else


def _kind(t: type) -> int:
    """Whether arrays of type ``t`` are CuPy (1), torch (2) or neither (0), learned once."""
    k = _KINDS.get(t)
    if k is None:
        m = t.__module__
        k = _KINDS[t] = 1 if m.startswith("cupy") else 2 if m.startswith("torch") else 0
    return k


def signature_key(inputs: Sequence[Any]) -> Tuple:
    """The cache key of an input signature (shapes, strides, dtypes, devices, each array's
    start address modulo 16, scalar types); raises TypeError or AttributeError for
    inputs that have none (NumPy arrays, non-lists)."""
    if type(inputs) not in _SEQUENCES:
        raise TypeError("inputs must be a list or a tuple")
    if len(inputs) == 1:  # the common case, without a loop
        x = inputs[0]
        k = _KINDS.get(type(x))
        if k == 1:
            d = x.data
            return (x.shape, x.strides, x.dtype, d.device_id, d.ptr & 15)
        if k == 2:
            return (2, x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
    key = []
    for x in inputs:
        t = type(x)
        k = _kind(t)
        if k == 1:
            d = x.data
            key.append((x.shape, x.strides, x.dtype, d.device_id, d.ptr & 15))
        elif k == 2:
            key.append((2, x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15))
        elif isinstance(x, _SCALARS):
            # A scalar's value is a per-call argument; its type stays in the key, so a value
            # of a new type (a float for an Int scalar) takes the validating full path.
            key.append(t)
        else:
            key.append((t, x))  # hashes only what validation will refuse (or fails to hash)
    return tuple(key) if len(inputs) != 1 else key[0]


def launcher_kind() -> str:
    """``"rust"`` (kiln's launcher) or ``"cupy"`` (CuPy's): ``KILN_LAUNCHER`` picks one,
    unset it is ``"rust"`` wherever libcuda loads."""
    want = launcher_choice()
    if want not in ("", "rust", "cupy"):
        raise KilnError(f"KILN_LAUNCHER must be 'rust' or 'cupy', got {want!r}")
    if want == "cupy":
        return "cupy"
    from . import _core  # noqa: PLC0415

    try:
        _core.load_cuda_driver()
    except KilnError:
        if want == "rust":
            raise
        return "cupy"
    return "rust"


def graphs_enabled() -> bool:
    """Whether host programs are replayed as CUDA graphs (``KILN_CUDA_GRAPHS``, default on)."""
    want = cuda_graphs_choice()
    if want not in ("on", "off"):
        raise KilnError(f"KILN_CUDA_GRAPHS must be 0 or 1, got {want!r}")
    return want == "on"


def prepare_graph(nodes: Sequence[Tuple[Any, Sequence[int]]]) -> Any:
    """A ``kiln._core.GraphLaunch`` of ``nodes``: (``PreparedLaunch``, argument indices)."""
    from . import _core  # noqa: PLC0415

    return _core.GraphLaunch([(pl, list(ix)) for pl, ix in nodes])


_STREAM_GETTER: List[Any] = []  # [capsule or None] once looked up
_EXTERNAL: Dict[int, Any] = {}  # raw stream pointer -> cupy.cuda.ExternalStream


class _RawStream:
    """A raw stream pointer behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.ptr)


def external_stream(ptr: int) -> Any:
    """A CuPy stream object for the raw stream ``ptr`` (one per pointer, kept)."""
    st = _EXTERNAL.get(ptr)
    if st is None:
        import cupy as cp  # noqa: PLC0415

        # CuPy 14 deprecates ExternalStream for Stream.from_external (the stream protocol).
        from_external = getattr(getattr(cp.cuda, "Stream", None), "from_external", None)
        st = from_external(_RawStream(ptr)) if from_external is not None else cp.cuda.ExternalStream(ptr)
        _EXTERNAL[ptr] = st
    return st


def on_stream(ptr: Optional[int]) -> Any:
    """A context making raw stream ``ptr`` CuPy's current stream, so that CuPy's memsets
    and its memory pool's stream bookkeeping follow it; None: leave CuPy's stream alone."""
    return contextlib.nullcontext() if ptr is None else external_stream(ptr)


def torch_stream_getter() -> Callable[[int], int]:
    """``f(device) -> int``: the raw pointer of torch's current stream on ``device``."""
    import torch  # noqa: PLC0415

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: int(torch.cuda.current_stream(device).cuda_stream)


def _cupy_stream_getter() -> Any:
    """The capsule of CuPy's C function that returns its current stream (what CuPy's own
    launches read), or None when this CuPy does not export it."""
    if not _STREAM_GETTER:
        cap = None
        try:
            from cupy_backends.cuda import stream  # noqa: PLC0415

            cap = stream.__pyx_capi__["get_current_stream_ptr"]
        except (ImportError, AttributeError, KeyError, TypeError):
            pass
        _STREAM_GETTER.append(cap)
    return _STREAM_GETTER[0]


def prepare_launch(function: Any, grid: Sequence[int], block: Sequence[int], smem: int, pointers: int,
                   scalars: Sequence[Any], memsets: Sequence[Tuple[int, int]] = (),
                   device: int = -1) -> Any:
    """A ``kiln._core.PreparedLaunch`` of CuPy ``function`` taking ``pointers`` device
    pointers then ``scalars``: NumPy scalars of the kernel's parameter types (constants) or
    kiln dtype names (per-call scalars, passed after the pointers); it reads CuPy's current
    stream itself where CuPy exports it; the layout is checked against the kernel's."""
    from . import _core  # noqa: PLC0415

    params: List[Optional[Any]] = [None] * pointers
    params += [v if isinstance(v, str) else np.asarray(v).tobytes() for v in scalars]
    args = (int(function.ptr), tuple(int(g) for g in grid), tuple(int(b) for b in block), int(smem), params,
            [(int(k), int(n)) for k, n in memsets], int(device))
    getter = _cupy_stream_getter()
    launch = None
    if getter is not None:
        try:
            launch = _core.PreparedLaunch(*args, getter)
        except KilnTypeError:  # exported under another signature: read the stream in Python
            launch = None
    if launch is None:
        launch = _core.PreparedLaunch(*args)
    launch.verify()
    return launch


class HostEvaluator:
    """Runs one lowered fusion's host program on the GPU (CuPy or torch CUDA arrays)."""

    def __init__(self, lowered: Any) -> None:
        self.lowered = lowered  # kiln.lowering.LoweredFusion
        self._recipes: Dict[Tuple, _Recipe] = {}
        # Compiled kernels per segment, keyed by (device, index variant: False 64-bit, True 32-bit).
        self._functions: List[Dict[Tuple[int, bool], Any]] = [{} for _ in lowered.kernels]
        # Per device: a recipe binds the arena and zeroed pool of its inputs' device, so a
        # signature on another device never gets memory of this one.
        self._arenas: DefaultDict[int, Workspace] = defaultdict(Workspace)
        self._pools: DefaultDict[int, ZeroedPool] = defaultdict(ZeroedPool)
        # True once a plan turned out to read an int/bool scalar input's value (a size):
        # then recipes are keyed on those values too (see ``_key``).
        self._by_value = False
        # Per device: the error words of this program's kernels with gathers.
        self._error_words: Dict[int, ErrorWords] = {}
        self._error_kernels: Dict[int, int] = {}  # error word slot -> kernel
        self.memsets = 0  # per-launch zeroings of zero_init-only buffers
        self.launches = 0
        # Test hook: skip the per-launch zeroing (shows why it is needed).
        self.zero_per_launch = True
        # The workspaces of calls recorded by a CUDA graph capture (see ``run_captured``).
        self.captured_memory: List[Tuple[Workspace, ZeroedPool]] = []

    # -- per call ----------------------------------------------------------------------
    def run(self, inputs: Sequence[Any], validate: Optional[Callable[[], None]] = None) -> List[Any]:
        """Run on ``inputs`` (CuPy arrays / torch CUDA tensors and Python scalars);
        ``validate`` runs before the first launch of a new input signature."""
        key = self._key(inputs)
        r = self._recipes.get(key)
        if r is None:
            with relaxed_capture():
                if validate is not None:
                    validate()
                r = self._prepare(inputs)
                self._recipes[self._key(inputs)] = r  # _prepare may have switched to value keys
                # The first call of a signature launches kernel by kernel; a repeat replays
                # the graph (built at its first launch), so one-off signatures never build one.
                return r.direct(inputs, self)
        return r.fast(inputs, self)

    def run_cached(self, inputs: Sequence[Any]) -> Optional[List[Any]]:
        """Run if this input signature was seen before (validated then), else None."""
        try:
            r = self._recipes.get(self._key(inputs))
        except (AttributeError, TypeError):
            return None
        if r is None:
            return None
        return r.fast(inputs, self)

    def run_captured(self, inputs: Sequence[Any], r: _Recipe) -> List[Any]:
        """Run recipe ``r`` for a call that a CUDA graph capture records: its intermediates
        and zeroed buffers get memory of their own, kept as long as this program, because
        the graph replays at those addresses after the call (the shared workspace may grow
        and hand its old memory back, and later calls write it)."""
        if r.torch_mode:
            alloc = torch_allocator(r.device)
            arena, pool = Workspace(alloc), ZeroedPool(alloc)
        else:
            arena, pool = Workspace(), ZeroedPool()
        self.captured_memory.append((arena, pool))
        words = self.error_words_for(r.device, len(r.errors)) if r.errors else None
        run = _specialize(r, r.torch_mode, r.device, r.launcher, arena, pool, words, captured=True)
        return run(inputs, self)

    def _key(self, inputs: Sequence[Any]) -> Tuple:
        """The recipe key of ``inputs``: their signature, plus the int/bool scalar values
        when this fusion's plan reads them (``_by_value``)."""
        key = signature_key(inputs)
        if self._by_value:
            key = (key, tuple(x for x in inputs if isinstance(x, (bool, int))))
        return key

    def launcher_for(self, inputs: Sequence[Any]) -> Optional[Launcher]:
        """The specialised launcher of a prepared signature like ``inputs``, called as
        ``launcher(inputs, evaluator)``; None if that signature was not prepared, or when
        recipes are keyed on scalar values (a plain signature cannot pick one)."""
        if self._by_value:
            return None
        r = self._recipes.get(self._key(inputs))
        return None if r is None else r.fast

    def _memset_ptrs(self, ptrs: Sequence[Any], memsets: Sequence[Tuple[int, int]],
                     stream: Optional[int] = None) -> None:
        """Zero each ``(buffer, nbytes)`` of ``memsets`` at ``ptrs`` on raw stream ``stream``
        (None: CuPy's current stream)."""
        import cupy as cp  # noqa: PLC0415

        if stream is None:
            stream = cp.cuda.get_current_stream().ptr
        for p, (_bid, nbytes) in zip(ptrs, memsets):
            cp.cuda.runtime.memsetAsync(int(p), 0, nbytes, stream)
            self.memsets += 1

    def error_words_for(self, device: int, slots: int) -> ErrorWords:
        """The error words of ``device`` (``slots`` of them, created zeroed on first use)."""
        hit = self._error_words.get(device)
        if hit is None or len(hit.words) < 4 * slots:
            hit = self._error_words[device] = ErrorWords(slots)
        return hit

    def report_errors(self, words: Any) -> None:
        """Raise the out-of-range index an earlier launch recorded in ``words`` (and clear
        it), naming the kernel, the index tensor, the element and the value."""
        for slot in range(len(words) // 4):
            site, element, value, extent = (int(v) for v in words[4 * slot:4 * slot + 4])
            if site == 0:
                continue
            words[:] = 0
            k = self._error_kernels.get(slot, 0)
            gathers = {g.site: (g.index, g.table) for g in self.lowered.kernels[k]._core.gathers()}
            ix, table = gathers.get(site - 1, ("the index tensor", "the table"))
            raise KilnError(f"a gather (index_select, take_along_axis) in kernel {k} of an earlier call of "
                            f"this fusion: the index tensor {ix} "
                            f"held {value} at element {element}; {table} has {extent} entries along the "
                            f"gathered axis (indices must be in [0, {extent})); entry 0 was read instead")

    def check_errors(self) -> None:
        """Synchronize each device this program ran on and raise what its kernels recorded."""
        import cupy as cp  # noqa: PLC0415

        for dev, ew in self._error_words.items():
            with cp.cuda.Device(dev):
                cp.cuda.Device(dev).synchronize()
            self.report_errors(ew.words)

    def arena_for(self, device: int) -> Workspace:
        """The arena of ``device`` (created empty on first use)."""
        return self._arenas[device]

    def pool_for(self, device: int) -> ZeroedPool:
        """The zeroed pool of ``device`` (created empty on first use)."""
        return self._pools[device]

    @property
    def pool(self) -> ZeroedPool:
        """The zeroed pool of CuPy's current device."""
        import cupy as cp  # noqa: PLC0415

        return self.pool_for(cp.cuda.Device().id)

    @property
    def _arena(self) -> Any:
        """The arena memory of CuPy's current device (None before its first use)."""
        import cupy as cp  # noqa: PLC0415

        return self.arena_for(cp.cuda.Device().id).mem

    # -- per signature -----------------------------------------------------------------
    def _prepare(self, inputs: Sequence[Any]) -> _Recipe:
        import cupy as cp  # noqa: PLC0415

        from .runtime.kernel_executor import np_dtype, np_scalar  # noqa: PLC0415

        arrays = [x for x in inputs if not isinstance(x, _SCALARS)]
        scalars = [x for x in inputs if isinstance(x, _SCALARS)]
        scalar_pos = [i for i, x in enumerate(inputs) if isinstance(x, _SCALARS)]
        torch_mode = any(type(x).__module__.startswith("torch") for x in arrays)
        dev = cp.cuda.Device().id
        for i, x in enumerate(arrays):
            what = f"input {i}"
            if torch_mode:
                if not getattr(x, "is_cuda", False):
                    raise KilnTypeError(f"{what}: torch tensor is on {x.device}, expected a CUDA tensor")
                got = x.get_device()
            else:
                if not hasattr(x, "data") or not hasattr(x.data, "device_id"):
                    raise KilnTypeError(f"{what}: expected a CuPy array, got {type(x).__name__}")
                got = x.data.device_id
            if got != dev:
                raise KilnError(f"{what}: is on device {got} but the current device is {dev}")
            ptr = x.data_ptr() if torch_mode else x.data.ptr
            if getattr(self.lowered, "aligned_bases", False) and ptr % 16:
                raise KilnError(f"{what}: starts at address {ptr:#x}, not 16-byte aligned, but this lowering "
                                "was compiled for aligned inputs; fd.execute picks a lowering for it")
        kind = "torch" if torch_mode else "cupy"
        plan = plan_program(self.lowered.program, arrays, scalars, kind)
        if not self._by_value and any(not isinstance(v, float) for v in scalars):
            # Does the plan read an int/bool scalar's value (a size, a grid)? Planning with
            # every scalar a float tells: the plan binds only int and bool scalars, and any
            # expression that reads an unbound one fails.
            try:
                plan_program(self.lowered.program, arrays, [0.0] * len(scalars), kind)
            except KilnError:
                self._by_value = True
                self._recipes.clear()  # keyed without values: none can be trusted now
        r = _Recipe()
        r.plan = plan
        r.nbufs = len(plan.buffers)
        array_pos = [i for i, x in enumerate(inputs) if not isinstance(x, (bool, int, float))]
        r.inputs = [(bid, array_pos[b.offset], torch_mode)
                    for bid, b in enumerate(plan.buffers) if b.place == "input"]
        outs = sorted(((b.offset, bid, b) for bid, b in enumerate(plan.buffers) if b.place == "output"))
        r.outputs = []
        device = arrays[0].device if torch_mode and arrays else None
        for _, bid, b in outs:
            stored = tuple(b.sizes[a] for a in b.layout)
            inverse = [b.layout.index(a) for a in range(len(b.layout))]
            view = None if list(b.layout) == sorted(b.layout) else (lambda o, inv=inverse: o.permute(*inv)
                                                                     if torch_mode else o.transpose(inv))
            if torch_mode:
                import torch  # noqa: PLC0415

                tdt = getattr(torch, _ITEMSIZE_NAMES[b.dtype])

                def alloc(shape: Tuple[int, ...] = stored, tdt: Any = tdt,
                          device: Any = device) -> Tuple[Any, int]:
                    o = torch.empty(shape, dtype=tdt, device=device)
                    return o, o.data_ptr()
            else:
                ndt = np.dtype(np_dtype(b.dtype))

                def alloc(shape: Tuple[int, ...] = stored, ndt: Any = ndt) -> Tuple[Any, int]:
                    o = cp.empty(shape, dtype=ndt)
                    return o, o.data.ptr
            r.outputs.append((bid, alloc, view))
        small = bool(outs) and sum(b.nbytes for *_, b in outs) <= REUSE_MAX_BYTES
        r.reuse = _reuse_baselines(r.outputs[0][1], torch_mode) if small and reuse_outputs() else None
        r.arena = [(bid, b.offset) for bid, b in enumerate(plan.buffers) if b.place == "arena"]
        r.zero = [(bid, b.offset) for bid, b in enumerate(plan.buffers) if b.place == "zero_pool"]
        r.errors = [(bid, b.offset) for bid, b in enumerate(plan.buffers) if b.place == "error"]
        for la in plan.launches:
            for bid, slot in r.errors:
                if bid in la.args:
                    self._error_kernels[slot] = la.kernel
        r.arena_bytes = plan.arena_bytes
        r.zero_bytes = plan.zero_pool_bytes
        r.launches = []
        for la in plan.launches:
            if min(la.grid) == 0 or min(la.block) == 0:
                continue  # empty tensors: nothing to compute
            fn = self._function(la.kernel, la.smem, la.index32, la.block[0] * la.block[1] * la.block[2])
            scal = self._scalar_args(la, inputs, scalar_pos, np_scalar)
            memsets = tuple((bid, max(plan.buffers[bid].nbytes, 1)) for bid in la.memsets)
            r.launches.append((fn, la.grid, la.block, la.smem, la.args, scal, memsets))
        r.launcher = launcher_kind()
        r.torch_mode, r.device = torch_mode, dev
        words = self.error_words_for(dev, len(r.errors)) if r.errors else None
        arena, pool = self.arena_for(dev), self.pool_for(dev)
        r.fast = r.direct = _specialize(r, torch_mode, dev, r.launcher, arena, pool, words)
        r.graph = None
        # A memset of a buffer its kernel does not take (none today) has no graph node.
        nodes_only = all(b in la[4] for la in r.launches for b, _n in la[6])
        if r.launcher == "rust" and r.launches and nodes_only and graphs_enabled():
            r.fast = _specialize(r, torch_mode, dev, r.launcher, arena, pool, words, graph=True)
        return r

    def _scalar_args(self, la: PlannedLaunch, inputs: Sequence[Any], scalar_pos: Sequence[int],
                     np_scalar: Callable[[Any, str], Any]) -> Tuple[Tuple[Any, str, int], ...]:
        """The non-pointer arguments of ``la`` as (value, dtype, input position): sizes and
        strides are constants (NumPy scalars, position -1); a scalar input is passed per
        call (value None, its position in ``inputs``), after checking its kind."""
        kernel_params = self.lowered.kernels[la.kernel].params
        params = [p for p in kernel_params if p.kind in ("scalar", "extent", "stride")]
        out = []
        for p, (v, d) in zip(params, la.scalars):
            if p.kind != "scalar":
                out.append((np_scalar(v, d), d, -1))
                continue
            pos = scalar_pos[p.number]
            x = inputs[pos]
            if isinstance(x, float) and d in ("Int", "Int32", "Bool"):
                # NumPy would truncate it; the CPU interpreter refuses it: so do we.
                article = "an" if str(d)[:1] in "AEIOU" else "a"
                raise KilnTypeError(f"input {pos} (s{p.number}): got float {x} for {article} {d} scalar")
            try:  # a value out of the parameter's range: refused now, naming the input
                np_scalar(x, d)
            except (OverflowError, ValueError) as e:
                raise KilnError(f"input {pos} (s{p.number}): {x} does not fit a {d} scalar: {e}") from e
            out.append((None, d, pos))
        return tuple(out)

    def _function(self, k: int, smem: int, index32: bool = False, threads: int = 0) -> Any:
        import cupy as cp  # noqa: PLC0415

        from .runtime import executor  # noqa: PLC0415

        # A module is loaded per device: another device's function is an invalid handle here.
        key = (cp.cuda.Device().id, index32, threads)
        ck = self._functions[k].get(key)
        if ck is None:
            kern = self.lowered.kernels[k]
            ck = executor.load_module(kern.cuda_source_for(index32), kern.kernel_name, threads=threads)
            if isinstance(ck, executor.CompiledKernel):
                executor.check_local_reservation(ck.function, f"kernel {k} ({kern.kernel_name})",
                                                 _local_tensors(kern.allocations_text))
            self._functions[k][key] = ck
        if smem > ck.max_dynamic_smem:
            executor.set_max_dynamic_smem(ck.function, smem)
            ck.max_dynamic_smem = smem
        return ck.function

    def plan_for(self, inputs: Sequence[Any]) -> ProgramPlan:
        """The concrete plan used for ``inputs`` (prepared if needed)."""
        key = self._key(inputs)
        r = self._recipes.get(key)
        if r is None:
            r = self._prepare(inputs)
            self._recipes[key] = r
        return r.plan


def _local_tensors(allocations: str) -> str:
    """The Local tensors of a kernel's allocation dump, with their allocated ids."""
    names = [ln.split(" ids=")[0].replace(" Local", "") + " " + ln.split(" ids=")[1].split(" strides=")[0]
             for ln in allocations.splitlines() if " Local ids=" in ln]
    return "Local tensors: " + (", ".join(names) or "none, the compiler's own")


def _specialize(r: _Recipe, torch_mode: bool, device: int, launcher: str, arena: Workspace,
                pool: ZeroedPool, words: Optional[ErrorWords] = None, graph: bool = False,
                captured: bool = False) -> Launcher:
    """A launcher specialised to one recipe: straight-line Python with every constant
    (shapes, offsets, size/stride arguments, grid/block) bound, so a call does no lookups or
    loops. ``launcher="rust"``: each launch is one call of a ``PreparedLaunch`` with the
    device pointers and the scalar inputs (``inputs[i]``, converted in Rust); ``"cupy"``:
    CuPy's ``Function.__call__`` with arrays and NumPy scalars (``np_scalar`` per call).
    ``graph`` (``"rust"`` only): every launch and memset of the recipe is one
    ``GraphLaunch`` call (sets ``r.graph``); the recipe's ``direct`` launcher serves calls
    that turn the per-launch zeroing off (a test hook). A recipe with a workspace or zeroed
    buffers checks whether its stream is being captured into a CUDA graph and then runs
    through ``HostEvaluator.run_captured``; ``captured`` builds that launcher (memory of its
    own, no output reuse, no graph)."""
    import cupy as cp  # noqa: PLC0415

    from .runtime.kernel_executor import np_scalar  # noqa: PLC0415

    rust = launcher == "rust"
    ns: Dict[str, Any] = {"_nd": cp.ndarray, "_gs": cp.cuda.get_current_stream, "_nps": np_scalar,
                          "_xs": external_stream}
    lines = ["def _run(inputs, ev):"]
    if graph and any(memsets for *_, memsets in r.launches):
        ns["_direct"] = r.direct
        lines.append("    if not ev.zero_per_launch: return _direct(inputs, ev)")
    if words is not None:
        # An index an earlier call found out of range is reported now (no sync needed:
        # the device wrote it to host memory).
        ns["_ew"] = words.words
        checks = " or ".join(f"_ew[{4 * slot}]" for _bid, slot in r.errors)
        lines.append(f"    if {checks}: ev.report_errors(_ew)")
    # torch tensors: torch's current stream, read once per call and passed explicitly.
    stream_arg = ""
    if torch_mode:
        ns["_ts"] = torch_stream_getter()
        lines.append(f"    s = _ts({int(device)})")
        stream_arg = ", s"
    if not captured and (r.arena_bytes or r.zero_bytes):
        from . import _core  # noqa: PLC0415

        ns["_cap"], ns["_r"] = _core.stream_is_capturing, r
        stream = "s" if torch_mode else "_gs().ptr"
        lines.append(f"    if _cap({stream}): return ev.run_captured(inputs, _r)")
    # Per buffer: its device pointer (rust) or what CuPy takes as the argument (cupy).
    arg: Dict[int, str] = {}
    for bid, i, _t in r.inputs:
        if torch_mode:
            arg[bid] = f"inputs[{i}].data_ptr()"
        else:
            arg[bid] = f"inputs[{i}].data.ptr" if rust else f"inputs[{i}]"
    outs = []
    reuse = r.reuse is not None and not captured
    if reuse:
        ns["_rc"], ns["_B"] = sys.getrefcount, r.reuse[0]
        if torch_mode:
            ns["_suc"] = r.reuse[1]
    if reuse and not torch_mode:
        # The previous outputs are reused only on the stream they were written on.
        lines.append("    s = _gs().ptr")
    for n, (bid, alloc, view) in enumerate(r.outputs):
        ns[f"_alloc{n}"] = alloc
        if torch_mode:
            if reuse:
                _reuse_torch_output(n, alloc, ns, lines)
            else:
                lines.append(f"    o{n}, p{n} = _alloc{n}()")
            arg[bid] = f"p{n}"
        else:
            ns[f"_shape{n}"], ns[f"_dt{n}"] = alloc.__defaults__
            if reuse:
                _reuse_cupy_output(n, ns, lines)
            else:
                lines.append(f"    o{n} = _nd(_shape{n}, _dt{n})")
            arg[bid] = f"o{n}.data.ptr" if rust else f"o{n}"
        if view is not None:
            ns[f"_view{n}"] = view
            outs.append(f"_view{n}(o{n})")
        else:
            outs.append(f"o{n}")
    if r.arena_bytes:
        ns["_arena"] = arena
        lines.append(f"    base = _arena.get({r.arena_bytes}{stream_arg})")
        for bid, off in r.arena:
            arg[bid] = f"base + {off}"
    if words is not None:
        for bid, slot in r.errors:
            arg[bid] = str(words.ptr + 32 * slot)
    if r.zero_bytes:
        ns["_zpool"] = pool
        lines.append(f"    zbase = _zpool.get({r.zero_bytes}{stream_arg})")
        for bid, off in r.zero:
            arg[bid] = f"zbase + {off}"
    explicit = torch_mode or reuse  # the generated code holds the stream in ``s``
    if graph:
        _graph_launch(r, ns, lines, arg, device, explicit_stream=explicit)
    elif rust and r.launches:
        _rust_launches(r, ns, lines, arg, device, explicit_stream=explicit)
    else:
        for k, (fn, grid, block, smem, argids, scal, memsets) in enumerate(r.launches):
            ns[f"_f{k}"], ns[f"_g{k}"], ns[f"_b{k}"] = fn, tuple(grid), tuple(block)
            if memsets:
                ns[f"_ms{k}"] = memsets
                pl = ", ".join(arg[b] for b, _ in memsets)
                lines.append(f"    if ev.zero_per_launch: ev._memset_ptrs(({pl},), _ms{k}{stream_arg})")
            names = [arg[a] for a in argids]
            for j, (v, d, pos) in enumerate(scal):
                if pos >= 0:  # a scalar input: this call's value, converted now
                    ns[f"_d{k}_{j}"] = d
                    names.append(f"_nps(inputs[{pos}], _d{k}_{j})")
                    continue
                ns[f"_s{k}_{j}"] = v
                names.append(f"_s{k}_{j}")
            on = ", stream=_xs(s)" if torch_mode else ""
            lines.append(f"    _f{k}(_g{k}, _b{k}, ({', '.join(names)},), shared_mem={int(smem)}{on})")
    if r.launches:
        lines.append(f"    ev.launches += {len(r.launches)}")
    lines.append(f"    return [{', '.join(outs)}]")
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the plan's own constants
    return ns["_run"]


def _reuse_baselines(alloc: Callable[..., Tuple[Any, int]], torch_mode: bool) -> Optional[Tuple[Any, Any]]:
    """(reference counts, torch's storage use-count getter or None): the counts an output
    held by nothing but kiln's slot shows to the generated checks, measured once per recipe
    on a fresh array of ``alloc`` through the same expressions (the counts the interpreter
    reports differ between Python versions). None where this array library lacks what the
    checks read (then every call allocates)."""
    scope: Dict[str, Any] = {"_rc": sys.getrefcount}
    if torch_mode:
        import torch  # noqa: PLC0415

        scope["_suc"] = getattr(torch._C, "_storage_Use_Count", None)
        if scope["_suc"] is None:
            return None
        probe = ("def _probe(_k):\n    o = _k[0]\n"
                 "    return _rc(o), o._use_count(), _suc(o.untyped_storage()._cdata)\n")
    else:
        probe = "def _probe(_k):\n    o = _k[0]\n    return _rc(o), _rc(o.data), _rc(o.data.mem)\n"
    exec(probe, scope)  # noqa: S102 - a fixed probe, compiled like the generated launcher
    try:
        return scope["_probe"]([alloc((1,))[0]]), scope.get("_suc")
    except AttributeError:
        return None


def _reuse_cupy_output(n: int, ns: Dict[str, Any], lines: List[str]) -> None:
    """Append the allocation of CuPy output ``n`` that reuses the previous call's array
    when no reference to it, to its memory pointer or to its memory is held outside kiln's
    slot (a view holds the array as its base, an export the array or its memory), it was
    written on this call's stream ``s``, and its shape was not reassigned in place."""
    ns[f"_k{n}"] = [None, None]  # [array, stream it was last written on]
    lines += [f"    o{n} = _k{n}[0]",
              f"    if _k{n}[1] != s or (_rc(o{n}), _rc(o{n}.data), _rc(o{n}.data.mem)) != _B"
              f" or o{n}.shape != _shape{n}:",
              f"        o{n} = _nd(_shape{n}, _dt{n})",
              f"        _k{n}[0] = o{n}",
              f"        _k{n}[1] = s"]


def _reuse_torch_output(n: int, alloc: Callable[..., Tuple[Any, int]], ns: Dict[str, Any],
                        lines: List[str]) -> None:
    """``_reuse_cupy_output`` for a torch output: no Python reference, no other handle on
    its TensorImpl (a DLPack export) and no other tensor on its storage (a view) outside
    kiln's slot, the same stream, and its data pointer, sizes, strides and ``requires_grad``
    as kiln made them (torch tensors can be resized or re-pointed in place)."""
    shape = alloc.__defaults__[0]
    ns[f"_k{n}"] = [None, None, 0]  # [tensor, stream, data pointer]
    ns[f"_shape{n}"] = tuple(shape)
    ns[f"_st{n}"] = tuple(_contiguous_strides(shape))
    lines += [f"    o{n} = _k{n}[0]",
              f"    if _k{n}[1] != s or (_rc(o{n}), o{n}._use_count(), _suc(o{n}.untyped_storage()._cdata))"
              f" != _B or o{n}.data_ptr() != _k{n}[2] or o{n}.shape != _shape{n} or o{n}.stride() != _st{n}"
              f" or o{n}.requires_grad:",
              f"        o{n}, p{n} = _alloc{n}()",
              f"        _k{n}[0] = o{n}",
              f"        _k{n}[1] = s",
              f"        _k{n}[2] = p{n}",
              "    else:",
              f"        p{n} = _k{n}[2]"]


def _contiguous_strides(shape: Sequence[int]) -> List[int]:
    """Row-major element strides of ``shape`` (torch's for a fresh ``torch.empty``)."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return out[::-1]


def _rust_launches(r: _Recipe, ns: Dict[str, Any], lines: List[str], arg: Dict[int, str],
                   device: int, explicit_stream: bool = False) -> None:
    """Append the launches of ``r`` through ``PreparedLaunch``es to the generated ``lines``:
    each device pointer computed once, then one Rust call per memset group and launch, the
    scalar inputs passed after the pointers as this call's Python values.
    ``explicit_stream``: the generated code already holds the stream in ``s``."""
    used = []
    for _fn, _g, _b, _sm, argids, _sc, memsets in r.launches:
        used += [b for b in argids if b not in used]
        used += [b for b, _ in memsets if b not in used]
    for b in used:  # each pointer once, even when several launches take it
        lines.append(f"    a{b} = {arg[b]}")
    # The Python-side stream read, emitted once before the first launch needing it.
    stream_read = explicit_stream
    for k, (fn, grid, block, smem, argids, scal, memsets) in enumerate(r.launches):
        # Memsets of buffers the kernel takes go through the same object; any other (none
        # today) keeps the CuPy memset.
        mine = [(argids.index(b), n) for b, n in memsets if b in argids]
        other = tuple((b, n) for b, n in memsets if b not in argids)
        pl = prepare_launch(fn, grid, block, smem, len(argids), [d if pos >= 0 else v for v, d, pos in scal],
                            mine, device)
        ns[f"_f{k}"] = fn  # keeps the CuPy Function, so its module, alive with the launcher
        ns[f"_P{k}"] = pl
        current = pl.stream_getter_used and not explicit_stream
        if not current and not stream_read:
            stream_read = True
            lines.append("    s = _gs().ptr")
        ptrs = ", ".join(f"a{b}" for b in argids)
        per_call = [f"inputs[{pos}]" for _v, _d, pos in scal if pos >= 0]
        call_args = ", ".join([f"a{b}" for b in argids] + per_call)
        if other:
            ns[f"_ms{k}"] = other
            pl_other = ", ".join(f"a{b}" for b, _ in other)
            stream_arg = ", s" if explicit_stream else ""
            lines.append(f"    if ev.zero_per_launch: ev._memset_ptrs(({pl_other},), _ms{k}{stream_arg})")
        if mine:
            zero = "zero_current(" if current else "zero(s, "
            lines.append("    if ev.zero_per_launch:")
            lines.append(f"        _P{k}.{zero}{ptrs})")
            lines.append(f"        ev.memsets += {len(mine)}")
        # The bound method, so a call is one C-level call with no attribute lookup.
        ns[f"_L{k}"] = pl.launch_current if current else pl.launch
        lines.append(f"    _L{k}({call_args})" if current else f"    _L{k}(s, {call_args})")


def _graph_launch(r: _Recipe, ns: Dict[str, Any], lines: List[str], arg: Dict[int, str],
                  device: int, explicit_stream: bool = False) -> None:
    """Append one ``GraphLaunch`` call running every launch of ``r`` (memsets included as
    memset nodes) to the generated ``lines``: its arguments are each device pointer once,
    then each scalar input once per dtype it is passed as. Sets ``r.graph``."""
    ptrs: List[int] = []  # buffer ids, in argument order
    scalars: List[Tuple[int, str]] = []  # (input position, dtype), after the pointers
    for _fn, _g, _b, _sm, argids, _sc, memsets in r.launches:
        ptrs += [b for b in argids if b not in ptrs]
        if any(b not in argids for b, _ in memsets):
            raise KilnError("a memset of a buffer its kernel does not take cannot be a graph node")
    for *_, scal, _ms in r.launches:
        scalars += [(pos, d) for _v, d, pos in scal if pos >= 0 and (pos, d) not in scalars]
    nodes = []
    for k, (fn, grid, block, smem, argids, scal, memsets) in enumerate(r.launches):
        mine = [(argids.index(b), n) for b, n in memsets]
        pl = prepare_launch(fn, grid, block, smem, len(argids), [d if pos >= 0 else v for v, d, pos in scal],
                            mine, device)
        ns[f"_f{k}"] = fn  # keeps the CuPy Function, so its module, alive with the graph
        index = [ptrs.index(b) for b in argids]
        index += [len(ptrs) + scalars.index((pos, d)) for _v, d, pos in scal if pos >= 0]
        nodes.append((pl, index))
    g = r.graph = prepare_graph(nodes)
    ns["_graph"] = g
    call_args = [arg[b] for b in ptrs] + [f"inputs[{pos}]" for pos, _d in scalars]
    current = g.stream_getter_used and not explicit_stream
    if current:
        ns["_G"] = g.launch_current
        lines.append(f"    _G({', '.join(call_args)})")
    else:
        ns["_G"] = g.launch
        if not explicit_stream:
            lines.append("    s = _gs().ptr")
        lines.append(f"    _G(s, {', '.join(call_args)})")
    zeroed = sum(len(memsets) for *_, memsets in r.launches)
    if zeroed:
        lines.append(f"    ev.memsets += {zeroed}")


def strided_view(x: Any, shape: Sequence[int], axes: Sequence[Optional[int]]) -> Any:
    """The view of ``x`` whose axis ``k`` reads input axis ``axes[k]`` from index 0 (a new
    size-one axis where None): a prefix of each axis read, in any order."""
    read = [a for a in axes if a is not None]
    size = {a: n for n, a in zip(shape, axes) if a is not None}
    # Input axes the view does not read are read at index 0.
    y = x[tuple(slice(0, size[a]) if a in size else 0 for a in range(x.ndim))]
    kept = sorted(read)
    order = [kept.index(a) for a in read]
    # (A torch tensor's `transpose` swaps two axes; its `permute` is NumPy's `transpose`.)
    y = y.permute(*order) if callable(getattr(y, "permute", None)) else y.transpose(order)
    return y.reshape(tuple(shape))


def run_on_cpu(lowered: Any, inputs: Sequence[Any],
               launcher: Callable[[Any, List[Any]], Sequence[Any]]) -> List[Any]:
    """Walk the host program on the CPU: ``launcher(kernel_core, kernel_inputs)`` runs one
    kernel (tensor inputs then scalars, e.g. ``kiln._core.execute_cpu``) and returns its
    outputs; kernel-internal buffers are the launcher's business."""
    arrays = [x for x in inputs if not isinstance(x, (bool, int, float))]
    scalars = [x for x in inputs if isinstance(x, (bool, int, float))]
    env: Dict[str, Any] = {}
    for name, x in zip(lowered.program.input_names(), arrays):
        env[name] = x
    # Inputs read at another shape: row-major views of the caller's arrays (the plan was
    # made for their layout, so the reshape moves no element).
    strides = [elem_strides(x, "torch" if callable(getattr(x, "stride", None)) else "numpy") for x in arrays]
    for name, pos, shape, axes in lowered.program.input_views([[int(s) for s in x.shape] for x in arrays],
                                                              strides, list(scalars)):
        if axes is None:
            env[name] = arrays[pos].reshape(shape)
        else:
            env[name] = strided_view(arrays[pos], shape, axes)
    for ins in lowered.program.instructions():
        if ins.op == "Deallocate" and ins.buffer is not None:
            env.pop(ins.buffer, None)
        if ins.kernel is None:  # Allocate / Deallocate
            continue
        results = launcher(lowered.kernels[ins.kernel]._core, [env[n] for n in ins.inputs] + scalars)
        for n, v in zip(ins.outputs, results):
            env[n] = v
    outs = [env[n] for n in lowered.program.output_names()]
    # Outputs computed at another shape are handed back at the defined one (row-major).
    # Outputs stored permuted are handed back in their stored order (a row-major array).
    outs = [o if lay is None else o.transpose(lay) for o, lay in zip(outs, lowered.program.output_layouts())]
    views = lowered.program.output_views([[int(s) for s in x.shape] for x in arrays], list(scalars))
    return [o if v is None else o.reshape(v) for o, v in zip(outs, views)]
