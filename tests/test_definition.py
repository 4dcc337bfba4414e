"""Building fusions: output shapes and dtypes of every op, tensor names, and the
manual-scheduling happy paths (split / merge / reorder / parallelize / caches / ...).

Expected dtypes are written out as tables derived from PyTorch's type promotion rules
(``torch.promote_types`` / ``torch.result_type``); torch itself is not imported.
"""

from __future__ import annotations

from typing import Any

import pytest
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType

# Short dtype codes used in the tables below and in test ids.
SHORT: dict[str, str] = {
    "b": "Bool", "i32": "Int32", "i64": "Int", "f16": "Half", "bf16": "BFloat16",
    "f32": "Float", "f64": "Double",
}
DTYPES = list(SHORT)


def dt(code: str) -> Any:
    """``DataType`` member from its short code (``"f32"`` -> ``DataType.Float``)."""
    return getattr(DataType, SHORT[code])


def extents(t: Any) -> list[str]:
    """Extent strings of the loop domain of ``t``."""
    return [axis.extent for axis in t.loop_domain]


# --------------------------------------------------------------------------------------
# Dtype tables (PyTorch rules).
# --------------------------------------------------------------------------------------

# fmt: off
# torch.promote_types(lhs, rhs) for two dimensioned tensors: add sub mul pow maximum
# minimum, and where(cond, lhs, rhs).  Columns (rhs) in the order of DTYPES.
#                b       i32     i64     f16     bf16    f32     f64
PROMOTE_ROWS: dict[str, tuple[str, ...]] = {
    "b":    ("b",    "i32",  "i64",  "f16",  "bf16", "f32",  "f64"),
    "i32":  ("i32",  "i32",  "i64",  "f16",  "bf16", "f32",  "f64"),
    "i64":  ("i64",  "i64",  "i64",  "f16",  "bf16", "f32",  "f64"),
    "f16":  ("f16",  "f16",  "f16",  "f16",  "f32",  "f32",  "f64"),
    "bf16": ("bf16", "bf16", "bf16", "f32",  "bf16", "f32",  "f64"),
    "f32":  ("f32",  "f32",  "f32",  "f32",  "f32",  "f32",  "f64"),
    "f64":  ("f64",  "f64",  "f64",  "f64",  "f64",  "f64",  "f64"),
}
# torch.div (true division): like PROMOTE, but bool/integer results become f32.
#                b       i32     i64     f16     bf16    f32     f64
DIV_ROWS: dict[str, tuple[str, ...]] = {
    "b":    ("f32",  "f32",  "f32",  "f16",  "bf16", "f32",  "f64"),
    "i32":  ("f32",  "f32",  "f32",  "f16",  "bf16", "f32",  "f64"),
    "i64":  ("f32",  "f32",  "f32",  "f16",  "bf16", "f32",  "f64"),
    "f16":  ("f16",  "f16",  "f16",  "f16",  "f32",  "f32",  "f64"),
    "bf16": ("bf16", "bf16", "bf16", "f32",  "bf16", "f32",  "f64"),
    "f32":  ("f32",  "f32",  "f32",  "f32",  "f32",  "f32",  "f64"),
    "f64":  ("f64",  "f64",  "f64",  "f64",  "f64",  "f64",  "f64"),
}

# Tensor (op) python scalar: a python number only raises the category.  A python int
# on a bool tensor gives the default integer (i64); a python float on a bool/integer
# tensor gives the default float (f32).
PY_SCALARS: tuple[bool, int, float] = (True, 3, 2.0)
#  tensor:       True    3       2.0
SCALAR_PROMOTE: dict[str, tuple[str, str, str]] = {
    "b":    ("b",    "i64",  "f32"),
    "i32":  ("i32",  "i32",  "f32"),
    "i64":  ("i64",  "i64",  "f32"),
    "f16":  ("f16",  "f16",  "f16"),
    "bf16": ("bf16", "bf16", "bf16"),
    "f32":  ("f32",  "f32",  "f32"),
    "f64":  ("f64",  "f64",  "f64"),
}
#  tensor:       True    3       2.0
SCALAR_DIV: dict[str, tuple[str, str, str]] = {
    "b":    ("f32",  "f32",  "f32"),
    "i32":  ("f32",  "f32",  "f32"),
    "i64":  ("f32",  "f32",  "f32"),
    "f16":  ("f16",  "f16",  "f16"),
    "bf16": ("bf16", "bf16", "bf16"),
    "f32":  ("f32",  "f32",  "f32"),
    "f64":  ("f64",  "f64",  "f64"),
}

# input dtype -> result dtype.
#   UNARY_FLOAT: exp log sqrt rsqrt reciprocal sin cos tanh sigmoid
#   SUM:         sum (bool/integer inputs accumulate in i64)
#                                   b      i32    i64    f16    bf16    f32    f64
UNARY_FLOAT = dict(zip(DTYPES, ("f32", "f32", "f32", "f16", "bf16", "f32", "f64")))
SUM = dict(zip(DTYPES,         ("i64", "i64", "i64", "f16", "bf16", "f32", "f64")))
# fmt: on


def promote(a: str, b: str) -> str:
    """PROMOTE table lookup."""
    return PROMOTE_ROWS[a][DTYPES.index(b)]


def true_div(a: str, b: str) -> str:
    """DIV table lookup."""
    return DIV_ROWS[a][DTYPES.index(b)]


ARITH_OPS = ["add", "sub", "mul", "pow", "maximum", "minimum"]
COMPARE_OPS = ["eq", "ne", "lt", "le", "gt", "ge"]
UNARY_FLOAT_OPS = [
    "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid",
]
UNARY_KEEP_OPS = ["abs", "neg", "relu"]


def _bool_excluded(op: str, lhs_is_bool: bool, rhs_is_bool: bool) -> bool:
    """Cases PyTorch rejects, left unspecified here: subtraction with a bool operand,
    and pow of two bools."""
    if op == "sub":
        return lhs_is_bool or rhs_is_bool
    if op == "pow":
        return lhs_is_bool and rhs_is_bool
    return False


def _binary(op: str, a: str, b: str) -> Any:
    """Build ``op(T0, T1)`` on two [-1, 4] tensors of dtypes ``a``/``b``."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=dt(a))
        y = fd.define_tensor(shape=[-1, 4], dtype=dt(b))
        out = getattr(fd.ops, op)(x, y)
        fd.add_output(out)
    return out


def _with_scalar(op: str, tensor_dtype: str, value: Any, scalar_first: bool) -> Any:
    """Build ``op(T0, value)`` (or ``op(value, T0)``) with a python scalar."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1], dtype=dt(tensor_dtype))
        fn = getattr(fd.ops, op)
        out = fn(value, x) if scalar_first else fn(x, value)
        fd.add_output(out)
    return out


# --------------------------------------------------------------------------------------
# Enums and names
# --------------------------------------------------------------------------------------


def test_enum_members_exist_and_are_distinct() -> None:
    assert len({str(dt(c)) for c in DTYPES}) == 7
    ptypes = [
        "Serial", "BIDx", "BIDy", "BIDz", "TIDx", "TIDy", "TIDz", "Vectorize", "Unroll",
        "Unswitch",
    ]
    assert len({str(getattr(ParallelType, p)) for p in ptypes}) == 10
    mtypes = ["Global", "Shared", "Local"]
    assert len({str(getattr(MemoryType, m)) for m in mtypes}) == 3


def test_canonical_example_names_shapes_dtypes() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        b = fd.define_tensor(shape=[-1], dtype=DataType.Float, contiguity=[True])
        bb = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        y = fd.ops.add(x, bb)
        r = fd.ops.sum(y, dims=[1], keepdim=False)
        fd.add_output(r)
    assert [t.name for t in (x, b, bb, y, r)] == ["T0", "T1", "T2", "T3", "T4"]
    assert x.shape == (-1, -1) and x.ndim == 2
    assert b.shape == (-1,) and b.ndim == 1
    assert bb.shape == (1, -1) and bb.ndim == 2
    assert bb.axis(0).is_broadcast and not bb.axis(1).is_broadcast
    assert y.shape == (-1, -1) and y.dtype == DataType.Float
    assert r.shape == (-1,) and r.ndim == 1 and r.dtype == DataType.Float
    assert len(r.loop_domain) == 2
    assert [a.is_reduction for a in r.loop_domain] == [False, True]


def test_scalars_do_not_take_tensor_names() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        s = fd.define_scalar(2.0, dtype=DataType.Double)
        k = fd.define_scalar(dtype=DataType.Double)
        y = fd.ops.mul(x, s)
        z = fd.ops.add(y, k)
        f = fd.ops.full([4], 1.0, DataType.Float)
        fd.add_output(z)
        fd.add_output(f)
    assert (x.name, y.name, z.name, f.name) == ("T0", "T1", "T2", "T3")
    assert z.dtype == DataType.Float and z.shape == (-1,)


def test_define_scalar_takes_a_dtype_as_its_first_argument() -> None:
    """nvFuser's older ``define_scalar(DataType.Int)``: a runtime scalar input of that type."""
    import numpy as np  # noqa: PLC0415
    from kiln import KilnTypeError  # noqa: PLC0415

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        k = fd.define_scalar(DataType.Int)
        fd.add_output(fd.ops.mul(x, k))
    (got,) = fd.execute([np.arange(4, dtype=np.float32), 3])
    np.testing.assert_array_equal(got, np.arange(4) * 3.0)
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=DataType.Float)
        with pytest.raises(KilnTypeError, match="dtype given twice"):
            fd.define_scalar(DataType.Int, dtype=DataType.Double)
        fd.add_output(x)


def test_names_restart_per_fusion() -> None:
    for _ in range(2):
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[-1], dtype=DataType.Half)
            y = fd.ops.relu(x)
            fd.add_output(y)
        assert (x.name, y.name) == ("T0", "T1")


# --------------------------------------------------------------------------------------
# define_tensor
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "contiguity", "broadcast"),
    [
        ([-1, -1], None, [False, False]),
        ([4, -1], [True, True], [False, False]),
        ([1, -1], [None, True], [True, False]),
        ([2, 1, 3], [False, None, True], [False, True, False]),
        ([7], [True], [False]),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_define_tensor(
    shape: list[int],
    contiguity: list[bool | None] | None,
    broadcast: list[bool],
    dtype: str,
) -> None:
    with FusionDefinition() as fd:
        if contiguity is None:
            t = fd.define_tensor(shape=shape, dtype=dt(dtype))
        else:
            t = fd.define_tensor(shape=shape, dtype=dt(dtype), contiguity=contiguity)
        fd.add_output(fd.ops.eq(t, t))
    assert t.name == "T0"
    assert t.shape == tuple(shape)
    assert t.ndim == len(shape)
    assert t.dtype == dt(dtype)
    assert len(t.loop_domain) == len(shape)
    assert [a.is_broadcast for a in t.loop_domain] == broadcast
    assert not any(a.is_reduction for a in t.loop_domain)
    assert all(a.parallel_type == ParallelType.Serial for a in t.loop_domain)
    for size, axis in zip(shape, t.loop_domain):
        if size > 0:
            assert axis.extent == str(size)
        else:
            assert axis.extent not in ("", "1")


def test_symbolic_extents_are_distinct(chain: Any) -> None:
    e0, e1 = extents(chain.x)
    assert e0 != e1


def test_axis_negative_index_is_python_style(static_chain: Any) -> None:
    x = static_chain.x
    assert x.axis(-1).extent == "8" == x.axis(1).extent
    assert x.axis(-2).extent == "4" == x.axis(0).extent


# --------------------------------------------------------------------------------------
# Binary ops
# --------------------------------------------------------------------------------------

ARITH_CASES = [
    (op, a, b)
    for op in ARITH_OPS
    for a in DTYPES
    for b in DTYPES
    if not _bool_excluded(op, a == "b", b == "b")
]


@pytest.mark.parametrize(("op", "a", "b"), ARITH_CASES)
def test_binary_arith_dtype(op: str, a: str, b: str) -> None:
    out = _binary(op, a, b)
    assert out.dtype == dt(promote(a, b))
    assert out.shape == (-1, 4)
    # An operand of another dtype meeting a half or bfloat16 common type is first cast to
    # it (PyTorch's conversion), a tensor of its own (T2); the result is the next one.
    common = promote(a, b)
    casts = sum(common in ("f16", "bf16") and d != common for d in (a, b))
    assert out.name == f"T{2 + casts}"


@pytest.mark.parametrize("b", DTYPES)
@pytest.mark.parametrize("a", DTYPES)
def test_truediv_dtype(a: str, b: str) -> None:
    out = _binary("truediv", a, b)
    assert out.dtype == dt(true_div(a, b))
    assert out.shape == (-1, 4)


@pytest.mark.parametrize("b", DTYPES)
@pytest.mark.parametrize("a", DTYPES)
def test_div_keeps_the_promoted_type(a: str, b: str) -> None:
    # div truncates integers (as nvFuser's div); truediv is torch.div.
    out = _binary("div", a, b)
    assert out.dtype == dt(promote(a, b))


@pytest.mark.parametrize("b", DTYPES)
@pytest.mark.parametrize("a", DTYPES)
@pytest.mark.parametrize("op", COMPARE_OPS)
def test_compare_dtype(op: str, a: str, b: str) -> None:
    out = _binary(op, a, b)
    assert out.dtype == DataType.Bool
    assert out.shape == (-1, 4)


SCALAR_CASES = [
    (op, t, which, first)
    for op in ["add", "sub", "mul", "pow", "truediv"]
    for t in DTYPES
    for which in range(3)
    for first in (False, True)
    if not _bool_excluded(op, t == "b", which == 0)
]


@pytest.mark.parametrize(("op", "tensor_dtype", "which", "scalar_first"), SCALAR_CASES)
def test_binary_with_python_scalar_dtype(
    op: str, tensor_dtype: str, which: int, scalar_first: bool
) -> None:
    value = PY_SCALARS[which]
    table = SCALAR_DIV if op == "truediv" else SCALAR_PROMOTE
    out = _with_scalar(op, tensor_dtype, value, scalar_first)
    assert out.dtype == dt(table[tensor_dtype][which])
    assert out.shape == (3, -1)
    assert out.name == "T1"


@pytest.mark.parametrize("value", [True, 3, 2.5])
@pytest.mark.parametrize("tensor_dtype", DTYPES)
@pytest.mark.parametrize("op", COMPARE_OPS)
def test_compare_with_python_scalar(op: str, tensor_dtype: str, value: Any) -> None:
    out = _with_scalar(op, tensor_dtype, value, scalar_first=False)
    assert out.dtype == DataType.Bool
    assert out.shape == (3, -1)


@pytest.mark.parametrize(
    ("tensor_dtype", "value", "scalar_dtype", "expected"),
    [
        ("f32", 2.0, "f64", "f32"),
        ("f16", 2.0, "f64", "f16"),
        ("bf16", 0.5, "f32", "bf16"),
        ("f64", 2.0, "f32", "f64"),
        ("i32", 3, "i64", "i32"),
        ("i64", 3, "i32", "i64"),
        ("b", 1, "i64", "i64"),
        ("f32", None, "f64", "f32"),
        ("i32", None, "i64", "i32"),
    ],
)
def test_binary_with_scalar_handle_dtype(
    tensor_dtype: str, value: Any, scalar_dtype: str, expected: str
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 5], dtype=dt(tensor_dtype))
        if value is None:
            s = fd.define_scalar(dtype=dt(scalar_dtype))
        else:
            s = fd.define_scalar(value, dtype=dt(scalar_dtype))
        out = fd.ops.mul(x, s)
        out2 = fd.ops.add(s, out)
        fd.add_output(out2)
    assert out.dtype == dt(expected) and out2.dtype == dt(expected)
    assert out.shape == (-1, 5) and out2.shape == (-1, 5)
    assert (out.name, out2.name) == ("T1", "T2")


@pytest.mark.parametrize(
    ("lhs", "rhs", "expected"),
    [
        ([4, 8], [4, 8], (4, 8)),
        ([4, 1], [1, 8], (4, 8)),
        ([1, -1], [3, -1], (3, -1)),
        ([-1, 1], [-1, 6], (-1, 6)),
        ([1, 1], [1, 6], (1, 6)),
        ([-1, 1, 5], [-1, 7, 1], (-1, 7, 5)),
        ([2, 3, 4], [1, 1, 1], (2, 3, 4)),
    ],
)
@pytest.mark.parametrize("op", ["add", "mul", "div", "maximum", "lt"])
def test_binary_shapes_static_propagation(
    op: str, lhs: list[int], rhs: list[int], expected: tuple[int, ...]
) -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=lhs, dtype=DataType.Float)
        b = fd.define_tensor(shape=rhs, dtype=DataType.Float)
        out = getattr(fd.ops, op)(a, b)
        fd.add_output(out)
    assert out.shape == expected
    assert out.ndim == len(expected)
    for size, axis in zip(expected, out.loop_domain):
        if size > 0:
            assert axis.extent == str(size)
        assert axis.is_broadcast == (size == 1)


# --------------------------------------------------------------------------------------
# Unary ops, cast
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", UNARY_FLOAT_OPS)
def test_unary_float_ops(op: str, dtype: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1, 1], dtype=dt(dtype))
        y = getattr(fd.ops, op)(x)
        fd.add_output(y)
    assert y.dtype == dt(UNARY_FLOAT[dtype])
    assert y.shape == (3, -1, 1)
    assert y.ndim == 3
    assert y.name == "T1"


@pytest.mark.parametrize("dtype", ["i32", "i64", "f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", UNARY_KEEP_OPS)
def test_unary_dtype_keeping_ops(op: str, dtype: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1, 1], dtype=dt(dtype))
        y = getattr(fd.ops, op)(x)
        fd.add_output(y)
    assert y.dtype == dt(dtype)
    assert y.shape == (3, -1, 1)
    assert y.name == "T1"


@pytest.mark.parametrize("to", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_cast(src: str, to: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1], dtype=dt(src))
        y = fd.ops.cast(x, dt(to))
        fd.add_output(y)
    assert y.dtype == dt(to)
    assert y.shape == (3, -1)
    assert y.name == "T1"


# --------------------------------------------------------------------------------------
# where
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("f32", "f32", "f32"),
        ("f16", "bf16", "f32"),
        ("f16", "f16", "f16"),
        ("i32", "i64", "i64"),
        ("b", "i32", "i32"),
        ("b", "b", "b"),
        ("f16", "f64", "f64"),
        ("i64", "bf16", "bf16"),
        ("f32", 0.0, "f32"),
        ("f16", 0.0, "f16"),
        ("i32", 1, "i32"),
        ("i32", 1.5, "f32"),
        (0.0, "bf16", "bf16"),
        (1, "b", "i64"),
    ],
)
def test_where_dtype_and_shape(a: Any, b: Any, expected: str) -> None:
    with FusionDefinition() as fd:
        cond = fd.define_tensor(shape=[-1, 4], dtype=DataType.Bool)
        lhs = fd.define_tensor(shape=[1, 4], dtype=dt(a)) if isinstance(a, str) else a
        rhs = fd.define_tensor(shape=[-1, 1], dtype=dt(b)) if isinstance(b, str) else b
        out = fd.ops.where(cond, lhs, rhs)
        fd.add_output(out)
    assert out.dtype == dt(expected)
    assert out.shape == (-1, 4)
    assert out.name == f"T{1 + isinstance(a, str) + isinstance(b, str)}"


# --------------------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reduction_dtype(op: str, dtype: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 6], dtype=dt(dtype))
        r = getattr(fd.ops, op)(x, dims=[1])
        fd.add_output(r)
    assert r.dtype == dt(SUM[dtype] if op == "sum" else dtype)
    assert r.shape == (-1,)
    assert r.ndim == 1
    if op == "sum" and dtype in ("f16", "bf16"):
        # Half sums accumulate in float: cast, sum, cast back.
        assert r.name == "T3" and "Float" in str(fd)
    else:
        assert r.name == "T1"


@pytest.mark.parametrize(
    ("shape", "dims", "keepdim", "expected"),
    [
        ([4, -1, 8], [1], False, (4, 8)),
        ([4, -1, 8], [1], True, (4, 1, 8)),
        ([4, -1, 8], [0, 2], False, (-1,)),
        ([4, -1, 8], [0, 2], True, (1, -1, 1)),
        ([4, -1, 8], [2], False, (4, -1)),
        ([-1, -1], [0, 1], False, ()),
        ([6], [0], True, (1,)),
    ],
)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reduction_shapes(
    op: str, shape: list[int], dims: list[int], keepdim: bool, expected: tuple[int, ...]
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=shape, dtype=DataType.Float)
        r = getattr(fd.ops, op)(x, dims=dims, keepdim=keepdim)
        fd.add_output(r)
    assert r.shape == expected
    assert r.ndim == len(expected)
    assert r.dtype == DataType.Float
    if not keepdim:
        # The loop domain keeps the reduction axes, in place.
        assert len(r.loop_domain) == len(shape)
        assert [a.is_reduction for a in r.loop_domain] == [
            i in dims for i in range(len(shape))
        ]
        for i, size in enumerate(shape):
            if size > 0:
                assert r.axis(i).extent == str(size)


def test_reduction_default_keepdim_is_false() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[3, -1], dtype=DataType.Float)
        r = fd.ops.sum(x, dims=[0])
        fd.add_output(r)
    assert r.shape == (-1,)
    assert r.dtype == DataType.Float
    assert r.axis(0).is_reduction and r.axis(0).extent == "3"
    assert not r.axis(1).is_reduction


# --------------------------------------------------------------------------------------
# broadcast_in_dim, permute, index_select, full
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "bdims", "expected"),
    [
        ([-1], [-1, -1], [1], (1, -1)),
        ([-1], [-1, -1], [0], (-1, 1)),
        ([3], [-1, 3], [1], (1, 3)),
        ([-1, 5], [-1, -1, 5], [0, 2], (-1, 1, 5)),
        ([-1, 5], [-1, 5, -1], [0, 1], (-1, 5, 1)),
        ([4], [-1, -1, 4], [2], (1, 1, 4)),
        ([2, 3], [2, 3], [0, 1], (2, 3)),
    ],
)
def test_broadcast_in_dim_shapes(
    in_shape: list[int],
    out_shape: list[int],
    bdims: list[int],
    expected: tuple[int, ...],
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=in_shape, dtype=DataType.BFloat16)
        y = fd.ops.broadcast_in_dim(x, shape=out_shape, broadcast_dims=bdims)
        fd.add_output(y)
    assert y.shape == expected
    assert y.ndim == len(out_shape)
    assert y.dtype == DataType.BFloat16
    assert y.name == "T1"
    assert [a.is_broadcast for a in y.loop_domain] == [
        i not in bdims for i in range(len(out_shape))
    ]


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        ([0, 1, 2], (2, -1, 4)),
        ([2, 0, 1], (4, 2, -1)),
        ([1, 2, 0], (-1, 4, 2)),
        ([2, 1, 0], (4, -1, 2)),
        ([0, 2, 1], (2, 4, -1)),
    ],
)
@pytest.mark.parametrize("dtype", ["f16", "i32", "b"])
def test_permute_shapes(dims: list[int], expected: tuple[int, ...], dtype: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, -1, 4], dtype=dt(dtype))
        y = fd.ops.permute(x, dims=dims)
        fd.add_output(y)
    assert y.shape == expected
    assert y.dtype == dt(dtype)
    assert y.name == "T1"
    assert [e for e in extents(y) if e.isdigit()] == [
        str(size) for size in expected if size > 0
    ]


@pytest.mark.parametrize(
    ("in_shape", "idx_shape", "idx_dtype", "dim", "expected"),
    [
        ([4, 7], [3], "i64", 0, (3, 7)),
        ([4, 7], [3], "i32", 1, (4, 3)),
        ([-1, 7], [-1], "i64", 1, (-1, -1)),
        ([-1, 7], [5], "i64", 0, (5, 7)),
        ([5, -1, 2], [6], "i32", 2, (5, -1, 6)),
        ([9], [2], "i64", 0, (2,)),
    ],
)
@pytest.mark.parametrize("dtype", ["f16", "f32", "i64"])
def test_index_select_shapes(
    in_shape: list[int],
    idx_shape: list[int],
    idx_dtype: str,
    dim: int,
    expected: tuple[int, ...],
    dtype: str,
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=in_shape, dtype=dt(dtype))
        idx = fd.define_tensor(shape=idx_shape, dtype=dt(idx_dtype))
        y = fd.ops.index_select(x, idx, dim)
        fd.add_output(y)
    assert y.shape == expected
    assert y.ndim == len(in_shape)
    assert y.dtype == dt(dtype)
    assert y.name == "T2"


@pytest.mark.parametrize(
    ("shape", "value", "dtype"),
    [
        ([2, 3], 1.5, "f32"),
        ([4], 7, "i64"),
        ([2, 5, 3], True, "b"),
        ([8], 0.0, "f16"),
        ([3, 3], -1, "i32"),
        ([6, 2], 2.0, "f64"),
    ],
)
def test_full_shapes(shape: list[int], value: Any, dtype: str) -> None:
    with FusionDefinition() as fd:
        y = fd.ops.full(shape, value, dt(dtype))
        fd.add_output(y)
    assert y.shape == tuple(shape)
    assert y.ndim == len(shape)
    assert y.dtype == dt(dtype)
    assert y.name == "T0"
    assert extents(y) == [str(s) for s in shape]


def test_full_combined_with_input() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[2, 3], dtype=DataType.Half)
        f = fd.ops.full([2, 3], 1.0, DataType.Half)
        y = fd.ops.add(x, f)
        fd.add_output(y)
    assert (x.name, f.name, y.name) == ("T0", "T1", "T2")
    assert y.dtype == DataType.Half and y.shape == (2, 3)


# --------------------------------------------------------------------------------------
# Scheduling happy paths
# --------------------------------------------------------------------------------------


def test_split_symbolic(chain: Any) -> None:
    y = chain.y
    before = extents(y)
    assert y.split(1, 128) is None
    after = extents(y)
    assert len(after) == 3
    assert after[0] == before[0]
    assert "ceilDiv" in after[1] and "128" in after[1] and before[1] in after[1]
    assert after[2] == "128"
    assert [a.is_reduction for a in y.loop_domain] == [False, False, False]
    # The logical shape is unchanged by loop transforms.
    assert y.shape == (-1, -1)


def test_split_outer(chain: Any) -> None:
    y = chain.y
    before = extents(y)
    y.split(1, 4, inner_split=False)
    after = extents(y)
    assert after[1] == "4"
    assert "ceilDiv" in after[2] and before[1] in after[2] and "4" in after[2]


def test_split_static_non_divisible_folds_constants(make_chain: Any) -> None:
    c = make_chain([4, 10])
    c.z.split(1, 4)
    assert extents(c.z) == ["4", "3", "4"]
    c.y.split(0, 3)
    assert extents(c.y) == ["2", "3", "10"]


def test_split_negative_axis(static_chain: Any) -> None:
    z = static_chain.z
    z.split(-1, 2)
    assert extents(z) == ["4", "4", "2"]


def test_split_twice(chain: Any) -> None:
    y = chain.y
    y.split(1, 128)
    y.split(1, 4)
    ext = extents(y)
    assert len(ext) == 4
    assert ext[2] == "4" and ext[3] == "128"
    assert "ceilDiv" in ext[1]


@pytest.mark.parametrize(
    ("shape", "args", "expected"),
    [
        ([4, 8], (0,), ["32"]),
        ([4, 8], (0, 1), ["32"]),
        ([4, 8, 5], (1,), ["4", "40"]),
        ([4, 8, 5], (1, 2), ["4", "40"]),
        ([4, 8, 5], (0, 2), ["20", "8"]),
        ([4, 8, 5], (-2, -1), ["4", "40"]),
    ],
)
def test_merge_static(
    make_chain: Any, shape: list[int], args: tuple[int, ...], expected: list[str]
) -> None:
    c = make_chain(shape)
    assert c.y.merge(*args) is None
    assert extents(c.y) == expected


def test_merge_symbolic(chain: Any) -> None:
    y = chain.y
    e0, e1 = extents(y)
    y.merge(0, 1)
    (merged,) = extents(y)
    assert e0 in merged and e1 in merged


def test_split_then_merge_back(static_chain: Any) -> None:
    z = static_chain.z
    z.split(1, 2)
    z.merge(0, 1)
    assert extents(z) == ["16", "2"]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ({0: 2}, ["3", "4", "2"]),
        ({2: 0}, ["4", "2", "3"]),
        ({0: 1, 1: 0}, ["3", "2", "4"]),
        ({0: 2, 2: 0}, ["4", "3", "2"]),
        ({1: 2}, ["2", "4", "3"]),
        ({0: 0}, ["2", "3", "4"]),
        ({0: 1, 1: 2, 2: 0}, ["4", "2", "3"]),
    ],
)
def test_reorder(make_chain: Any, order: dict[int, int], expected: list[str]) -> None:
    c = make_chain([2, 3, 4])
    assert c.y.reorder(order) is None
    assert extents(c.y) == expected


def test_parallelize(chain: Any) -> None:
    y = chain.y
    assert y.axis(0).parallel_type == ParallelType.Serial
    y.split(1, 128)
    assert y.axis(0).parallelize(ParallelType.BIDy) is None
    y.axis(1).parallelize(ParallelType.BIDx)
    y.axis(-1).parallelize(ParallelType.TIDx)
    assert [a.parallel_type for a in y.loop_domain] == [
        ParallelType.BIDy,
        ParallelType.BIDx,
        ParallelType.TIDx,
    ]
    # Other tensors are untouched.
    assert all(a.parallel_type == ParallelType.Serial for a in chain.z.loop_domain)


@pytest.mark.parametrize("ptype", ["Unroll", "Unswitch", "TIDy", "BIDz", "Serial"])
def test_parallelize_other_types(chain: Any, ptype: str) -> None:
    chain.z.axis(0).parallelize(getattr(ParallelType, ptype))
    assert chain.z.axis(0).parallel_type == getattr(ParallelType, ptype)


def test_vectorize_static_innermost(static_chain: Any) -> None:
    z = static_chain.z
    z.split(1, 4)
    z.axis(2).parallelize(ParallelType.Vectorize)
    z.axis(1).parallelize(ParallelType.TIDx)
    assert z.axis(2).parallel_type == ParallelType.Vectorize
    assert z.axis(1).parallel_type == ParallelType.TIDx
    assert z.axis(2).extent == "4"


def test_vectorize_after_split_of_symbolic(chain: Any) -> None:
    z = chain.z
    z.split(1, 4)
    z.axis(-1).parallelize(ParallelType.Vectorize)
    assert z.axis(2).parallel_type == ParallelType.Vectorize


def test_schedule_reduction(reduction: Any) -> None:
    r = reduction.r
    assert r.ndim == 1
    r.split(1, 32)
    assert [a.is_reduction for a in r.loop_domain] == [False, True, True]
    assert r.axis(2).extent == "32"
    r.axis(2).parallelize(ParallelType.TIDx)
    r.axis(0).parallelize(ParallelType.BIDx)
    assert r.axis(2).parallel_type == ParallelType.TIDx
    assert r.axis(2).is_reduction
    r.reorder({1: 0})
    assert [a.is_reduction for a in r.loop_domain] == [True, False, True]
    assert r.axis(1).parallel_type == ParallelType.BIDx


def test_cache_after_and_before_names(chain: Any) -> None:
    c = chain.x.cache_after()
    assert c.name == "T3"
    assert c.dtype == DataType.Float
    assert c.shape == (-1, -1)
    assert c.ndim == 2
    d = chain.z.cache_before()
    assert d.name == "T4"
    assert d.dtype == DataType.Float
    assert d.shape == (-1, -1)
    # The original handles keep their names.
    assert (chain.x.name, chain.y.name, chain.z.name) == ("T0", "T1", "T2")


@pytest.mark.parametrize("dtype", ["f16", "bf16", "i32"])
def test_cache_keeps_dtype_and_static_shape(make_chain: Any, dtype: str) -> None:
    c = make_chain([3, -1], dt(dtype))
    after = c.x.cache_after()
    before = c.z.cache_before()
    mid = c.y.cache_after()
    assert after.dtype == dt(dtype)
    assert after.shape == (3, -1)
    assert before.dtype == c.z.dtype == dt(UNARY_FLOAT[dtype])
    assert before.shape == (3, -1)
    assert mid.dtype == c.y.dtype == dt(UNARY_FLOAT[dtype])
    assert (after.name, before.name, mid.name) == ("T3", "T4", "T5")
    assert after.axis(0).extent == "3"


def test_cache_before_of_reduction_takes_the_reduction(reduction: Any) -> None:
    c = reduction.r.cache_before()
    assert c.name == "T3"
    assert c.shape == (-1,)
    assert c.dtype == DataType.Float
    assert [a.is_reduction for a in c.loop_domain] == [False, True]


def test_set_memory_type(chain: Any) -> None:
    c = chain.x.cache_after()
    assert c.set_memory_type(MemoryType.Shared) is None
    assert chain.y.set_memory_type(MemoryType.Local) is None
    assert chain.z.set_memory_type(MemoryType.Global) is None


def test_inline_at_matching_splits(chain: Any) -> None:
    y, z = chain.y, chain.z
    y.split(1, 4)
    z.split(1, 4)
    assert y.inline_at(2) is None


@pytest.mark.parametrize("pos", [-1, 0, 1, 2])
def test_inline_at_positions(chain: Any, pos: int) -> None:
    assert chain.y.inline_at(pos) is None


def test_inline_at_most_stops_before_reduction(reduction: Any) -> None:
    # r's reduction axis is innermost, so -1 resolves to position 1.
    assert reduction.r.inline_at(-1) is None


def test_set_allocation_domain_ints(chain: Any) -> None:
    z = chain.z
    assert z.set_allocation_domain([1, 0], [True, True]) is None
    # Allocation metadata leaves the logical shape and the loop domain alone.
    assert z.shape == (-1, -1)
    assert len(z.loop_domain) == 2


def test_set_allocation_domain_handles(chain: Any) -> None:
    z = chain.z
    assert z.set_allocation_domain([z.axis(1), z.axis(0)], [True, False]) is None
    assert z.shape == (-1, -1)


def test_set_allocation_domain_after_split(static_chain: Any) -> None:
    y, z = static_chain.y, static_chain.z
    y.split(1, 4)
    assert y.set_allocation_domain([0, 1, 2], [True, True, True]) is None
    assert extents(y) == ["4", "2", "4"]
    # An output comes back as a strided array: its layout orders its logical axes.
    z.split(1, 4)
    with pytest.raises(KilnError, match="is not one of its logical axes"):
        z.set_allocation_domain([0, 1, 2], [True, True, True])


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_circular_buffer(chain: Any, stages: int) -> None:
    c = chain.x.cache_after()
    c.set_memory_type(MemoryType.Shared)
    assert c.circular_buffer(stages) is None


def test_nvfuser_spellings() -> None:
    """Code written against nvFuser's frontend: ``define_tensor(shape, contiguity, dtype)``
    positionally, ``axes``/``keep_dim``, ``reshape(x, original_shape, new_shape)``,
    ``broadcast_in_dim(output_shape=...)``, and ``mean``; checked against NumPy."""
    import numpy as np  # noqa: PLC0415

    a = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], [True, True], DataType.Float, is_cpu=False, static_sizes=False)
        s = fd.ops.sum(x, axes=[1], keep_dim=True)
        fd.add_output(s)
        fd.add_output(fd.ops.reshape(x, [3, 4], [6, 2]))
        m = fd.ops.max(x, axes=[0])
        fd.add_output(fd.ops.broadcast_in_dim(m, output_shape=[3, 4], broadcast_dims=[1]))
        fd.add_output(fd.ops.mean(x, dims=[0, 1]))
        fd.add_output(fd.ops.mean(x, dims=[-1], keepdim=True))
    got = fd.execute([a])
    want = [a.sum(1, keepdims=True), a.reshape(6, 2), np.broadcast_to(a.max(0), (3, 4)), a.mean(),
            a.mean(-1, keepdims=True)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build, pattern", [
    (lambda fd: fd.define_tensor([-1], is_cpu=True), r"is_cpu=True"),
    (lambda fd: fd.define_tensor([-1, -1], stride_order=[0, 1]), r"stride_order \[0, 1\]"),
    (lambda fd: fd.ops.mean(fd.define_tensor([-1], dtype=DataType.Int), dims=[0]),
     r"mean: T0 .*Int.*floating"),
    (lambda fd: fd.ops.reshape(fd.define_tensor([-1, -1]), [3], [3]),
     r"original_shape \[3\] has 1 entries .*rank 2"),
])
def test_nvfuser_spellings_refused_with_a_reason(build: Any, pattern: str) -> None:
    from kiln import KilnError  # noqa: PLC0415

    fd = FusionDefinition()
    with pytest.raises(KilnError, match=pattern):
        build(fd)
