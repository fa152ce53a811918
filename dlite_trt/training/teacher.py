"""The isomorphic history-aware teacher (DESIGN 1.4).

The same backbone and sequential head as the student (a ``DLiteDraft`` of the same config,
so its head can be copied into the student), plus a sliding window of W positions before
the pivot as extra context slots. Each slot is RMSNorm(Linear(3H -> H)) over the target's
first, middle and last selected layers at that position, placed at its true position
relative to the pivot (the draft's local RoPE frame, extended backwards). The teacher sees
history the student never will; the student learns from it in stage 1.
"""

from __future__ import annotations

import torch
from torch import nn

from dlite_trt.config import DraftConfig
from dlite_trt.errors import ConfigError
from dlite_trt.model.draft import DLiteDraft, ExtraContext
from dlite_trt.model.ops import RMSNorm
from dlite_trt.model.sequential_head import HeadOutput, recurrence
from dlite_trt.training.examples import DraftExamples


def window_layers(cfg: DraftConfig) -> tuple[int, int, int]:
    """Indices into the draft's S selected layers: first, middle and last."""
    s = cfg.chs_num_layers
    return 0, s // 2, s - 1


class HistoryAwareTeacher(nn.Module):
    def __init__(self, cfg: DraftConfig, window: int) -> None:
        super().__init__()
        if window < 0:
            raise ConfigError(f"the teacher's window must be >= 0 positions, got {window}")
        self.cfg = cfg
        self.window = window
        self.draft = DLiteDraft(cfg)  # isomorphic: the student's architecture and parameter names
        self.window_proj = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.window_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def window_context(self, ex: DraftExamples) -> ExtraContext | None:
        if self.window == 0:
            return None
        states = ex.window_states  # [N, W, 3, H]
        slots = self.window_norm(self.window_proj(states.flatten(2)))  # [N, W, H]
        pivot_pos = (ex.group_len - 2).clamp_min(0)  # [N] the pivot's local position (as in the backbone)
        back = torch.arange(1, self.window + 1, device=slots.device)  # [W] positions before the pivot
        return ExtraContext(slots, pivot_pos[:, None] - back[None, :], ex.window_valid)

    def forward(self, ex: DraftExamples, embed_weight: torch.Tensor) -> HeadOutput:
        """Teacher-forced block logits [N, K, V] (V_d: over the head's rows) for a batch of examples."""
        hidden = self.draft.backbone(ex.chs, ex.group, ex.group_len, embed_weight, self.window_context(ex))
        return teacher_forced_head(self.draft, hidden, ex)


def teacher_forced_head(draft: DLiteDraft, hidden: torch.Tensor, ex: DraftExamples) -> HeadOutput:
    """The head over draft_hidden [N, K, H], fed the sequence's own tokens: logits [N, K, V] over
    the head's rows (V_d of them with a reduced draft vocabulary: its inputs are mapped to rows,
    a token outside read as the mask token; tokens returned are rows)."""
    head = draft.sequential_head
    seed = head.to_draft(ex.group[:, -2]) if draft.cfg.anchor_group_size > 1 else None
    return recurrence(head.weights(), hidden, head.to_draft(ex.group[:, -1]), seed,
                      teacher_tokens=head.to_draft(ex.teacher_tokens))


def in_head_rows(draft: DLiteDraft, ex: DraftExamples) -> DraftExamples:
    """The examples' target-side ids (the target's top-k, labels, the sequence's tokens) as the
    head's rows, for the losses: with a reduced draft vocabulary a token outside it becomes the
    sentinel V_d (probability 0 for the draft); without one, unchanged."""
    table = draft.sequential_head.target_to_draft  # [V] or None
    if table is None:
        return ex
    return ex._replace(target_ids=table[ex.target_ids], labels=table[ex.labels],
                       teacher_tokens=table[ex.teacher_tokens])


def student_forward(student: DLiteDraft, ex: DraftExamples,
                    embed_weight: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
    """The student's draft_hidden [N, K, H] and teacher-forced block logits (no window: what it
    will see at inference)."""
    hidden = student.backbone(ex.chs, ex.group, ex.group_len, embed_weight)
    return hidden, teacher_forced_head(student, hidden, ex)


def student_logits(student: DLiteDraft, ex: DraftExamples, embed_weight: torch.Tensor) -> HeadOutput:
    """The student's teacher-forced block logits."""
    return student_forward(student, ex, embed_weight)[1]
