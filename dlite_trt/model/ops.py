"""Export-friendly building blocks shared by the target adapter and the draft.

Plain tensor ops only: RoPE from explicit integer positions as real cos/sin, attention as
matmul + additive mask + softmax (no SDPA dispatch, no cache objects), so the same code runs
eagerly and traces into ONNX.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale (as transformers does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward with Qwen3's parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (default RoPE, Qwen3 layout)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)  # [D/2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] rotated by cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
              masks: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """Grouped-query attention over key/value chunks, each with its own boolean mask.

    q [B, nH, T, D]; keys[i], values[i] [B, kvH, L_i, D] (e.g. a KV cache view and the new
    block: they are never concatenated, so no cache-sized copy is made); masks[i] bool,
    broadcastable to [B, T, L_i] (True = may attend; a cache chunk's mask is [B, 1, L] since
    it depends only on the key). Returns [B, T, nH * D]. Each query row must allow at least one
    key. Masks are applied as additive 0 / finfo.min biases built at mask size and broadcast,
    so each chunk's scores get one pass: at long contexts these passes, not the matmuls, cost most.
    """
    if not len(keys) == len(values) == len(masks):
        raise ValueError(f"{len(keys)} key chunks, {len(values)} value chunks and {len(masks)} masks must agree")
    b, n_heads, t, d = q.shape
    kv_heads = keys[0].shape[1]
    groups = n_heads // kv_heads
    # heads of one kv group stacked along T; the scale is applied to q (T x D values), not to
    # the T x L scores
    qg = (q * scale).reshape(b, kv_heads, groups * t, d)
    neg = torch.finfo(torch.float32).min
    chunks = []
    for k, mask in zip(keys, masks, strict=True):
        if mask.ndim != 3 or mask.shape[-1] != k.shape[2]:
            raise ValueError(f"a mask must be [B|1, T|1, L] over its chunk's {k.shape[2]} keys, got {tuple(mask.shape)}")
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().reshape(b, kv_heads, groups, t, -1)
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill(~mask, neg)
        chunks.append(scores + bias[:, None, None])  # [B, kvH, g, T, L_i]
    probs = torch.softmax(torch.cat(chunks, dim=-1), dim=-1).to(values[0].dtype).reshape(b, kv_heads, groups * t, -1)
    if len(values) == 1:
        out = torch.matmul(probs, values[0])
    else:  # sum the chunks' partial outputs in fp32, round once
        out, start = 0.0, 0
        for v in values:
            out = out + torch.matmul(probs[..., start : start + v.shape[2]], v).float()
            start += v.shape[2]
        out = out.to(values[0].dtype)
    return out.reshape(b, n_heads, t, d).transpose(1, 2).reshape(b, t, n_heads * d)
