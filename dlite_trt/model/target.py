"""The target as a pure function of (tokens, positions, past KV): the verifier.

``TargetAdapter`` wraps a transformers ``Qwen3ForCausalLM``, ``LlamaForCausalLM`` or
``Qwen2ForCausalLM`` and reuses its modules (so parameter names stay
``model.layers.{i}.self_attn.q_proj.weight`` ... as in the checkpoint, and projection biases
come with them); what differs between those architectures is read from
``spec.arch`` (dlite_trt/architectures.py): q/k norm, and the RoPE type from ``spec``. It
runs its own export-friendly forward: explicit per-token positions, a preallocated KV
buffer passed in as a tensor view, and only the block's new KV entries returned. It also
returns the hidden states of the draft's selected layers, with DLite's layer-id semantics:
id k is the output of decoder layer k, and id N-1 is taken after the final RMSNorm
(``output_hidden_states[k + 1]`` in transformers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from dlite_trt.config import TargetSpec
from dlite_trt.model.ops import (
    apply_rope,
    attention,
    cache_attention,
    reshape,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)


class TargetOutput(NamedTuple):
    logits: torch.Tensor  # [B, R, V] at the requested output indices
    hidden: torch.Tensor  # [B, R, S, H] selected layers at the same indices
    # [L, B, kvH, T, D] keys (RoPE applied) and values of the T input tokens; None with ``write_cache``
    new_k: torch.Tensor | None
    new_v: torch.Tensor | None
    # with ``write_cache``: per layer, the cache buffers with the new entries written ([B, kvH, P, D])
    present_k: tuple[torch.Tensor, ...] = ()
    present_v: tuple[torch.Tensor, ...] = ()


class TargetAdapter(nn.Module):
    """Target forward over a block of tokens on top of a KV cache; returns new KV entries."""

    def __init__(self, hf_model: nn.Module, spec: TargetSpec, layer_ids: tuple[int, ...]) -> None:
        super().__init__()
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= spec.num_hidden_layers:
            raise ValueError(f"layer_ids {layer_ids} out of range for a {spec.num_hidden_layers}-layer target")
        self.model = hf_model.model  # embed_tokens, layers, norm (transformers *Model)
        self.lm_head = hf_model.lm_head
        self.spec = spec
        self.layer_ids = tuple(layer_ids)
        expected = spec.arch.hf_class
        if type(hf_model).__name__ != expected:
            raise ValueError(f"a {spec.architecture} target spec needs a transformers {expected}, "
                             f"got {type(hf_model).__name__}")

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # [V, H]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64, absolute positions of the tokens
        past_k: torch.Tensor | Sequence[torch.Tensor],  # [L, B, kvH, P, D], or L tensors [B, kvH, P, D];
        past_v: torch.Tensor | Sequence[torch.Tensor],  # entries >= past_len are ignored
        past_len: torch.Tensor,  # [B] int64, valid cache entries per sequence
        output_index: torch.Tensor,  # [B, R] int64, indices into T where logits/hidden are wanted
        write_cache: bool = False,  # ops.cache_attention: also returns the cache buffers, new entries written
    ) -> TargetOutput:
        spec = self.spec
        if input_ids.ndim != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must be [B, T]; got {tuple(input_ids.shape)}, "
                             f"{tuple(positions.shape)}")
        b, t = input_ids.shape
        _check_cache(past_k, past_v, (spec.num_hidden_layers, b, spec.num_key_value_heads, spec.head_dim))
        if past_len.shape != (b,) or output_index.ndim != 2 or output_index.shape[0] != b:
            raise ValueError(f"past_len must be [B] and output_index [B, R] for B={b}; got "
                             f"{tuple(past_len.shape)}, {tuple(output_index.shape)}")
        p = past_k[0].shape[2]
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        if write_cache:  # the RoPE tables are made inside the cache attention (export: GroupQueryAttention's)
            inv_freq = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling, x.device)
        else:
            cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, x.dtype, spec.rope_scaling)
        # Keys: P cached entries (valid below past_len) then the T new ones (causal).
        past_ok = torch.arange(p, device=x.device)[None, None, :] < past_len[:, None, None]  # [B, 1, P]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None]  # [1, T, T]
        scale = spec.head_dim ** -0.5
        n_layers = spec.num_hidden_layers
        gather = output_index[:, :, None].expand(-1, -1, spec.hidden_size)  # [B, R, H]
        split_heads = (0, 0, -1, spec.head_dim)  # [B, T, h * D] -> [B, T, h, D]
        qk_norm = spec.arch.qk_norm
        new_k, new_v, present_k, present_v, selected = [], [], [], [], {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)  # [B, T, heads * D]
            if qk_norm:  # per head
                q, k = attn.q_norm(reshape(q, split_heads)), attn.k_norm(reshape(k, split_heads))
            if write_cache:  # heads packed, RoPE inside, as GroupQueryAttention takes them
                if qk_norm:
                    q, k = reshape(q, (0, 0, -1)), reshape(k, (0, 0, -1))
                attended, pk, pv = cache_attention(q, k, v, past_k[i], past_v[i], past_len, positions, inv_freq,
                                                   spec.num_attention_heads, scale)
                present_k.append(pk)
                present_v.append(pv)
            else:
                q, k = (heads if qk_norm else reshape(heads, split_heads) for heads in (q, k))
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                v = reshape(v, split_heads).transpose(1, 2)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                new_k.append(k)
                new_v.append(v)
                attended = attention(q, (past_k[i], k), (past_v[i], v), (past_ok, causal), scale)
            x = x + attn.o_proj(attended)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.layer_ids and i != n_layers - 1:
                selected[i] = torch.gather(x, 1, gather)
        x_out = torch.gather(x, 1, gather)  # [B, R, H]
        normed = rms_norm(x_out, self.model.norm.weight, self.model.norm.variance_epsilon)
        if n_layers - 1 in self.layer_ids:
            selected[n_layers - 1] = normed
        hidden = torch.stack([selected[i] for i in self.layer_ids], dim=2)  # [B, R, S, H]
        logits = self.lm_head(normed)  # [B, R, V]
        if write_cache:
            return TargetOutput(logits, hidden, None, None, tuple(present_k), tuple(present_v))
        return TargetOutput(logits, hidden, torch.stack(new_k), torch.stack(new_v))


def _check_cache(past_k, past_v, cache_shape: tuple[int, int, int, int]) -> None:
    """past_k/past_v: one [L, B, kvH, P, D] tensor each, or L per-layer [B, kvH, P, D] tensors."""
    layers, *row_shape = cache_shape
    ok = len(past_k) == layers and len(past_v) == layers and all(
        k.ndim == 4 and (*k.shape[:2], k.shape[3]) == tuple(row_shape) and v.shape == k.shape == past_k[0].shape
        for k, v in zip(past_k, past_v, strict=True))
    if not ok:
        got = [tuple(t.shape) for t in (past_k, past_v)] if isinstance(past_k, torch.Tensor) else \
            [f"{len(past_k)} x {tuple(past_k[0].shape) if len(past_k) else ()}"]
        raise ValueError(f"past_k/past_v must be [L, B, kvH, P, D] (or L tensors [B, kvH, P, D]) with "
                         f"(L, B, kvH, D) = {cache_shape}; got {got}")
