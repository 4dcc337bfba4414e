"""Helpers for tests that run families of tests/families.py and compare with their NumPy
references."""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import pytest
from families import Family, output_f64


def family_inputs(fam: Family) -> List[Any]:
    """The family's NumPy inputs; skips the test where bfloat16 arrays need ml_dtypes."""
    if "BFloat16" in fam.dtypes:
        pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 arrays need ml_dtypes")
    return fam.inputs()


def array_shapes(inputs: Sequence[Any]) -> List[List[int]]:
    """The shapes of the array inputs (what `auto_program` takes)."""
    return [list(np.shape(a)) for a in inputs if isinstance(a, np.ndarray)]


def check_outputs(fam: Family, outs: Sequence[Any], wants: Sequence[np.ndarray]) -> None:
    """Assert each output matches its float64 reference within the family's tolerance."""
    assert len(outs) == len(wants)
    for i, (out, want) in enumerate(zip(outs, wants)):
        got = output_f64(out)
        assert got.shape == want.shape, f"{fam.name} output {i}: shape {got.shape}, expected {want.shape}"
        rtol, atol = fam.tol(i)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{fam.name} output {i}")
