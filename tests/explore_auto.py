"""Explore kiln's automatic schedule path with fresh random fusions (not a pytest module).

    python tests/explore_auto.py [M] [--seed S] [--shrink BUDGET] [--groups K] [--out PATH]
                                 [--contiguous] [--gpu] [--seconds T]

draws M cases (default 2000) with the generator of tests/test_auto_random.py from a fresh
seed (printed, so a run can be repeated with --seed), runs each through ``fd.execute`` on the
automatic path, and prints counts per category (ok, mismatch, internal, memfault, refused) and,
per non-ok category, the distinct failure messages (tensor names and numbers stripped) with
their counts and, for the K most frequent, the smallest example (greedily shrunk while the same
message persists, BUDGET runs each) as a runnable Python repro. The report is also written to
/tmp/auto_random_report.txt (--out). With --gpu the cases run on the GPU (CuPy inputs of the
same strides) instead of in the interpreter.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_auto_random as gen  # noqa: E402 - the generator lives next to this script


def main(argv: list) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("m", nargs="?", type=int, default=2000, help="number of examples (default 2000)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: fresh)")
    p.add_argument("--shrink", type=int, default=200, help="runs spent shrinking each repro (0: none)")
    p.add_argument("--groups", type=int, default=10, help="repros per category")
    p.add_argument("--out", default="/tmp/auto_random_report.txt")
    p.add_argument("--contiguous", action="store_true",
                   help="only C-contiguous inputs (hides the failures of strided ones, shows the rest)")
    p.add_argument("--gpu", action="store_true",
                   help="run on the GPU (CuPy inputs) instead of the interpreter")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop drawing examples after this many seconds (the report covers those run)")
    p.add_argument("--max-elements", type=int, default=None,
                   help="largest input size in elements (default 4096); larger sizes are drawn too")
    args = p.parse_args(argv)
    if args.max_elements:
        gen.set_max_elements(args.max_elements)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(6), "little")
    rng = random.Random(seed)
    results = []
    harness: Counter = Counter()
    harness_example = {}
    t0 = time.time()
    drawn = 0
    for i in range(args.m):
        if args.seconds is not None and time.time() - t0 > args.seconds:
            break
        drawn += 1
        case = gen.gen_case(gen.RandomDraw(rng))
        if args.contiguous:
            case.fulls = [(dt, "contig") for dt, _ in case.fulls]
        try:
            outcome = gen.run_case(case, gpu=args.gpu)
        except Exception as e:  # noqa: BLE001 - a bug of the harness itself: count it, go on
            key = f"{type(e).__name__}: {gen.normalize(str(e))}"
            harness[key] += 1
            harness_example.setdefault(key, (case, traceback.format_exc()))
            continue
        results.append((case, outcome))
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} examples, {time.time() - t0:.0f} s", file=sys.stderr)
    elapsed = time.time() - t0
    head = [f"kiln automatic-path exploration: seed {seed}, {drawn} examples in {elapsed:.1f} s "
            f"(repeat: python tests/explore_auto.py {drawn} --seed {seed}"
            f"{' --contiguous' if args.contiguous else ''}{' --gpu' if args.gpu else ''})"]
    kernels = Counter(o.kernels for _, o in results if o.category == "ok")
    head.append("kernels per ok example: " + ", ".join(f"{k}: {v}" for k, v in sorted(kernels.items())))
    if harness:
        head.append(f"HARNESS ERRORS (bugs of the test generator, not of kiln): {sum(harness.values())}")
        for key, n in harness.most_common():
            case, tb = harness_example[key]
            head.append(f"  {n:4d}  {key}\n{tb}\n# case: {case!r}")
    summary = gen.summarize(results, shrink_budget=args.shrink, max_groups=args.groups)
    report = "\n".join(head) + "\n" + summary
    print(report)
    with open(args.out, "w") as f:
        f.write(report + "\n")
    print(f"\n(report written to {args.out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
