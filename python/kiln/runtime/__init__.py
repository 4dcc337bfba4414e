"""kiln's GPU runtime: NVRTC compilation (``nvrtc``) and CuPy module loading/launching
(``executor``).

Importing this package needs neither CuPy nor cuda-bindings nor ``kiln._core``; each
dependency is imported where it is used. ``runtime_header()`` returns the CUDA header
that codegen prepends to every kernel (rust/src/codegen/runtime.cuh in a source checkout).
"""

from __future__ import annotations

from pathlib import Path

from .nvrtc import CompileResult, compile_cubin, cuda_include_dir, nvrtc_available

__all__ = [
    "CompileResult",
    "compile_cubin",
    "cuda_include_dir",
    "nvrtc_available",
    "runtime_header",
]


def runtime_header() -> str:
    """Text of runtime.cuh from the source checkout (rust/src/codegen/runtime.cuh)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "rust" / "src" / "codegen" / "runtime.cuh"
        if cand.is_file():
            return cand.read_text()
    raise FileNotFoundError("runtime.cuh not found: it lives in rust/src/codegen of a kiln checkout")
