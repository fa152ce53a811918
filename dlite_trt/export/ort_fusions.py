"""Fusions written into a graph after ONNX Runtime optimized it (``engine.build``), where its own
optimizer leaves the pattern alone.

``fuse_skip_norms``: a residual sum that feeds an RMSNorm (``SimplifiedLayerNormalization``) and the
next residual sum, as every decoder layer's two are, becomes one ``SkipSimplifiedLayerNormalization``
whose fourth output (input_skip_bias_sum) is the sum the next residual reads. ONNX Runtime's own
SkipLayerNorm fusion does not take a sum that other nodes also read, so it fuses none of them here.
The op adds the two inputs in fp32 and normalizes each row alone, as the two nodes did (measured in
docs/engine.md; the graphs' parity tests hold it to the reference).

``drop_unread_nodes``: nodes none of whose outputs anything reads. ONNX Runtime keeps them: in a
greedy graph the draft head's logits (the recurrence node's second output, unread there) were still
stacked into a [B, K, V] tensor per step call after the function was inlined (75 us of SmolLM2's
fp32 step). Nodes with subgraphs or in other domains than ONNX's and ONNX Runtime's stay.
"""

from __future__ import annotations

import onnx
from onnx import helper

ORT_DOMAIN = "com.microsoft"


def fuse_skip_norms(model: onnx.ModelProto) -> int:
    """Fuse every Add -> SimplifiedLayerNormalization (last axis, the Add's only normalization) in
    place; returns how many."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    norms: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
            norms.setdefault(node.input[0], []).append(node)
    fused: dict[int, onnx.NodeProto] = {}  # id(the Add) -> the fused node, at the Add's place (its inputs exist)
    dropped: set[int] = set()
    for name, readers in norms.items():
        add = producers.get(name)
        if add is None or add.op_type != "Add" or len(readers) != 1:
            continue
        norm = readers[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        if attrs.get("axis", -1) != -1 or len(norm.output) > 1 and norm.output[1]:
            continue  # another axis, or its inv_std_var is read: not the pattern
        fused[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.output[0]}/SkipSimplifiedLayerNormalization",
            domain=ORT_DOMAIN, epsilon=attrs.get("epsilon", 1e-5))
        dropped.add(id(norm))
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    if fused and not any(o.domain == ORT_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return len(fused)


def drop_unread_nodes(model: onnx.ModelProto) -> int:
    """Remove, in place and until none is left, every node of the main graph whose outputs are neither
    read by a node nor graph outputs, then the initializers nothing reads any more; returns how many
    nodes. Only ops without side effects: ONNX's and ONNX Runtime's, none holding a subgraph."""
    graph = model.graph
    removed = 0
    while True:
        read = {o.name for o in graph.output} | _reads(graph)
        unread = [n for n in graph.node if n.domain in ("", "ai.onnx", ORT_DOMAIN) and not _subgraphs(n)
                  and not any(o in read for o in n.output if o)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
        removed += len(unread)
    if removed:
        kept = [i for i in graph.initializer if i.name in read]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return removed


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` reads, nodes of its subgraphs included (they read outer names)."""
    return {i for n in graph.node for i in n.input if i} | {i for n in graph.node for g in _subgraphs(n)
                                                             for i in _reads(g)}
