"""Every bad input raises ``KilnError`` (a ``ValueError``) whose message names the
tensor (``T<n>``) and, where an axis is involved, the axis as ``axis <i>`` (the index
the user passed, normalized to non-negative)."""

from __future__ import annotations

import re
from typing import Any

import kiln
import numpy as np
import pytest
from kiln import DataType, FusionDefinition, KilnError, MemoryType, ParallelType

F = DataType.Float


def check(exc: pytest.ExceptionInfo[Any], *names: str, axis: int | None = None) -> str:
    """Assert the error is a KilnError/ValueError naming ``names`` (and ``axis``)."""
    err = exc.value
    assert isinstance(err, KilnError) and isinstance(err, ValueError)
    msg = str(err)
    for name in names:
        # "T1" must not be satisfied by "T10" or "T12".
        assert re.search(rf"(?<![A-Za-z0-9]){name}(?!\d)", msg), (
            f"{name!r} not named in: {msg!r}"
        )
    if axis is not None:
        assert re.search(rf"\baxis {axis}(?!\d)", msg), (
            f"'axis {axis}' not named in: {msg!r}"
        )
    return msg


def test_error_hierarchy() -> None:
    assert issubclass(KilnError, ValueError)
    assert issubclass(kiln.KilnTypeError, KilnError)
    assert issubclass(kiln.KilnTypeError, TypeError)


# --------------------------------------------------------------------------------------
# Definition errors (raised inside the `with` block; the fusion is then completed)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["add", "mul", "div", "eq", "maximum", "pow"])
def test_binary_rank_mismatch(op: str) -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[-1, -1], dtype=F)
        b = fd.define_tensor(shape=[-1], dtype=F)
        with pytest.raises(KilnError) as ei:
            getattr(fd.ops, op)(a, b)
        fd.add_output(fd.ops.neg(a))
    msg = check(ei, "T0", "T1")
    assert "broadcast_in_dim" in msg


def test_where_rank_mismatch() -> None:
    with FusionDefinition() as fd:
        c = fd.define_tensor(shape=[-1, -1], dtype=DataType.Bool)
        a = fd.define_tensor(shape=[-1, -1], dtype=F)
        b = fd.define_tensor(shape=[-1], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.ops.where(c, a, b)
        fd.add_output(fd.ops.neg(a))
    check(ei, "T2")


@pytest.mark.parametrize(
    ("lhs", "rhs", "axis"),
    [
        ([3, -1], [4, -1], 0),
        ([-1, 3], [-1, 4], 1),
        ([2, 5, 3], [2, 5, 4], 2),
        ([1, 6, 3], [7, 5, 3], 1),
    ],
)
def test_binary_static_size_mismatch(lhs: list[int], rhs: list[int], axis: int) -> None:
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=lhs, dtype=F)
        b = fd.define_tensor(shape=rhs, dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.ops.add(a, b)
        fd.add_output(fd.ops.neg(a))
    msg = check(ei, "T0", "T1", axis=axis)
    assert str(lhs[axis]) in msg and str(rhs[axis]) in msg


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reduction_dim_out_of_range(op: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=F)
        with pytest.raises(KilnError) as ei:
            getattr(fd.ops, op)(x, dims=[2])
        fd.add_output(fd.ops.neg(x))
    check(ei, "T0", axis=2)


def test_reduction_duplicate_dim() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], dtype=F)
        y = fd.ops.neg(x)
        with pytest.raises(KilnError) as ei:
            fd.ops.sum(y, dims=[1, 1])
        fd.add_output(y)
    check(ei, "T1", axis=1)


@pytest.mark.parametrize(
    "dims",
    [[0], [0, 1, 2], [0, 0], [1, 1], [0, 2], [-5, 0]],
    ids=["too_short", "too_long", "dup0", "dup1", "out_of_range", "negative_oob"],
)
def test_permute_not_a_permutation(dims: list[int]) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.ops.permute(x, dims=dims)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T0")


@pytest.mark.parametrize("idx_dtype", ["Float", "Half", "Double", "Bool"])
def test_index_select_non_integer_index(idx_dtype: str) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=F)
        idx = fd.define_tensor(shape=[-1], dtype=getattr(DataType, idx_dtype))
        with pytest.raises(KilnError) as ei:
            fd.ops.index_select(x, idx, 0)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T1")
    assert isinstance(ei.value, TypeError)


def test_index_select_2d_index() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=F)
        idx = fd.define_tensor(shape=[-1, 2], dtype=DataType.Int)
        with pytest.raises(KilnError) as ei:
            fd.ops.index_select(x, idx, 0)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T1")


def test_index_select_dim_out_of_range() -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, 4], dtype=F)
        idx = fd.define_tensor(shape=[-1], dtype=DataType.Int32)
        with pytest.raises(KilnError) as ei:
            fd.ops.index_select(x, idx, 2)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T0", axis=2)


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "bdims"),
    [
        ([-1], [-1, -1], [0, 1]),  # broadcast_dims longer than the input rank
        ([-1, -1], [-1, -1, -1], [0]),  # shorter than the input rank
        ([-1, -1], [-1, -1, -1], [2, 0]),  # not increasing
        ([-1, -1], [-1, -1, -1], [1, 1]),  # not strictly increasing
        ([-1], [-1, -1], [2]),  # out of range of the output rank
        ([-1, -1], [-1], [0, 1]),  # output rank smaller than the input rank
        ([3], [-1, 4], [1]),  # output size incompatible with the input size
        ([5, -1], [6, -1, -1], [0, 2]),  # output size incompatible with the input size
    ],
    ids=[
        "long", "short", "decreasing", "repeated", "out_of_range", "rank_down",
        "size_3_vs_4", "size_5_vs_6",
    ],
)
def test_broadcast_in_dim_invalid(
    in_shape: list[int], out_shape: list[int], bdims: list[int]
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=in_shape, dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.ops.broadcast_in_dim(x, shape=out_shape, broadcast_dims=bdims)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T0")


@pytest.mark.parametrize("cond_dtype", ["Float", "Int32", "Int", "Half"])
def test_where_non_bool_condition(cond_dtype: str) -> None:
    with FusionDefinition() as fd:
        c = fd.define_tensor(shape=[-1, 4], dtype=getattr(DataType, cond_dtype))
        a = fd.define_tensor(shape=[-1, 4], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.ops.where(c, a, 0.0)
        fd.add_output(fd.ops.neg(a))
    check(ei, "T0")
    assert isinstance(ei.value, TypeError)


@pytest.mark.parametrize("bad", ["float", 3, None, type(F)], ids=repr)
def test_cast_to_non_datatype(bad: Any) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        y = fd.ops.neg(x)
        with pytest.raises(KilnError) as ei:
            fd.ops.cast(y, bad)
        fd.add_output(y)
    assert isinstance(ei.value, TypeError)
    check(ei, "T1")


@pytest.mark.parametrize(
    ("shape", "contiguity"),
    [([-1, -1], [True]), ([-1], [True, True]), ([4, 1, -1], [True, None])],
)
def test_define_tensor_contiguity_wrong_length(
    shape: list[int], contiguity: list[bool | None]
) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.define_tensor(shape=shape, dtype=F, contiguity=contiguity)
        fd.add_output(fd.ops.neg(x))
    msg = check(ei, "T1")
    assert str(len(shape)) in msg


@pytest.mark.parametrize(("shape", "axis"), [([-2], 0), ([-1, -2], 1), ([4, 1, -7], 2)])
def test_define_tensor_bad_size(shape: list[int], axis: int) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.define_tensor(shape=shape, dtype=F)
        fd.add_output(fd.ops.neg(x))
    msg = check(ei, "T1", axis=axis)
    assert str(shape[axis]) in msg


def test_add_output_from_another_fusion() -> None:
    with FusionDefinition() as other:
        a = other.define_tensor(shape=[-1], dtype=F)
        b = other.ops.neg(a)
        foreign = other.ops.exp(b)
        other.add_output(foreign)
    assert foreign.name == "T2"
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1], dtype=F)
        with pytest.raises(KilnError) as ei:
            fd.add_output(foreign)
        fd.add_output(fd.ops.neg(x))
    check(ei, "T2")


def test_error_inside_with_propagates() -> None:
    with pytest.raises(KilnError) as ei:
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape=[2, -1], dtype=F)
            y = fd.define_tensor(shape=[3, -1], dtype=F)
            fd.add_output(fd.ops.sub(x, y))
    check(ei, "T0", "T1", axis=0)


# --------------------------------------------------------------------------------------
# Scheduling errors (after the `with` block). Fixture names: x=T0, y=T1, z=T2.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [2, 5])
def test_split_axis_out_of_range(chain: Any, axis: int) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.split(axis, 4)
    check(ei, "T1", axis=axis)


def test_split_negative_axis_out_of_range(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.split(-3, 4)
    check(ei, "T1")


@pytest.mark.parametrize("factor", [0, -4], ids=["zero", "negative"])
@pytest.mark.parametrize("axis", [1, -1])
def test_split_bad_factor(chain: Any, factor: int, axis: int) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.split(axis, factor)
    msg = check(ei, "T1", axis=1)
    assert str(factor) in msg
    # A rejected transform leaves the tensor untouched.
    assert len(chain.y.loop_domain) == 2


def test_merge_same_axis(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.merge(1, 1)
    check(ei, "T1", axis=1)


def test_merge_same_axis_after_normalization(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.merge(1, -1)
    check(ei, "T1", axis=1)


@pytest.mark.parametrize(("a", "b", "bad"), [(0, 5, 5), (2, 0, 2), (1, 3, 3)])
def test_merge_axis_out_of_range(chain: Any, a: int, b: int, bad: int) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.merge(a, b)
    check(ei, "T1", axis=bad)
    assert len(chain.y.loop_domain) == 2


def test_merge_reduction_with_iteration(reduction: Any) -> None:
    with pytest.raises(KilnError) as ei:
        reduction.r.merge(0, 1)
    msg = check(ei, "T1")
    assert re.search(r"\baxis [01](?!\d)", msg), msg
    assert "reduction" in msg.lower()


def test_reorder_duplicate_target(make_chain: Any) -> None:
    c = make_chain([2, 3, 4])
    with pytest.raises(KilnError) as ei:
        c.y.reorder({0: 1, 2: 1})
    check(ei, "T1")
    assert [a.extent for a in c.y.loop_domain] == ["2", "3", "4"]


@pytest.mark.parametrize("src", [3, 7])
def test_reorder_source_out_of_range(make_chain: Any, src: int) -> None:
    c = make_chain([2, 3, 4])
    with pytest.raises(KilnError) as ei:
        c.y.reorder({src: 0})
    check(ei, "T1", axis=src)


def test_reorder_target_out_of_range(make_chain: Any) -> None:
    c = make_chain([2, 3, 4])
    with pytest.raises(KilnError) as ei:
        c.y.reorder({0: 3})
    check(ei, "T1")


@pytest.mark.parametrize("i", [2, -3])
def test_axis_index_out_of_range(chain: Any, i: int) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.axis(i)
    check(ei, "T1")


@pytest.mark.parametrize("ptype", ["TIDx", "BIDx", "TIDy"])
def test_parallelize_same_type_twice(chain: Any, ptype: str) -> None:
    pt = getattr(ParallelType, ptype)
    chain.y.axis(0).parallelize(pt)
    with pytest.raises(KilnError) as ei:
        chain.y.axis(1).parallelize(pt)
    check(ei, "T1", axis=1)
    assert chain.y.axis(1).parallel_type == ParallelType.Serial


def test_parallelize_same_type_twice_after_split(chain: Any) -> None:
    z = chain.z
    z.split(1, 128)
    z.axis(2).parallelize(ParallelType.TIDx)
    with pytest.raises(KilnError) as ei:
        z.axis(-3).parallelize(ParallelType.TIDx)
    check(ei, "T2", axis=0)


def test_vectorize_not_innermost(static_chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        static_chain.z.axis(0).parallelize(ParallelType.Vectorize)
    check(ei, "T2", axis=0)


def test_vectorize_not_innermost_after_split(static_chain: Any) -> None:
    z = static_chain.z
    z.split(1, 4)
    with pytest.raises(KilnError) as ei:
        z.axis(1).parallelize(ParallelType.Vectorize)
    check(ei, "T2", axis=1)


def test_vectorize_symbolic_extent(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.z.axis(1).parallelize(ParallelType.Vectorize)
    check(ei, "T2", axis=1)


def test_shared_memory_on_fusion_input(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.x.set_memory_type(MemoryType.Shared)
    check(ei, "T0")


def test_cache_before_on_fusion_input(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.x.cache_before()
    check(ei, "T0")


@pytest.mark.parametrize("pos", [3, 4])
def test_inline_at_beyond_ndim(chain: Any, pos: int) -> None:
    with pytest.raises(KilnError) as ei:
        chain.y.inline_at(pos)
    msg = check(ei, "T1")
    assert str(pos) in msg


def test_inline_at_past_reduction_axis(reduction: Any) -> None:
    r = reduction.r
    r.reorder({1: 0})  # reduction axis outermost: [r1, i0]
    with pytest.raises(KilnError) as ei:
        r.inline_at(1)
    check(ei, "T1", axis=0)


def test_inline_at_mismatched_consumer_split(chain: Any) -> None:
    chain.y.split(1, 4)
    chain.z.split(1, 8)
    with pytest.raises(KilnError) as ei:
        chain.y.inline_at(2)
    check(ei, "T1", axis=1)


def test_split_within_inline_position(chain: Any) -> None:
    chain.y.inline_at(1)
    with pytest.raises(KilnError) as ei:
        chain.y.split(0, 4)
    check(ei, "T1", axis=0)


@pytest.mark.parametrize(
    ("axes", "contiguity"),
    [([0, 1], [True]), ([0, 1], [True, True, True]), ([1, 0], [])],
)
def test_allocation_domain_contiguity_wrong_length(
    chain: Any, axes: list[int], contiguity: list[bool]
) -> None:
    with pytest.raises(KilnError) as ei:
        chain.z.set_allocation_domain(axes, contiguity)
    check(ei, "T2")


def test_allocation_domain_misses_axis(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.z.set_allocation_domain([0], [True])
    check(ei, "T2", axis=1)


def test_allocation_domain_misses_axis_handles(chain: Any) -> None:
    z = chain.z
    with pytest.raises(KilnError) as ei:
        z.set_allocation_domain([z.axis(1)], [True])
    check(ei, "T2", axis=0)


def test_allocation_domain_duplicate_axis(chain: Any) -> None:
    with pytest.raises(KilnError) as ei:
        chain.z.set_allocation_domain([1, 1], [True, True])
    check(ei, "T2", axis=1)


def test_allocation_domain_foreign_axis(chain: Any) -> None:
    z, y = chain.z, chain.y
    with pytest.raises(KilnError) as ei:
        z.set_allocation_domain([y.axis(0), z.axis(1)], [True, True])
    check(ei, "T2")


@pytest.mark.parametrize("stages", [1, 0, -2])
def test_circular_buffer_too_few_stages(chain: Any, stages: int) -> None:
    c = chain.x.cache_after()
    assert c.name == "T3"
    c.set_memory_type(MemoryType.Shared)
    with pytest.raises(KilnError) as ei:
        c.circular_buffer(stages)
    msg = check(ei, "T3")
    assert str(stages) in msg


def _add_of_two(rank_b: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1] * rank_b)
        if rank_b == 1:
            b = fd.ops.broadcast_in_dim(b, shape=[-1, -1], broadcast_dims=[1])
        fd.add_output(fd.ops.add(a, b))
    return fd


SIZES_THAT_DISAGREE = [((4, 5), (4, 6)), ((4, 6), (4, 5)), ((3, 5), (4, 5)), ((4, 8), (5,)), ((2, 1), (3,))]


@pytest.mark.parametrize("shapes", SIZES_THAT_DISAGREE)
@pytest.mark.parametrize("as_written", [False, True])
def test_symbolic_sizes_that_disagree_raise_before_running_on_cpu(shapes: Any, as_written: bool) -> None:
    """Sizes the definition makes equal (an add's operands) are checked in the interpreter as
    in the GPU plan: a KilnError naming the sizes, never a read of the wrong elements."""
    fd = _add_of_two(len(shapes[1]))
    ins = [np.ones(s, np.float32) for s in shapes]
    want = r"input \d \(T\d\): axis \d has size \d+ but input \d \(T\d\) axis \d has size \d+; the definition"
    with pytest.raises(KilnError, match=want):
        fd.execute(ins, as_written=as_written)
    with pytest.raises(KilnError, match="the definition makes them equal"):
        fd.lower(ins)


# Arguments of the wrong kind: each op names the argument and what it expected, with a
# KilnTypeError, instead of letting an AttributeError or a TypeError of its internals out.
WRONG_KIND = [
    ("sum", lambda fd, x, i: fd.ops.sum(x, ["x"]), "sum: dims: expected an int"),
    ("logsumexp", lambda fd, x, i: fd.ops.logsumexp(x, "x"), "logsumexp: dims: expected a list of ints"),
    ("mean", lambda fd, x, i: fd.ops.mean(x, [None]), "mean: dims: expected an int"),
    ("mean of a non-tensor", lambda fd, x, i: fd.ops.mean(3, [0]), "mean: expected a Tensor"),
    ("var", lambda fd, x, i: fd.ops.var(x, [0], correction=1.5), "var_mean: correction: expected an int"),
    ("var_mean dims", lambda fd, x, i: fd.ops.var_mean(x, DataType.Int), "var_mean: dims"),
    ("permute", lambda fd, x, i: fd.ops.permute(x, None), "permute: dims: expected a list of ints"),
    ("squeeze", lambda fd, x, i: fd.ops.squeeze(x, [1.0]), "squeeze: dims: expected an int"),
    ("broadcast", lambda fd, x, i: fd.ops.broadcast(x, True), "broadcast: is_broadcast_dim"),
    ("broadcast_in_dim shape", lambda fd, x, i: fd.ops.broadcast_in_dim(x, 5, [0, 1]),
     "broadcast_in_dim: shape: expected a list"),
    ("broadcast_in_dim dims", lambda fd, x, i: fd.ops.broadcast_in_dim(x, [-1, -1, 1], "x"),
     "broadcast_in_dim: broadcast_dims"),
    ("slice", lambda fd, x, i: fd.ops.slice(x, 0, [1, 1]), "slice: start_indices: expected a list"),
    ("slice of a non-tensor", lambda fd, x, i: fd.ops.slice([1], [0], [1]), "slice: expected a Tensor"),
    ("select", lambda fd, x, i: fd.ops.select(x, None, 0), "select: dim: expected an int"),
    ("reshape", lambda fd, x, i: fd.ops.reshape(x, 6), "reshape: new_shape: expected a list"),
    ("pad", lambda fd, x, i: fd.ops.pad(x, True), "pad: pad_widths: expected a list"),
    ("cat", lambda fd, x, i: fd.ops.cat(x, 0), "cat: tensors: expected a list"),
    ("triu", lambda fd, x, i: fd.ops.triu(x, DataType.Float), "triu: diagonal: expected an int"),
    ("triu nan", lambda fd, x, i: fd.ops.triu(x, float("nan")), "triu: diagonal: expected an int"),
    ("gather index", lambda fd, x, i: fd.ops.gather(x, None, 0), "gather: expected a Tensor"),
    ("gather dim", lambda fd, x, i: fd.ops.gather(x, i, DataType.Float), "gather: dim: expected an int"),
    ("take_along_axis", lambda fd, x, i: fd.ops.take_along_axis(x, i, [0]), "take_along_axis: dim"),
    ("index_select", lambda fd, x, i: fd.ops.index_select(x, i, "0"), "index_select: dim"),
    ("expand", lambda fd, x, i: fd.ops.expand(x, None), "expand: shape: expected a list"),
    ("full", lambda fd, x, i: fd.ops.full(x, 1.0, DataType.Float), "full: shape: expected a list"),
]


@pytest.mark.parametrize("case", WRONG_KIND, ids=[c[0] for c in WRONG_KIND])
def test_arguments_of_the_wrong_kind_are_named(case: Any) -> None:
    _, call, message = case
    with pytest.raises(kiln.KilnTypeError, match=re.escape(message)):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, -1])
            i = fd.define_tensor([-1, -1], dtype=DataType.Int)
            fd.add_output(call(fd, x, i))


@pytest.mark.parametrize("shape", [None, 3, 1.5])
def test_define_tensor_checks_its_shape_before_stride_order(shape: Any) -> None:
    with pytest.raises(kiln.KilnTypeError, match="shape must be a list of ints"):
        with FusionDefinition() as fd:
            fd.define_tensor(shape, stride_order=[1, 0])

