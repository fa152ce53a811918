"""Draft training examples: what the draft sees at an anchor equals what the decoding loop feeds
it there (checked against transformers' hidden states and logits)."""

from __future__ import annotations

import pytest
import torch
from helpers import draft_config, make_target, random_draft

from dlite_trt.model.sequential_head import recurrence
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.examples import draft_examples, target_states
from dlite_trt.training.losses import target_matching_loss


@pytest.fixture(scope="module")
def setup():
    hf, spec = make_target(64, seed=2)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2)
    target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    return hf, cfg, target, tokens


def test_examples_match_transformers(setup):
    hf, cfg, target, tokens = setup
    hidden, logits = target_states(target, tokens)
    anchors = torch.tensor([[1, 5, 10], [2, 9, 7]])
    ex = draft_examples(tokens, hidden, logits, anchors, cfg.anchor_group_size, cfg.num_proposals)
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
    n_layers = hf.config.num_hidden_layers
    for i, (row, a) in enumerate((r, int(a)) for r in range(2) for a in anchors[r]):
        # layer id l is hidden_states[l + 1]; the last one is after the final norm (DESIGN 1.1)
        want = torch.stack([ref.hidden_states[l + 1][row, a - 1] for l in cfg.target_layer_ids])
        torch.testing.assert_close(ex.chs[i], want, atol=1e-5, rtol=0)  # fp32, one graph vs another
        g = min(cfg.anchor_group_size, a + 1)
        assert ex.group_len[i] == g and ex.group[i, -g:].tolist() == tokens[row, a - g + 1: a + 1].tolist()
        for k in range(cfg.num_proposals):
            if a + k + 1 < tokens.shape[1]:
                assert ex.valid[i, k]
                assert ex.labels[i, k] == ref.logits[row, a + k].argmax()  # exact: greedy label
                assert ex.teacher_tokens[i, k] == tokens[row, a + k + 1]
                want_probs = torch.softmax(ref.logits[row, a + k], dim=-1)
                torch.testing.assert_close(ex.target_probs[i, k], want_probs[ex.target_ids[i, k]], atol=1e-5, rtol=0)
                assert sorted(ex.target_ids[i, k].tolist()) == list(range(64))  # V <= DENSE_TOP_K: all of it
            else:
                assert not ex.valid[i, k]
    assert n_layers - 1 in cfg.target_layer_ids


def test_bad_anchors(setup):
    _, cfg, target, tokens = setup
    hidden, logits = target_states(target, tokens)
    with pytest.raises(ValueError, match="anchors must lie"):
        draft_examples(tokens, hidden, logits, torch.tensor([[0], [3]]), 2, 3)


def test_a_few_steps_lower_the_stage2_loss(setup):
    """Stage 2 (student against the target, CE + TV) on a fixed batch: the loss goes down."""
    _, cfg, target, tokens = setup
    hidden, logits = target_states(target, tokens)
    ex = draft_examples(tokens, hidden, logits, torch.arange(1, 11).expand(2, -1), cfg.anchor_group_size,
                        cfg.num_proposals)
    draft = random_draft(cfg).train()
    embed = target.embed_weight.detach()
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)

    def loss() -> torch.Tensor:
        hid = draft.backbone(ex.chs, ex.group, ex.group_len, embed)  # [N, K, H]
        out = recurrence(draft.sequential_head.weights(), hid, ex.group[:, -1], ex.group[:, -2],
                         teacher_tokens=ex.teacher_tokens)
        return target_matching_loss(out.logits, ex.target_ids, ex.target_probs, ex.labels, ex.teacher_tokens, ex.valid)["loss"]

    first = loss().item()
    for _ in range(20):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
    assert loss().item() < 0.8 * first


def test_teacher_window(setup):
    """W = 0 makes the teacher its inner draft; its window slots are the right positions' states,
    invalid before the sequence start; a few steps lower the teacher's loss."""
    from dlite_trt.training.teacher import HistoryAwareTeacher, student_logits, window_layers

    _, cfg, target, tokens = setup
    hidden, logits = target_states(target, tokens)
    layers = window_layers(cfg)
    ex = draft_examples(tokens, hidden, logits, torch.tensor([[2, 6], [9, 4]]), cfg.anchor_group_size,
                        cfg.num_proposals, window=3, window_layers=layers)
    # example 0 anchors at 2: pivot 1, window positions 0, -1, -2
    assert ex.window_valid[0].tolist() == [True, False, False]
    torch.testing.assert_close(ex.window_states[0, 0], hidden[0, 0, list(layers)], atol=0, rtol=0)
    torch.testing.assert_close(ex.window_states[2, 2], hidden[1, 9 - 1 - 3, list(layers)], atol=0, rtol=0)
    embed = target.embed_weight.detach()
    torch.manual_seed(3)
    plain = HistoryAwareTeacher(cfg, window=0).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ex, embed).logits, student_logits(plain.draft, ex, embed).logits)
    teacher = HistoryAwareTeacher(cfg, window=3).train()
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)

    def loss():
        return target_matching_loss(teacher(ex, embed).logits, ex.target_ids, ex.target_probs, ex.labels,
                                    ex.teacher_tokens, ex.valid)["loss"]

    first = loss().item()
    for _ in range(20):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.8 * first
    assert teacher.window_proj.weight.grad.abs().sum() > 0  # the window is used


def test_stage1_distills_with_the_teachers_frozen_head(setup):
    from dlite_trt.training.stages import adopt_teacher_head, release_head, stage1_loss, stage2_loss
    from dlite_trt.training.teacher import HistoryAwareTeacher, window_layers

    _, cfg, target, tokens = setup
    hidden, logits = target_states(target, tokens)
    ex = draft_examples(tokens, hidden, logits, torch.arange(1, 11).expand(2, -1), cfg.anchor_group_size,
                        cfg.num_proposals, window=3, window_layers=window_layers(cfg))
    embed = target.embed_weight.detach()
    torch.manual_seed(5)
    teacher = HistoryAwareTeacher(cfg, window=3).eval()
    student = random_draft(cfg, seed=6).train()
    adopt_teacher_head(student, teacher)
    head_before = {k: v.clone() for k, v in student.sequential_head.state_dict().items()}
    trainable = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3)
    first = stage1_loss(student, teacher, ex, embed)["loss"].item()
    for _ in range(20):
        opt.zero_grad()
        stage1_loss(student, teacher, ex, embed)["loss"].backward()
        opt.step()
    assert stage1_loss(student, teacher, ex, embed)["loss"].item() < 0.8 * first
    for name, value in student.sequential_head.state_dict().items():  # frozen: bit-identical
        assert torch.equal(value, head_before[name]), name
    release_head(student)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    first = stage2_loss(student, ex, embed)["loss"].item()
    for _ in range(20):
        opt.zero_grad()
        stage2_loss(student, ex, embed)["loss"].backward()
        opt.step()
    assert stage2_loss(student, ex, embed)["loss"].item() < 0.8 * first
    assert not torch.equal(student.sequential_head.output_proj.weight, head_before["output_proj.weight"])
