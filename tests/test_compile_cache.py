"""The disk cache of compiled CUBINs serves a second process without an NVRTC compile
(CPU: NVRTC from the cuda-bindings wheels; the GPU variant loads and runs the kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_util import cupy_or_skip

HERE = Path(__file__).resolve().parent

# A child process: lower a two-kernel fusion for NumPy stand-ins, get each kernel's CUBIN
# through the executor's caches, print the compiles it ran and the cache keys.
_CPU_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_host import three_segment_chain
from kiln.runtime import executor
low = three_segment_chain().lower([np.zeros((8, 300), np.float32)])
keys = [executor.cubin_for(k.cuda_source_for(False), "sm_90")[1] for k in low.kernels]
print(json.dumps({{"compiles": executor.compile_count(), "keys": keys}}))
"""

# A child process on the GPU: run the fusion and check its values.
_GPU_CHILD = """
import json, sys
import cupy as cp, numpy as np
sys.path.insert(0, {tests!r})
from test_host import three_segment_chain
from kiln.runtime import executor
x = np.random.default_rng(1).standard_normal((8, 300)).astype(np.float32)
(y,) = three_segment_chain().execute([cp.asarray(x)])
e = np.exp(x.astype(np.float64))
err = float(np.abs(cp.asnumpy(y) - e / e.sum(axis=1, keepdims=True)).max())
print(json.dumps({{"compiles": executor.compile_count(), "err": err}}))
"""


def _run_child(code: str, cache: Path) -> dict:
    env = dict(os.environ, KILN_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", code.format(tests=str(HERE))], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mtimes(cache: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("*.cubin")}


def test_second_process_reads_cubins_from_disk_without_compiling(tmp_path: Path) -> None:
    from kiln.runtime import nvrtc

    if not nvrtc.nvrtc_available():
        pytest.skip("NVRTC (cuda-bindings, nvidia-cuda-nvrtc) is not installed")
    first = _run_child(_CPU_CHILD, tmp_path)
    assert first["compiles"] == 3 and len(set(first["keys"])) == 3
    files = _mtimes(tmp_path)
    assert sorted(files) == sorted(f"{k}.cubin" for k in first["keys"])
    second = _run_child(_CPU_CHILD, tmp_path)
    assert second == {"compiles": 0, "keys": first["keys"]}
    assert _mtimes(tmp_path) == files, "no CUBIN was rewritten"
    # A cache entry that is not a CUBIN is compiled again, not loaded.
    victim = tmp_path / f"{first['keys'][1]}.cubin"
    victim.write_bytes(b"not an ELF file")
    third = _run_child(_CPU_CHILD, tmp_path)
    assert third["compiles"] == 1
    whole = victim.read_bytes()
    assert whole.startswith(b"\x7fELF")
    # Nor is one cut short: an ELF header whose section table lies past the file's end.
    victim.write_bytes(whole[:64])
    fourth = _run_child(_CPU_CHILD, tmp_path)
    assert fourth["compiles"] == 1
    assert victim.read_bytes() == whole


@pytest.mark.gpu
def test_gpu_second_process_runs_from_the_disk_cache(tmp_path: Path) -> None:
    cupy_or_skip()
    first = _run_child(_GPU_CHILD, tmp_path)
    assert first["compiles"] == 3 and first["err"] < 1e-6
    files = _mtimes(tmp_path)
    second = _run_child(_GPU_CHILD, tmp_path)
    assert second["compiles"] == 0 and second["err"] < 1e-6
    assert _mtimes(tmp_path) == files
    np.testing.assert_array_less([first["err"], second["err"]], 1e-6)


@pytest.mark.gpu
def test_gpu_a_cached_cubin_the_driver_refuses_is_compiled_again(tmp_path: Path) -> None:
    # A whole-looking ELF file whose contents are damaged: the load fails, the kernel is
    # compiled again, the file replaced, and the fusion runs.
    cupy_or_skip()
    first = _run_child(_GPU_CHILD, tmp_path)
    victims = sorted(tmp_path.glob("*.cubin"))
    good = {v: v.read_bytes() for v in victims}
    for v in victims:
        data = bytearray(good[v])
        data[64:] = bytes(len(data) - 64)
        v.write_bytes(bytes(data))
    second = _run_child(_GPU_CHILD, tmp_path)
    assert second["compiles"] == first["compiles"] and second["err"] < 1e-6
    assert {v: v.read_bytes() for v in victims} == good


def _two_sources() -> list:
    sys.path.insert(0, str(HERE))
    from test_host import three_segment_chain

    low = three_segment_chain().lower([np.zeros((8, 300), np.float32)])
    return [k.cuda_source_for(False) for k in low.kernels][:2]


def test_the_runtime_header_is_precompiled_once_and_the_cubins_are_the_same(tmp_path: Path) -> None:
    rt = pytest.importorskip("kiln.runtime.nvrtc")
    if not rt.nvrtc_available():
        pytest.skip("NVRTC wheels not installed")
    first, second = _two_sources()
    plain = [rt.compile_cubin(s, "kiln_kernel.cu").cubin for s in (first, second)]
    pch = str(tmp_path / "pch")
    made = rt.compile_cubin(first, "kiln_kernel.cu", pch_dir=pch)
    assert "creating precompiled header" in made.log
    (file,) = list((tmp_path / "pch").iterdir())  # renamed into place: no temporary left
    assert file.suffix == ".pch"
    used = rt.compile_cubin(second, "kiln_kernel.cu", pch_dir=pch)
    assert "using precompiled header" in used.log
    assert [made.cubin, used.cubin] == plain
    # A changed header is another file: NVRTC does not notice that an in-memory header
    # changed, so the file name carries the header's hash.
    end = second.index("#endif  // KILN_RUNTIME_CUH")
    changed = second[:end] + "#define KILN_TEST_CHANGED 1\n" + second[end:]
    assert "creating precompiled header" in rt.compile_cubin(changed, "kiln_kernel.cu", pch_dir=pch).log
    assert len(list((tmp_path / "pch").iterdir())) == 2
    # A damaged file is not used, and the compile still gives the same CUBIN.
    file.write_bytes(b"not a precompiled header")
    again = rt.compile_cubin(second, "kiln_kernel.cu", pch_dir=pch)
    assert "using precompiled header" not in again.log and again.cubin == plain[1]
