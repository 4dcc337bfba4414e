"""Scaffolding shared by the random property tests (tests/test_manual_random.py,
tests/test_manual_reduction_random.py, tests/test_circular_buffer_random.py and, for the draws,
the CI sampling of kernels and the GPU re-run, tests/test_auto_random.py).

Each of those modules draws cases with its own ``gen_case`` from a ``RandomDraw``, runs one with
its own ``run_case`` into an outcome (a ``category``, a ``message``, a grouping ``key`` and the
``kernels`` it lowered) and prints a case as a runnable ``repro``; this module runs them: the
hypothesis collection of the CI test (``collect``, keeping the kernels of every N-th accepted
example for conftest to compile with NVRTC), the report grouped by message (``summary_lines``),
the re-run of the accepted cases on the GPU (``rerun_accepted_on_gpu``) and the explorer's
command line (``explorer_parser``, ``explore``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

CaseT = TypeVar("CaseT")  # a case: plain data that prints and reproduces
WrongT = TypeVar("WrongT")  # what a GPU re-run tells of a case that failed there


class Outcome(Protocol):
    """What a module's ``run_case`` returns: its category, message, grouping key and kernels."""

    category: str
    message: str
    key: str
    kernels: Any


OutcomeT = TypeVar("OutcomeT", bound=Outcome)
Results = List[Tuple[CaseT, OutcomeT]]


# -- drawing -----------------------------------------------------------------------------------
class RandomDraw:
    """The generators' draws, from a ``random.Random``. Hypothesis supplies the seed (so the CI
    examples are fixed by the derandomized profile), the explorer its own; drawing the structure
    through hypothesis' own strategies skews it to its minimal examples (in test_auto_random a
    third had a single op) and costs the spread of op kinds, ranks and sizes the generators are
    written for."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        """An integer in ``[lo, hi]``."""
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        """An element of ``seq`` (repeat an element to weigh it)."""
        return seq[self.rng.randrange(len(seq))]

    def bool(self, p: float = 0.5) -> bool:
        """True with probability ``p``."""
        return self.rng.random() < p


def seeded_cases(gen_case: Callable[[RandomDraw], CaseT]) -> st.SearchStrategy[CaseT]:
    """A hypothesis strategy of cases: a seed, expanded by ``gen_case``."""
    return st.integers(0, 2 ** 63 - 1).map(lambda s: gen_case(RandomDraw(random.Random(s))))


# -- the CI tests ---------------------------------------------------------------------------------
def _ok(outcome: Outcome) -> bool:
    return outcome.category == "ok"


def collect(results: Results[CaseT, OutcomeT], kept: List[Any], strategy: st.SearchStrategy[CaseT],
            run_case: Callable[[CaseT], OutcomeT], n_examples: int, compile_every: int,
            derandomized_seed: int, accepted: Callable[[OutcomeT], bool] = _ok,
            phases: Optional[Sequence[Phase]] = (Phase.generate,)) -> Results[CaseT, OutcomeT]:
    """Run ``n_examples`` cases of ``strategy`` into ``results`` (once), sampling kernels into ``kept``."""
    # The kernels of every ``compile_every``-th ``accepted`` outcome go to ``kept`` (0: none), the
    # others are dropped. Under a derandomized profile the examples come from ``derandomized_seed``,
    # each module's own: hypothesis would derive one from the source of ``body``, the same for every
    # module and changed by any edit of it. ``phases`` None: hypothesis' default phases.
    if results:
        return results
    from kiln import lowering

    n_accepted = 0

    def body(case: CaseT) -> None:
        nonlocal n_accepted
        lowering.take_generated()
        outcome = run_case(case)
        results.append((case, outcome))
        lowering.take_generated()
        if accepted(outcome):
            n_accepted += 1
            if compile_every and n_accepted % compile_every == 0:
                kept.extend(outcome.kernels)
        outcome.kernels = []

    options: Dict[str, Any] = dict(max_examples=n_examples, deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck))
    if phases is not None:
        options["phases"] = list(phases)
    profile = settings(**options)
    test = profile(given(strategy)(body))
    if profile.derandomize:
        test = seed(derandomized_seed)(test)
    test()
    return results


def hand_kept_kernels_to_conftest(kept: List[Any]) -> None:
    """Forget the kernels lowered since, and leave the sampled ``kept`` ones for conftest's NVRTC."""
    from kiln import lowering

    lowering.take_generated()
    lowering._GENERATED.extend(kept)
    kept.clear()


def rerun_accepted_on_gpu(results_of: Callable[[], Results[CaseT, OutcomeT]], limit_env: str,
                          limit_default: int, run: Callable[[Any, CaseT], Optional[WrongT]],
                          report: Callable[[CaseT, WrongT], str], accepted: Callable[[OutcomeT], bool] = _ok,
                          what: str = "accepted schedules") -> None:
    """Run the first ``accepted`` cases on the GPU with CuPy; fail with 5 reports if any went wrong."""
    # ``run(cp, case)`` tells what went wrong or None; at most env ``limit_env`` cases run. The
    # kernels were compiled for the GPU they ran on: conftest need not compile them again.
    from gpu_util import cupy_or_skip

    cp = cupy_or_skip()
    limit = int(os.environ.get(limit_env, str(limit_default)))
    bad: List[Tuple[CaseT, WrongT]] = []
    ran = 0
    for case, o in results_of():
        if not accepted(o) or ran >= limit:
            continue
        ran += 1
        wrong = run(cp, case)
        if wrong is not None:
            bad.append((case, wrong))
    from kiln.lowering import take_generated

    take_generated()
    if bad:
        pytest.fail(f"{len(bad)} of {ran} {what} differ on the GPU\n" + "\n\n".join(
            report(case, wrong) for case, wrong in bad[:5]), pytrace=False)


def _out_of_device_memory(e: Exception) -> bool:
    """Whether ``e`` says the device lacks the memory a launch needs: a random schedule's Local
    arrays, reserved by the driver for every thread the device holds, can need more than is free
    while other processes hold memory (kiln refuses those that exceed the whole device)."""
    text = str(e)
    return "CUDA_ERROR_OUT_OF_MEMORY" in text or "of Local memory per thread" in text


def gpu_mismatch(cp: Any, prog: Any, check_output: Callable[[Any, Any], Optional[str]]) -> Optional[str]:
    """Execute ``prog.fd`` on CuPy copies of ``prog.arrays``: the error, the outputs' differences or None."""
    try:
        got = prog.fd.execute([cp.asarray(a) for a in prog.arrays])
    except Exception as e:  # noqa: BLE001 - every failure on the GPU is reported
        if _out_of_device_memory(e):
            return None  # the device's resources, not a wrong answer
        return f"{type(e).__name__}: {e}"
    problems = [p for v, g in zip(prog.outputs, got) if (p := check_output(v, cp.asnumpy(g)))]
    return "; ".join(problems) if problems else None


# -- the report -------------------------------------------------------------------------------------
def summary_lines(results: Sequence[Tuple[CaseT, OutcomeT]], categories: Sequence[str],
                  case_size: Callable[[CaseT], Any], repro: Callable[[CaseT, OutcomeT], str],
                  max_groups: int = 12, refusal_rule: Optional[Callable[[str], str]] = None) -> List[str]:
    """Counts per category, then per non-ok category its messages and the smallest repro of each."""
    # ``categories[0]`` is ``ok``; outcomes are grouped by (category, key). Refusals get no repro,
    # but the distribution of the rules they come from, with ``refusal_rule``.
    counts = Counter(o.category for _, o in results)
    total = max(1, len(results))
    lines = [f"{len(results)} examples: " + ", ".join(
        f"{c} {counts.get(c, 0)} ({100.0 * counts.get(c, 0) / total:.1f}%)" for c in categories)]
    groups: Dict[Tuple[str, str], List[Tuple[CaseT, OutcomeT]]] = {}
    for case, o in results:
        if o.category != "ok":
            groups.setdefault((o.category, o.key), []).append((case, o))
    for cat in categories[1:]:
        mine = sorted(((k, v) for k, v in groups.items() if k[0] == cat), key=lambda kv: -len(kv[1]))
        if not mine:
            continue
        lines.append(f"\n=== {cat}: {counts[cat]} examples, {len(mine)} distinct messages ===")
        lines += [f"  {len(items):4d}  {key}" for (_, key), items in mine]
        if cat == "refused":
            if refusal_rule is not None:
                rules = Counter(refusal_rule(o.message) for _, o in results if o.category == "refused")
                lines.append("  by rule:")
                lines += [f"  {n:4d}  {rule}" for rule, n in rules.most_common()]
            continue
        for n, ((_, key), items) in enumerate(mine[:max_groups]):
            case, o = min(items, key=lambda co: case_size(co[0]))
            lines.append(f"\n--- {cat} #{n + 1} ({len(items)}x): {key}\n# case: {case!r}")
            lines.append(repro(case, o))
    return lines


# -- explorer --------------------------------------------------------------------------------------
def explorer_parser(description: str, default_m: int) -> argparse.ArgumentParser:
    """The explorer's command line: the number of examples, ``--seed`` and ``--groups``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("m", nargs="?", type=int, default=default_m,
                   help=f"number of examples (default {default_m})")
    p.add_argument("--seed", type=int, default=None, help="seed (default: fresh)")
    p.add_argument("--groups", type=int, default=12, help="repros per category")
    return p


def explore(args: argparse.Namespace, title: str, script: str, gen_case: Callable[[RandomDraw], CaseT],
            run_case: Callable[[CaseT], OutcomeT]) -> Results[CaseT, OutcomeT]:
    """Draw and run ``args.m`` cases from ``args.seed`` (or a fresh seed) and print a header; the results."""
    seed_ = args.seed if args.seed is not None else int.from_bytes(os.urandom(6), "little")
    rng = random.Random(seed_)
    results: Results[CaseT, OutcomeT] = []
    t0 = time.time()
    for i in range(args.m):
        case = gen_case(RandomDraw(rng))
        o = run_case(case)
        o.kernels = []
        results.append((case, o))
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} examples, {time.time() - t0:.0f} s", file=sys.stderr)
    print(f"kiln {title} exploration: seed {seed_}, {args.m} examples in {time.time() - t0:.1f} s "
          f"(repeat: python tests/{os.path.basename(script)} {args.m} --seed {seed_})")
    return results
