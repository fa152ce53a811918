"""Export one engine graph to ONNX (torch.onnx.export, TorchScript exporter) and lower it.

Names, dynamic axes and the trace inputs come from the graph's contract. The trace shapes are
deliberately odd (batch 2, chunk 3, cache 7, a step verifying 2 drafts) so that parity tests at other shapes prove the
dims are really dynamic. Weights go to one external data file next to the graph, so targets
above protobuf's 2 GB limit export.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

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
TRACE_SIZES = {"batch": 2, "chunk": 3, "outputs": 2, "cache": 7, "verify": 3}


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


def export_graph(graph: GraphSpec, target: TargetAdapter, draft: DLiteDraft, path: Path, *,
                 lowering: str = "onnxruntime") -> Path:
    """Write ``path`` (+ ``path.data`` with the weights); returns ``path``."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    module = graph_module(graph, target, draft)
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
                              custom_opsets={DOMAIN: OP_VERSION} if module.uses_draft else None,
                              do_constant_folding=True)
        model = onnx.load(str(raw), load_external_data=False)
        _declare_output_shapes(model, graph)
        if module.uses_draft and lowering == "onnxruntime":
            body = recurrence_function(draft.sequential_head, draft.cfg.num_proposals,
                                       draft.cfg.anchor_group_size > 1, module.sampling, dtype)
            lower_for_onnxruntime(model, body)
        elif module.uses_draft:
            lower_for_tensorrt(model)
        # decode has no draft: both lowerings are the same standard-op graph
        onnx.load_external_data_for_model(model, tmp)
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    return path
