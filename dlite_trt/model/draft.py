"""The DLite draft: history-free parallel backbone + low-rank sequential head (DESIGN 1.2).

Parameter names equal the official dlite_v1 checkpoint's (no prefix), so ``state_dict()``
is the checkpoint. The draft has no embedding or LM head: query embeddings come from the
target's ``embed_tokens``, passed in as ``embed_weight``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dlite_trt.config import DraftConfig
from dlite_trt.model.ops import MLP, RMSNorm, apply_rope, attention, reshape, rope_cos_sin
from dlite_trt.model.sequential_head import HeadOutput, SequentialHead


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, a: torch.Tensor, ctx: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor,
                cos_k: torch.Tensor, sin_k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """a [B, Q, H] normed queries; ctx [B, S, H]; allowed [B, 1, S+Q] (per key) -> [B, Q, H]."""
        d = self.head_dim
        split_heads = (0, 0, -1, d)  # [B, L, h * D] -> [B, L, h, D]
        q = self.q_norm(reshape(self.q_proj(a), split_heads)).transpose(1, 2)  # [B, nH, Q, D]
        kv_in = torch.cat([ctx, a], dim=1)  # [B, S+Q, H]: ctx enters as is, not re-normed
        k = self.k_norm(reshape(self.k_proj(kv_in), split_heads)).transpose(1, 2)
        v = reshape(self.v_proj(kv_in), split_heads).transpose(1, 2)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos_k, sin_k)
        return self.o_proj(attention(q, (k,), (v,), (allowed,), d ** -0.5))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: tuple[torch.Tensor, ...],
                allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class ExtraContext(NamedTuple):
    """Additional context slots (the history-aware teacher's window; never used at inference)."""

    slots: torch.Tensor  # [B, W, H], entering k_proj/v_proj as the pivot slots do
    positions: torch.Tensor  # [B, W] int64 local RoPE positions (may be negative: before the pivot)
    valid: torch.Tensor  # [B, W] bool


class DLiteDraft(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_depth_embedding = nn.Embedding(cfg.num_target_layers, cfg.hidden_size)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sequential_head = SequentialHead(cfg.vocab_size, cfg.sequential_rank, cfg.hidden_size,
                                              cfg.draft_vocab_size, cfg.mask_token_id)

    def backbone(
        self,
        chs: torch.Tensor,  # [B, S, H] target hidden states at the pivot (anchor_pos - 1)
        group_ids: torch.Tensor,  # [B, G] int64 tokens ending with the anchor, left-padded
        group_len: torch.Tensor,  # [B] int64 G' = min(G, anchor_pos + 1) valid tokens at the right
        embed_weight: torch.Tensor,  # [V, H] the target's embed_tokens weight
        extra: ExtraContext | None = None,  # training only: the teacher's window slots
    ) -> torch.Tensor:
        """The parallel backbone: returns draft_hidden [B, K, H]."""
        cfg = self.cfg
        s, hsz = cfg.chs_num_layers, cfg.hidden_size
        if chs.ndim != 3 or tuple(chs.shape[1:]) != (s, hsz):
            raise ValueError(f"chs must be [B, {s}, {hsz}], got {tuple(chs.shape)}")
        b, g = chs.shape[0], group_ids.shape[-1]
        if group_ids.ndim != 2 or g != cfg.anchor_group_size or group_ids.shape[0] != b:
            raise ValueError(f"group_ids must be [B={b}, G={cfg.anchor_group_size}] (left-padded), "
                             f"got {tuple(group_ids.shape)}")
        if group_len.shape != (b,) or group_ids.dtype != torch.long or group_len.dtype != torch.long:
            raise ValueError(f"group_ids/group_len must be int64 [B, G] / [B], got {group_ids.dtype} "
                             f"{tuple(group_ids.shape)} / {group_len.dtype} {tuple(group_len.shape)}")
        if embed_weight.ndim != 2 or embed_weight.shape[1] != hsz or embed_weight.dtype != chs.dtype:
            raise ValueError(f"embed_weight must be the target's [V, {hsz}] {chs.dtype} embedding, got "
                             f"{embed_weight.dtype} {tuple(embed_weight.shape)}")
        k_props = cfg.num_proposals
        depth = self.layer_depth_embedding.weight[list(cfg.target_layer_ids)]  # [S, H]
        ctx = self.context_norm(chs + depth)  # [B, S, H]
        mask_row = embed_weight[cfg.mask_token_id]  # [H]
        x = torch.cat([
            nn.functional.embedding(group_ids, embed_weight),  # [B, G, H]
            mask_row.expand(b, k_props, hsz),  # [B, K, H]
        ], dim=1)  # [B, G+K, H]
        # Local RoPE positions. Left padding of the group shifts the query slots by
        # pad = G - G'; valid queries sit at 0..G'+K-1, context slots at max(G'-2, 0).
        slot = torch.arange(g + k_props, device=chs.device)  # [G+K]
        pad = (g - group_len)[:, None]  # [B, 1]
        q_pos = (slot[None, :] - pad).clamp_min(0)  # [B, G+K]
        c_pos = (group_len - 2).clamp_min(0)[:, None].expand(b, s)  # [B, S]
        # Non-causal: every query sees every context slot and every valid (non-pad) query.
        ctx_ok = torch.ones(b, s, dtype=torch.bool, device=chs.device)
        if extra is not None:  # more context slots, before the query slots
            ctx = torch.cat([ctx, extra.slots.to(ctx.dtype)], dim=1)
            c_pos = torch.cat([c_pos, extra.positions], dim=1)
            ctx_ok = torch.cat([ctx_ok, extra.valid], dim=1)
        key_ok = torch.cat([ctx_ok, slot[None, :] >= pad], dim=1)
        allowed = key_ok[:, None, :]  # [B, 1, S(+W)+G+K]: the same keys for every query
        cos_q, sin_q = rope_cos_sin(q_pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        cos_k, sin_k = rope_cos_sin(torch.cat([c_pos, q_pos], dim=1), cfg.head_dim, cfg.rope_theta, x.dtype)
        rope = (cos_q, sin_q, cos_k, sin_k)
        for layer in self.layers:
            x = layer(x, ctx, rope, allowed)
        return self.norm(x)[:, -k_props:]  # [B, K, H]

    def forward(
        self,
        chs: torch.Tensor,
        group_ids: torch.Tensor,
        group_len: torch.Tensor,
        embed_weight: torch.Tensor,
        temperature: float = 0.0,
        uniforms: torch.Tensor | None = None,  # [B, K] when temperature > 0
    ) -> HeadOutput:
        """One draft block: backbone then the K head steps. Returns tokens [B, K], logits [B, K, V]."""
        draft_hidden = self.backbone(chs, group_ids, group_len, embed_weight)
        anchor = group_ids[:, -1]
        # G > 1: the head is seeded by the token before the anchor (always present: the
        # anchor follows at least one token, so G' >= 2).
        seed_prev = group_ids[:, -2] if self.cfg.anchor_group_size > 1 else None
        return self.sequential_head(draft_hidden, anchor, seed_prev, temperature, uniforms)
