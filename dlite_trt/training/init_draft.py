"""A first, untrained DLite draft for a target: the checkpoint that `dlite-trt train teacher`
and `train student` start from (``--init``), written by `dlite-trt train init`.

Its shape follows the target (hidden size, heads, vocabulary; DraftConfig.for_target) and its
weights are a DLiteDraft's default initialisation, seeded. Its mask token, the query input of
the K proposal slots, must be a token of the target's vocabulary: the tokenizer's own mask
token if it has one, else its unknown token (never one the target emits to stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlite_trt.config import DraftConfig, TargetSpec
from dlite_trt.errors import CheckpointError, ConfigError

MASK_TOKENS = ("<|mask|>", "<mask>", "<|fim_pad|>", "<fim_pad>")  # tried in this order


def pick_mask_token(tokenizer: Any | None, spec: TargetSpec, stop_ids: tuple[int, ...],
                    override: int | None = None) -> int:
    """The mask token id: ``override``, else a named mask token, else the unknown token."""
    if override is not None:
        if not 0 <= override < spec.vocab_size:
            raise ConfigError(f"--mask-token-id {override} is outside the target's vocabulary (0..{spec.vocab_size - 1}).")
        return override
    if tokenizer is None:
        raise ConfigError("the target has no tokenizer to find a mask token in; pass --mask-token-id.")
    vocab = tokenizer.get_vocab()
    named = [vocab[t] for t in MASK_TOKENS if t in vocab]
    unk = [tokenizer.unk_token_id] if tokenizer.unk_token_id is not None else []
    for token_id in named + unk:
        if token_id not in stop_ids and token_id < spec.vocab_size:
            return token_id
    raise ConfigError(f"the target's tokenizer has no mask token ({', '.join(MASK_TOKENS)}) and no unknown token "
                      "that is not a stop token; pass --mask-token-id with an id the prompts never use.")


def require_new_dir(out: Path) -> None:
    """Refuse an --out that exists and holds anything: a checkpoint is never written over another."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} exists and is not empty; pass a new directory.")


def write_initial_draft(out: Path, spec: TargetSpec, mask_token_id: int, *, seed: int = 0,
                        draft_vocab: Sequence[int] | None = None, **shape: Any) -> DraftConfig:
    """Write an initialised dlite_v1 draft for ``spec`` to ``out``; ``shape``: DraftConfig.for_target's
    num_hidden_layers, chs_num_layers and config overrides (block_size, sequential_rank, ...).
    ``draft_vocab``: the target ids of a reduced draft vocabulary (the mask token among them)."""
    import torch

    from dlite_trt.tiny_models import write_random_draft

    require_new_dir(out)
    size = None if draft_vocab is None else len(draft_vocab)
    cfg = DraftConfig.for_target(spec, mask_token_id=mask_token_id, draft_vocab_size=size, **shape)
    ids = None if draft_vocab is None else torch.tensor(list(draft_vocab), dtype=torch.long)
    try:
        write_random_draft(out, cfg, seed=seed, draft_vocab=ids)
    except ValueError as exc:  # set_draft_vocab: the ids do not make a draft vocabulary
        raise ConfigError(f"cannot use that draft vocabulary: {exc}") from exc
    return cfg
