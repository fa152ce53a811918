"""MatMulNBits settings the int4 build and the engine manifest share (no heavy imports: the
manifest is read by every command)."""

HEAD_SCHEME = "Q8_0"  # the LM head's blocks, at accuracy level 4 (8-bit: a GGUF's own where it stores them)
HEAD_Q4 = "Q4_0"  # or 4-bit symmetric blocks, round-to-nearest: how onnxruntime-genai's int4 models store theirs
HEAD_WEIGHTS = (HEAD_SCHEME, HEAD_Q4)  # --head-weights of an int4 engine at accuracy level 4
# 4-bit by default: every call ~8% cheaper on SmolLM2 (2 cores), the argmax agreeing with the fp32 model at 69%
# of positions against 73% for Q8_0 (onnxruntime-genai's int4 model: 69%; docs/engine.md, the LM head)
DEFAULT_HEAD = HEAD_Q4
# how an engine stores the draft's matrices (not float: at level 4); Q4_0 symmetric (no minima: one product a
# matrix, as the 4-bit head), Q4_1 with a float minimum per block (an extra product and sum a matrix)
DRAFT_FORMATS = ("float", HEAD_SCHEME, HEAD_Q4, "Q4_1")
INT8_ACTIVATIONS = 4  # MatMulNBits accuracy_level: activations quantized to int8 per block
FP32_COMPUTE = 0  # MatMulNBits accuracy_level: fp32 compute on the dequantized weights
ACCURACY_LEVELS = (INT8_ACTIVATIONS, FP32_COMPUTE)
DEFAULT_ACCURACY_LEVEL = INT8_ACTIVATIONS  # the fastest; lossless with attention "gqa" (export/contract.py)
# the target's 4-bit blocks: "native", MatMulNBits' own forms (Q4_0, or Q4_ZP: a zero point per block; a Q4_1
# GGUF's blocks re-fitted), one node a product; "ggml", llama.cpp's (a GGUF's own blocks exactly; Q4_1's float
# minima then cost a float product and a sum per matrix: docs/engine.md)
BLOCK_FORMS = ("native", "ggml")
ZP_SCHEME = "Q4_ZP"  # MatMulNBits' own asymmetric form: fp32 scale s and 4-bit zero point z per block, w = s * (q - z)
DEFAULT_BLOCKS = "native"
# the prefill's products of the target's matrices (export/int8_rows.py): "int8", int8 codes per column x int8
# rows on MLAS's integer GEMM (AMX/VNNI; a 2,048-token prefill 1.8x faster on a Xeon with AMX), at accuracy level
# 4 only; "int4", MatMulNBits on the 4-bit blocks as in every other graph
PREFILL_WEIGHTS = ("int8", "int4")


def default_accuracy_level(attention: str) -> int:
    """The fastest level whose speculative output equals the engine's own target-only greedy: level 4
    where every position is computed alike by a verify and a decode call (attention "gqa"); over
    attention "ops" a verify and a decode call sum a position's attention in another order, which
    level 4's int8 rounding of the activations magnifies (docs/engine.md), so level 0 there."""
    return DEFAULT_ACCURACY_LEVEL if attention == "gqa" else FP32_COMPUTE


def default_prefill_weights(accuracy_level: int) -> str:
    """int8 at accuracy level 4 (the prefill's rows on MLAS's integer GEMM, the decode and verify calls
    unchanged, so speculative output stays the engine's target-only greedy); at level 0, whose point is fp32
    arithmetic on the 4-bit weights, the prefill's products as every other graph's."""
    return "int8" if accuracy_level == INT8_ACTIVATIONS else "int4"


def default_draft_format(weights: str, accuracy_level: int | None, quantizable: bool) -> str:
    """How the draft's matrices are stored (``quantizable``: the engine runs ONNX Runtime's MatMulNBits
    on fp32 activations, ``manifest.QUANTIZED_DRAFT_BUILDS``). Q8_0 at accuracy level 4, in an int4
    engine at level 4 and in an fp32 one (docs/engine.md: the draft's share of a step and its acceptance,
    measured per format; the target still verifies every token in its own precision, so output is
    unchanged); float elsewhere: an int4 engine at level 0 (a MatMulNBits of more than one row
    dequantizes its whole matrix first there, and the draft's backbone runs G + K rows), TensorRT, fp16."""
    if not quantizable or (weights == "int4" and accuracy_level != INT8_ACTIVATIONS):
        return "float"
    return HEAD_SCHEME
