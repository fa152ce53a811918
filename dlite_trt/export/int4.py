"""int4 weight-only engines: the target's projection matrices on ONNX Runtime's ``MatMulNBits``.

What is quantized and what stays float (``dlite-trt build --dtype int4``):
- int4: every ``nn.Linear`` of the target's decoder layers (q/k/v/o, gate/up/down), stored in
  4-bit blocks, 32 weights per block along K (the input dim):
    Q4_1: fp16 scale d and fp16 minimum m per block, w = d * q + m, q in 0..15
    Q4_0: fp16 scale d per block, w = d * (q - 8)
    Q4_ZP: fp32 scale s and 4-bit zero point z per block, w = s * (q - z): MatMulNBits' own form
  With ``blocks`` "ggml" a Q4_1/Q4_0 GGUF's own blocks are kept exactly (never requantized) and any
  other target is quantized round-to-nearest into Q4_1 (min/max per block, gguf's own quantizer);
  with "native" (the default) every matrix runs in a form MatMulNBits takes whole: a Q4_0 GGUF's
  blocks as they are, a Q4_1 GGUF's re-fitted into Q4_ZP (``native_blocks``), any other target
  fitted into Q4_ZP (``fit_zero_point``).
- 4-bit (the default, ``--head-weights Q4_0``) or 8-bit (``Q8_0``), at accuracy level 4 only: the
  LM head (tied to the embedding or not). Q4_0: blocks round-to-nearest from the converted
  weights (a GGUF's head re-rounded), ``MatMulNBits`` bits=4 with the kernel's default zero point,
  as onnxruntime-genai's int4 models store their head (half the bytes a token reads of Q8_0's,
  the head being a fifth of SmolLM2's weights). Q8_0: bits=8 from Q8_0 blocks (fp16 scale d per
  32 weights, w = d * q, q int8): a GGUF's own head blocks when the file stores it as Q8_0
  (SmolLM2's tied token_embd), else round-to-nearest Q8_0 by gguf's quantizer for a target that
  is no GGUF; a GGUF head of another type then stays float.
- int8, in the prefill graphs only (``Int4Plan.prefill`` "int8", the default at accuracy level 4;
  ``export/int8_rows.py``): each target matrix as int8 columns of its dequantized blocks, the prompt's
  rows quantized to int8 one by one, on MLAS's integer GEMM, where MatMulNBits is slow at hundreds of
  rows; the decode and step graphs keep the 4-bit products.
- 8-bit (Q8_0, the default) or 4-bit (Q4_0 or Q4_1), at accuracy level 4 only (``with_draft``,
  ``--draft-weights``; in fp32 engines too, ``draft_only``): the draft's matrices that run as a product of activations and a weight,
  round-to-nearest: every ``nn.Linear`` of its layers and its head's vocabulary-sized output
  projection (``draft_projections``). They sit outside ``/target/``; the head's products are inside
  the ``LowRankRecurrence`` function, which ``quantize_graph`` inlines first (ONNX Runtime inlines it
  anyway), one product per drafted token, all reading the same stored blocks.
- float (the engine's dtype, fp32): the activations between the matmuls, the embedding Gather
  (also where the draft reads the target's embedding), every norm, the projection biases, the
  draft's head's small Gemms (state_proj, state_hidden_mlp), the whole draft with
  ``--draft-weights float`` (the default at level 0), and the LM head at accuracy level 0
  (``MatMulNBits`` bits=8 has no fast fp32 kernel on ONNX Runtime's CPU provider: 364 ms for
  SmolLM2's [1, 576] x [576, 49152] head against 16 ms as a float MatMul and 9.5 ms at level 4).

The accuracy level (``ACCURACY_LEVELS``, a build setting recorded in the manifest) is MatMulNBits'
``accuracy_level`` on every quantized matmul:
  4: the activations are quantized to int8 per block of 32 (symmetric, scale max|x| / 127) and
     multiplied with the weights in int8: what onnxruntime-genai's CPU int4 models run. SmolLM2 on
     2 AVX2 cores: ~0.46x the fp32 decode call with the 8-bit head, ~0.54x with a float head.
     Error per output: at most half an int8 step of each activation block times the block's sum
     |w| (tests/test_int4.py measures ~0.12 of that bound). That rounding also turns fp32-level
     differences between a step call and a decode call into int8-sized ones, so greedy speculative
     output equals target-only greedy only where a verify and a decode call compute every
     position alike: with attention "gqa" (the int4 default, and then this level is), not over "ops";
  0: fp32 compute on the dequantized weights (weight-only): each output as exact as a float
     MatMul of the same weights, other rounding; ~0.85x the fp32 decode call here.

How a Q4_1 matrix runs: ``y = MatMulNBits(x; codes, d) + BlockSum(x) @ Mins``, where
``BlockSum(x)[.., j] = sum of x[.., 32j:32j+32]`` (one float MatMul with a 0/1 matrix, computed once
per input tensor) and ``Mins[j, n]`` the block minima: the same weights d * q + m, other rounding.
Without a zero_points input the 4-bit kernel subtracts 8 from each code (measured ~15% faster than
passing zero points of 0), so a Q4_1 matrix is fed with its minima shifted, m + 8 d, wherever that
sum is exact in fp32 (d * (q - 8) + (m + 8 d) = d * q + m), and with explicit uint8 zero points of
0 and the minima as they are otherwise. (Float zero points are not used: not every MatMulNBits
kernel takes them, onnxruntime#28162.) A Q8_0 head is fed codes q + 128 as uint8 and no
zero_points: the 8-bit kernel's default zero point is 128 (checked against numpy on ONNX Runtime
1.32 by tests/test_int4.py), so it computes d * (q + 128 - 128) = d * q.

The rewrite is a post-export ONNX graph surgery (``quantize_graph``): the model code is not
touched. A matrix is found by its weight, not its name: a MatMul under ``/target/`` whose weight
initializer holds exactly the transposed fp32 matrix (W^T, [K, N], as the TorchScript exporter
folds it; for a tied head that is a copy of the embedding, so the Gathers keep theirs), or a
Transpose of W; a draft matrix the same way outside ``/target/``. Every graph must contain every
quantized target matrix (and every graph that runs the draft every draft matrix), or the build fails. The new
initializers are named after the checkpoint parameter (``model.layers.0.self_attn.q_proj.weight.q4``
/ ``.scales`` / ``.zero_points`` / ``.mins``, ``lm_head.weight.q8`` / ``.scales``) and are bytewise
the same in every graph, so ``engine/weights.py`` stores each once.

Products of one activation in one form (q/k/v of a layer, gate/up) run as one ``MatMulNBits``
over their matrices stacked along N, one product with their stacked minima, and a Split
(``_product_nodes``): each output column is a dot product along K of its own codes, so the stacked
node's columns equal, bitwise, each matrix's own node's (tests/test_int4.py, 1 to 15 rows, both
levels). Their initializers are named after the parameters joined by "+". With the lengths of
GroupQueryAttention computed once (export/cache_attention.py) that takes SmolLM2's decode graph
from 1,936 to 1,465 nodes; docs/engine.md has what it saves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
from onnx import helper, numpy_helper

from dlite_trt.errors import ConfigError, EngineError
from dlite_trt.export.cache_attention import (
    ORT_DOMAIN,
    drop_unused_initializers,
    pack_query_key_value,
)
from dlite_trt.export.int8_rows import Int8Columns, product_nodes, row_quantize_nodes
from dlite_trt.export.nbits_levels import (  # noqa: F401 (re-exported: the build reads them here)
    ACCURACY_LEVELS,
    BLOCK_FORMS,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCKS,
    DEFAULT_HEAD,
    DRAFT_FORMATS,
    FP32_COMPUTE,
    HEAD_Q4,
    HEAD_SCHEME,
    HEAD_WEIGHTS,
    INT8_ACTIVATIONS,
    PREFILL_WEIGHTS,
    ZP_SCHEME,
)

BLOCK = 32  # weights per block along K, every ggml 4-bit type and Q8_0
SCHEMES = ("Q4_1", "Q4_0")  # ggml types kept as they are
Q4_SCHEMES = (*SCHEMES, ZP_SCHEME)
HEAD_NAME = "lm_head.weight"  # the LM head's parameter (tied: the same tensor as model.embed_tokens.weight)
CONTRIB_DOMAIN = ORT_DOMAIN  # ONNX Runtime's contrib ops (MatMulNBits, MatMulIntegerToFloat)
TARGET_SCOPE = "/target/"  # node-name prefix of the target's ops in every engine graph
RTN = "round-to-nearest"
GGUF = "gguf"
DRAFT_PREFIX = "draft."  # the draft's matrices in a plan: its checkpoint parameter names, prefixed


# --------------------------------------------------------------------------------------------- blocks


def _check_blocks(name: str, codes: np.ndarray, dtype: type, scales: np.ndarray) -> tuple[int, int]:
    """codes [N, K] of ``dtype`` with K a multiple of 32 and float32 scales [N, K/32]; returns (N, K/32)."""
    if codes.ndim != 2 or codes.dtype != dtype or codes.shape[1] % BLOCK:
        raise ValueError(f"{name}: codes must be {np.dtype(dtype).name} [N, K] with K a multiple of {BLOCK}, got "
                         f"{codes.dtype} {codes.shape}")
    blocks = (codes.shape[0], codes.shape[1] // BLOCK)
    if scales.shape != blocks or scales.dtype != np.float32:
        raise ValueError(f"{name}: scales must be float32 {blocks}, got {scales.dtype} {scales.shape}")
    return blocks


@dataclass(frozen=True, eq=False)
class Q4Blocks:
    """One [N, K] weight matrix in a ggml 4-bit block layout (32 weights per block along K)."""

    name: str  # checkpoint parameter, e.g. model.layers.0.self_attn.q_proj.weight
    scheme: str  # Q4_1 | Q4_0 | Q4_ZP
    codes: np.ndarray  # [N, K] uint8, 0..15
    scales: np.ndarray  # [N, K/32] float32 (fp16 values but for Q4_ZP)
    mins: np.ndarray | None  # [N, K/32] float32 (fp16 values); Q4_1 only
    zero_points: np.ndarray | None = None  # [N, K/32] uint8, 0..15; Q4_ZP only

    def __post_init__(self) -> None:
        if self.scheme not in Q4_SCHEMES:
            raise ValueError(f"{self.name}: scheme must be one of {Q4_SCHEMES}, got {self.scheme!r}")
        blocks = _check_blocks(self.name, self.codes, np.uint8, self.scales)
        if (self.mins is None) != (self.scheme != "Q4_1") or (
                self.mins is not None and (self.mins.shape != blocks or self.mins.dtype != np.float32)):
            raise ValueError(f"{self.name}: {self.scheme} needs {'float32' if self.scheme == 'Q4_1' else 'no'} "
                             f"minima {blocks}")
        if (self.zero_points is None) != (self.scheme != ZP_SCHEME) or (self.zero_points is not None and (
                self.zero_points.shape != blocks or self.zero_points.dtype != np.uint8 or self.zero_points.max() > 15)):
            kind = "uint8 (0..15)" if self.scheme == ZP_SCHEME else "no"
            raise ValueError(f"{self.name}: {self.scheme} needs {kind} zero points {blocks}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # [N, K]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, computed as gguf.dequantize does (the fp32 engine's weights)."""
        n, k = self.shape
        q = self.codes.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        d = self.scales[:, :, None]
        if self.mins is not None:
            w = d * q + self.mins[:, :, None]
        else:
            zero = np.float32(8) if self.zero_points is None else self.zero_points[:, :, None].astype(np.float32)
            w = d * (q - zero)
        return w.reshape(n, k)

    def permute_rows(self, order: np.ndarray) -> Q4Blocks:
        return Q4Blocks(self.name, self.scheme, self.codes[order], self.scales[order],
                        None if self.mins is None else self.mins[order],
                        None if self.zero_points is None else self.zero_points[order])


def fit_zero_point(name: str, weight: np.ndarray) -> Q4Blocks:
    """[N, K] float weights in MatMulNBits' own asymmetric 4-bit form (Q4_ZP: w ~ s * (q - z), an fp32
    scale and a 4-bit zero point per block of 32): per block, the zero point either side of -min / s
    with s = (max - min) / 15 (min <= 0 <= max), each with its least-squares scale and codes rounded
    to it, whichever is closer to the weights. On a Q4_1 block's own values (which span its codes) that keeps s = d
    and the codes, and moves the block's minimum by at most half a step to the grid point s * -z."""
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise ConfigError(f"--dtype int4 quantizes blocks of {BLOCK} along a matrix's input dim; {name} is "
                          f"{tuple(weight.shape)}. Build this target with --dtype fp32.")
    n, k = weight.shape
    w = weight.astype(np.float64).reshape(n, k // BLOCK, BLOCK)
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)  # the grid holds 0: z in 0..15
    step = np.where(hi > lo, (hi - lo) / 15, 1.0)
    fits = []  # (squared error [N, K/32], codes, scale, zero point) for each zero point tried
    for z in (np.floor(-lo / step), np.ceil(-lo / step)):
        z = np.clip(z, 0, 15)[..., None]
        c = np.clip(np.rint(w / step[..., None] + z), 0, 15) - z
        denom = (c * c).sum(-1, keepdims=True)
        s = (w * c).sum(-1, keepdims=True) / np.maximum(denom, 1)  # least squares for these codes
        s = np.where((denom > 0) & (s > 0), s, step[..., None])
        q = np.clip(np.rint(w / s + z), 0, 15)
        fits.append((((s * (q - z) - w) ** 2).sum(-1), q, s, z))
    second = (fits[1][0] < fits[0][0])[..., None]
    q, s, z = (np.where(second, b, a) for a, b in zip(fits[0][1:], fits[1][1:], strict=True))
    return Q4Blocks(name, ZP_SCHEME, q.astype(np.uint8).reshape(n, k), s[..., 0].astype(np.float32), None,
                    z[..., 0].astype(np.uint8))


def native_blocks(blocks: Q4Blocks) -> Q4Blocks:
    """``blocks`` in a form MatMulNBits runs with no product besides its own: Q4_0 and Q4_ZP as they
    are; Q4_1 (whose float minimum per block it has no input for) re-fitted into Q4_ZP from its own
    weights (``fit_zero_point``): the GGUF's blocks no longer exactly, one float product and sum a
    matrix fewer."""
    return fit_zero_point(blocks.name, blocks.dequantize()) if blocks.scheme == "Q4_1" else blocks


def blocks_from_ggml(name: str, scheme: str, raw: np.ndarray, shape: tuple[int, int]) -> Q4Blocks:
    """Parse ggml blocks: ``raw`` uint8 [N, K/32 * bytes per block] as a GGUF stores them (per block:
    fp16 d, for Q4_1 fp16 m, then 16 bytes whose low nibbles are weights 0..15, high nibbles 16..31)."""
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: {scheme} is not one of {SCHEMES}")
    n, k = shape
    head = 4 if scheme == "Q4_1" else 2
    if raw.dtype != np.uint8 or raw.shape != (n, k // BLOCK * (head + BLOCK // 2)) or k % BLOCK:
        raise ValueError(f"{name}: {scheme} blocks of a [{n}, {k}] matrix must be uint8 "
                         f"[{n}, {k // BLOCK * (head + BLOCK // 2)}], got {raw.dtype} {raw.shape}")
    blocks = raw.reshape(n, k // BLOCK, head + BLOCK // 2)
    scales = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    mins = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if scheme == "Q4_1" else None
    qs = blocks[:, :, head:]  # [N, K/32, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)  # low nibbles first
    return Q4Blocks(name, scheme, np.ascontiguousarray(codes), scales, mins)


def quantize_rtn(name: str, weight: np.ndarray, scheme: str = "Q4_1") -> Q4Blocks:
    """Round-to-nearest Q4_1 (min/max per block of 32) or Q4_0 (symmetric: the signed extreme per
    block at code 0), by gguf's quantizer: llama.cpp's layout."""
    from gguf import GGMLQuantizationType, quants

    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise ConfigError(f"--dtype int4 quantizes blocks of {BLOCK} along a matrix's input dim; {name} is "
                          f"{tuple(weight.shape)}. Build this target with --dtype fp32.")
    raw = quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[scheme])
    return blocks_from_ggml(name, scheme, raw, weight.shape)


@dataclass(frozen=True, eq=False)
class Q8Blocks:
    """One [N, K] weight matrix in ggml's Q8_0 layout: per 32 weights along K an fp16 scale d and
    32 int8 q, w = d * q (the LM head at accuracy level 4)."""

    name: str  # checkpoint parameter: lm_head.weight
    codes: np.ndarray  # [N, K] int8
    scales: np.ndarray  # [N, K/32] float32 (fp16 values)

    scheme = HEAD_SCHEME

    def __post_init__(self) -> None:
        _check_blocks(self.name, self.codes, np.int8, self.scales)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # [N, K]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, computed as gguf.dequantize does."""
        n, k = self.shape
        q = self.codes.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        return (q * self.scales[:, :, None]).reshape(n, k)


def q8_blocks_from_ggml(name: str, raw: np.ndarray, shape: tuple[int, int]) -> Q8Blocks:
    """Parse Q8_0 blocks: ``raw`` uint8 [N, K/32 * 34] as a GGUF stores them (per block: fp16 d, 32 int8)."""
    n, k = shape
    if raw.dtype != np.uint8 or k % BLOCK or raw.shape != (n, k // BLOCK * (2 + BLOCK)):
        raise ValueError(f"{name}: Q8_0 blocks of a [{n}, {k}] matrix must be uint8 [{n}, {k // BLOCK * (2 + BLOCK)}], "
                         f"got {raw.dtype} {raw.shape}")
    blocks = raw.reshape(n, k // BLOCK, 2 + BLOCK)
    scales = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    codes = blocks[:, :, 2:].copy().view(np.int8).reshape(n, k)
    return Q8Blocks(name, codes, scales)


def quantize_q8_rtn(name: str, weight: np.ndarray) -> Q8Blocks:
    """Round-to-nearest Q8_0 (max |w| / 127 per block of 32), by gguf's quantizer: llama.cpp's layout."""
    from gguf import GGMLQuantizationType, quants

    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        raise ConfigError(f"--dtype int4 stores the LM head in blocks of {BLOCK} along its input dim; {name} is "
                          f"{tuple(weight.shape)}. Build with --int4-accuracy-level 0 (float head) or --dtype fp32.")
    raw = quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType.Q8_0)
    return q8_blocks_from_ggml(name, raw, weight.shape)


def quantize_as(name: str, weight: np.ndarray, scheme: str) -> Q4Blocks | Q8Blocks:
    """Round-to-nearest in ``scheme``: Q8_0 (``quantize_q8_rtn``), Q4_0 or Q4_1 (``quantize_rtn``)."""
    return quantize_q8_rtn(name, weight) if scheme == HEAD_SCHEME else quantize_rtn(name, weight, scheme)


# --------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Int4Plan:
    """The target matrices to store int4 (and the LM head 4- or 8-bit), where their blocks came from, and
    the MatMulNBits accuracy level they run at."""

    origin: str  # GGUF: the file's own blocks; RTN: quantized at build
    matrices: dict[str, Q4Blocks]  # parameter name -> blocks
    keys: dict[str, str] = field(default_factory=dict)  # sha256 of the fp32 W^T bytes -> parameter name
    gguf_sha256: str | None = None
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    head: Q8Blocks | Q4Blocks | None = None  # the LM head Q8_0 or Q4_0 (accuracy level 4 only); None: float
    # the draft's matrices (``draft.``-prefixed parameter names; accuracy level 4 only), found in the graphs
    # that run the draft; their sha256 keys are in ``keys`` too
    draft: dict[str, Q4Blocks | Q8Blocks] = field(default_factory=dict)
    # how the prefill graphs multiply by the target's matrices (PREFILL_WEIGHTS): "int8", int8 columns of the
    # dequantized blocks on MLAS's integer GEMM (export/int8_rows.py; level 4 only); "int4", as every other graph
    prefill: str = "int4"

    def __post_init__(self) -> None:
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"the int4 accuracy level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level!r}")
        if self.prefill not in PREFILL_WEIGHTS:
            raise ConfigError(f"the prefill's weights are one of {PREFILL_WEIGHTS}, not {self.prefill!r}")
        if self.prefill == "int8" and self.accuracy_level != INT8_ACTIVATIONS:
            raise ConfigError(f"an int8 prefill runs at accuracy level {INT8_ACTIVATIONS} only (level "
                              f"{self.accuracy_level} is fp32 arithmetic on the 4-bit weights in every graph)")
        if self.head is not None and self.accuracy_level != INT8_ACTIVATIONS:
            raise ConfigError(f"a {self.head.scheme} LM head runs at accuracy level {INT8_ACTIVATIONS} only (at level "
                              f"{self.accuracy_level} MatMulNBits bits=8 is ~20x slower than a float MatMul, and "
                              "more than one row of bits=4 dequantizes the whole matrix first)")
        if self.draft and self.accuracy_level != INT8_ACTIVATIONS:
            raise ConfigError(f"a quantized draft runs at accuracy level {INT8_ACTIVATIONS} only (at level "
                              f"{self.accuracy_level} a MatMulNBits of more than one row dequantizes its whole matrix "
                              "first, and the draft's backbone runs G + K rows)")

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(sorted({b.scheme for b in self.matrices.values()}))

    @property
    def head_format(self) -> str:
        return "float" if self.head is None else self.head.scheme

    @property
    def draft_format(self) -> str:
        return next(iter(self.draft.values())).scheme if self.draft else "float"

    def blocks(self, name: str) -> Q4Blocks | Q8Blocks:
        if self.head is not None and name == self.head.name:
            return self.head
        return self.draft[name] if name.startswith(DRAFT_PREFIX) else self.matrices[name]

    @property
    def names(self) -> set[str]:
        """Every target parameter the rewrite replaces in each graph."""
        return set(self.matrices) | ({self.head.name} if self.head is not None else set())


def _weight_key(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def target_projections(target) -> dict[str, np.ndarray]:
    """Every nn.Linear weight of the target's decoder layers, by parameter name: [N, K] float32.
    ``target``: a TargetAdapter (or a transformers *ForCausalLM: both hold ``.model.layers``)."""
    from torch import nn

    out = {}
    for name, module in target.model.layers.named_modules():
        if isinstance(module, nn.Linear):
            out[f"model.layers.{name}.weight"] = module.weight.detach().float().cpu().numpy()
    if not out:
        raise EngineError("the target has no projection matrices to quantize (no nn.Linear in model.layers)")
    return out


def draft_projections(draft) -> dict[str, np.ndarray]:
    """The draft's matrices that run as a MatMul of activations and a weight, by ``draft.``-prefixed
    parameter name, [N, K] float32: every nn.Linear of its layers and its head's vocabulary-sized
    ``output_proj`` (one product a drafted token). The head's state_proj and state_hidden_mlp (Gemms
    with a bias, 2r x 2r and r x (r + H)) stay float: small next to those."""
    from torch import nn

    out = {f"{DRAFT_PREFIX}layers.{name}.weight": module.weight for name, module in draft.layers.named_modules()
           if isinstance(module, nn.Linear)}
    out[f"{DRAFT_PREFIX}sequential_head.output_proj.weight"] = draft.sequential_head.output_proj.weight
    return {name: w.detach().float().cpu().numpy() for name, w in out.items() if w.shape[1] % BLOCK == 0}


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' LlamaTensorProcessor)."""
    rows = np.arange(n_rows)
    return rows.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)


def _gguf_name_map(spec):
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == spec.architecture)
    return get_tensor_name_map(arch, spec.num_hidden_layers)


def gguf_blocks(path: Path, spec, names: Mapping[str, tuple[int, int]]) -> dict[str, Q4Blocks]:
    """The named target parameters' blocks as ``path`` stores them ([N, K] each, in Hugging Face
    row order). Raises ConfigError for a tensor of a type int4 does not keep as it is."""
    from dlite_trt.gguf_header import read_raw_tensors

    name_map = _gguf_name_map(spec)
    to_gguf = {}
    for hf_name in names:
        g = name_map.get_name(hf_name, try_suffixes=(".weight",))
        if g is None:
            raise EngineError(f"no GGUF tensor name for {hf_name} ({spec.architecture})")
        to_gguf[hf_name] = g
    raw = read_raw_tensors(path, to_gguf.values())
    bad = {g: t.type_name for g, t in raw.items() if t.type_name not in SCHEMES}
    if bad:
        types = ", ".join(sorted(set(bad.values())))
        raise ConfigError(
            f"--dtype int4 keeps a GGUF's own 4-bit blocks ({', '.join(SCHEMES)}) exactly; {path.name} stores "
            f"{len(bad)} of the target's {len(raw)} projection matrices as {types} (e.g. {next(iter(bad))}). "
            "Use a Q4_1 or Q4_0 GGUF, pass a Hugging Face model directory (its weights are then quantized "
            "round-to-nearest into Q4_1), or build with --dtype fp32.")
    out = {}
    for hf_name, g in to_gguf.items():
        t = raw[g]
        if t.shape != tuple(names[hf_name]):
            raise EngineError(f"{path.name}: {g} is {t.shape}, the converted target's {hf_name} is {names[hf_name]}")
        blocks = blocks_from_ggml(hf_name, t.type_name, t.data, t.shape)
        if spec.architecture == "llama" and (".attn_q." in g or ".attn_k." in g):
            heads = spec.num_attention_heads if ".attn_q." in g else spec.num_key_value_heads
            blocks = blocks.permute_rows(_unpermute_rows(t.shape[0], heads))
        out[hf_name] = blocks
    return out


def gguf_head_blocks(path: Path, spec, shape: tuple[int, int]) -> Q8Blocks | None:
    """The LM head's blocks as ``path`` stores them ([V, H]): its ``output`` tensor, or where the file
    has none (a tied head, as llama.cpp reads it) ``token_embd``. None where that tensor is not Q8_0:
    the head then stays float."""
    from dlite_trt.gguf_header import checked_header, read_raw_tensors

    name_map = _gguf_name_map(spec)
    stored = {t.name for t in checked_header(path, path.stat().st_size).tensors}
    g = name_map.get_name(HEAD_NAME, try_suffixes=(".weight",))
    if g not in stored:
        g = name_map.get_name("model.embed_tokens.weight", try_suffixes=(".weight",))
    (t,) = read_raw_tensors(path, [g]).values()
    if t.type_name != HEAD_SCHEME:
        return None
    if t.shape != tuple(shape):
        raise EngineError(f"{path.name}: {g} is {t.shape}, the converted target's {HEAD_NAME} is {tuple(shape)}")
    return q8_blocks_from_ggml(HEAD_NAME, t.data, t.shape)


def plan_int4(target, spec, target_dir: Path | None, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
              blocks: str = DEFAULT_BLOCKS, head_format: str = DEFAULT_HEAD) -> Int4Plan:
    """What ``--dtype int4`` stores for a target: a GGUF conversion's own blocks (checked to
    dequantize bit for bit to the converted fp32 weights), else round-to-nearest Q4_1; with
    ``blocks`` "native" (``BLOCK_FORMS``) in MatMulNBits' own forms instead (``native_blocks``: a
    Q4_1 GGUF's re-fitted, other targets fitted into Q4_ZP from their weights); at accuracy level 4
    also the LM head in ``head_format``: Q8_0 (the GGUF's own where it stores Q8_0, else
    round-to-nearest, and float for a GGUF head of another type) or Q4_0 (round-to-nearest from the
    converted weights, a GGUF's or not)."""
    from dlite_trt.gguf_import import gguf_origin, read_import_record

    if accuracy_level not in ACCURACY_LEVELS:
        raise ConfigError(f"the int4 accuracy level must be one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    if blocks not in BLOCK_FORMS:
        raise ConfigError(f"int4 blocks must be one of {BLOCK_FORMS}, got {blocks!r}")
    if head_format not in HEAD_WEIGHTS:
        raise ConfigError(f"the LM head of an int4 engine is stored as one of {HEAD_WEIGHTS}, not {head_format!r}")
    weights = target_projections(target)
    keys = {_weight_key(w.T): name for name, w in weights.items()}
    head_weight = None  # [V, H]
    if accuracy_level == INT8_ACTIVATIONS:
        head_weight = target.lm_head.weight.detach().float().cpu().numpy()
        keys[_weight_key(head_weight.T)] = HEAD_NAME
    gguf_file = gguf_origin(target_dir) if target_dir is not None else None
    rounded = head_weight is not None and (head_format == HEAD_Q4 or gguf_file is None)
    head = quantize_as(HEAD_NAME, head_weight, head_format) if rounded else None
    if gguf_file is None:
        quantize = fit_zero_point if blocks == "native" else quantize_rtn
        return Int4Plan(RTN, {n: quantize(n, w) for n, w in weights.items()}, keys,
                        accuracy_level=accuracy_level, head=head)
    matrices = gguf_blocks(gguf_file, spec, {n: w.shape for n, w in weights.items()})
    if head_weight is not None and not rounded:
        head = gguf_head_blocks(gguf_file, spec, head_weight.shape)
    converted = dict(weights) | ({HEAD_NAME: head_weight} if head is not None else {})
    kept = [*matrices.items(), *([(HEAD_NAME, head)] if head is not None and not rounded else [])]
    for name, stored in kept:
        if not np.array_equal(stored.dequantize(), converted[name]):
            raise EngineError(f"the {stored.scheme} blocks of {name} in {gguf_file} do not dequantize to the weights "
                              f"converted from it in {target_dir}; delete that directory (the conversion cache) "
                              "and build again.")
    if head is None:
        keys = {k: n for k, n in keys.items() if n != HEAD_NAME}
    if blocks == "native":
        matrices = {n: native_blocks(b) for n, b in matrices.items()}
    return Int4Plan(GGUF, matrices, keys, read_import_record(target_dir)["sha256"], accuracy_level, head)


def draft_only() -> Int4Plan:
    """The plan of an engine whose target stays float: no target matrix, the draft's (``with_draft``)
    at accuracy level 4, its blocks quantized round-to-nearest at build."""
    return Int4Plan(RTN, {}, accuracy_level=INT8_ACTIVATIONS)


def with_draft(plan: Int4Plan, draft, scheme: str) -> Int4Plan:
    """``plan`` plus the draft's matrices (``draft_projections``) round-to-nearest in ``scheme`` (Q8_0,
    Q4_0 or Q4_1); "float": ``plan`` as it is. A matrix whose input dim is no multiple of 32 stays float."""
    if scheme not in DRAFT_FORMATS:
        raise ConfigError(f"the draft of an int4 engine is stored as one of {DRAFT_FORMATS}, not {scheme!r}")
    if scheme == "float":
        return plan
    weights = draft_projections(draft)
    keys: dict[str, str] = {}
    for name, w in weights.items():  # equal matrices (an untrained draft's) are one entry: the graph folds them too
        keys.setdefault(_weight_key(w.T), name)
    keys = {k: n for k, n in keys.items() if k not in plan.keys}
    return replace(plan, draft={name: quantize_as(name, weights[name], scheme) for name in keys.values()},
                   keys=plan.keys | keys)


# --------------------------------------------------------------------------------------------- ONNX inputs


@dataclass(frozen=True)
class NBitsTensors:
    """What one Q4Blocks matrix becomes in a graph (MatMulNBits' own layout)."""

    qweight: np.ndarray  # [N, K/32, 16] uint8: byte j holds codes 2j (low nibble) and 2j+1
    scales: np.ndarray  # [N * K/32] float32
    zero_points: np.ndarray | None  # [N * ceil(K/64)] uint8 zeros; None: the kernel's default 8
    mins: np.ndarray | None  # [K/32, N] float32, added through BlockSum(x) @ mins


def nbits_tensors(blocks: Q4Blocks) -> NBitsTensors:
    n, k = blocks.shape
    kb = k // BLOCK
    pairs = blocks.codes.reshape(n, kb, BLOCK // 2, 2)
    qweight = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    scales = blocks.scales.reshape(-1)
    if blocks.zero_points is not None:  # Q4_ZP: s * (q - z), two zero points a byte (low nibble first) per row
        z = np.zeros((n, -(-kb // 2) * 2), np.uint8)
        z[:, :kb] = blocks.zero_points
        return NBitsTensors(qweight, scales, (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1), None)
    if blocks.mins is None:  # Q4_0: d * (q - 8), the kernel's default zero point
        return NBitsTensors(qweight, scales, None, None)
    shifted = blocks.mins + np.float32(8) * blocks.scales
    exact = np.array_equal(shifted.astype(np.float64),
                           blocks.mins.astype(np.float64) + 8.0 * blocks.scales.astype(np.float64))
    if exact:
        return NBitsTensors(qweight, scales, None, np.ascontiguousarray(shifted.T))
    zero_points = np.zeros(n * -(-kb // 2), np.uint8)
    return NBitsTensors(qweight, scales, zero_points, np.ascontiguousarray(blocks.mins.T))


def q8_nbits_tensors(blocks: Q8Blocks) -> NBitsTensors:
    """A Q8_0 matrix for MatMulNBits bits=8: codes q + 128 as uint8 [N, K/32, 32], the kernel's
    default zero point 128 (no zero_points input), no minima."""
    n, k = blocks.shape
    codes = (blocks.codes.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
    return NBitsTensors(codes, blocks.scales.reshape(-1), None, None)


def reference_matmul(x: np.ndarray, blocks: Q4Blocks | Q8Blocks) -> np.ndarray:
    """x [.., K] @ W^T with W = the blocks' weights, in float64: the truth the graphs are checked against."""
    return x.astype(np.float64) @ blocks.dequantize().astype(np.float64).T


def block_sum_matrix(k: int) -> np.ndarray:
    """[K, K/32] float32: x @ E sums each block of 32 of x."""
    e = np.zeros((k, k // BLOCK), np.float32)
    e[np.arange(k), np.arange(k) // BLOCK] = 1.0
    return e


# --------------------------------------------------------------------------------------------- the rewrite


def _matched_weight(node: onnx.NodeProto, inits: dict, producers: dict, plan: Int4Plan,
                    shapes: set[tuple[int, int]]) -> str | None:
    """The plan's parameter whose W^T is ``node``'s second input, or None."""
    w = node.input[1]
    if w in inits:
        t = inits[w]
        if tuple(t.dims) in {(k, n) for n, k in shapes}:
            return plan.keys.get(_weight_key(numpy_helper.to_array(t)))
        return None
    src = producers.get(w)
    if src is not None and src.op_type == "Transpose" and src.input[0] in inits:
        perm = next((list(a.ints) for a in src.attribute if a.name == "perm"), [1, 0])
        t = inits[src.input[0]]
        if perm == [1, 0] and tuple(t.dims) in shapes:
            return plan.keys.get(_weight_key(numpy_helper.to_array(t).T))
    return None


def _nbits_tensors(blocks: Q4Blocks | Q8Blocks) -> NBitsTensors:
    return q8_nbits_tensors(blocks) if isinstance(blocks, Q8Blocks) else nbits_tensors(blocks)


def _concatenated(names: list[str], tensors: dict[str, NBitsTensors]) -> NBitsTensors:
    """Matrices of one K and one form stacked along N: each output column is computed alone (a
    dot product along K of its own codes), so the stacked product's columns are those of each."""
    parts = [tensors[n] for n in names]
    zero_points = None if parts[0].zero_points is None else np.concatenate([t.zero_points for t in parts])
    mins = None if parts[0].mins is None else np.concatenate([t.mins for t in parts], axis=1)
    return NBitsTensors(np.concatenate([t.qweight for t in parts]), np.concatenate([t.scales for t in parts]),
                        zero_points, mins)


def _product_nodes(x: str, products: list[tuple[str, str, str]], tensors: dict[str, NBitsTensors], level: int,
                   added: dict[str, onnx.TensorProto], block_sums: dict[str, str]) -> list[onnx.NodeProto]:
    """The nodes computing ``products`` (parameter name, scope, output), all of activation ``x``: one
    MatMulNBits (with its minima's product and sum for Q4_1) over their matrices stacked along N,
    split into each product's output. Fused initializers are named after their parameters joined by
    "+" (the same bytes in every graph that has the group, so stored once)."""
    names, scope, y, outputs = _group(products)
    name = "+".join(names)
    t = tensors[names[0]] if len(names) == 1 else _concatenated(names, tensors)
    n, kb = t.qweight.shape[:2]
    eight = t.qweight.shape[-1] == BLOCK
    inputs = [x, f"{name}.{'q8' if eight else 'q4'}", f"{name}.scales"]
    added[inputs[1]] = numpy_helper.from_array(t.qweight, inputs[1])
    added[inputs[2]] = numpy_helper.from_array(t.scales, inputs[2])
    if t.zero_points is not None:
        inputs.append(f"{name}.zero_points")
        added[inputs[3]] = numpy_helper.from_array(t.zero_points, inputs[3])
    out = y if t.mins is None else f"{scope}/MatMulNBits_output_0"
    nodes = [helper.make_node("MatMulNBits", inputs, [out], name=f"{scope}/MatMulNBits", domain=CONTRIB_DOMAIN,
                              K=kb * BLOCK, N=n, bits=8 if eight else 4, block_size=BLOCK, accuracy_level=level)]
    if t.mins is not None:
        if x not in block_sums:
            e = f"int4.block_sum.{kb * BLOCK}"
            added.setdefault(e, numpy_helper.from_array(block_sum_matrix(kb * BLOCK), e))
            block_sums[x] = f"{scope}/block_sum_output_0"
            nodes.append(helper.make_node("MatMul", [x, e], [block_sums[x]], name=f"{scope}/block_sum"))
        added[f"{name}.mins"] = numpy_helper.from_array(t.mins, f"{name}.mins")
        nodes.append(helper.make_node("MatMul", [block_sums[x], f"{name}.mins"], [f"{scope}/mins_output_0"],
                                      name=f"{scope}/mins"))
        nodes.append(helper.make_node("Add", [out, f"{scope}/mins_output_0"], [y], name=f"{scope}/add_mins"))
    return nodes + _split(y, outputs, [tensors[n].qweight.shape[0] for n in names], scope, added)


def _group(products: list[tuple[str, str, str]]) -> tuple[list[str], str, str, list[str]]:
    """A group of products (parameter name, scope, output) of one activation: their names, the scope of their
    stacked product, its output (the one product's own when alone) and the products' outputs."""
    names, outputs = [name for name, _, _ in products], [y for _, _, y in products]
    scope = products[0][1] + ("/fused" if len(products) > 1 else "")
    return names, scope, (outputs[0] if len(outputs) == 1 else f"{scope}/output_0"), outputs


def _split(y: str, outputs: list[str], sizes: list[int], scope: str,
           added: dict[str, onnx.TensorProto]) -> list[onnx.NodeProto]:
    """A stacked product's columns back into each product's output (nothing for a product alone)."""
    if len(outputs) == 1:
        return []
    name = f"{scope}/split_sizes"
    added[name] = numpy_helper.from_array(np.array(sizes, np.int64), name)
    return [helper.make_node("Split", [y, name], outputs, name=f"{scope}/split", axis=-1)]


def _int8_product_nodes(x: str, products: list[tuple[str, str, str]], plan: Int4Plan, added: dict[str, onnx.TensorProto],
                        rows: dict[str, tuple[str, str]], opset: int) -> list[onnx.NodeProto]:
    """``products`` of activation ``x`` as int8 rows times int8 columns of their dequantized blocks, stacked
    along N as ``_product_nodes`` stacks them; ``x`` is quantized once (``rows``: activation -> its codes and
    row scales) in nodes of the model's standard-op ``opset``."""
    names, scope, y, outputs = _group(products)
    nodes = []
    if x not in rows:
        quantize, codes, scales = row_quantize_nodes(x, scope, added, opset)
        nodes += quantize
        rows[x] = (codes, scales)
    columns = Int8Columns.stacked([Int8Columns.of(plan.blocks(n).dequantize()) for n in names])
    nodes += product_nodes(*rows[x], "+".join(names), scope, columns, y, added)
    return nodes + _split(y, outputs, [plan.blocks(n).shape[0] for n in names], scope, added)


def quantize_model(model: onnx.ModelProto, plan: Int4Plan, where: str, runs_draft: bool = False,
                   prefill: bool = False) -> int:
    """Replace every target projection MatMul of ``model`` (weights loaded) by its int4 form, the LM
    head's by its 8-bit form where the plan has one, and with ``runs_draft`` the draft's by the plan's
    draft blocks, in place; returns how many MatMuls. ``prefill``: the model is a prefill graph, whose
    target projections run in int8 where the plan says so (``Int4Plan.prefill``). Raises EngineError unless
    every matrix wanted was found. The draft's head is inside the recurrence's function: ``quantize_graph``
    inlines it first."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    wanted = plan.names | (set(plan.draft) if runs_draft else set())
    shapes = {plan.blocks(name).shape for name in wanted}
    added: dict[str, onnx.TensorProto] = {}
    block_sums: dict[str, str] = {}  # activation -> its BlockSum output
    rows: dict[str, tuple[str, str]] = {}  # activation -> its int8 rows (codes, scales)
    int8 = set(plan.matrices) if prefill and plan.prefill == "int8" else set()
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    found: dict[str, int] = {}
    scopes: set[str] = set()
    matches: dict[int, tuple[str, str]] = {}  # node index -> (parameter name, scope)
    for i, node in enumerate(graph.node):
        name = _matched_weight(node, inits, producers, plan, shapes) if node.op_type == "MatMul" else None
        if name is not None and name.startswith(DRAFT_PREFIX) == node.name.startswith(TARGET_SCOPE):
            name = None  # a target matrix only under the target's scope, a draft's only outside it
        if name is None:
            continue
        found[name] = found.get(name, 0) + 1
        scope = node.name.rsplit("/", 1)[0]  # /target/q_proj_1
        if scope in scopes:  # two products in one scope (the inlined recurrence's steps): the node's own name
            scope = node.name
        scopes.add(scope)
        matches[i] = (name, scope)
    tensors = {name: _nbits_tensors(plan.blocks(name)) for name, _ in matches.values()}
    groups: dict[tuple, list[int]] = {}  # the products of one activation in one form run as one node
    for i, (name, _) in matches.items():
        t = tensors[name]
        form = (graph.node[i].input[0], t.qweight.shape[1:], t.zero_points is None, t.mins is None, name in int8)
        groups.setdefault(form, []).append(i)
    group_of = {i: members for members in groups.values() for i in members}
    nodes = []
    for i, node in enumerate(graph.node):
        if i not in matches:
            nodes.append(node)
        elif group_of[i][0] == i:  # the group's products at its first member's place (their input exists there)
            products = [(matches[j][0], matches[j][1], graph.node[j].output[0]) for j in group_of[i]]
            if matches[i][0] in int8:
                nodes.extend(_int8_product_nodes(node.input[0], products, plan, added, rows, opset))
            else:
                nodes.extend(_product_nodes(node.input[0], products, tensors, plan.accuracy_level, added, block_sums))
    missing = sorted(wanted - set(found))
    if missing:
        raise EngineError(f"{where}: {len(missing)} of the {len(wanted)} quantized matrices were not found as a "
                          f"MatMul weight (the target's under {TARGET_SCOPE}, the draft's outside it; e.g. "
                          f"{missing[0]}); the exported graph has a form the int4 rewrite does not know.")
    consumed = {i for node in nodes for i in node.input} | {o.name for o in graph.output}
    # a Transpose of W that only fed a replaced MatMul (the Transpose form of _matched_weight) goes too
    nodes = [n for n in nodes if n.op_type != "Transpose" or any(o in consumed for o in n.output)
             or not all(i in inits for i in n.input)]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added.values())
    pack_query_key_value(model)  # attention "gqa": a layer's stacked q/k/v product read whole, not split
    drop_unused_initializers(model)  # the replaced weights, the packed Splits' sizes
    if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return sum(found.values())


def quantize_graph(path: Path, plan: Int4Plan, prefill: bool = False) -> int:
    """Rewrite an exported graph file (``path`` + its external ``path.data``) in place (``prefill``: it is a
    prefill graph, ``quantize_model``)."""
    from dlite_trt.export.recurrence import recurrence_nodes

    path = Path(path)
    model = onnx.load(str(path))  # with its external data
    runs_draft = bool(plan.draft) and bool(recurrence_nodes(model))
    if not plan.names and not runs_draft:  # a draft-only plan and a graph without the draft: as it is
        return 0
    if runs_draft:  # the head's products are in the recurrence's body: inline it (ONNX Runtime would anyway)
        model = onnx.inliner.inline_local_functions(model)
    count = quantize_model(model, plan, str(path), runs_draft, prefill)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return count
