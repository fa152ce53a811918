"""int4 engines (dlite_trt/export/int4.py) on real ONNX Runtime.

Tolerance tiers:
- block parsing, dequantization, GGUF bytes and row permutations: exact (bit for bit);
- one rewritten matmul against x @ W^T in float64 from the same blocks:
    accuracy level 0 (fp32 compute): 1e-5 of sum |x| |W| (fp32 accumulation over K; a float
      MatMul of the same weights is ~1e-6);
    accuracy level 4 (int8 activations): that, plus the activations' int8 rounding: at most half a
      step (max |x| / 127 of its block of 32) per element, times |w| of the weights the kernel
      multiplies, summed. The kernel stays within ~0.12 of that bound (measured: ``_int8_bound``);
- a whole level-0 int4 graph against the eager PyTorch graph on the dequantized weights: atol
  1e-4 on logits and hidden states, as for the fp32 graphs (tests/test_engine_graphs.py);
- end to end, at either level: the int4 engine's greedy speculative output equals its own
  target-only greedy.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from dlite_trt.engine.manifest import GRAPH_DIR, WeightFormat, load_manifest
from dlite_trt.errors import ConfigError, EngineError
from dlite_trt.export.int4 import (
    BLOCK,
    CONTRIB_DOMAIN,
    FP32_COMPUTE,
    GGUF,
    HEAD_NAME,
    INT8_ACTIVATIONS,
    RTN,
    Int4Plan,
    Q4Blocks,
    Q8Blocks,
    blocks_from_ggml,
    draft_only,
    gguf_blocks,
    gguf_head_blocks,
    nbits_tensors,
    plan_int4,
    q8_blocks_from_ggml,
    q8_nbits_tensors,
    quantize_model,
    quantize_q8_rtn,
    ZP_SCHEME,
    fit_zero_point,
    native_blocks,
    quantize_rtn,
    reference_matmul,
    with_draft,
)
from dlite_trt.export.nbits_levels import default_draft_format, default_prefill_weights
from dlite_trt.gguf_header import checked_header, read_raw_tensors

LIMITS = {"max_batch": 2, "max_seq_len": 128, "max_chunk": 8}


def _fp16_values(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float16).astype(np.float32)


def _blocks(scheme: str, n: int, k: int, seed: int = 0) -> Q4Blocks:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = np.abs(_fp16_values(rng, (n, k // BLOCK), 0.02))
    mins = _fp16_values(rng, (n, k // BLOCK), 0.1) if scheme == "Q4_1" else None
    zero_points = rng.integers(0, 16, (n, k // BLOCK), dtype=np.uint8) if scheme == ZP_SCHEME else None
    return Q4Blocks("model.layers.0.self_attn.q_proj.weight", scheme, codes, scales, mins, zero_points)


def _q8_blocks(n: int, k: int, seed: int = 0) -> Q8Blocks:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, (n, k), dtype=np.int16).astype(np.int8)
    return Q8Blocks(HEAD_NAME, codes, np.abs(_fp16_values(rng, (n, k // BLOCK), 0.01)))


def _one_matmul(blocks: Q4Blocks | Q8Blocks, level: int = FP32_COMPUTE) -> tuple[onnx.ModelProto, Int4Plan]:
    """x [B, T, K] @ W^T as the exporter writes a target projection (or the LM head), and a plan
    holding W's blocks at accuracy ``level``."""
    n, k = blocks.shape
    wt = np.ascontiguousarray(blocks.dequantize().T)  # [K, N]
    head = blocks.name == HEAD_NAME
    node = helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["y"],
                            name="/target/lm_head/MatMul" if head else "/target/q_proj/MatMul")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", n])],
                              [numpy_helper.from_array(wt, "onnx::MatMul_7")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    key = hashlib.sha256(wt.tobytes()).hexdigest()
    if head:
        return model, Int4Plan(RTN, {}, {key: blocks.name}, accuracy_level=level, head=blocks)
    return model, Int4Plan(RTN, {blocks.name: blocks}, {key: blocks.name}, accuracy_level=level)


def _kernel_weights(blocks: Q4Blocks | Q8Blocks) -> np.ndarray:
    """[N, K] float64: the weights MatMulNBits itself multiplies, d * (code - zero point) (a Q4_1
    matrix's minima are added apart, in fp32, through BlockSum)."""
    n, k = blocks.shape
    if isinstance(blocks, Q8Blocks):
        q = blocks.codes.astype(np.float64)
    elif blocks.zero_points is not None:  # Q4_ZP: its own zero point per block
        q = blocks.codes.astype(np.float64) - np.repeat(blocks.zero_points, BLOCK, axis=1)
    else:
        zero = 8 if nbits_tensors(blocks).zero_points is None else 0
        q = blocks.codes.astype(np.float64) - zero
    return (q.reshape(n, k // BLOCK, BLOCK) * blocks.scales[:, :, None]).reshape(n, k)


def _int8_bound(x: np.ndarray, kernel_w: np.ndarray) -> np.ndarray:
    """[.., N]: the largest error int8 activations can add (half a step of each block of 32 of x,
    max |x_block| / 127, times |w| summed): level 4's tolerance."""
    k = x.shape[-1]
    step = np.abs(x.astype(np.float64)).reshape(*x.shape[:-1], k // BLOCK, BLOCK).max(-1) / 127  # [.., K/32]
    wsum = np.abs(kernel_w).reshape(kernel_w.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, K/32]
    return step / 2 @ wsum.T


def _check_against_blocks(model: onnx.ModelProto, blocks: Q4Blocks | Q8Blocks, level: int = FP32_COMPUTE) -> float:
    """Run the rewritten model at two shapes against the blocks' float64 matmul; returns the
    largest error as a fraction of level 4's int8 bound (0 at level 0)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    w = np.abs(blocks.dequantize().astype(np.float64))
    worst = 0.0
    for b, t in ((1, 1), (3, 5)):
        x = rng.standard_normal((b, t, blocks.shape[1])).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        err = np.abs(y - reference_matmul(x, blocks))
        bound = 1e-5 * float((np.abs(x.astype(np.float64)) @ w.T).max())
        if level == INT8_ACTIVATIONS:
            int8 = _int8_bound(x, _kernel_weights(blocks))
            assert (err <= bound + int8).all(), f"worst {float((err / (bound + int8)).max()):.3f} of the bound"
            worst = max(worst, float((err / int8).max()))
        else:
            np.testing.assert_allclose(y, reference_matmul(x, blocks), rtol=0, atol=bound)
    return worst


@pytest.mark.parametrize("level", [FP32_COMPUTE, INT8_ACTIVATIONS])
@pytest.mark.parametrize("scheme", ["Q4_1", "Q4_0", ZP_SCHEME])
def test_rewritten_matmul_equals_the_blocks_matmul(scheme: str, level: int) -> None:
    blocks = _blocks(scheme, 96, 160)  # K = 160: five blocks, an odd count (the last zero point byte half used)
    model, plan = _one_matmul(blocks, level)
    assert quantize_model(model, plan, "test") == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 1 and "onnx::MatMul_7" not in {t.name for t in model.graph.initializer}
    nbits = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    # the kernel's default zero point 8, or Q4_ZP's own
    assert nbits.domain == CONTRIB_DOMAIN and len(nbits.input) == (4 if scheme == ZP_SCHEME else 3)
    attrs = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
    assert attrs["bits"] == 4 and attrs["accuracy_level"] == level
    assert ops.count("MatMul") == (2 if scheme == "Q4_1" else 0)  # BlockSum(x) and @ mins
    assert _check_against_blocks(model, blocks, level) < 0.5


def _nbits8(codes: np.ndarray, scales: np.ndarray, level: int, zero_points: np.ndarray | None) -> ort.InferenceSession:
    """One MatMulNBits bits=8 node: x [M, K] @ the blocks' W^T."""
    n, kb, _ = codes.shape
    inputs, inits = ["x", "B", "S"], [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S")]
    if zero_points is not None:
        inputs.append("Z")
        inits.append(numpy_helper.from_array(zero_points, "Z"))
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain=CONTRIB_DOMAIN, K=kb * BLOCK, N=n, bits=8,
                            block_size=BLOCK, accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", kb * BLOCK])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_8bit_kernels_default_zero_point_is_128() -> None:
    """What q8_nbits_tensors relies on: MatMulNBits bits=8 without zero_points computes d * (code - 128),
    at level 0 within the fp32 tier of numpy, and the same bits as explicit uint8 zero points of 128."""
    blocks = _q8_blocks(64, 96)
    t = q8_nbits_tensors(blocks)
    assert t.zero_points is None and t.mins is None and t.qweight.dtype == np.uint8
    np.testing.assert_array_equal(t.qweight.reshape(blocks.shape).astype(np.int16) - 128, blocks.codes)
    x = np.random.default_rng(2).standard_normal((3, 96)).astype(np.float32)
    w = np.abs(blocks.dequantize().astype(np.float64))
    for level in (FP32_COMPUTE, INT8_ACTIVATIONS):
        (y,) = _nbits8(t.qweight, t.scales, level, None).run(None, {"x": x})
        (y128,) = _nbits8(t.qweight, t.scales, level, np.full(64 * 96 // BLOCK, 128, np.uint8)).run(None, {"x": x})
        np.testing.assert_array_equal(y, y128)
        if level == FP32_COMPUTE:
            np.testing.assert_allclose(y, reference_matmul(x, blocks), rtol=0,
                                       atol=1e-5 * float((np.abs(x.astype(np.float64)) @ w.T).max()))


def test_rewritten_head_equals_the_q8_blocks_matmul() -> None:
    """The LM head as MatMulNBits bits=8 at level 4 against numpy from the same Q8_0 blocks."""
    blocks = _q8_blocks(200, 128)
    model, plan = _one_matmul(blocks, INT8_ACTIVATIONS)
    assert quantize_model(model, plan, "test") == 1
    (nbits,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
    assert nbits.op_type == "MatMulNBits" and list(nbits.input) == ["x", f"{HEAD_NAME}.q8", f"{HEAD_NAME}.scales"]
    assert attrs == {"K": 128, "N": 200, "bits": 8, "block_size": BLOCK, "accuracy_level": INT8_ACTIVATIONS}
    assert _check_against_blocks(model, blocks, INT8_ACTIVATIONS) < 0.5


def test_the_demo_heads_q8_0_blocks_run_within_the_int8_bound(smollm2_gguf: Path) -> None:
    """SmolLM2's own token_embd (its tied LM head, Q8_0) read exactly, and 4096 of its rows as the
    8-bit head at level 4 against numpy from those blocks."""
    from gguf import GGMLQuantizationType, quants

    spec = SimpleNamespace(architecture="llama", num_hidden_layers=30)
    (raw,) = read_raw_tensors(smollm2_gguf, ["token_embd.weight"]).values()
    head = gguf_head_blocks(smollm2_gguf, spec, raw.shape)  # no output.weight in the file: token_embd
    assert raw.type_name == "Q8_0" and head is not None and head.shape == (49152, 576)
    np.testing.assert_array_equal(head.dequantize(), quants.dequantize(raw.data, GGMLQuantizationType.Q8_0))
    rows = Q8Blocks(HEAD_NAME, head.codes[:4096], head.scales[:4096])
    model, plan = _one_matmul(rows, INT8_ACTIVATIONS)
    quantize_model(model, plan, "test")
    assert _check_against_blocks(model, rows, INT8_ACTIVATIONS) < 0.5


def test_a_tied_heads_embedding_gather_is_untouched() -> None:
    """Tied: the Gather reads the embedding [V, H], the head MatMul its folded copy W^T [H, V] or a
    Transpose of the embedding; only the MatMul becomes 8-bit, the Gather keeps the float embedding."""
    blocks = _q8_blocks(64, 32)
    emb = blocks.dequantize()  # [V, H]
    key = hashlib.sha256(np.ascontiguousarray(emb.T).tobytes()).hexdigest()
    for transposed in (False, True):
        nodes = [helper.make_node("Gather", ["emb", "ids"], ["h"], name="/target/embed_tokens/Gather")]
        inits = [numpy_helper.from_array(emb, "emb")]
        if transposed:
            nodes.append(helper.make_node("Transpose", ["emb"], ["emb_t"], name="/target/lm_head/Transpose",
                                          perm=[1, 0]))
        else:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(emb.T), "onnx::MatMul_9"))
        nodes.append(helper.make_node("MatMul", ["h", "emb_t" if transposed else "onnx::MatMul_9"], ["y"],
                                      name="/target/lm_head/MatMul"))
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 64])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        assert quantize_model(model, Int4Plan(RTN, {}, {key: HEAD_NAME}, accuracy_level=INT8_ACTIVATIONS,
                                              head=blocks), "test") == 1
        assert [n.op_type for n in model.graph.node] == ["Gather", "MatMulNBits"]
        inits = {t.name: t for t in model.graph.initializer}
        assert set(inits) == {"emb", f"{HEAD_NAME}.q8", f"{HEAD_NAME}.scales"}
        np.testing.assert_array_equal(numpy_helper.to_array(inits["emb"]), emb)


def test_an_8bit_head_needs_accuracy_level_4() -> None:
    with pytest.raises(ConfigError, match="a Q8_0 LM head runs at accuracy level 4 only"):
        Int4Plan(RTN, {}, {}, accuracy_level=FP32_COMPUTE, head=_q8_blocks(32, 32))
    with pytest.raises(ConfigError, match="accuracy level must be one of"):
        Int4Plan(RTN, {}, {}, accuracy_level=1)


def test_rtn_head_is_ggufs_q8_0() -> None:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(6).standard_normal((40, 64)).astype(np.float32)
    blocks = quantize_q8_rtn(HEAD_NAME, w)
    want = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(blocks.dequantize(), want)
    step = np.abs(w).reshape(40, 2, BLOCK).max(-1, keepdims=True) / 127
    # half a step, plus the fp16 rounding of the scale (at most 2^-11 of it) on codes up to 127
    assert (np.abs(blocks.dequantize() - w).reshape(40, 2, BLOCK) <= step * (0.5 + 127 * 2.0 ** -11)).all()


def test_minima_not_exact_once_shifted_use_explicit_zero_points() -> None:
    """m + 8 d not exact in fp32 (d = 1, m = 2^-14 (1 + 2^-10)): zero points 0 and the minima as they are."""
    blocks = _blocks("Q4_1", 64, 64)
    blocks.scales[3, 1], blocks.mins[3, 1] = 1.0, np.float32(np.float16(2.0 ** -14 * (1 + 2.0 ** -10)))
    t = nbits_tensors(blocks)
    assert t.zero_points is not None and not t.zero_points.any()
    np.testing.assert_array_equal(t.mins, blocks.mins.T)
    model, plan = _one_matmul(blocks)
    quantize_model(model, plan, "test")
    assert len(next(n for n in model.graph.node if n.op_type == "MatMulNBits").input) == 4
    _check_against_blocks(model, blocks)


def _shared_input_graph(blocks: list[Q4Blocks | Q8Blocks], scope: str) -> onnx.ModelProto:
    """x [B, T, K] @ each matrix's W^T, as the exporter writes q/k/v (one activation, three products)."""
    k = blocks[0].shape[1]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"{scope}/p{i}/MatMul")
             for i in range(len(blocks))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["B", "T", b.shape[0]])
                               for i, b in enumerate(blocks)],
                              [numpy_helper.from_array(np.ascontiguousarray(b.dequantize().T), f"w{i}")
                               for i, b in enumerate(blocks)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _keys(blocks: list[Q4Blocks | Q8Blocks]) -> dict[str, str]:
    """A plan's keys of these matrices: the digest of W^T, as the exporter folds it, -> name."""
    return {hashlib.sha256(np.ascontiguousarray(b.dequantize().T).tobytes()).hexdigest(): b.name for b in blocks}


# an 8-bit draft runs at level 4 only
@pytest.mark.parametrize(("scheme", "level"), [("Q4_1", FP32_COMPUTE), ("Q4_1", INT8_ACTIVATIONS), ("Q4_0", FP32_COMPUTE),
                                               ("Q4_0", INT8_ACTIVATIONS), ("Q8_0", INT8_ACTIVATIONS)])
def test_products_of_one_activation_run_as_one_node_with_each_products_columns(scheme: str, level: int) -> None:
    """q/k/v (or gate/up) stacked along N into one MatMulNBits and split: bitwise the columns each
    matrix's own node gives, at both levels, at 1 and several rows."""
    if scheme == "Q8_0":  # 8-bit products of a draft, outside the target's scope
        blocks = [replace(_q8_blocks(n, 160, seed=i), name=f"draft.layers.0.p{i}.weight")
                  for i, n in enumerate((32, 64, 96))]
        scope, plan = "/layers.0", Int4Plan(RTN, {}, {}, accuracy_level=level, draft={b.name: b for b in blocks})
    else:
        blocks = [replace(_blocks(scheme, n, 160, seed=i), name=f"model.layers.0.p{i}.weight")
                  for i, n in enumerate((32, 64, 96))]
        scope, plan = "/target", Int4Plan(RTN, {b.name: b for b in blocks}, {}, accuracy_level=level)
    keys = _keys(blocks)
    plan = replace(plan, keys=keys)
    fused = _shared_input_graph(blocks, scope)
    assert quantize_model(fused, plan, "test", runs_draft=scheme == "Q8_0") == 3
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MatMulNBits") == 1 and ops.count("Split") == 1
    assert ops.count("MatMul") == (2 if scheme == "Q4_1" else 0)  # one BlockSum and one product with the minima
    rng = np.random.default_rng(3)
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    for b in blocks:
        alone = _shared_input_graph([b], scope)
        only = {"draft": {b.name: b}} if scheme == "Q8_0" else {"matrices": {b.name: b}}
        quantize_model(alone, replace(plan, keys={k: n for k, n in keys.items() if n == b.name}, **only), "test",
                       runs_draft=scheme == "Q8_0")
        assert [n.op_type for n in alone.graph.node].count("Split") == 0
        one = ort.InferenceSession(alone.SerializeToString(), providers=["CPUExecutionProvider"])
        for shape in ((1, 1, 160), (1, 2, 160), (3, 5, 160)):
            x = rng.standard_normal(shape).astype(np.float32)
            i = blocks.index(b)
            np.testing.assert_array_equal(session.run([f"y{i}"], {"x": x})[0], one.run(None, {"x": x})[0])


def test_products_in_other_forms_are_not_stacked() -> None:
    """A Q4_1 matrix whose shifted minima are not exact (explicit zero points) runs apart from the others."""
    blocks = [replace(_blocks("Q4_1", 64, 64, seed=i), name=f"model.layers.0.p{i}.weight") for i in range(3)]
    blocks[2].scales[3, 1], blocks[2].mins[3, 1] = 1.0, np.float32(np.float16(2.0 ** -14 * (1 + 2.0 ** -10)))
    model = _shared_input_graph(blocks, "/target")
    quantize_model(model, Int4Plan(RTN, {b.name: b for b in blocks}, _keys(blocks)), "test")
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert sorted(len(n.input) for n in nbits) == [3, 4]  # the stacked pair, and the one with zero points
    assert [n.op_type for n in model.graph.node].count("MatMul") == 3  # one BlockSum, two products with minima


def test_a_graph_without_the_plans_matrix_is_refused() -> None:
    model, _ = _one_matmul(_blocks("Q4_1", 32, 64))
    other = _blocks("Q4_1", 32, 64, seed=5)
    with pytest.raises(EngineError, match="1 of the 1 quantized matrices were not found"):
        quantize_model(model, Int4Plan(RTN, {other.name: other}, {"0" * 64: other.name}), "test")


def test_rtn_is_ggufs_q4_1() -> None:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(2).standard_normal((48, 128)).astype(np.float32)
    blocks = quantize_rtn("w", w)
    want = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(blocks.dequantize(), want)
    assert np.abs(blocks.dequantize() - w).max() <= (w.max() - w.min()) / 15  # within a step of each block


def test_zero_point_blocks_fit_weights_as_closely_as_q4_1() -> None:
    """Q4_ZP (MatMulNBits' own asymmetric form, ``native`` blocks) fitted to float weights: each weight
    within a step of its block, and as close overall as gguf's Q4_1 (same 16 levels a block, its
    offset a multiple of the step); a Q4_1 matrix re-fitted keeps nearly all its codes and moves each
    weight by less than a step (by a quarter of one typically)."""
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    w[0, :32] = np.linspace(0.1, 0.9, 32)  # a block of positive weights only: its zero point clamps at 0
    fitted = fit_zero_point("w", w)
    assert fitted.scheme == ZP_SCHEME and fitted.mins is None and fitted.zero_points.max() <= 15
    blocks = w.reshape(64, 8, 32)
    err = np.abs(fitted.dequantize() - w).reshape(64, 8, 32)
    step = (np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)) / 15  # the range holds 0
    assert (err <= step[..., None] + 1e-6).all()
    q4_1 = quantize_rtn("w", w)
    rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
    assert rms(fitted.dequantize() - w) <= 1.05 * rms(q4_1.dequantize() - w)
    refit = native_blocks(q4_1)
    assert native_blocks(refit) is refit and native_blocks(_blocks("Q4_0", 8, 64)).scheme == "Q4_0"
    assert np.mean(refit.codes == q4_1.codes) > 0.8
    moved = np.abs(refit.dequantize() - q4_1.dequantize()).reshape(64, 8, 32) / q4_1.scales[..., None]  # in steps
    assert moved.max() < 1 and np.median(moved) < 0.3


# --------------------------------------------------------------------------------------------- GGUF blocks


def _tiny_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF holding ``tensors`` (name -> float [N, K], ggml type name), quantized by gguf."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["a", "b"])
    for name, (w, qtype) in tensors.items():
        t = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_q4_1_blocks_read_exactly_and_unpermuted(tmp_path: Path) -> None:
    """A synthetic llama GGUF: our reader's blocks dequantize bit for bit to gguf's own dequantize,
    and q/k rows come back in Hugging Face order as transformers' GGUF loader puts them."""
    from gguf import GGMLQuantizationType, quants
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(3)
    spec = SimpleNamespace(architecture="llama", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (64, 96), "model.layers.0.self_attn.k_proj.weight": (32, 96),
              "model.layers.0.mlp.down_proj.weight": (96, 64)}
    gguf_names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"]
    weights = {g: rng.standard_normal(s).astype(np.float32) for g, s in zip(gguf_names, shapes.values(), strict=True)}
    path = _tiny_gguf(tmp_path / "tiny.gguf", {g: (w, "Q4_1") for g, w in weights.items()})
    raw = read_raw_tensors(path, gguf_names)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    blocks = gguf_blocks(path, spec, shapes)
    for (hf_name, shape), g in zip(shapes.items(), gguf_names, strict=True):
        assert raw[g].type_name == "Q4_1" and raw[g].shape == shape
        stored = quants.dequantize(raw[g].data, GGMLQuantizationType.Q4_1)
        np.testing.assert_array_equal(blocks_from_ggml(g, "Q4_1", raw[g].data, shape).dequantize(), stored)
        np.testing.assert_array_equal(blocks[hf_name].dequantize(), processor.process(stored, g).weights)


def test_gguf_of_another_quant_type_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    spec = SimpleNamespace(architecture="qwen3", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    path = _tiny_gguf(tmp_path / "q8.gguf", {"blk.0.ffn_up.weight": (rng.standard_normal((64, 64)).astype(np.float32),
                                                                       "Q8_0")})
    with pytest.raises(ConfigError, match=r"as Q8_0 \(e.g. blk.0.ffn_up.weight\).*Q4_1 or Q4_0 GGUF"):
        gguf_blocks(path, spec, {"model.layers.0.mlp.up_proj.weight": (64, 64)})


def test_gguf_head_blocks_are_the_output_tensor_else_token_embd(tmp_path: Path) -> None:
    """As llama.cpp reads a head: ``output.weight``, or where the file has none (tied) ``token_embd``;
    a head stored other than Q8_0 gives None (it stays float)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(7)
    spec = SimpleNamespace(architecture="llama", num_hidden_layers=1)
    emb, out = (rng.standard_normal((64, 96)).astype(np.float32) for _ in range(2))
    cases = {"tied": ({"token_embd.weight": (emb, "Q8_0")}, "token_embd.weight"),
             "untied": ({"token_embd.weight": (emb, "F16"), "output.weight": (out, "Q8_0")}, "output.weight"),
             "tied-f16": ({"token_embd.weight": (emb, "F16")}, None),
             "untied-q4_1": ({"token_embd.weight": (emb, "Q8_0"), "output.weight": (out, "Q4_1")}, None)}
    for case, (tensors, want) in cases.items():
        path = _tiny_gguf(tmp_path / f"{case}.gguf", tensors)
        head = gguf_head_blocks(path, spec, (64, 96))
        if want is None:
            assert head is None, case
            continue
        (raw,) = read_raw_tensors(path, [want]).values()
        assert head.name == HEAD_NAME
        np.testing.assert_array_equal(head.dequantize(), quants.dequantize(raw.data, GGMLQuantizationType.Q8_0))
        np.testing.assert_array_equal(q8_blocks_from_ggml(want, raw.data, raw.shape).codes, head.codes)


def test_the_demo_ggufs_first_q4_1_tensor_reads_exactly(smollm2_gguf: Path) -> None:
    from gguf import GGMLQuantizationType, quants

    header = checked_header(smollm2_gguf, smollm2_gguf.stat().st_size)
    first = next(t for t in header.tensors if t.type_id == GGMLQuantizationType.Q4_1)
    (raw,) = read_raw_tensors(smollm2_gguf, [first.name]).values()
    blocks = blocks_from_ggml(first.name, "Q4_1", raw.data, raw.shape)
    np.testing.assert_array_equal(blocks.dequantize(), quants.dequantize(raw.data, GGMLQuantizationType.Q4_1))


# --------------------------------------------------------------------------------------------- an engine


def _bundled_engine(tmp_path_factory, level: int, draft_format: str | None = None, head: str | None = None,
                   prefill: str | None = None):
    """The bundled tiny pair (not a GGUF: round-to-nearest Q4_1, and at level 4 a round-to-nearest
    head, Q8_0 or ``head``; its head is untied) as an int4 engine at accuracy ``level`` (the draft:
    ``draft_format``, else the level's default; the prefill's products: ``prefill``, else the level's
    default), and its plan."""
    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.loading import load_pair

    target, draft = bundled_pair()
    out = tmp_path_factory.mktemp(f"int4-l{level}") / "engine"
    settings = BuildSettings(weights="int4", int4_accuracy_level=level, draft_weights=draft_format,
                             head_weights=head, prefill_weights=prefill, limits=EngineLimits(**LIMITS))
    manifest = build_engine(target, draft, out, settings, progress=False)
    pair = load_pair(target, draft)
    plan = plan_int4(pair.generator.target, pair.source.spec, pair.source.path, level, head_format=head or "Q4_0")
    plan = replace(plan, prefill=prefill or default_prefill_weights(level))
    return out, manifest, pair, with_draft(plan, pair.generator.draft, draft_format or default_draft_format("int4", level, True))


@pytest.fixture(scope="module")
def bundled_int4(tmp_path_factory):
    """The default: accuracy level 4, the LM head 4-bit, the draft 8-bit."""
    return _bundled_engine(tmp_path_factory, INT8_ACTIVATIONS)


@pytest.fixture(scope="module")
def bundled_int4_l0(tmp_path_factory):
    return _bundled_engine(tmp_path_factory, FP32_COMPUTE)


@pytest.fixture(scope="module")
def bundled_int4_q4_draft(tmp_path_factory):
    return _bundled_engine(tmp_path_factory, INT8_ACTIVATIONS, "Q4_1")


@pytest.fixture(scope="module")
def bundled_int4_q4_0_draft(tmp_path_factory):
    return _bundled_engine(tmp_path_factory, INT8_ACTIVATIONS, "Q4_0")


@pytest.fixture(scope="module")
def bundled_int4_q8_head(tmp_path_factory):
    """The head 8-bit, and the prefill's products 4-bit like every other graph's (--prefill-weights int4)."""
    return _bundled_engine(tmp_path_factory, INT8_ACTIVATIONS, head="Q8_0", prefill="int4")


@pytest.mark.parametrize(("engine", "level", "head", "draft", "prefill"),
                         [("bundled_int4", 4, "Q4_0", "Q8_0", "int8"),
                          ("bundled_int4_q8_head", 4, "Q8_0", "Q8_0", "int4"),
                          ("bundled_int4_q4_0_draft", 4, "Q4_0", "Q4_0", "int8"),
                          ("bundled_int4_l0", 0, "float", "float", "int4")])
def test_int4_manifest_records_the_weight_format(engine: str, level: int, head: str, draft: str, prefill: str,
                                                 request) -> None:
    from dlite_trt.engine.manifest import Manifest

    out, manifest, pair, plan = request.getfixturevalue(engine)
    cfg = pair.generator.draft.cfg
    draft_matrices = (7 * cfg.num_hidden_layers + 1) if draft != "float" else 0  # the layers' and output_proj
    want = WeightFormat("int4", (ZP_SCHEME,), RTN, len(plan.matrices), None, level, head, draft, draft_matrices,
                        prefill)
    assert manifest.weights == want == load_manifest(out).weights and manifest.dtype == "fp32"
    assert plan.head_format == head and len(plan.matrices) == 7 * pair.source.spec.num_hidden_layers
    assert plan.draft_format == draft and len(plan.draft) == draft_matrices
    text = manifest.weights.describe(manifest.dtype)
    assert text.startswith("int4 weights (Q4_ZP quantized round-to-nearest at build, 28 target matrices; LM head ")
    assert f"(accuracy level {level}" in text and (f"LM head {head}" if level == 4 else "LM head fp32") in text
    assert (f"draft {draft} ({draft_matrices} matrices)" if draft != "float" else "draft fp32") in text
    assert ("the prefill's products int8 x int8" in text) == (prefill == "int8")
    # a record from before the prefill could run int8 reads as an int4 prefill
    old = {k: v for k, v in manifest.weights.to_dict().items() if k != "prefill"}
    assert WeightFormat.from_dict(old).prefill == "int4"
    # a record from before the draft could be quantized reads as a float draft
    old = {k: v for k, v in manifest.weights.to_dict().items() if not k.startswith("draft")}
    assert WeightFormat.from_dict(old).draft == "float"
    # an int4 record that does not say how it runs is refused, never read as one level or the other
    data = manifest.to_dict()
    for key in ("accuracy_level", "head"):
        del data["weights"][key]
    with pytest.raises(EngineError, match=r"does not record its MatMulNBits accuracy level.*rebuild it"):
        Manifest.from_dict(data, "m.json")
    # the attention is part of the I/O contract (attention "gqa": the in-place cache outputs)
    data = manifest.to_dict()
    assert data["attention"] == "gqa" == load_manifest(out).attention
    for edit in ({"attention": "ops"}, {"attention": "flash"}):
        with pytest.raises(EngineError, match="I/O contract does not match|with attention 'flash' is not"):
            Manifest.from_dict(data | edit, "m.json")


def test_a_float_weight_record_without_the_int4_fields_reads_as_float() -> None:
    fp32 = WeightFormat.from_dict({"format": "float", "schemes": [], "origin": None, "matrices": 0,
                                   "gguf_sha256": None})
    assert fp32 == WeightFormat() and fp32.describe("fp32") == "fp32"
    assert WeightFormat.from_dict(WeightFormat("int4", ("Q4_0",), GGUF, 3, "ab", 0).to_dict()).accuracy_level == 0
    with pytest.raises(EngineError, match="quantized only at accuracy level 4"):
        WeightFormat("int4", ("Q4_1",), RTN, 3, None, 0, "Q8_0")
    with pytest.raises(EngineError, match="inconsistent"):
        WeightFormat("int4", ("Q4_1",), RTN, 3)  # no accuracy level


@torch.no_grad()
def test_int4_graphs_match_the_reference_on_dequantized_weights(bundled_int4_l0) -> None:
    """Level 0: the int4 engine's decode and prefill graphs against the eager graphs of the same
    target with every projection set to its dequantized blocks (the fp32 engine on those weights)."""
    from dlite_trt.export.contract import dummy_inputs, present_output
    from dlite_trt.export.graphs import graph_module

    out, manifest, pair, plan = bundled_int4_l0
    assert plan.head is None
    target, draft = pair.generator.target, pair.generator.draft
    params = dict(target.named_parameters())
    for name, blocks in plan.matrices.items():
        params[name].copy_(torch.from_numpy(blocks.dequantize()))
    rng = np.random.default_rng(0)
    for graph, sizes in (("decode", {"batch": 2, "chunk": 5, "outputs": 3, "cache": 24}),
                         ("prefill", {"batch": 1, "chunk": 7, "cache": 16})):
        spec = manifest.contract[graph]
        session = ort.InferenceSession(str(out / manifest.graphs[graph]["runtime"]), providers=["CPUExecutionProvider"])
        assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(out / manifest.graphs[graph]["runtime"]),
                                                                 load_external_data=False).graph.node)
        feed = dummy_inputs(spec, sizes, vocab_size=manifest.target_spec.vocab_size, rng=rng)
        got = dict(zip(spec.output_names, session.run(None, feed), strict=True))
        eager = graph_module(spec, target, draft)(*(torch.from_numpy(feed[n]) for n in spec.input_names))
        for name, want in zip(spec.output_names, eager, strict=True):
            if want.is_floating_point() and present_output(name) is None:  # the cache buffers: test_cache_attention
                np.testing.assert_allclose(got[name], want.numpy(), rtol=0, atol=1e-4, err_msg=f"{graph} {name}")


def _nbits_nodes(model: onnx.ModelProto) -> dict[str, dict]:
    """Each MatMulNBits' attributes, and ``names``: the parameters its weights stack ("+"-joined)."""
    return {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}
            | {"names": n.input[1].rsplit(".", 1)[0].split("+")}
            for n in model.graph.node if n.op_type == "MatMulNBits"}


def test_int4_weights_are_stored_once_for_all_graphs(bundled_int4_q8_head) -> None:
    """Every int4 and 8-bit tensor of every graph points at one place in weights.bin; every graph
    runs the head 8-bit (--head-weights Q8_0) and the projections 4-bit, each matrix exactly where the model
    multiplies by it (stacked with the others of its activation: q/k/v, gate/up), and its embedding
    Gathers (the target's, and the draft's in the step and prefill graphs) read the float embedding."""
    from onnx.external_data_helper import ExternalDataInfo

    out, manifest, pair, plan = bundled_int4_q8_head
    embed = pair.generator.target.embed_weight.detach().numpy()
    k = pair.generator.draft.cfg.num_proposals  # the head projects onto its vocabulary once a drafted token
    layers = pair.source.spec.num_hidden_layers
    where: dict[str, set] = {}
    for graph, paths in manifest.graphs.items():
        model = onnx.load(str(out / paths["onnx"]), load_external_data=False)
        nodes = _nbits_nodes(model)
        assert {a["bits"] for a in nodes.values()} == {4, 8} and {a["accuracy_level"] for a in nodes.values()} == {4}
        for a in nodes.values():
            assert a["N"] == sum(plan.blocks(name).shape[0] for name in a["names"]), a
        covered = sorted(name for a in nodes.values() for name in a["names"])
        drafted = graph in ("prefill", "prefill_sampling", "step", "step_sampling")  # the graphs that run the draft
        # every target matrix and the head once; with the draft, each of its matrices once, its output projection
        # once a drafted token
        want = sorted(plan.names) if not drafted else sorted(
            list(plan.names) + list(plan.draft) + ["draft.sequential_head.output_proj.weight"] * (k - 1))
        assert covered == want, graph
        # per target layer: q/k/v stacked, o, gate/up stacked, down
        assert sum(a["bits"] == 4 and a["names"][0].startswith("model.") for a in nodes.values()) == 4 * layers, graph
        gathers = {n.input[0] for n in model.graph.node
                   if n.op_type == "Gather" and n.input[0].endswith("embed_tokens.weight")}
        assert gathers == {"target.model.embed_tokens.weight"}, graph
        onnx.load_external_data_for_model(model, str(out / GRAPH_DIR))
        emb = next(t for t in model.graph.initializer if t.name in gathers)
        np.testing.assert_array_equal(numpy_helper.to_array(emb), embed)
        for rel in paths.values():
            for t in onnx.load(str(out / rel), load_external_data=False).graph.initializer:
                if t.name.endswith((".q4", ".q8", ".scales", ".mins")) and t.data_location == onnx.TensorProto.EXTERNAL:
                    info = ExternalDataInfo(t)
                    where.setdefault(t.name, set()).add((info.location, info.offset))
    assert all(len(places) == 1 for places in where.values()), where


PROMPTS = ("def main():\n    ", "import os\nimport")


@pytest.mark.parametrize("engine", ["bundled_int4", "bundled_int4_l0", "bundled_int4_q4_draft", "bundled_int4_q4_0_draft",
                                    "bundled_int4_q8_head"])
def test_int4_speculative_greedy_equals_its_target_only_greedy(engine: str, request) -> None:
    """At both levels (at level 4 through attention "gqa", the default: a verify and a decode call
    compute every position alike, tests/test_call_rows.py; over attention "ops" level 4's int8
    rounding magnifies their different attention sums into different tokens at near-ties), with
    the draft 8-bit (the level-4 default), 4-bit (Q4_1, Q4_0) and float (level 0), and the head
    4-bit (the default) and 8-bit."""
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    out, manifest, pair, _ = request.getfixturevalue(engine)
    assert manifest.attention == "gqa"
    engine = open_engine(out)
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=40)
    speculative = engine.generate(prompts, params)
    assert speculative.output_ids == engine.session(prompts).generate_target_only(params).output_ids
    assert max(speculative.acceptance_lengths(0)) > 1  # the draft's blocks were really verified


@pytest.fixture(scope="module")
def bundled_fp32_q8_draft(tmp_path_factory):
    """The bundled tiny pair as an fp32 engine at the defaults: the target fp32, the draft Q8_0."""
    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.loading import load_pair

    target, draft = bundled_pair()
    out = tmp_path_factory.mktemp("fp32-q8-draft") / "engine"
    manifest = build_engine(target, draft, out, BuildSettings(limits=EngineLimits(**LIMITS)), progress=False)
    return out, manifest, load_pair(target, draft)


def test_an_fp32_engine_drafts_through_8_bit_blocks_and_stays_lossless(bundled_fp32_q8_draft) -> None:
    """The default fp32 engine (ONNX Runtime) stores the draft's matrices Q8_0 and runs them at level 4,
    in the graphs that draft and nowhere else; the target is untouched (no MatMulNBits under /target/),
    so speculative greedy equals transformers' greedy on the fp32 target."""
    from transformers import AutoModelForCausalLM

    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams
    from helpers import hf_greedy

    out, manifest, pair = bundled_fp32_q8_draft
    cfg = pair.generator.draft.cfg
    want = WeightFormat(draft="Q8_0", draft_matrices=7 * cfg.num_hidden_layers + 1)  # the layers' and output_proj
    assert manifest.weights == want == load_manifest(out).weights and manifest.dtype == "fp32"
    assert manifest.weights.describe("fp32") == (f"fp32; draft Q8_0 ({want.draft_matrices} matrices), int8 "
                                                 "activations in the quantized matmuls (accuracy level 4)")
    plan = with_draft(draft_only(), pair.generator.draft, "Q8_0")
    k = cfg.num_proposals
    for graph, paths in manifest.graphs.items():
        nodes = _nbits_nodes(onnx.load(str(out / paths["onnx"]), load_external_data=False))
        drafted = graph in ("prefill", "prefill_sampling", "step", "step_sampling")
        covered = sorted(name for a in nodes.values() for name in a["names"])
        assert covered == (sorted(list(plan.draft) + ["draft.sequential_head.output_proj.weight"] * (k - 1))
                           if drafted else []), graph
        assert all(a["bits"] == 8 and a["accuracy_level"] == 4 for a in nodes.values())
        assert not any(name.startswith("/target/") for name in nodes), graph
    engine = open_engine(out)
    hf = AutoModelForCausalLM.from_pretrained(pair.source.path, torch_dtype=torch.float32)
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=40)
    speculative = engine.generate(prompts, params)
    assert speculative.output_ids == [hf_greedy(hf, p, 40) for p in prompts]
    assert max(speculative.acceptance_lengths(0)) > 1  # the draft's blocks were really verified
    # a quantized draft only where MatMulNBits runs it (not in a TensorRT engine's manifest)
    from dlite_trt.engine.manifest import Manifest

    data = manifest.to_dict() | {"backend": "tensorrt", "attention": "ops"}
    with pytest.raises(EngineError, match="tensorrt fp32 engine with a Q8_0 draft is not something"):
        Manifest.from_dict(data, "m.json")
    # a float record from before drafts could be quantized, and the same record with one: each reads as written
    assert WeightFormat.from_dict({"format": "float", "schemes": [], "origin": None, "matrices": 0,
                                   "gguf_sha256": None}).draft == "float"
    assert WeightFormat.from_dict(want.to_dict()) == want


def test_int4_settings_are_checked() -> None:
    from dlite_trt.engine.build import BuildSettings

    with pytest.raises(ConfigError, match="int4 runs on ONNX Runtime"):
        BuildSettings(backend="tensorrt", weights="int4")
    with pytest.raises(ConfigError, match="fp32 activations"):
        BuildSettings(dtype="fp16", weights="int4")
    with pytest.raises(EngineError, match="inconsistent"):
        WeightFormat("int4")
    with pytest.raises(ConfigError, match="accuracy level must be one of"):
        BuildSettings(weights="int4", int4_accuracy_level=2)
    with pytest.raises(ConfigError, match="runs at int4 accuracy level 4 only"):
        BuildSettings(weights="int4", int4_accuracy_level=0, draft_weights="Q8_0")
    with pytest.raises(ConfigError, match="not in a onnxruntime fp16 engine"):
        BuildSettings(dtype="fp16", draft_weights="Q8_0")
    with pytest.raises(ConfigError, match="not in a tensorrt fp32 engine"):
        BuildSettings(backend="tensorrt", draft_weights="Q4_1")
    with pytest.raises(ConfigError, match="one of"):
        BuildSettings(weights="int4", draft_weights="Q2_K")
    with pytest.raises(EngineError, match="draft format must be one of"):
        WeightFormat("int4", ("Q4_1",), RTN, 3, None, 0, "float", "Q8_0", 3)  # a quantized draft at level 0
    with pytest.raises(ConfigError, match="LM head's weights are one of"):
        BuildSettings(weights="int4", head_weights="Q2_K")
    for settings in ({}, {"weights": "int4", "int4_accuracy_level": 0}):
        with pytest.raises(ConfigError, match="--head-weights Q4_0: the LM head is quantized in int4 engines at"):
            BuildSettings(head_weights="Q4_0", **settings)
    with pytest.raises(EngineError, match="quantized only at accuracy level 4"):
        WeightFormat("int4", ("Q4_1",), RTN, 3, None, 0, "Q4_0")
    with pytest.raises(ConfigError, match="a Q4_0 LM head runs at accuracy level 4 only"):
        Int4Plan(RTN, {}, {}, accuracy_level=FP32_COMPUTE, head=quantize_rtn(HEAD_NAME, np.ones((32, 32)), "Q4_0"))


def test_a_4bit_head_runs_in_every_graph_as_its_q4_0_blocks(bundled_int4) -> None:
    """The default head (--head-weights Q4_0): every graph multiplies by the head as one 4-bit
    MatMulNBits (no zero points: the kernel's symmetric default) over gguf's round-to-nearest Q4_0
    blocks of the head, and that node's output equals numpy on those blocks within level 4's int8 bound."""
    out, manifest, pair, plan = bundled_int4
    head = pair.generator.target.lm_head.weight.detach().float().numpy()
    want = quantize_rtn(HEAD_NAME, head, "Q4_0")
    assert plan.head.scheme == "Q4_0" and np.array_equal(plan.head.codes, want.codes)
    for graph, paths in manifest.graphs.items():
        model = onnx.load(str(out / paths["onnx"]), load_external_data=False)
        (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith(HEAD_NAME)]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["accuracy_level"], len(node.input)) == (4, 4, 3), graph
    model, head_plan = _one_matmul(want, INT8_ACTIVATIONS)
    assert head_plan.head is want and quantize_model(model, head_plan, "test") == 1
    _check_against_blocks(model, want, INT8_ACTIVATIONS)


def test_the_accuracy_level_option_needs_dtype_int4() -> None:
    from click.testing import CliRunner

    from dlite_trt.cli.build import command

    for option, value in (("--int4-accuracy-level", "0"), ("--int4-blocks", "ggml"), ("--head-weights", "Q4_0")):
        result = CliRunner().invoke(command, ["--out", "x", option, value])
        assert result.exit_code == 2 and f"{option} applies to --dtype int4 only" in result.output
