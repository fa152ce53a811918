"""Export one engine graph to ONNX (torch.onnx.export, TorchScript exporter) and lower it.

Names, dynamic axes and the trace inputs come from the graph's contract. The trace shapes are
deliberately odd (batch 2, chunk 3, cache 7, a step verifying 2 drafts and drafting 3) so that
parity tests at other shapes prove the dims are really dynamic. Weights go to one external data file next to the graph, so targets
above protobuf's 2 GB limit export.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from dlite_trt.export.cache_attention import lower_cache_attention
from dlite_trt.export.contract import GraphSpec, dummy_inputs
from dlite_trt.export.graphs import graph_module
from dlite_trt.export.recurrence import (
    DOMAIN,
    OP_VERSION,
    OPSET,
    lower_for_onnxruntime,
    lower_for_tensorrt,
    recurrence_function,
)
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter

LOWERINGS = ("onnxruntime", "tensorrt")
TRACE_SIZES = {"batch": 2, "chunk": 3, "outputs": 2, "cache": 7, "verify": 3, "next": 4}


def trace_inputs(graph: GraphSpec, vocab_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Contract-valid inputs at TRACE_SIZES; the model-precision ones (the KV cache) in ``dtype``
    (numpy has no bfloat16, so dummy_inputs gives float32 there)."""
    feeds = dummy_inputs(graph, {d.name: TRACE_SIZES[d.name] for d in graph.dims}, vocab_size=vocab_size,
                         rng=np.random.default_rng(0), check=False)
    return tuple(torch.from_numpy(a).to(dtype) if t.dtype in ("float16", "bfloat16") else torch.from_numpy(a)
                 for a, t in zip(feeds.values(), graph.inputs, strict=True))


def _declare_output_shapes(model: onnx.ModelProto, graph: GraphSpec) -> None:
    """Write the contract's output dims (static sizes, dim names) into the graph outputs (the tracer
    invents names like ``Concatnew_key_dim_4`` for dims it cannot prove static)."""
    for value in model.graph.output:
        dims = value.type.tensor_type.shape.dim
        spec = graph.tensor(value.name)
        if len(dims) != len(spec.dims):
            raise ValueError(f"{graph.name}: output {value.name} has rank {len(dims)}, the contract says {spec.dims}")
        for dim, want in zip(dims, spec.dims, strict=True):
            dim.Clear()
            if isinstance(want, str):
                dim.dim_param = want
            else:
                dim.dim_value = want


def _constants_as_initializers(model: onnx.ModelProto, tables: dict[str, torch.Tensor]) -> None:
    """The tracer inlines non-persistent buffers (the draft head's ``target_to_draft`` [V]) as Constant
    nodes; make each Constant equal to one of ``tables`` (name -> tensor) that initializer instead, named as
    the buffer and stored (once) with the weights (in place). Equal values: the graph computes the same."""
    arrays = {name: t.detach().cpu().numpy() for name, t in tables.items()}

    def table_of(node: onnx.NodeProto) -> str | None:
        if node.op_type != "Constant" or [a.name for a in node.attribute] != ["value"]:
            return None
        value = numpy_helper.to_array(node.attribute[0].t)
        return next((n for n, a in arrays.items() if value.shape == a.shape and value.dtype == a.dtype
                     and np.array_equal(value, a)), None)

    renames = {node.output[0]: name for node in model.graph.node if (name := table_of(node)) is not None}
    kept = [node for node in model.graph.node if node.output[0] not in renames]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    for node in model.graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
    for name in sorted(set(renames.values())):
        model.graph.initializer.append(numpy_helper.from_array(arrays[name], name))


def _head_tables(module: torch.nn.Module, draft: DLiteDraft) -> dict[str, torch.Tensor]:
    """The draft head's derived buffers by their names in ``module`` (none without a draft vocabulary)."""
    head = draft.sequential_head
    if head.target_to_draft is None:
        return {}
    return {name: b for name, b in module.named_buffers() if b is head.target_to_draft}


def export_graph(graph: GraphSpec, target: TargetAdapter, draft: DLiteDraft, path: Path, *,
                 lowering: str = "onnxruntime") -> Path:
    """Write ``path`` (+ ``path.data`` with the weights); returns ``path``."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    module = graph_module(graph, target, draft)
    if module.writes_cache and lowering != "onnxruntime":
        raise ValueError(f"graph {graph.name}: attention \"gqa\" is ONNX Runtime's GroupQueryAttention, not for {lowering}")
    dtype = target.embed_weight.dtype
    args = trace_inputs(graph, target.spec.vocab_size, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "graph.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings of the boundary shape checks
            torch.onnx.export(module, args, str(raw), dynamo=False, opset_version=OPSET,
                              input_names=graph.input_names, output_names=graph.output_names,
                              dynamic_axes=graph.dynamic_axes(),
                              custom_opsets={DOMAIN: OP_VERSION} if module.uses_draft or module.writes_cache
                              else None,
                              do_constant_folding=True)
        model = onnx.load(str(raw), load_external_data=False)
        _declare_output_shapes(model, graph)
        if module.writes_cache:
            lower_cache_attention(model, max_positions=graph.dim("cache").max)
        if module.uses_draft and (tables := _head_tables(module, draft)):
            _constants_as_initializers(model, tables)
        if module.uses_draft and lowering == "onnxruntime":
            body = recurrence_function(draft.sequential_head, draft.cfg.num_proposals,
                                       draft.cfg.anchor_group_size > 1, module.sampling, dtype)
            lower_for_onnxruntime(model, body)
        elif module.uses_draft:
            lower_for_tensorrt(model)
        # decode has no draft: its lowerings differ only in the attention ("gqa": ONNX Runtime only)
        onnx.load_external_data_for_model(model, tmp)
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    return path
