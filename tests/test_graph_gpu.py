"""CUDA-graph replay on the GPU: a replayed host program gives the NumPy float64 answer
whenever input, output, arena or pool pointers, scalar values or sizes change between
calls, keeps its memsets, its stream and its gather error words."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest
import scenarios
from gpu_util import cupy_or_skip, plan_without_resets
from kiln import DataType, FusionDefinition, KilnError
from kiln.compiled import compiled
from test_host import _row, three_segment_chain

pytestmark = pytest.mark.gpu


def _softmax_ref(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    e = np.exp(x.astype(np.float64))
    return e / e.sum(axis=1, keepdims=True) * alpha


def _close(got: Any, ref: np.ndarray) -> None:
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max())))


def _graph(fd: FusionDefinition) -> Any:
    """The graph of ``fd``'s last prepared signature that has one (any lowering)."""
    graphs = [r.graph for low in compiled(fd).lowerings() if low._evaluator is not None
              for r in low._evaluator._recipes.values() if r.graph is not None]
    return graphs[-1]


def _scaled_chain() -> FusionDefinition:
    """``three_segment_chain`` times a runtime Float scalar: three kernels, one scalar."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        alpha = fd.define_scalar(dtype=DataType.Float)
        a = fd.ops.exp(x)
        s = fd.ops.sum(a, dims=[1])
        sb = fd.ops.broadcast_in_dim(s, shape=[-1, -1], broadcast_dims=[0])
        q = fd.ops.div(a, sb)
        y = fd.ops.mul(q, alpha)
        fd.add_output(y)
    for t in (a, s, sb, q, y):
        _row(t)
    sb.inline_at(-1)
    q.inline_at(-1)
    fd.segment_after(a)
    fd.segment_after(s)
    return fd


def test_replay_follows_input_output_and_arena_pointers_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    cp = cupy_or_skip()
    monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
    rng = np.random.default_rng(0)
    fd = three_segment_chain()
    xs = [rng.standard_normal((8, 300)).astype(np.float32) for _ in range(4)]
    dev = [cp.asarray(x) for x in xs]
    kept: List[Any] = []  # outputs kept alive: every call writes a new address
    for _rep in range(3):
        for x, d in zip(xs, dev):
            (y,) = fd.execute([d])
            kept.append(y)
            _close(cp.asnumpy(y), _softmax_ref(x))
    g = _graph(fd)
    assert g.kernel_count == 3 and g.instantiations == 1 and g.replays == 11
    assert g.node_updates >= 10  # new input and output addresses reach their nodes
    for x, y in zip(xs * 3, kept):
        _close(cp.asnumpy(y), _softmax_ref(x))  # no later replay overwrote an earlier output
    # Other sizes: their own signature; a larger arena moves the intermediates, and the first
    # signature's graph follows it.
    big = rng.standard_normal((64, 1000)).astype(np.float32)
    for _ in range(3):
        (yb,) = fd.execute([cp.asarray(big)])
        _close(cp.asnumpy(yb), _softmax_ref(big))
    before = g.node_updates
    (y,) = fd.execute([dev[0]])
    _close(cp.asnumpy(y), _softmax_ref(xs[0]))
    assert g.node_updates > before and g.instantiations == 1
    ev = fd._lowered().evaluator()
    assert ev.launches == 3 * (12 + 3 + 1)


def test_replay_takes_this_calls_scalar_values() -> None:
    cp = cupy_or_skip()
    x = np.random.default_rng(1).standard_normal((5, 200)).astype(np.float32)
    d = cp.asarray(x)
    fd = _scaled_chain()
    for alpha in (1.0, 2.5, -0.75, 2.5, 1e-3):
        (y,) = fd.execute([d, alpha])
        _close(cp.asnumpy(y), _softmax_ref(x, alpha))
    assert _graph(fd).replays == 4


def test_graphs_off_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    cp = cupy_or_skip()
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
    x = np.random.default_rng(2).standard_normal((8, 300)).astype(np.float32)
    fd = three_segment_chain()
    for _ in range(3):
        (y,) = fd.execute([cp.asarray(x)])
        _close(cp.asnumpy(y), _softmax_ref(x))
    assert all(r.graph is None for r in fd._lowered().evaluator()._recipes.values())


def test_memset_nodes_clear_dirty_semaphores_every_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
    cp = cupy_or_skip()
    plan_without_resets(monkeypatch)
    sc = scenarios.h_grid_column_sum()
    x = sc.make_inputs(cp)[0]
    ref = sc.reference([cp.asnumpy(x)])[0]
    for _ in range(20):
        (out,) = sc.fd.execute([x])
        _close(cp.asnumpy(out), ref)
    ev = sc.fd._lowered().evaluator()
    assert ev.memsets == 20 and _graph(sc.fd).replays == 19


def test_replay_on_cupy_and_torch_current_streams() -> None:
    cp = cupy_or_skip()
    x = np.random.default_rng(3).standard_normal((16, 500)).astype(np.float32)
    fd = three_segment_chain()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for k in range(4):
            # The input is written on s right before the call: the replay must follow it on s.
            d = cp.asarray(x) * float(k + 1)
            (y,) = fd.execute([d])
            s.synchronize()
            _close(cp.asnumpy(y), _softmax_ref(x * (k + 1)))
    torch = pytest.importorskip("torch")
    fd2 = _scaled_chain()
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        for k in range(4):
            t = torch.as_tensor(x, device="cuda") * float(k + 1)
            (y,) = fd2.execute([t, 0.5])
            ts.synchronize()
            _close(y.cpu().numpy(), _softmax_ref(x * (k + 1), 0.5))
    assert _graph(fd2).replays == 3


def test_gather_errors_are_reported_after_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        t = fd.define_tensor(shape=[-1, -1])
        i = fd.define_tensor(shape=[-1], dtype=DataType.Int)
        fd.add_output(fd.ops.index_select(t, i, 0))
    tab = cp.arange(15, dtype=cp.float32).reshape(5, 3)
    (out,) = fd.execute([tab, cp.array([4, 1, 0], cp.int64)])
    _close(cp.asnumpy(out), cp.asnumpy(tab)[[4, 1, 0]].astype(np.float64))
    fd.execute([tab, cp.array([0, 7, 2], cp.int64)])  # a replay records the bad index
    assert _graph(fd).replays == 1
    cp.cuda.Device().synchronize()
    with pytest.raises(KilnError, match="held 7 at element 1; T0 has 5 entries"):
        fd.execute([tab, cp.array([1, 0, 2], cp.int64)])
    (out,) = fd.execute([tab, cp.array([2, 2, 3], cp.int64)])
    _close(cp.asnumpy(out), cp.asnumpy(tab)[[2, 2, 3]].astype(np.float64))
    fd.check_errors()


def test_one_node_graph_follows_fresh_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
    cp = cupy_or_skip()
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        y = fd.ops.sub(fd.ops.mul(fd.ops.exp(x), 2.0), 1.5)
        fd.add_output(y)
    v = np.random.default_rng(4).standard_normal(3000).astype(np.float32)
    d = cp.asarray(v)
    outs = [fd.execute([d])[0] for _ in range(6)]
    assert len({o.data.ptr for o in outs}) == 6
    for o in outs:
        _close(cp.asnumpy(o), np.exp(v.astype(np.float64)) * 2 - 1.5)
    assert _graph(fd).replays == 5


def _torch_cuda_or_skip() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _one_kernel() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(fd.ops.exp(x), 2.0))
    return fd


def _softmax_auto() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        m = fd.ops.max(x, [1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)))
    return fd


_CAPTURED = [("one_kernel", _one_kernel, lambda x: 2.0 * np.exp(x.astype(np.float64)), (256, 1000)),
             ("three_kernels", three_segment_chain, _softmax_ref, (64, 3000)),
             ("softmax", _softmax_auto, _softmax_ref, (64, 50000))]


@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("warm", [3, 0])
@pytest.mark.parametrize("name, make, ref, shape", _CAPTURED, ids=[c[0] for c in _CAPTURED])
def test_torch_cuda_graph_records_a_call_and_replays_it_on_new_data(
        monkeypatch: pytest.MonkeyPatch, name: str, make: Any, ref: Any, shape: Any, warm: int,
        graphs: str) -> None:
    # A caller's capture cannot launch kiln's own graph, and its replays write the memory the
    # call used after the call returned: the call must be recorded, not replayed.
    torch = _torch_cuda_or_skip()
    monkeypatch.setenv("KILN_CUDA_GRAPHS", graphs)
    fd = make()
    gen = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(*shape, generator=gen).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fd.execute([x])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (out,) = fd.execute([x])
    for _ in range(2):
        x.copy_(torch.randn(*shape, generator=gen))
        # eager calls between replays use (and may grow) kiln's shared workspace
        (eager,) = fd.execute([x * 2.0])
        g.replay()
        torch.cuda.synchronize()
        _close(out.cpu().numpy(), ref(x.cpu().numpy()))
        _close(eager.cpu().numpy(), ref(2.0 * x.cpu().numpy()))


def test_cupy_stream_capture_records_a_multi_kernel_call() -> None:
    cp = cupy_or_skip()
    fd = three_segment_chain()
    rng = np.random.default_rng(11)
    x = cp.asarray(rng.standard_normal((32, 700)).astype(np.float32))
    fd.execute([x])
    fd.execute([x])  # the signature's graph exists
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        (out,) = fd.execute([x])
        graph = s.end_capture()
    for _ in range(2):
        host = rng.standard_normal((32, 700)).astype(np.float32)
        x.set(host)
        graph.launch(s)
        s.synchronize()
        _close(cp.asnumpy(out), _softmax_ref(host))
