"""The fusions written into a graph after ONNX Runtime optimized it (export/ort_fusions.py), run on
real ONNX Runtime: a residual sum feeding an RMSNorm and the next residual becomes one
SkipSimplifiedLayerNormalization whose sum output the next residual reads; the same outputs as the
two nodes (within fp32 rounding; the engine graphs' parity tests hold whole graphs to the
reference); a sum normalized twice, or a norm whose inv_std_var is read, is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from dlite_trt.export.ort_fusions import ORT_DOMAIN, drop_unread_nodes, fuse_skip_norms

H = 64


def _layer_graph(second_norm: bool = False) -> onnx.ModelProto:
    """x -> s1 = x + a -> n1 = RMSNorm(s1) -> s2 = s1 + n1 * 2 -> n2 = RMSNorm(s2); outputs n2, s2."""
    norm = dict(epsilon=1e-5, axis=-1)
    nodes = [helper.make_node("Add", ["x", "a"], ["s1"]),
             helper.make_node("SimplifiedLayerNormalization", ["s1", "w1"], ["n1"], **norm),
             helper.make_node("Mul", ["n1", "two"], ["m"]),
             helper.make_node("Add", ["s1", "m"], ["s2"]),
             helper.make_node("SimplifiedLayerNormalization", ["s2", "w2"], ["n2"], **norm)]
    outputs = ["n2", "s2"]
    if second_norm:  # s2 normalized twice: not the pattern
        nodes.append(helper.make_node("SimplifiedLayerNormalization", ["s2", "w1"], ["n3"], **norm))
        outputs.append("n3")
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, H).astype(np.float32), n) for n in ("w1", "w2")]
    inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "T", H])
                                           for n in ("x", "a")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # what the graph says, no more
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)


def test_residual_norms_fuse_with_their_sums_kept() -> None:
    rng = np.random.default_rng(1)
    feed = {n: rng.standard_normal((1, 5, H)).astype(np.float32) for n in ("x", "a")}
    model = _layer_graph()
    want = _run(model, feed)
    assert fuse_skip_norms(model) == 2
    ops = [(n.op_type, n.domain) for n in model.graph.node]
    assert ops == [("SkipSimplifiedLayerNormalization", ORT_DOMAIN), ("Mul", ""),
                   ("SkipSimplifiedLayerNormalization", ORT_DOMAIN)]
    assert [list(n.output) for n in model.graph.node if n.op_type.startswith("Skip")] == [
        ["n1", "", "", "s1"], ["n2", "", "", "s2"]]
    got = _run(model, feed)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_a_sum_normalized_twice_is_left_alone() -> None:
    model = _layer_graph(second_norm=True)
    assert fuse_skip_norms(model) == 1  # the first sum only
    assert sum(n.op_type == "Add" for n in model.graph.node) == 1


def test_nodes_nothing_reads_are_dropped_with_their_initializers() -> None:
    """A chain whose end nothing reads goes, node by node back to the graph's inputs, with the
    initializers only it read; what the outputs need stays, and the outputs are unchanged."""
    model = _layer_graph()
    graph = model.graph
    graph.node.extend([helper.make_node("Mul", ["s1", "dead_w"], ["d1"]),
                       helper.make_node("Relu", ["d1"], ["d2"]),
                       helper.make_node("Concat", ["d2", "s2"], ["d3"], axis=-1)])
    graph.initializer.append(numpy_helper.from_array(np.full(H, 3.0, np.float32), "dead_w"))
    feed = {n: np.random.default_rng(1).standard_normal((1, 3, H)).astype(np.float32) for n in ("x", "a")}
    before = _run(model, feed)
    assert drop_unread_nodes(model) == 3
    assert [n.op_type for n in graph.node] == [n.op_type for n in _layer_graph().graph.node]
    assert "dead_w" not in {i.name for i in graph.initializer} and {"w1", "w2", "two"} <= {i.name for i in graph.initializer}
    for got, want in zip(_run(model, feed), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert drop_unread_nodes(model) == 0
