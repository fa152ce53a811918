"""The reference model is export-friendly: the draft block and the target adapter trace to ONNX
with dynamic batch/lengths, and ONNX Runtime matches PyTorch at shapes other than the traced
ones. (The engine graphs themselves are built by the export issue; this guards the property.)
Tier: fp32, one graph vs eager ~1e-5; draft tokens exact."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from helpers import draft_config, make_target, random_draft

from dlite_trt.model.target import TargetAdapter


def export_and_run(module, trace_args, run_args, names, outputs, dynamic_axes, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings for the input-shape checks
        torch.onnx.export(module, trace_args, str(path), dynamo=False, opset_version=18, input_names=names,
                          output_names=outputs, dynamic_axes=dynamic_axes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: a.numpy() for n, a in zip(names, run_args, strict=True)})
    with torch.no_grad():
        want = module(*run_args)
    return got, [w.numpy() for w in want if isinstance(w, torch.Tensor)]  # an empty tuple field exports nothing


class _DraftBlock(torch.nn.Module):
    def __init__(self, draft, embed):
        super().__init__()
        self.draft, self.embed = draft, embed

    def forward(self, chs, group, group_len):
        out = self.draft(chs, group, group_len, self.embed)
        return out.tokens, out.logits


def test_draft_block_exports(tmp_path):
    hf, spec = make_target(64, seed=0)
    cfg = draft_config(spec, block_size=8, anchor_group_size=2)
    module = _DraftBlock(random_draft(cfg), hf.model.embed_tokens.weight.detach()).eval()
    trace = (torch.randn(2, 3, 64), torch.randint(0, 64, (2, 2)), torch.tensor([2, 2]))
    run = (torch.randn(5, 3, 64), torch.randint(0, 64, (5, 2)), torch.tensor([2, 1, 2, 2, 1]))
    got, want = export_and_run(module, trace, run, ["chs", "group", "group_len"], ["tokens", "logits"],
                               {"chs": {0: "b"}, "group": {0: "b"}, "group_len": {0: "b"}}, tmp_path / "d.onnx")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)


def test_target_adapter_exports(tmp_path):
    hf, spec = make_target(64, seed=0)
    module = TargetAdapter(hf, spec, (0, 1, 3)).eval()
    kv = (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim)

    def args(b, t, p, r):
        return (torch.randint(0, 64, (b, t)), (p + torch.arange(t)).expand(b, -1).contiguous(),
                torch.randn(kv[0], b, kv[1], p, kv[2]), torch.randn(kv[0], b, kv[1], p, kv[2]),
                torch.full((b,), p), torch.arange(t - r, t).expand(b, -1).contiguous())

    names = ["input_ids", "positions", "past_k", "past_v", "past_len", "output_index"]
    dyn = {"input_ids": {0: "b", 1: "t"}, "positions": {0: "b", 1: "t"}, "past_k": {1: "b", 3: "p"},
           "past_v": {1: "b", 3: "p"}, "past_len": {0: "b"}, "output_index": {0: "b", 1: "r"}}
    got, want = export_and_run(module, args(2, 5, 3, 1), args(3, 8, 11, 8), names,
                               ["logits", "hidden", "new_k", "new_v"], dyn, tmp_path / "t.onnx")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_shape_plumbing_does_not_grow_with_layers(tmp_path):
    """Reshapes export with constant shapes and static sizes as constants: the Shape ops of the
    exported target are per graph (inputs, masks), none per layer. At the tiny sizes of CI those
    chains of Shape -> Gather -> Unsqueeze -> Concat cost more per call than the matmuls."""
    shape_ops = []
    for layers in (2, 4):
        hf, spec = make_target(64, seed=0, num_hidden_layers=layers)
        module = TargetAdapter(hf, spec, (0, layers - 1)).eval()
        kv = (layers, 2, spec.num_key_value_heads, 7, spec.head_dim)
        args = (torch.randint(0, 64, (2, 3)), torch.arange(3).expand(2, -1).contiguous(), torch.randn(kv),
                torch.randn(kv), torch.full((2,), 7), torch.arange(3).expand(2, -1).contiguous())
        names = ["input_ids", "positions", "past_k", "past_v", "past_len", "output_index"]
        dyn = {"input_ids": {0: "b", 1: "t"}, "positions": {0: "b", 1: "t"}, "past_k": {1: "b", 3: "p"},
               "past_v": {1: "b", 3: "p"}, "past_len": {0: "b"}, "output_index": {0: "b", 1: "r"}}
        path = tmp_path / f"t{layers}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=18, input_names=names,
                              output_names=["logits", "hidden", "new_k", "new_v"], dynamic_axes=dyn)
        shape_ops.append(sum(n.op_type == "Shape" for n in onnx.load(str(path)).graph.node))
    assert shape_ops[0] == shape_ops[1], f"Shape ops with 2 and 4 layers: {shape_ops}"
