"""The column-partials rewrite (on by default, ``KILN_COLUMN_PARTIALS=0`` turns it off): LayerNorm
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

import numpy as np
import pytest

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
        # The row's two sums run as one block reduction of a pair.
        assert "grouped with the next" in low.kernels[0].kernel_ir, low.kernels[0].kernel_ir
        assert "kiln::blockAllReduce2<" in low.kernels[0].cuda_source
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


RANDOM_CHILD = textwrap.dedent(
    """
    import random
    import numpy as np
    from kiln import FusionDefinition

    def case(seed):
        rng = random.Random(seed)
        m = rng.choice([4224, 8448, 4256])  # rows a multiple of 16, 32 or 8 in whole waves
        n = rng.choice([1, 3, 8, 33, 64, 100])
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            y = fd.define_tensor([-1, -1])
            r = fd.define_tensor([-1])
            w = fd.define_tensor([-1])
            rb = fd.ops.broadcast_in_dim(r, [fd.ops.size(x, 0), fd.ops.size(x, 1)], [0])
            wb = fd.ops.broadcast_in_dim(w, [fd.ops.size(x, 0), fd.ops.size(x, 1)], [1])
            a = fd.ops.mul(x, wb) if rng.random() < 0.7 else fd.ops.add(x, y)
            b = fd.ops.sub(y, rb) if rng.random() < 0.7 else fd.ops.exp(fd.ops.mul(y, 0.1))
            red = rng.choice(["sum", "max"])
            row = getattr(fd.ops, red)(fd.ops.mul(a, b), [1], keepdim=True)
            full = fd.ops.sub(a, fd.ops.mul(b, row))
            fd.add_output(full)
            cols = []
            for k in range(rng.randint(1, 3)):
                src = [a, b, full, fd.ops.mul(a, b)][rng.randrange(4)]
                cred = rng.choice(["sum", "sum", "max", "min"])
                fd.add_output(getattr(fd.ops, cred)(src, [0]))
                cols.append((src, cred))
        xs, ys = (np.random.default_rng(seed + i).standard_normal((m, n)).astype(np.float32) for i in (0, 1))
        rs = np.random.default_rng(seed + 2).standard_normal(m).astype(np.float32)
        ws = np.random.default_rng(seed + 3).standard_normal(n).astype(np.float32)
        return fd, [xs, ys, rs, ws]

    def numpy_ref(fd, ins, seed):
        # Recompute with the same draws in float64.
        rng = random.Random(seed)
        rng.choice([4224, 8448, 4256]); rng.choice([1, 3, 8, 33, 64, 100])
        x, y, r, w = (np.asarray(v, dtype=np.float64) for v in ins)
        rb, wb = r[:, None], w[None, :]
        a = x * wb if rng.random() < 0.7 else x + y
        b = y - rb if rng.random() < 0.7 else np.exp(y * 0.1)
        red = rng.choice(["sum", "max"])
        row = getattr(np, red)(a * b, axis=1, keepdims=True)
        full = a - b * row
        outs = [full]
        for k in range(rng.randint(1, 3)):
            src = [a, b, full, a * b][rng.randrange(4)]
            cred = rng.choice(["sum", "sum", "max", "min"])
            outs.append(getattr(np, cred)(src, axis=0))
        return outs

    fused = 0
    for seed in range({count}):
        fd, ins = case(seed)
        low = fd.lower(ins)
        fused += "column_partials[" in low.program.segmentation()
        outs = fd.execute(ins)
        refs = numpy_ref(fd, ins, seed)
        assert len(outs) == len(refs)
        for o, want in zip(outs, refs):
            assert o.shape == want.shape, (seed, o.shape, want.shape)
            scale = 1 + np.abs(want).max() + np.sqrt(ins[0].shape[0]) * 10
            err = float(np.abs(o - want).max())
            assert err <= 2e-5 * scale, (seed, err, scale)
    print("FUSED", fused)
    """
)


def test_random_row_and_column_reductions_with_partials_match_numpy() -> None:
    # Random fusions of this class: element-wise prologues of two [M, N] inputs, a per-row
    # and a per-column operand, a row reduction broadcast back, and one to three column
    # reductions (sum, max, min) of tensors before and after it.
    env = dict(os.environ, KILN_COLUMN_PARTIALS="1")
    proc = subprocess.run([sys.executable, "-c", RANDOM_CHILD.replace("{count}", "12")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fused = int(proc.stdout.split("FUSED")[-1])
    assert fused == 12, proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(4224, 256), (4224, 1000), (8448, 4096), (4256, 33), (16384, 768)])
def test_layernorm_backward_with_column_partials_on_the_gpu(m: int, n: int) -> None:
    # The partials kernel (register accumulators, inputs loaded a row ahead) on the device,
    # against NumPy in float64.
    cp = pytest.importorskip("cupy")
    sys.path.insert(0, str(HERE))
    import families

    spec = next(s for s in families.SPECS if s.name == "layernorm_backward")
    fam = spec.build((m, n))
    ins = fam.make_inputs((m, n), 0)
    assert "column_partials[" in fam.fd.lower(ins).program.segmentation()
    outs = fam.fd.execute([cp.asarray(x) for x in ins])
    refs = fam.reference(*[np.asarray(x, dtype=np.float64) for x in ins])
    for o, r in zip(outs, refs):
        o = cp.asnumpy(o)
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * (1 + np.sqrt(m)))
