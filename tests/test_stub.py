"""``kiln/_core.pyi`` describes the extension module as built: every class, method, property
and function of ``kiln._core`` is in the stub, and the stub names nothing the module lacks."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

import kiln
from kiln import _core

STUB = Path(kiln.__file__).with_name("_core.pyi")


def _stub_names() -> Dict[str, Set[str]]:
    tree = ast.parse(STUB.read_text())
    names: Dict[str, Set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[""].add(node.target.id)
    return names


def test_the_stub_matches_the_extension_module():
    stub = _stub_names()
    module = {n for n in dir(_core) if not n.startswith("_")}
    classes = {n for n in module if isinstance(getattr(_core, n), type)}
    assert set(stub) - {""} == classes
    assert stub[""] == module - classes
    for cls in classes:
        runtime = {m for m in vars(getattr(_core, cls)) if not m.startswith("_")}
        declared = stub[cls] - {"__init__"}
        assert declared == runtime, (
            f"{cls}: only in the stub {declared - runtime}, only built {runtime - declared}")


def test_the_package_is_marked_typed():
    assert STUB.with_name("py.typed").is_file()
