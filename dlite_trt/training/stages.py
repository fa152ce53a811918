"""The student's two stages (DESIGN 1.4) as loss functions over a batch of examples.

- stage 1 (warm-up): the teacher's sequential head is copied into the student and frozen;
  the student's backbone learns to produce what the teacher's head needs, by KL to the
  teacher's (windowed, history-aware) logits.
- stage 2 (stable): everything is trained against the target with CE + TV
  (``target_matching_loss``). Single-stage training is stage 2 alone.
"""

from __future__ import annotations

import torch

from dlite_trt.model.draft import DLiteDraft
from dlite_trt.training.examples import DraftExamples
from dlite_trt.training.losses import (
    DEFAULT_WEIGHTS,
    LossWeights,
    distillation_loss,
    state_regression,
    target_matching_loss,
)
from dlite_trt.training.teacher import HistoryAwareTeacher, in_head_rows, student_forward, student_logits


def adopt_teacher_head(student: DLiteDraft, teacher: HistoryAwareTeacher) -> None:
    """Stage 1 setup: the teacher's head weights, copied in and frozen."""
    student.sequential_head.load_state_dict(teacher.draft.sequential_head.state_dict())
    student.sequential_head.requires_grad_(False)


def release_head(student: DLiteDraft) -> None:
    """The transition to stage 2: the head trains again."""
    student.sequential_head.requires_grad_(True)


def teacher_loss(teacher: HistoryAwareTeacher, ex: DraftExamples, embed_weight: torch.Tensor,
                 weights: LossWeights = DEFAULT_WEIGHTS) -> dict[str, torch.Tensor]:
    out = teacher(ex, embed_weight)
    rows = in_head_rows(teacher.draft, ex)
    return target_matching_loss(out.logits, rows.target_ids, ex.target_probs, rows.labels, rows.teacher_tokens,
                                ex.valid, weights)


def stage1_loss(student: DLiteDraft, teacher: HistoryAwareTeacher, ex: DraftExamples,
                embed_weight: torch.Tensor, weights: LossWeights = DEFAULT_WEIGHTS) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        teacher_out = teacher(ex, embed_weight)
    out = student_logits(student, ex, embed_weight)
    return distillation_loss(out.logits, teacher_out.logits, ex.valid, weights.gamma)


def stage2_loss(student: DLiteDraft, ex: DraftExamples, embed_weight: torch.Tensor,
                weights: LossWeights = DEFAULT_WEIGHTS) -> dict[str, torch.Tensor]:
    hidden, out = student_forward(student, ex, embed_weight)
    rows = in_head_rows(student, ex)
    terms = target_matching_loss(out.logits, rows.target_ids, ex.target_probs, rows.labels, rows.teacher_tokens,
                                 ex.valid, weights)
    if weights.state:
        terms["state"] = state_regression(hidden, ex.target_final, ex.valid, weights.gamma)
        terms["loss"] = terms["loss"] + weights.state * terms["state"]
    return terms
