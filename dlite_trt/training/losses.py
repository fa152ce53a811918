"""DLite's training losses (DESIGN 1.4), as pure functions of logits.

Shapes: a batch of N draft blocks, K positions each, vocabulary V. ``draft_logits`` [N, K, V];
``target_ids`` / ``target_probs`` [N, K, k] the top-k of the target's distribution at the same
K positions (what the draft must match); ``labels`` [N, K] int64 the target's greedy tokens there; ``valid`` [N, K]
bool (positions past the end of a sequence do not count). Every reduction is a weighted mean
over valid positions with the per-position weight exp(-k / gamma), k = 0..K-1: early
positions matter more, since a block is accepted only up to its first miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlite_trt.errors import ConfigError


@dataclass(frozen=True)
class LossWeights:
    """The teacher / stage-2 objective: ce * CE(labels) + tv * TV(draft, target) + base_ce * CE(data)
    (+ state * the draft_hidden regression, ``state_regression``; off in DLite's recipe)."""

    ce: float = 0.1
    tv: float = 1.0
    base_ce: float = 0.01  # "small base CE" on the sequence's own next tokens
    gamma: float = 4.0  # position weights exp(-k / gamma)
    state: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ce", "tv", "base_ce", "state"):
            if getattr(self, name) < 0:
                raise ConfigError(f"loss weight {name} must be >= 0, got {getattr(self, name)}")
        if not self.gamma > 0:
            raise ConfigError(f"gamma must be > 0, got {self.gamma}")


DEFAULT_WEIGHTS = LossWeights()


def position_weights(num_positions: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[K] weights exp(-k / gamma) for k = 0..K-1."""
    return torch.exp(-torch.arange(num_positions, dtype=torch.float32, device=device) / gamma)


def _weighted_mean(per_position: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Mean of per_position [N, K] over valid positions, weighted by exp(-k / gamma)."""
    weights = position_weights(per_position.shape[1], gamma, per_position.device)[None, :] * valid.float()
    total = weights.sum()
    if total <= 0:
        raise ValueError("no valid positions in the batch")
    return (per_position * weights).sum() / total


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance 0.5 * sum |p - q| over the last dim: [..., V] -> [...]."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the last dim, from logits: [..., V] -> [...]."""
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position CE: logits [N, K, V], labels [N, K] -> [N, K]."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def target_matching_loss(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor,
                         labels: torch.Tensor, data_labels: torch.Tensor, valid: torch.Tensor,
                         weights: LossWeights = DEFAULT_WEIGHTS) -> dict[str, torch.Tensor]:
    """The teacher's and stage 2's loss. Returns the total and each term (weighted means).

    The target's distribution comes as its top-k: ``target_ids`` / ``target_probs`` [N, K, k].
    TV is taken over those k tokens plus one bucket for all others (the rest of each
    distribution's mass): exact when k covers the target's support, a lower bound otherwise.

    With a reduced draft vocabulary the logits have V_d columns and ids are the head's rows,
    the sentinel V_d standing for a token outside it: the draft gives such a token probability
    0 (its target mass still counts in TV), and CE skips such labels.
    """
    columns = draft_logits.shape[-1]
    log_q = F.log_softmax(draft_logits.float(), dim=-1)  # [N, K, V]: the one vocabulary-sized pass
    padded = F.pad(log_q, (0, 1), value=float("-inf"))  # [N, K, V + 1]: the sentinel's column, q = 0
    q_top = padded.gather(-1, target_ids).exp()  # [N, K, k]
    p_top = target_probs.float()
    q_rest = (1.0 - q_top.sum(-1, keepdim=True)).clamp_min(0.0)
    p_rest = (1.0 - p_top.sum(-1, keepdim=True)).clamp_min(0.0)
    tv = tv_distance(torch.cat([q_top, q_rest], dim=-1), torch.cat([p_top, p_rest], dim=-1))

    def nll(ids: torch.Tensor) -> torch.Tensor:  # [N, K] -> weighted mean over labels the draft can name
        named = ids < columns
        per = -log_q.gather(-1, ids.clamp(max=columns - 1)[..., None])[..., 0]
        return _weighted_mean(torch.where(named, per, 0.0), valid & named, weights.gamma)

    terms = {"ce": nll(labels), "tv": _weighted_mean(tv, valid, weights.gamma), "base_ce": nll(data_labels)}
    terms["loss"] = weights.ce * terms["ce"] + weights.tv * terms["tv"] + weights.base_ce * terms["base_ce"]
    return terms


def state_regression(draft_hidden: torch.Tensor, target_final: torch.Tensor, valid: torch.Tensor,
                     gamma: float = LossWeights.gamma) -> torch.Tensor:
    """The draft's hidden state [N, K, H] against the target's final state where d_k is predicted
    (EAGLE's feature regression): the squared error relative to the target state's mean square,
    position-weighted. A dense signal beside the distribution's, read through the same head."""
    target = target_final.float()
    error = (draft_hidden.float() - target).pow(2).mean(-1) / target.pow(2).mean(-1).clamp_min(1e-6)
    return _weighted_mean(error, valid, gamma)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor,
                      gamma: float = LossWeights.gamma) -> dict[str, torch.Tensor]:
    """Stage 1 (warm-up): KL(teacher || student), position-weighted."""
    kl = _weighted_mean(kl_divergence(teacher_logits.detach(), student_logits), valid, gamma)
    return {"kl": kl, "loss": kl}
