"""The user API: ``FusionDefinition``, tensor and scalar handles, and ``fd.ops``."""

from __future__ import annotations

import numbers
import operator
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core
from ._env import dump_enabled
from ._errors import KilnError, KilnTypeError
from .compiled import CompiledFusion, compiled
from .enums import DataType, ParallelType
from .host import signature_key
from .lowering import LoweredFusion, LoweredKernel, check_inputs, configure_lowering, plain_numbers
from .schedule import ScheduleMixin, flag, handle_id, is_bool, is_flag

Operand = Union["Tensor", "Scalar", int, float, bool]



class Tensor(ScheduleMixin):
    """A tensor of a fusion: use it in ``fd.ops`` and schedule it."""

    __slots__ = ("_fd", "_id")

    def __init__(self, fd: FusionDefinition, id_: int) -> None:
        self._id = handle_id(fd, FusionDefinition, id_, "Tensor", "T{} is not a tensor of this fusion")
        self._fd = fd

    @property
    def dtype(self) -> DataType:
        """Element type."""
        return DataType(self._fd._core.tv_dtype(self._id))

    @property
    def shape(self) -> Tuple[int, ...]:
        """Sizes: -1 symbolic, 1 broadcast, n static (reduced axes dropped)."""
        return tuple(self._fd._core.tv_shape(self._id))

    @property
    def ndim(self) -> int:
        """Rank, not counting reduced axes."""
        return len(self.shape)

    def segment_after(self) -> None:
        """End a segment (kernel) after this tensor; see ``FusionDefinition.segment_after``."""
        self._fd.segment_after(self)

    def __repr__(self) -> str:
        return str(self._fd._core.tv_label(self._id))


class Scalar:
    """A scalar of a fusion: a constant or a runtime input."""

    __slots__ = ("_fd", "_id")

    def __init__(self, fd: FusionDefinition, id_: int) -> None:
        self._id = handle_id(fd, FusionDefinition, id_, "Scalar", "scalar {} is not a scalar of this fusion")
        self._fd = fd

    @property
    def dtype(self) -> DataType:
        """Scalar type."""
        return DataType(self._fd._core.scalar_dtype(self._id))

    @property
    def name(self) -> str:
        """The scalar as the fusion prints it (``s0`` for a runtime input)."""
        return str(self._fd._core.scalar_text(self._id))

    def __repr__(self) -> str:
        return f"Scalar({self.name}: {self.dtype.name})"


def _index(v: object) -> Optional[int]:
    """``v`` as an int where it is one (Python and NumPy integers, 0-d integer arrays; not a
    bool), else None. (An array of several elements has ``__index__`` too, which raises.)"""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return None


def _sizes(entries: Sequence[Any]) -> List[Any]:
    """Shape entries with NumPy integers as Python ints (Scalars and anything else as given,
    for the caller to check)."""
    return [s if isinstance(s, Scalar) or _index(s) is None else _index(s) for s in entries]


def _listed(v: object) -> object:
    """A NumPy (or other array library's) 1-d array of axes as a list; anything else as is."""
    listable = callable(getattr(v, "tolist", None))
    if listable and not isinstance(v, (list, tuple, str, bytes)) and _index(v) is None:
        out = v.tolist()  # type: ignore[attr-defined]
        return out if isinstance(out, list) else v
    return v


def _int(v: object, what: str) -> int:
    """An axis, position or count given as an int (a bool is not one)."""
    i = _index(v)
    if i is None:
        raise KilnTypeError(f"{what}: expected an int, got {v!r}")
    if not -(2**63) <= i < 2**63:
        raise KilnError(f"{what}: {i} does not fit 64 bits")
    return i


def _ints(v: object, what: str) -> List[int]:
    """Axes given as a list or tuple of ints (one int is a list of one)."""
    if _index(v) is not None:
        return [_int(v, what)]
    v = _listed(v)
    if not isinstance(v, (list, tuple)):
        raise KilnTypeError(f"{what}: expected a list of ints, got {v!r}")
    return [_int(d, what) for d in v]


def _seq(v: object, what: str) -> List[Any]:
    """Per-axis entries (sizes, positions, widths) given as a list or tuple."""
    if not isinstance(v, (list, tuple)):
        raise KilnTypeError(f"{what}: expected a list with one entry per axis, got {v!r}")
    return list(v)


_NARROW_FLOATS = ("Half", "BFloat16")


def _check_dtype(dtype: object, what: str) -> str:
    if not isinstance(dtype, DataType):
        raise KilnTypeError(f"{what}: dtype must be a kiln.DataType, got {dtype!r}")
    return dtype.value


class FusionDefinition:
    """Define a fusion inside ``with FusionDefinition() as fd:``, then schedule and run it."""

    def __init__(self) -> None:
        self._core = _core.Fusion()
        self.ops = Ops(self)
        self._compiled: Optional[CompiledFusion] = None

    @classmethod
    def _from_core(cls, core: Any) -> FusionDefinition:
        """A definition around a fusion the core built (a stage of a sharded fusion)."""
        fd = cls.__new__(cls)
        fd._core = core
        fd.ops = Ops(fd)
        fd._compiled = None
        return fd

    def __enter__(self) -> FusionDefinition:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            return
        if self._core.num_outputs == 0:
            raise KilnError("the fusion defines no outputs: mark what it computes with fd.add_output(t)")
        if dump_enabled("fusion"):
            print(self)

    def __str__(self) -> str:
        return str(self._core.math())

    # -- definition ------------------------------------------------------------------
    def define_tensor(self, shape: Sequence[int], dtype: Any = DataType.Float,
                      contiguity: Any = None, static_sizes: bool = False, is_cpu: bool = False,
                      stride_order: Optional[Sequence[int]] = None) -> Tensor:
        """Declare a tensor input (-1 symbolic size, 1 broadcast, n static)."""
        name = f"T{self._core.num_tensors}"
        # nvFuser's positional order is (shape, contiguity, dtype): take either.
        if isinstance(dtype, (list, tuple)) or (dtype is None and isinstance(contiguity, DataType)):
            dtype, contiguity = (DataType.Float if contiguity is None else contiguity), dtype
        if is_cpu:
            raise KilnError(f"define_tensor {name}: CPU scalar tensors (is_cpu=True) are not supported; "
                            f"declare a runtime scalar with fd.define_scalar(dtype=...) instead")
        if not isinstance(shape, (list, tuple)) or any(_index(s) is None for s in shape):
            raise KilnTypeError(f"define_tensor {name}: shape must be a list of ints, got {shape!r}")
        shape = [int(_index(s)) for s in shape]  # type: ignore[arg-type]  # NumPy integers too
        if stride_order is not None and _ints(stride_order, f"define_tensor {name}: stride_order") != list(
                range(len(shape) - 1, -1, -1)):
            raise KilnError(f"define_tensor {name}: stride_order {list(stride_order)} is not supported; "
                            f"declare no contiguity and pass arrays of any layout instead")
        del static_sizes  # sizes other than -1 are static already
        dt = _check_dtype(dtype, f"define_tensor {name}")
        for axis, s in enumerate(shape):
            if not -1 <= s < 2**63:
                raise KilnError(f"define_tensor {name}: axis {axis} has size {s}; expected -1 (symbolic), "
                                f"1 (broadcast) or a size in [0, 2**63)")
        if is_bool(contiguity):  # one flag for every axis, as set_allocation_domain takes;
            # a broadcast (size-one) axis has no stride to describe, as nvFuser's frontend says
            contiguity = [None if s == 1 else contiguity for s in shape]
        if contiguity is not None and (not isinstance(contiguity, (list, tuple))
                                       or not all(is_flag(c) for c in contiguity)):
            raise KilnTypeError(f"define_tensor {name}: contiguity must be a bool or a list of bools "
                                f"(or None), got {contiguity!r}")
        contig = None if contiguity is None else [None if c is None else bool(c) for c in contiguity]
        if contig is not None and len(contig) == len(shape) and any(
                c is None and s != 1 for c, s in zip(contig, shape)):
            # nvFuser marks an expanded axis (stride 0, any size) with None. kiln then takes
            # the layout from the arrays given, as for a tensor declared without contiguity.
            contig = None
        return Tensor(self, self._core.define_tensor(list(shape), dt, contig))

    def define_scalar(self, value: Optional[Union[int, float, bool, DataType]] = None,
                      dtype: Optional[DataType] = None) -> Scalar:
        """A constant scalar (``value`` given) or a runtime scalar input (``value`` None)."""
        if isinstance(value, DataType):
            # nvFuser's older spelling of a runtime scalar input: define_scalar(DataType.Int).
            if dtype is not None and dtype != value:
                raise KilnTypeError(f"define_scalar: dtype given twice ({value.name} and {dtype.name})")
            value, dtype = None, value
        if value is None:
            dt = _check_dtype(dtype or DataType.Double, "define_scalar")
            return Scalar(self, self._core.define_scalar(dt))
        if isinstance(value, np.bool_):
            value = bool(value)
        if not isinstance(value, numbers.Real):
            raise KilnTypeError(f"define_scalar: expected a bool, int or float value (or a DataType), "
                                f"got {value!r}")
        if not isinstance(value, (bool, int, float)):  # a NumPy scalar: its Python value
            value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if dtype is not None:
            _check_dtype(dtype, "define_scalar")
            if dtype == DataType.Bool:
                if value not in (0, 1):
                    raise KilnTypeError(f"define_scalar: {value!r} is not a bool; a Bool constant takes "
                                        f"True, False, 0 or 1")
                value = bool(value)
            elif dtype in (DataType.Int, DataType.Int32):
                if isinstance(value, float) and not value.is_integer():
                    raise KilnTypeError(f"define_scalar: {value} is not an integer; a {dtype.name} constant "
                                        f"needs one")
                value = int(value)
                lo, hi = (-(2**31), 2**31) if dtype == DataType.Int32 else (-(2**63), 2**63)
                if not lo <= value < hi:
                    raise KilnError(f"define_scalar: {value} does not fit a {dtype.name} constant "
                                    f"(range [{lo}, {hi}))")
            else:
                try:
                    value = float(value)
                except OverflowError as e:
                    raise KilnError(f"define_scalar: the integer is too large for a {dtype.name} constant "
                                     "(beyond 1.8e308)") from e
        return self._const(value)

    def _const(self, value: Union[int, float, bool]) -> Scalar:
        if isinstance(value, bool):
            return Scalar(self, self._core.const_bool(value))
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise KilnError(f"the integer constant {value} does not fit an Int (int64) scalar")
            return Scalar(self, self._core.const_int(value))
        if isinstance(value, float):
            return Scalar(self, self._core.const_float(value))
        raise KilnTypeError(f"expected a Tensor, Scalar, int, float or bool, got {value!r}")

    def add_output(self, t: Tensor, alias_input: Optional[Tensor] = None,
                   stride_order: Optional[Sequence[int]] = None) -> None:
        """Mark ``t`` as an output of the fusion; with ``alias_input``, ``t`` is written into
        that input's array instead of being returned (an in-place update); with
        ``stride_order`` (nvFuser's: axis ``i`` has the ``stride_order[i]``-th smallest
        stride), it is stored in that order and handed back as a strided view. Adding a
        tensor that is already an output adds another output, a copy with its own order."""
        if not isinstance(t, Tensor):
            raise KilnTypeError(f"add_output: expected a Tensor of this fusion, got {t!r}")
        if stride_order is not None:
            if alias_input is not None:
                raise KilnError(f"add_output {t.name}: stride_order and alias_input exclude each other "
                                f"(an aliased output takes the input's layout)")
            order = _ints(stride_order, f"add_output {t.name}: stride_order")
            if any(o < 0 for o in order):
                raise KilnError(f"add_output {t.name}: stride_order {order} is not a permutation "
                                f"(entries are axis ranks from 0)")
            self._core.add_output_ordered(self._tensor(t, "add_output"), order)
        elif alias_input is None:
            self._core.add_output(self._tensor(t, "add_output"))
        else:
            out, inp = self._tensor(t, "add_output"), self._tensor(alias_input, "add_output")
            self._core.add_output_alias(out, inp)

    def segment_after(self, t: Tensor) -> None:
        """Split the fusion after ``t``'s definition: what depends on ``t`` runs in a later
        kernel, and tensors crossing segments become Global intermediates of the host program."""
        self._core.segment_after(self._tensor(t, "segment_after"))

    def set_cluster(self, pt: ParallelType, size: int) -> None:
        """Launch the kernel's blocks in clusters of ``size`` (2 to 8) along block dimension
        ``pt`` (sm_90+): the grid along ``pt`` must be exactly ``size`` blocks, and a
        reduction over ``pt`` combines them through distributed Shared memory, leaving the
        result in every block."""
        if not isinstance(pt, ParallelType):
            raise KilnError(f"set_cluster: pt must be a ParallelType (BIDx, BIDy or BIDz), got {pt!r}")
        if isinstance(size, bool) or not isinstance(size, int):
            raise KilnError(f"set_cluster: size must be an int, got {size!r}")
        if not 0 <= size < 2**31:
            raise KilnError(f"set_cluster: a cluster of {size} blocks along {pt.name}; expected 2 to 8")
        self._core.set_cluster(pt.name, size)

    # -- lowering --------------------------------------------------------------------
    def lower(self, inputs: Sequence[Any]) -> LoweredFusion:
        """The host program and kernels ``execute`` runs for inputs like ``inputs``."""
        inputs = plain_numbers(self, inputs)
        if self._core.has_mesh:
            return self._lower_mesh(inputs)
        args = check_inputs(self, inputs)
        if self._core.manually_scheduled:
            low = self._lower_program()
        else:
            from .execute import lowered_for  # noqa: PLC0415

            low = lowered_for(self, inputs, args)
        for kernel in low.kernels:
            for name, text in kernel.pass_dumps:
                print(f"// kernel IR after {name}\n{text}")
            if dump_enabled("kernel_ir"):
                print(kernel.kernel_ir)
            if dump_enabled("allocations"):
                print(kernel.allocations_text)
        if dump_enabled("host_ir"):
            print(low.host_program)
        return low

    def _lower_mesh(self, inputs: Sequence[Any]) -> Any:
        from .multidevice import LoweredMesh, mesh_run  # noqa: PLC0415

        low = LoweredMesh(mesh_run(self), inputs)
        if dump_enabled("host_ir"):
            print(low.host_program)
        return low

    def _lower_program(self) -> LoweredFusion:
        configure_lowering()
        program = self._core.lower_program()
        return LoweredFusion([LoweredKernel(k) for k in program.kernels()], program, self)

    # -- execution -------------------------------------------------------------------
    def _lowered(self) -> LoweredFusion:
        """The lowered fusion of the current schedule (re-lowered when the schedule changes)."""
        c = compiled(self)
        if c.as_scheduled is None:
            c.as_scheduled = self._lower_program()
        return c.as_scheduled

    def execute(self, inputs: Sequence[Any], device: Optional[str] = None,
                as_written: bool = False, comm: Optional[Any] = None) -> List[Any]:
        """Run the fusion: on the GPU for CuPy/torch inputs, in the CPU interpreter for NumPy.
        A sharded fusion runs this rank's part on its local inputs, ``comm`` (default:
        torch.distributed's group) doing the collectives."""
        if device is not None and not isinstance(device, str):
            shown = repr(device) if len(repr(device)) <= 40 else f"a {type(device).__name__}"
            raise KilnTypeError(f"execute: device must be 'cuda', 'cpu' or None, got {shown} "
                                f"(pass the inputs as one list: fd.execute([a, b]))")
        as_written = flag(as_written, "execute: as_written")
        if self._core.has_mesh:
            return self._execute_mesh(inputs, device, as_written, comm)
        if comm is not None:
            raise KilnError("execute: comm= is for fusions sharded over a DeviceMesh; this one is not")
        if not as_written and (device is None or device == "cuda"):
            # Fast path: a GPU input signature that ran before (validated then) goes straight
            # to its specialised launcher; anything else takes the full path below.
            c = self._compiled
            if c is not None and c.version == self._core.version:
                try:
                    hit = c.launchers.get(signature_key(inputs))
                except (AttributeError, TypeError):
                    hit = None
                if hit is not None:
                    return hit[0](inputs, hit[1])
        from .execute import execute, refuse_immutable_targets  # noqa: PLC0415
        from .host import relaxed_capture  # noqa: PLC0415

        if isinstance(inputs, (list, tuple)):
            refuse_immutable_targets(self, inputs)
        # A first call may happen inside a caller's CUDA graph capture: what it asks of the
        # driver before launching must not invalidate that capture.
        with relaxed_capture():
            return execute(self, plain_numbers(self, inputs), device, as_written)

    def _execute_mesh(self, inputs: Sequence[Any], device: Optional[str], as_written: bool,
                      comm: Any) -> List[Any]:
        if as_written:
            raise KilnError("as_written=True interprets a fusion on one device's whole tensors; a sharded "
                            "fusion runs per rank (kiln.multidevice.simulate runs every rank in the "
                            "interpreter)")
        if not isinstance(inputs, (list, tuple)):
            raise KilnTypeError(f"inputs must be a list of arrays, got {type(inputs).__name__}")
        from .execute import refuse_immutable_targets  # noqa: PLC0415
        from .multidevice import execute  # noqa: PLC0415

        refuse_immutable_targets(self, inputs)
        return execute(self, plain_numbers(self, inputs), device, comm)

    def check_errors(self) -> None:
        """Wait for this fusion's GPU work and raise what its kernels recorded (an
        index_select index out of range); otherwise the next call reports it."""
        c = self._compiled
        if c is None:
            return
        for low in c.lowerings():
            if low._evaluator is not None:
                low._evaluator.check_errors()

    # -- helpers ---------------------------------------------------------------------
    def _tensor(self, t: object, what: str) -> int:
        if not isinstance(t, Tensor):
            raise KilnTypeError(f"{what}: expected a Tensor, got {t!r}")
        if t._fd is not self:
            raise KilnError(f"{what}: {t.name} belongs to another FusionDefinition")
        return t._id

    def _operand(self, x: object, what: str) -> Tuple[bool, int]:
        if isinstance(x, Tensor):
            return True, self._tensor(x, what)
        if isinstance(x, Scalar):
            if x._fd is not self:
                raise KilnError(f"{what}: a Scalar that belongs to another FusionDefinition")
            return False, x._id
        if isinstance(x, (bool, int, float)):
            return False, self._const(x)._id
        # A NumPy number (`np.float32(0.5)`, a size from `arr.shape` arithmetic) is the
        # Python number it holds, as `execute` takes it.
        if isinstance(x, (np.bool_, np.integer, np.floating)):
            return False, self._const(x.item())._id
        raise KilnTypeError(f"{what}: expected a Tensor, Scalar, int, float or bool, got {x!r}")


class Ops:
    """``fd.ops``: the tensor operations of a fusion."""

    def __init__(self, fd: FusionDefinition) -> None:
        self._fd = fd

    def _result(self, r: Tuple[bool, int]) -> Any:
        return Tensor(self._fd, r[1]) if r[0] else Scalar(self._fd, r[1])

    def _unary(self, op: str, x: Operand) -> Any:
        fd = self._fd
        return self._result(fd._core.unary_value(op, fd._operand(x, op)))

    def _binary(self, op: str, a: Operand, b: Operand) -> Any:
        fd = self._fd
        return self._result(fd._core.binary_value(op, fd._operand(a, op), fd._operand(b, op)))

    if TYPE_CHECKING:
        # The element-wise ops (``fd.ops.exp(x)``, ``fd.ops.add(a, b)``) are generated from
        # the op table below the class. On tensors they return a Tensor; on scalars alone a
        # folded constant or integer Scalar, or a 0-d Tensor.
        def __getattr__(self, name: str) -> Callable[..., Any]: ...

    # others
    def where(self, cond: Operand, a: Operand, b: Operand) -> Tensor:
        """``a`` where ``cond`` else ``b``."""
        fd = self._fd
        return Tensor(fd, fd._core.where_(fd._operand(cond, "where"), fd._operand(a, "where"),
                                          fd._operand(b, "where")))

    def clamp(self, x: Operand, min: Optional[Operand] = None,  # noqa: A002 - torch's names
              max: Optional[Operand] = None) -> Tensor:  # noqa: A002
        """``x`` limited to ``[min, max]``, a bound of None left open (NaN stays NaN, as torch.clamp)."""
        if min is None and max is None:
            raise KilnTypeError("clamp: at least one of min and max must be given (as torch.clamp)")
        lower = x if min is None else self.maximum(x, min)
        return lower if max is None else self.minimum(lower, max)

    def lerp(self, start: Operand, end: Operand, weight: Operand) -> Tensor:
        """``start + weight * (end - start)``, computed from the nearer end (torch.lerp)."""
        diff = self.sub(end, start)
        if isinstance(weight, (int, float)):  # a constant picks its formula here
            if abs(weight) < 0.5:
                return self.add(start, self.mul(diff, weight))
            return self.sub(end, self.mul(diff, 1.0 - weight))
        near_start = self.add(start, self.mul(weight, diff))
        near_end = self.sub(end, self.mul(diff, self.sub(1.0, weight)))
        return self.where(self.lt(self.abs(weight), 0.5), near_start, near_end)

    def addcmul(self, x: Operand, a: Operand, b: Operand, value: Operand = 1.0) -> Tensor:
        """``x + value * a * b`` (torch.addcmul)."""
        return self.add(x, self.mul(self.mul(a, b), value))

    def threshold(self, x: Operand, threshold: Operand, value: Operand) -> Tensor:
        """``value`` where ``x <= threshold``, else ``x`` (torch.nn.functional.threshold; NaN stays NaN)."""
        return self.where(self.le(x, threshold), value, x)

    def size(self, x: Tensor, dim: int) -> Scalar:
        """The size of axis ``dim`` of ``x`` as a Scalar (usable in shapes and arithmetic)."""
        fd = self._fd
        return Scalar(fd, fd._core.axis_size(fd._tensor(x, "size"), _int(dim, "size: dim")))

    def shape(self, x: Tensor) -> List[Scalar]:
        """The sizes of ``x``'s axes as Scalars (nvFuser's ``t.shape()``)."""
        self._fd._tensor(x, "shape")
        return [self.size(x, d) for d in range(x.ndim)]

    def cast(self, x: Operand, dtype: DataType) -> Tensor:
        """Convert ``x`` to ``dtype``."""
        fd = self._fd
        op = fd._operand(x, "cast")
        what = f"cast {x.name}" if isinstance(x, Tensor) else "cast"
        return Tensor(fd, fd._core.cast(op, _check_dtype(dtype, what)))

    def _reduce(self, op: str, x: Tensor, dims: Optional[Sequence[int]], keepdim: bool,
                dtype: Optional[DataType]) -> Tensor:
        fd = self._fd
        t = fd._tensor(x, op)
        if dims is None:
            # No dims: every axis, as torch's `x.sum()` and nvFuser's `ops.sum(x)` reduce.
            dims = list(range(x.ndim))
        listed = _listed(dims)
        for d in (listed if isinstance(listed, (list, tuple)) else [listed]):
            # An axis past 64 bits is named as out of range for the tensor, not only as too big.
            j = _index(d)
            if j is not None and not -(2**63) <= j < 2**63:
                self._dim(x, d, op, "dims")
        axes = _ints(dims, f"{op}: dims")
        dt = None if dtype is None else _check_dtype(dtype, op)
        if dt is not None and dt in _NARROW_FLOATS and x.dtype.value in ("Float", "Double"):
            # PyTorch casts the input to a half or bfloat16 `dtype` before reducing.
            t = fd._tensor(self.cast(x, DataType(dt)), op)
        return Tensor(fd, fd._core.reduction(op, t, axes, flag(keepdim, f"{op}: keepdim"), dt))

    @staticmethod
    def _one_of(op: str, new: Any, old: Any, names: str) -> Any:
        """An argument given under its name or its older one, not both (they may disagree)."""
        if new is not None and old is not None:
            raise KilnTypeError(f"{op}: got both {names}; pass one")
        return new if old is None else old

    def sum(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False,
            dtype: Optional[DataType] = None, *, axes: Optional[Sequence[int]] = None,
            keep_dim: Optional[bool] = None) -> Tensor:
        """Sum over ``dims``, every axis by default. (``axes``/``keep_dim``: nvFuser's older names)."""
        return self._reduce("sum", x, self._one_of("sum", dims, axes, "dims and axes"),
                            keepdim if keep_dim is None else keep_dim, dtype)

    def max(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False, *,
            axes: Optional[Sequence[int]] = None, keep_dim: Optional[bool] = None) -> Tensor:
        """Max over ``dims``, every axis by default. (``axes``/``keep_dim``: nvFuser's older names)."""
        return self._reduce("max", x, self._one_of("max", dims, axes, "dims and axes"),
                            keepdim if keep_dim is None else keep_dim, None)

    def min(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False, *,
            axes: Optional[Sequence[int]] = None, keep_dim: Optional[bool] = None) -> Tensor:
        """Min over ``dims``, every axis by default. (``axes``/``keep_dim``: nvFuser's older names)."""
        return self._reduce("min", x, self._one_of("min", dims, axes, "dims and axes"),
                            keepdim if keep_dim is None else keep_dim, None)

    def prod(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False,
             dtype: Optional[DataType] = None) -> Tensor:
        """Product over ``dims``."""
        return self._reduce("prod", x, dims, keepdim, dtype)

    def logsumexp(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False) -> Tensor:
        """``log(sum(exp(x)))`` over ``dims`` (floating point; half and bfloat16 accumulate in float)."""
        return self._reduce("logsumexp", x, dims, keepdim, None)

    def var_mean(self, x: Tensor, dims: Optional[Sequence[int]] = None, correction: int = 1,
                 keepdim: bool = False) -> Tuple[Tensor, Tensor]:
        """``(var, mean)`` over ``dims``, dividing the squared deviations by ``N - correction``.

        Computed in double with a two-pass variance's accuracy (the deviations from an
        accurate mean; rows streamed from memory take one pass of sums shifted by the row's
        first element): stable where float32 sums would cancel (a mean of 1e4 with a
        standard deviation of 1e-2), and rounded once to ``x``'s type."""
        self._fd._tensor(x, "var_mean")
        rank = x.ndim
        axes = self._axes(x, list(range(rank)) if dims is None else dims, "var_mean")
        if x.dtype.value not in ("Float", "Double", "Half", "BFloat16"):
            raise KilnTypeError(f"var_mean: {x.name} has dtype {x.dtype.name}; expected a floating type")
        n = self._count(x, axes, "var_mean")
        # The LayerNorm shape the normalization schedule runs as one kernel: the reduced
        # mean, broadcast back for the deviations.
        xd = self.cast(x, DataType.Double)
        kept = [d for d in range(rank) if d not in axes]
        mean = self.div(self.sum(xd, axes), n)
        mean_b = self.broadcast_in_dim(mean, [-1] * rank, kept)
        dev = self.sub(xd, mean_b)
        # N - correction clamped at zero (NumPy's and torch's divisor): a correction of N or
        # more gives inf (NaN for no deviation), never a negative variance.
        dof = self.maximum(self.sub(n, _int(correction, "var_mean: correction")), 0)
        var = self.div(self.sum(self.mul(dev, dev), axes), dof)
        if flag(keepdim, "var_mean: keepdim"):
            var, mean = self.broadcast_in_dim(var, [-1] * rank, kept), mean_b
        return self.cast(var, x.dtype), self.cast(mean, x.dtype)

    def _dim(self, x: Tensor, d: object, what: str, label: str = "dim") -> int:
        """Axis ``d`` of ``x`` (negative counts from the end) as given, checked against its rank."""
        j = _index(d)
        if j is None:
            raise KilnTypeError(f"{what}: {label}: expected an int, got {d!r}")
        i = j
        if not -x.ndim <= i < max(x.ndim, 1):
            raise KilnError(f"{what}: axis {i} is out of range for {x.name} of rank {x.ndim}")
        return i

    def _axes(self, x: Tensor, dims: Sequence[int], what: str) -> List[int]:
        """``dims`` of ``x`` as sorted non-negative axes; out-of-range or repeated axes refused."""
        if _index(dims) is not None:
            dims = [dims]  # type: ignore[list-item]
        dims = _listed(dims)  # type: ignore[assignment]
        if not isinstance(dims, (list, tuple)):
            raise KilnTypeError(f"{what}: dims: expected a list of ints, got {dims!r}")
        axes: List[int] = []
        for d in dims:
            i = self._dim(x, d, what, "dims")
            if x.ndim == 0:
                raise KilnError(f"{what}: axis {i} is out of range for {x.name} of rank 0")
            a = i + x.ndim if i < 0 else i
            if a in axes:
                raise KilnError(f"{what}: axis {i} of {x.name} appears twice in dims {list(dims)}")
            axes.append(a)
        return sorted(axes)

    def _count(self, x: Tensor, axes: Sequence[int], what: str) -> Any:
        """The number of elements of ``x`` over ``axes``, an Int Scalar."""
        n: Any = 1
        for d in axes:
            if not -x.ndim <= d < x.ndim:
                raise KilnError(f"{what}: axis {d} is out of range for {x.name} of rank {x.ndim}")
            n = self.mul(n, self.size(x, d))
        return n

    def mean(self, x: Tensor, dims: Optional[Sequence[int]] = None, keepdim: bool = False,
             dtype: Optional[DataType] = None) -> Tensor:
        """Mean over ``dims`` (every axis by default): the sum divided by the number of reduced elements."""
        self._fd._tensor(x, "mean")
        dims = list(range(x.ndim)) if dims is None else _listed(dims)  # type: ignore[assignment]
        for d in ([dims] if not isinstance(dims, (list, tuple)) else dims):
            self._dim(x, d, "mean", "dims")
        dims = _ints(dims, "mean: dims")
        if x.dtype.value not in ("Float", "Double", "Half", "BFloat16"):
            raise KilnTypeError(f"mean: {x.name} has dtype {x.dtype.name}; expected a floating type "
                                f"(cast it first)")
        n = self._count(x, list(dims), "mean")
        out = x.dtype if dtype is None else DataType(_check_dtype(dtype, "mean"))
        if out.value not in ("Float", "Double", "Half", "BFloat16"):
            raise KilnTypeError(f"mean: dtype {out.name} is not a floating type")
        if out.value not in _NARROW_FLOATS:
            return self.div(self.sum(x, dims, keepdim, out if dtype is not None else None), n)
        # A half or bfloat16 mean is summed and divided in float and rounded once, as in
        # PyTorch: a sum rounded to half first overflows past 65504 (a mean of 1000 hundreds).
        src = x if x.dtype == out else self.cast(x, out)
        return self.cast(self.div(self.sum(src, dims, keepdim, DataType.Float), n), out)

    def var(self, x: Tensor, dims: Optional[Sequence[int]] = None, correction: int = 1,
            keepdim: bool = False) -> Tensor:
        """Variance over ``dims``, every axis by default (see ``var_mean``)."""
        return self.var_mean(x, dims, correction, keepdim)[0]

    def welford(self, x: Tensor, dims: Sequence[int]) -> Tuple[Tensor, Tensor, Tensor]:
        """``(mean, var_sum, n)`` over ``dims`` (nvFuser's welford): ``var_sum`` is the sum of
        squared deviations, ``n`` the Int count, broadcast to the mean's shape."""
        self._fd._tensor(x, "welford")
        axes = self._axes(x, dims, "welford")
        var, mean = self.var_mean(x, axes, correction=0)
        n = self._count(x, axes, "welford")
        # The sum of squared deviations over no elements is 0 (var is 0/0 there).
        var_sum = self.where(self.gt(n, 0), self.mul(var, self.cast(n, x.dtype)), 0.0)
        count = self.full([self.size(mean, d) for d in range(mean.ndim)], n, DataType.Int)
        return mean, var_sum, count

    def broadcast_in_dim(self, x: Tensor, shape: Optional[Sequence[Union[int, Scalar]]] = None,
                         broadcast_dims: Sequence[int] = (), *,
                         output_shape: Optional[Sequence[Union[int, Scalar]]] = None,
                         _op: str = "broadcast_in_dim") -> Tensor:
        """Place input axis ``i`` at output axis ``broadcast_dims[i]``; other axes are broadcasts
        (``output_shape``: nvFuser's older name of ``shape``)."""
        fd = self._fd
        shape = self._one_of("broadcast_in_dim", shape, output_shape, "shape and output_shape")
        if shape is None:
            raise KilnTypeError("broadcast_in_dim: shape is required")
        t = fd._tensor(x, "broadcast_in_dim")
        dims = _ints(broadcast_dims, "broadcast_in_dim: broadcast_dims")
        shape = _seq(shape, "broadcast_in_dim: shape")
        scalars = [s for s in shape if isinstance(s, Scalar)]
        if not scalars:
            sizes = [_int(s, "broadcast_in_dim: shape") for s in shape]
            return Tensor(fd, fd._core.broadcast_in_dim(t, sizes, dims))
        for s in scalars:
            if s._fd is not fd:
                raise KilnError("broadcast_in_dim: a shape Scalar belongs to another FusionDefinition")
            if s.dtype not in (DataType.Int, DataType.Int32):
                raise KilnTypeError(f"broadcast_in_dim: shape Scalars must be integers, got {s.dtype}")
        # Scalar sizes (nvFuser's `fd.define_scalar` or `fd.ops.size` entries): broadcast with
        # those axes as they are, then expand them like the core expands static sizes, by
        # selecting under an all-true mask of the asked sizes (size one, a broadcast that
        # asks nothing, on the other axes). An input axis that is not a size-one broadcast
        # keeps its size: checked against the Scalar in the op's own terms first.
        if len(dims) == x.ndim and all(0 <= d < len(shape) for d in dims):
            wanted = [shape[d]._id if isinstance(shape[d], Scalar) and have != 1 else None
                      for d, have in zip(dims, x.shape)]
            if any(w is not None for w in wanted):
                fd._core.require_shape(t, wanted, _op)
        out = fd._core.broadcast_in_dim(
            t, [-1 if isinstance(s, Scalar) else _int(s, "broadcast_in_dim: shape") for s in shape], dims)
        sizes = [s._id if isinstance(s, Scalar) else fd._const(1)._id for s in shape]
        mask = fd._core.full(sizes, fd._operand(True, "broadcast_in_dim"), DataType.Bool.value)
        return Tensor(fd, fd._core.where_((True, mask), (True, out), (True, out)))

    def permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        """Output axis ``i`` is input axis ``dims[i]``."""
        fd = self._fd
        return Tensor(fd, fd._core.permute(fd._tensor(x, "permute"), _ints(dims, "permute: dims")))

    def squeeze(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        """``x`` without its axes ``dims``, each of size one."""
        fd = self._fd
        return Tensor(fd, fd._core.squeeze(fd._tensor(x, "squeeze"), _ints(dims, "squeeze: dims")))

    def broadcast(self, x: Tensor, is_broadcast_dim: Sequence[bool]) -> Tensor:
        """``x`` with new size-one axes where ``is_broadcast_dim`` is true (nvFuser's broadcast)."""
        self._fd._tensor(x, "broadcast")
        flags = _seq(is_broadcast_dim, "broadcast: is_broadcast_dim")
        for i, b in enumerate(flags):
            if not isinstance(b, (bool, np.bool_)):
                raise KilnTypeError(f"broadcast: is_broadcast_dim[{i}]: expected a bool, got {b!r}")
        flags = [bool(b) for b in flags]
        kept = [i for i, b in enumerate(flags) if not b]
        if len(kept) != x.ndim:
            raise KilnError(f"broadcast: {x.name} has rank {x.ndim} but is_broadcast_dim {flags} keeps "
                            f"{len(kept)} axes; expected one False entry per axis")
        return self.broadcast_in_dim(x, [-1] * len(flags), kept)

    def _index_value(self, v: Union[int, Scalar], what: str) -> int:
        """The scalar id of a position or size given as an int or an Int Scalar."""
        if isinstance(v, Scalar):
            return self._fd._operand(v, what)[1]
        if _index(v) is not None:
            return self._fd._const(_int(v, what))._id
        raise KilnTypeError(f"{what}: expected an int or an Int Scalar, got {v!r}")

    def slice(self, x: Tensor, start_indices: Sequence[Union[int, Scalar]],
              end_indices: Sequence[Union[int, Scalar, None]],
              strides: Optional[Sequence[int]] = None) -> Tensor:
        """``x[start:end:stride]`` on every axis (nvFuser's slice; negative indices count from
        the end and ends past the size are clamped, as in Python)."""
        fd = self._fd
        fd._tensor(x, "slice")
        rank = x.ndim
        start_indices = _seq(start_indices, "slice: start_indices")
        end_indices = _seq(end_indices, "slice: end_indices")
        steps = [1] * rank if strides is None else _seq(strides, "slice: strides")
        if not len(start_indices) == len(end_indices) == len(steps) == rank:
            raise KilnError(f"slice: {x.name} has rank {rank}; start_indices, end_indices and strides "
                            f"need one entry per axis")
        for a, st in enumerate(steps):
            if isinstance(st, Scalar):
                raise KilnError(f"slice: axis {a} has a runtime Scalar stride ({st.name}); strides must be "
                                f"Python ints >= 1, known when the fusion is defined (slicing {x.name})")
            if not isinstance(st, int) or isinstance(st, bool) or not 1 <= st < 2**63:
                raise KilnError(f"slice: axis {a} has stride {st!r}; expected an int >= 1 that fits 64 bits "
                                f"(slicing {x.name})")
        start = [self._index_value(v, "slice") for v in start_indices]
        end = [None if v is None else self._index_value(v, "slice") for v in end_indices]
        return Tensor(fd, fd._core.slice(fd._tensor(x, "slice"), start, end, [int(s) for s in steps]))

    def select(self, x: Tensor, dim: int, index: Union[int, Scalar]) -> Tensor:
        """``x`` at position ``index`` of axis ``dim`` (negative: from the end), that axis removed."""
        fd = self._fd
        at = self._index_value(index, "select")
        return Tensor(fd, fd._core.select(fd._tensor(x, "select"), self._dim(x, dim, "select"), at))

    def reshape(self, x: Tensor, new_shape: Sequence[Union[int, Scalar]], *args: Sequence[Union[int, Scalar]],
                original_shape: Optional[Sequence[Union[int, Scalar]]] = None) -> Tensor:
        """``x``'s elements in row-major order in the shape ``new_shape`` (one entry may be
        ``-1``: inferred from the others; Scalars give runtime sizes). nvFuser's older
        ``reshape(x, original_shape, new_shape)`` is taken too; the original shape is ``x``'s."""
        fd = self._fd
        if len(args) > 1:
            raise KilnTypeError(f"reshape takes x and new_shape (or original_shape, new_shape), "
                                f"got {2 + len(args)} arguments")
        if args:
            original_shape, new_shape = new_shape, args[0]
        fd._tensor(x, "reshape")
        new_shape = _sizes(_seq(new_shape, "reshape: new_shape"))
        if original_shape is not None:
            original_shape = _sizes(_seq(original_shape, "reshape: original_shape"))
        if original_shape is not None and len(original_shape) != x.ndim:
            raise KilnError(f"reshape: original_shape {list(original_shape)} has {len(original_shape)} "
                            f"entries but {x.name} has rank {x.ndim}")
        if original_shape is not None:
            for s in original_shape:
                if isinstance(s, int) and not isinstance(s, bool) and s < -1:
                    raise KilnError(f"reshape: original_shape {list(original_shape)} has size {s}; "
                                    f"expected {x.name}'s sizes (or -1 for any)")
            sizes = [None if isinstance(s, int) and not isinstance(s, bool) and s == -1
                     else self._index_value(s, "reshape: original_shape") for s in original_shape]
            fd._core.require_shape(fd._tensor(x, "reshape"), sizes, "reshape: original_shape")
        shape: List[Optional[int]] = []
        for s in new_shape:
            if isinstance(s, int) and not isinstance(s, bool) and s == -1:
                shape.append(None)
            elif isinstance(s, int) and not isinstance(s, bool) and s < -1:
                raise KilnError(f"reshape: size {s} is negative; expected a size >= 0, -1 or a Scalar")
            else:
                shape.append(self._index_value(s, "reshape"))
        return Tensor(fd, fd._core.reshape(fd._tensor(x, "reshape"), shape))

    def view(self, x: Tensor, new_shape: Sequence[Union[int, Scalar]]) -> Tensor:
        """The same as :meth:`reshape` (kiln's tensors have no storage to share)."""
        return self.reshape(x, new_shape)

    def pad(self, x: Tensor, pad_widths: Sequence[Union[int, Scalar]],
            value: Optional[Operand] = None) -> Tensor:
        """``x`` padded as ``torch.nn.functional.pad``: pairs ``(before, after)`` from the last
        axis backwards; negative widths crop; new positions hold ``value`` (default 0)."""
        fd = self._fd
        fd._tensor(x, "pad")
        widths = _seq(pad_widths, "pad: pad_widths")
        if len(widths) % 2 or len(widths) > 2 * x.ndim:
            raise KilnError(f"pad: {x.name} has rank {x.ndim}; pad_widths needs an even number of "
                            f"entries, at most {2 * x.ndim}, got {len(widths)}")
        zero = self._index_value(0, "pad")
        pairs = [(zero, zero)] * x.ndim
        for k in range(len(widths) // 2):
            pairs[x.ndim - 1 - k] = (self._index_value(widths[2 * k], "pad"),
                                     self._index_value(widths[2 * k + 1], "pad"))
        if isinstance(value, Tensor) and value.ndim > 0:
            raise KilnTypeError(f"pad: value must be a number, a Scalar or a 0-d tensor (the fill of every "
                                f"new position), got {value.name} of rank {value.ndim}")
        fill = fd._operand(0 if value is None else value, "pad")
        return Tensor(fd, fd._core.pad(fd._tensor(x, "pad"), pairs, fill))

    def cat(self, tensors: Sequence[Tensor], dim: int) -> Tensor:
        """``tensors`` joined along ``dim`` in their common dtype (as torch.cat promotes); the
        other axes of one size."""
        fd = self._fd
        ids = [fd._tensor(t, "cat") for t in _seq(tensors, "cat: tensors")]
        return Tensor(fd, fd._core.cat(ids, _int(dim, "cat: dim")))

    def triu(self, x: Tensor, diagonal: int = 0) -> Tensor:
        """``x`` on and above ``diagonal`` of its last two axes, 0 below (torch.triu)."""
        fd = self._fd
        return Tensor(fd, fd._core.triu(fd._tensor(x, "triu"), _int(diagonal, "triu: diagonal")))

    def take_along_axis(self, x: Tensor, index: Tensor, dim: int) -> Tensor:
        """``out[..., i, ...] = x[..., index[..., i, ...], ...]`` along ``dim``; ``index`` has
        ``x``'s rank and, off ``dim``, its sizes, or either has size one where the other does
        not and the output takes the other's size (NumPy's take_along_axis)."""
        fd = self._fd
        return Tensor(fd, fd._core.take_along_axis(fd._tensor(x, "take_along_axis"),
                                                   fd._tensor(index, "take_along_axis"),
                                                   self._dim(x, dim, "take_along_axis")))

    def gather(self, x: Tensor, index: Tensor, dim: int) -> Tensor:
        """``torch.gather``: ``index`` has ``x``'s rank, and off ``dim`` sizes no larger than
        ``x``'s; the output has ``index``'s shape."""
        self._fd._tensor(x, "gather")
        self._fd._tensor(index, "gather")
        dim = self._dim(x, dim, "gather")
        rank = x.ndim
        if index.ndim != rank:
            raise KilnError(f"gather: index {index.name} has rank {index.ndim} but {x.name} has rank "
                            f"{rank}; expected the same rank")
        d = dim + rank if dim < 0 else dim
        if not 0 <= d < rank:
            raise KilnError(f"gather: dim {dim} is out of range for {x.name} of rank {rank}")
        # Off `dim`, x is cut to the index's static sizes where they are smaller; symbolic
        # sizes must agree when the fusion runs (a KilnError names the axes otherwise).
        # An index axis of size one reads x's first position there (a broadcast axis of the
        # output, as the index's).
        ends: List[Union[int, Scalar, None]] = [None] * rank
        cut = False
        ones: List[int] = []
        for a in range(rank):
            xs, js = x.shape[a], index.shape[a]
            if a == d or js == -1 or xs == js:
                continue
            if xs != -1 and js > xs:
                raise KilnError(f"gather: axis {a} of index {index.name} has size {js} but {x.name} has "
                                f"{xs}; off dim {d} the index may not be larger")
            if js == 1:
                ones.append(a)
            else:
                ends[a] = js
                cut = True
        table = self.slice(x, [0] * rank, ends) if cut else x
        if ones:
            for a in reversed(ones):
                table = self.select(table, a, 0)
            table = self.broadcast(table, [a in ones for a in range(rank)])
        return self.take_along_axis(table, index, d)

    def expand(self, x: Tensor, shape: Sequence[Union[int, Scalar]]) -> Tensor:
        """``x`` with its size-one axes expanded to ``shape`` (``-1`` keeps an axis's size)."""
        self._fd._tensor(x, "expand")
        shape = _seq(shape, "expand: shape")
        if len(shape) != x.ndim:
            raise KilnError(f"expand: {x.name} has rank {x.ndim} but shape {list(shape)} has {len(shape)} "
                            f"entries; expected one per axis")
        for axis, (want, have) in enumerate(zip(shape, x.shape)):
            if isinstance(want, Scalar):
                continue
            n = _int(want, f"expand: shape[{axis}]")
            if n < -1:
                raise KilnError(f"expand: {x.name} axis {axis}: size {n}; expected -1 (keep the size) or a "
                                f"size >= 0")
            if n not in (-1, have) and isinstance(have, int) and have not in (-1, 1):
                raise KilnError(f"expand: {x.name} axis {axis} has size {have}, not one; only a size-one "
                                f"axis expands (asked for {n})")
        return self.broadcast_in_dim(x, shape, list(range(x.ndim)), _op="expand")

    def index_select(self, x: Tensor, index: Tensor, dim: int) -> Tensor:
        """Rows of ``x`` along ``dim`` at positions ``index`` (1-D, integer; a 0-d index
        selects one row and keeps the axis, as torch.index_select)."""
        fd = self._fd
        if isinstance(index, Tensor) and index.ndim == 0:
            index = self.broadcast_in_dim(index, [1], [])
        return Tensor(fd, fd._core.index_select(fd._tensor(x, "index_select"),
                                                fd._tensor(index, "index_select"),
                                                self._dim(x, dim, "index_select")))

    def full(self, shape: Sequence[Union[int, Scalar]], value: Union[Scalar, Tensor, int, float, bool],
             dtype: DataType) -> Tensor:
        """A tensor of ``shape`` filled with ``value`` (a scalar, or a 0-d tensor: torch.full_like
        of a computed step size)."""
        fd = self._fd
        if isinstance(value, Tensor):
            fd._tensor(value, "full")
            if value.ndim != 0:
                raise KilnTypeError(f"full: the fill value {value.name} has rank {value.ndim}; expected a "
                                    "scalar or a 0-d tensor (broadcast_in_dim or expand fill with a tensor)")
            self._shape(shape, "full")  # the same checks of the sizes
            _check_dtype(dtype, "full")
            return self.broadcast_in_dim(self.cast(value, dtype), list(shape), [])
        dims = self._shape(shape, "full")
        return Tensor(fd, fd._core.full(dims, fd._operand(value, "full"), _check_dtype(dtype, "full")))

    def _shape(self, shape: Sequence[Union[int, Scalar]], what: str) -> List[int]:
        fd = self._fd
        dims: List[int] = []
        for s in _sizes(_seq(shape, f"{what}: shape")):
            if isinstance(s, Scalar):
                dims.append(fd._operand(s, what)[1])
            elif isinstance(s, int) and not isinstance(s, bool):
                if s < 0:
                    raise KilnError(f"{what}: size {s} is negative; expected a size >= 0 or a Scalar")
                dims.append(fd._const(s)._id)
            else:
                raise KilnTypeError(f"{what}: shape entries must be ints or Scalars, got {s!r}")
        return dims

    def iota(self, length: Union[int, Scalar], start: Operand = 0, step: Operand = 1,
             dtype: DataType = DataType.Int) -> Tensor:
        """``[start, start + step, ...]``: ``length`` elements (nvFuser's iota)."""
        fd = self._fd
        (n,) = self._shape([length], "iota")
        return Tensor(fd, fd._core.iota(n, fd._operand(start, "iota"), fd._operand(step, "iota"),
                                        _check_dtype(dtype, "iota")))

    def _random(self, dist: str, a: Operand, b: Operand, shape: Sequence[Union[int, Scalar]],
                dtype: DataType, rng_seed: Operand, rng_offset: Operand) -> Tensor:
        fd = self._fd
        dims = self._shape(shape, dist)
        return Tensor(fd, fd._core.random(dist, dims, fd._operand(a, dist), fd._operand(b, dist),
                                          fd._operand(rng_seed, dist), fd._operand(rng_offset, dist),
                                          _check_dtype(dtype, dist)))

    def uniform(self, minval: Operand, maxval: Operand, shape: Sequence[Union[int, Scalar]],
                dtype: DataType = DataType.Float, rng_seed: Operand = 0, rng_offset: Operand = 0) -> Tensor:
        """Uniform random numbers in ``[minval, maxval)``, reproducible from ``rng_seed`` and
        ``rng_offset`` (Int scalars) whatever the schedule (Philox 4x32-10)."""
        return self._random("uniform", minval, maxval, shape, dtype, rng_seed, rng_offset)

    def normal(self, mean: Operand, std: Operand, shape: Sequence[Union[int, Scalar]],
               dtype: DataType = DataType.Float, rng_seed: Operand = 0, rng_offset: Operand = 0) -> Tensor:
        """Normal random numbers (Box-Muller on Philox 4x32-10 uniforms), reproducible from
        ``rng_seed`` and ``rng_offset``."""
        return self._random("normal", mean, std, shape, dtype, rng_seed, rng_offset)

    def rand_like(self, x: Tensor, rng_seed: Operand = 0, rng_offset: Operand = 0) -> Tensor:
        """Uniform numbers in ``[0, 1)`` of ``x``'s shape and dtype."""
        self._fd._tensor(x, "rand_like")
        return self.uniform(0.0, 1.0, self.shape(x), x.dtype, rng_seed, rng_offset)

    def randn_like(self, x: Tensor, rng_seed: Operand = 0, rng_offset: Operand = 0) -> Tensor:
        """Standard normal numbers of ``x``'s shape and dtype."""
        self._fd._tensor(x, "randn_like")
        return self.normal(0.0, 1.0, self.shape(x), x.dtype, rng_seed, rng_offset)


def _elementwise_method(op: _core.ElementwiseOp) -> Callable[..., Any]:
    """An ``fd.ops`` method for one entry of the op table."""
    name = op.name
    if op.arity == 1:
        def unary(self: Ops, x: Operand) -> Any:
            return self._unary(name, x)
        method: Callable[..., Any] = unary
    else:
        def binary(self: Ops, a: Operand, b: Operand) -> Any:
            return self._binary(name, a, b)
        method = binary
    method.__name__ = name
    method.__qualname__ = f"Ops.{name}"
    method.__doc__ = op.doc
    return method


for _op in _core.elementwise_ops():
    setattr(Ops, _op.name, _elementwise_method(_op))
del _op
