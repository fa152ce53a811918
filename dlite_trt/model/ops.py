"""Export-friendly building blocks shared by the target adapter and the draft.

Plain tensor ops only: RoPE from explicit integer positions as real cos/sin, attention as
matmul + additive mask + softmax (no SDPA dispatch, no cache objects), so the same code runs
eagerly and traces into ONNX.

Shapes are written so the traced graph stays small: sizes the engine contract fixes (heads,
head_dim, rank) are Python ints (``static_size``), and reshapes that keep dynamic dims (batch,
tokens) use ``reshape`` with ONNX's 0 = "copy this dim" semantics, which exports as ONE Reshape
with a constant shape instead of a Shape -> Gather -> Unsqueeze -> Concat chain per call site.
At small sizes on CPU those chains, not the matmuls, dominated a call's time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dlite_trt.config import RopeScaling


def static_size(x: torch.Tensor, dim: int) -> int:
    """``x.shape[dim]`` as a Python int even while tracing (where sizes are traced tensors), so
    the exporter writes a constant. Only for sizes the engine contract fixes (heads, head_dim,
    hidden, rank), never for batch, token or cache dims."""
    return int(x.shape[dim])


class _ConstantReshape(torch.autograd.Function):
    """Exports as one ONNX Reshape whose shape is a constant (0 copies the input's dim)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return x.reshape(_resolve_shape(x, shape))

    @staticmethod
    def symbolic(g, x, shape: tuple[int, ...]):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


def _resolve_shape(x: torch.Tensor, shape: Sequence[int]) -> list[int]:
    if any(s == 0 and i >= x.ndim for i, s in enumerate(shape)):
        raise ValueError(f"reshape {tuple(shape)}: a 0 (copy) entry past the input's rank {x.ndim}")
    return [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]


def reshape(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``x.reshape(shape)`` with ONNX semantics: an entry 0 keeps x's size at that index, one
    entry may be -1. Eagerly a plain reshape (autograd as usual); in ONNX export one Reshape
    with a constant shape, however dynamic the kept dims are."""
    if torch.onnx.is_in_onnx_export():
        return _ConstantReshape.apply(x, tuple(int(s) for s in shape))
    return x.reshape(_resolve_shape(x, shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Qwen3, Llama, Qwen2): normalise in fp32, cast back, then scale (as transformers does)."""
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


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], fp32, in transformers' arithmetic (so fp32
    logits match it bit for bit). ``scaling``: a fixed-frequency RoPE type (linear, llama3)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope_type {scaling.rope_type!r} has no fixed inverse frequencies here")
    # Llama 3.1: wavelengths longer than original/low_freq_factor are stretched by `factor`,
    # shorter than original/high_freq_factor kept, the ones between blended smoothly
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, stretched)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (rotate-half layout)."""
    return rope_from_inv_freq(positions, rope_inv_freq(head_dim, theta, scaling, positions.device), dtype)


def rope_from_inv_freq(positions: torch.Tensor, inv_freq: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., D] for integer positions [...] and inverse frequencies [D / 2] (rotate-half
    layout: the two halves equal)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] rotated by cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = static_size(x, -1) // 2
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
    Whether a mask varies per query (its dim 1 is not 1) is read when tracing: it is structural
    (a cache mask never does, a causal block mask does), so the exported graph keeps it.
    """
    if not len(keys) == len(values) == len(masks):
        raise ValueError(f"{len(keys)} key chunks, {len(values)} value chunks and {len(masks)} masks must agree")
    n_heads, d = static_size(q, 1), static_size(q, 3)
    kv_heads = static_size(keys[0], 1)
    groups = n_heads // kv_heads
    # heads of one kv group stacked along T (row j * T + t is head j of the group at query t);
    # the scale is applied to q (T x D values), not to the T x L scores
    qg = reshape(q * scale, (0, kv_heads, -1, d))  # [B, kvH, g*T, D]
    neg = torch.finfo(torch.float32).min
    chunks, lengths = [], []
    for k, mask in zip(keys, masks, strict=True):
        if mask.ndim != 3 or mask.shape[-1] != k.shape[2]:
            raise ValueError(f"a mask must be [B|1, T|1, L] over its chunk's {k.shape[2]} keys, got {tuple(mask.shape)}")
        scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, kvH, g*T, L_i]
        bias = torch.where(mask, 0.0, neg)  # [B|1, T|1, L_i] in the default dtype, float32
        if static_size(mask, 1) != 1:  # a per-query mask: one copy per group head (rows j * T + t)
            bias = bias.repeat(1, groups, 1)
        chunks.append(scores + bias[:, None])
        # a chunk's length from its mask: masks are shared by all layers, so the exported graph
        # reads their shapes once, not once per layer
        lengths.append(mask.shape[-1])
    probs = torch.softmax(torch.cat(chunks, dim=-1), dim=-1).to(values[0].dtype)  # [B, kvH, g*T, L]
    if len(values) == 1:
        out = torch.matmul(probs, values[0])
    else:  # sum the chunks' partial outputs in fp32, round once
        out, start = 0.0, 0
        for v, length in zip(values, lengths, strict=True):
            out = out + torch.matmul(probs[..., start : start + length], v).float()
            start = start + length
        out = out.to(values[0].dtype)
    out = reshape(out, (0, n_heads, -1, d))  # [B, nH, T, D]
    return reshape(out.transpose(1, 2), (0, 0, n_heads * d))


CACHE_ATTENTION_OP = "CacheAttention"  # in the dlite domain; export/cache_attention.py lowers it


class _CacheAttention(torch.autograd.Function):
    """A call's T tokens attending over one KV buffer that the call also writes, RoPE applied inside.

    q [B, T, nH * D], k / v [B, T, kvH * D] (RoPE not applied), past_k / past_v [B, kvH, P, D] with
    each row's first past_len entries valid, positions [B, T] (= past_len[b] + t), inv_freq
    [D / 2] (``rope_inv_freq``) -> (out [B, T, nH * D], present_k, present_v): q and k rotated to
    their positions, the buffers with row b's new entries written at slots past_len[b] ..
    past_len[b] + T - 1, and query t attending over slots 0 .. past_len[b] + t. Every key is read
    from its own slot, so a position's attention sums the same terms in the same order whichever
    call computes it (a verify of several tokens or a later decode call). Exports as one
    ``dlite::CacheAttention`` node, which the ONNX Runtime lowering makes a GroupQueryAttention over
    a shared buffer that also rotates (its cos/sin tables made from inv_freq at the lowering).
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, past_len, positions, inv_freq, num_heads: int, kv_heads: int,
                scale: float):
        b, t = q.shape[:2]
        p, d = past_k.shape[2:]
        cos, sin = rope_from_inv_freq(positions, inv_freq, q.dtype)  # [B, T, D]
        q = apply_rope(q.reshape(b, t, num_heads, d).transpose(1, 2), cos, sin)  # [B, nH, T, D]
        k = apply_rope(k.reshape(b, t, kv_heads, d).transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, kvH, D]
        pos = past_len[:, None] + torch.arange(t, device=q.device)[None, :]  # [B, T] slots
        rows = torch.arange(b, device=q.device)[:, None].expand(b, t)
        fits = pos < p  # slots past the buffer are not written (GroupQueryAttention refuses such a call)
        present = []
        for past, new in ((past_k, k), (past_v, v.reshape(b, t, kv_heads, d))):
            buf = past.clone()
            buf.permute(0, 2, 1, 3)[rows[fits], pos[fits]] = new[fits].to(buf.dtype)
            present.append(buf)
        mask = torch.arange(p, device=q.device)[None, None, :] <= pos[:, :, None]  # [B, T, P]
        out = attention(q, present[:1], present[1:], (mask,), scale)
        return out, present[0], present[1]

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, past_len, positions, inv_freq, num_heads: int, kv_heads: int,
                 scale: float):
        int32 = 6  # TensorProto.INT32
        t = g.op("Shape", q, start_i=1, end_i=2)  # [1] int64
        one = g.op("Constant", value_t=torch.tensor([1], dtype=torch.int64))
        seqlens_k = g.op("Cast", g.op("Sub", g.op("Add", past_len, t), one), to_i=int32)  # [B] total - 1
        capacity = g.op("Squeeze", g.op("Shape", past_k, start_i=2, end_i=3),
                        g.op("Constant", value_t=torch.tensor([0], dtype=torch.int64)))
        query_seqlens = g.op("Cast", g.op("Expand", t, g.op("Shape", past_len)), to_i=int32)  # [B] = T
        out, present_k, present_v = g.op(f"dlite::{CACHE_ATTENTION_OP}", q, k, v, past_k, past_v, seqlens_k,
                                         g.op("Cast", capacity, to_i=int32), query_seqlens, positions, inv_freq,
                                         num_heads_i=num_heads, kv_num_heads_i=kv_heads, scale_f=scale, outputs=3)
        for value, like in ((out, q), (present_k, past_k), (present_v, past_v)):
            value.setType(like.type())
        return out, present_k, present_v


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                    past_len: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_CacheAttention`` on q [B, T, nH * D] and k / v [B, T, kvH * D] (heads packed as the
    projections make them, RoPE not applied) at positions [B, T]: (out [B, T, nH * D], present_k,
    present_v)."""
    kv_heads = static_size(past_k, 1)
    return _CacheAttention.apply(q, k, v, past_k, past_v, past_len, positions, inv_freq, num_heads, kv_heads, scale)
