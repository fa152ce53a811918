"""The ``LowRankRecurrence`` node: the draft's K-step sequential head as ONE graph node.

Its identity (domain, op name, version) and the TensorRT plugin's name, namespace and version
are defined here once; the TensorRT plugin (plugins/lowrank_recurrence) imports them.

Node contract (inputs in this order, outputs, attributes). Tokens are rows of the head's
vocabulary: the target's V ids, or with a reduced draft vocabulary its V_d rows (then V below is
V_d, and the graph maps target ids to rows before the node and rows back after it):
    draft_hidden [B, D, H] float   the backbone's output at the block's first D positions
    anchor       [B] int64         prev token of step 1
    seed_prev    [B] int64         token before the anchor (read only when seeded = 1)
    temperature  [B] float32       <= 1e-5: argmax, else inverse-CDF sample of softmax(logits / T)
                                   (read only when sampling = 1; greedy graphs pass zeros)
    uniforms     [B, D] float32    one uniform in [0, 1) per step (read only when sampling = 1)
    prev_token_embedding [V, r], state_proj_weight [2r, 2r], state_proj_bias [2r],
    state_hidden_mlp_weight [r, r + H], state_hidden_mlp_bias [r], output_proj_weight [V, r]
  -> tokens [B, D] int64, logits [B, D, V] float32
    attributes: num_steps = K (the most steps: D <= K is draft_hidden's dim 1, known at run time;
    a greedy step drafts only what the next step verifies), seeded = 1 when G > 1, sampling = 1 in
    the sampling graphs (0: every token is the argmax and the logits output may go unused)

Two lowerings, chosen after export:
- ONNX Runtime: the model carries an ONNX function of that name whose body is the reference
  ``recurrence`` exported with standard ops (K steps unrolled); ORT inlines it.
- TensorRT: a plain node in the default domain with ``plugin_namespace``/``plugin_version``
  attributes, which TensorRT's ONNX parser maps to the registered plugin of that name.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from dlite_trt.model.sequential_head import HeadOutput, HeadWeights, SequentialHead, recurrence

DOMAIN = "dlite"
OP_NAME = "LowRankRecurrence"
OP_VERSION = 1
PLUGIN_NAME = OP_NAME
PLUGIN_NAMESPACE = DOMAIN
PLUGIN_VERSION = "1"
OPSET = 18  # the standard-op opset of every engine graph and of the function body

INPUT_NAMES = ("draft_hidden", "anchor", "seed_prev", "temperature", "uniforms", *HeadWeights._fields)
OUTPUT_NAMES = ("tokens", "logits")
ATTRIBUTES = ("num_steps", "seeded", "sampling")
# The TensorRT plugin node also carries the head's rank (its kernel is compiled for it) and
# three more outputs: the kernel's per-sequence workspace [B, 2, r] fp32 (state and latent), and
# two one-byte slots for the pointers OpenAI Triton appends to every kernel's parameters (its
# global and profile scratch, unused by this kernel): TensorRT launches an ahead-of-time kernel
# with one pointer per plugin output, so each slot makes it pass the pointer the kernel expects.
TRT_ATTRIBUTES = ("rank",)
TRT_WORKSPACE = "workspace"
TRT_ABI_SLOTS = ("triton_global_scratch", "triton_profile_scratch")
TRT_EXTRA_OUTPUTS = (TRT_WORKSPACE, *TRT_ABI_SLOTS)


class _RecurrenceOp(torch.autograd.Function):
    """Runs the reference recurrence; exports as one ``dlite::LowRankRecurrence`` node.

    ``num_steps`` (K, the most steps) and ``vocab`` (V) are passed as Python ints so that the node's
    attributes and its outputs' vocabulary dim are static; the steps D (dim 1) are dynamic.
    """

    @staticmethod
    def forward(ctx, draft_hidden, anchor, seed_prev, temperature, uniforms, num_steps, vocab, seeded, sampling,
                *weights):
        return _run(HeadWeights(*weights), draft_hidden, anchor, seed_prev, temperature, uniforms, seeded, sampling,
                    num_steps)

    @staticmethod
    def symbolic(g, draft_hidden, anchor, seed_prev, temperature, uniforms, num_steps, vocab, seeded, sampling,
                 *weights):
        tokens, logits = g.op(f"{DOMAIN}::{OP_NAME}", draft_hidden, anchor, seed_prev, temperature, uniforms,
                              *weights, num_steps_i=num_steps, seeded_i=int(seeded), sampling_i=int(sampling),
                              outputs=2)
        tensor_type = torch._C.TensorType.get()
        tokens.setType(tensor_type.with_dtype(torch.int64).with_sizes([None, None]))
        logits.setType(tensor_type.with_dtype(torch.float32).with_sizes([None, None, vocab]))
        return tokens, logits


def _run(w: HeadWeights, draft_hidden, anchor, seed_prev, temperature, uniforms, seeded: bool,
         sampling: bool, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's semantics: the reference recurrence with the node's flags applied, written out for
    ``num_steps`` steps (draft_hidden's D <= num_steps of them do work)."""
    out = recurrence(w, draft_hidden, anchor, seed_prev if seeded else None,
                     temperature if sampling else 0.0, uniforms if sampling else None, steps=num_steps)
    return out.tokens, out.logits.float()


def low_rank_recurrence(head: SequentialHead, draft_hidden: torch.Tensor, anchor: torch.Tensor,
                        seed_prev: torch.Tensor | None, temperature: torch.Tensor | None,
                        uniforms: torch.Tensor | None, num_steps: int) -> HeadOutput:
    """The head's D steps over draft_hidden [B, D, H] (greedy when ``temperature`` is None; D at most
    ``num_steps``, the block's K); one custom node when traced for ONNX export, the reference otherwise.
    Tokens [B, D] are target ids and logits [B, D, V] span the target vocabulary: with a draft
    vocabulary the node works in draft rows (its ``vocab`` is V_d) and the head's standard-op mapping
    surrounds it (``SequentialHead.mapped``)."""
    if not torch.onnx.is_in_onnx_export():
        out = head(draft_hidden, anchor, seed_prev, 0.0 if temperature is None else temperature, uniforms)
        return HeadOutput(out.tokens, out.logits.float())
    seeded, sampling = seed_prev is not None, temperature is not None
    if not sampling:  # the node's inputs are fixed; greedy graphs feed zeros it does not read
        temperature = torch.zeros_like(draft_hidden[:, 0, 0], dtype=torch.float32)  # [B]
        uniforms = torch.zeros_like(draft_hidden[:, :, 0], dtype=torch.float32)  # [B, D]
    rows = int(head.output_proj.weight.shape[0])  # V, or V_d with a draft vocabulary

    def node(anchor_row: torch.Tensor, seed_row: torch.Tensor | None) -> HeadOutput:
        tokens, logits = _RecurrenceOp.apply(draft_hidden, anchor_row, seed_row if seeded else anchor_row,
                                             temperature, uniforms, num_steps, rows, seeded, sampling, *head.weights())
        return HeadOutput(tokens, logits)

    return head.mapped(node, anchor, seed_prev)


class _Body(nn.Module):
    """The node's semantics with weights as inputs, exported to become the function body."""

    def __init__(self, seeded: bool, sampling: bool, num_steps: int) -> None:
        super().__init__()
        self.seeded, self.sampling, self.num_steps = seeded, sampling, num_steps

    def forward(self, draft_hidden, anchor, seed_prev, temperature, uniforms, *weights):
        return _run(HeadWeights(*weights), draft_hidden, anchor, seed_prev, temperature, uniforms, self.seeded,
                    self.sampling, self.num_steps)


def recurrence_function(head: SequentialHead, num_steps: int, seeded: bool, sampling: bool,
                        dtype: torch.dtype) -> onnx.FunctionProto:
    """An ONNX function ``dlite.LowRankRecurrence`` whose body is the reference recurrence.

    The body is exported from ``recurrence`` itself (batch and steps D dynamic, K steps written
    out, those past D empty), so the ONNX Runtime lowering cannot drift from the reference.
    Inputs the body does not read (seed_prev when not seeded, temperature/uniforms when greedy)
    stay in its signature.
    """
    b = 2
    args = (
        torch.zeros(b, num_steps, head.hidden_size, dtype=dtype),
        torch.zeros(b, dtype=torch.long),
        torch.zeros(b, dtype=torch.long),
        torch.zeros(b, dtype=torch.float32),
        torch.zeros(b, num_steps, dtype=torch.float32),
        *(w.detach() for w in head.weights()),
    )
    dynamic = {name: {0: "batch"} for name in INPUT_NAMES[:5]} | {name: {0: "batch"} for name in OUTPUT_NAMES}
    for name in ("draft_hidden", "uniforms", *OUTPUT_NAMES):  # the steps D <= num_steps
        dynamic[name][1] = "steps"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the shape checks; unused inputs
        path = Path(tmp) / "body.onnx"
        torch.onnx.export(_Body(seeded, sampling, num_steps), args, str(path), dynamo=False, opset_version=OPSET,
                          input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES), dynamic_axes=dynamic,
                          do_constant_folding=False)
        graph = onnx.load(str(path)).graph
    constants = [onnx.helper.make_node("Constant", [], [init.name], value=init, name=f"const/{init.name}")
                 for init in graph.initializer]
    return onnx.helper.make_function(
        DOMAIN, OP_NAME, list(INPUT_NAMES), list(OUTPUT_NAMES), [*constants, *graph.node],
        [onnx.helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES))


def recurrence_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_NAME]


def lower_for_onnxruntime(model: onnx.ModelProto, body: onnx.FunctionProto) -> None:
    """Attach the standard-op body as a model-local function (in place)."""
    if not recurrence_nodes(model):
        raise ValueError(f"the graph has no {OP_NAME} node to lower")
    del model.functions[:]
    model.functions.append(body)


def lower_for_tensorrt(model: onnx.ModelProto) -> None:
    """Turn each recurrence node into a plugin node for TensorRT's ONNX parser (in place)."""
    nodes = recurrence_nodes(model)
    if not nodes:
        raise ValueError(f"the graph has no {OP_NAME} node to lower")
    initializers = {i.name: i for i in model.graph.initializer}
    for node in nodes:
        embedding = initializers.get(node.input[INPUT_NAMES.index("prev_token_embedding")])
        if embedding is None:
            raise ValueError(f"{OP_NAME}: prev_token_embedding is not a graph initializer; its rank is unknown")
        node.domain = ""
        node.attribute.extend([onnx.helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                               onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION),
                               onnx.helper.make_attribute("rank", int(embedding.dims[1]))])
        node.output.extend(f"{node.output[0]}_{name}" for name in TRT_EXTRA_OUTPUTS)
    del model.functions[:]
    keep = [op for op in model.opset_import if op.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
