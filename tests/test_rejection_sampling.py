"""Speculative rejection sampling: seeded determinism, and the output follows the target's own
sampling distribution (chi-square against exact probabilities from transformers)."""

from __future__ import annotations

import torch
from helpers import draft_config, generator, make_target, random_draft

from dlite_trt.runtime.reference import SamplingParams

V, T = 16, 0.7
PROMPT = [3, 1, 4, 1, 5]


def _setup():
    hf, spec = make_target(V, seed=7, initializer_range=0.3)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2, sequential_rank=32)
    draft = random_draft(cfg, seed=8)
    with torch.no_grad():  # a draft whose q is far from p: many rejections, some acceptances
        draft.sequential_head.output_proj.weight.mul_(8)
    return hf, spec, draft


def test_same_seed_same_output_different_seed_different_output():
    hf, spec, draft = _setup()
    gen = generator(hf, spec, draft)
    prompts = [PROMPT, PROMPT[:2]]

    def run(seed):
        return gen.generate(prompts, SamplingParams(max_new_tokens=30, temperature=T, seed=seed)).output_ids

    assert run(5) == run(5)
    assert run(5) != run(6)


@torch.no_grad()
def _exact_target_distributions(hf, prompt):
    """p(x1, x2) and p(x3) of the target alone at temperature T, by enumeration."""
    def next_probs(seqs):
        return torch.softmax(hf(torch.tensor(seqs)).logits[:, -1].double() / T, -1)

    p1 = next_probs([prompt])[0]  # [V]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [V, V]: p(x2 | x1)
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint12 = p1[:, None] * p2
    return joint12, (joint12[:, :, None] * p3).sum((0, 1))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square; cells with expected count < 5 are pooled."""
    n = counts.sum()
    expected = probs.flatten() * n
    observed = counts.flatten().double()
    small = expected < 5
    exp_cells = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs_cells = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = ((obs_cells - exp_cells) ** 2 / exp_cells.clamp_min(1e-12)).sum()
    df = len(exp_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def test_first_tokens_follow_the_target_distribution():
    """A batch mixing two prompt lengths; x3 comes from the first or the second speculative step."""
    hf, spec, draft = _setup()
    gen = generator(hf, spec, draft)
    prompts = [PROMPT, PROMPT[:2]]
    exact = [_exact_target_distributions(hf, p) for p in prompts]
    c12 = torch.zeros(2, V, V)
    c3 = torch.zeros(2, V)
    first_draft = torch.zeros(2, V, V)  # (x1, d_1) pairs: what the draft alone proposes
    accepted = []
    for seed in range(8):
        res = gen.generate(prompts * 1250, SamplingParams(max_new_tokens=3, temperature=T, seed=seed))
        for row, out in enumerate(res.output_ids):
            c12[row % 2, out[0], out[1]] += 1
            c3[row % 2, out[2]] += 1
            first_draft[row % 2, out[0], res.steps[0].draft_tokens[row][0]] += 1
        accepted += [n for n in res.steps[0].accepted if n is not None]
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # both acceptances and rejections happened
    for i, (joint12, marg3) in enumerate(exact):
        assert _chi_square_p(c12[i], joint12) > 1e-3
        assert _chi_square_p(c3[i], marg3) > 1e-3
        # The test has power: the draft's own proposals (before correction) are clearly rejected.
        assert _chi_square_p(first_draft[i], joint12) < 1e-6
