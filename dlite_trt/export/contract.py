"""The engine I/O contract: every input and output of every engine graph, declared once.

Export (input/output names, dynamic axes), the runtimes (binding, dummy inputs), the
TensorRT optimization profiles (min/opt/max) and Triton's config.pbtxt are all derived from
``engine_contract``; nothing else spells a tensor name, dtype or shape.

Graphs (DESIGN 2):
- ``prefill``: a chunk of prompt tokens on top of the KV cache -> first anchor, pivot hidden
  states, first draft block; chunked prefill and multi-turn extend are the same graph.
- ``step``: verify [anchor, d_1..d_k] on top of the cache, accept per sequence, draft the next
  block from the pivot at the last accepted position. One call = one speculative step. The
  greedy step's width k + 1 is dynamic (``verify``, 2..K+1): the host verifies the first k of
  the K drafts where that pays more tokens per second (runtime/verify_width.py); and so is the
  next block's (``next``, 2..K+1, the width of its ``next_width`` input): the draft's head makes
  only the drafts the next step will verify (its first D of K; each costs a sequential step).
- ``decode``: the target alone over a chunk (target-only decoding, the baseline).

``prefill`` and ``step`` are greedy: argmax everywhere, no draft logits leave the graph.
``prefill_sampling`` and ``step_sampling`` take a temperature per sequence (rows at or below
1e-5 stay greedy) and uniform random numbers, and pass the draft's logits from one call to the
next for rejection sampling. A greedy batch never pays for the sampling machinery (at Qwen3's
V = 151,936, softmaxes and a [B, K, V] logits tensor per step).

Dims: ``batch`` B, ``chunk`` T (tokens per prefill/decode call), ``cache`` P (KV slots
bound per call, the session's capacity) and the greedy step's ``verify`` (k + 1) are dynamic;
the rest are fixed by the models.
KV inputs are per layer (``past_key.{i}``, [B, kvH, P, D]) so that a runtime binds slices of
one preallocated buffer without copying; new entries come back stacked ([L, B, kvH, T, D])
and the runtime writes only the accepted ones (O(block) per step), or (attention "gqa") the
graph writes them into the buffer itself and returns none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dlite_trt.config import DraftConfig, TargetSpec
from dlite_trt.dtypes import NUMPY_NAMES
from dlite_trt.errors import ConfigError

GRAPH_NAMES = ("prefill", "step", "prefill_sampling", "step_sampling", "decode", "decode_sampling")
SAMPLING_SUFFIX = "_sampling"  # the variant of a graph that samples (temperature > 0); without it: greedy
PAD_TOKEN = -1  # fills the unused tail of ``emitted``
# How a graph attends over the KV cache: "ops", standard ops over [the cache's slots, masked past each
# row's length; the call's new keys]; "gqa" (ONNX Runtime), one GroupQueryAttention per layer that
# writes the call's entries into the cache buffer in place (outputs ``present_key.{i}`` /
# ``present_value.{i}``, bound to the same memory as ``past_key.{i}`` / ``past_value.{i}``; no
# new_key / new_value), reads every key from its own slot and applies RoPE itself
# (export/cache_attention.py)
ATTENTIONS = ("ops", "gqa")


@dataclass(frozen=True)
class Dim:
    """A dynamic dimension and its optimization range (TensorRT profile min/opt/max)."""

    name: str
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ConfigError(f"dim {self.name}: need 1 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: int64, float32, float16, bfloat16
    dims: tuple[str | int, ...]  # a str names a dynamic Dim of the graph, an int is static
    doc: str = ""

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: tuple[Dim, ...]

    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(f"graph {self.name} has no dim {name!r}")

    def tensor(self, name: str) -> TensorSpec:
        for t in (*self.inputs, *self.outputs):
            if t.name == name:
                return t
        raise KeyError(f"graph {self.name} has no tensor {name!r}")

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """For torch.onnx.export: {tensor: {axis: dim name}}."""
        return {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
                for t in (*self.inputs, *self.outputs) if any(isinstance(d, str) for d in t.dims)}

    def profile(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of an input, for a TensorRT optimization profile."""
        t = self.tensor(name)
        return tuple(t.shape({d.name: getattr(d, which) for d in self.dims})  # type: ignore[return-value]
                     for which in ("min", "opt", "max"))

    def check_sizes(self, sizes: Mapping[str, int]) -> None:
        for d in self.dims:
            if not d.min <= sizes[d.name] <= d.max:
                raise ConfigError(f"graph {self.name}: {d.name}={sizes[d.name]} is outside [{d.min}, {d.max}]")

    def to_dict(self) -> dict:
        return {
            "dims": {d.name: {"min": d.min, "opt": d.opt, "max": d.max} for d in self.dims},
            "inputs": [_tensor_dict(t) for t in self.inputs],
            "outputs": [_tensor_dict(t) for t in self.outputs],
        }

    @classmethod
    def from_dict(cls, name: str, data: Mapping) -> GraphSpec:
        dims = tuple(Dim(n, int(r["min"]), int(r["opt"]), int(r["max"])) for n, r in data["dims"].items())

        def tensors(key: str) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t["name"], t["dtype"], tuple(t["dims"]), t.get("doc", "")) for t in data[key])

        return cls(name, tensors("inputs"), tensors("outputs"), dims)


def _tensor_dict(t: TensorSpec) -> dict:
    return {"name": t.name, "dtype": t.dtype, "dims": list(t.dims), "doc": t.doc}


@dataclass(frozen=True)
class EngineLimits:
    """Build-time limits of an engine: what the runtime accepts and the profiles cover."""

    max_batch: int = 8
    max_seq_len: int = 4096  # prompt + generated tokens per sequence
    max_chunk: int = 512  # prompt tokens per prefill call (longer prompts are chunked)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_seq_len", "max_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")

    def to_dict(self) -> dict:
        return {"max_batch": self.max_batch, "max_seq_len": self.max_seq_len, "max_chunk": self.max_chunk}


def kv_input(name: str) -> tuple[str, int] | None:
    """("key" | "value", layer) for a KV cache input name (``past_key.3``), else None."""
    for kind in ("key", "value"):
        if name.startswith(f"past_{kind}."):
            return kind, int(name.rsplit(".", 1)[1])
    return None


def present_output(name: str) -> tuple[str, int] | None:
    """("key" | "value", layer) for an in-place cache output name (``present_key.3``), else None."""
    for kind in ("key", "value"):
        if name.startswith(f"present_{kind}."):
            return kind, int(name.rsplit(".", 1)[1])
    return None


def cache_capacity_max(limits: EngineLimits, block_size: int) -> int:
    """KV slots a sequence can need: every token plus the block verified past the last one."""
    return limits.max_seq_len + block_size


def engine_contract(spec: TargetSpec, cfg: DraftConfig, limits: EngineLimits,
                    dtype: str = "fp32", attention: str = "ops") -> dict[str, GraphSpec]:
    """The I/O of every graph of an engine for this target, draft, limits, dtype and attention."""
    if dtype not in NUMPY_NAMES:
        raise ConfigError(f"dtype must be one of {sorted(NUMPY_NAMES)}, got {dtype!r}")
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    fdt = NUMPY_NAMES[dtype]
    k, g = cfg.num_proposals, cfg.anchor_group_size
    n_layers, kv_heads, head_dim = spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim
    v, s, h = spec.vocab_size, cfg.chs_num_layers, spec.hidden_size
    chunk_max = min(limits.max_chunk, limits.max_seq_len)
    batch = Dim("batch", 1, min(limits.max_batch, 4), limits.max_batch)
    chunk = Dim("chunk", 1, min(chunk_max, 128), chunk_max)
    p_max = cache_capacity_max(limits, cfg.block_size)
    cache = Dim("cache", 1, min(p_max, 2048), p_max)

    def kv_inputs() -> list[TensorSpec]:
        return [TensorSpec(f"past_{kind}.{i}", fdt, ("batch", kv_heads, "cache", head_dim),
                           f"layer {i} {kind}s; slots >= past_len are ignored")
                for i in range(n_layers) for kind in ("key", "value")]

    def kv_outputs(width: str | int) -> list[TensorSpec]:
        if attention == "gqa":  # the graph writes the cache itself
            return [TensorSpec(f"present_{kind}.{i}", fdt, ("batch", kv_heads, "cache", head_dim),
                               f"past_{kind}.{i}'s buffer (bound to the same memory), this call's entries written "
                               "(unbound, ONNX Runtime returns a new buffer of another length)")
                    for i in range(n_layers) for kind in ("key", "value")]
        return [TensorSpec(f"new_{kind}", fdt, (n_layers, "batch", kv_heads, width, head_dim),
                           f"{kind}s of this call's tokens (RoPE applied); the runtime stores the kept ones")
                for kind in ("key", "value")]

    prefix = [TensorSpec("group_prefix", "int64", ("batch", g - 1),
                         "the G-1 tokens before the anchor, left-padded (any value where absent)")] if g > 1 else []
    temperature = TensorSpec("temperature", "float32", ("batch",), "per sequence; <= 1e-5 is greedy")
    next_logits = TensorSpec("next_draft_logits", "float32", ("batch", k, v), "logits next_block's drafts came from")
    next_block = TensorSpec("next_block", "int64", ("batch", k + 1), "[anchor, d_1..d_K] for the next step")
    next_drafted = TensorSpec("next_block", "int64", ("batch", "next"), "[anchor, d_1..d_D] for the next step")

    def prefill(sampling: bool) -> GraphSpec:
        return GraphSpec("prefill" + SAMPLING_SUFFIX * sampling, inputs=(
            TensorSpec("input_ids", "int64", ("batch", "chunk"), "prompt tokens, right-padded"),
            TensorSpec("chunk_len", "int64", ("batch",), "valid tokens in input_ids per sequence (>= 1)"),
            TensorSpec("past_len", "int64", ("batch",), "cached tokens per sequence = position of input_ids[:, 0]"),
            *prefix,
            *([temperature,
               TensorSpec("u_anchor", "float32", ("batch",), "uniform in [0, 1) to sample the anchor"),
               TensorSpec("u_draft", "float32", ("batch", k), "uniforms in [0, 1) to sample the draft")]
              if sampling else []),
            *kv_inputs(),
        ), outputs=(
            next_block,
            *([next_logits] if sampling else []),
            TensorSpec("pivot_hidden", fdt, ("batch", s, h), "target layers target_layer_ids at the last prompt token"),
            *kv_outputs("chunk"),
        ), dims=(batch, chunk, cache))

    def step(sampling: bool) -> GraphSpec:
        # greedy steps verify the first k <= K drafts (the block's width is k + 1; the host picks k,
        # runtime/verify_width.py); sampling steps verify all K (their draft logits are [B, K, V])
        # and draft the next step's D <= K (next_block [B, D + 1])
        width: str | int = k + 1 if sampling else "verify"
        greedy_dims = (Dim("verify", 2, k + 1, k + 1), Dim("next", 2, k + 1, k + 1))
        dims = (batch, cache) if sampling else (batch, cache, *greedy_dims)
        return GraphSpec("step" + SAMPLING_SUFFIX * sampling, inputs=(
            TensorSpec("block", "int64", ("batch", width), "[anchor, d_1..d_k] (k <= K) from the previous call"),
            TensorSpec("past_len", "int64", ("batch",), "cached tokens = position of the anchor"),
            *([] if sampling else [TensorSpec("next_width", "int64", ("batch", "next"),
                                              "any values: its width D + 1 is next_block's (the step drafts D)")]),
            *prefix,
            *([TensorSpec("draft_logits", "float32", ("batch", k, v), "next_draft_logits of the previous call"),
               temperature,
               TensorSpec("u_accept", "float32", ("batch", k), "uniforms for the accept tests"),
               TensorSpec("u_resample", "float32", ("batch",), "uniform for the correction / bonus sample"),
               TensorSpec("u_draft", "float32", ("batch", k), "uniforms to sample the next draft")]
              if sampling else []),
            *kv_inputs(),
        ), outputs=(
            TensorSpec("accepted", "int64", ("batch",), "n: drafts accepted; the step emits n + 1 tokens"),
            TensorSpec("emitted", "int64", ("batch", width), f"d_1..d_n, the new anchor, then {PAD_TOKEN}"),
            next_block if sampling else next_drafted,
            *([TensorSpec("next_group_prefix", "int64", ("batch", g - 1), "group_prefix for the next step")]
              if g > 1 else []),
            *([next_logits] if sampling else []),
            *kv_outputs(width),
        ), dims=dims)

    def decode(sampling: bool) -> GraphSpec:
        # the greedy graph takes its argmax only: the sampler (a softmax over the vocabulary and the
        # inverse CDF per row) cost 4-5% of an int4 decode call that never used it
        return GraphSpec("decode" + SAMPLING_SUFFIX * sampling, inputs=(
            TensorSpec("input_ids", "int64", ("batch", "chunk"), "tokens, right-padded"),
            TensorSpec("past_len", "int64", ("batch",), "cached tokens per sequence = position of input_ids[:, 0]"),
            TensorSpec("output_index", "int64", ("batch", "outputs"), "chunk positions whose next token is wanted"),
            *([temperature, TensorSpec("uniforms", "float32", ("batch", "outputs"), "uniforms in [0, 1) for sampling")]
              if sampling else []),
            *kv_inputs(),
        ), outputs=(
            TensorSpec("next_tokens", "int64", ("batch", "outputs"), "the target's token after each indexed position"),
            *kv_outputs("chunk"),
        ), dims=(batch, chunk, Dim("outputs", 1, 1, chunk_max), cache))

    graphs = (prefill(False), step(False), prefill(True), step(True), decode(False), decode(True))
    return {gs.name: gs for gs in graphs}


def steady_step(drafts: int) -> dict[str, int]:
    """The dim sizes of a greedy step that verifies ``drafts`` drafts and drafts as many for the next
    step: what decoding at that verify width runs, step after step."""
    return {"verify": drafts + 1, "next": drafts + 1}


def dummy_inputs(graph: GraphSpec, sizes: Mapping[str, int], *, vocab_size: int,
                 rng: np.random.Generator, check: bool = True) -> dict[str, np.ndarray]:
    """Valid random inputs for a graph at the given dim sizes (tests, tracing, TensorRT checks).

    A dim not in ``sizes`` takes its largest size (the greedy step's ``verify``: all K drafts).
    ``check=False`` allows sizes outside the engine's ranges (tracing uses fixed odd sizes;
    the traced dims are dynamic, so they need not lie within the limits).
    """
    sizes = {d.name: d.max for d in graph.dims} | dict(sizes)
    if check:
        graph.check_sizes(sizes)
    feeds: dict[str, np.ndarray] = {}
    b = sizes["batch"]
    has_chunk = any(d.name == "chunk" for d in graph.dims)
    chunk = sizes["chunk"] if has_chunk else 1
    block_width = None if has_chunk else graph.tensor("block").dims[1]
    width = chunk if has_chunk else sizes[block_width] if isinstance(block_width, str) else block_width  # tokens this call adds
    for t in graph.inputs:
        shape = t.shape(sizes)
        if t.name in ("input_ids", "block", "group_prefix"):
            value = rng.integers(0, vocab_size, shape)
        elif t.name == "next_width":  # only its shape counts
            value = np.zeros(shape)
        elif t.name == "chunk_len":
            value = rng.integers(1, chunk + 1, shape)
        elif t.name == "output_index":
            value = rng.integers(0, chunk, shape)
        elif t.name == "past_len":  # leave room for this call's tokens in a cache of this size
            value = rng.integers(0, max(sizes["cache"] - width, 0) + 1, (b,))
        elif t.name == "temperature":
            value = rng.choice(np.array([0.0, 0.7, 1.3]), shape)
        elif t.name.startswith("u_") or t.name == "uniforms":
            value = rng.random(shape)
        else:
            value = rng.standard_normal(shape)
        feeds[t.name] = value.astype(np.float32 if t.dtype == "bfloat16" else t.dtype)
    return feeds
