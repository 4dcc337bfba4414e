"""``fd.execute``: pick the device from the inputs, validate, run the host program, return
outputs of the same kind as the inputs."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

from ._env import dump_enabled
from ._errors import KilnError, KilnTypeError
from .compiled import compiled
from .host import elem_strides, signature_key
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


def execute(fd: Any, inputs: Sequence[Any], device: Optional[str], as_written: bool = False) -> List[Any]:
    """Run ``fd`` on ``inputs``; ``device`` is ``"cpu"``, ``"cuda"`` or None (from the inputs)."""
    args = check_inputs(fd, inputs)
    _check_writable(fd, inputs)
    kinds = {_kind(x) for x in inputs if _kind(x) != "scalar"}
    if device is None:
        device = "cpu" if kinds <= {"numpy"} else "cuda"
    if device not in ("cpu", "cuda"):
        raise KilnError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        check_cuda_inputs(kinds, _first_input(fd, inputs, {"numpy"}))
        _check_element_alignment(fd, inputs)
    elif kinds - {"numpy", "other"}:
        # The interpreter reads host memory through NumPy: GPU arrays (or torch tensors of any
        # device) are not taken as they are.
        raise KilnTypeError(f"{_first_input(fd, inputs, kinds - {'numpy', 'other'})}: device='cpu' runs the "
                            f"CPU interpreter on NumPy arrays, got "
                            f"{' and '.join(sorted(kinds - {'numpy', 'other'}))} inputs; pass NumPy "
                            f"arrays (x.cpu().numpy(), x.get()) or run on the GPU (device='cuda')")
    if len(kinds - {"other"}) > 1:
        arrays = [(i, _kind(x)) for i, x in enumerate(inputs) if _kind(x) not in ("scalar", "other")]
        (i0, k0), (i1, k1) = arrays[0], next(a for a in arrays if a[1] != arrays[0][1])
        specs = fd._core.input_specs()
        raise KilnTypeError(f"all inputs must be of one kind (NumPy, CuPy or torch): input {i0} "
                            f"({specs[i0].name}) is {k0} but input {i1} ({specs[i1].name}) is {k1}")
    if "other" in kinds:
        bad = next(i for i, x in enumerate(inputs) if _kind(x) == "other")
        raise KilnTypeError(f"input {bad}: expected a NumPy or CuPy array or a torch tensor, "
                            f"got {type(inputs[bad]).__name__}")
    if as_written and device != "cpu":
        raise KilnError("as_written=True interprets the fusion as defined, without a schedule: "
                        "it runs on the CPU only (device='cpu' or NumPy inputs)")
    if device == "cpu":
        # Checked before a kernel is compiled for them: the NumPy bindings convert at most 32.
        for i, x in enumerate(inputs):
            if getattr(x, "ndim", 0) > 32:
                name = fd._core.input_specs()[i].name
                raise KilnError(f"input {i} ({name}) has {x.ndim} axes; the CPU interpreter takes arrays of "
                                f"at most 32 axes")
    # Every path runs the program the GPU would run for these inputs (so the interpreter
    # checks the automatic schedules), unless the caller asks for the fusion as written.
    low = fd._lowered() if (fd._core.manually_scheduled or as_written) else lowered_for(fd, inputs, args)
    if dump_enabled("host_ir"):
        print(low.host_program)
    if device == "cpu":
        import numpy as np  # noqa: PLC0415

        from . import _core  # noqa: PLC0415

        # The fusion as written is interpreted for row-major inputs: a strided NumPy view is
        # copied first (automatic kernels are specialised on the arrays' strides; a hand
        # schedule keeps the layout its definition declared).
        targets = inputs  # (in-place outputs go into the caller's arrays, not the copies)
        if as_written:
            inputs = [np.ascontiguousarray(x) if _kind(x) == "numpy" and not x.flags.c_contiguous else x
                      for x in inputs]
        from .host import run_on_cpu  # noqa: PLC0415

        if not as_written:
            # What the GPU could not compile does not run on the CPU either (a Local
            # array of a non-constant size, say): the same KilnError on both.
            for kernel in low.kernels:
                kernel.cuda_source_for(False)
        if not hasattr(_core, "execute_cpu"):
            raise KilnError("this build of kiln has no CPU interpreter (kiln._core.execute_cpu); "
                            "run on a GPU with CuPy arrays or torch CUDA tensors")
        if not as_written:  # (the fusion as written has no launches to plan)
            _check_before_launch(fd, low, inputs, "numpy")
        return in_place(fd, targets, run_on_cpu(low, inputs, _core.execute_cpu))
    ev = low.evaluator()
    outs = ev.run(inputs, validate=lambda: _check_before_launch(fd, low, inputs, _kind(next(
        (x for x in inputs if _kind(x) != "scalar"), None))))
    _remember(fd, inputs, ev)
    return in_place(fd, inputs, outs)


def _check_element_alignment(fd: Any, inputs: Sequence[Any]) -> None:
    """Refuse a GPU array whose data does not start at a multiple of its element size: the
    GPU faults on a misaligned load (a CuPy view starting one byte into a float32 buffer)."""
    for i, x in enumerate(inputs):
        kind = _kind(x)
        if kind == "cupy":
            ptr, size = x.data.ptr, x.dtype.itemsize
        elif kind == "torch":
            ptr, size = x.data_ptr(), getattr(x, "element_size", lambda: 1)()
        else:
            continue
        if size > 1 and ptr % size and getattr(x, "size", 1) != 0:
            name = fd._core.input_specs()[i].name
            raise KilnTypeError(f"input {i} ({name}): its data starts at address {ptr:#x}, not a multiple of "
                                f"its element size ({size} bytes), which GPU loads need; pass an aligned "
                                f"copy (x.copy() or x.clone())")


_NOUNS = {"numpy": "NumPy array", "cupy": "CuPy array", "torch": "torch tensor"}


def _first_input(fd: Any, inputs: Sequence[Any], kinds: Set[str]) -> str:
    """``input i (name) is a <kind>`` for the first of ``inputs`` of one of ``kinds``."""
    for i, x in enumerate(inputs):
        if _kind(x) in kinds:
            noun = _NOUNS.get(_kind(x), "array")
            return f"input {i} ({fd._core.input_specs()[i].name}) is a {noun}"
    return "an input"


def check_cuda_inputs(kinds: Set[str], first_numpy: str = "an input is a NumPy array") -> None:
    """Refuse ``device='cuda'`` for inputs of ``kinds`` (``_kind`` of the arrays) whose outputs
    cannot be GPU arrays: NumPy arrays (``first_numpy`` names the first), or no array at all
    without CuPy installed."""
    if "numpy" in kinds:
        raise KilnTypeError(f"{first_numpy}: device='cuda' needs CuPy arrays or torch CUDA tensors, "
                            "got NumPy arrays")
    if not kinds:
        # With no array to take them from, the GPU path allocates the outputs with CuPy.
        try:
            import cupy  # noqa: F401, PLC0415
        except ImportError as e:
            raise KilnTypeError("device='cuda' with no array inputs returns CuPy arrays, but CuPy cannot "
                                "be imported; install CuPy, or run on the CPU (device='cpu')") from e


def _aliases(fd: Any) -> List[Tuple[int, int]]:
    """``(output, input)`` pairs of ``fd``'s in-place outputs, cached with its compiled state."""
    c = compiled(fd)
    if c.aliases is None:
        c.aliases = [tuple(p) for p in fd._core.aliases()]
    return c.aliases


def _check_before_launch(fd: Any, low: Any, inputs: Sequence[Any], kind: str) -> None:
    """Plan every launch of ``low`` for ``inputs`` (launch limits of every kernel) and check
    the shapes of the in-place outputs, before any kernel runs."""
    from .host import plan_program  # noqa: PLC0415

    aliases = _aliases(fd)
    if low.program is None:
        return
    arrays = [x for x in inputs if _kind(x) != "scalar"]
    scalars = [x for x in inputs if _kind(x) == "scalar"]
    plan = plan_program(low.program, arrays, scalars, "torch" if kind == "torch" else "numpy")
    if not aliases:
        return
    names = low.program.output_names()
    specs = fd._core.input_specs()
    for o, i in aliases:
        want = tuple(plan.buffer(names[o]).sizes)
        if tuple(inputs[i].shape) != want:
            name = f" ({specs[i].name})" if i < len(specs) else ""
            raise KilnError(f"input {i}{name}: has shape {tuple(inputs[i].shape)} but output {o}, written "
                            f"into it in place, has shape {want}; nothing was run")


def _check_writable(fd: Any, inputs: Sequence[Any]) -> None:
    """Refuse, before anything runs, a read-only NumPy array that an output is written into."""
    aliases = _aliases(fd)
    for o, i in aliases:
        x = inputs[i] if i < len(inputs) else None
        kind = _kind(x)
        if kind not in ("numpy", "torch", "cupy"):
            continue
        specs = fd._core.input_specs()
        name = f" ({specs[i].name})" if i < len(specs) else ""
        if kind == "numpy" and not x.flags.writeable:
            raise KilnError(f"input {i}{name}: output {o} is written into it in place "
                            f"(add_output(..., alias_input=...)), but the array is read-only")
        if kind == "torch":
            _check_torch_target(x, i, o, name)
        axis = _overlapping_axis(x, kind)
        if axis is not None:
            stride = elem_strides(x, kind)[axis]
            why = ("has stride 0 (a broadcast view)" if stride == 0 else
                   f"(stride {stride} elements) steps onto elements of the axes of smaller strides")
            raise KilnError(f"input {i}{name}: output {o} is written into it in place "
                            f"(add_output(..., alias_input=...)), but its axis {axis} {why}, so "
                            f"several elements share memory; pass an array whose elements do not "
                            f"overlap")


def _check_torch_target(x: Any, i: int, o: int, name: str) -> None:
    """Refuse a torch tensor that torch itself would not let output ``o`` be copied into in
    place: torch raises only after the kernels ran."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:  # (a stand-in of a torch tensor)
        return

    if getattr(x, "requires_grad", False) and getattr(x, "is_leaf", False) and torch.is_grad_enabled():
        raise KilnError(f"input {i}{name}: output {o} is written into it in place "
                        f"(add_output(..., alias_input=...)), but it is a leaf tensor that "
                        f"requires grad, which torch does not let be updated in place; "
                        f"run under torch.no_grad() or pass x.detach()")
    if getattr(x, "is_inference", lambda: False)() and not torch.is_inference_mode_enabled():
        raise KilnError(f"input {i}{name}: output {o} is written into it in place "
                        f"(add_output(..., alias_input=...)), but it is an inference tensor, "
                        f"which torch lets be updated in place only in inference mode")


def _check_torch_targets(fd: Any, inputs: Sequence[Any]) -> None:
    """``_check_torch_target`` of every torch tensor an output is written into."""
    for o, i in _aliases(fd):
        x = inputs[i] if i < len(inputs) else None
        if _kind(x) == "torch":
            specs = fd._core.input_specs()
            _check_torch_target(x, i, o, f" ({specs[i].name})" if i < len(specs) else "")


def refuse_immutable_targets(fd: Any, inputs: Sequence[Any]) -> None:
    """Refuse a number (a NumPy or Python scalar) where an output is written in place: the
    result would go into a temporary array and be lost."""
    import numpy as np  # noqa: PLC0415

    aliases = _aliases(fd)
    for o, i in aliases:
        x = inputs[i] if i < len(inputs) else None
        if isinstance(x, (np.generic, int, float, bool)):
            specs = fd._core.input_specs()
            name = f" ({specs[i].name})" if i < len(specs) else ""
            raise KilnError(f"input {i}{name}: output {o} is written into it in place "
                            f"(add_output(..., alias_input=...)), but it is a {type(x).__name__}, "
                            f"which cannot be updated; pass a 0-d array")


def _overlapping_axis(x: Any, kind: str) -> Optional[int]:
    """An axis of ``x`` whose elements may be elements of other axes too (a broadcast
    stride of 0, or strides that do not nest), else None: an in-place result written into
    such an array would keep only the last of the values that share memory."""
    if 0 in tuple(x.shape):
        return None  # no element, none to share (NumPy gives fresh empty arrays zero strides)
    strides = elem_strides(x, kind)
    axes = sorted((abs(st), a) for a, (st, n) in enumerate(zip(strides, x.shape)) if n > 1)
    span = 0  # the largest offset the axes of smaller strides reach
    for st, a in axes:
        if st <= span:
            return a
        span += st * (x.shape[a] - 1)
    return None


def in_place(fd: Any, inputs: Sequence[Any], outs: List[Any]) -> List[Any]:
    """Copy the in-place outputs (``add_output(t, alias_input=x)``) into their inputs' arrays,
    on the inputs' stream, and return the other outputs."""
    aliases = _aliases(fd)
    if not aliases:
        return outs
    for o, i in aliases:
        dst, src = inputs[i], outs[o]
        if tuple(dst.shape) != tuple(src.shape):
            raise KilnError(f"input {i}: has shape {tuple(dst.shape)} but the output written into it "
                            f"in place has shape {tuple(src.shape)}")
    for o, i in aliases:
        dst, src = inputs[i], outs[o]
        kind = _kind(dst)
        if kind == "numpy":
            import numpy as np  # noqa: PLC0415

            np.copyto(dst, src)
        elif kind == "torch":
            dst.copy_(src)
        else:
            dst[...] = src
    dropped = {o for o, _ in aliases}
    return [x for k, x in enumerate(outs) if k not in dropped]


def _remember(fd: Any, inputs: Sequence[Any], ev: Any) -> None:
    """Record the launcher of this (validated, prepared) input signature on ``fd``, so that
    ``fd.execute`` dispatches a repeat call to it directly (until the fusion changes)."""
    try:
        key = signature_key(inputs)
        launcher = ev.launcher_for(inputs)
    except (AttributeError, TypeError):  # no hashable signature: always take the full path
        return
    if launcher is None:
        return
    c = compiled(fd)
    if _aliases(fd):
        c.launchers[key] = (_in_place_launcher(fd, launcher), ev)
    else:
        c.launchers[key] = (launcher, ev)


def _in_place_launcher(fd: Any, run: Any) -> Any:
    """``run`` followed by the in-place copies of ``fd``'s aliased outputs."""
    def launcher(inputs: Sequence[Any], ev: Any) -> List[Any]:
        _check_torch_targets(fd, inputs)  # (not part of the signature)
        return in_place(fd, inputs, run(inputs, ev))
    return launcher


def lowered_for(fd: Any, inputs: Sequence[Any], args: Optional[Sequence[Any]] = None) -> Any:
    """The host program the automatic schedulers and the segmenter pick for inputs like
    ``inputs`` on the device they live on (the default target for NumPy inputs): cached per
    sizes, and per heuristic, so that sizes leading to the same schedule share a lowering.
    ``args``: the inputs as ``check_inputs`` read them (read again when not given)."""
    from .lowering import (  # noqa: PLC0415
        LoweredFusion,
        LoweredKernel,
        _arg,  # noqa: PLC0415
        configure_lowering,
    )

    if args is None:
        args = [_arg(x) for x in inputs]
    tensors = [x for x in inputs if _kind(x) != "scalar"]
    read = [a for a in args if a.kind == "tensor"]
    sizes = [list(a.sizes) for a in read]
    # Inputs without declared contiguity get kernels for their arrays' layout (slices,
    # transposes, expanded arrays read through runtime strides).
    strides = [list(a.strides) for a in read]
    # Inputs at 16-byte aligned addresses (any fresh allocation) get kernels whose vector
    # accesses need no address checks; others (views at an odd offset) get checked ones.
    aligned = all(data_ptr(x) % 16 == 0 for x in tensors)
    device = device_props(tensors)
    # A runtime scalar that a shape reads (a `full` of a runtime size) is part of the plan.
    scalars: List[Optional[int]] = [None] * sum(1 for x in inputs if _kind(x) == "scalar")
    values = [x for x in inputs if _kind(x) == "scalar"]
    for n in _shape_scalars(fd):
        # (A bool is the Int it stands for, as it is where the scalar only enters math.)
        if n < len(values) and isinstance(values[n], int):
            scalars[n] = int(values[n])
    layout_key = tuple(tuple(s) for s in strides)
    key = (tuple(tuple(s) for s in sizes), layout_key, aligned, device, tuple(scalars))
    c = compiled(fd)
    hit = c.by_inputs.get(key)
    if hit is not None:
        return hit
    configure_lowering()
    auto = fd._core.auto_program(sizes, aligned, device, scalars, strides)
    program = auto.program
    if dump_enabled("segments"):
        print(program.segmentation())
    contiguity = tuple(tuple(c) for c in auto.contiguity)
    hkey = (auto.heuristic, tuple(auto.params), contiguity, aligned, device, tuple(scalars))
    low = c.by_heuristic.get(hkey)
    if low is None:
        low = c.by_heuristic[hkey] = LoweredFusion([LoweredKernel(k) for k in program.kernels()], program, fd)
        low.aligned_bases = aligned
    c.by_inputs[key] = low
    return low


def _shape_scalars(fd: Any) -> List[int]:
    """Positions of ``fd``'s scalar inputs that tensor shapes read (cached per fusion version)."""
    c = compiled(fd)
    if c.shape_scalars is None:
        c.shape_scalars = list(fd._core.shape_scalars())
    return c.shape_scalars


#: The target the heuristics assume without a GPU (H100/H200 class): SM count, threads
#: per block, Shared bytes per block (opt-in), registers per block, compute capability.
DEFAULT_DEVICE = (132, 1024, 232448, 65536, 90)
_DEVICE_PROPS: dict = {}


def device_props(tensors: Sequence[Any]) -> Tuple[int, int, int, int, int]:
    """Properties of the GPU the (CuPy or torch) ``tensors`` live on, else ``DEFAULT_DEVICE``."""
    kinds = {_kind(x) for x in tensors}
    if not tensors or kinds <= {"numpy"}:
        return DEFAULT_DEVICE
    x = tensors[0]
    dev = int(x.device.id) if _kind(x) == "cupy" else int(x.device.index or 0)
    hit = _DEVICE_PROPS.get(dev)
    if hit is None:
        import cupy  # noqa: PLC0415

        a = cupy.cuda.Device(dev).attributes
        cc = int(cupy.cuda.Device(dev).compute_capability)
        hit = _DEVICE_PROPS[dev] = (int(a["MultiProcessorCount"]), int(a["MaxThreadsPerBlock"]),
                                    int(a["MaxSharedMemoryPerBlockOptin"]),
                                    int(a["MaxRegistersPerBlock"]), cc)
    return hit


def data_ptr(x: Any) -> int:
    """The device (or host) address of an array's first element."""
    kind = _kind(x)
    if kind == "cupy":
        return int(x.data.ptr)
    if kind == "torch":
        return int(x.data_ptr())
    if kind == "numpy":
        return int(x.ctypes.data)
    raise KilnTypeError(f"expected an array, got {type(x).__name__}")



_auto_lowered = lowered_for  # the name older tests use
