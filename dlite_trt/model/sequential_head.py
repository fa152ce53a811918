"""DLite's low-rank sequential head: a gated RNN over the K proposals of a block (DESIGN 1.2).

For k = 1..K: e = prev_token_embedding[prev_k]; [g; c] = state_proj([s; e]);
s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c); z = state_hidden_mlp([s; h_k]);
logits_k = output_proj(z); d_k = argmax (or a sample); prev_1 = anchor, prev_{k+1} = d_k.

``recurrence`` is the whole K-step loop as a pure function of its inputs and the six head
weights. It is the one definition of the head: ``SequentialHead`` calls it with its
parameters, and the exporter turns it into the body of the ``LowRankRecurrence`` node.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dlite_trt.model.ops import static_size
from dlite_trt.runtime.sampling import sample_from_logits


class HeadOutput(NamedTuple):
    tokens: torch.Tensor  # [B, K] int64 draft tokens
    logits: torch.Tensor  # [B, K, V] the logits each token was chosen from


class HeadWeights(NamedTuple):
    """The head's weights, named as in the checkpoint (``sequential_head.<name>``, dots -> _)."""

    prev_token_embedding: torch.Tensor  # [V, r]
    state_proj_weight: torch.Tensor  # [2r, 2r]
    state_proj_bias: torch.Tensor  # [2r]
    state_hidden_mlp_weight: torch.Tensor  # [r, r + H]
    state_hidden_mlp_bias: torch.Tensor  # [r]
    output_proj_weight: torch.Tensor  # [V, r]


def recurrence_step(w: HeadWeights, state: torch.Tensor, prev: torch.Tensor,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step. state [B, r], prev [B] int64, hidden [B, H] -> (latent [B, r], state [B, r])."""
    e = F.embedding(prev, w.prev_token_embedding)  # [B, r]
    rank = static_size(w.prev_token_embedding, 1)  # a Python int: exports as a Split with constant sizes
    gate_raw, cand_raw = F.linear(torch.cat([state, e], dim=-1), w.state_proj_weight, w.state_proj_bias).split(rank, -1)
    gate = torch.sigmoid(gate_raw)
    state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
    latent = F.linear(torch.cat([state, hidden], dim=-1), w.state_hidden_mlp_weight, w.state_hidden_mlp_bias)
    return latent, state


def recurrence(
    w: HeadWeights,
    draft_hidden: torch.Tensor,  # [B, K, H] the backbone's output
    anchor: torch.Tensor,  # [B] int64
    seed_prev: torch.Tensor | None,  # [B] int64 token at anchor_pos - 1 (G > 1), else None
    temperature: float | torch.Tensor = 0.0,  # a float, or [B] per sequence
    uniforms: torch.Tensor | None = None,  # [B, K] in [0, 1), required when any row samples
    teacher_tokens: torch.Tensor | None = None,  # [B, K] training: prev_{k+1} = teacher_tokens[:, k]
) -> HeadOutput:
    """The K head steps of one block: tokens [B, K] and the logits [B, K, V] each was chosen from.

    With ``teacher_tokens`` (teacher forcing, for training) step k+1 is fed the true token
    instead of the draft's own choice; the returned tokens are still the draft's choices.
    """
    b, num_steps = draft_hidden.shape[:2]
    hidden_size, rank = static_size(draft_hidden, 2), static_size(w.prev_token_embedding, 1)
    state = draft_hidden.new_zeros(b, rank)
    if seed_prev is not None:  # G > 1: one step on the token before the anchor, latent discarded
        _, state = recurrence_step(w, state, seed_prev, draft_hidden.new_zeros(b, hidden_size))
    prev = anchor
    tokens, logits = [], []
    for k in range(num_steps):
        latent, state = recurrence_step(w, state, prev, draft_hidden[:, k])
        step_logits = F.linear(latent, w.output_proj_weight)  # [B, V]
        chosen = sample_from_logits(step_logits, temperature, None if uniforms is None else uniforms[:, k])
        tokens.append(chosen)
        logits.append(step_logits)
        prev = chosen if teacher_tokens is None else teacher_tokens[:, k]
    return HeadOutput(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))


class SequentialHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.rank = rank
        self.hidden_size = hidden_size
        self.prev_token_embedding = nn.Embedding(vocab_size, rank)
        self.output_proj = nn.Linear(rank, vocab_size, bias=False)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden_size, rank)

    def weights(self) -> HeadWeights:
        return HeadWeights(self.prev_token_embedding.weight, self.state_proj.weight, self.state_proj.bias,
                           self.state_hidden_mlp.weight, self.state_hidden_mlp.bias, self.output_proj.weight)

    def forward(
        self,
        draft_hidden: torch.Tensor,  # [B, K, H]
        anchor: torch.Tensor,  # [B] int64
        seed_prev: torch.Tensor | None,  # [B] int64 token at anchor_pos - 1 (G > 1), else None
        temperature: float | torch.Tensor = 0.0,
        uniforms: torch.Tensor | None = None,  # [B, K] in [0, 1), required when temperature > 0
    ) -> HeadOutput:
        if draft_hidden.ndim != 3 or draft_hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"draft_hidden must be [B, K, {self.hidden_size}], got {tuple(draft_hidden.shape)}")
        return recurrence(self.weights(), draft_hidden, anchor, seed_prev, temperature, uniforms)
