"""Shared fixtures for the fusion-definition, error and dump suites (CPU only)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from kiln import DataType, FusionDefinition

# Property tests draw the same examples on every run (CI must not pass or fail by luck);
# HYPOTHESIS_PROFILE=explore draws fresh ones.
settings.register_profile("kiln", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kiln"))


@dataclass
class Chain:
    """``x`` (T0, input) -> ``y = exp(x)`` (T1) -> ``z = neg(y)`` (T2, output)."""

    fd: FusionDefinition
    x: Any
    y: Any
    z: Any


@dataclass
class Reduction:
    """``x`` (T0, input) -> ``r = sum(x, dims=[1])`` (T1) -> ``out = neg(r)`` (T2)."""

    fd: FusionDefinition
    x: Any
    r: Any
    out: Any


def build_chain(shape: Sequence[int], dtype: Any = DataType.Float) -> Chain:
    """Build (and close) the three-tensor pointwise chain on an input of ``shape``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=list(shape), dtype=dtype)
        y = fd.ops.exp(x)
        z = fd.ops.neg(y)
        fd.add_output(z)
    return Chain(fd, x, y, z)


@pytest.fixture(autouse=True)
def _no_dump_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests must not depend on a KILN_DUMP set in the caller's environment."""
    monkeypatch.delenv("KILN_DUMP", raising=False)


@pytest.fixture
def make_chain() -> Callable[..., Chain]:
    """Factory: ``make_chain([4, 8], DataType.Half)``."""
    return build_chain


@pytest.fixture
def chain() -> Chain:
    """Symbolic 2-D pointwise chain: T0[-1, -1] -> T1 -> T2 (all Float)."""
    return build_chain([-1, -1])


@pytest.fixture
def static_chain() -> Chain:
    """Static 2-D pointwise chain: T0[4, 8] -> T1 -> T2 (all Float)."""
    return build_chain([4, 8])


@pytest.fixture
def reduction() -> Reduction:
    """T0[-1, -1] -> T1 = sum(T0, dims=[1]) -> T2 = neg(T1), output T2."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        r = fd.ops.sum(x, dims=[1], keepdim=False)
        out = fd.ops.neg(r)
        fd.add_output(out)
    return Reduction(fd, x, r, out)


# -- every kernel the suite generates compiles with NVRTC (sm_90), without spills --------
_COMPILED: dict = {}
# The runtime header precompiled once per test process (each compile then skips parsing it).
_PCH_DIR = tempfile.TemporaryDirectory(prefix="kiln-test-pch-")


def pytest_configure(config: pytest.Config) -> None:
    """Keep the kernels each test lowers, for the NVRTC check below; verify the kernel IR
    after every lowering pass."""
    from kiln.lowering import record_generated

    record_generated(True)
    os.environ.setdefault("KILN_VERIFY", "1")


def _nvrtc_ready() -> bool:
    try:
        from kiln.runtime.nvrtc import nvrtc_available

        return nvrtc_available()
    except Exception:
        return False


@pytest.fixture(autouse=True)
def _compile_generated_kernels(request: pytest.FixtureRequest):
    """After each test, compile each kernel it lowered; a compile error or spill fails it
    (a spill only without the ``may_spill`` marker: random hand schedules may ask for Local
    arrays larger than the registers hold, which is the schedule's cost, not a defect)."""
    from kiln import KilnError
    from kiln.lowering import take_generated

    take_generated()
    yield
    kernels = take_generated()
    if not kernels or not _nvrtc_ready():
        return
    from kiln.runtime.executor import uses_tensor_memory
    from kiln.runtime.nvrtc import compile_cubin

    for k in kernels:
        for index32 in (False, True):
            try:
                src = k.cuda_source_for(index32)
            except KilnError:
                break  # codegen refused the schedule with a user-facing error: nothing to compile
            # Tensor-memory kernels are compiled for Blackwell (sm_100a), the rest for sm_90.
            arch = "sm_100a" if uses_tensor_memory(src) else "sm_90"
            if src not in _COMPILED:
                _COMPILED[src] = compile_cubin(src, k.kernel_name, arch=arch, pch_dir=_PCH_DIR.name)
            res = _COMPILED[src]
            spills = {n: s for n, s in res.spills.items() if s}
            assert not spills or request.node.get_closest_marker("may_spill"), \
                f"kernel spills registers: {spills}\n{res.log}"
            # A block needing more registers than a block may have is compiled again with a
            # register cap at launch (runtime.executor.load_module): that compile must work.
            block = k.launch["block"]
            if all(str(d).isdigit() for d in block):
                threads = int(block[0]) * int(block[1]) * int(block[2])
                if res.registers.get(k.kernel_name, 0) * threads > 65536:
                    cap = max(16, 65536 // threads // 8 * 8)
                    compile_cubin(src, k.kernel_name, arch=arch, extra_options=[f"--maxrregcount={cap}"],
                                  pch_dir=_PCH_DIR.name)
