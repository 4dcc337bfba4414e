"""Multi-GPU fusions: device meshes, the per-rank mesh program, and the communicators that
run its collectives.

A fusion whose tensors are put on a ``DeviceMesh`` and sharded over ``ParallelType.DIDx`` is
written on global shapes and run on each rank with that rank's local slices. The core
decomposes it (``kiln._core.Fusion.mesh_program``) into local stages, each an ordinary
automatically scheduled fusion, and collectives between them (``Allreduce``,
``Allgather``, ``ReduceScatter``). This module runs that program: stages through the usual
``execute`` path (GPU or CPU interpreter), collectives through a ``Communicator``.

Ranks are started with ``torchrun`` (``python -m torch.distributed.run``), one process per
GPU, with ``torch.distributed`` initialised on the NCCL backend: torch owns the rendezvous
and the NCCL communicators, and its asynchronous collectives order themselves after the
current stream's work and make it wait at ``work.wait()`` without blocking the host, which
is what the program's Communication / Wait pair needs. ``simulate`` runs N ranks in one
process on the CPU interpreter, with the collectives done in NumPy.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Generator, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ._errors import KilnError, KilnTypeError
from .host import _contiguous_strides

Request = Tuple[Any, ...]


class DeviceMesh:
    """The devices (process ranks) a sharded fusion runs on, in mesh order."""

    def __init__(self, devices: Iterable[int]) -> None:
        try:
            devs = list(devices)
        except TypeError as e:
            raise KilnTypeError(f"DeviceMesh takes a list of device ranks, got {devices!r}") from e
        for d in devs:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise KilnTypeError(f"DeviceMesh: device {d!r} is not an int rank")
        self.devices: Tuple[int, ...] = tuple(int(d) for d in devs)
        if not self.devices:
            raise KilnError("DeviceMesh: the mesh has no devices")
        if any(not 0 <= d < 2**31 for d in self.devices):
            raise KilnError(f"DeviceMesh: ranks are in [0, 2**31), got {list(self.devices)}")
        if len(set(self.devices)) != len(self.devices):
            raise KilnError(f"DeviceMesh: a rank is listed twice in {list(self.devices)}")

    @property
    def size(self) -> int:
        """Number of devices."""
        return len(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and other.devices == self.devices

    def __hash__(self) -> int:
        return hash(self.devices)

    def __repr__(self) -> str:
        return f"DeviceMesh({list(self.devices)})"


# -- communicators ---------------------------------------------------------------------


class Work:
    """A collective in flight; ``wait()`` orders later work after it."""

    def wait(self) -> None:
        """Wait for the collective (a finished one returns at once)."""


class Communicator(Protocol):
    """What runs a mesh program's collectives for one rank (``comm=`` of ``fd.execute``).
    ``rank`` is the position in the mesh, ``size`` the mesh size; arrays are this rank's
    buffers, contiguous."""

    rank: int
    size: int

    def allreduce(self, x: Any, op: str) -> Work:
        """Reduce ``x`` over the ranks with ``op`` (sum, max, min, prod), in place."""
        ...

    def allgather(self, out: Any, x: Any) -> Work:
        """``out[i] = x`` of rank ``i`` (``out`` has shape ``[size, *x.shape]``)."""
        ...

    def reduce_scatter(self, out: Any, x: Any, op: str) -> Work:
        """``out = op`` over ranks ``j`` of ``x[rank]`` of rank ``j`` (``x``: ``[size, *out.shape]``)."""
        ...


class LocalCommunicator:
    """The communicator of a one-device mesh: every collective is a copy or nothing."""

    rank = 0
    size = 1

    def allreduce(self, x: Any, op: str) -> Work:
        """Nothing to combine on one device."""
        return Work()

    def allgather(self, out: Any, x: Any) -> Work:
        """Copy ``x`` into ``out[0]``."""
        out[0] = x
        return Work()

    def reduce_scatter(self, out: Any, x: Any, op: str) -> Work:
        """Copy ``x[0]`` into ``out``."""
        out[...] = x[0]
        return Work()


class TorchCommunicator:
    """Collectives through ``torch.distributed`` (NCCL for CUDA tensors, gloo for CPU ones),
    issued asynchronously after the current stream's work."""

    def __init__(self, mesh: DeviceMesh, group: Any = None) -> None:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_initialized():
            raise KilnError("TorchCommunicator needs torch.distributed initialised (start the ranks with "
                            "torchrun and call torch.distributed.init_process_group('nccl'))")
        me = dist.get_rank()
        if me not in mesh.devices:
            raise KilnError(f"rank {me} is not on {mesh}: every rank that runs a sharded fusion must be "
                            f"on its mesh")
        if list(mesh.devices) != sorted(mesh.devices):
            raise KilnError(f"{mesh}: with torch.distributed the mesh lists its ranks in ascending order "
                            f"(a process group orders its ranks that way)")
        self._torch, self._dist = torch, dist
        self.rank = mesh.devices.index(me)
        self.size = mesh.size
        if group is None and list(mesh.devices) != list(range(dist.get_world_size())):
            # dist.new_group must be called by every rank of the world, the ones off the mesh
            # too: kiln cannot make it from inside one rank's execute without a hang.
            raise KilnError(f"{mesh} spans part of the {dist.get_world_size()} ranks: create its group "
                            f"on every rank (group = torch.distributed.new_group({list(mesh.devices)})) "
                            f"and pass comm=kiln.multidevice.TorchCommunicator(mesh, group)")
        self.group = group
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                     "prod": dist.ReduceOp.PRODUCT}

    def _tensor(self, x: Any) -> Any:
        """A torch view of ``x`` sharing its memory (collectives write in place)."""
        torch = self._torch
        if isinstance(x, torch.Tensor):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            # No device argument: torch keeps the array on the device its pointer is on;
            # naming one could make a copy on another device, which the in-place collective
            # would then fill instead of the array.
            t = torch.as_tensor(x)
            ptr = int(x.__cuda_array_interface__["data"][0])
            if t.data_ptr() != ptr or not t.is_cuda:
                raise KilnError(f"a collective's buffer ({type(x).__name__} at {ptr:#x}) could not be viewed "
                                f"in place by torch (it made a copy on {t.device})")
            return t
        return torch.from_numpy(np.asarray(x))

    def _on_stream(self, x: Any) -> Any:
        """The torch stream a CuPy array's work runs on (its current stream), else None."""
        if type(x).__module__.startswith("cupy"):
            import cupy  # noqa: PLC0415

            ptr = int(cupy.cuda.get_current_stream().ptr)
            device = self._torch.device("cuda", int(x.device.id))
            if ptr in (0, 1):
                # The legacy default stream (CuPy's null stream). torch's ExternalStream(0)
                # is not it (torch reads id 0 as one of its pool's streams), so the
                # collective would be ordered after the wrong stream; torch's default
                # stream is the legacy one.
                return self._torch.cuda.default_stream(device)
            return self._torch.cuda.ExternalStream(ptr, device=device)
        return None

    def _issue(self, x: Any, call: Any) -> Work:
        stream = self._on_stream(x)
        if stream is None:
            return _TorchWork(call(), None, self._torch)
        with self._torch.cuda.stream(stream):
            return _TorchWork(call(), stream, self._torch)

    def allreduce(self, x: Any, op: str) -> Work:
        """``dist.all_reduce`` in place, asynchronously."""
        t = self._tensor(x)
        return self._issue(x, lambda: self._dist.all_reduce(t, op=self._ops[op], group=self.group,
                                                            async_op=True))

    def allgather(self, out: Any, x: Any) -> Work:
        """``dist.all_gather_into_tensor`` along a new first axis, asynchronously."""
        o, t = self._tensor(out), self._tensor(x)
        return self._issue(x, lambda: self._dist.all_gather_into_tensor(o, t, group=self.group,
                                                                         async_op=True))

    def reduce_scatter(self, out: Any, x: Any, op: str) -> Work:
        """``dist.reduce_scatter_tensor`` over the first axis, asynchronously."""
        o, t = self._tensor(out), self._tensor(x)
        return self._issue(x, lambda: self._dist.reduce_scatter_tensor(o, t, op=self._ops[op],
                                                                       group=self.group, async_op=True))


class _TorchWork(Work):
    def __init__(self, work: Any, stream: Any, torch: Any) -> None:
        self._work, self._stream, self._torch = work, stream, torch

    def wait(self) -> None:
        """Make the stream the collective was issued after wait for it (not the host)."""
        if self._work is None:
            return
        if self._stream is None:
            self._work.wait()
        else:
            with self._torch.cuda.stream(self._stream):
                self._work.wait()
        self._work = None


_TORCH_COMMS: Dict[Tuple[Tuple[int, ...], int], TorchCommunicator] = {}


def default_communicator(mesh: DeviceMesh) -> Communicator:
    """torch.distributed's default group when it is initialised, a local one for a mesh of
    one device; otherwise a KilnError saying how to start the ranks."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # One per mesh and default group (a new init_process_group is a new group).
        key = (tuple(mesh.devices), id(dist.group.WORLD))
        comm = _TORCH_COMMS.get(key)
        if comm is None:
            comm = _TORCH_COMMS[key] = TorchCommunicator(mesh)
        return comm
    if mesh.size == 1:
        return LocalCommunicator()
    raise KilnError(f"this fusion is sharded over {mesh} ({mesh.size} devices): start one process per "
                    f"device with torchrun and initialise torch.distributed, pass comm=..., or run the "
                    f"ranks in one process with kiln.multidevice.simulate(fd, inputs_per_rank)")


# -- the mesh program -------------------------------------------------------------------


def _numpy_dtype(name: str) -> Any:
    from .runtime.kernel_executor import np_dtype  # noqa: PLC0415

    return np_dtype(name)


class MeshRun:
    """A sharded fusion's mesh program with one ``FusionDefinition`` per stage."""

    def __init__(self, fd: Any) -> None:
        from .fusion import FusionDefinition  # noqa: PLC0415

        self.fd = fd
        self.program = fd._core.mesh_program()
        self.mesh = DeviceMesh(self.program.devices)
        self.stages = [FusionDefinition._from_core(self.program.stage_fusion(k))
                       for k in range(self.program.num_stages)]
        self.stage_inputs = [list(self.program.stage_inputs(k)) for k in range(len(self.stages))]
        self.stage_outputs = [list(self.program.stage_outputs(k)) for k in range(len(self.stages))]
        # (output, input) pairs of each stage's in-place outputs (add_output(..., alias_input=)).
        self.stage_aliases = [[(int(o), int(i)) for o, i in st._core.aliases()] for st in self.stages]
        self.instructions = [tuple(i) for i in self.program.instructions()]
        self.comms = [self.program.communication(c) for c in range(self.program.num_communications)]
        self.inputs = list(self.program.inputs())
        self.outputs = list(self.program.outputs())
        # Stages that read a whole tensor's slice take the rank as a last scalar input.
        self.takes_rank = bool(self.program.takes_rank)
        self._checked: Dict[Any, Dict[int, List[int]]] = {}

    def _split(self, inputs: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
        """Tensor and scalar inputs, checked against the definition's inputs (count, kind)."""
        specs = self.fd._core.input_specs()
        if len(inputs) != len(specs):
            raise KilnError(f"the fusion takes {len(specs)} input(s) ({', '.join(s.name for s in specs)}), "
                            f"got {len(inputs)}")
        for i, (x, spec) in enumerate(zip(inputs, specs)):
            number = isinstance(x, (bool, int, float))
            if spec.kind == "tensor" and (number or not (hasattr(x, "shape") and hasattr(x, "dtype"))):
                raise KilnTypeError(f"input {i} ({spec.name}): expected this rank's slice as a NumPy or CuPy "
                                    f"array or a torch tensor, got {type(x).__name__}")
            if spec.kind != "tensor" and not number:
                raise KilnTypeError(f"input {i} ({spec.name}): expected a number, got {type(x).__name__}")
        arrays = [x for x in inputs if not isinstance(x, (bool, int, float))]
        scalars = [x for x in inputs if isinstance(x, (bool, int, float))]
        return arrays, scalars

    def shapes(self, inputs: Sequence[Any]) -> Dict[int, List[int]]:
        """Sizes of every tensor the program moves for these inputs; the first time for a
        signature, the inputs are validated and every stage's inputs are checked against its
        fusion before anything runs."""
        try:
            # Int and bool scalars by value (they may be sizes), floats by type only.
            key = tuple((type(x), None if type(x) is float else x) if isinstance(x, (bool, int, float))
                        else (x.shape, x.dtype) for x in inputs) if type(inputs) in (list, tuple) else None
            hit = self._checked.get(key)
        except (AttributeError, TypeError):  # not arrays: _split names the bad input
            key, hit = None, None
        if hit is not None:
            return hit
        shapes = self._check(inputs)
        if key is not None:
            self._checked[key] = shapes
        return shapes

    def _check(self, inputs: Sequence[Any]) -> Dict[int, List[int]]:
        """Validate ``inputs`` and every stage's inputs; the sizes of every tensor."""
        from .execute import _aliases  # noqa: PLC0415
        from .lowering import _arg  # noqa: PLC0415

        arrays, scalars = self._split(inputs)
        ints: List[Optional[int]] = [int(s) if isinstance(s, int) and not isinstance(s, bool) else None
                                     for s in scalars]
        from . import _core  # noqa: PLC0415

        try:
            shapes = {t: list(s) for t, s in self.program.shapes([list(x.shape) for x in arrays], ints)}
        except KilnError as e:
            # The program names a size it could not bind (an input of the wrong rank);
            # fd.execute's check of the definition names the input.
            self._raise_whole_error(inputs, e, None)
            raise
        given = dict(zip(self.inputs, arrays))
        for k, st in enumerate(self.stages):
            args = []
            for t in self.stage_inputs[k]:
                if t in given:
                    args.append(_arg(given[t]))
                else:
                    dt = str(np.dtype(_numpy_dtype(self.program.dtype(t))))
                    args.append(_core.RuntimeArg("tensor", dt, shapes[t], _contiguous_strides(shapes[t])))
            args.extend(_arg(s) for s in self._scalars(scalars, 0))
            try:
                st._core.check_inputs(args, True)
            except KilnError as e:
                # A stage names its own tensors (the broadcast of an input, say): the
                # definition's check names the input and axis first.
                self._raise_whole_error(inputs, e, f"in this rank's stage {k}: {e}")
                raise
        specs = self.fd._core.input_specs()
        for o, i in _aliases(self.fd):
            want = shapes.get(self.outputs[o]) if o < len(self.outputs) else None
            if want is not None and list(inputs[i].shape) != want:
                raise KilnError(f"input {i} ({specs[i].name}): has shape {tuple(inputs[i].shape)} but "
                                f"output {o}, written into it in place, has shape {tuple(want)} on this "
                                f"rank; nothing was run")
        return shapes

    def _raise_whole_error(self, inputs: Sequence[Any], cause: KilnError, detail: Optional[str]) -> None:
        """Raise the error of the definition's input check (fd.execute's) on the whole tensors
        that this rank's ``inputs`` are slices of (a sharded axis: the slice's size times the
        mesh size), ``detail`` appended, from ``cause``; return where that check passes."""
        from . import _core  # noqa: PLC0415
        from .lowering import _arg  # noqa: PLC0415

        specs = self.fd._core.input_specs()
        tensors = iter(self.inputs)
        args: List[Any] = []
        notes: List[str] = []
        for i, (x, spec) in enumerate(zip(inputs, specs)):
            a = _arg(x)
            if spec.kind != "tensor":
                args.append(a)
                continue
            t = next(tensors)
            if a.kind != "tensor":
                args.append(a)
                continue
            sizes = list(a.sizes)
            mesh = self.fd._core.tv_mesh(t)
            if mesh is not None and mesh[1] is not None and mesh[1] < len(sizes):
                axis, n = mesh[1], len(mesh[0])
                notes.append(f"input {i} ({spec.name}) axis {axis}: this rank's {sizes[axis]} times {n} "
                             f"devices")
                sizes[axis] *= n
            # (Contiguous strides: each stage checks the layout of the slices themselves.)
            args.append(_core.RuntimeArg("tensor", a.text, sizes, _contiguous_strides(sizes)))
        try:
            self.fd._core.check_inputs(args, True)
        except KilnError as e:
            note = f" (sizes of the whole tensors; sharded: {', '.join(notes)})" if notes else ""
            more = f"; {detail}" if detail else ""
            raise type(e)(f"{e}{note}{more}") from cause

    def validate(self, inputs: Sequence[Any]) -> Dict[int, List[int]]:
        """Check this rank's ``inputs`` before anything runs; the sizes of every tensor."""
        from .execute import _check_writable  # noqa: PLC0415

        shapes = self.shapes(inputs)  # validates the inputs on a new signature
        _check_writable(self.fd, inputs)  # (not part of the signature)
        return shapes

    def _scalars(self, scalars: Sequence[Any], rank: int) -> List[Any]:
        """The stages' scalar arguments: the definition's, then the rank where they take it."""
        return list(scalars) + ([rank] if self.takes_rank else [])

    def steps(self, inputs: Sequence[Any], device: Optional[str],
              rank: int = 0) -> Generator[Request, None, List[Any]]:
        """Run the program on rank ``rank``'s ``inputs``, yielding at each collective
        (``("comm", c, kind, op, input, output)``) and wait (``("wait", c)``)."""
        from .execute import in_place as write_in_place  # noqa: PLC0415  (a comm's flag is `in_place`)

        shapes = self.validate(inputs)
        arrays = [x for x in inputs if not isinstance(x, (bool, int, float))]
        scalars = [x for x in inputs if isinstance(x, (bool, int, float))]
        env: Dict[int, Any] = dict(zip(self.inputs, arrays))
        like = arrays[0] if arrays else None
        for what, i in self.instructions:
            if what == "run":
                args = [env[t] for t in self.stage_inputs[i]] + self._scalars(scalars, rank)
                env.update(zip(self.stage_outputs[i], self._run_stage(i, args, device)))
            elif what == "allocate":
                env[i] = _empty(like, shapes[i], self.program.dtype(i))
            elif what == "comm":
                kind, op, src, dst, in_place = self.comms[i]
                x = _contiguous_array(env[src])
                env[src] = x
                if in_place:
                    env[dst] = x
                yield ("comm", i, kind, op, x, env[dst])
            elif what == "wait":
                yield ("wait", i)
            elif what == "free":
                env.pop(i, None)
        # In-place outputs go into the caller's arrays once every stage has read them, and
        # are not returned, as fd.execute does.
        return write_in_place(self.fd, inputs, [env[t] for t in self.outputs])

    def _run_stage(self, k: int, args: List[Any], device: Optional[str]) -> List[Any]:
        """Every output of stage ``k`` on ``args``, its in-place ones included."""
        aliases = self.stage_aliases[k]
        if not aliases:
            return self.stages[k].execute(args, device=device)
        # The stage writes an in-place output into its input's array and returns the others:
        # give it a copy (later stages may read the input, and the caller's array is updated
        # at the end), which then is that output.
        args = list(args)
        into = {o: j for o, j in aliases}
        for j in into.values():
            args[j] = args[j].clone() if type(args[j]).__module__.startswith("torch") else args[j].copy()
        rest = iter(self.stages[k].execute(args, device=device))
        return [args[into[o]] if o in into else next(rest) for o in range(len(self.stage_outputs[k]))]

    def run(self, inputs: Sequence[Any], comm: Communicator, device: Optional[str]) -> List[Any]:
        """Run on this rank with ``comm`` doing the collectives."""
        if comm.size != self.mesh.size:
            raise KilnError(f"the communicator spans {comm.size} rank(s) but the fusion's mesh is "
                            f"{self.mesh}")
        gen = self.steps(inputs, device, comm.rank)
        works: Dict[int, Work] = {}
        try:
            req = next(gen)
            while True:
                if req[0] == "comm":
                    _, c, kind, op, x, out = req
                    if kind == "Allreduce":
                        works[c] = comm.allreduce(x, op)
                    elif kind == "Allgather":
                        works[c] = comm.allgather(out, x)
                    else:
                        works[c] = comm.reduce_scatter(out, x, op)
                else:
                    works.pop(req[1]).wait()
                req = gen.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def lowerings(self, inputs: Sequence[Any]) -> List[Any]:
        """Each stage lowered for inputs like ``inputs`` (shapes only; nothing runs)."""
        arrays, scalars = self._split(inputs)
        shapes = self.shapes(inputs)
        given = dict(zip(self.inputs, arrays))
        lows = []
        for k, st in enumerate(self.stages):
            args = [given[t] if t in given else _stand_in(shapes[t], self.program.dtype(t))
                    for t in self.stage_inputs[k]]
            lows.append(st.lower(args + self._scalars(scalars, 0)))
        return lows


def _stand_in(shape: Sequence[int], dtype: str) -> Any:
    """A NumPy array of this shape and dtype whose memory is one element: lowering reads
    only shapes, dtypes and strides."""
    dt = np.dtype(_numpy_dtype(dtype))
    base = np.zeros(1, dtype=dt)
    strides = [s * dt.itemsize for s in _contiguous_strides(shape)]
    return np.lib.stride_tricks.as_strided(base, shape=tuple(shape), strides=strides, writeable=False)


def _empty(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """An uninitialised array of the same kind (NumPy, CuPy, torch) and device as ``like``."""
    mod = type(like).__module__ if like is not None else "numpy"
    if mod.startswith("torch"):
        import torch  # noqa: PLC0415

        tdt = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16,
               "BFloat16": torch.bfloat16, "Int": torch.int64, "Int32": torch.int32,
               "Bool": torch.bool}[dtype]
        return torch.empty(tuple(shape), dtype=tdt, device=like.device)
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy.empty(tuple(shape), dtype=_numpy_dtype(dtype))
    return np.empty(tuple(shape), dtype=_numpy_dtype(dtype))


def _contiguous_array(x: Any) -> Any:
    """``x`` itself when row-major contiguous, else a contiguous copy (collectives move
    contiguous buffers)."""
    if type(x).__module__.startswith("torch"):
        return x if x.is_contiguous() else x.contiguous()
    flags = getattr(x, "flags", None)
    if flags is not None and not flags.c_contiguous:
        return x.copy() if not type(x).__module__.startswith("numpy") else np.ascontiguousarray(x)
    return x


def mesh_run(fd: Any) -> MeshRun:
    """The mesh program of ``fd``'s current version (decomposed once per version)."""
    from .compiled import compiled  # noqa: PLC0415

    c = compiled(fd)
    if c.mesh is None:
        if not fd._core.has_mesh:
            raise KilnError("the fusion is not sharded (no tensor has a DeviceMesh); "
                            "run it with fd.execute(inputs)")
        if fd._core.num_outputs == 0:
            raise KilnError("the fusion has no outputs: add one with fd.add_output")
        c.mesh = MeshRun(fd)
        from ._env import dump_enabled  # noqa: PLC0415

        if dump_enabled("sharding"):
            print(c.mesh.program.spreads())
    return c.mesh  # type: ignore[no-any-return]


def execute(fd: Any, inputs: Sequence[Any], device: Optional[str], comm: Optional[Communicator]) -> List[Any]:
    """Run a sharded fusion on this rank's local inputs."""
    run = mesh_run(fd)
    if comm is not None and not all(hasattr(comm, a) for a in ("rank", "size", "allreduce", "allgather")):
        raise KilnTypeError(f"execute: comm= takes a kiln.multidevice.Communicator (rank, size, allreduce, "
                            f"allgather, reduce_scatter), got {type(comm).__name__}")
    return run.run(inputs, comm if comm is not None else default_communicator(run.mesh), device)


# -- simulation ----------------------------------------------------------------------------

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def simulate(fd: Any, inputs_per_rank: Sequence[Sequence[Any]]) -> List[List[Any]]:
    """Run every rank of a sharded fusion in this process (stages in the CPU interpreter,
    collectives in NumPy, ranks in lockstep); returns each rank's outputs."""
    from .execute import refuse_immutable_targets  # noqa: PLC0415
    from .fusion import FusionDefinition  # noqa: PLC0415
    from .lowering import plain_numbers  # noqa: PLC0415

    if not isinstance(fd, FusionDefinition):
        raise KilnTypeError(f"simulate: expected a kiln.FusionDefinition, got {type(fd).__name__}")
    run = mesh_run(fd)
    n = run.mesh.size
    if not isinstance(inputs_per_rank, (list, tuple)) or len(inputs_per_rank) != n:
        ok = isinstance(inputs_per_rank, (list, tuple))
        got = len(inputs_per_rank) if ok else type(inputs_per_rank).__name__
        raise KilnError(f"simulate: the fusion's mesh is {run.mesh}; pass one input list per rank ({n}), "
                        f"got {got}")
    for r, ins in enumerate(inputs_per_rank):
        if not isinstance(ins, (list, tuple)):
            raise KilnTypeError(f"simulate: rank {r}: expected a list of inputs, got {type(ins).__name__}")
        for x in ins:
            if not isinstance(x, (bool, int, float, np.ndarray, np.generic)):
                raise KilnTypeError(f"simulate: rank {r}: inputs are NumPy arrays and numbers, "
                                    f"got {type(x).__name__}")
        refuse_immutable_targets(fd, ins)
    # NumPy numbers as fd.execute takes them (a 0-d array or the Python number).
    inputs_per_rank = [plain_numbers(fd, list(ins)) for ins in inputs_per_rank]
    # A sharded axis splits evenly over the mesh (its size is the local one times the mesh
    # size) and every other axis is replicated, so every rank's inputs have one shape:
    # uneven shards would give each rank its own wrong size (a mean dividing by 4 * 2 on one
    # rank and 3 * 2 on the other).
    shapes = [[np.shape(x) for x in ins] for ins in inputs_per_rank]
    for r in range(1, n):
        if len(shapes[r]) != len(shapes[0]):
            raise KilnError(f"simulate: rank {r} has {len(shapes[r])} inputs, rank 0 has {len(shapes[0])}")
        for i, (a, b) in enumerate(zip(shapes[0], shapes[r])):
            if a != b:
                raise KilnError(f"simulate: input {i} has shape {b} on rank {r} and {a} on rank 0; every "
                                f"rank's inputs must have the same shape (a sharded axis splits evenly over "
                                f"the mesh)")
    for ins in inputs_per_rank:
        # Every rank before any runs: a rank that finishes alone updates its in-place inputs.
        run.validate(ins)
    gens = [run.steps(list(ins), "cpu", r) for r, ins in enumerate(inputs_per_rank)]
    results: List[Optional[List[Any]]] = [None] * n
    reqs: List[Optional[Request]] = [None] * n

    def advance(r: int) -> None:
        try:
            reqs[r] = next(gens[r]) if reqs[r] is None else gens[r].send(None)
        except StopIteration as stop:
            reqs[r], results[r] = None, stop.value

    for r in range(n):
        advance(r)
    while any(q is not None for q in reqs):
        live = [q for q in reqs if q is not None]
        if len(live) != n or len({(q[0], q[1]) for q in live}) != 1:
            raise KilnError("internal: simulated ranks diverged")  # every rank runs one program
        first = live[0]
        if first[0] == "comm":
            _, _c, kind, op, _x, _o = first
            xs = [np.asarray(q[4]) for q in live]  # type: ignore[index]
            outs = [q[5] for q in live]  # type: ignore[index]
            if len({x.shape for x in xs}) != 1:
                # Each rank's slice has the shape of its own inputs: they must agree.
                raise KilnError(f"simulate: the ranks' {kind.lower()} operands have shapes "
                                f"{[x.shape for x in xs]}; every rank's inputs must have the same sizes")
            if kind == "Allreduce":
                total = _REDUCE[op].reduce(np.stack(xs), axis=0).astype(xs[0].dtype)
                for o in outs:
                    o[...] = total
            elif kind == "Allgather":
                for o in outs:
                    for j, x in enumerate(xs):
                        o[j] = x
            else:
                for r, o in enumerate(outs):
                    o[...] = _REDUCE[op].reduce(np.stack([x[r] for x in xs]), axis=0).astype(xs[0].dtype)
        for r in range(n):
            advance(r)
    return [list(x) if x is not None else [] for x in results]


class LoweredMesh:
    """``fd.lower(inputs)`` of a sharded fusion: each stage's lowering, their kernels, and
    the rank's host program with its collectives."""

    def __init__(self, run: MeshRun, inputs: Sequence[Any]) -> None:
        self.mesh = run.mesh
        self.program = run.program  # kiln._core.MeshProgram
        self.stages = run.lowerings(inputs)
        self.kernels = [k for low in self.stages for k in low.kernels]
        self._text = str(run.program.text([low.host_program for low in self.stages]))

    @property
    def host_program(self) -> str:
        """The rank's host program: stages (each its own host program), Allocate,
        Communication, Wait and Deallocate."""
        return self._text

    @property
    def sharding(self) -> str:
        """How propagation spread each tensor of the definition over the mesh."""
        return str(self.program.spreads())

    def __repr__(self) -> str:
        return self._text
