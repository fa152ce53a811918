"""Training losses against closed-form values on small hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from dlite_trt.errors import ConfigError
from dlite_trt.model.sequential_head import SequentialHead, recurrence
from dlite_trt.training.losses import (
    LossWeights,
    distillation_loss,
    kl_divergence,
    position_weights,
    target_matching_loss,
    tv_distance,
)


def test_tv_closed_form():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    assert tv_distance(p, q).item() == pytest.approx(0.5)  # 0.5 * (0.25 + 0.25 + 0.5)
    assert tv_distance(p, p).item() == 0.0
    assert tv_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(1.0)


def test_kl_closed_form():
    p, q = [0.5, 0.5], [0.25, 0.75]
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    got = kl_divergence(torch.log(torch.tensor(p)), torch.log(torch.tensor(q)))
    assert got.item() == pytest.approx(want, abs=1e-6)
    assert kl_divergence(torch.tensor([3.0, 1.0]), torch.tensor([3.0, 1.0])).item() == pytest.approx(0.0, abs=1e-7)
    # logits are shift-invariant
    assert kl_divergence(torch.log(torch.tensor(p)) + 7, torch.log(torch.tensor(q)) - 2).item() == \
        pytest.approx(want, abs=1e-6)


def test_position_weights():
    w = position_weights(3, gamma=2.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])


def test_target_matching_loss_closed_form():
    """One block of K=2 positions over V=2, hand-computed."""
    draft = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))  # [1, 2, 2]
    target_probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # the whole distribution (k = V)
    target_ids = torch.tensor([[[0, 1], [0, 1]]])
    labels = torch.tensor([[0, 1]])
    data = torch.tensor([[1, 1]])
    valid = torch.tensor([[True, True]])
    weights = LossWeights(ce=0.1, tv=1.0, base_ce=0.01, gamma=1.0)
    got = target_matching_loss(draft, target_ids, target_probs, labels, data, valid, weights)
    w = [1.0, math.exp(-1.0)]
    mean = lambda a, b: (w[0] * a + w[1] * b) / (w[0] + w[1])  # noqa: E731
    assert got["tv"].item() == pytest.approx(mean(0.5, 0.4), abs=1e-6)
    assert got["ce"].item() == pytest.approx(mean(-math.log(0.5), -math.log(0.1)), abs=1e-5)
    assert got["base_ce"].item() == pytest.approx(mean(-math.log(0.5), -math.log(0.1)), abs=1e-5)
    assert got["loss"].item() == pytest.approx(0.1 * got["ce"].item() + got["tv"].item() + 0.01 * got["base_ce"].item())


def test_invalid_positions_do_not_count():
    draft = torch.randn(2, 3, 5)
    target_probs, target_ids = torch.softmax(torch.randn(2, 3, 5), dim=-1).topk(3, dim=-1)
    labels = torch.randint(0, 5, (2, 3))
    valid = torch.tensor([[True, True, False], [True, False, False]])
    base = target_matching_loss(draft, target_ids, target_probs, labels, labels, valid)["loss"]
    changed = draft.clone()
    changed[0, 2] += 100.0
    changed[1, 1:] -= 50.0
    assert target_matching_loss(changed, target_ids, target_probs, labels, labels, valid)["loss"].item() == pytest.approx(base.item())


def test_distillation_is_zero_at_the_teacher_and_has_gradient():
    teacher = torch.randn(2, 3, 7)
    student = teacher.clone().requires_grad_(True)
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert distillation_loss(student, teacher, valid)["loss"].item() == pytest.approx(0.0, abs=1e-6)
    moved = (teacher + torch.randn_like(teacher)).requires_grad_(True)
    loss = distillation_loss(moved, teacher, valid)["loss"]
    loss.backward()
    assert loss.item() > 0 and moved.grad.abs().sum() > 0


def test_bad_weights():
    with pytest.raises(ConfigError, match="gamma"):
        LossWeights(gamma=0)
    with pytest.raises(ConfigError, match="tv"):
        LossWeights(tv=-1)


def test_teacher_forcing_with_own_tokens_is_free_running():
    """Forcing the head with the tokens it would choose itself changes nothing; forcing others does."""
    torch.manual_seed(0)
    head = SequentialHead(vocab_size=50, rank=16, hidden_size=24).eval()
    hidden, anchor, seed = torch.randn(3, 5, 24), torch.randint(0, 50, (3,)), torch.randint(0, 50, (3,))
    with torch.no_grad():
        free = head(hidden, anchor, seed)
        forced = recurrence(head.weights(), hidden, anchor, seed, teacher_tokens=free.tokens)
        other = recurrence(head.weights(), hidden, anchor, seed, teacher_tokens=(free.tokens + 1) % 50)
    assert torch.equal(forced.logits, free.logits) and torch.equal(forced.tokens, free.tokens)
    assert torch.equal(other.logits[:, 0], free.logits[:, 0])  # step 1 reads the anchor only
    assert not torch.allclose(other.logits[:, 1:], free.logits[:, 1:])
