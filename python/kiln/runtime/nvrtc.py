"""Compile CUDA C++ to a CUBIN with NVRTC through ``cuda-bindings`` — no GPU needed.

This is the CPU-side compile check of every generated kernel (DESIGN.md, Tests, oracle 2)
and the preferred compile path of the executor. It needs the pip wheels ``cuda-bindings``
and ``nvidia-cuda-nvrtc`` (the compiler) and ``nvidia-cuda-runtime`` (whose include dir
holds ``cuda_fp16.h`` / ``cuda_bf16.h``, passed with ``-I``).

Nothing here imports ``kiln._core``: the module can be loaded on a machine without the
compiled extension (see DEVELOPERS.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _env
from .._errors import KilnError

__all__ = [
    "CompileResult",
    "compile_cubin",
    "cuda_include_dir",
    "default_options",
    "nvrtc_available",
    "nvrtc_version",
    "parse_ptxas_log",
]

# Relative to a `nvidia` namespace-package directory: CUDA 13 wheels, then CUDA 12 wheels.
_INCLUDE_CANDIDATES = ("cu13/include", "cuda_runtime/include")


@dataclass
class CompileResult:
    """A compiled CUBIN plus what ptxas said about each entry function.

    ``registers`` (entry functions only) and ``spills``/``spill_stores``/``spill_loads``/
    ``stack_frame`` (every function ptxas reports, non-inlined device functions included) are
    keyed by the function's name as ptxas prints it (the plain name for ``extern "C"``
    kernels, the mangled one otherwise); names given as ``name_expressions`` are also
    keys. ``spills`` is spill-store bytes + spill-load bytes.
    """

    cubin: bytes
    log: str
    registers: Dict[str, int] = field(default_factory=dict)
    spills: Dict[str, int] = field(default_factory=dict)
    spill_stores: Dict[str, int] = field(default_factory=dict)
    spill_loads: Dict[str, int] = field(default_factory=dict)
    stack_frame: Dict[str, int] = field(default_factory=dict)
    lowered_names: Dict[str, str] = field(default_factory=dict)


def _nvrtc_module():  # noqa: ANN202 - returns the cuda.bindings.nvrtc module
    from cuda.bindings import nvrtc  # type: ignore[import-not-found]

    return nvrtc


@lru_cache(maxsize=1)
def nvrtc_available() -> bool:
    """True when cuda-bindings' NVRTC can be imported and its shared library loads."""
    try:
        nvrtc = _nvrtc_module()
        err, _major, _minor = nvrtc.nvrtcVersion()
        return int(err) == 0
    except Exception:  # ImportError, missing libnvrtc.so, ...
        return False


def nvrtc_version() -> Tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-bindings loads."""
    nvrtc = _nvrtc_module()
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


@lru_cache(maxsize=1)
def cuda_include_dir() -> Optional[str]:
    """Directory holding ``cuda_fp16.h``: $KILN_CUDA_INCLUDE, the nvidia-cuda-runtime wheel
    (``nvidia/cu13/include``, else ``nvidia/cuda_runtime/include``), then $CUDA_HOME/include
    and /usr/local/cuda/include. None if nothing is found."""
    env = _env.cuda_include_override()
    if env and Path(env, "cuda_fp16.h").is_file():
        return env
    roots: List[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots.extend(spec.submodule_search_locations)
    for root in roots:
        for rel in _INCLUDE_CANDIDATES:
            cand = Path(root, rel)
            if (cand / "cuda_fp16.h").is_file():
                return str(cand)
    for base in _env.cuda_roots():
        if Path(base, "include", "cuda_fp16.h").is_file():
            return str(Path(base, "include"))
    if Path("/usr/local/cuda/include/cuda_fp16.h").is_file():
        return "/usr/local/cuda/include"
    return None


def default_options(arch: str = "sm_90") -> List[str]:
    """The options every kiln kernel is compiled with (the include dir when found)."""
    opts = ["--std=c++17", "-default-device", "--ptxas-options=-v", f"-arch={arch}"]
    inc = cuda_include_dir()
    if inc is not None:
        opts.insert(0, f"-I{inc}")
    return opts


def _check(err: object, what: str) -> None:
    if int(err) != 0:  # type: ignore[call-overload]
        raise KilnError(f"NVRTC call {what} failed with {err!r}")


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def _new_record() -> Dict[str, int]:
    return {"entry": 0, "registers": 0, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}


def parse_ptxas_log(log: str) -> Dict[str, Dict[str, int]]:
    """Parse ``--ptxas-options=-v`` output into ``{function: {entry, registers,
    spill_stores, spill_loads, stack_frame}}``. Non-entry (non-inlined) device functions,
    e.g. libdevice's ``__internal_accurate_pow``, get their own record with ``entry`` 0
    (their registers count towards the calling entry, as ptxas reports)."""
    out: Dict[str, Dict[str, int]] = {}
    entry: Optional[str] = None
    props_for: Optional[str] = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            entry = m.group(1)
            rec = out.setdefault(entry, _new_record())
            rec["entry"] = 1
            props_for = None
            continue
        m = _PROPS_RE.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _FRAME_RE.search(line)
        if m and props_for is not None:
            rec = out.setdefault(props_for, _new_record())
            rec["stack_frame"] = int(m.group(1))
            rec["spill_stores"] = int(m.group(2))
            rec["spill_loads"] = int(m.group(3))
            continue
        m = _REGS_RE.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
    return out


_ERR_LINE_RE = re.compile(r"\((\d+)\): (?:error|catastrophic error)")


def _source_excerpt(source: str, log: str, context: int = 2, max_sites: int = 5) -> str:
    lines = source.splitlines()
    seen: List[int] = []
    for m in _ERR_LINE_RE.finditer(log):
        n = int(m.group(1))
        if n not in seen:
            seen.append(n)
        if len(seen) >= max_sites:
            break
    parts: List[str] = []
    for n in seen:
        lo, hi = max(1, n - context), min(len(lines), n + context)
        block = [f"{'>' if i == n else ' '}{i:6d} | {lines[i - 1]}" for i in range(lo, hi + 1)]
        parts.append("\n".join(block))
    return "\n   ...\n".join(parts)


# The last line of kiln's runtime header, which every generated kernel starts with.
_RUNTIME_END = "#endif  // KILN_RUNTIME_CUH"
_RUNTIME_NAME = "kiln_runtime.cuh"


def _pch_attempt(source: str, opts: List[bytes], pch_dir: str):  # noqa: ANN202
    """(source, headers, include names, options, created file, final file) that compile
    ``source`` with its runtime header precompiled, or None when the source has no runtime
    header or ``pch_dir`` cannot be written. The file is keyed by the header's text, the
    options and NVRTC's version: NVRTC does not notice that an in-memory header changed."""
    end = source.find(_RUNTIME_END)
    if end < 0:
        return None
    cut = end + len(_RUNTIME_END)
    header, body = source[:cut] + "\n", source[cut:]
    h = hashlib.sha256()
    for part in (header.encode(), b"\0".join(opts), repr(nvrtc_version()).encode()):
        h.update(part)
        h.update(b"\x00\x01")
    final = Path(pch_dir) / f"runtime-{h.hexdigest()[:40]}.pch"
    if final.exists():
        created = None
        flag = f"--use-pch={final}"
    else:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        # A file of this process's own, renamed into place whole: concurrent compiles never
        # read a half-written header.
        created = final.with_name(f"{final.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        flag = f"--create-pch={created}"
    src = f'#include "{_RUNTIME_NAME}"\n' + body
    return src, [header.encode()], [_RUNTIME_NAME.encode()], opts + [flag.encode()], created, final


def compile_cubin(
    source: str,
    name: str,
    arch: str = "sm_90",
    extra_options: Sequence[str] = (),
    name_expressions: Sequence[str] = (),
    pch_dir: Optional[str] = None,
) -> CompileResult:
    """Compile ``source`` (file name ``name`` in messages) to a CUBIN for ``arch``
    (``sm_XX``; a bare ``90`` is accepted). Raises KilnError with the NVRTC log and the
    offending source lines on a compile error. With ``pch_dir``, kiln's runtime header at
    the start of ``source`` is loaded from a precompiled header kept there (made on first
    use); a compile that fails that way is run again from the whole source."""
    if not nvrtc_available():
        raise KilnError(
            "NVRTC is not available: pip install cuda-bindings nvidia-cuda-nvrtc nvidia-cuda-runtime"
        )
    nvrtc = _nvrtc_module()
    if not arch.startswith(("sm_", "compute_")):
        arch = f"sm_{arch}"
    if not arch.startswith("sm_"):
        raise KilnError(f"compile_cubin needs a real architecture (sm_XX), got {arch!r}")
    opts = [o.encode() for o in default_options(arch)] + [o.encode() for o in extra_options]
    attempt = _pch_attempt(source, opts, pch_dir) if pch_dir and not name_expressions else None
    if attempt is not None:
        src, headers, names, pch_opts, created, final = attempt
        err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), len(headers), headers, names)
        _check(err, "nvrtcCreateProgram")
        result: Optional[CompileResult] = None
        try:
            (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(pch_opts), pch_opts)
            made = created is not None and int(nvrtc.nvrtcGetPCHCreateStatus(prog)[0]) == 0
            if int(cerr) == 0:
                result = _result(nvrtc, prog, int(cerr), source, name, arch, ())
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        if created is not None:
            try:
                if made and created.exists():
                    os.replace(created, final)
                else:
                    created.unlink(missing_ok=True)
            except OSError:
                pass
        if result is not None:
            return result
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            _check(err, f"nvrtcAddNameExpression({expr!r})")
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        return _result(nvrtc, prog, int(cerr), source, name, arch, name_expressions)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _result(nvrtc, prog, cerr: int, source: str, name: str, arch: str,  # noqa: ANN001
            name_expressions: Sequence[str]) -> CompileResult:
    """The CUBIN, log and ptxas figures of compiled program ``prog`` (KilnError if ``cerr``)."""
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(err, "nvrtcGetProgramLogSize")
    buf = b" " * size
    (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
    _check(err, "nvrtcGetProgramLog")
    log = buf.rstrip(b"\x00 \n").decode(errors="replace")
    if cerr != 0:
        excerpt = _source_excerpt(source, log)
        msg = f"NVRTC failed to compile {name} for {arch}:\n{log}"
        if excerpt:
            msg += f"\n--- source ---\n{excerpt}"
        raise KilnError(msg)
    lowered: Dict[str, str] = {}
    for expr in name_expressions:
        err, low = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
        _check(err, f"nvrtcGetLoweredName({expr!r})")
        lowered[expr] = low.decode() if isinstance(low, bytes) else str(low)
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    _check(err, "nvrtcGetCUBINSize")
    cubin = b" " * size
    (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
    _check(err, "nvrtcGetCUBIN")

    res = CompileResult(cubin=cubin, log=log, lowered_names=lowered)
    stats = parse_ptxas_log(log)
    aliases = {low: expr for expr, low in lowered.items()}
    for fn, rec in stats.items():
        keys = [fn] + ([aliases[fn]] if fn in aliases else [])
        for k in keys:
            if rec["entry"]:
                res.registers[k] = rec["registers"]
            res.spill_stores[k] = rec["spill_stores"]
            res.spill_loads[k] = rec["spill_loads"]
            res.spills[k] = rec["spill_stores"] + rec["spill_loads"]
            res.stack_frame[k] = rec["stack_frame"]
    return res
