"""Load and launch kiln kernels with CuPy.

CuPy is imported lazily (first call), so ``kiln.runtime`` imports on machines without it.

* ``load_module(source, kernel_name)`` compiles ``source`` with NVRTC to a CUBIN for the
  current device's own ``sm_XX`` — never PTX, because the driver may be older than NVRTC
  and could not JIT newer PTX — and returns a ``CompiledKernel``. The compile goes
  through ``kiln.runtime.nvrtc`` (cuda-bindings) when that is installed, else through
  CuPy's own NVRTC (``cupy.cuda.compiler.compile_using_nvrtc``), whose output is checked
  to be an ELF CUBIN. Modules are cached in memory (per device) and on disk at
  ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``, file ``<sha256(source, options, arch)>.cubin``;
  the key is computed once per ``load_module`` miss, never per launch.
* ``launch(kernel, grid, block, shared_mem, args)`` launches on CuPy's current stream.
  ``args``: CuPy arrays (passed as device pointers) and NumPy scalars (passed by value
  with their own dtype: ``np.int64``, ``np.float32``, ``np.float64``, ...). Plain Python
  ints/floats are passed by CuPy as int64/float64; prefer explicit NumPy scalars.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from .. import _env
from .._errors import KilnError
from . import nvrtc as _nvrtc

__all__ = [
    "CompiledKernel",
    "as_cupy",
    "cache_dir",
    "clear_memory_cache",
    "compile_count",
    "cubin_for",
    "device_arch",
    "empty_buffer",
    "launch",
    "load_module",
    "zeroed_buffer",
]

# Dynamic Shared memory up to which a kernel launches as loaded. Above it, the function's
# limit is raised (needed past 48 KiB) and Shared memory is preferred over L1 in the SM's
# split, so that as many blocks as their Shared memory allows run at once.
_DEFAULT_SMEM_LIMIT = 16 * 1024
_ELF_MAGIC = b"\x7fELF"


def _cupy() -> Any:
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise KilnError("the GPU runtime needs CuPy: pip install cupy-cuda13x") from e
    return cupy


class CompiledKernel:
    """A loaded kernel: the CuPy module and function plus what the compile reported."""

    __slots__ = ("arch", "function", "key", "max_dynamic_smem", "module", "name", "registers", "spills")

    def __init__(self, module: Any, function: Any, name: str, arch: str, key: str) -> None:
        self.module = module
        self.function = function
        self.name = name
        self.arch = arch
        self.key = key
        self.registers: Optional[int] = None
        self.spills: Optional[int] = None
        self.max_dynamic_smem = _DEFAULT_SMEM_LIMIT

    def __repr__(self) -> str:
        return f"CompiledKernel({self.name!r}, arch={self.arch}, key={self.key[:12]})"


# (device id, source, options, arch) -> _LoadedModule, and
# (device id, source, kernel name, options, arch) -> CompiledKernel. Python caches str
# hashes, so a hit costs no re-hash of the source text.
class _LoadedModule:
    __slots__ = ("key", "module", "registers", "spills")

    def __init__(self, module: Any, key: str, registers: Dict[str, int], spills: Dict[str, int]) -> None:
        self.module = module
        self.key = key
        self.registers = registers
        self.spills = spills


_MODULE_CACHE: Dict[Tuple[int, str, Tuple[str, ...], str], _LoadedModule] = {}
_MEMORY_CACHE: Dict[Tuple[int, str, str, Tuple[str, ...], str], CompiledKernel] = {}


def clear_memory_cache() -> None:
    """Forget every loaded module (the disk cache stays)."""
    _MEMORY_CACHE.clear()
    _MODULE_CACHE.clear()


def cache_dir() -> Path:
    """Where compiled CUBINs are kept: $KILN_CACHE_DIR, else ~/.cache/kiln."""
    return _env.cache_dir()


def device_arch() -> str:
    """``sm_XX`` of CuPy's current device."""
    cp = _cupy()
    return f"sm_{cp.cuda.Device().compute_capability}"


def _cache_key(source: str, options: Tuple[str, ...], arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch):
        h.update(part.encode())
        h.update(b"\x00\x01")
    return h.hexdigest()


# NVRTC compiles this process ran (cache misses): what tests and benches read to tell a
# disk-cache hit from a compile.
_COMPILES = [0]


def compile_count() -> int:
    """How many NVRTC compiles this process has run (memory and disk cache hits run none)."""
    return _COMPILES[0]


def _compile(
    source: str, options: Tuple[str, ...], arch: str
) -> Tuple[bytes, Dict[str, int], Dict[str, int]]:
    """CUBIN bytes, plus registers/spills per kernel when the compile path reports them."""
    _COMPILES[0] += 1
    if _nvrtc.nvrtc_available():
        pch = str(cache_dir() / "pch") if _env.nvrtc_pch() else None
        res = _nvrtc.compile_cubin(source, "kiln_kernel.cu", arch=arch, extra_options=options, pch_dir=pch)
        return res.cubin, res.registers, res.spills
    _cupy()
    from cupy.cuda import compiler  # type: ignore[import-not-found]

    opts = [o for o in _nvrtc.default_options(arch) if not o.startswith(("-arch", "--ptxas"))]
    opts += list(options)
    try:
        binary, _mapping = compiler.compile_using_nvrtc(
            source, tuple(opts), arch=arch[len("sm_") :], cache_in_memory=True
        )
    except compiler.CompileException as e:
        raise KilnError(f"NVRTC (CuPy) failed to compile for {arch}:\n{e}") from e
    if isinstance(binary, str):
        binary = binary.encode()
    if not binary.startswith(_ELF_MAGIC):
        raise KilnError(
            f"CuPy's NVRTC produced PTX, not a CUBIN, for {arch} (is CUPY_COMPILE_WITH_PTX set, or is "
            "the device newer than NVRTC?); install cuda-bindings to compile with kiln's own NVRTC path"
        )
    return bytes(binary), {}, {}


def cubin_for(source: str, arch: str, options: Sequence[str] = ()) -> Tuple[bytes, str]:
    """The CUBIN of ``source`` for ``arch`` and its cache key: read from the disk cache, else
    compiled with NVRTC and stored there (no GPU needed)."""
    cubin, key, _regs, _spills = _cubin(source, tuple(options), arch)
    return cubin, key


#: Architectures with Tensor memory (tcgen05), compiled for their arch-specific target.
_TMEM_ARCHS = ("sm_100", "sm_101", "sm_103")


def uses_tensor_memory(source: str) -> bool:
    """Whether a generated kernel keeps tensors in Tensor memory (MemoryType.Tensor)."""
    return "kiln::tmemAlloc<" in source


def tensor_memory_arch(source: str, arch: str) -> str:
    """``arch`` for a kernel; for one that keeps tensors in Tensor memory (MemoryType.Tensor)
    its arch-specific ``sm_10Xa`` target, or a KilnError on a GPU without Tensor memory."""
    if not uses_tensor_memory(source):
        return arch
    base = arch[:-1] if arch.endswith("a") else arch
    if base not in _TMEM_ARCHS:
        raise KilnError(f"this kernel keeps tensors in Tensor memory (MemoryType.Tensor), which needs a "
                        f"Blackwell GPU (sm_100a, tcgen05); the target is {arch}: keep them in Local memory")
    return base + "a"


def _whole_elf(data: bytes) -> bool:
    """Whether ``data`` is a 64-bit ELF file whose program and section header tables lie
    inside it (a cache file cut short, or overwritten with a prefix of one, is not)."""
    if len(data) < 64 or not data.startswith(_ELF_MAGIC) or data[4] != 2:
        return False
    order = "little" if data[5] == 1 else "big"

    def num(at: int, size: int) -> int:
        return int.from_bytes(data[at:at + size], order)

    programs = num(0x20, 8) + num(0x36, 2) * num(0x38, 2)
    sections = num(0x28, 8) + num(0x3A, 2) * num(0x3C, 2)
    return max(programs, sections) <= len(data)


def _cubin(source: str, opts: Tuple[str, ...], arch: str,
           fresh: bool = False) -> Tuple[bytes, str, Dict[str, int], Dict[str, int]]:
    """The CUBIN, cache key, registers and spills of ``source``: from the disk cache unless
    ``fresh`` (or the cached file is not a whole ELF file), else compiled and stored."""
    arch = tensor_memory_arch(source, arch)
    key = _cache_key(source, opts, arch)
    path = cache_dir() / f"{key}.cubin"
    cubin: Optional[bytes] = None
    regs: Dict[str, int] = {}
    spills: Dict[str, int] = {}
    try:
        data = b"" if fresh else path.read_bytes()
        if _whole_elf(data):
            cubin = data
    except OSError:
        pass
    if cubin is None:
        cubin, regs, spills = _compile(source, opts, arch)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)  # atomic: concurrent writers leave one whole file
        except OSError:
            pass  # a read-only cache is not an error
    return cubin, key, regs, spills


def _load_module(cp: Any, dev_id: int, source: str, opts: Tuple[str, ...], arch: str,
                 fresh: bool = False) -> _LoadedModule:
    mkey = (dev_id, source, opts, arch)
    hit = None if fresh else _MODULE_CACHE.get(mkey)
    if hit is not None:
        return hit
    cubin, key, regs, spills = _cubin(source, opts, arch, fresh)
    module = cp.cuda.function.Module()
    try:
        module.load(cubin)
    except Exception:  # noqa: BLE001 - a damaged cache file: compile again and replace it
        cubin, key, regs, spills = _cubin(source, opts, arch, fresh=True)
        module = cp.cuda.function.Module()
        try:
            module.load(cubin)
        except Exception as e:  # noqa: BLE001
            raise KilnError(f"the driver cannot load the CUBIN NVRTC compiled for {arch}: {e}") from e
    loaded = _LoadedModule(module, key, regs, spills)
    _MODULE_CACHE[mkey] = loaded
    return loaded


def load_module(
    source: str, kernel_name: str, arch: Optional[str] = None, options: Sequence[str] = (),
    threads: Optional[int] = None,
) -> CompiledKernel:
    """Compile (or fetch from the caches) ``source`` for ``arch`` (default: the current
    device's ``sm_XX``) and return its kernel ``kernel_name`` (an ``extern "C"`` name or a
    mangled one). Several kernels of one source share one compile and one module. With
    ``threads`` (the block size), a kernel whose registers would not fit one block of that
    size is compiled again with a register cap."""
    kernel = _load_kernel(source, kernel_name, arch, tuple(options))
    if threads and threads > _max_threads(kernel.function):
        per_block = int(_cupy().cuda.Device().attributes["MaxRegistersPerBlock"])
        # Registers are granted in units of 8 per thread; the cap keeps the block launchable.
        cap = max(16, per_block // threads // 8 * 8)
        kernel = _load_kernel(source, kernel_name, arch, (*options, f"--maxrregcount={cap}"))
    return kernel


def _max_threads(function: Any) -> int:
    """The largest block ``function`` launches with, given the registers it was compiled to."""
    from cupy.cuda import driver  # type: ignore[import-not-found]  # noqa: PLC0415

    attribute = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK", 0)  # 0 in cuda.h
    return int(driver.funcGetAttribute(attribute, function.ptr))


def local_bytes(function: Any) -> int:
    """Local memory (stack frame) per thread of ``function``, a ``cupy.cuda.Function``."""
    from cupy.cuda import driver  # type: ignore[import-not-found]  # noqa: PLC0415

    attribute = getattr(driver, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", 3)  # 3 in cuda.h
    return int(driver.funcGetAttribute(attribute, function.ptr))


def check_local_reservation(function: Any, what: str, tensors: str) -> None:
    """Raise a KilnError when the Local memory the driver reserves to launch ``function``
    cannot fit the device; free CuPy's cached blocks when it fits only without them."""
    cp = _cupy()
    try:
        per_thread = local_bytes(function)
        if not per_thread:
            return
        attrs = cp.cuda.Device().attributes
        # The driver reserves a thread's Local memory for every thread the device can hold.
        threads = int(attrs["MultiProcessorCount"]) * int(attrs["MaxThreadsPerMultiProcessor"])
        free, total = cp.cuda.runtime.memGetInfo()
    except Exception:  # noqa: BLE001 - a check the driver cannot answer (a capture underway) is skipped
        return
    need = per_thread * threads
    if need > total:
        raise KilnError(
            f"{what} needs {per_thread} bytes of Local memory per thread ({tensors}); to launch it "
            f"the driver reserves that for all {threads} threads the device holds, "
            f"{need / 2**30:.1f} GiB, more than the device's {total / 2**30:.1f} GiB (inline the "
            "tensors deeper, parallelize their axes or keep them in Shared memory)")
    if need > free:
        cp.get_default_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def set_max_dynamic_smem(function: Any, nbytes: int) -> None:
    """Let ``function`` (a ``cupy.cuda.Function``) launch with ``nbytes`` of dynamic Shared memory."""
    from cupy.cuda import driver  # type: ignore[import-not-found]  # noqa: PLC0415

    limit = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)  # 8 in cuda.h
    carveout = getattr(driver, "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT", 9)  # 9 in cuda.h
    try:
        driver.funcSetAttribute(function.ptr, limit, int(nbytes))
    except Exception as e:  # a CUDADriverError: more than the device's opt-in limit
        raise KilnError(f"the kernel needs {nbytes} bytes of dynamic Shared memory; the device refuses: "
                        f"{e}") from e
    try:
        driver.funcSetAttribute(function.ptr, carveout, 100)  # a hint: all of the split to Shared memory
    except Exception:  # noqa: BLE001, S110 - a device without the split ignores the hint
        pass


def _load_kernel(source: str, kernel_name: str, arch: Optional[str], opts: Tuple[str, ...]) -> CompiledKernel:
    cp = _cupy()
    dev = cp.cuda.Device()
    if arch is None:
        arch = f"sm_{dev.compute_capability}"
    kkey = (dev.id, source, kernel_name, opts, arch)
    hit = _MEMORY_CACHE.get(kkey)
    if hit is not None:
        return hit
    loaded = _load_module(cp, dev.id, source, opts, arch)
    try:
        function = loaded.module.get_function(kernel_name)
    except Exception:  # noqa: BLE001 - a damaged cache file the driver loaded: compile again
        loaded = _load_module(cp, dev.id, source, opts, arch, fresh=True)
        try:
            function = loaded.module.get_function(kernel_name)
        except Exception as e:
            raise KilnError(f"kernel {kernel_name!r} not found in the compiled module for {arch}") from e
    kernel = CompiledKernel(loaded.module, function, kernel_name, arch, loaded.key)
    kernel.registers = loaded.registers.get(kernel_name)
    kernel.spills = loaded.spills.get(kernel_name)
    _MEMORY_CACHE[kkey] = kernel
    return kernel


def launch(
    kernel: Any,
    grid: Tuple[int, ...],
    block: Tuple[int, ...],
    shared_mem: int,
    args: Sequence[Any],
) -> None:
    """Launch ``kernel`` (a CompiledKernel or a raw ``cupy.cuda.Function``) on the current
    stream. Dynamic shared memory above 48 KiB raises the function's limit once."""
    if type(kernel) is CompiledKernel:
        if shared_mem > kernel.max_dynamic_smem:
            set_max_dynamic_smem(kernel.function, shared_mem)
            kernel.max_dynamic_smem = shared_mem
        fn = kernel.function
    else:
        fn = kernel
    fn(grid, block, tuple(args), shared_mem=shared_mem)


def zeroed_buffer(nbytes: int) -> Any:
    """A zero-filled uint8 CuPy array of ``nbytes`` (at least 1) bytes."""
    cp = _cupy()
    return cp.zeros(max(int(nbytes), 1), dtype=cp.uint8)


def empty_buffer(nbytes: int) -> Any:
    """An uninitialised uint8 CuPy array of ``nbytes`` (at least 1) bytes."""
    cp = _cupy()
    return cp.empty(max(int(nbytes), 1), dtype=cp.uint8)


def as_cupy(x: Any) -> Any:
    """A CuPy view of a CuPy array, a torch CUDA tensor or anything with
    ``__cuda_array_interface__`` / DLPack (zero-copy)."""
    cp = _cupy()
    if isinstance(x, cp.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    if hasattr(x, "__dlpack__"):
        return cp.from_dlpack(x)
    raise KilnError(f"expected a GPU array (CuPy, torch CUDA tensor), got {type(x).__name__}")
