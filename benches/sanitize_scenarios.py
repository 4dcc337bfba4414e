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
    return bad + auto_schedules()


def auto_schedules() -> int:
    """Every automatic scheduler on a few shapes (unscheduled fusions, as users run them)."""
    import test_auto  # noqa: PLC0415

    bad = 0
    builders = [*test_auto.BUILDERS, test_auto.softmax, test_auto.layernorm]
    for build in builders:
        for m, n in [(33, 1000), (64, 4096), (130, 70)]:
            fd, ref = build()
            norm = build in (test_auto.softmax, test_auto.layernorm)
            arrays = (test_auto.norm_inputs if norm else test_auto.make_inputs)(build, m, n, cp)
            name = f"auto {build.__name__} {m}x{n}"
            try:
                outs = fd.execute(arrays)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name:32s} ERROR {e}")
                bad += 1
                continue
            want = ref(*[a if isinstance(a, float) else cp.asnumpy(a).astype(np.float64) for a in arrays])
            ok = all(np.allclose(cp.asnumpy(o), w, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(w).max())))
                     for o, w in zip(outs, want))
            bad += not ok
            print(f"{name:32s} {'ok' if ok else 'MISMATCH'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
