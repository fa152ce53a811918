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
from dlite_trt.export.cache_attention import ORT_DOMAIN, ORT_OP, QUERY_SEQLENS_INPUT, ROTARY_TABLES
from dlite_trt.export.contract import GRAPH_NAMES, EngineLimits, dummy_inputs, engine_contract, kv_input
from dlite_trt.export.graphs import graph_module
from dlite_trt.export.onnx_export import export_graph
from dlite_trt.export.recurrence import DOMAIN
from dlite_trt.runtime.ort_runner import run_in_place
from dlite_trt.model.ops import rope_cos_sin
from dlite_trt.model.target import TargetAdapter

VOCAB = 96
LIMITS = EngineLimits(max_batch=4, max_seq_len=64, max_chunk=16)
FLOAT_ATOL = 1e-4  # the fp32 tier of tests/test_engine_graphs.py
SIZES = [{"batch": 3, "chunk": 5, "cache": 40, "outputs": 2, "verify": 4, "next": 3},
         {"batch": 1, "chunk": 2, "cache": 20, "outputs": 1, "verify": 2, "next": 8}]


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
        self.rope = (spec.head_dim, spec.rope_theta, torch.float32, spec.rope_scaling)

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
        new = {kind: want.pop(f"new_{kind}") for kind in ("key", "value")}  # "gqa" writes them into the buffers
        assert set(got) == set(want)
        for name, value in want.items():
            where = f"{graph}.{name} at {sizes}"
            assert got[name].shape == value.shape and got[name].dtype == value.dtype, where
            if np.issubdtype(value.dtype, np.integer):
                np.testing.assert_array_equal(got[name], value, err_msg=where)
            else:
                np.testing.assert_allclose(got[name], value, rtol=0, atol=FLOAT_ATOL, err_msg=where)
        width = new["key"].shape[3]
        for layer in range(pair.layers):
            for kind in ("key", "value"):
                name, where = f"past_{kind}.{layer}", f"{graph} past_{kind}.{layer} at {sizes}"
                written = np.zeros(feed[name].shape, bool)
                expected = feed[name].copy()
                for row, start in enumerate(feed["past_len"]):  # the call's entries at the row's own slots
                    expected[row, :, start:start + width] = new[kind][layer, row]
                    written[row, :, start:start + width] = True
                assert np.array_equal(buffers[name][~written], feed[name][~written]), where  # the rest untouched
                # the keys rotated by the op (an ulp from the reference's rotation), the values as computed
                np.testing.assert_allclose(buffers[name], expected, rtol=0, atol=FLOAT_ATOL, err_msg=where)


def test_lowered_nodes(pair: Pair) -> None:
    for graph in GRAPH_NAMES:
        model = onnx.load(str(pair.export(graph)))  # with its weights: the rotary tables are read below
        nodes = [n for n in model.graph.node if n.op_type == ORT_OP]
        assert len(nodes) == pair.layers and all(n.domain == ORT_DOMAIN for n in nodes)
        for layer, node in enumerate(nodes):
            assert len(node.input) == QUERY_SEQLENS_INPUT + 1 and node.input[10:QUERY_SEQLENS_INPUT] == [""] * 6
            assert (node.input[3], node.input[4]) == (f"past_key.{layer}", f"past_value.{layer}")
            assert (node.output[1], node.output[2]) == (f"present_key.{layer}", f"present_value.{layer}")
            assert {a.name: a.i for a in node.attribute if a.name == "do_rotary"} == {"do_rotary": 1}
            assert tuple(node.input[7:9]) == ROTARY_TABLES
        # the lengths and positions are computed once, for every layer, and nothing of the per-layer copies is left
        assert len({(*n.input[5:7], n.input[9], n.input[QUERY_SEQLENS_INPUT]) for n in nodes}) == 1
        # no rotation left outside the attention (rotate-half's Neg), no new entries returned
        assert not [n for n in model.graph.node if n.op_type == "Neg" and n.name.startswith("/target/")], graph
        assert not {"new_key", "new_value"} & {o.name for o in model.graph.output}
        tables = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name in ROTARY_TABLES}
        # every slot the cache has (max_seq_len + the block), the reference's values
        cos, sin = rope_cos_sin(torch.arange(LIMITS.max_seq_len + 8)[None], *pair.rope)
        half = pair.rope[0] // 2
        np.testing.assert_array_equal(tables[ROTARY_TABLES[0]], cos[0, :, :half].numpy())
        np.testing.assert_array_equal(tables[ROTARY_TABLES[1]], sin[0, :, :half].numpy())
        read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        assert all(any(o in read for o in n.output) for n in model.graph.node), graph
        opsets = {o.domain for o in model.opset_import}
        assert ORT_DOMAIN in opsets and (DOMAIN in opsets) == (not graph.startswith("decode"))
        assert not [n for n in model.graph.node if n.domain == DOMAIN and n.op_type != "LowRankRecurrence"]


def test_where_gqa_is_built() -> None:
    assert default_attention("onnxruntime", "fp32", 64) == "gqa" == resolve(BuildSettings(weights="int4"),
                                                                                     64).attention
    assert resolve(BuildSettings(weights="int4"), 64).int4_accuracy_level == 4  # lossless with gqa: the fastest
    assert resolve(BuildSettings(weights="int4", attention="ops"), 64).int4_accuracy_level == 0
    assert default_attention("onnxruntime", "fp32", 64) == "gqa" == resolve(BuildSettings(), 64).attention
    assert default_attention("onnxruntime", "fp32", 12) == "ops" == resolve(BuildSettings(), 12).attention
    assert default_attention("onnxruntime", "fp16", 64) == "ops"
    assert default_attention("tensorrt", "fp32", 64) == "ops"
    assert resolve(BuildSettings(attention="ops"), 64).attention == "ops"  # on request
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


def test_a_split_qkv_product_becomes_the_packed_query() -> None:
    """A stacked q/k/v product split into GroupQueryAttention's query, key and value (export/int4.py)
    is handed to it whole as its packed query, the Split gone: the same outputs, bitwise; a Split
    whose outputs something else also reads stays."""
    from onnx import TensorProto, helper

    from dlite_trt.export.cache_attention import pack_query_key_value

    heads, kv_heads, d, cap = 4, 2, 16, 24
    sizes = [heads * d, kv_heads * d, kv_heads * d]
    freqs = torch.arange(cap).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))

    def model(extra_reader: bool) -> onnx.ModelProto:
        f32, i32 = TensorProto.FLOAT, TensorProto.INT32
        inputs = [helper.make_tensor_value_info("qkv", f32, [1, "T", sum(sizes)]),
                  *(helper.make_tensor_value_info(n, f32, [1, kv_heads, cap, d]) for n in ("pk", "pv")),
                  helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total", i32, []),
                  helper.make_tensor_value_info("pos", TensorProto.INT64, [1, "T"]),
                  helper.make_tensor_value_info("qs", i32, [1])]
        nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
                 helper.make_node(ORT_OP, ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "cos", "sin", "pos",
                                           *[""] * 6, "qs"], ["o", "prk", "prv"], domain=ORT_DOMAIN, num_heads=heads,
                                  kv_num_heads=kv_heads, do_rotary=1)]
        outputs = ["o"] + (["v"] if extra_reader else [])
        graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(n, f32, None) for n in outputs],
                                  [onnx.numpy_helper.from_array(np.array(sizes, np.int64), "sizes"),
                                   onnx.numpy_helper.from_array(freqs.cos().numpy(), "cos"),
                                   onnx.numpy_helper.from_array(freqs.sin().numpy(), "sin")])
        return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                            helper.make_opsetid(ORT_DOMAIN, 1)])

    rng = np.random.default_rng(0)
    t, past = 3, 5
    feed = {"qkv": rng.standard_normal((1, t, sum(sizes)), dtype=np.float32),
            "pk": rng.standard_normal((1, kv_heads, cap, d), dtype=np.float32),
            "pv": rng.standard_normal((1, kv_heads, cap, d), dtype=np.float32),
            "seqlens_k": np.array([past + t - 1], np.int32), "total": np.array(cap, np.int32),
            "pos": (past + np.arange(t))[None].astype(np.int64), "qs": np.array([t], np.int32)}
    split = model(False)
    want = ort.InferenceSession(split.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    assert pack_query_key_value(split) == 1
    (node,) = split.graph.node
    assert node.op_type == ORT_OP and list(node.input[:3]) == ["qkv", "", ""]
    got = ort.InferenceSession(split.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    read_elsewhere = model(True)
    assert pack_query_key_value(read_elsewhere) == 0 and len(read_elsewhere.graph.node) == 2
