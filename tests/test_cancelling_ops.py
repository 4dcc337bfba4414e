"""Fusions whose ops move no element: reshapes, squeezes, size-one broadcasts, permutes and
sums over size-one axes, which the automatic path's rewrites cancel until an output is the
input itself or a view of it (``x.reshape(1).sum(0)[None]``). Such an output is still a buffer
of its own, written by a copy: the fusion runs, its values match NumPy, and the output shares
no memory with the input. Checked through the CPU interpreter."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kiln import FusionDefinition


def _factorizations(n: int) -> List[List[int]]:
    """Shapes of rank 1-3 holding `n` elements, with size-one axes among them."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    shapes = [[n], [1, n], [n, 1]]
    shapes += [[d, n // d] for d in divisors]
    shapes += [[1, d, n // d] for d in divisors] + [[d, 1, n // d] for d in divisors]
    return shapes


@st.composite
def _programs(draw: Any) -> Tuple[List[int], bool, List[Tuple[str, Any]], List[int]]:
    n = draw(st.sampled_from([1, 1, 2, 6]))
    shape = draw(st.sampled_from(_factorizations(n)))
    static = draw(st.booleans())
    steps: List[Tuple[str, Any]] = []
    cur = list(shape)
    # Axes whose size the definition knows (a squeeze needs a known size one; a symbolic
    # axis of size one may still be summed).
    known = [static] * len(cur)
    for _ in range(draw(st.integers(1, 5))):
        ones = [a for a, s in enumerate(cur) if s == 1]
        known_ones = [a for a in ones if known[a]]
        kinds = ["reshape", "unsqueeze"] + (["sum"] if ones else []) + (["squeeze"] if known_ones else [])
        kind = draw(st.sampled_from(kinds + (["permute"] if len(cur) > 1 else [])))
        if kind == "reshape":
            new = draw(st.sampled_from(_factorizations(int(np.prod(cur)))))
            steps.append((kind, new))
            cur, known = list(new), [True] * len(new)
        elif kind == "unsqueeze":
            at = draw(st.integers(0, len(cur)))
            steps.append((kind, at))
            cur.insert(at, 1)
            known.insert(at, True)
        elif kind in ("sum", "squeeze"):
            axes = sorted(draw(st.sets(st.sampled_from(ones if kind == "sum" else known_ones), min_size=1)))
            keep = kind == "sum" and draw(st.booleans())
            steps.append((kind, (axes, keep) if kind == "sum" else axes))
            if not keep:
                cur = [s for a, s in enumerate(cur) if a not in axes]
                known = [k for a, k in enumerate(known) if a not in axes]
        else:
            perm = draw(st.permutations(range(len(cur))))
            steps.append((kind, list(perm)))
            cur, known = [cur[p] for p in perm], [known[p] for p in perm]
    outputs = sorted(draw(st.sets(st.integers(0, len(steps)), min_size=1, max_size=2)))
    return shape, static, steps, outputs


def _apply_np(x: np.ndarray, kind: str, arg: Any) -> np.ndarray:
    if kind == "reshape":
        return x.reshape(arg)
    if kind == "unsqueeze":
        return np.expand_dims(x, arg)
    if kind == "sum":
        axes, keep = arg
        return x.sum(axis=tuple(axes), keepdims=keep)
    if kind == "squeeze":
        return x.squeeze(axis=tuple(arg))
    return x.transpose(arg)


def _apply_fd(fd: FusionDefinition, t: Any, shape: List[int], kind: str, arg: Any) -> Any:
    if kind == "reshape":
        return fd.ops.reshape(t, list(arg))
    if kind == "unsqueeze":
        rank = len(shape)
        kept = [a if a < arg else a + 1 for a in range(rank)]
        return fd.ops.broadcast_in_dim(t, shape=[-1] * (rank + 1), broadcast_dims=kept)
    if kind == "sum":
        axes, keep = arg
        return fd.ops.sum(t, dims=list(axes), keepdim=keep)
    if kind == "squeeze":
        return fd.ops.squeeze(t, list(arg))
    return fd.ops.permute(t, list(arg))


@settings(max_examples=120, deadline=None)
@given(_programs())
def test_outputs_of_cancelling_ops_are_copies_that_match_numpy(program: Any) -> None:
    """Every chain runs on the automatic path, matches NumPy, and writes fresh outputs."""
    shape, static, steps, outputs = program
    x = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)
    with FusionDefinition() as fd:
        t = fd.define_tensor(list(shape) if static else [-1] * len(shape))
        ts, want = [t], [x.astype(np.float64)]
        for kind, arg in steps:
            t = _apply_fd(fd, t, list(want[-1].shape), kind, arg)
            ts.append(t)
            want.append(_apply_np(want[-1], kind, arg))
        for k in outputs:
            fd.add_output(ts[k])
    got = fd.execute([x])
    assert len(got) == len(outputs)
    for g, k in zip(got, outputs):
        assert g.shape == want[k].shape, (steps, k)
        np.testing.assert_array_equal(g, want[k])
        assert not np.shares_memory(g, x), (steps, k)


def test_sum_over_the_size_one_axis_of_a_reshaped_input() -> None:
    """``x.reshape(1).sum(0)[None]`` of a one-element input: the rewrites leave the output a
    view of the input, which is still copied into a buffer of its own."""
    x = np.array([2.5], dtype=np.float32)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1])
        s = fd.ops.sum(fd.ops.reshape(t, [1]), dims=[0])
        fd.add_output(fd.ops.broadcast_in_dim(s, shape=[-1], broadcast_dims=[]))
    (got,) = fd.execute([x])
    assert got.shape == (1,) and got[0] == 2.5
    assert not np.shares_memory(got, x)
