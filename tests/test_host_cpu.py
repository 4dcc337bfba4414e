"""The host program run on the CPU: every kernel through the interpreter, buffers from the
host program with their zero_init flags — the same program the GPU path runs."""

from __future__ import annotations

import numpy as np
import pytest
import scenarios
from kiln import DataType, FusionDefinition
from kiln.cli import build_demo, demo
from kiln.cli import reference as softmax_reference
from test_host import _chain_ref, three_segment_chain


def test_three_segment_chain_on_the_cpu():
    fd = three_segment_chain()
    x = np.random.default_rng(3).standard_normal((5, 300)).astype(np.float32)
    (out,) = fd.execute([x])  # NumPy inputs: the CPU interpreter
    np.testing.assert_allclose(out, _chain_ref(x.astype(np.float64)), rtol=1e-5, atol=1e-5)


def test_demo_program_on_the_cpu():
    fd = build_demo()
    x = np.random.default_rng(4).standard_normal((6, 250)).astype(np.float32)
    (out,) = fd.execute([x], device="cpu")
    np.testing.assert_allclose(out, softmax_reference(x), rtol=1e-5, atol=1e-7)


def test_demo_runs_through_the_interpreter_without_a_gpu(capsys):
    assert demo(rows=4, cols=130) == 0
    assert "-> OK" in capsys.readouterr().out


def test_grid_reductions_through_the_host_program_on_the_cpu():
    for build in (scenarios.h_grid_column_sum, scenarios.h_serial_grid_column_sum,
                  scenarios.h_grid_column_sum_hoisted):
        sc = build()
        arrays = sc.make_inputs(np)
        (out,) = sc.fd.execute(arrays)
        np.testing.assert_allclose(out, sc.reference(arrays)[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("build", scenarios.ALL, ids=lambda b: getattr(b, "__name__", "scenario"))
def test_every_gpu_scenario_matches_numpy_in_the_interpreter(build):
    sc = build()
    arrays = sc.make_inputs(np)
    outs = sc.fd.execute(arrays, device="cpu")
    for got, want in zip(outs, sc.reference(arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_bfloat16_numpy_inputs_run_twice() -> None:
    """A NumPy bfloat16 array has no buffer to look at: the second call keys its plan too."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1], DataType.BFloat16)
        fd.add_output(fd.ops.neg(a))
    x = np.array([1.5, -2.0, 0.25], ml_dtypes.bfloat16)
    for _ in range(2):
        (got,) = fd.execute([x])
        np.testing.assert_array_equal(np.asarray(got).astype(np.float32), [-1.5, 2.0, -0.25])
