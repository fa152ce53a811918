"""Draft training examples from target-generated sequences (DESIGN 1.4).

A sequence of tokens t_0..t_{L-1} (a prompt and the target's own answer) run through the
target gives, at every position, the hidden states of the draft's S layers and the target's
logits. An example is one draft block anchored at position a (1 <= a <= L-2):
- pivot states chs = hidden[a - 1], and the token group ending at the anchor t_a;
- for k = 1..K: the target's distribution for d_k, softmax(logits[a + k - 1]) (what the
  verifier compares d_k against), its greedy token (the CE label), the sequence's own token
  t_{a+k} (base CE label, and the head's teacher-forced input for step k+1);
- valid[k] = a + k < L (a block near the end is cut, not dropped);
- the target's last selected layer (N-1: its final, normed state) at a + k - 1, the state its
  own LM head reads d_k's distribution from (an optional regression target for draft_hidden).
This mirrors the decoding loop: at inference the pivot is the verify pass's state one position
before the anchor, and d_k is accepted iff it equals the target's argmax after d_{k-1}.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.corpus import exact_depth


DENSE_TOP_K = 256  # tokens of the target's distribution kept when it comes as full logits


class TargetTopK(NamedTuple):
    """The target's next-token distribution at every position, as its top-k."""

    ids: torch.Tensor  # [B, L, k] int64, most likely first
    probs: torch.Tensor  # [B, L, k] float32

    @classmethod
    def of_logits(cls, logits: torch.Tensor, k: int = DENSE_TOP_K) -> TargetTopK:
        logits = logits.float()
        top, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)  # no vocabulary-sized softmax is written
        return cls(ids, (top - logits.logsumexp(-1, keepdim=True)).exp())


class DraftExamples(NamedTuple):
    chs: torch.Tensor  # [N, S, H] pivot hidden states
    group: torch.Tensor  # [N, G] int64 tokens ending with the anchor, left-padded with 0
    group_len: torch.Tensor  # [N] int64 G' = min(G, a + 1)
    teacher_tokens: torch.Tensor  # [N, K] int64 t_{a+1..a+K} (0 where invalid)
    labels: torch.Tensor  # [N, K] int64 the target's greedy token for d_k
    target_ids: torch.Tensor  # [N, K, k] int64 the target's top-k tokens for d_k (most likely first)
    target_probs: torch.Tensor  # [N, K, k] float32 their probabilities
    valid: torch.Tensor  # [N, K] bool
    target_final: torch.Tensor | None = None  # [N, K, H] the target's last selected layer where d_k is predicted
    window_states: torch.Tensor | None = None  # [N, W, 3, H] teacher only: layers at a-2, a-3, ..., a-1-W
    window_valid: torch.Tensor | None = None  # [N, W] bool (positions >= 0)


@torch.no_grad()
def target_states(target: TargetAdapter, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [B, L, S, H] (the draft's layers) and logits [B, L, V] at every position, fp32
    whatever the target's dtype (a bf16 copy of the target, for speed, gives fp32 training inputs)."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, L], got {tuple(tokens.shape)}")
    spec = target.spec
    b, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(b, length)
    empty = tokens.new_zeros((spec.num_hidden_layers, b, spec.num_key_value_heads, 0, spec.head_dim),
                             dtype=target.embed_weight.dtype)
    out = target(tokens, positions, empty, empty, tokens.new_zeros(b), positions)
    return out.hidden.float(), out.logits.float()


def draft_examples(tokens: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor | TargetTopK, anchors: torch.Tensor,
                   group_size: int, num_proposals: int, window: int = 0,
                   window_layers: tuple[int, int, int] = (0, 0, 0), exact_only: bool = False) -> DraftExamples:
    """Examples at ``anchors`` [B, A] (positions 1..L-2) of each sequence; N = B * A blocks.

    ``target``: the target's logits [B, L, V] (their top ``DENSE_TOP_K`` are kept) or its
    top-k distribution at every position (``TargetTopK``, e.g. from a state cache).

    ``exact_only``: a label counts only while it is the target's greedy continuation from the
    anchor, i.e. up to and including the first position where the text leaves the target's
    own choice (``corpus.exact_depth``); on the target's own output every label is exact.

    ``window`` > 0 adds the history-aware teacher's inputs: the hidden states of the selected
    layers ``window_layers`` (indices into S) at the W positions before the pivot.
    """
    b, length = tokens.shape
    if anchors.ndim != 2 or anchors.shape[0] != b:
        raise ValueError(f"anchors must be [B={b}, A], got {tuple(anchors.shape)}")
    if anchors.numel() and (anchors.min() < 1 or anchors.max() > length - 2):
        raise ValueError(f"anchors must lie in [1, {length - 2}] for sequences of {length} tokens")
    rows = torch.arange(b, device=tokens.device)[:, None].expand_as(anchors).reshape(-1)  # [N]
    a = anchors.reshape(-1)  # [N]
    k = torch.arange(1, num_proposals + 1, device=tokens.device)  # [K]
    target_pos = a[:, None] + k[None, :] - 1  # [N, K] the target's prediction for d_k is made here
    valid = a[:, None] + k[None, :] < length  # t_{a+k} exists
    safe = target_pos.clamp(max=length - 1)
    if not isinstance(target, TargetTopK):
        target = TargetTopK.of_logits(target)
    if exact_only:
        depth = exact_depth(tokens, target.ids[..., 0], num_proposals)[rows, a]  # [N]
        valid &= k[None, :] <= depth[:, None]
    block_ids, block_probs = target.ids[rows[:, None], safe], target.probs[rows[:, None], safe].float()  # [N, K, k]
    teacher = torch.where(valid, tokens[rows[:, None], (a[:, None] + k[None, :]).clamp(max=length - 1)], 0)
    offsets = torch.arange(group_size - 1, -1, -1, device=tokens.device)  # [G]: a-G+1 .. a
    group_pos = a[:, None] - offsets[None, :]  # [N, G]
    group = torch.where(group_pos >= 0, tokens[rows[:, None], group_pos.clamp_min(0)], 0)
    window_states = window_valid = None
    if window:
        back = a[:, None] - 1 - torch.arange(1, window + 1, device=tokens.device)[None, :]  # [N, W]
        window_valid = back >= 0
        window_states = hidden[rows[:, None], back.clamp_min(0)][:, :, list(window_layers)]  # [N, W, 3, H]
    return DraftExamples(
        window_states=window_states,
        window_valid=window_valid,
        chs=hidden[rows, a - 1],
        group=group,
        group_len=(a + 1).clamp(max=group_size),
        teacher_tokens=teacher,
        labels=block_ids[..., 0],
        target_ids=block_ids,
        target_probs=block_probs,
        valid=valid,
        target_final=hidden[rows[:, None], safe][:, :, -1],
    )
