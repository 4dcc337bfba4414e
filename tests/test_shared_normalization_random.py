"""Random fusions through the Shared-persistent normalization schedule (``shared_normalization``).

The rows the random generators draw are short enough for registers, so the register-persistent
``normalization`` scheduler takes nearly all of them. ``KILN_ROWS_IN_SHARED=1`` makes it step
aside: every normalization over the trailing axes whose inputs fit in Shared memory then goes
through ``shared_normalization``. kiln reads the variable once per process, so the checks run in a
child process (``sys.executable -m pytest`` on this file's two inner tests, the variable set):

- ``KILN_SHARED_NORM_EXAMPLES`` (default 60) normalizations from the generator of
  tests/test_normalization_random.py (softmax, log-softmax, LayerNorm, RMSNorm; ranks 2-4;
  keepdim or rank-reduced statistics; weights over the kept or the reduced axes; statistics
  and a mean over the rows as extra outputs) with the reduced axes moved to the end of the
  shape, each through that module's ``check``: the automatic schedule in the CPU interpreter
  (which checks every memory access, Shared races included) against float64 NumPy, in one
  kernel;
- the fusions among ``KILN_SHARED_AUTO_DRAWS`` (default 2000) of the generator of
  tests/test_auto_random.py (element-wise chains over every op, casts, half and double
  inputs, strided layouts, gathers, shape ops; seed ``KILN_SHARED_AUTO_SEED``, default 0)
  that get a ``shared_normalization`` kernel, each classified by that module's ``run_case``:
  no mismatch, internal error or memory fault.

conftest verifies the kernel IR after each lowering pass and compiles the kernels with NVRTC
where it is installed. The inner tests record the schedulers their cases got; the outer test
asserts that the child passed and that its cases were really scheduled by
``shared_normalization`` (a refusal falls back to another scheduler silently). The
normalizations are drawn with the suite's hypothesis profile: derandomized in CI, fresh with
``HYPOTHESIS_PROFILE=explore``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_auto_random as fusions  # noqa: E402 - the generators live next to this file
import test_normalization_random as norm  # noqa: E402

N_EXAMPLES = int(os.environ.get("KILN_SHARED_NORM_EXAMPLES", "60"))
AUTO_DRAWS = int(os.environ.get("KILN_SHARED_AUTO_DRAWS", "2000"))
AUTO_SEED = int(os.environ.get("KILN_SHARED_AUTO_SEED", "0"))
# The folder where the inner tests write the schedulers their cases got (set by the outer test).
REPORT_ENV = "KILN_SHARED_NORM_REPORT"
# Most normalizations drawn must be scheduled by shared_normalization (each reduces the
# trailing axes of dense inputs; a mean over the rows may take a kernel of its own).
MIN_SHARED_FRACTION = 0.8
# Of the default 2000 draws (seed 0), 17 fusions get a shared_normalization kernel; far
# fewer means the scheduler refuses fusions it took.
MIN_AUTO_SHARED = 10
INNER = ["test_random_trailing_normalizations_in_shared_memory",
         "test_random_fusions_with_rows_in_shared_memory"]


def _trailing(case: norm.Case) -> norm.Case:
    """``case`` reducing as many axes, moved to the end of the shape (at least one kept)."""
    rank = len(case.shape)
    k = min(len(case.dims), rank - 1)
    return dataclasses.replace(case, dims=tuple(range(rank - k, rank)))


def _splits_in_two(case: norm.Case) -> bool:
    """A known limitation of every row schedule (``normalization``, ``looped_normalization``
    and ``shared_normalization`` alike, with or without ``KILN_ROWS_IN_SHARED``): a keepdim
    statistic as an output, a weight over the reduced axes and a kept axis of size one among
    several ("cannot promote loop axis 0 of T11: it is one loop with T7 axis 0 (... {i0 * 2}),
    but T11 axis 0 iterates ... {2} there") take two kernels instead of one. Left out here."""
    kept = case.shape[:len(case.shape) - len(case.dims)]
    return case.keepdim and case.weight == "reduced" and case.stat_output and len(kept) > 1 and 1 in kept


def trailing_cases() -> st.SearchStrategy[norm.Case]:
    """The normalization generator's cases over trailing axes: rank 2 or more, and not its
    rows too long for Shared memory (those stream through ``looped_normalization``)."""
    return (norm.cases()
            .filter(lambda c: len(c.shape) > 1 and math.prod(c.shape) <= norm.MAX_ELEMENTS)
            .map(_trailing)
            .filter(lambda c: not _splits_in_two(c)))


def kernel_schedulers(program: Any) -> List[str]:
    """The scheduler of each kernel of a host program the automatic path made."""
    return re.findall(r"segment \d+: (\w+)\[", str(program.segmentation()))


def _rows_in_shared() -> bool:
    """Whether this process runs with ``KILN_ROWS_IN_SHARED`` on (a short softmax then goes
    through ``shared_normalization``, not the register-persistent schedule)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1])
        e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, dims=[1], keepdim=True)))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, dims=[1], keepdim=True)))
    return fd._core.auto_program([[4, 64]]).heuristic == "shared_normalization"


def _inner_only() -> None:
    if not _rows_in_shared():
        pytest.skip("needs KILN_ROWS_IN_SHARED=1 before kiln loads (run in a child process by "
                    "test_random_fusions_match_numpy_with_rows_in_shared_memory)")


def _write_report(name: str, seen: List[Dict[str, Any]]) -> None:
    folder = os.environ.get(REPORT_ENV)
    if folder:
        (Path(folder) / f"{name}.json").write_text(json.dumps(seen))


def test_random_trailing_normalizations_in_shared_memory() -> None:
    """(Inner: runs in the child process of the last test.)"""
    _inner_only()
    seen: List[Dict[str, Any]] = []

    @settings(max_examples=N_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(trailing_cases())
    def body(case: norm.Case) -> None:
        fd, _, inputs = norm.build(case)
        auto = fd._core.auto_program([list(a.shape) for a in inputs])
        norm.check(case)
        seen.append({"case": repr(case), "schedulers": kernel_schedulers(auto.program)})

    body()
    _write_report("normalizations", seen)


def test_random_fusions_with_rows_in_shared_memory() -> None:
    """(Inner: runs in the child process of the last test.)"""
    _inner_only()
    from kiln.lowering import take_generated

    rng = random.Random(AUTO_SEED)
    picked = []
    for _ in range(AUTO_DRAWS):
        case = fusions.gen_case(fusions.RandomDraw(rng))
        try:
            prog = fusions.build(case)
            kinds = kernel_schedulers(prog.fd.lower(prog.inputs).program)
        except Exception as e:  # noqa: BLE001 - a crash is run below, where run_case reports it
            if fusions.classify_error(e) == "refused":
                continue  # kiln declines the definition or the fusion: the auto-random test's business
            kinds = ["crashed"]
        if "shared_normalization" in kinds or kinds == ["crashed"]:
            picked.append((case, kinds))
    take_generated()  # conftest compiles the kernels of the cases run below, not of every draw
    seen: List[Dict[str, Any]] = []
    results = []
    for case, kinds in picked:
        outcome = fusions.run_case(case)
        results.append((case, outcome))
        seen.append({"case": repr(case), "schedulers": kinds, "category": outcome.category})
    _write_report("fusions", seen)
    bad = [(c, o) for c, o in results if o.category in ("mismatch", "internal", "memfault")]
    if bad:
        pytest.fail(f"{len(bad)} of {len(results)} fusions failed\n"
                    + fusions.summarize(bad, shrink_budget=60), pytrace=False)


def test_random_fusions_match_numpy_with_rows_in_shared_memory(tmp_path: Path) -> None:
    if _rows_in_shared():
        pytest.skip("KILN_ROWS_IN_SHARED=1 is on here: the inner tests run in this process")
    env = dict(os.environ, KILN_ROWS_IN_SHARED="1", **{REPORT_ENV: str(tmp_path)})
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider"]
    cmd += [f"{__file__}::{t}" for t in INNER]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = (run.stdout + run.stderr)[-8000:]
    assert run.returncode == 0, f"the child run failed ({run.returncode}):\n{out}"
    reports = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(reports) == ["fusions", "normalizations"], f"the child skipped a test:\n{out}"

    def others(seen: List[Dict[str, Any]]) -> str:
        return "\n".join(f"  {s['schedulers']} {s['case']}" for s in seen
                         if "shared_normalization" not in s["schedulers"])

    seen = reports["normalizations"]
    kinds = Counter(k for s in seen for k in set(s["schedulers"]))
    shared = kinds["shared_normalization"]
    assert seen and shared >= MIN_SHARED_FRACTION * len(seen), (
        f"{shared} of {len(seen)} normalizations got a shared_normalization kernel ({dict(kinds)}):\n"
        + others(seen))
    seen = reports["fusions"]
    shared = sum("shared_normalization" in s["schedulers"] for s in seen)
    assert shared >= MIN_AUTO_SHARED, (
        f"{shared} of {AUTO_DRAWS} random fusions got a shared_normalization kernel "
        f"(expected {MIN_AUTO_SHARED} or more)\n" + others(seen))
