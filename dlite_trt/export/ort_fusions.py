"""Fusions written into a graph after ONNX Runtime optimized it (``engine.build``), where its own
optimizer leaves the pattern alone.

``fuse_skip_norms``: a residual sum that feeds an RMSNorm (``SimplifiedLayerNormalization``) and the
next residual sum, as every decoder layer's two are, becomes one ``SkipSimplifiedLayerNormalization``
whose fourth output (input_skip_bias_sum) is the sum the next residual reads. ONNX Runtime's own
SkipLayerNorm fusion does not take a sum that other nodes also read, so it fuses none of them here.
The op adds the two inputs in fp32 and normalizes each row alone, as the two nodes did (measured in
docs/engine.md; the graphs' parity tests hold it to the reference).
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
