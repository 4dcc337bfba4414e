"""Run every GPU scenario once (for compute-sanitizer memcheck / racecheck) and check results."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import cupy as cp  # noqa: E402
import scenarios  # noqa: E402


def main() -> int:
    """Run all scenarios; return the number of mismatches."""
    bad = 0
    for build in scenarios.ALL:
        sc = build()
        arrays = sc.make_inputs(cp)
        try:
            outs = sc.fd.execute(arrays)
        except Exception as e:  # report and go on: the sanitizer should see every scenario
            print(f"{sc.name:32s} ERROR {e}")
            bad += 1
            continue
        refs = sc.reference([cp.asnumpy(a) for a in arrays])
        ok = all(np.allclose(cp.asnumpy(o), r, rtol=1e-5, atol=1e-4) for o, r in zip(outs, refs))
        bad += not ok
        print(f"{sc.name:32s} {'ok' if ok else 'MISMATCH'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
