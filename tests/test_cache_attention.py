"""Attention "gqa": each target layer's attention over the KV cache as ONNX Runtime's
GroupQueryAttention, writing the call's entries into the cache buffer in place
(``model.ops.cache_attention``, ``export/cache_attention.py``).

Checked on every graph against the eager module with standard-op attention (attention "ops",
the reference's arithmetic): every contract output within the fp32 tier, and the cache buffers,
run as the runtime runs them (present_* bound to the memory of past_*), equal to the inputs with
exactly the eager new entries written at each row's slots and every other slot untouched. Also:
the lowered nodes, and where "gqa" is refused or chosen by default.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import ARCH_TARGETS, draft_config, make_target, random_draft

from dlite_trt.engine.build import BuildSettings, default_attention, resolve
from dlite_trt.errors import ConfigError
from dlite_trt.export.cache_attention import ORT_DOMAIN, ORT_OP, QUERY_SEQLENS_INPUT
from dlite_trt.export.contract import GRAPH_NAMES, EngineLimits, dummy_inputs, engine_contract, kv_input
from dlite_trt.export.graphs import graph_module
from dlite_trt.export.onnx_export import export_graph
from dlite_trt.export.recurrence import DOMAIN
from dlite_trt.runtime.ort_runner import run_in_place
from dlite_trt.model.target import TargetAdapter

VOCAB = 96
LIMITS = EngineLimits(max_batch=4, max_seq_len=64, max_chunk=16)
FLOAT_ATOL = 1e-4  # the fp32 tier of tests/test_engine_graphs.py
SIZES = [{"batch": 3, "chunk": 5, "cache": 40, "outputs": 2, "verify": 4},
         {"batch": 1, "chunk": 2, "cache": 20, "outputs": 1, "verify": 2}]


class Pair:
    def __init__(self, root, **arch) -> None:
        hf, spec = make_target(VOCAB, seed=0, initializer_range=0.1, **arch)
        cfg = draft_config(spec, block_size=8, anchor_group_size=2)
        self.draft = random_draft(cfg)
        self.target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
        self.ops = engine_contract(spec, cfg, LIMITS)
        self.gqa = engine_contract(spec, cfg, LIMITS, attention="gqa")
        self.root = root
        self.layers = spec.num_hidden_layers

    def export(self, graph: str):
        return export_graph(self.gqa[graph], self.target, self.draft, self.root / f"{graph}.onnx")


@pytest.fixture(scope="module", params=["qwen3", *ARCH_TARGETS])
def pair(request, tmp_path_factory) -> Pair:
    arch = {} if request.param == "qwen3" else ARCH_TARGETS[request.param]
    return Pair(tmp_path_factory.mktemp(request.param), **arch)


@pytest.mark.parametrize("graph", GRAPH_NAMES)
def test_gqa_graph_matches_eager_standard_ops(pair: Pair, graph: str) -> None:
    path = pair.export(graph)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for sizes in SIZES:
        spec = pair.ops[graph]
        feed = dummy_inputs(spec, {d.name: sizes[d.name] for d in spec.dims}, vocab_size=VOCAB, rng=rng)
        with torch.no_grad():
            outs = graph_module(spec, pair.target, pair.draft)(*(torch.from_numpy(feed[n]) for n in spec.input_names))
        want = {n: t.numpy() for n, t in zip(spec.output_names, outs, strict=True)}
        buffers = {name: value.copy() for name, value in feed.items() if kv_input(name) is not None}
        got = run_in_place(session, pair.gqa[graph], feed | buffers)
        assert set(got) == set(want)
        for name, value in want.items():
            where = f"{graph}.{name} at {sizes}"
            assert got[name].shape == value.shape and got[name].dtype == value.dtype, where
            if np.issubdtype(value.dtype, np.integer):
                np.testing.assert_array_equal(got[name], value, err_msg=where)
            else:
                np.testing.assert_allclose(got[name], value, rtol=0, atol=FLOAT_ATOL, err_msg=where)
        width = want["new_key"].shape[3]
        for layer in range(pair.layers):
            for kind in ("key", "value"):
                name = f"past_{kind}.{layer}"
                expected = feed[name].copy()
                for row, start in enumerate(feed["past_len"]):  # the call's entries at the row's own slots
                    expected[row, :, start:start + width] = got[f"new_{kind}"][layer, row]
                assert np.array_equal(buffers[name], expected), f"{graph} {name} at {sizes}"


def test_lowered_nodes(pair: Pair) -> None:
    for graph in GRAPH_NAMES:
        model = onnx.load(str(pair.export(graph)), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == ORT_OP]
        assert len(nodes) == pair.layers and all(n.domain == ORT_DOMAIN for n in nodes)
        for layer, node in enumerate(nodes):
            assert len(node.input) == QUERY_SEQLENS_INPUT + 1 and node.input[7:QUERY_SEQLENS_INPUT] == [""] * 9
            assert (node.input[3], node.input[4]) == (f"past_key.{layer}", f"past_value.{layer}")
            assert (node.output[1], node.output[2]) == (f"present_key.{layer}", f"present_value.{layer}")
        # the lengths are computed once, for every layer, and nothing of the per-layer copies is left
        assert len({(n.input[5], n.input[6], n.input[QUERY_SEQLENS_INPUT]) for n in nodes}) == 1
        read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        assert all(any(o in read for o in n.output) for n in model.graph.node), graph
        opsets = {o.domain for o in model.opset_import}
        assert ORT_DOMAIN in opsets and (DOMAIN in opsets) == (graph != "decode")
        assert not [n for n in model.graph.node if n.domain == DOMAIN and n.op_type != "LowRankRecurrence"]


def test_where_gqa_is_built() -> None:
    assert default_attention("onnxruntime", "fp32", "int4", 64) == "gqa" == resolve(BuildSettings(weights="int4"),
                                                                                     64).attention
    assert resolve(BuildSettings(weights="int4"), 64).int4_accuracy_level == 4  # lossless with gqa: the fastest
    assert resolve(BuildSettings(weights="int4", attention="ops"), 64).int4_accuracy_level == 0
    assert default_attention("onnxruntime", "fp32", "int4", 12) == "ops"  # the kernel takes head_dim % 8 == 0 only
    assert default_attention("onnxruntime", "fp32", "float", 64) == "ops" == resolve(BuildSettings(), 64).attention
    assert default_attention("onnxruntime", "fp16", "float", 64) == "ops"
    assert default_attention("tensorrt", "fp32", "float", 64) == "ops"
    assert resolve(BuildSettings(attention="gqa"), 64).attention == "gqa"  # fp32 on request
    with pytest.raises(ConfigError, match="multiple of 8, this target's is 12"):
        resolve(BuildSettings(attention="gqa"), 12)
    with pytest.raises(ConfigError, match="GroupQueryAttention"):
        BuildSettings(backend="tensorrt", attention="gqa")
    with pytest.raises(ConfigError, match="GroupQueryAttention"):
        BuildSettings(dtype="fp16", attention="gqa")
    with pytest.raises(ConfigError, match="attention must be one of"):
        BuildSettings(attention="flash")


def test_tensorrt_lowering_refuses_gqa(pair: Pair, tmp_path) -> None:
    with pytest.raises(ValueError, match="GroupQueryAttention"):
        export_graph(pair.gqa["decode"], pair.target, pair.draft, tmp_path / "decode.onnx", lowering="tensorrt")
