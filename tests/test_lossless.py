"""Greedy speculative decoding == target-only greedy decoding (transformers generate), exact, fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import bigram_draft, draft_config, generator, hf_greedy, make_target, near_bigram_target, random_draft

from dlite_trt.runtime.reference import SamplingParams

NEW = 40


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("lengths", [(7,), (2, 13, 5)], ids=["batch1", "batch3"])
def test_greedy_lossless(seed, g, block, lengths):
    """Two drafts per case: a random one (almost never right) and a near-bigram one (often right)."""
    hf, spec = near_bigram_target(64, seed=seed)
    cfg = draft_config(spec, block_size=block, anchor_group_size=g)
    prompts = _prompts(seed, lengths, 64)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    accepted = []
    for draft in (random_draft(cfg, seed), bigram_draft(hf, cfg, seed)):
        result = generator(hf, spec, draft).generate(prompts, SamplingParams(max_new_tokens=NEW))
        assert result.output_ids == want
        accepted += [n for s in result.steps for n in s.accepted if n is not None]
    assert 0 in accepted and max(accepted) >= 2  # rejections and multi-token acceptances both ran


def test_greedy_lossless_plain_random_target():
    """A target whose attention matters at full strength (no bigram structure)."""
    hf, spec = make_target(300, seed=4, num_hidden_layers=5, hidden_size=96)
    cfg = draft_config(spec, block_size=8, anchor_group_size=2, chs_num_layers=4, sequential_rank=64)
    prompts = _prompts(4, (9, 1, 30), 300)  # a one-token prompt: its first group is shorter than G
    result = generator(hf, spec, random_draft(cfg)).generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]


def test_each_sequence_advances_by_its_own_acceptance():
    hf, spec = near_bigram_target(64, seed=1)
    cfg = draft_config(spec, block_size=8)
    prompts = _prompts(1, (3, 9, 6), 64)
    result = generator(hf, spec, bigram_draft(hf, cfg)).generate(prompts, SamplingParams(max_new_tokens=NEW))
    per_row = [result.acceptance_lengths(r) for r in range(3)]
    # the batch's rows took different numbers of steps to reach NEW tokens
    assert len({len(a) for a in per_row}) > 1
    # a step where rows accepted different counts
    assert any(len({n for n in s.accepted if n is not None}) > 1 for s in result.steps)
    for r, lengths in enumerate(per_row):
        assert 1 + sum(lengths) >= NEW and 1 + sum(lengths[:-1]) < NEW


def test_stop_tokens_and_max_new_tokens():
    hf, spec = near_bigram_target(64, seed=0)
    cfg = draft_config(spec, block_size=8)
    gen = generator(hf, spec, bigram_draft(hf, cfg))
    prompts = _prompts(0, (5, 8), 64)
    full = [hf_greedy(hf, p, NEW) for p in prompts]
    stop = full[0][12]  # a token row 0 emits at index 12 (possibly earlier too)
    result = gen.generate(prompts, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
    for row, want in enumerate(full):
        cut = want.index(stop) + 1 if stop in want else NEW
        assert result.output_ids[row] == want[:cut]
        assert result.stop_reasons[row] == ("stop_token" if stop in want else "max_new_tokens")
    for n in (1, 3, 17):
        short = gen.generate(prompts, SamplingParams(max_new_tokens=n))
        assert short.output_ids == [w[:n] for w in full]
    assert gen.generate(prompts, SamplingParams(max_new_tokens=0)).output_ids == [[], []]


def test_stream_yields_the_same_tokens_step_by_step():
    hf, spec = near_bigram_target(64, seed=2)
    gen = generator(hf, spec, bigram_draft(hf, draft_config(spec)))
    prompts = _prompts(2, (4, 6), 64)
    events = list(gen.session(prompts).stream(SamplingParams(max_new_tokens=NEW)))
    assert events[0].record is None and all(len(t) == 1 for t in events[0].new_tokens)  # prefill: the anchor
    streamed = [[t for e in events for t in e.new_tokens[r]] for r in range(2)]
    assert streamed == gen.generate(prompts, SamplingParams(max_new_tokens=NEW)).output_ids


def test_target_only_decoding_equals_transformers_and_mixes_with_speculative_turns():
    hf, spec = make_target(300, seed=5, num_hidden_layers=5, hidden_size=96)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2, chs_num_layers=4, sequential_rank=64)
    gen = generator(hf, spec, random_draft(cfg))
    prompts = _prompts(5, (3, 11), 300)
    session = gen.session(prompts)
    first = session.generate_target_only(SamplingParams(max_new_tokens=12))
    assert first.output_ids == [hf_greedy(hf, p, 12) for p in prompts]
    assert first.steps == [] and "decode" in first.timings
    session.extend([[7, 8], [9]])
    context = [list(t) for t in session.tokens]
    second = session.generate(SamplingParams(max_new_tokens=10))
    assert second.output_ids == [hf_greedy(hf, c, 10) for c in context]
    context = [list(t) for t in session.tokens]
    third = session.generate_target_only(SamplingParams(max_new_tokens=6))
    assert third.output_ids == [hf_greedy(hf, c, 6) for c in context]
