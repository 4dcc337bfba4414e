"""kiln's public API is typed for its users: ``mypy --strict`` accepts a small user program
and rejects a misuse of a kiln type in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "user_code" / "user_script.py"


def _mypy(path: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(path)],
                          capture_output=True, text=True, check=False)


def test_user_script_type_checks() -> None:
    r = _mypy(SCRIPT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_misused_kiln_type_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad_user.py"
    bad.write_text(SCRIPT.read_text().replace("kernels: int = len(low.kernels)",
                                              "kernels: str = low.kernels"))
    r = _mypy(bad)
    named = "List[LoweredKernel]" in r.stdout or "list[LoweredKernel]" in r.stdout
    assert r.returncode == 1 and named, r.stdout
