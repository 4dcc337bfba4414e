"""Text dumps: ``str(fd)`` (the fusion math), ``t.print_transforms()`` and the
``KILN_DUMP=fusion`` environment switch.  Only robust facts are checked: tensor names,
op names, section headers, transform lines and extents."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from kiln import DataType, FusionDefinition


def names_in(text: str) -> set[str]:
    """Tensor names ``T<n>`` mentioned in ``text``."""
    return set(re.findall(r"(?<![A-Za-z0-9])(T\d+)", text))


def canonical() -> tuple[FusionDefinition, list[Any]]:
    """The DESIGN.md example: T0, T1 -> broadcast T2 -> add T3 -> sum T4 (output)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], dtype=DataType.Float, contiguity=[True])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        y = fd.ops.add(x, bb)
        r = fd.ops.sum(y, dims=[1], keepdim=False)
        fd.add_output(r)
    return fd, [x, b, bb, y, r]


# --------------------------------------------------------------------------------------
# str(fd)
# --------------------------------------------------------------------------------------


def test_str_fd_names_every_tensor_and_headers() -> None:
    fd, tensors = canonical()
    text = str(fd)
    assert isinstance(text, str)
    assert names_in(text) == {"T0", "T1", "T2", "T3", "T4"}
    assert [t.name for t in tensors] == ["T0", "T1", "T2", "T3", "T4"]
    assert "Inputs" in text and "Outputs" in text
    assert text.index("Inputs") < text.index("Outputs")
    assert "broadcast" in text.lower()


def test_str_fd_inputs_and_outputs_sections() -> None:
    fd, _ = canonical()
    text = str(fd)
    start, end = text.index("Inputs"), text.index("Outputs")
    inputs = text[start:end]
    # Both fusion inputs are listed in the Inputs section, the output is not.
    assert {"T0", "T1"} <= names_in(inputs)
    assert "T4" not in names_in(inputs)
    assert "T4" in names_in(text[end:])


def test_str_fd_reduction_marker() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        r = fd.ops.sum(x, dims=[0])
        fd.add_output(r)
    text = str(fd)
    assert names_in(text) == {"T0", "T1"}
    assert "sum" in text.lower() or "add" in text.lower()


@pytest.mark.parametrize("op", ["exp", "sqrt", "tanh", "sigmoid", "where", "permute"])
def test_str_fd_op_names(op: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=DataType.Float)
        if op == "where":
            c = fd.ops.gt(x, 0.0)
            y = fd.ops.where(c, x, 1.0)
        elif op == "permute":
            y = fd.ops.permute(x, dims=[1, 0])
        else:
            y = getattr(fd.ops, op)(x)
        fd.add_output(y)
    text = str(fd)
    assert op in text.lower()
    assert y.name in names_in(text)


def test_str_fd_index_select_and_full() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=DataType.Half)
        idx = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        g = fd.ops.index_select(x, idx, 0)
        f = fd.ops.full([4], 1.0, DataType.Half)
        bf = fd.ops.broadcast_in_dim(f, shape=[-1, 4], broadcast_dims=[1])
        y = fd.ops.mul(g, bf)
        fd.add_output(y)
    text = str(fd)
    assert names_in(text) == {"T0", "T1", "T2", "T3", "T4", "T5"}
    assert "index_select" in text.lower()
    assert "full" in text.lower()


def test_str_fd_after_scheduling_shows_caches() -> None:
    fd, tensors = canonical()
    c = tensors[0].cache_after()
    tensors[4].split(0, 128)
    text = str(fd)
    assert c.name == "T5"
    assert names_in(text) == {"T0", "T1", "T2", "T3", "T4", "T5"}
    assert "Inputs" in text and "Outputs" in text


def test_str_fd_is_stable() -> None:
    fd, _ = canonical()
    assert str(fd) == str(fd)


# --------------------------------------------------------------------------------------
# print_transforms
# --------------------------------------------------------------------------------------


def test_print_transforms_split(chain: Any, capfd: pytest.CaptureFixture[str]) -> None:
    y = chain.y
    y.split(1, 128)
    text = y.print_transforms()
    assert isinstance(text, str)
    assert "logical domain" in text
    assert "loop domain" in text
    assert "Split" in text
    assert "ceilDiv(" in text and "128" in text
    assert "Merge" not in text
    logical, split = text.index("logical domain"), text.index("Split")
    assert logical < split < text.index("loop domain")
    loop_at = text.index("loop domain")
    loop_part = text[loop_at:]
    assert "ceilDiv(" in loop_part and "128" in loop_part
    # It is printed as well as returned.
    out = capfd.readouterr().out
    assert "Split" in out and "ceilDiv(" in out and "loop domain" in out


def test_print_transforms_merge(static_chain: Any) -> None:
    z = static_chain.z
    z.merge(0, 1)
    text = z.print_transforms()
    assert "Merge" in text
    assert "Split" not in text
    loop_at = text.index("loop domain")
    assert "32" in text[loop_at:]


def test_print_transforms_one_line_per_transform(chain: Any) -> None:
    z = chain.z
    z.split(1, 128)
    z.split(0, 2)
    z.merge(0, 1)
    text = z.print_transforms()
    lines = text.splitlines()
    assert len([ln for ln in lines if "Split" in ln]) == 2
    assert len([ln for ln in lines if "Merge" in ln]) == 1


def test_print_transforms_untransformed(chain: Any) -> None:
    text = chain.x.print_transforms()
    assert "logical domain" in text and "loop domain" in text
    assert "Split" not in text and "Merge" not in text
    assert "ceilDiv" not in text


def test_print_transforms_reduction(reduction: Any) -> None:
    r = reduction.r
    r.split(1, 32)
    text = r.print_transforms()
    assert "Split" in text and "32" in text and "ceilDiv(" in text


# --------------------------------------------------------------------------------------
# KILN_DUMP
# --------------------------------------------------------------------------------------


def test_kiln_dump_fusion_prints_on_exit(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KILN_DUMP", "fusion")
    capfd.readouterr()
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        y = fd.ops.exp(x)
        fd.add_output(y)
        # Nothing is printed before the block exits.
        assert capfd.readouterr().out == ""
    out = capfd.readouterr().out
    assert str(fd).strip() in out
    assert {"T0", "T1"} <= names_in(out)
    assert "Inputs" in out and "Outputs" in out


def test_kiln_dump_fusion_canonical(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KILN_DUMP", "fusion")
    capfd.readouterr()
    fd, _ = canonical()
    out = capfd.readouterr().out
    assert str(fd).strip() in out
    assert "broadcast" in out.lower()
    assert out.count(str(fd).strip()) == 1


def test_kiln_dump_cuda_prints_each_generated_kernel_once(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KILN_DUMP", "cuda")
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        y = fd.ops.exp(x)
        fd.add_output(y)
    (k,) = fd.lower([np.zeros((4, 8), np.float32)]).kernels
    capfd.readouterr()
    src = k.cuda_source
    assert k.cuda_source == src  # cached: printed once
    out = capfd.readouterr().out
    assert out.count(f'extern "C" __global__ void {k.kernel_name}(') == 1, out
    assert "64-bit indexing" in out
    # The kernel, not the runtime header in front of it.
    body = src[src.index('extern "C" __global__'):]
    assert body.strip() in out
    assert "KILN_RUNTIME_CUH" not in out and "namespace kiln {" not in out


def test_no_dump_without_env(capfd: pytest.CaptureFixture[str]) -> None:
    capfd.readouterr()
    canonical()
    captured = capfd.readouterr()
    assert captured.out == ""
    assert "Inputs" not in captured.err
