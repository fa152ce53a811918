"""The ONNX Runtime lowering of ``dlite::CacheAttention`` (model/ops.py): GroupQueryAttention.

An engine exported with attention "gqa" (export/contract.py) has one ``CacheAttention`` node per
target layer, inputs (query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
query_seqlens, positions, inv_freq) and outputs (output, present_key, present_value): the inputs
and outputs of ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (query_seqlens is its input 16,
positions its position_ids, input 9), with RoPE done by the op (``do_rotary``): inv_freq becomes its
cos_cache / sin_cache (inputs 7, 8), tables over every position the engine's cache can hold, made
once per graph with the reference's arithmetic (``rotary_tables``). The inputs between (bias, norms,
quantization scales) stay empty. The node is renamed in place. Measured on ONNX Runtime 1.32: the
op's rotation of q and k differs from the reference's by at most an ulp (it fuses the multiply-adds)
and is the same for a position whatever the call's width. What the engine relies on (docs/engine.md):
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

import numpy as np
import onnx
from onnx import numpy_helper

from dlite_trt.export.recurrence import DOMAIN
from dlite_trt.model.ops import CACHE_ATTENTION_OP

ORT_DOMAIN = "com.microsoft"
ORT_OP = "GroupQueryAttention"
QUERY_SEQLENS_INPUT = 16  # GroupQueryAttention's input index of query_seqlens
COS_CACHE_INPUT, SIN_CACHE_INPUT, POSITION_IDS_INPUT = 7, 8, 9  # its rotary inputs
ROTARY_TABLES = ("rotary.cos_cache", "rotary.sin_cache")  # the initializers the lowering adds
GQA_HEAD_DIM_MULTIPLE = 8  # its CPU kernel refuses other head sizes ("head_size must be a multiple of 8")


def cache_attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == CACHE_ATTENTION_OP]


# seqlens_k, total_sequence_length, query_seqlens, positions, inv_freq: the same for every layer
SHARED_INPUTS = (5, 6, 7, 8, 9)


def lower_cache_attention(model: onnx.ModelProto, max_positions: int) -> int:
    """Make every CacheAttention node a GroupQueryAttention that also rotates (in place); returns
    how many. ``max_positions``: the positions the engine's cache can hold (the rotary tables' rows).
    The lengths (seqlens_k, total_sequence_length, query_seqlens) are computed once: every layer's
    are the same values (from the graph's past_len, the call's T and the buffers' capacity, which
    all layers share), and the exporter writes them once per layer (about 10 nodes each, dropped
    here); so are the positions and the rotary tables."""
    nodes = cache_attention_nodes(model)
    for node in nodes:
        if len(node.input) != 10 or len(node.output) != 3:
            raise ValueError(f"{CACHE_ATTENTION_OP} node {node.name} has {len(node.input)} inputs and "
                             f"{len(node.output)} outputs, expected 10 and 3")
    shared = {i: nodes[0].input[i] for i in SHARED_INPUTS} if nodes else {}  # computed before any layer's node
    if nodes:
        cos, sin = rotary_tables(_constant(model, shared[9]), max_positions)
        model.graph.initializer.extend([numpy_helper.from_array(cos, ROTARY_TABLES[0]),
                                        numpy_helper.from_array(sin, ROTARY_TABLES[1])])
    for node in nodes:
        for i, name in shared.items():
            node.input[i] = name
        *first, query_seqlens, positions, _inv_freq = node.input
        node.domain, node.op_type = ORT_DOMAIN, ORT_OP
        rotary = {COS_CACHE_INPUT: ROTARY_TABLES[0], SIN_CACHE_INPUT: ROTARY_TABLES[1], POSITION_IDS_INPUT: positions}
        node.input[:] = [*first, *[rotary.get(i, "") for i in range(len(first), QUERY_SEQLENS_INPUT)], query_seqlens]
        node.attribute.append(onnx.helper.make_attribute("do_rotary", 1))
    drop_unused_nodes(model)
    drop_unused_initializers(model)  # inv_freq, now in the tables
    if nodes and not any(op.domain == ORT_DOMAIN for op in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    if not any(n.domain == DOMAIN for n in model.graph.node):  # the decode graph: nothing of ours is left
        keep = [op for op in model.opset_import if op.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep)
    return len(nodes)


def pack_query_key_value(model: onnx.ModelProto) -> int:
    """Where a GroupQueryAttention's query, key and value are, in that order, the three outputs of one
    Split of one tensor along its last axis (a stacked q/k/v product, export/int4.py) that nothing
    else reads, give it that tensor as its packed query (key and value empty: the op's packed QKV
    input, which it reads in the same slices) and drop the Split; in place, returns how many. The
    Splits' sizes stay as initializers (``drop_unused_initializers`` takes them)."""
    graph = model.graph
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    splits = {tuple(n.output): n for n in graph.node if n.op_type == "Split"
              and next((a.i for a in n.attribute if a.name == "axis"), 0) == -1 and len(n.output) == 3}
    packed, dropped = 0, set()
    for node in graph.node:
        split = splits.get(tuple(node.input[:3])) if node.domain == ORT_DOMAIN and node.op_type == ORT_OP else None
        if split is None or any(readers[o] != 1 or o in outputs for o in split.output):
            continue
        node.input[:3] = [split.input[0], "", ""]
        dropped.add(id(split))
        packed += 1
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    return packed


def rotary_tables(inv_freq: np.ndarray, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos_cache / sin_cache [max_positions, D / 2] for RoPE inverse frequencies
    [D / 2]: the first half of ``model.ops.rope_from_inv_freq``'s, so the op rotates by the
    reference's values."""
    import torch

    from dlite_trt.model.ops import rope_from_inv_freq

    half = inv_freq.shape[0]
    cos, sin = rope_from_inv_freq(torch.arange(max_positions), torch.from_numpy(inv_freq.astype(np.float32)),
                                  torch.float32)
    return cos[:, :half].numpy(), sin[:, :half].numpy()


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of ``name``: an initializer or a Constant node's output (the exporter folds inv_freq)."""
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and list(node.output) == [name]:
            return numpy_helper.to_array(node.attribute[0].t)
    raise ValueError(f"{CACHE_ATTENTION_OP}'s inv_freq {name!r} is not a constant of the graph")


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


def drop_unused_initializers(model: onnx.ModelProto) -> int:
    """Remove the initializers no node (subgraphs included) and no graph output reads; returns how many."""
    graph = model.graph
    read = _read_names(graph.node) | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    dropped = len(graph.initializer) - len(kept)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return dropped


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
