"""The ONNX Runtime lowering of ``dlite::CacheAttention`` (model/ops.py): GroupQueryAttention.

An engine exported with attention "gqa" (export/contract.py) has one ``CacheAttention`` node per
target layer, inputs (query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
query_seqlens) and outputs (output, present_key, present_value): exactly the inputs and outputs
of ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (query_seqlens is its input 16; the ones
between, rotary caches, bias, norms, quantization scales, stay empty). The node is renamed in
place. What the engine relies on (measured on ONNX Runtime 1.32, docs/engine.md):
- with present_* bound to the memory of past_* (``runtime.ort_runner``) the op writes row b's
  new entries at slots seqlens_k[b] + 1 - query_seqlens[b] .. seqlens_k[b] and reads the past
  from the buffer: no cache-sized copy per call;
- query_seqlens (every row's T, every row counted valid: a row of 0 or 1 valid tokens would take
  other kernels) lets batches of several multi-token rows on a cache run; total_sequence_length
  is then only an upper bound (the buffer's capacity);
- every key is read from its own slot, so a verify's row j equals, bitwise, a two-token call at
  that position (``tests/test_call_rows.py``).
"""

from __future__ import annotations

import functools

import onnx

from dlite_trt.export.recurrence import DOMAIN
from dlite_trt.model.ops import CACHE_ATTENTION_OP

ORT_DOMAIN = "com.microsoft"
ORT_OP = "GroupQueryAttention"
QUERY_SEQLENS_INPUT = 16  # GroupQueryAttention's input index of query_seqlens
GQA_HEAD_DIM_MULTIPLE = 8  # its CPU kernel refuses other head sizes ("head_size must be a multiple of 8")


def cache_attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == CACHE_ATTENTION_OP]


SHARED_INPUTS = (5, 6, 7)  # seqlens_k, total_sequence_length, query_seqlens: the same for every layer


def lower_cache_attention(model: onnx.ModelProto) -> int:
    """Make every CacheAttention node a GroupQueryAttention (in place); returns how many. The
    lengths (seqlens_k, total_sequence_length, query_seqlens) are computed once: every layer's are
    the same values (from the graph's past_len, the call's T and the buffers' capacity, which all
    layers share), and the exporter writes them once per layer (about 10 nodes each, dropped here)."""
    nodes = cache_attention_nodes(model)
    for node in nodes:
        if len(node.input) != 8 or len(node.output) != 3:
            raise ValueError(f"{CACHE_ATTENTION_OP} node {node.name} has {len(node.input)} inputs and "
                             f"{len(node.output)} outputs, expected 8 and 3")
    shared = {i: nodes[0].input[i] for i in SHARED_INPUTS} if nodes else {}  # computed before any layer's node
    for node in nodes:
        for i, name in shared.items():
            node.input[i] = name
        *first, query_seqlens = node.input
        node.domain, node.op_type = ORT_DOMAIN, ORT_OP
        node.input[:] = [*first, *[""] * (QUERY_SEQLENS_INPUT - len(first)), query_seqlens]
    drop_unused_nodes(model)
    if nodes and not any(op.domain == ORT_DOMAIN for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    if not any(n.domain == DOMAIN for n in model.graph.node):  # the decode graph: nothing of ours is left
        keep = [op for op in model.opset_import if op.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    return len(nodes)


def drop_unused_nodes(model: onnx.ModelProto) -> int:
    """Remove the nodes none of whose outputs is read (by a node or as a graph output), until none is
    left; returns how many."""
    graph, dropped = model.graph, 0
    while True:
        read = _read_names(graph.node) | {o.name for o in graph.output}
        kept = [n for n in graph.node if any(o in read for o in n.output)]
        if len(kept) == len(graph.node):
            return dropped
        dropped += len(graph.node) - len(kept)
        del graph.node[:]
        graph.node.extend(kept)


def _read_names(nodes) -> set[str]:
    """Every value name the nodes read, their subgraphs' (If, Loop, Scan bodies) reads included."""
    read = set()
    for n in nodes:
        read.update(n.input)
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                read |= _read_names(sub.node)
    return read


@functools.cache
def onnxruntime_takes_query_seqlens() -> bool:
    """Whether the installed ONNX Runtime's GroupQueryAttention has query_seqlens (its input 16),
    which attention "gqa" needs (older versions refuse batches of multi-token rows on a cache)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    schemas = [s for s in ort_state.get_all_operator_schema() if (s.domain, s.name) == (ORT_DOMAIN, ORT_OP)]
    return any(len(s.inputs) > QUERY_SEQLENS_INPUT and s.inputs[QUERY_SEQLENS_INPUT].name == "query_seqlens"
               for s in schemas)


GQA_UNAVAILABLE = ("the installed onnxruntime's GroupQueryAttention has no query_seqlens input (attention \"gqa\" "
                   "needs it; 1.32 has it): upgrade onnxruntime, or build with --attention ops")
