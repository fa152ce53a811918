"""Named Qwen3 targets with their published shapes (Hugging Face Qwen/Qwen3-* config.json)."""

from __future__ import annotations

from dataclasses import dataclass

from dlite_trt.config import TargetSpec

_QWEN3_COMMON = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    max_position_embeddings=40960, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)


@dataclass(frozen=True)
class Preset:
    name: str
    hf_repo: str  # where the weights live on the Hugging Face Hub (never fetched by dlite-trt)
    spec: TargetSpec


def _preset(name: str, repo: str, hidden: int, layers: int, heads: int, ffn: int, tie: bool) -> Preset:
    spec = TargetSpec(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=ffn, tie_word_embeddings=tie, **_QWEN3_COMMON)
    return Preset(name, repo, spec)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", 1024, 28, 16, 3072, True),
    _preset("qwen3-1.7b", "Qwen/Qwen3-1.7B", 2048, 28, 16, 6144, True),
    _preset("qwen3-4b", "Qwen/Qwen3-4B", 2560, 36, 32, 9728, True),
    _preset("qwen3-8b", "Qwen/Qwen3-8B", 4096, 36, 32, 12288, False),
    _preset("qwen3-14b", "Qwen/Qwen3-14B", 5120, 40, 40, 17408, False),
    _preset("qwen3-32b", "Qwen/Qwen3-32B", 5120, 64, 64, 25600, False),
)}
