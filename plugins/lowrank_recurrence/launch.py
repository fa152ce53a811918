"""Launch the fused head kernel from PyTorch: the same inputs and outputs as the reference
``model.sequential_head.recurrence`` (tokens, and the logits each was chosen from when asked)."""

from __future__ import annotations

import torch

from dlite_trt.model.sequential_head import HeadWeights
from dlite_trt.runtime.sampling import GREEDY_EPS
from plugins.lowrank_recurrence.aot import DEFAULT_TACTIC, TACTICS, constants
from plugins.lowrank_recurrence.kernel import lowrank_recurrence_kernel


def lowrank_recurrence(w: HeadWeights, draft_hidden: torch.Tensor, anchor: torch.Tensor,
                       seed_prev: torch.Tensor | None, temperature: torch.Tensor, uniforms: torch.Tensor | None,
                       *, write_logits: bool, tactic: int = DEFAULT_TACTIC) -> tuple[torch.Tensor, torch.Tensor | None]:
    """draft_hidden [B, K, H] fp32, anchor / seed_prev [B] int64, temperature [B] fp32, uniforms
    [B, K] fp32 -> tokens [B, K] int64 and, with ``write_logits`` (needed to sample), logits
    [B, K, V] fp32. Rows with temperature <= GREEDY_EPS take the argmax. ``tactic``: one of the
    TensorRT plugin's (``aot.TACTICS``: vocabulary tile and warps); every tactic gives the same tokens."""
    b, k, h = draft_hidden.shape
    v, r = w.prev_token_embedding.shape
    if not write_logits and bool((temperature > GREEDY_EPS).any()):
        raise ValueError("sampling rows need write_logits=True (the sample is drawn from the written logits)")
    dev = draft_hidden.device
    tokens = torch.empty(b, k, dtype=torch.int64, device=dev)
    logits = torch.empty(b, k, v, dtype=torch.float32, device=dev) if write_logits else tokens  # unused pointer
    scratch = torch.empty(b, 2, r, dtype=torch.float32, device=dev)
    u = uniforms if uniforms is not None else torch.zeros(b, k, dtype=torch.float32, device=dev)
    lowrank_recurrence_kernel[(b,)](
        draft_hidden.contiguous(), anchor.contiguous(), (seed_prev if seed_prev is not None else anchor).contiguous(),
        temperature.float().contiguous(), u.float().contiguous(),
        *(t.contiguous() for t in w), k, h, r, v, tokens, logits, scratch,
        **constants(rank=r, seeded=seed_prev is not None, sampling=write_logits, tactic=tactic),
        num_warps=TACTICS[tactic][1])
    return tokens, (logits if write_logits else None)
