"""The column-partials rewrite (``KILN_COLUMN_PARTIALS=1``, off by default): LayerNorm
backward's row reductions and column sums over the same rows, with the column sums computed
as per-block partials ``[M/S, N]`` in the row kernel and totalled by small second kernels,
checked against NumPy in float64 in the CPU interpreter. Runs in a child interpreter, since
the setting is read once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, {here!r})
    import families
    spec = next(s for s in families.SPECS if s.name == "layernorm_backward")
    for m, n in [(4224, 256), (4224, 100)]:
        fam = spec.build((m, n))
        ins = fam.make_inputs((m, n), 0)
        low = fam.fd.lower(ins)
        seg = low.program.segmentation()
        assert "column_partials" in seg, seg
        outs = fam.fd.execute(ins)
        refs = fam.reference(*[np.asarray(x, dtype=np.float64) for x in ins])
        for o, r in zip(outs, refs):
            assert o.shape == r.shape, (o.shape, r.shape)
            err = float(np.abs(o - r).max())
            assert err <= 1e-4 * (1 + float(np.abs(r).max())), (m, n, err)
        print("OK", m, n, len(low.kernels))
    """
)


def test_layernorm_backward_with_column_partials_matches_numpy() -> None:
    env = dict(os.environ, KILN_COLUMN_PARTIALS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK") == 2, proc.stdout
