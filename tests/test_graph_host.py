"""CUDA-graph replay of host programs (``KILN_CUDA_GRAPHS``): the generated launcher on a
stand-in CuPy (CPU; the real ``GraphLaunch`` packs every node's parameters, nothing is
launched), and ``GraphLaunch``'s own checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import scenarios
from gpu_util import plan_without_resets
from kiln import KilnError, _core, host
from test_host import three_segment_chain
from test_launch import FakeArray, _scalar_fusion, fake_gpu  # noqa: F401 - fake_gpu is a fixture


class GraphRecorder:
    """Wraps a real GraphLaunch (real packing of every node), recording calls."""

    def __init__(self, nodes):
        self.g = _core.GraphLaunch([(rec.pl, list(ix)) for rec, ix in nodes])
        self.index = [list(ix) for _rec, ix in nodes]
        self.calls = []
        self.stream_getter_used = False
        self.memsets = self.g.memsets

    def launch(self, stream, *args):
        self.calls.append((stream, args, self.g.packed(*args)))


@pytest.fixture
def graphs(fake_gpu, monkeypatch):  # noqa: F811 - the imported fixture
    """The fake GPU with graphs on (default setting) and every GraphLaunch recorded."""
    made = []

    def prepare(nodes):
        g = GraphRecorder(nodes)
        made.append(g)
        return g

    monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(host, "prepare_graph", prepare)
    fake_gpu.graphs = made
    return fake_gpu


def _direct_calls(fake):
    return [c for rec in fake.made for c in rec.calls]


def test_three_kernel_program_replays_one_graph_from_its_second_call(graphs):
    fd = three_segment_chain()
    x = FakeArray((8, 300))
    (out1,) = fd.execute([x])
    ev = fd._lowered().evaluator()
    # First call: kernel by kernel (a one-off signature never builds a graph's launch).
    assert len(_direct_calls(graphs)) == 3 and ev.launches == 3
    (g,) = graphs.graphs
    assert g.calls == []
    (out2,) = fd.execute([x])
    assert len(_direct_calls(graphs)) == 3, "the repeat goes through the graph only"
    assert ev.launches == 6
    ((stream, args, packed),) = g.calls
    assert stream == 0x51
    # Each node holds exactly what its direct launch passed, but the fresh output's address.
    direct = [c[3] for c in _direct_calls(graphs)]
    assert packed[0] == direct[0] and packed[1] == direct[1]
    assert packed[2] != direct[2]
    assert packed[2] == direct[2].replace(struct.pack("<Q", out1.data.ptr), struct.pack("<Q", out2.data.ptr))
    assert out2.data.ptr in args and x.data.ptr in args
    # Each pointer is one argument, shared by the nodes that take it.
    assert len(args) == len(set(args))
    # A new input address: the same graph, this call's pointer.
    y = FakeArray((8, 300))
    fd.execute([y])
    assert y.data.ptr in g.calls[-1][1] and len(graphs.graphs) == 1
    # New sizes: a new signature with its own graph.
    fd.execute([FakeArray((9, 300))])
    fd.execute([FakeArray((9, 300))])
    assert len(graphs.graphs) == 2 and len(graphs.graphs[1].calls) == 1


def test_graphs_off_launches_kernel_by_kernel(graphs, monkeypatch):
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
    fd = three_segment_chain()
    x = FakeArray((8, 300))
    for _ in range(3):
        fd.execute([x])
    assert graphs.graphs == [] and len(_direct_calls(graphs)) == 9


def test_one_kernel_program_replays_a_graph_with_this_calls_scalars(graphs):
    fd = _scalar_fusion()
    x = FakeArray(1000)
    fd.execute([x, 0.5, -2.0])
    assert len(_direct_calls(graphs)) == 1
    (out,) = fd.execute([x, 3.0, 1e-3])
    ((g,),) = [graphs.graphs]
    ((_s, args, (packed,)),) = g.calls
    # The scalar inputs are this call's values, converted as the kernel's parameters.
    assert args[-2:] == (3.0, 1e-3)
    assert struct.pack("<f", 3.0) in packed and struct.pack("<d", 1e-3) in packed
    assert args[:2] == (x.data.ptr, out.data.ptr)
    assert len(_direct_calls(graphs)) == 1


def test_bad_setting_is_refused(graphs, monkeypatch):
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "sometimes")
    with pytest.raises(KilnError, match="KILN_CUDA_GRAPHS must be 0 or 1"):
        three_segment_chain().execute([FakeArray((8, 300))])


def test_zero_init_buffers_are_memset_nodes_of_their_kernel(graphs, monkeypatch):
    plan_without_resets(monkeypatch)
    sc = scenarios.h_grid_column_sum()
    x = FakeArray((61, 300))
    sc.fd.execute([x])
    sc.fd.execute([x])
    ev = sc.fd._lowered().evaluator()
    (g,) = graphs.graphs
    ((_s, args, _p),) = g.calls
    ((mset,),) = g.memsets
    base = ev._arena.data.ptr
    # The semaphore (zero_init, left dirty) is cleared right before its kernel, every replay.
    assert mset[1] == 24 and args[mset[0]] == base + 24576
    assert ev.memsets == 2
    ev.zero_per_launch = False  # the test hook still works: the direct launcher runs
    sc.fd.execute([x])
    assert len(g.calls) == 1 and _direct_calls(graphs)[-1][0] == "launch" and ev.memsets == 2


def _pl(params, memsets=()):
    return _core.PreparedLaunch(0xF00, (1, 1, 1), (32, 1, 1), 0, params, list(memsets))


def test_graph_launch_checks_its_nodes():
    a = _pl([None, None, "Float"], [(1, 64)])
    b = _pl([None, "Double"])
    g = _core.GraphLaunch([(a, [0, 1, 3]), (b, [1, 2])])
    assert (g.argument_count, g.kernel_count, g.instantiations, g.replays) == (4, 2, 0, 0)
    assert g.memsets == [[(1, 64)], []]
    pa, pb = g.packed(0x1000, 0x2000, 0.25, 1.5)
    assert pa[:20] == struct.pack("<QQf", 0x1000, 0x2000, 1.5)
    assert pb[:16] == struct.pack("<Qd", 0x2000, 0.25)
    assert pa[:20] == a.packed(0x1000, 0x2000, 1.5)[:20]
    with pytest.raises(KilnError, match="takes 4 arguments, got 3"):
        g.packed(1, 2, 3.0)
    with pytest.raises(KilnError, match="argument 0: expected an int device address"):
        g.packed("x", 2, 0.25, 1.5)
    with pytest.raises(KilnError, match="node 0 takes 3 arguments, got 2 indices"):
        _core.GraphLaunch([(a, [0, 1])])
    with pytest.raises(KilnError, match="argument 1 is a Pointer in one launch and a Scalar"):
        _core.GraphLaunch([(a, [0, 1, 2]), (b, [0, 1])])
    with pytest.raises(KilnError, match="used by no launch"):
        _core.GraphLaunch([(b, [0, 2])])
    with pytest.raises(KilnError, match="at least one launch"):
        _core.GraphLaunch([])
    with pytest.raises(TypeError):
        _core.GraphLaunch([(object(), [0])])


def test_scalar_values_out_of_range_are_refused_per_call():
    g = _core.GraphLaunch([(_pl([None, "Int32"]), [0, 1])])
    (p,) = g.packed(8, -5)
    assert p[:12] == struct.pack("<Qi", 8, -5)
    with pytest.raises(KilnError, match="argument 1"):
        g.packed(8, 1 << 40)
    np.testing.assert_array_equal(np.frombuffer(p[8:12], np.int32), [-5])
