"""The target architectures dlite-trt compiles, and what differs between them: declared here once.

Every supported target is a decoder-only transformer with RMSNorm, grouped-query attention,
RoPE and a SwiGLU MLP, and the target adapter (model/target.py) reuses the transformers
modules of the model, so projection biases come with the weights. What the adapter, the
config reader and the loader still need to know per architecture is in ``Architecture``:
nothing else branches on the architecture.

The DLite draft is the same whatever the target's architecture: it reads the target's hidden
states at fixed layers, its token embeddings, and nothing of its attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# RoPE types whose inverse frequencies are fixed (they do not change with the sequence length),
# with the rope_parameters keys each needs beyond rope_theta. Dynamic NTK, YaRN and LongRoPE
# change the rotation with the length or scale cos/sin: not supported.
ROPE_TYPES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType({
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
})


@dataclass(frozen=True)
class Architecture:
    """One target architecture: a transformers ``*ForCausalLM`` class and its quirks."""

    model_type: str  # config.json "model_type"
    hf_class: str  # the transformers model class (config.json "architectures")
    config_class: str  # its transformers config class
    qk_norm: bool  # per-head RMSNorm on queries and keys before RoPE (attn.q_norm / attn.k_norm)
    # head_dim when config.json has no "head_dim" key (None: hidden_size // num_attention_heads)
    head_dim_if_absent: int | None
    # config.json keys with their defaults (as the transformers config class has them) that
    # only change the weights' layout, passed through to random-weight construction
    layout_keys: MappingProxyType[str, Any]
    rope_types: tuple[str, ...]
    default_max_positions: int  # max_position_embeddings when config.json omits it
    sliding_window_key: str | None  # a config.json flag that turns on sliding-window attention


def _arch(model_type: str, name: str, *, qk_norm: bool, head_dim_if_absent: int | None, layout: dict[str, Any],
          rope_types: tuple[str, ...], max_positions: int, sliding_window_key: str | None) -> Architecture:
    return Architecture(model_type, f"{name}ForCausalLM", f"{name}Config", qk_norm, head_dim_if_absent,
                        MappingProxyType(layout), rope_types, max_positions, sliding_window_key)


ARCHITECTURES: MappingProxyType[str, Architecture] = MappingProxyType({a.model_type: a for a in (
    # Qwen3: q/k norm; head_dim 128 unless given (transformers' Qwen3Config)
    _arch("qwen3", "Qwen3", qk_norm=True, head_dim_if_absent=128, layout={"attention_bias": False},
          rope_types=("default",), max_positions=40960, sliding_window_key="use_sliding_window"),
    # Llama 2/3 (incl. Llama 3.x's "llama3" RoPE scaling), SmolLM2, TinyLlama: no q/k norm;
    # attention_bias puts biases on q/k/v/o, mlp_bias on the MLP
    _arch("llama", "Llama", qk_norm=False, head_dim_if_absent=None,
          layout={"attention_bias": False, "mlp_bias": False},
          rope_types=("default", "linear", "llama3"), max_positions=2048, sliding_window_key=None),
    # Qwen2 / Qwen2.5: q/k/v projections always have biases (built into the transformers module)
    _arch("qwen2", "Qwen2", qk_norm=False, head_dim_if_absent=None, layout={},
          rope_types=("default",), max_positions=32768, sliding_window_key="use_sliding_window"),
)})


def supported() -> str:
    """The supported architectures, for error messages."""
    return ", ".join(f"{a.hf_class} (model_type {a.model_type!r})" for a in ARCHITECTURES.values())
