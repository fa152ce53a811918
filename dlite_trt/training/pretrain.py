"""Train the small Qwen3 target itself (causal LM) on a token stream, for the bundled models.

The corpus is the standard library's training split (``tiny_models.stdlib_files("train")``),
tokenized once into one stream with an end-of-text token between files; each step takes
``batch`` seeded random windows of ``seq_len + 1`` tokens. Uses the same resumable,
distributed loop as the draft (``trainer.train``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlite_trt.errors import ConfigError
from dlite_trt.training.trainer import TrainSettings, train


def token_stream(files: Sequence[Path], tokenizer: Any, separator_id: int) -> torch.Tensor:
    """[T] int64: every file's tokens, each followed by ``separator_id``."""
    ids: list[int] = []
    for path in files:
        ids += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        ids.append(separator_id)
    return torch.tensor(ids, dtype=torch.long)


class WindowBatches:
    """batch(step, rank, world) -> [batch / world, seq_len + 1] windows of the stream, seeded by step."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int = 0) -> None:
        if stream.numel() <= seq_len + 1:
            raise ConfigError(f"the corpus has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
        self.stream, self.seq_len, self.batch, self.seed = stream, seq_len, batch, seed
        self.tokens_seen = 0

    def __call__(self, step: int, rank: int, world: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch,), generator=g)
        starts = starts[rank * self.batch // world: (rank + 1) * self.batch // world]
        windows = torch.stack([self.stream[s: s + self.seq_len + 1] for s in starts.tolist()])
        self.tokens_seen += windows.numel()
        return windows


def lm_loss(model: nn.Module, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Next-token cross-entropy of a transformers causal LM on [B, L + 1] windows."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, L, V]
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    return {"loss": loss}


def pretrain(model: nn.Module, batches: WindowBatches, settings: TrainSettings, out: Path | None = None,
             log=None) -> int:
    """Train ``model`` (a transformers Qwen3ForCausalLM) on ``batches``; resumable from ``out``."""
    model.train()
    return train(model, lm_loss, batches, settings, out, log)
