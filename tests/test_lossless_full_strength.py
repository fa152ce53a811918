"""Losslessness and draft inputs at full target strength, with controlled proposals.

The target is a plain random Qwen3 (attention at full strength), and proposals are the
target's own greedy continuation with seeded corruptions (see helpers.OracleProposals), so
every acceptance count 0..K occurs. Checks: output == transformers greedy; and every draft
call got the target's hidden states at anchor_pos - 1 (the pivot) and the right token group.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OracleProposals, draft_config, generator, hf_greedy, make_target, random_draft

from dlite_trt.runtime.reference import SamplingParams

NEW = 30


def _prompts(seed, lengths, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _setup(seed, g, block):
    hf, spec = make_target(300, seed=seed, num_hidden_layers=5, hidden_size=96)
    cfg = draft_config(spec, block_size=block, anchor_group_size=g, chs_num_layers=4, sequential_rank=32)
    return hf, generator(hf, spec, random_draft(cfg, seed))


@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("block", [2, 4, 8])
@pytest.mark.parametrize("lengths", [(6,), (1, 12, 4)], ids=["batch1", "batch3"])
def test_greedy_lossless_with_every_acceptance_count(g, block, lengths):
    hf, gen = _setup(g + block, g, block)
    prompts = _prompts(g * block, lengths)
    session = gen.session(prompts)
    oracle = OracleProposals(session, corrupt=0.25, seed=block)
    oracle.expect(hf, NEW)
    result = session.generate(SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]
    accepted = {n for s in result.steps for n in s.accepted if n is not None}
    assert 0 in accepted and block - 1 in accepted  # rejections and full blocks both happened
    assert oracle.check_pivots(hf) >= len(result.steps)


def test_multiturn_full_strength_with_stop_cut_and_uneven_extends():
    hf, gen = _setup(7, 2, 8)
    prompts = _prompts(7, (5, 2, 9))
    session = gen.session(prompts)
    oracle = OracleProposals(session, corrupt=0.15, seed=1)
    context = [list(p) for p in prompts]
    g = torch.Generator().manual_seed(70)
    for turn, (lens, n_new) in enumerate([((0, 0, 0), 20), ((4, 0, 11), 15), ((1, 6, 0), 25)]):
        news = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
        session.extend(news)
        context = [c + n for c, n in zip(context, news)]
        oracle.expect(hf, n_new)
        want = [hf_greedy(hf, c, n_new) for c in context]
        stop = want[0][n_new // 2]  # row 0 stops mid-block (possibly earlier), the others may too
        out = session.generate(SamplingParams(max_new_tokens=n_new, stop_token_ids=(stop,)))
        for row in range(3):
            cut = want[row].index(stop) + 1 if stop in want[row] else n_new
            assert out.output_ids[row] == want[row][:cut], f"turn {turn} row {row}"
            context[row] += out.output_ids[row]
        assert session.tokens == context
    assert oracle.check_pivots(hf) > 0
