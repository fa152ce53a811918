"""The target-informed initialisation and the draft_hidden regression term, checked against
what they claim: the whitened factorisation is the best rank-r map on the states (Eckart-Young
in their metric), a draft_hidden equal to the target's final state is read through the head as
the target's LM head reads it, the centred context slots have mean zero, and the regression
term has its closed form and enters stage 2's loss with its weight."""

from __future__ import annotations

import pytest
import torch
from helpers import draft_config, make_target, random_draft

from dlite_trt.errors import ConfigError
from dlite_trt.model.sequential_head import recurrence
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.examples import draft_examples, target_states
from dlite_trt.training.informed_init import informed_init, whitened_factors
from dlite_trt.training.losses import LossWeights, position_weights, state_regression
from dlite_trt.training.stages import stage2_loss


def anisotropic_states(n: int, h: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, h)  # a few directions dominate, as in a real target's states
    return torch.randn(n, h, generator=g) * scales + 0.3


def test_whitened_factors_are_the_best_rank_r_map_on_the_states():
    g = torch.Generator().manual_seed(1)
    w, states = torch.randn(40, 12, generator=g), anisotropic_states(500, 12)
    a, b = whitened_factors(w, states, 12)  # full rank: exact
    torch.testing.assert_close(states @ (a @ b).T, states @ w.T, atol=1e-3, rtol=1e-4)
    for rank in (2, 4, 8):
        a, b = whitened_factors(w, states, rank)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        plain = (u[:, :rank] * s[:rank]) @ vh[:rank]  # the best rank-r map in the plain metric

        def error(m: torch.Tensor) -> float:
            return float((states @ (w - m).T).pow(2).mean())

        assert a.shape == (40, rank) and b.shape == (rank, 12)
        assert error(a @ b) < error(plain)  # better where the states are
        # and no nearby rank-r map does better (a minimum, not just an improvement)
        best = error(a @ b)
        for trial in range(20):
            g.manual_seed(100 + trial)
            da, db = 1e-2 * torch.randn(a.shape, generator=g), 1e-2 * torch.randn(b.shape, generator=g)
            assert error((a + da) @ (b + db)) >= best * (1 - 1e-5)


@pytest.fixture(scope="module")
def setup():
    hf, spec = make_target(64, seed=3, hidden_size=32)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2, sequential_rank=32)  # r = H: exact readout
    target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
    tokens = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))
    hidden, logits = target_states(target, tokens)
    return hf, cfg, tokens, hidden, logits, spec


def test_head_reads_the_targets_final_state_as_its_lm_head_does(setup):
    hf, cfg, tokens, hidden, _, spec = setup
    states = hidden.flatten(0, 1)  # [N, S, H]
    draft = random_draft(cfg)
    informed_init(draft, hf.lm_head.weight, hf.model.norm.weight, None, states)
    final = states[:, -1]
    out = recurrence(draft.sequential_head.weights(), final[:, None], tokens.flatten(), None)
    want = final @ hf.lm_head.weight.T  # the target's own logits at those positions
    torch.testing.assert_close(out.logits[:, 0], want.detach(), atol=2e-3, rtol=1e-3)
    assert (out.logits[:, 0].argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(draft.norm.weight, hf.model.norm.weight)
    # the centred slots: each selected layer's states plus its depth embedding average to zero
    depth = draft.layer_depth_embedding.weight[list(cfg.target_layer_ids)]
    torch.testing.assert_close((states + depth).mean(0), torch.zeros_like(depth), atol=1e-4, rtol=0)


def test_a_rank_below_the_hidden_size_reads_through_the_best_rank_r_map(setup):
    """r < H: the head's readout of the target's final state is the whitened rank-r map, which
    agrees with the LM head's argmax more often than the plain (unwhitened) rank-r SVD does."""
    hf, cfg, tokens, hidden, _, spec = setup
    states = hidden.flatten(0, 1)
    small = draft_config(spec, block_size=4, anchor_group_size=2, sequential_rank=4)
    draft = random_draft(small)
    informed_init(draft, hf.lm_head.weight, hf.model.norm.weight, None, states)
    final, w = states[:, -1], hf.lm_head.weight.detach()
    got = recurrence(draft.sequential_head.weights(), final[:, None], tokens.flatten(), None).logits[:, 0]
    u, sv, vh = torch.linalg.svd(w, full_matrices=False)
    plain = final @ ((u[:, :4] * sv[:4]) @ vh[:4]).T
    want = final @ w.T
    assert ((got - want) ** 2).mean() < ((plain - want) ** 2).mean()


def test_informed_init_refuses_what_it_cannot_use(setup):
    hf, cfg, _, hidden, _, spec = setup
    draft = random_draft(cfg)
    wide = random_draft(draft_config(spec, block_size=4, anchor_group_size=2, sequential_rank=64))
    with pytest.raises(ConfigError, match="exceeds the target's hidden size 32"):
        informed_init(wide, hf.lm_head.weight, hf.model.norm.weight, None, hidden.flatten(0, 1))
    with pytest.raises(ConfigError, match="unknown informed-initialisation parts"):
        informed_init(draft, hf.lm_head.weight, hf.model.norm.weight, None, hidden.flatten(0, 1), ("centre",))
    with pytest.raises(ConfigError, match="states must be"):
        informed_init(draft, hf.lm_head.weight, hf.model.norm.weight, None, hidden.flatten(0, 1)[:, :2])
    with pytest.raises(ConfigError, match="needs the target's decoder layers"):
        informed_init(draft, hf.lm_head.weight, hf.model.norm.weight, None, hidden.flatten(0, 1), ("layers",))


def test_state_regression_closed_form():
    target = torch.tensor([[[3.0, 4.0], [1.0, 1.0]]])  # [N=1, K=2, H=2]
    valid = torch.tensor([[True, True]])
    assert state_regression(target, target, valid).item() == 0.0
    assert state_regression(torch.zeros_like(target), target, valid).item() == pytest.approx(1.0)
    # position 0 off by (1, 0): error 0.5 / 12.5; position 1 exact; weights exp(-k / gamma)
    draft = target + torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    w = position_weights(2, 2.0)
    assert state_regression(draft, target, valid, gamma=2.0).item() == pytest.approx(float(0.04 * w[0] / w.sum()))
    assert state_regression(draft, target, torch.tensor([[False, True]])).item() == 0.0


def test_examples_carry_the_targets_final_state_where_each_proposal_is_predicted(setup):
    _, cfg, tokens, hidden, logits, spec = setup
    anchors = torch.tensor([[1, 10, 21]] * 4)
    ex = draft_examples(tokens, hidden, logits, anchors, cfg.anchor_group_size, cfg.num_proposals)
    for i, (row, a) in enumerate((r, int(a)) for r in range(4) for a in anchors[r]):
        for k in range(cfg.num_proposals):
            if ex.valid[i, k]:  # d_{k+1} is predicted by the target at a + k
                assert torch.equal(ex.target_final[i, k], hidden[row, a + k, -1])


def test_stage2_loss_adds_the_weighted_regression(setup):
    hf, cfg, tokens, hidden, logits, spec = setup
    ex = draft_examples(tokens, hidden, logits, torch.tensor([[2, 8]] * 4), cfg.anchor_group_size, cfg.num_proposals)
    draft = random_draft(cfg)
    embed = hf.model.embed_tokens.weight.detach()
    plain = stage2_loss(draft, ex, embed)
    with_state = stage2_loss(draft, ex, embed, LossWeights(state=0.5))
    assert "state" not in plain
    # the term by hand: draft_hidden against the target's final state, relative squared error,
    # weighted exp(-k / 4) over valid positions
    with torch.no_grad():
        mine = draft.backbone(ex.chs, ex.group, ex.group_len, embed)
        error = ((mine - ex.target_final) ** 2).mean(-1) / (ex.target_final ** 2).mean(-1)
        w = torch.exp(-torch.arange(cfg.num_proposals) / 4.0)[None] * ex.valid
        want = float((error * w).sum() / w.sum())
    assert with_state["state"].item() == pytest.approx(want, rel=1e-5)
    assert with_state["loss"].item() == pytest.approx(plain["loss"].item() + 0.5 * want, rel=1e-5)
