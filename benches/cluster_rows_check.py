"""Normalizations whose rows are split over a thread-block cluster (the Shared-persistent
schedule's clusters, each block's part filled by one bulk copy) on the GPU against float64
NumPy: nine model families (two with two row inputs, streamed at 131136) at float rows of
40000 to 131136 and half/bfloat16 rows of 65536 and 131136 columns. Small enough to run under
compute-sanitizer, from the repository root::

    compute-sanitizer --tool racecheck python3 benches/cluster_rows_check.py
    compute-sanitizer --tool synccheck python3 benches/cluster_rows_check.py
    compute-sanitizer --tool memcheck python3 benches/cluster_rows_check.py

Prints one line per case and the number of mismatches last.
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, 'tests')
from families import SPECS, output_f64  # noqa: E402

B = {s.name: s.build for s in SPECS}
bad = 0
NAMES = ["softmax_long_rows", "log_softmax", "layernorm", "rmsnorm_t5", "layernorm_bf16",
         "rmsnorm_llama_half", "layernorm_half", "bert_residual_layernorm", "softmax_backward"]
for name in NAMES:
    for sizes in [(3, 40000), (2, 65536), (2, 131072 + 64)]:
        fam = B[name](sizes)
        ins = fam.inputs()
        shapes = [list(np.shape(a)) for a in ins if isinstance(a, np.ndarray)]
        a = fam.fd._core.auto_program(shapes)
        dev = [cp.asarray(x) if isinstance(x, np.ndarray) else x for x in ins]
        outs = fam.fd.execute(dev)
        wants = fam.expected(ins)
        ok = True
        for i, (o, w) in enumerate(zip(outs, wants)):
            rtol, atol = fam.tol(i)
            try:
                np.testing.assert_allclose(output_f64(cp.asnumpy(o)), w, rtol=rtol, atol=atol)
            except AssertionError as e:
                ok = False
                print(str(e)[:300])
        bad += not ok
        print(name, sizes, a.heuristic, list(a.params)[:5], "ok" if ok else "MISMATCH", flush=True)
print("mismatches", bad)
