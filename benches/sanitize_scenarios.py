"""Run every GPU scenario once (for compute-sanitizer memcheck / racecheck) and check results.

    compute-sanitizer --tool racecheck python3 benches/sanitize_scenarios.py [families]

``families`` runs the model families only (the quickest set of automatic schedules).
"""

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
    return bad + auto_schedules() + model_families() + circular_buffers()


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



def model_families() -> int:
    """Model families whose automatic schedules stream long rows or split reductions by
    class (one-pass statistics, unswitched inner reductions, looped normalizations), at
    sizes small enough for the sanitizer."""
    import families as fams  # noqa: PLC0415

    bad = 0
    cases = [(fams.cross_entropy, (64, 32000)), (fams.cross_entropy, (8, 128256)),
             (fams.log_softmax, (8, 128256)), (fams.logsumexp, (64, 32000)),
             (fams.layernorm_backward, (256, 1024)), (fams.batchnorm_nchw_train, (4, 8, 28, 28)),
             (fams.attention_softmax_padding_mask, (2, 2, 64)),
             # 320 groups of 2048: 256-thread blocks (one wave of them on 132 SMs).
             (fams.group_norm_nchw, (10, 64, 32, 32)),
             # Rows of [8, 64, 64] split over clusters of two, each block's part in Shared.
             (fams.group_norm_nchw, (2, 256, 64, 64)),
             # rotate_half's halves read as whole vectors or zeros.
             (fams.llama_rope_view, (2, 16, 4, 64))]
    for make, sizes in cases:
        fam = make(sizes)
        name = f"family {fam.name} {'x'.join(map(str, sizes))}"
        host = fam.make_inputs(sizes, 0)
        arrays = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in host]
        try:
            outs = fam.fd.execute(arrays)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:32s} ERROR {e}")
            bad += 1
            continue
        want = fam.expected(host)
        ok = all(np.allclose(fams.output_f64(o), w, rtol=fam.tol(i)[0], atol=fam.tol(i)[1])
                 for i, (o, w) in enumerate(zip(outs, want)))
        bad += not ok
        print(f"{name:32s} {'ok' if ok else 'MISMATCH'}")
    return bad


def circular_buffers() -> int:
    """The circular-buffer schedules (block barriers, and bulk copies with mbarriers), at
    sizes with partial tiles and rows that take the bulk copy's element-loop fallback."""
    import test_circular_buffer as cb  # noqa: PLC0415

    bad = 0
    for kind, stages, prefetch, cross in cb.GPU_CASES:
        build = cb.bulk_exp if kind == "bulk" else cb.streamed_exp
        for m, n in [(3, 33), (4, 4096), (3, 301)]:
            fd, _, _ = build(stages, prefetch, cross=cross, tile=64)
            x = cb.rand(m, n, seed=n)
            name = f"circular {kind} {stages}/{prefetch}{' cross' if cross else ''} {m}x{n}"
            got = cp.asnumpy(fd.execute([cp.asarray(x)])[0])
            ok = bool(np.allclose(got, cb.exp64(x), rtol=1e-6, atol=1e-6))
            bad += not ok
            print(f"{name:32s} {'ok' if ok else 'MISMATCH'}")
    return bad

if __name__ == "__main__":
    sys.exit(model_families() if sys.argv[1:] == ["families"] else main())
