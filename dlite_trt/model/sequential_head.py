"""DLite's low-rank sequential head: a gated RNN over the K proposals of a block (DESIGN 1.2).

For k = 1..K: e = prev_token_embedding[prev_k]; [g; c] = state_proj([s; e]);
s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c); z = state_hidden_mlp([s; h_k]);
logits_k = output_proj(z); d_k = argmax (or a sample); prev_1 = anchor, prev_{k+1} = d_k.

``recurrence`` is the whole K-step loop as a pure function of its inputs and the six head
weights. It is the one definition of the head: ``SequentialHead`` calls it with its
parameters, and the exporter turns it into the body of the ``LowRankRecurrence`` node.

With an optional reduced draft vocabulary (V_d of the target's V ids, ``draft_vocab_size``) the
recurrence is unchanged and works in draft rows (``prev`` and the argmax index the head's V_d
rows); ``SequentialHead`` maps target ids to rows before it and rows back to ids after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dlite_trt.model.ops import static_size
from dlite_trt.runtime.sampling import sample_from_logits


class HeadOutput(NamedTuple):
    tokens: torch.Tensor  # [B, K] int64 draft tokens (draft rows inside the recurrence, else target ids)
    logits: torch.Tensor  # [B, K, V] the logits each token was chosen from (V_d columns inside the recurrence)


class HeadWeights(NamedTuple):
    """The head's weights, named as in the checkpoint (``sequential_head.<name>``, dots -> _)."""

    prev_token_embedding: torch.Tensor  # [V, r] (V_d rows with a draft vocabulary, as output_proj)
    state_proj_weight: torch.Tensor  # [2r, 2r]
    state_proj_bias: torch.Tensor  # [2r]
    state_hidden_mlp_weight: torch.Tensor  # [r, r + H]
    state_hidden_mlp_bias: torch.Tensor  # [r]
    output_proj_weight: torch.Tensor  # [V, r]


def recurrence_step(w: HeadWeights, state: torch.Tensor, prev: torch.Tensor,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step. state [..., r], prev [...] int64, hidden [..., H] -> (latent [..., r], state [..., r])."""
    e = F.embedding(prev, w.prev_token_embedding)  # [..., r]
    rank = static_size(w.prev_token_embedding, 1)  # a Python int: exports as a Split with constant sizes
    gate_raw, cand_raw = F.linear(torch.cat([state, e], dim=-1), w.state_proj_weight, w.state_proj_bias).split(rank, -1)
    gate = torch.sigmoid(gate_raw)
    state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
    latent = F.linear(torch.cat([state, hidden], dim=-1), w.state_hidden_mlp_weight, w.state_hidden_mlp_bias)
    return latent, state


def recurrence(
    w: HeadWeights,
    draft_hidden: torch.Tensor,  # [B, D, H] the backbone's output at the block's first D positions
    anchor: torch.Tensor,  # [B] int64
    seed_prev: torch.Tensor | None,  # [B] int64 token at anchor_pos - 1 (G > 1), else None
    temperature: float | torch.Tensor = 0.0,  # a float, or [B] per sequence
    uniforms: torch.Tensor | None = None,  # [B, D] in [0, 1), required when any row samples
    teacher_tokens: torch.Tensor | None = None,  # [B, D] training: prev_{k+1} = teacher_tokens[:, k]
    *,
    steps: int | None = None,
) -> HeadOutput:
    """The head's steps over a block: tokens [B, D] and the logits [B, D, V] each was chosen from.

    With ``teacher_tokens`` (teacher forcing, for training) step k+1 is fed the true token
    instead of the draft's own choice; the returned tokens are still the draft's choices.

    Step k works on [B, 1, ...] slices (``draft_hidden[:, k:k+1]``), which are empty ([B, 0, ...])
    from k = D on, and an empty step empties every later one: so ``steps`` (default D) steps may be
    written out for any D <= ``steps`` and only D of them do work. The exported node's body is
    written out for the block's K steps and drafts the D a step asks for (export/recurrence.py).
    """
    b = draft_hidden.shape[0]
    hidden_size, rank = static_size(draft_hidden, 2), static_size(w.prev_token_embedding, 1)
    state = draft_hidden.new_zeros(b, 1, rank)
    if seed_prev is not None:  # G > 1: one step on the token before the anchor, latent discarded
        _, state = recurrence_step(w, state, seed_prev[:, None], draft_hidden.new_zeros(b, 1, hidden_size))
    prev = anchor[:, None]  # [B, 1]
    tokens, logits = [], []
    for k in range(draft_hidden.shape[1] if steps is None else steps):
        hidden = draft_hidden[:, k: k + 1]  # [B, 1, H] for k < D, else [B, 0, H]
        present = hidden.shape[1]  # traced: a step past D slices its inputs empty
        latent, state = recurrence_step(w, state[:, :present], prev[:, :present], hidden)
        step_logits = F.linear(latent, w.output_proj_weight)  # [B, 1, V]
        chosen = sample_from_logits(step_logits, temperature, None if uniforms is None else uniforms[:, k: k + 1])
        tokens.append(chosen)
        logits.append(step_logits)
        prev = chosen if teacher_tokens is None else teacher_tokens[:, k: k + 1]
    return HeadOutput(torch.cat(tokens, dim=1), torch.cat(logits, dim=1))


def draft_vocab_problem(ids: torch.Tensor, vocab_size: int, mask_token_id: int) -> str | None:
    """What is wrong with a draft vocabulary (ids [V_d] int64, the target id of each draft row), or None.

    Each id must name one target token, once; the mask token must be among them, since a token
    the draft cannot name is read as the mask token (``SequentialHead.to_draft``)."""
    if ids.ndim != 1 or ids.dtype != torch.long:
        return f"the draft vocabulary must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}"
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        return (f"the draft vocabulary has {outside.numel()} id(s) outside the target vocabulary [0, {vocab_size}), "
                f"e.g. {outside[:5].tolist()}")
    unique, counts = ids.unique(return_counts=True)
    if len(unique) != len(ids):
        return f"the draft vocabulary lists {int((counts > 1).sum())} id(s) more than once, e.g. " \
               f"{unique[counts > 1][:5].tolist()}"
    if not bool((ids == mask_token_id).any()):
        return (f"the draft vocabulary lacks the mask token {mask_token_id} (tokens outside the draft vocabulary "
                "are read as the mask token, so it needs a row)")
    return None


def default_draft_vocab(vocab_size: int, size: int, mask_token_id: int) -> torch.Tensor:
    """The lowest ``size`` target ids, the mask token taking the last row when it is not among them: [V_d]."""
    ids = torch.arange(size)
    return ids if mask_token_id < size else torch.cat([ids[:-1], ids.new_tensor([mask_token_id])])


class SequentialHead(nn.Module):
    """The head's parameters, and optionally a reduced draft vocabulary.

    With ``draft_vocab_size`` V_d the head proposes among V_d of the target's V tokens (EAGLE-3's
    draft vocabularies, FR-Spec): its embedding and projection have V_d rows ("draft rows"),
    ``draft_vocab`` [V_d] holds the target id of each row and ``target_to_draft`` [V] the row of
    each target id (V_d for ids outside). The recurrence runs in draft rows; ``forward`` maps its
    inputs in and its outputs back to target ids, with logits over the full target vocabulary
    (-inf outside the draft vocabulary). Without one, forward runs the recurrence as is.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, draft_vocab_size: int | None = None,
                 mask_token_id: int | None = None) -> None:
        super().__init__()
        if draft_vocab_size is not None and mask_token_id is None:
            raise ValueError("a head with a draft vocabulary needs the mask_token_id (the row of the tokens it "
                             "cannot name)")
        self.vocab_size = vocab_size
        self.rank = rank
        self.hidden_size = hidden_size
        self.mask_token_id = mask_token_id
        rows = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.prev_token_embedding = nn.Embedding(rows, rank)
        self.output_proj = nn.Linear(rank, rows, bias=False)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden_size, rank)
        self.register_buffer("draft_vocab", None)  # [V_d] int64, persistent (a checkpoint tensor)
        self.register_buffer("target_to_draft", None, persistent=False)  # [V] int64, derived from draft_vocab
        if draft_vocab_size is not None:
            self._install(default_draft_vocab(vocab_size, draft_vocab_size, mask_token_id))

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.draft_vocab is None else static_size(self.draft_vocab, 0)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Use ``ids`` [V_d] int64 (the target id of each draft row) as the draft vocabulary."""
        if self.draft_vocab is None:
            raise ValueError("this head has no draft vocabulary (build it with draft_vocab_size to give it one)")
        if tuple(ids.shape) != tuple(self.draft_vocab.shape):
            raise ValueError(f"the draft vocabulary must have the head's {self.draft_vocab_size} rows, "
                             f"got {tuple(ids.shape)}")
        problem = draft_vocab_problem(ids, self.vocab_size, self.mask_token_id)
        if problem is not None:
            raise ValueError(f"{problem}; pass distinct target ids in [0, {self.vocab_size}) that include the mask "
                             f"token {self.mask_token_id}.")
        self._install(ids if self.draft_vocab.is_meta else ids.to(self.draft_vocab.device))

    def _install(self, ids: torch.Tensor) -> None:
        """Set draft_vocab [V_d] and rebuild target_to_draft [V] from it (the sentinel V_d outside)."""
        rows = torch.arange(len(ids), device=ids.device)  # [V_d]
        sentinel = torch.full((self.vocab_size,), len(ids), dtype=torch.long, device=ids.device)
        self.draft_vocab = ids
        self.target_to_draft = sentinel.scatter(0, ids, rows)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.draft_vocab is not None and prefix + "draft_vocab" in state_dict:
            self.set_draft_vocab(self.draft_vocab)  # checks the loaded ids and rebuilds target_to_draft

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids [...] -> draft rows [...]; a token the draft cannot name is read as the mask token."""
        if self.target_to_draft is None:
            return target_ids
        rows = self.target_to_draft[target_ids]  # [...] (V_d outside the draft vocabulary)
        mask_row = self.target_to_draft[self.mask_token_id]  # a constant of the exported graph
        return torch.where(rows < static_size(self.draft_vocab, 0), rows, mask_row)

    def to_target(self, draft_rows: torch.Tensor) -> torch.Tensor:
        """Draft rows [...] -> target ids [...]."""
        return draft_rows if self.draft_vocab is None else self.draft_vocab[draft_rows]

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits over draft rows [..., V_d] -> over the target vocabulary [..., V], -inf outside the draft
        vocabulary (a -inf column appended at index V_d, gathered by target_to_draft's sentinel)."""
        if self.target_to_draft is None:
            return draft_logits
        padded = F.pad(draft_logits, (0, 1), value=float("-inf"))  # [..., V_d + 1]
        return padded.index_select(-1, self.target_to_draft)  # [..., V]

    def mapped(self, run: Callable[[torch.Tensor, torch.Tensor | None], HeadOutput], anchor: torch.Tensor,
               seed_prev: torch.Tensor | None) -> HeadOutput:
        """``run(anchor_row, seed_row)`` (the recurrence, in draft rows) with target ids in and out: tokens
        [B, K] as target ids, logits [B, K, V] over the target vocabulary. No mapping without a draft vocabulary."""
        if self.draft_vocab is None:
            return run(anchor, seed_prev)
        out = run(self.to_draft(anchor), None if seed_prev is None else self.to_draft(seed_prev))
        return HeadOutput(self.to_target(out.tokens), self.full_logits(out.logits))

    def weights(self) -> HeadWeights:
        return HeadWeights(self.prev_token_embedding.weight, self.state_proj.weight, self.state_proj.bias,
                           self.state_hidden_mlp.weight, self.state_hidden_mlp.bias, self.output_proj.weight)

    def forward(
        self,
        draft_hidden: torch.Tensor,  # [B, K, H]
        anchor: torch.Tensor,  # [B] int64 target id
        seed_prev: torch.Tensor | None,  # [B] int64 target id at anchor_pos - 1 (G > 1), else None
        temperature: float | torch.Tensor = 0.0,
        uniforms: torch.Tensor | None = None,  # [B, K] in [0, 1), required when temperature > 0
    ) -> HeadOutput:
        if draft_hidden.ndim != 3 or draft_hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"draft_hidden must be [B, K, {self.hidden_size}], got {tuple(draft_hidden.shape)}")
        return self.mapped(lambda a, s: recurrence(self.weights(), draft_hidden, a, s, temperature, uniforms),
                           anchor, seed_prev)
