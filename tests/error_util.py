"""Helpers shared by the bad-input and misuse tests: regexes of how messages name tensors,
axes and inputs, the KilnError check, float64 comparisons, and a child interpreter for
inputs that might crash the process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kiln import KilnError


def tv(n: int) -> str:
    """Regex of tensor ``T{n}`` (not matched by ``T{n}0``)."""
    return rf"(?<![A-Za-z0-9])T{n}(?!\d)"


def ax(k: int) -> str:
    """Regex of ``axis {k}``."""
    return rf"\baxis {k}(?!\d)"


def inp(i: int, t: int) -> str:
    """Regex of how a message names fusion input ``i`` (tensor ``T{t}``)."""
    return rf"input {i} \(T{t}\)"


def expect(fn: Callable[[], Any], exc: type[KilnError], *patterns: str) -> str:
    """``fn()`` raises a KilnError of type ``exc`` whose message matches every pattern."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type is what is checked
        assert isinstance(err, KilnError), (
            f"not a KilnError: {type(err).__module__}.{type(err).__name__}: {err}"
        )
        assert isinstance(err, exc), f"expected {exc.__name__}, got {type(err).__name__}: {err}"
        msg = str(err)
        for p in patterns:
            assert re.search(p, msg, re.S), f"{p!r} not found in: {msg!r}"
        return msg
    pytest.fail(f"no error raised; expected {exc.__name__} matching {patterns}")


def close(got: Any, want: Any, rtol: float = 1e-5) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-6, equal_nan=True
    )


def rnd(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(-1, 1, shape).astype(np.float32)


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


CHILD_PRELUDE = """
import numpy as np
import kiln
from kiln import DataType, FusionDefinition, KilnError, ParallelType
F = DataType.Float
"""


def run_child(body: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter (a crash fails one test, not the run)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = CHILD_PRELUDE + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish within {timeout} s (a hang)")
