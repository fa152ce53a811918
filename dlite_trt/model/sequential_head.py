"""DLite's low-rank sequential head: a gated RNN over the K proposals of a block (DESIGN 1.2).

For k = 1..K: e = prev_token_embedding[prev_k]; [g; c] = state_proj([s; e]);
s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c); z = state_hidden_mlp([s; h_k]);
logits_k = output_proj(z); d_k = argmax (or a sample); prev_1 = anchor, prev_{k+1} = d_k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dlite_trt.runtime.sampling import sample_from_logits


class HeadOutput(NamedTuple):
    tokens: torch.Tensor  # [B, K] int64 draft tokens
    logits: torch.Tensor  # [B, K, V] the logits each token was chosen from


class SequentialHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.rank = rank
        self.hidden_size = hidden_size
        self.prev_token_embedding = nn.Embedding(vocab_size, rank)
        self.output_proj = nn.Linear(rank, vocab_size, bias=False)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden_size, rank)

    def step(self, state: torch.Tensor, prev: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step. state [B, r], prev [B] int64, hidden [B, H] -> (latent, state)."""
        e = self.prev_token_embedding(prev)  # [B, r]
        gate_raw, cand_raw = self.state_proj(torch.cat([state, e], dim=-1)).chunk(2, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        latent = self.state_hidden_mlp(torch.cat([state, hidden], dim=-1))  # [B, r]
        return latent, state

    def initial_state(self, seed_prev: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Zero state, or (G > 1) the state after one step on the token before the anchor."""
        b = like.shape[0]
        state = like.new_zeros(b, self.rank)
        if seed_prev is None:
            return state
        _, state = self.step(state, seed_prev, like.new_zeros(b, self.hidden_size))
        return state

    def forward(
        self,
        draft_hidden: torch.Tensor,  # [B, K, H]
        anchor: torch.Tensor,  # [B] int64
        seed_prev: torch.Tensor | None,  # [B] int64 token at anchor_pos - 1 (G > 1), else None
        temperature: float = 0.0,
        uniforms: torch.Tensor | None = None,  # [B, K] in [0, 1), required when temperature > 0
    ) -> HeadOutput:
        if draft_hidden.ndim != 3 or draft_hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"draft_hidden must be [B, K, {self.hidden_size}], got {tuple(draft_hidden.shape)}")
        num_steps = draft_hidden.shape[1]
        state = self.initial_state(seed_prev, draft_hidden[:, 0])
        prev = anchor
        tokens, logits = [], []
        for k in range(num_steps):
            latent, state = self.step(state, prev, draft_hidden[:, k])
            step_logits = self.output_proj(latent)  # [B, V]
            u = None if uniforms is None else uniforms[:, k]
            prev = sample_from_logits(step_logits, temperature, u)
            tokens.append(prev)
            logits.append(step_logits)
        return HeadOutput(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))
