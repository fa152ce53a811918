"""The exported engine graphs (prefill, step, decode) against their eager reference modules.

Every check derives what it expects from the I/O contract (``engine_contract``) and the eager
graph modules (``graph_module``), never from pasted numbers (STYLE 1, 4). Parity runs at shapes
other than the trace shapes of ``onnx_export.TRACE_SIZES`` (batch 2, chunk 3, outputs 2, cache 7)
so it proves the dims are really dynamic (STYLE 7).

Tolerance tiers used below (fp32 throughout):
- integer outputs (tokens, acceptance counts, gathers): exact;
- float outputs (logits, hidden states, KV): atol 1e-4, rtol 0. ORT and PyTorch agree to ~1e-6
  on these models; 1e-4 leaves room for a different reduction order on another CPU.
"""

from __future__ import annotations

from collections import Counter

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import onnx.shape_inference
import onnxruntime as ort
import pytest
import torch
from helpers import ARCH_TARGETS, draft_config, make_target, random_draft, reduced_vocab
from onnx import helper, numpy_helper
from polygraphy_data import ENV_VAR, feeds, write_request

from dlite_trt.config import TargetSpec
from dlite_trt.export.contract import (
    EngineLimits,
    GRAPH_NAMES,
    GraphSpec,
    SAMPLING_SUFFIX,
    dummy_inputs,
    engine_contract,
)
from dlite_trt.export.graphs import graph_module
from dlite_trt.export.onnx_export import TRACE_SIZES, export_graph
from dlite_trt.export.recurrence import (
    ATTRIBUTES,
    DOMAIN,
    INPUT_NAMES,
    OP_NAME,
    OP_VERSION,
    OUTPUT_NAMES,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TRT_ATTRIBUTES,
    TRT_EXTRA_OUTPUTS,
)
from dlite_trt.model.sequential_head import HeadWeights
from dlite_trt.model.target import TargetAdapter

VOCAB = 64
LIMITS = EngineLimits(max_batch=4, max_seq_len=64, max_chunk=16)
DRAFT_VOCAB = 40  # V_d of the drafts with a reduced draft vocabulary (of VOCAB target tokens)
# (anchor_group_size G, block_size[, draft vocabulary size]); the last: a reduced draft vocabulary
COMBOS = [(1, 4), (1, 8), (2, 4), (2, 8), (2, 8, DRAFT_VOCAB)]


def combo_id(combo: tuple[int, ...]) -> str:
    return f"G{combo[0]}-block{combo[1]}" + (f"-vocab{combo[2]}" if len(combo) > 2 else "")


COMBO_IDS = [combo_id(c) for c in COMBOS]
# The TensorRT lowering is exported again from scratch; three combos cover seeded 0/1, K 3/7 and the
# draft vocabulary's mapping around the plugin node.
TRT_COMBOS = [(1, 4), (2, 8), (1, 4, DRAFT_VOCAB)]
def _base(graph: str) -> str:
    return graph.removesuffix(SAMPLING_SUFFIX)


GRAPHS = GRAPH_NAMES  # prefill, step, decode (greedy) and their _sampling variants
DRAFT_GRAPHS = tuple(g for g in GRAPHS if _base(g) != "decode")  # the graphs with the draft's LowRankRecurrence node
TEMPERATURES = np.array([0.0, 0.7, 1.3], dtype=np.float32)  # greedy and two sampling temperatures
FLOAT_ATOL = 1e-4  # fp32 tier, see the module docstring

# Parity shapes, none equal to the trace shapes. cache 16 with chunk 11 leaves past_len <= 5.
PARITY_SIZES = {
    "prefill": [{"batch": 1, "chunk": 1, "cache": 16}, {"batch": 3, "chunk": 5, "cache": 40},
                {"batch": 3, "chunk": 11, "cache": 16}],
    "decode": [{"batch": 1, "chunk": 1, "outputs": 1, "cache": 16}, {"batch": 3, "chunk": 11, "outputs": 4, "cache": 40},
               {"batch": 4, "chunk": 5, "outputs": 5, "cache": 16}],
}
# step: sizes, temperature per row, and for greedy rows how many leading drafts are made to agree
# with the target's greedy choice (None: all K), so acceptance counts 0 < n < K and n = K occur too.
STEP_CASES = [
    ({"batch": 1, "cache": 16}, [0.0], [None]),
    ({"batch": 3, "cache": 40}, [0.0, 0.7, 0.0], [1, 0, 0]),
    ({"batch": 4, "cache": 16}, [1.3, 0.0, 0.7, 0.0], [0, None, 0, 2]),
    # a greedy step verifying fewer than K drafts (the sampling step ignores "verify": it verifies K)
    ({"batch": 3, "cache": 24, "verify": 2}, [0.0, 0.0, 0.7], [None, 0, 0]),
    ({"batch": 2, "cache": 16, "verify": 4}, [0.0, 0.0], [None, 1]),
    # a greedy step drafting fewer than K for the next step (sampling steps draft K)
    ({"batch": 2, "cache": 24, "verify": 3, "next": 2}, [0.0, 0.7], [None, 0]),
    ({"batch": 3, "cache": 16, "next": 3}, [0.0, 0.0, 1.3], [1, None, 0]),
]
POLYGRAPHY_SIZES = {
    "prefill": [{"batch": 1, "chunk": 4, "cache": 24}, {"batch": 4, "chunk": 9, "cache": 33}],
    "step": [{"batch": 1, "cache": 24}, {"batch": 4, "cache": 33}],
    "decode": [{"batch": 1, "chunk": 4, "outputs": 2, "cache": 24}, {"batch": 4, "chunk": 9, "outputs": 3, "cache": 33}],
}
# Ops that TensorRT handles poorly or not at all (data-dependent control flow, sequences).
CONTROL_FLOW_OPS = {"If", "Loop", "Scan", "SplitToSequence", "ConcatFromSequence"}
GRAPHS_STRUCTURE = list(GRAPHS)


@dataclass
class Engine:
    """A target + draft for one (G, block) and its exported graphs (exported on first use)."""

    group: int
    block: int
    out: Path
    hf_target: torch.nn.Module  # shared by all engines (building one takes ~1 s)
    target_spec: TargetSpec
    draft_vocab_size: int | None = None  # a reduced draft vocabulary of that many ids (reduced_vocab)
    target: TargetAdapter = field(init=False)
    draft: torch.nn.Module = field(init=False)
    contract: dict[str, GraphSpec] = field(init=False)
    _paths: dict[tuple[str, str], Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hf, spec = self.hf_target, self.target_spec
        cfg = draft_config(spec, block_size=self.block, anchor_group_size=self.group,
                           draft_vocab_size=self.draft_vocab_size)
        ids = None if self.draft_vocab_size is None else reduced_vocab(spec.vocab_size, self.draft_vocab_size)
        self.draft = random_draft(cfg, draft_vocab=ids)
        self.target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
        self.contract = engine_contract(spec, cfg, LIMITS)

    @property
    def k(self) -> int:
        return self.draft.cfg.num_proposals

    def onnx_path(self, graph: str, lowering: str = "onnxruntime") -> Path:
        key = (graph, lowering)
        if key not in self._paths:
            self._paths[key] = export_graph(self.contract[graph], self.target, self.draft,
                                            self.out / lowering / f"{graph}.onnx", lowering=lowering)
        return self._paths[key]

    @torch.no_grad()
    def eager(self, graph: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.contract[graph]
        outs = graph_module(spec, self.target, self.draft)(*(torch.from_numpy(feed[n]) for n in spec.input_names))
        return {n: t.numpy() for n, t in zip(spec.output_names, outs, strict=True)}


class EngineCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.hf_target, self.target_spec = make_target(VOCAB, seed=0)
        self.engines: dict[tuple[int, int, int | None], Engine] = {}

    def get(self, group: int, block: int, draft_vocab_size: int | None = None) -> Engine:
        key = (group, block, draft_vocab_size)
        if key not in self.engines:
            self.engines[key] = Engine(group, block, self.root / combo_id(tuple(k for k in key if k is not None)),
                                       self.hf_target, self.target_spec, draft_vocab_size)
        return self.engines[key]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> EngineCache:
    return EngineCache(tmp_path_factory.mktemp("engines"))


@pytest.fixture(params=COMBOS, ids=COMBO_IDS)
def engine(request, engines) -> Engine:
    return engines.get(*request.param)


# ---------------------------------------------------------------------------------------------
# inputs


def _parity_feeds(engine: Engine, graph: str) -> list[tuple[dict[str, int], dict[str, np.ndarray]]]:
    """(sizes, feed) cases: dummy_inputs at non-trace shapes, temperatures mixing greedy and sampling
    where the graph takes a temperature (the greedy graphs have none: every row is greedy)."""
    spec = engine.contract[graph]
    rng = np.random.default_rng(1234)
    sampling = "temperature" in spec.input_names
    if _base(graph) == "step":
        cases = []
        for sizes, temps, agree in STEP_CASES:
            sizes = {d.name: d.max for d in spec.dims} | sizes  # the greedy step verifies all K unless told
            feed = _dummy(spec, sizes, rng)
            if sampling:
                feed["temperature"] = np.array(temps, dtype=np.float32)
            k = feed["block"].shape[1] - 1  # drafts this step verifies
            cases.append((sizes, _agree_greedy_drafts(engine, graph, feed, [k if a is None else min(a, k) for a in agree])))
        return cases
    cases = []
    for i, sizes in enumerate(PARITY_SIZES[_base(graph)]):
        feed = _dummy(spec, sizes, rng)
        if sampling:
            feed["temperature"] = np.resize(np.roll(TEMPERATURES, i), sizes["batch"])
        if i == 0:
            feed["past_len"][:] = 0  # a sequence's first call
        cases.append((sizes, feed))
    return cases


def _dummy(spec: GraphSpec, sizes: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    assert any(sizes[d] != TRACE_SIZES[d] for d in sizes), f"{sizes} are the trace shapes"
    return dummy_inputs(spec, sizes, vocab_size=VOCAB, rng=rng)


def _greedy_rows(feed: dict[str, np.ndarray]) -> np.ndarray:
    return feed["temperature"] <= 1e-5 if "temperature" in feed else np.ones(len(feed["past_len"]), dtype=bool)


def _agree_greedy_drafts(engine: Engine, graph: str, feed: dict[str, np.ndarray],
                         agree: list[int]) -> dict[str, np.ndarray]:
    """Set d_1..d_agree[row] of greedy rows to the target's greedy tokens (found with the eager step)."""
    block = feed["block"].copy()  # [B, k+1]
    greedy = _greedy_rows(feed)
    want = np.where(greedy, agree, 0)
    for j in range(block.shape[1] - 1):
        rows = want > j
        if not rows.any():
            break
        # drafts 1..j agree, so at least j are accepted and emitted[:, j] is the target's token there
        emitted = engine.eager(graph, {**feed, "block": block})["emitted"]
        block[rows, j + 1] = emitted[rows, j]
    feed = {**feed, "block": block}
    accepted = engine.eager(graph, feed)["accepted"]
    assert (accepted[greedy] >= want[greedy]).all(), (accepted, want)  # the setup did what it says (exact)
    return feed


# ---------------------------------------------------------------------------------------------
# ONNX structure helpers


def _all_nodes(model: onnx.ModelProto):
    """Every node of the graph, of its subgraphs and of its model-local functions."""

    def walk(nodes):
        for node in nodes:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attr.g.node)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        yield from walk(g.node)

    yield from walk(model.graph.node)
    for function in model.functions:
        yield from walk(function.node)


def _recurrence_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_NAME]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _source(model: onnx.ModelProto, name: str) -> str:
    """Follow Cast/Identity producers back from a value to where it comes from."""
    producers = {o: n for n in model.graph.node for o in n.output}
    while name in producers and producers[name].op_type in ("Cast", "Identity"):
        name = producers[name].input[0]
    return name


def _check_io(model: onnx.ModelProto, spec: GraphSpec) -> None:
    """Graph inputs/outputs: names and order, dtypes and ranks as the contract says."""
    for kind, values, tensors in (("input", model.graph.input, spec.inputs), ("output", model.graph.output, spec.outputs)):
        assert [v.name for v in values] == [t.name for t in tensors], f"{spec.name} {kind}s"
        for v, t in zip(values, tensors, strict=True):
            tt = v.type.tensor_type
            assert helper.tensor_dtype_to_np_dtype(tt.elem_type) == np.dtype(t.dtype), f"{spec.name}.{t.name} dtype"
            dims = [d.dim_param or d.dim_value for d in tt.shape.dim]
            assert len(dims) == len(t.dims), f"{spec.name}.{t.name}: rank {len(dims)}, contract {t.dims}"
            assert tuple(dims) == tuple(t.dims), f"{spec.name}.{t.name}: dims {dims}, contract {t.dims}"


def _check_recurrence_wiring(model: onnx.ModelProto, node: onnx.NodeProto, engine: Engine,
                             outputs: tuple[str, ...] = OUTPUT_NAMES) -> None:
    """The node's inputs/outputs mean what INPUT_NAMES/``outputs`` say, in that order."""
    assert len(node.input) == len(INPUT_NAMES) and len(node.output) == len(outputs)
    wire = dict(zip(INPUT_NAMES, node.input, strict=True))
    sampling = "temperature" in [i.name for i in model.graph.input]
    assert _attrs(node)["sampling"] == int(sampling)
    if sampling:
        assert _source(model, wire["temperature"]) == "temperature"
        assert _source(model, wire["uniforms"]) == "u_draft"
    else:  # greedy graphs: no logits leave the graph
        assert "next_draft_logits" not in [o.name for o in model.graph.output]
    _check_head_mapping(model, node, engine, outputs, sampling)
    initializers = {i.name: i for i in model.graph.initializer}
    weights = engine.draft.sequential_head.weights()
    for name in HeadWeights._fields:
        assert wire[name] in initializers, f"{name} -> {wire[name]} is not a weight"
        # exact: the initializer is the parameter's bytes
        np.testing.assert_array_equal(numpy_helper.to_array(initializers[wire[name]]),
                                      getattr(weights, name).detach().numpy(), err_msg=name)
    assert _attrs(node)["num_steps"] == engine.k
    assert _attrs(node)["seeded"] == int(engine.group > 1)


HEAD_TABLES = ("draft.sequential_head.draft_vocab", "draft.sequential_head.target_to_draft")  # [V_d], [V] int64


def _check_head_mapping(model: onnx.ModelProto, node: onnx.NodeProto, engine: Engine, outputs: tuple[str, ...],
                        sampling: bool) -> None:
    """Without a draft vocabulary the node reads the anchor the next block starts with and its tokens and
    logits leave as they are: the export adds no op around it. With one, anchor and seed pass a Where (the
    mask token's row for ids outside the draft vocabulary) first, the tokens a Gather of draft_vocab after,
    and the sampling graphs' logits a Pad (the -inf column) and a Gather of target_to_draft (exact tables)."""
    wire = dict(zip(INPUT_NAMES, node.input, strict=True))
    out = dict(zip(outputs, node.output, strict=True))
    producers = {o: n for n in model.graph.node for o in n.output}
    concat = producers["next_block"]  # [anchor, d_1..d_K]
    unsqueeze = producers[concat.input[0]]
    assert concat.op_type == "Concat" and unsqueeze.op_type == "Unsqueeze"
    block_anchor, block_tokens = unsqueeze.input[0], concat.input[1]
    if engine.group == 1:  # no seed step: the node's seed_prev input is its anchor input
        assert wire["seed_prev"] == wire["anchor"]
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    head = engine.draft.sequential_head
    if head.draft_vocab is None:
        assert wire["anchor"] == block_anchor and block_tokens == out["tokens"]
        assert not sampling or out["logits"] == "next_draft_logits"
        assert not set(HEAD_TABLES) & set(initializers)
        assert not [n for n in model.graph.node if n.op_type == "Pad" and out["logits"] in n.input]  # no -inf column
        return
    draft_vocab, target_to_draft = HEAD_TABLES
    np.testing.assert_array_equal(initializers[draft_vocab], head.draft_vocab.numpy())
    np.testing.assert_array_equal(initializers[target_to_draft], head.target_to_draft.numpy())
    assert producers[wire["anchor"]].op_type == "Where"
    assert engine.group == 1 or producers[wire["seed_prev"]].op_type == "Where"
    to_target = producers[block_tokens]
    assert to_target.op_type == "Gather" and list(to_target.input) == [draft_vocab, out["tokens"]]
    if sampling:
        full = producers["next_draft_logits"]
        pad = producers[full.input[0]]
        assert full.op_type == "Gather" and full.input[1] == target_to_draft
        assert pad.op_type == "Pad" and pad.input[0] == out["logits"]


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("graph", GRAPHS)
def test_ort_matches_eager(engine: Engine, graph: str) -> None:
    _check_ort_parity(engine, graph)


@pytest.fixture(scope="module", params=list(ARCH_TARGETS))
def arch_engine(request, tmp_path_factory) -> Engine:
    """An engine (G2, block 8) on a Llama (llama3 RoPE, untied), tied Llama or Qwen2 (biases) target."""
    hf, spec = make_target(VOCAB, seed=0, initializer_range=0.1, **ARCH_TARGETS[request.param])
    return Engine(2, 8, tmp_path_factory.mktemp(request.param), hf, spec)


@pytest.mark.parametrize("graph", GRAPHS)
def test_ort_matches_eager_other_architectures(arch_engine: Engine, graph: str) -> None:
    _check_ort_parity(arch_engine, graph)


def _check_ort_parity(engine: Engine, graph: str) -> None:
    """Every output of the exported graph equals its eager module at the parity shapes."""
    spec = engine.contract[graph]
    session = ort.InferenceSession(str(engine.onnx_path(graph)), providers=["CPUExecutionProvider"])
    greedy_accepted = set()
    for sizes, feed in _parity_feeds(engine, graph):
        got = dict(zip(spec.output_names, session.run(spec.output_names, feed), strict=True))
        want = engine.eager(graph, feed)
        for t in spec.outputs:
            where = f"{graph}.{t.name} at {sizes}"
            assert got[t.name].shape == t.shape(sizes) == want[t.name].shape, where
            assert got[t.name].dtype == np.dtype(t.dtype) == want[t.name].dtype, where
            if np.issubdtype(got[t.name].dtype, np.integer):
                np.testing.assert_array_equal(got[t.name], want[t.name], err_msg=where)  # integer tier: exact
            else:
                np.testing.assert_allclose(got[t.name], want[t.name], rtol=0, atol=FLOAT_ATOL, err_msg=where)  # fp32
        if _base(graph) == "step":
            greedy_accepted |= set(got["accepted"][_greedy_rows(feed)].tolist())
    if _base(graph) == "step":  # the cases exercised no, partial and full acceptance
        assert {0, engine.k} <= greedy_accepted and greedy_accepted - {0, engine.k}, greedy_accepted


def test_a_step_drafting_fewer_drafts_the_first_of_the_block(engine: Engine) -> None:
    """A greedy step asked for D < K drafts (``next_width`` D + 1 wide) returns the first D of the K the
    same step drafts when asked for all (the head is sequential: draft i reads drafts before it only),
    and everything else alike: the exported graph, at every D."""
    spec = engine.contract["step"]
    session = ort.InferenceSession(str(engine.onnx_path("step")), providers=["CPUExecutionProvider"])
    feed = _dummy(spec, {"batch": 3, "cache": 24, "verify": 3}, np.random.default_rng(7))
    full = dict(zip(spec.output_names, session.run(spec.output_names, feed), strict=True))
    assert full["next_block"].shape == (3, engine.k + 1)
    for drafts in range(1, engine.k):
        fewer = dict(zip(spec.output_names, session.run(spec.output_names, {
            **feed, "next_width": np.zeros((3, drafts + 1), np.int64)}), strict=True))
        for name, value in fewer.items():
            want = full[name][:, : drafts + 1] if name == "next_block" else full[name]
            np.testing.assert_array_equal(value, want, err_msg=f"{name} at {drafts} drafts")


@pytest.mark.parametrize("graph", GRAPHS)
def test_io_matches_contract(engine: Engine, graph: str) -> None:
    model = onnx.load(str(engine.onnx_path(graph)), load_external_data=False)
    _check_io(model, engine.contract[graph])


@pytest.mark.parametrize("graph", GRAPHS)
def test_onnxruntime_lowering(engine: Engine, graph: str) -> None:
    path = engine.onnx_path(graph)
    onnx.checker.check_model(str(path))  # the path form reads the external data file
    model = onnx.load(str(path))
    nodes = _recurrence_nodes(model)
    custom = {(n.domain, n.op_type) for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    opsets = {o.domain: o.version for o in model.opset_import}
    if graph not in DRAFT_GRAPHS:
        assert not nodes and not custom and not model.functions and DOMAIN not in opsets
        return
    assert len(nodes) == 1 and custom == {(DOMAIN, OP_NAME)}
    node = nodes[0]
    assert node.domain == DOMAIN and opsets[DOMAIN] == OP_VERSION
    _check_recurrence_wiring(model, node, engine)
    assert len(model.functions) == 1
    function = model.functions[0]
    assert (function.domain, function.name) == (node.domain, node.op_type)
    assert tuple(function.input) == INPUT_NAMES and tuple(function.output) == OUTPUT_NAMES
    assert tuple(function.attribute) == ATTRIBUTES
    assert all(n.domain in ("", "ai.onnx") for n in function.node)  # the body is standard ops only


@pytest.mark.parametrize("engine", TRT_COMBOS, indirect=True, ids=[combo_id(c) for c in TRT_COMBOS])
@pytest.mark.parametrize("graph", DRAFT_GRAPHS)  # decode has no recurrence node: its lowerings are the same
def test_tensorrt_lowering(engine: Engine, graph: str) -> None:
    model = onnx.load(str(engine.onnx_path(graph, "tensorrt")))
    _check_io(model, engine.contract[graph])
    nodes = _recurrence_nodes(model)
    assert len(nodes) == 1
    node = nodes[0]
    assert node.domain == ""  # TensorRT's parser looks plugins up by op_type in the default domain
    attrs = _attrs(node)
    assert attrs["plugin_namespace"].decode() == PLUGIN_NAMESPACE
    assert attrs["plugin_version"].decode() == PLUGIN_VERSION
    assert set(attrs) == {*ATTRIBUTES, *TRT_ATTRIBUTES, "plugin_namespace", "plugin_version"}
    assert attrs["rank"] == engine.draft.cfg.sequential_rank
    _check_recurrence_wiring(model, node, engine, (*OUTPUT_NAMES, *TRT_EXTRA_OUTPUTS))
    assert not set(node.output[2:]) & {o.name for o in model.graph.output}  # the kernel's own scratch and slots
    assert not model.functions
    assert DOMAIN not in {o.domain for o in model.opset_import}
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    unsupported = {n.op_type for n in model.graph.node if n.op_type != OP_NAME} - _parser_ops()
    assert not unsupported, f"ops TensorRT's ONNX parser does not list: {sorted(unsupported)}"


def _parser_ops() -> set[str]:
    """The ONNX operators TensorRT's parser supports, as recorded (with its source) in plugins/."""
    path = Path(__file__).resolve().parents[1] / "plugins/lowrank_recurrence/onnx_tensorrt_operators.txt"
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


@pytest.mark.parametrize("graph", GRAPHS_STRUCTURE)
def test_no_control_flow(engine: Engine, graph: str) -> None:
    """Checked on the ONNX Runtime lowering: its main graph is the TensorRT one, plus the function body."""
    model = onnx.load(str(engine.onnx_path(graph)), load_external_data=False)
    bad = sorted({n.op_type for n in _all_nodes(model)
                  if n.op_type in CONTROL_FLOW_OPS or n.op_type.startswith(("Sequence", "Optional"))})
    assert not bad, f"{graph} contains {bad}"


def test_greedy_decode_runs_no_sampler(engine: Engine) -> None:
    """The greedy decode graph is the target and an argmax: its sampling variant has the sampler's
    softmax over the vocabulary and its two inverse-CDF CumSums besides (format 6 split them; the
    attention's own Softmax is in both), and only it takes a temperature."""
    ops = {g: Counter(n.op_type for n in onnx.load(str(engine.onnx_path(g)), load_external_data=False).graph.node)
           for g in ("decode", "decode_sampling")}
    assert ops["decode"]["ArgMax"] == 1
    assert ops["decode_sampling"]["Softmax"] == ops["decode"]["Softmax"] + 1
    assert ops["decode_sampling"]["CumSum"] == ops["decode"]["CumSum"] + 2
    assert "temperature" not in engine.contract["decode"].input_names
    assert "temperature" in engine.contract["decode_sampling"].input_names


@pytest.mark.parametrize("graph", GRAPHS_STRUCTURE)
def test_static_ranks(engine: Engine, graph: str) -> None:
    """After inlining the recurrence body, shape inference gives every value a known rank."""
    model = onnx.load(str(engine.onnx_path(graph)), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(model), strict_mode=True,
                                                 data_prop=True)
    g = inferred.graph
    typed = {v.name: v.type.tensor_type for v in (*g.value_info, *g.input, *g.output)}
    values = [o for n in g.node for o in n.output if o]
    assert values and all(v in typed for v in values), [v for v in values if v not in typed][:10]
    no_rank = [v for v in values if not typed[v].HasField("shape")]
    assert not no_rank, f"{graph}: {len(no_rank)} values without a static rank, e.g. {no_rank[:5]}"


def _polygraphy_cli() -> Path:
    pytest.importorskip("polygraphy", reason="polygraphy (extra 'dev') is not installed")
    cli = Path(sys.executable).with_name("polygraphy")
    if not cli.exists():
        pytest.skip(f"no polygraphy CLI next to {sys.executable}")
    return cli


@pytest.mark.parametrize("engine", [(2, 8)], indirect=True, ids=["G2-block8"])
@pytest.mark.parametrize("graph", GRAPHS)
def test_polygraphy_onnxrt_run(engine: Engine, graph: str, tmp_path: Path) -> None:
    """``polygraphy run --onnxrt`` on the exported graph, fed by tests/polygraphy_data.py, agrees with eager."""
    from polygraphy.comparator import RunResults

    cli = _polygraphy_cli()
    spec = engine.contract[graph]
    request = write_request(tmp_path / "request.json", spec, POLYGRAPHY_SIZES[_base(graph)], vocab_size=VOCAB,
                            seed=7)
    reference = RunResults()
    reference.add([engine.eager(graph, feed) for feed in feeds(request)], runner_name="eager")
    reference.save(str(tmp_path / "eager.json"))
    # per-output tolerances: integer outputs exact, fp32 outputs FLOAT_ATOL (see module docstring)
    atol = [f"{t.name}:{0 if np.issubdtype(np.dtype(t.dtype), np.integer) else FLOAT_ATOL}" for t in spec.outputs]
    cmd = [str(cli), "run", str(engine.onnx_path(graph)), "--onnxrt",
           "--data-loader-script", f"{Path(__file__).with_name('polygraphy_data.py')}:load_data",
           "--load-outputs", str(tmp_path / "eager.json"), "--atol", *atol, "--rtol", "0"]
    proc = subprocess.run(cmd, check=False, env={**os.environ, ENV_VAR: str(request)}, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    n = len(POLYGRAPHY_SIZES[_base(graph)])
    assert f"Passed: {n}/{n} iterations" in log, log[-4000:]
    assert "PASSED | Runtime" in log, log[-4000:]


@pytest.mark.parametrize("graph", ["prefill_sampling", "step_sampling"])
def test_draft_logits_outside_the_draft_vocabulary(engines: EngineCache, graph: str) -> None:
    """With a draft vocabulary the draft's logits are -inf exactly at the target ids outside it (q = 0 there),
    its proposals are ids inside it, and anchors outside it (read as the mask token) were drafted from."""
    engine = engines.get(2, 8, DRAFT_VOCAB)
    spec = engine.contract[graph]
    session = ort.InferenceSession(str(engine.onnx_path(graph)), providers=["CPUExecutionProvider"])
    inside = np.isin(np.arange(VOCAB), engine.draft.sequential_head.draft_vocab.numpy())  # [V]
    anchors_outside = 0
    for _, feed in _parity_feeds(engine, graph):
        got = dict(zip(spec.output_names, session.run(spec.output_names, feed), strict=True))
        logits = got["next_draft_logits"]  # [B, K, V]
        assert np.isneginf(logits[..., ~inside]).all() and np.isfinite(logits[..., inside]).all()
        assert inside[got["next_block"][:, 1:]].all()
        anchors_outside += int((~inside[got["next_block"][:, 0]]).sum())
    assert anchors_outside > 0
