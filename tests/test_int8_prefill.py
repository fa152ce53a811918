"""The prefill's products in int8 (dlite_trt/export/int8_rows.py; ``--prefill-weights int8``, the int4
default at accuracy level 4), on real ONNX Runtime.

Tolerance tiers:
- the graph's product against numpy on the same rounded integers (``Int8Columns.reference``, float64):
  1e-6 relative (the integer sum is exact, the two scalings are fp32 products);
- against the float product of the dequantized weights: within the int8 bound, half a step of each row
  of x (max |x| / 127) times sum |w| plus half a step of each column of W (max |w| / 127) times sum |x|;
- a row alone and the same row among others: bitwise equal (no scale is shared across rows);
- end to end: the engine's greedy speculative output equals its own target-only greedy
  (tests/test_int4.py parametrizes the default engine), here also over prompts prefilled in chunks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dlite_trt.errors import ConfigError, EngineError
from dlite_trt.export.int4 import INT8_ACTIVATIONS, RTN, Int4Plan, quantize_model, quantize_rtn
from dlite_trt.export.int8_rows import QMAX, Int8Columns, quantize_rows
from test_int4 import _bundled_engine, _keys, _one_matmul, _shared_input_graph


def _int8_model(blocks):
    model, plan = _one_matmul(blocks, INT8_ACTIVATIONS)
    plan = replace(plan, prefill="int8")
    assert quantize_model(model, plan, "test", prefill=True) == 1
    return model, plan


def test_a_prefill_product_is_int8_rows_times_int8_columns_of_the_blocks() -> None:
    blocks = quantize_rtn("model.layers.0.self_attn.q_proj.weight",
                          np.random.default_rng(0).standard_normal((96, 128)).astype(np.float32) * 0.05)
    model, _ = _int8_model(blocks)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" not in ops and ops.count("MatMulIntegerToFloat") == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 9, 128)).astype(np.float32)
    x[0, 3, 5] = 40.0  # an outlier: it sets its own row's scale only
    got = session.run(None, {"x": x})[0]
    w = blocks.dequantize().astype(np.float64)  # [N, K]: what every other graph multiplies by
    columns = Int8Columns.of(blocks.dequantize())
    np.testing.assert_allclose(got, columns.reference(x), rtol=1e-6, atol=1e-6 * np.abs(got).max())
    # against the float product: within half a step of each row's and each column's int8 grid
    codes, s = quantize_rows(x)
    assert np.abs(codes).max() <= QMAX
    half_s, half_c = s.astype(np.float64) / 2, columns.scales.astype(np.float64) / 2  # [2, 9, 1], [96]
    bound = half_s * np.abs(w).sum(1) + (np.abs(x.astype(np.float64)).sum(-1, keepdims=True) + half_s * 128) * half_c
    err = np.abs(got - x.astype(np.float64) @ w.T)
    assert (err <= bound).all() and err.max() > 0
    assert err.max() < 0.1 * np.abs(x.astype(np.float64) @ w.T).max()


def test_each_row_is_computed_from_its_own_values_alone() -> None:
    """A prompt's entries do not depend on how it is chunked or what it is batched with."""
    blocks = quantize_rtn("model.layers.0.mlp.down_proj.weight",
                          np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32) * 0.05)
    model, _ = _int8_model(blocks)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((3, 37, 256)).astype(np.float32)
    x[1, 0] *= 300  # an attention-sink-like row
    together = session.run(None, {"x": x})[0]
    for b in range(3):
        for t in (0, 1, 17, 36):
            alone = session.run(None, {"x": x[b:b + 1, t:t + 1]})[0]
            np.testing.assert_array_equal(alone[0, 0], together[b, t])


def test_products_of_one_activation_share_its_rows_and_stack_their_columns() -> None:
    """q/k/v of a layer: one row quantization, one integer product over the stacked columns, a Split;
    each output equals its own product's."""
    rng = np.random.default_rng(4)
    blocks = [quantize_rtn(f"model.layers.0.self_attn.{p}_proj.weight",
                           rng.standard_normal((n, 64)).astype(np.float32) * 0.05) for p, n in (("q", 64), ("k", 32),
                                                                                                 ("v", 32))]
    model = _shared_input_graph(blocks, "/target/self_attn")
    plan = Int4Plan(RTN, {b.name: b for b in blocks}, _keys(blocks), accuracy_level=INT8_ACTIVATIONS, prefill="int8")
    assert quantize_model(model, plan, "test", prefill=True) == 3
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 1 and ops.count("Abs") == 1 and ops.count("Split") == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    for got, b in zip(session.run(None, {"x": x}), blocks, strict=True):
        np.testing.assert_allclose(got, Int8Columns.of(b.dequantize()).reference(x), rtol=1e-6, atol=1e-7)


def test_other_graphs_and_the_level_0_plan_keep_4bit_products() -> None:
    blocks = quantize_rtn("model.layers.0.mlp.up_proj.weight", np.ones((32, 64), np.float32), "Q4_0")
    model, plan = _one_matmul(blocks, INT8_ACTIVATIONS)
    quantize_model(model, replace(plan, prefill="int8"), "test", prefill=False)  # a decode or step graph
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    with pytest.raises(ConfigError, match="an int8 prefill runs at accuracy level 4 only"):
        Int4Plan(RTN, {}, {}, accuracy_level=0, prefill="int8")
    with pytest.raises(ConfigError, match="prefill's weights are one of"):
        Int4Plan(RTN, {}, {}, prefill="int2")


def test_prefill_settings_are_checked() -> None:
    from click.testing import CliRunner

    from dlite_trt.cli.build import command
    from dlite_trt.engine.build import BuildSettings
    from dlite_trt.engine.manifest import WeightFormat

    with pytest.raises(ConfigError, match="--prefill-weights int8: the prefill's products are chosen in int4"):
        BuildSettings(prefill_weights="int8")
    with pytest.raises(ConfigError, match="int8 at accuracy level 4 only"):
        BuildSettings(weights="int4", int4_accuracy_level=0, prefill_weights="int8")
    with pytest.raises(ConfigError, match="one of"):
        BuildSettings(weights="int4", prefill_weights="fp8")
    with pytest.raises(EngineError, match="prefill weights must be one of"):
        WeightFormat("int4", ("Q4_1",), RTN, 3, None, 0, "float", "float", 0, "int8")
    with pytest.raises(EngineError, match="prefill weights must be one of"):
        WeightFormat(prefill="int8")  # a float engine
    result = CliRunner().invoke(command, ["--out", "x", "--prefill-weights", "int8"])
    assert result.exit_code == 2 and "--prefill-weights applies to --dtype int4 only" in result.output


@pytest.fixture(scope="module")
def int8_prefill_engine(tmp_path_factory):
    return _bundled_engine(tmp_path_factory, INT8_ACTIVATIONS)  # the default: --prefill-weights int8


def test_the_default_int4_engine_prefills_every_target_matrix_in_int8(int8_prefill_engine) -> None:
    """The prefill graphs multiply by each target matrix once, as int8 columns of its blocks, stored once for
    both; the head and the draft stay on MatMulNBits there; the step and decode graphs have no int8 product."""
    from onnx.external_data_helper import ExternalDataInfo

    out, manifest, pair, plan = int8_prefill_engine
    assert manifest.weights.prefill == plan.prefill == "int8"
    places: dict[str, set] = {}
    for graph, paths in manifest.graphs.items():
        model = onnx.load(str(out / paths["onnx"]), load_external_data=False)
        int8 = [n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"]
        nbits = [n.input[1].rsplit(".", 1)[0].split("+") for n in model.graph.node if n.op_type == "MatMulNBits"]
        target_nbits = sorted(name for names in nbits for name in names if name in plan.matrices)
        if graph.startswith("prefill"):
            covered = sorted(name for n in int8 for name in n.input[1].removesuffix(".i8").split("+"))
            assert covered == sorted(plan.matrices) and not target_nbits, graph
            assert any(plan.head.name in names for names in nbits), graph
            for t in model.graph.initializer:
                if t.name.endswith(".i8"):  # the codes (their scales are small enough to sit in the graph)
                    assert t.data_location == onnx.TensorProto.EXTERNAL
                    info = ExternalDataInfo(t)
                    places.setdefault(t.name, set()).add((info.location, info.offset))
        else:
            assert not int8 and target_nbits == sorted(plan.matrices), graph
    assert places and all(len(p) == 1 for p in places.values())


def test_an_int8_prefill_engine_is_lossless_over_chunked_and_batched_prompts(int8_prefill_engine) -> None:
    """Prompts longer than the engine's prefill chunk (8 tokens here), two in one batch: speculative output
    equals the engine's own target-only greedy, and each prompt's output is the one it gets alone."""
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    out, _, pair, _ = int8_prefill_engine
    engine = open_engine(out)
    prompts = [pair.tokenizer.encode(p) for p in ("import os\nimport sys\n\n\ndef main(argv):\n    for a in argv:\n",
                                                  "class Point:\n    def __init__(self, x, y):\n        self.x = x\n")]
    assert min(len(p) for p in prompts) > 8
    params = SamplingParams(max_new_tokens=32)
    speculative = engine.generate(prompts, params)
    assert speculative.output_ids == engine.session(prompts).generate_target_only(params).output_ids
    for i, prompt in enumerate(prompts):
        assert engine.generate([prompt], params).output_ids[0] == speculative.output_ids[i]


def test_every_method_prefills_a_prompt_through_the_int8_products(int8_prefill_engine) -> None:
    """Target-only decoding and n-gram lookup run no draft, yet their prompt goes through the prefill graph
    too: the prompt's KV entries and first token are bitwise DLite's. (The decode graph, which prefilled
    them before, computes other entries: the check below that it does keeps this test able to fail.)"""
    import torch

    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
    from dlite_trt.runtime.session import SamplingParams

    out, manifest, pair, _ = int8_prefill_engine
    assert manifest.prefill_differs
    engine = open_engine(out)
    prompt = pair.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    for a in argv:\n        print(a)\n")
    n = len(prompt)

    def entries(session) -> tuple[torch.Tensor, torch.Tensor]:
        return session.cache.k[:, 0, :, :n].clone(), session.cache.v[:, 0, :, :n].clone()

    params = SamplingParams(max_new_tokens=1)
    dlite = engine.session([prompt])
    first = [e.new_tokens for e in dlite.stream(params)][0]
    target_only = engine.session([prompt])
    assert target_only.generate_target_only(params).output_ids == [list(first[0][:1])]
    lookup = engine.session([prompt])
    drafter = PromptLookupDrafter(1, PromptLookupConfig(num_tokens=pair.generator.draft.cfg.num_proposals))
    list(lookup.stream_drafted(params, drafter))
    for other in (target_only, lookup):
        for got, want in zip(entries(other), entries(dlite), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    decoded = engine.session([prompt])
    decoded._prefill("decode", {})
    assert not torch.equal(entries(decoded)[0], entries(dlite)[0])
    # sampled: the first token drawn from the same uniform as DLite's anchor (the first draw of either)
    sampled = SamplingParams(max_new_tokens=1, temperature=1.5, seed=7)
    anchor = [e.new_tokens for e in engine.session([prompt]).stream(sampled)][0][0][:1]
    assert engine.session([prompt]).generate_target_only(sampled).output_ids == [list(anchor)]


def _telling_prompts(engine, tokenizer, count: int) -> list[list[int]]:
    """Prompts (cut from a standard-library file) whose next token after a prefill through the int8 products
    differs from the one after the decode graph's 4-bit products: where the two prompt paths give another
    output, so a check on them can fail."""
    import inspect
    import textwrap

    ids = tokenizer.encode(inspect.getsource(textwrap))
    found = []
    for start in range(0, len(ids) - 40, 7):
        prompt = ids[start:start + 12 + start % 29]
        fast = engine.session([prompt]).prefill_target(np.zeros(1, np.float32), lambda: None)
        slow = engine.session([prompt])._prefill("decode", {})["next_tokens"][:, 0].tolist()
        if fast != slow:
            found.append(prompt)
            if len(found) == count:
                return found
    raise AssertionError(f"no prompt of textwrap's source tells the two prefills apart (found {len(found)})")


@pytest.mark.parametrize("speculative", ["none", "ngram", "dlite"])
def test_the_server_prefills_through_the_int8_products_in_every_mode(int8_prefill_engine, speculative) -> None:
    """A real server process on the engine (the scheduler's own prefill for its baselines): each mode's
    greedy completion equals the engine's own target-only greedy, whose prompt goes through the prefill
    graph, on prompts where a decode-graph prefill would give another first token."""
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.serve.openai_process import OpenAIServerProcess

    out, _, pair, _ = int8_prefill_engine
    engine = open_engine(out)
    prompts = _telling_prompts(engine, pair.tokenizer, 2)
    server = OpenAIServerProcess(out, "--speculative", speculative, model="m", threads=1, start_timeout=120)
    try:
        for ids in prompts:
            want = engine.session([ids]).generate_target_only(SamplingParams(max_new_tokens=24)).output_ids[0]
            status, r = server.post("/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 24,
                                                        "temperature": 0, "ignore_eos": True,
                                                        "return_token_ids": True})
            assert status == 200 and r["choices"][0]["token_ids"] == want, (ids, r)
    finally:
        server.stop()
