"""n-gram prompt lookup: proposals from the most recent longest match, kept incrementally; and
lossless through the engine's decode graph and the PyTorch reference (greedy output equals
target-only greedy: batches, uneven rows, multi-turn, stop tokens)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import bigram_draft, draft_config, generator, hf_greedy, near_bigram_target, small_engine

from dlite_trt.errors import DLiteError
from dlite_trt.runtime.prompt_lookup import NgramIndex, PromptLookupConfig, PromptLookupDrafter, stream_prompt_lookup
from dlite_trt.runtime.session import SamplingParams

NEW = 40


def _brute_force(tokens: list[int], cfg: PromptLookupConfig, limit: int) -> list[int]:
    """The definition: the longest suffix n-gram with an earlier occurrence; its most recent one."""
    for n in range(min(cfg.max_ngram, len(tokens)), cfg.min_ngram - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrence tokens[end - n : end], followed by tokens[end]
            if tokens[end - n : end] == suffix:
                return tokens[end : end + limit]
    return []


def test_longest_match_wins_then_most_recent():
    cfg = PromptLookupConfig(max_ngram=3, min_ngram=1)
    # [3, 1, 2] occurs once (followed by 7); [1, 2] occurs later too (followed by 8): longest wins
    assert NgramIndex(cfg).propose([3, 1, 2, 7, 4, 1, 2, 8, 3, 1, 2], 4) == [7, 4, 1, 2]
    # only 2-grams match: the most recent occurrence
    assert NgramIndex(cfg).propose([1, 2, 5, 6, 1, 2, 9, 9, 1, 2], 3) == [9, 9, 1]
    assert NgramIndex(cfg).propose([1, 2, 3], 5) == []
    assert NgramIndex(PromptLookupConfig(max_ngram=3, min_ngram=2)).propose([4, 1, 5, 1], 2) == []  # 1-grams off


def test_incremental_index_equals_the_definition_as_sequences_grow():
    rng = random.Random(0)
    for cfg in (PromptLookupConfig(max_ngram=3, min_ngram=1), PromptLookupConfig(max_ngram=4, min_ngram=2)):
        index, tokens = NgramIndex(cfg), []
        for _ in range(300):
            tokens += [rng.randrange(6) for _ in range(rng.choice((1, 1, 3, 9)))]  # steps and appended turns
            limit = rng.randint(1, 7)
            assert index.propose(tokens, limit) == _brute_force(tokens, cfg, limit), tokens[-8:]


def test_sync_counts_the_context_a_drafter_must_index():
    drafter = PromptLookupDrafter(2)
    assert drafter.sync([[1, 2, 3, 4], [5, 6]]) == 3 + 1  # every token but each sequence's last
    assert drafter.sync([[1, 2, 3, 4, 9, 9], [5, 6]]) == 2
    assert drafter.context_tokens == 6
    assert drafter.state_bytes() > 0


@pytest.mark.parametrize("bad", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(num_tokens=0)])
def test_bad_config(bad):
    with pytest.raises(DLiteError):
        PromptLookupConfig(**bad)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf, spec = near_bigram_target(64, seed=11)
    draft = bigram_draft(hf, draft_config(spec, block_size=8, anchor_group_size=2))
    return hf, generator(hf, spec, draft), small_engine(tmp_path_factory.mktemp("ngram"), hf, draft)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]


def _lookup(session, params, cfg=None):
    drafter = PromptLookupDrafter(session.batch_size, cfg or PromptLookupConfig(min_ngram=1))
    return session._collect(lambda p, timer: stream_prompt_lookup(session, p, drafter, timer), params)


@pytest.mark.parametrize("backend", ["engine", "reference"])
@pytest.mark.parametrize("lengths", [(9,), (3, 17, 30)], ids=["batch1", "batch3"])
def test_greedy_prompt_lookup_is_lossless(case, backend, lengths):
    hf, reference, engine = case
    gen = engine if backend == "engine" else reference
    prompts = _prompts(len(lengths), lengths)
    result = _lookup(gen.session(prompts), SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]
    accepted = [n for s in result.steps for n in s.accepted if n is not None]
    assert max(accepted) >= 2 and min(accepted) == 0  # multi-token acceptance and rejections both ran


def test_multiturn_and_stop_tokens(case):
    hf, _, engine = case
    session = engine.session(_prompts(7, (5, 12)))
    drafter = PromptLookupDrafter(2, PromptLookupConfig(min_ngram=1))
    for turn in (None, _prompts(8, (6, 1)), _prompts(9, (20, 3))):
        if turn is not None:
            session.extend(turn)
        context = [list(t) for t in session.tokens]
        before = drafter.context_tokens
        result = session._collect(lambda p, timer: stream_prompt_lookup(session, p, drafter, timer),
                                  SamplingParams(max_new_tokens=15))
        assert result.output_ids == [hf_greedy(hf, c, 15) for c in context]
        if turn is not None:  # the drafter indexed the appended turn (and the previous answer's tail)
            assert drafter.context_tokens - before >= sum(map(len, turn))
    full = hf_greedy(hf, session.tokens[0], NEW)
    stop = full[7]
    cut = _lookup(session, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
    assert cut.output_ids[0] == full[: full.index(stop) + 1]
    assert cut.stop_reasons[0] == "stop_token"


def test_sampling_is_seeded(case):
    _, _, engine = case
    prompts = _prompts(3, (6, 10))
    params = SamplingParams(max_new_tokens=25, temperature=0.9, seed=5)
    first = _lookup(engine.session(prompts), params).output_ids
    assert first == _lookup(engine.session(prompts), params).output_ids
    assert first != _lookup(engine.session(prompts), SamplingParams(max_new_tokens=25, temperature=0.9,
                                                                    seed=6)).output_ids
