"""Token choice and speculative verification, as pure functions of explicit random numbers.

Random numbers are inputs (uniforms in [0, 1)), never drawn inside, so the same function
gives the same tokens in the reference, in an exported graph and in a plugin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlite_trt.model.ops import reshape

GREEDY_EPS = 1e-5  # temperatures at or below this are greedy


def is_greedy(temperature: float) -> bool:
    return temperature <= GREEDY_EPS


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32, [..., V]."""
    return torch.softmax(logits.float() / temperature, dim=-1)


SAMPLE_BLOCK = 256  # the inverse CDF's first level: sums of this many consecutive probabilities


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: probs [..., V] (need not be normalised), u [...] in [0, 1) -> ids [...].

    The id is the first whose CDF entry is above u * total, found in two levels so that no op runs
    a scan over the whole vocabulary (a cumsum over V is one thread's sequential pass in ONNX
    Runtime, and every greedy call of a graph computes this branch too): the CDF of the sums of
    ``SAMPLE_BLOCK`` consecutive probabilities picks the block (the number of its entries <= the
    target), then the CDF inside that block, from the sum of the blocks before it, picks the id.
    Written with cumsum/compare/sum/gather so that it exports to ONNX (no searchsorted there).
    """
    v, lead = probs.shape[-1], (0,) * (probs.ndim - 1)  # lead: ONNX Reshape's "copy this dim", static ranks
    blocks = reshape(F.pad(probs, (0, -v % SAMPLE_BLOCK)), (*lead, -1, SAMPLE_BLOCK))  # [..., V/B, B], zeros padded
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [..., V/B]
    target = u.to(block_cdf.dtype).unsqueeze(-1) * block_cdf[..., -1:]  # [..., 1]
    block = (block_cdf <= target).sum(dim=-1).clamp(max=block_cdf.shape[-1] - 1)  # [...]
    before = block_cdf.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1)) * (block > 0).unsqueeze(-1)  # [..., 1]
    rows = block[..., None, None] + torch.zeros_like(blocks[..., :1, :], dtype=torch.int64)  # [..., 1, B]
    inside = blocks.gather(-2, rows)[..., 0, :]  # [..., B], the chosen block ([..., 0, :], not squeeze: no If in ONNX)
    idx = (before + inside.cumsum(dim=-1) <= target).sum(dim=-1).clamp(max=SAMPLE_BLOCK - 1)
    return (block * SAMPLE_BLOCK + idx).clamp(max=v - 1)


def sample_from_logits(logits: torch.Tensor, temperature: float | torch.Tensor,
                       u: torch.Tensor | None) -> torch.Tensor:
    """argmax when greedy, else a sample from softmax(logits / T) with uniforms u [...].

    ``temperature`` is a float for the whole batch, or a tensor [B] (one per sequence, as the
    engine graphs take it): rows at or below GREEDY_EPS take the argmax, the others sample.
    """
    if isinstance(temperature, torch.Tensor):
        return _choose_per_row(logits, temperature, u)
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    if u is None:
        raise ValueError("sampling with temperature > 0 needs uniform random numbers")
    return sample_categorical(probs_from_logits(logits, temperature), u)


def row_temperature(temperature: torch.Tensor, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """temperature [B] -> (greedy, safe T), both shaped [B, 1, ...] to broadcast over ``ndim`` dims.

    Greedy rows get T = 1 so that the (unused) sampled branch stays finite.
    """
    t = temperature.float().reshape(temperature.shape + (1,) * (ndim - 1))
    greedy = t <= GREEDY_EPS
    return greedy, torch.where(greedy, torch.ones_like(t), t)


def _choose_per_row(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    if u is None:
        raise ValueError("per-sequence temperatures need uniform random numbers (unused by greedy rows)")
    greedy, safe_t = row_temperature(temperature, logits.ndim - 1)  # [B, 1..] over the token dims
    sampled = sample_categorical(torch.softmax(logits.float() / safe_t.unsqueeze(-1), dim=-1), u)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row: mask [B, K] bool -> [B] int64.

    The running count equals index + 1 exactly along the leading run (CumSum + Equal,
    which export to ONNX and TensorRT; cumprod does not).
    """
    ones_so_far = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.long().cumsum(dim=1) == ones_so_far).long().sum(dim=1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of one block per sequence.

    draft_tokens [B, K]; target_logits [B, K+1, V] for [anchor, d_1..d_K].
    Returns n [B] (leading i with d_i == argmax of the logits before it) and the next
    anchor [B] = posterior[n].
    """
    posterior = target_logits.argmax(dim=-1)  # [B, K+1]
    n = leading_true(draft_tokens == posterior[:, :-1])  # [B]
    next_token = posterior.gather(1, n[:, None])[:, 0]  # [:, 0], not squeeze: no If in ONNX
    return n, next_token


def rejection_accept(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V] q, the distributions the drafts were sampled from
    target_probs: torch.Tensor,  # [B, K+1, V] p
    u_accept: torch.Tensor,  # [B, K] uniforms for the accept tests
    u_resample: torch.Tensor,  # [B] uniform for the correction / bonus sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (lossless in distribution).

    Accept d_i while u_i < min(1, p(d_i) / q(d_i)); at the first rejection n, sample the
    next token from norm(max(p_n - q_n, 0)); if all K are accepted, from p_K (the bonus).
    """
    b, k = draft_tokens.shape
    p_tok = target_probs[:, :k].gather(2, draft_tokens[:, :, None])[:, :, 0]  # [B, K]
    q_tok = draft_probs.gather(2, draft_tokens[:, :, None])[:, :, 0]  # [B, K]
    accept = u_accept * q_tok < p_tok  # u < p/q without dividing by q
    n = leading_true(accept)  # [B]
    p_n = target_probs.gather(1, n[:, None, None].expand(b, 1, target_probs.shape[-1]))[:, 0]  # [B, V]
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # q_K := 0
    q_n = q_padded.gather(1, n[:, None, None].expand(b, 1, q_padded.shape[-1]))[:, 0]
    residual = (p_n - q_n).clamp_min(0.0)
    # p == q at a rejected position has zero residual mass; it cannot be rejected then, but
    # guard against rounding by falling back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    return n, sample_categorical(residual, u_resample)
