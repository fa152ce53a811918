"""Small Qwen3 targets and DLite drafts built from configs, for tests and first runs.

The tokenizer is a byte-level BPE trained with `tokenizers` on real text that ships on every
machine with Python: the standard library's own sources. A fixed, seeded split keeps a
held-out set of files out of training (see ``stdlib_files``).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import torch

from dlite_trt.checkpoint import save_draft
from dlite_trt.config import DraftConfig, TargetSpec
from dlite_trt.model.draft import DLiteDraft

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stdlib_files(split: str = "train", held_out_percent: int = 10) -> list[Path]:
    """The standard library's top-level .py files, split by a hash of the file name.

    The split depends only on names, so it is the same on every machine and Python patch
    release; ``split`` is "train" or "held_out".
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}; the standard library is not installed as .py files")

    def held_out(p: Path) -> bool:
        return int(hashlib.sha256(p.name.encode()).hexdigest(), 16) % 100 < held_out_percent

    return [p for p in files if held_out(p) == (split == "held_out")]


def train_tokenizer(files: list[Path], vocab_size: int, out: Path | None = None):
    """A byte-level BPE (Qwen-style special tokens, a ChatML template) as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|mask|>"])
    fast.chat_template = CHAT_TEMPLATE
    if out is not None:
        fast.save_pretrained(out)
    return fast


def tiny_target_spec(vocab_size: int, *, hidden_size: int = 128, num_hidden_layers: int = 4,
                     num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 32,
                     intermediate_size: int = 384, eos_token_id: int | tuple[int, ...] | None = None,
                     max_position_embeddings: int = 32768, **spec: Any) -> TargetSpec:
    """A small target's shape (Qwen3 unless ``spec`` sets architecture, rope_scaling, ...)."""
    return TargetSpec(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                      head_dim=head_dim, intermediate_size=intermediate_size,
                      max_position_embeddings=max_position_embeddings,
                      rope_theta=10_000.0, eos_token_id=eos_token_id, **{"tie_word_embeddings": False, **spec})


def random_target(spec: TargetSpec, *, seed: int = 0, initializer_range: float = 0.02, bias_std: float = 0.0):
    """The transformers model of a small target with seeded random weights, fp32. transformers
    initialises projection biases to zero; ``bias_std`` > 0 draws them too, so they matter."""
    from dlite_trt.targets import random_hf_model

    model = random_hf_model(spec, torch.float32, seed, initializer_range=initializer_range)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None and bias_std:
                module.bias.normal_(0.0, bias_std)
    return model


def write_random_target(out: Path, spec: TargetSpec, *, seed: int = 0, initializer_range: float = 0.02):
    """A small target with seeded random weights, saved as a Hugging Face directory."""
    model = random_target(spec, seed=seed, initializer_range=initializer_range)
    model.save_pretrained(out)
    return model


def write_random_draft(out: Path, cfg: DraftConfig, *, seed: int = 0, max_shard_bytes: int | None = None,
                       draft_vocab: torch.Tensor | None = None) -> DLiteDraft:
    """A dlite_v1 draft checkpoint with seeded random weights (a DLiteDraft's default init); with
    ``draft_vocab`` [V_d] int64 (cfg.draft_vocab_size target ids) as its reduced draft vocabulary."""
    torch.manual_seed(seed)
    draft = DLiteDraft(cfg).eval()
    if draft_vocab is not None:
        draft.sequential_head.set_draft_vocab(draft_vocab)
    save_draft(draft, out, max_shard_bytes=max_shard_bytes)
    return draft


def make_tiny_pair(out: Path, *, vocab_size: int = 2048, seed: int = 0, anchor_group_size: int = 2,
                   block_size: int = 8, max_files: int | None = None) -> tuple[Path, Path]:
    """Write ``out/target`` (config, weights, tokenizer) and a matching random ``out/draft``."""
    out = Path(out)
    target_dir, draft_dir = out / "target", out / "draft"
    files = stdlib_files("train")[:max_files] if max_files else stdlib_files("train")
    tok = train_tokenizer(files, vocab_size, target_dir)
    ids = tok.convert_tokens_to_ids
    spec = tiny_target_spec(len(tok), eos_token_id=(ids("<|im_end|>"), ids("<|endoftext|>")))
    write_random_target(target_dir, spec, seed=seed)
    cfg = DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=3, mask_token_id=ids("<|mask|>"),
                                 anchor_group_size=anchor_group_size, block_size=block_size, sequential_rank=64)
    write_random_draft(draft_dir, cfg, seed=seed + 1)
    (out / "README.txt").write_text(
        "Tiny Qwen3 target + random dlite_v1 draft written by build_scripts/make_tiny_models.py.\n"
        + json.dumps({"vocab_size": len(tok), "seed": seed, "train_files": len(files)}) + "\n"
    )
    return target_dir, draft_dir
