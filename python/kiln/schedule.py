"""Manual scheduling on tensor handles: split, merge, reorder, parallelize, caches, inlining."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import numpy as np

from ._errors import KilnAttributeError, KilnError, KilnTypeError
from .enums import MemoryType, ParallelType

if TYPE_CHECKING:
    from ._core import IterDomainInfo
    from .fusion import FusionDefinition, Tensor
    from .multidevice import DeviceMesh


def is_bool(c: object) -> bool:
    """True for Python's and NumPy's booleans (``np.bool_``, named ``bool`` in NumPy 2)."""
    return isinstance(c, (bool, np.bool_))


def flag(v: object, what: str) -> bool:
    """A yes/no option given as a bool (Python's or NumPy's; None is no); anything else is
    refused rather than read by its truth (``keepdim='False'`` would keep the axis)."""
    if v is None:
        return False
    if not is_bool(v):
        raise KilnTypeError(f"{what}: expected a bool, got {v!r}")
    return bool(v)


def is_flag(c: object) -> bool:
    """A contiguity entry: None, a bool (Python's or NumPy's), or the integer 0 or 1."""
    if c is None or is_bool(c):
        return True
    return isinstance(c, numbers.Integral) and int(c) in (0, 1)


def handle_id(owner: object, owner_type: type, id_: object, handle: str, unknown: str) -> int:
    """The id of a handle (``kiln.Tensor(fd, 3)``, built by kiln or by hand) as the core takes
    it, an int in ``[0, 2**32)``, after checking that ``owner`` is an ``owner_type``;
    ``unknown`` (``"T{} is not a tensor of this fusion"``) words an id out of that range as
    the core words an id it does not know."""
    # Checked here: the core's conversion would raise PyO3's OverflowError or TypeError, and
    # a handle on something else an AttributeError at its first use.
    if not isinstance(owner, owner_type):
        shown = repr(owner) if len(repr(owner)) <= 40 else f"a {type(owner).__name__}"
        owner_name = "Tensor" if owner_type is ScheduleMixin else owner_type.__name__
        raise KilnTypeError(f"{handle}: expected the {owner_name} it belongs to, got {shown}")
    if isinstance(id_, bool) or not isinstance(id_, numbers.Integral):
        shown = repr(id_) if len(repr(id_)) <= 40 else f"a {type(id_).__name__}"
        raise KilnTypeError(f"{handle}: expected an int id, got {shown}")
    i = int(id_)  # a NumPy integer is the int it holds
    if not 0 <= i < 2**32:
        raise KilnError(unknown.format(i))
    return i


class IterDomain:
    """One loop axis (or any axis in a tensor's transform history)."""

    __slots__ = ("_tensor", "_id")

    def __init__(self, tensor: Tensor, id_: int) -> None:
        self._id = handle_id(tensor, ScheduleMixin, id_, "IterDomain",
                             "iter domain {} is not part of this fusion")
        self._tensor = tensor

    def _info(self) -> IterDomainInfo:
        return self._tensor._fd._core.id_info(self._id)

    @property
    def extent(self) -> str:
        """The symbolic extent as text (e.g. ``ceilDiv(i1, 128)``)."""
        return self._info().extent

    @property
    def iter_type(self) -> str:
        """``Iteration``, ``Reduction`` or ``Broadcast``."""
        return self._info().iter_type

    @property
    def is_reduction(self) -> bool:
        """True for a reduction axis."""
        return self.iter_type == "Reduction"

    @property
    def is_broadcast(self) -> bool:
        """True for a broadcast axis."""
        return self.iter_type == "Broadcast"

    @property
    def parallel_type(self) -> ParallelType:
        """The parallel type this axis is mapped to."""
        return ParallelType(self._info().parallel_type)

    def parallelize(self, pt: ParallelType) -> None:
        """Map this loop axis onto ``pt``."""
        if not isinstance(pt, ParallelType):
            raise KilnTypeError(f"{self._tensor.name}: parallelize expects a ParallelType, got {pt!r}")
        t = self._tensor
        loop = t._fd._core.tv_loop(t._id)
        if self._id not in loop:
            label = self._info().label
            core = t._fd._core
            owner = next((n for n in range(core.num_tensors)
                          if n != t._id and self._id in core.tv_loop(n)), None)
            if owner is not None:
                raise KilnError(f"{t.name}: {label} is not an axis of {t.name}; it is a loop axis of "
                                f"T{owner}")
            raise KilnError(f"{t.name}: {label} is no longer a loop axis (it was split or merged)")
        t._fd._core.parallelize(t._id, loop.index(self._id), pt.value)

    def __repr__(self) -> str:
        return self._info().label

    def __eq__(self, other: object) -> bool:
        same_fusion = isinstance(other, IterDomain) and other._tensor._fd is self._tensor._fd
        return same_fusion and other._id == self._id  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash(self._id)


def _int(value: object, what: str, tensor: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise KilnTypeError(f"{tensor}: {what} must be an int, got {value!r}")
    value = int(value)  # a NumPy integer is the int it holds
    if not -(2**63) <= value < 2**63:
        raise KilnError(f"{tensor}: {what} {value} does not fit 64 bits")
    return value


# nvFuser and TVM spellings a user may reach for, with kiln's way to say the same.
_OTHER_NAMES = {
    "rfactor": "kiln has no rfactor: split the reduced axis and parallelize its parts instead "
               "(s.split(1, 32); s.axis(2).parallelize(ParallelType.TIDx)); each part reduced by "
               "threads or blocks is combined as its parallel type says",
    "compute_at": "kiln's is inline_at: p.inline_at(pos) shares p's first pos loop axes with its "
                  "consumers (nvFuser's computeAt called on the producer)",
    "inline_most": "use t.inline_at(-1): the deepest valid position",
    "parallelize": "parallelize an axis: t.axis(i).parallelize(ParallelType.TIDx)",
    "vectorize": "vectorize an axis of a copy: c = x.cache_after(); "
                 "c.axis(-1).parallelize(ParallelType.Vectorize)",
}
_OTHER_NAMES["rFactor"] = _OTHER_NAMES["rfactor"]
_OTHER_NAMES["computeAt"] = _OTHER_NAMES["compute_at"]
_OTHER_NAMES["inlineMost"] = _OTHER_NAMES["inline_most"]


class ScheduleMixin:
    """Scheduling primitives shared by tensor handles."""

    _fd: FusionDefinition
    _id: int

    def __getattr__(self, name: str) -> Any:
        """Refuse another system's scheduling name with kiln's way to say it."""
        hint = _OTHER_NAMES.get(name)
        if hint is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise KilnAttributeError(f"T{object.__getattribute__(self, '_id')}.{name}: {hint}")

    @property
    def name(self) -> str:
        """The tensor's name, ``T{n}``."""
        return f"T{self._id}"

    @property
    def loop_domain(self) -> List[IterDomain]:
        """The loop axes, outermost first (reduction axes included)."""
        return [IterDomain(self, i) for i in self._fd._core.tv_loop(self._id)]  # type: ignore[arg-type]

    @property
    def logical_domain(self) -> List[IterDomain]:
        """The logical axes (the shape the user sees, reduction axes included)."""
        return [IterDomain(self, i) for i in self._fd._core.tv_logical(self._id)]  # type: ignore[arg-type]

    def axis(self, i: int) -> IterDomain:
        """Loop axis ``i`` (negative counts from the end)."""
        loop = self._fd._core.tv_loop(self._id)
        i = _int(i, "axis", self.name)
        n = len(loop)
        if not -n <= i < n:
            raise KilnError(f"{self.name}: axis {i} is out of range; the loop domain has {n} axes")
        return IterDomain(self, loop[i])  # type: ignore[arg-type]

    @property
    def memory_type(self) -> MemoryType:
        """Where the tensor lives."""
        return MemoryType(self._fd._core.tv_memory(self._id).memory_type)

    @property
    def inline_position(self) -> int:
        """How many outer loop axes the tensor shares with its consumers."""
        return int(self._fd._core.tv_memory(self._id).inline_position)

    def set_device_mesh(self, mesh: DeviceMesh) -> None:
        """Put the tensor on ``mesh`` (replicated there until an axis is parallelized over DIDx)."""
        from .multidevice import DeviceMesh  # noqa: PLC0415

        if not isinstance(mesh, DeviceMesh):
            raise KilnTypeError(f"{self.name}: set_device_mesh expects a kiln.DeviceMesh, got {mesh!r}")
        self._fd._core.set_device_mesh(self._id, list(mesh.devices))

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        """The mesh the tensor was put on, or None."""
        from .multidevice import DeviceMesh  # noqa: PLC0415

        m = self._fd._core.tv_mesh(self._id)
        return None if m is None else DeviceMesh(m[0])

    def split(self, axis: int, factor: int, inner_split: bool = True) -> None:
        """Split loop axis ``axis`` into (ceilDiv(extent, factor), factor); on a tensor with
        a device mesh, ``inner_split=False`` by the mesh size shards that axis."""
        self._fd._core.split(self._id, _int(axis, "axis", self.name), _int(factor, "factor", self.name),
                             flag(inner_split, f"split {self.name}: inner_split"))

    def merge(self, a: int, b: Optional[int] = None) -> None:
        """Merge loop axes ``a`` (outer) and ``b`` (inner, default ``a + 1``)."""
        a = _int(a, "axis", self.name)
        if b is None:
            n = len(self._fd._core.tv_loop(self._id))
            b = a + 1 if a >= 0 else a + 1 + n
            if b == n:
                raise KilnError(f"{self.name}: merge({a}): axis {a} is the last of its {n} loop axes "
                                f"(there is no axis {n}); merge(a) merges axis a with axis a + 1")
        self._fd._core.merge(self._id, a, _int(b, "axis", self.name))

    def reorder(self, moves: Dict[int, int]) -> None:
        """Move loop axes ``{old: new}``; unlisted axes keep their relative order."""
        if not isinstance(moves, dict):
            raise KilnTypeError(f"{self.name}: reorder expects a dict {{old: new}}, got {moves!r}")
        pairs = [(_int(k, "axis", self.name), _int(v, "axis", self.name)) for k, v in moves.items()]
        self._fd._core.reorder(self._id, pairs)

    def set_memory_type(self, mt: MemoryType) -> None:
        """Place the tensor in Global, Shared or Local memory."""
        if not isinstance(mt, MemoryType):
            raise KilnTypeError(f"{self.name}: set_memory_type expects a MemoryType, got {mt!r}")
        self._fd._core.set_memory_type(self._id, mt.value)

    def cache_after(self) -> Tensor:
        """A copy of this tensor that its consumers read instead."""
        return type(self)(self._fd, self._fd._core.cache_after(self._id))

    def cache_before(self) -> Tensor:
        """A new tensor that takes over this tensor's definition; this one becomes its copy."""
        return type(self)(self._fd, self._fd._core.cache_before(self._id))

    def inline_at(self, pos: int) -> None:
        """Compute this tensor inside its consumers' first ``pos`` loops (-1: deepest valid).

        Other negative positions count from the end (-2: all loop axes but the last). With -1
        and a consumer not scheduled yet (left to follow the schedule), the deepest position
        is found when the fusion is lowered; ``inline_position`` shows the one valid now."""
        self._fd._core.inline_at(self._id, _int(pos, "position", self.name))

    def set_allocation_domain(self, axes: Sequence[Union[int, IterDomain]],
                              contiguity: Union[bool, Sequence[Optional[bool]]]) -> None:
        """Lay the tensor out in memory in the order of ``axes`` (loop axis ints or IterDomains)."""
        if not isinstance(axes, (list, tuple)):
            raise KilnTypeError(f"{self.name}: set_allocation_domain: axes: expected a list of loop axes "
                                f"(ints or IterDomains), got {axes!r}")
        loop = self._fd._core.tv_loop(self._id)
        ids: List[int] = []
        for a in axes:
            if isinstance(a, IterDomain):
                if a._tensor._fd is not self._fd:
                    raise KilnError(f"{self.name}: set_allocation_domain got an axis of another fusion")
                ids.append(a._id)
            else:
                i = _int(a, "axis", self.name)
                if not -len(loop) <= i < len(loop):
                    raise KilnError(f"{self.name}: set_allocation_domain: axis {i} is out of range "
                                    f"for {len(loop)} loop axes")
                ids.append(loop[i])
        if isinstance(contiguity, bool):  # one flag for every axis, as nvFuser takes it
            contiguity = [contiguity] * len(ids)
        if not isinstance(contiguity, (list, tuple)) or not all(is_flag(c) for c in contiguity):
            raise KilnTypeError(f"{self.name}: set_allocation_domain: contiguity must be a bool or a list "
                                f"of bool/None, got {contiguity!r} ({type(contiguity).__name__})")
        contig = [None if c is None else bool(c) for c in contiguity]
        self._fd._core.set_allocation_domain(self._id, ids, contig)

    def circular_buffer(self, stages: int, prefetch: Optional[int] = None) -> None:
        """Pipeline this Shared copy's loads over ``stages`` buffers, ``prefetch`` iterations
        ahead of their use (default ``stages - 1``)."""
        pre = None if prefetch is None else _int(prefetch, "prefetch", self.name)
        self._fd._core.circular_buffer(self._id, _int(stages, "stages", self.name), pre)

    def set_streaming_load(self) -> None:
        """Mark this copy of a fusion input (from ``cache_after``, or an ``index_select`` of
        one) as read once: its vector loads skip L1 (it needs a Vectorize axis)."""
        self._fd._core.set_streaming_load(self._id)

    def set_evict_last(self) -> None:
        """Keep the lines that this copy of a fusion input (from ``cache_after``, or an
        ``index_select`` of one) loads in L2 ahead of other data (PTX ``L2::evict_last``; it
        needs a Vectorize axis)."""
        self._fd._core.set_evict_last(self._id)

    def set_serial_grid_reduction(self) -> None:
        """Reduce across blocks one block at a time (deterministic; semaphores return to zero)."""
        self._fd._core.set_serial_grid_reduction(self._id)

    def transforms(self) -> str:
        """The logical -> loop transforms with extents, as text."""
        return str(self._fd._core.transforms(self._id))

    def print_transforms(self) -> str:
        """Print and return :meth:`transforms`."""
        text = self.transforms()
        print(text, end="")
        return text
