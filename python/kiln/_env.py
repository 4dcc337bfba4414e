"""Every environment variable kiln reads, in one place (each read when it is used, so a
test or a long-running process can change it between calls).

- ``KILN_DUMP``: comma-separated dumps to print (``fusion``, ``segments``, ``kernel_ir``,
  ``allocations``, ``host_ir``, ``cuda``, and ``after:<pass>`` for the kernel IR after one
  lowering pass; ``kiln._core.lower_passes()`` names them).
- ``KILN_VERIFY``: ``1`` runs the kernel-IR verifier after every lowering pass (always on in
  debug builds of the core).
- ``KILN_CACHE_DIR``: where compiled CUBINs are kept (default ``~/.cache/kiln``).
- ``KILN_NVRTC_PCH``: ``0``/``false``/``off``/``no`` compiles every kernel with the runtime
  header parsed from source; unset or ``1``, the header is parsed once per header, NVRTC version
  and options into a precompiled header under ``$KILN_CACHE_DIR/pch`` that later compiles, in
  this process and others, load instead (about 45 ms less per kernel on a 2-core CPU).
- ``KILN_CUDA_INCLUDE``: a directory holding ``cuda_fp16.h`` for NVRTC; then ``CUDA_HOME`` and
  ``CUDA_PATH`` are tried after the nvidia-cuda-runtime wheel.
- ``KILN_LAUNCHER``: ``rust`` (kiln's launcher, the default where libcuda loads) or ``cupy``.
- ``KILN_CUDA_GRAPHS``: ``0``/``false``/``off``/``no`` launches every kernel of a host program
  one by one (``cuLaunchKernel``); unset or ``1``, a program is replayed as one CUDA graph
  (its kernels, and the memsets of zero-initialised buffers, as nodes) from the second call
  of an input signature on, its node parameters updated when pointers or scalar values
  change. Read when an input signature is first prepared; graphs need kiln's own launcher
  (``KILN_LAUNCHER=rust``, the default).
- ``KILN_REUSE_OUTPUTS``: ``0``/``false``/``off``/``no`` gives every call freshly allocated
  outputs; unset or ``1``, a signature whose outputs total at most 1 MiB hands back the
  previous call's output arrays when nothing outside kiln references them any more (no
  array, view, data pointer object or DLPack/``__cuda_array_interface__`` export of them is
  alive) and the call runs on the same stream, saving the allocation (about 1.4 µs with
  CuPy, 3 µs with torch). Read when an input signature is first prepared.
- ``KILN_L2_EVICT_LAST``: ``0``/``false``/``off``/``no`` turns off the L2 evict_last hint of the
  automatic schedules; read once per process by the Rust core
  (``sched::auto::evict_last_inputs``), so that cached plans never mix the two settings.
- ``KILN_ROWS_IN_SHARED``: ``1`` sends every normalization row that both the register- and the
  Shared-persistent schedules can hold to Shared memory, ``0`` keeps it in registers whenever
  they hold it; unset, the automatic path picks per row. For comparing the two; read once per
  process by the Rust core (``sched::auto::rows_in_shared``).
- ``KILN_COLUMN_PARTIALS``: ``0``/``false``/``off``/``no`` turns off the automatic path's
  per-block column partials: a fusion that reduces the same rows and columns (LayerNorm
  backward) then runs one kernel per class of reductions instead of one that computes the
  column sums as register partials beside the rows, plus small kernels that total them
  (``sched::auto::partials``); read once per process by the Rust core.
- ``KILN_CLUSTER_ROWS``: unset, the Shared-persistent normalization splits rows too long for
  two blocks' Shared memory per SM over a cluster of up to 8 blocks (sm_90+,
  ``sched::auto::shared::cluster_size``); ``1``/``true``/``on``/``yes`` also lets the
  register-persistent normalization split rows longer than four vectors per thread of a
  512-thread block (``sched::auto::normalization::cluster_size``, slower on the H200: see
  DEVELOPERS.md, "Thread-block clusters"); ``0`` splits no row. Read once per process by the
  Rust core.
- ``KILN_OUTER_ROWS_LOOPED``: ``1``/``true``/``on``/``yes`` makes the looped normalization read
  rows over leading or middle axes again in every pass even where they fit in registers
  (``sched::auto::looped``); for comparing the two. Read once per process by the Rust core.
- ``KILN_BULK_ROWS``: unset or ``1``, each block of a row split over a cluster copies its part
  into Shared memory with one bulk copy (``cp.async.bulk``); ``0``, every thread copies its
  own vectors. Read once per process by the Rust core.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional


def dump_enabled(what: str) -> bool:
    """True when ``KILN_DUMP`` lists ``what``."""
    return what in {p.strip() for p in os.environ.get("KILN_DUMP", "").split(",")}


def dump_after() -> List[str]:
    """The passes ``KILN_DUMP`` asks to print the kernel IR after (``after:<pass>`` entries)."""
    parts = (p.strip() for p in os.environ.get("KILN_DUMP", "").split(","))
    return [p[len("after:"):] for p in parts if p.startswith("after:")]


def verify_passes() -> bool:
    """``KILN_VERIFY=1``."""
    return os.environ.get("KILN_VERIFY", "") == "1"


def cache_dir() -> Path:
    """``KILN_CACHE_DIR``, else ``~/.cache/kiln``."""
    env = os.environ.get("KILN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kiln"


def nvrtc_pch() -> bool:
    """``KILN_NVRTC_PCH`` is not turned off."""
    return os.environ.get("KILN_NVRTC_PCH", "1").strip().lower() not in ("0", "false", "off", "no")


def cuda_include_override() -> Optional[str]:
    """``KILN_CUDA_INCLUDE`` when set."""
    return os.environ.get("KILN_CUDA_INCLUDE") or None


def cuda_roots() -> List[str]:
    """``CUDA_HOME`` and ``CUDA_PATH``, where set."""
    return [v for v in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if v]


def cuda_graphs_choice() -> str:
    """``KILN_CUDA_GRAPHS`` as ``"off"`` or ``"on"`` (the default); anything else is
    returned as given, lower-cased, for the caller to refuse."""
    v = os.environ.get("KILN_CUDA_GRAPHS", "").strip().lower()
    if v in ("0", "false", "off", "no"):
        return "off"
    if v in ("", "1", "true", "on", "yes"):
        return "on"
    return v


def reuse_outputs() -> bool:
    """``KILN_REUSE_OUTPUTS`` is not turned off."""
    return os.environ.get("KILN_REUSE_OUTPUTS", "1").strip().lower() not in ("0", "false", "off", "no")


def launcher_choice() -> str:
    """``KILN_LAUNCHER``, lower-cased (empty when unset)."""
    return os.environ.get("KILN_LAUNCHER", "").strip().lower()
