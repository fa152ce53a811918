"""n-gram prompt lookup: proposals from the most recent longest match, kept incrementally; and
lossless through the engine's decode graph and the PyTorch reference (greedy output equals
target-only greedy: batches, uneven rows, multi-turn, stop tokens)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import bigram_draft, draft_config, generator, hf_greedy, near_bigram_target, random_draft, small_engine

from dlite_trt.errors import DLiteError, EngineError
from dlite_trt.runtime.prompt_lookup import NgramIndex, PromptLookupConfig, PromptLookupDrafter, fill_padding
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.runtime.stats import StageTimer

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


def _brute_force_guess(tokens: list[int], limit: int) -> list[int]:
    """The definition of a guess: what followed the most recent earlier occurrence of the last token."""
    for end in range(len(tokens) - 1, 0, -1):  # occurrence tokens[end - 1], followed by tokens[end]
        if tokens[end - 1] == tokens[-1]:
            return tokens[end : end + limit]
    return []


def test_guess_is_the_one_gram_lookup_whatever_the_ngram_sizes():
    rng = random.Random(1)
    index, tokens = NgramIndex(PromptLookupConfig(max_ngram=3, min_ngram=2)), []
    seen_guess_without_proposal = False
    for _ in range(300):
        tokens += [rng.randrange(8) for _ in range(rng.choice((1, 1, 4)))]
        limit = rng.randint(1, 3)
        guess = index.guess(tokens, limit)
        assert guess == _brute_force_guess(tokens, limit), tokens[-6:]
        seen_guess_without_proposal |= bool(guess) and not index.propose(tokens, limit)
    assert seen_guess_without_proposal
    assert NgramIndex(PromptLookupConfig()).guess([4, 1, 5, 1], 2) == [5, 1]


def test_padding_slots_carry_guesses_and_proposals_stay():
    guesses = {0: [7, 8, 9, 6], 2: [5]}

    def guess(row: int, room: int) -> list[int]:
        assert room > 0
        return guesses.get(row, [])[:room]

    # the widest row is 1 + 3 tokens: the others' 3 slots after their last token are computed anyway
    assert fill_padding([[], [1, 2, 3], []], 2, guess) == [[7, 8, 9], [1, 2, 3], [5]]
    assert fill_padding([[], [], []], 2, guess) == [[7], [], [5]]  # a call's floor of 2 rows: room for 1
    assert fill_padding([[], [4]], 1, guess) == [[7], [4]]
    assert fill_padding([[], []], 1, guess) == [[], []]  # one token per row: no padding, no call to guess


def test_sync_counts_the_context_a_drafter_must_index():
    drafter = PromptLookupDrafter(2)
    assert drafter.sync([[1, 2, 3, 4], [5, 6]]) == 3 + 1  # every token but each sequence's last
    assert drafter.sync([[1, 2, 3, 4, 9, 9], [5, 6]]) == 2
    assert drafter.context_tokens == 6
    assert drafter.state_bytes() > 0


def test_the_guess_rate_counts_guesses_against_the_targets_token():
    """``MissRuns.guess_rate``: a sixth before any miss, then the share of misses whose 1-gram guess was
    the target's token (a missing guess is wrong), the prior weighing as two misses."""
    from dlite_trt.runtime.prompt_lookup import GUESS_PRIOR, MissRuns

    runs = MissRuns()
    assert runs.guess_rate() == pytest.approx(1 / 6) == GUESS_PRIOR
    for guess, token in (([5], 5), ([5, 6], 5), ([4], 5), ([], 5)):
        runs.record_guess(guess, token)
    assert (runs.guesses, runs.guesses_right) == (4, 2)
    assert runs.guess_rate() == pytest.approx((2 + 1 / 3) / 6)


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
    return session._collect(lambda p, timer: session.stream_drafted(p, drafter, timer), params)


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


def _recording_guesses(monkeypatch) -> list[tuple[int, list[int]]]:
    """Every guess made from here on, with the length of the sequence it follows."""
    made, guess = [], NgramIndex.guess
    monkeypatch.setattr(NgramIndex, "guess", lambda self, tokens, limit: (
        made.append((len(tokens), guess(self, tokens, limit))), made[-1][1])[1])
    return made


def _recording_graphs(engine, monkeypatch) -> list[str]:
    """The graph of every engine call from here on; a prefill's calls (``EngineSession._prefill``, by
    sessions and the server alike) as "prefill:<graph>"."""
    from dlite_trt.runtime.engine import EngineSession

    calls, infer, prefill, inside = [], engine.runner.infer, EngineSession._prefill, []

    def prefilling(self, graph, feeds, **options):
        inside.append(True)
        try:
            return prefill(self, graph, feeds, **options)
        finally:
            inside.pop()

    monkeypatch.setattr(EngineSession, "_prefill", prefilling)
    monkeypatch.setattr(engine.runner, "infer", lambda graph, *args: (
        calls.append(f"prefill:{graph}" if inside else graph), infer(graph, *args))[1])
    return calls


def _right(made: list[tuple[int, list[int]]], sequence: list[int]) -> list[list[int]]:
    return [g for n, g in made if g and sequence[n] == g[0]]


@pytest.mark.parametrize("backend", ["engine", "reference"])
def test_the_padding_slot_verifies_a_guess(case, backend, monkeypatch):
    """Where the lookup (its default n-gram sizes, 2 and 3) has no match, an engine's decode call still
    computes two rows (MIN_CALL_TOKENS): the second carries the 1-gram guess, and a right guess is
    kept, two tokens from the call. Output: target-only greedy. The reference's calls compute only
    the rows they are fed: at batch 1 it guesses nothing."""
    hf, reference, engine = case
    gen = engine if backend == "engine" else reference
    prompt = _prompts(21, (12,))[0]
    made = _recording_guesses(monkeypatch)
    result = _lookup(gen.session([prompt]), SamplingParams(max_new_tokens=NEW), PromptLookupConfig())
    assert result.output_ids == [hf_greedy(hf, prompt, NEW)]
    if backend == "reference":
        assert made == []
        return
    right = _right(made, prompt + result.output_ids[0])
    assert right and len(right) < len([g for _, g in made if g])  # guesses both right and wrong were verified
    kept = {d[0] for s in result.steps for d, n in zip(s.draft_tokens, s.accepted, strict=True) if n}
    assert all(g[0] in kept for g in right)  # a right guess's token was kept as a draft, not decoded again


def test_the_servers_padding_slot_verifies_a_guess(case, monkeypatch):
    """The same in the OpenAI server's scheduler (`--speculative ngram`): output target-only greedy,
    some guess right, and one decode-graph call fewer per guess kept than tokens emitted."""
    hf, _, engine = case
    prompt = _prompts(21, (12,))[0]
    calls, infer = [], engine.runner.infer
    monkeypatch.setattr(engine.runner, "infer", lambda graph, *args: (calls.append(graph), infer(graph, *args))[1])
    made = _recording_guesses(monkeypatch)
    tokens = _served(engine, prompt, speculative="ngram")
    assert tokens == hf_greedy(hf, prompt, NEW)
    assert _right(made, prompt + tokens) and calls.count("decode") < NEW - 1


def test_multiturn_and_stop_tokens(case):
    hf, _, engine = case
    session = engine.session(_prompts(7, (5, 12)))
    drafter = PromptLookupDrafter(2, PromptLookupConfig(min_ngram=1))
    for turn in (None, _prompts(8, (6, 1)), _prompts(9, (20, 3))):
        if turn is not None:
            session.extend(turn)
        context = [list(t) for t in session.tokens]
        before = drafter.context_tokens
        result = session._collect(lambda p, timer: session.stream_drafted(p, drafter, timer),
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


@torch.no_grad()
def _exact_marginals(hf, prompt: list[int], temperature: float, vocab: int) -> list[torch.Tensor]:
    """The target's own distribution of the 2nd and 3rd sampled tokens (summed over the earlier ones)."""
    def probs(seqs: torch.Tensor) -> torch.Tensor:
        return torch.softmax(hf(seqs).logits[:, -1].double() / temperature, dim=-1)

    base = torch.tensor([prompt])
    p1 = probs(base)[0]  # [V]
    ones = base.expand(vocab, -1)
    p2 = probs(torch.cat([ones, torch.arange(vocab)[:, None]], dim=1))  # [V(t1), V(t2)]
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (t1, t2) row-major
    p3 = torch.cat([probs(torch.cat([base.expand(len(chunk), -1), chunk], dim=1))
                    for chunk in pairs.split(1024)]).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return [joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))]


def test_sampling_follows_the_targets_distribution(case):
    """Rejection against a one-hot draft: the 2nd and 3rd tokens' frequencies over 3000 seeded rows
    match the target's exact marginals, within what sampling noise alone gives (its 99th
    percentile over 200 simulated draws of 3000 from the exact distribution, plus 20%)."""
    hf, reference, _ = case
    temperature, vocab, rows = 0.25, 64, 3000
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()
    prompt = perm + hf_greedy(hf, perm, 30)  # the greedy chain gives lookup matches the target often accepts
    result = _lookup(reference.session([prompt] * rows),
                     SamplingParams(max_new_tokens=3, temperature=temperature, seed=0))
    accepted = [n for s in result.steps for n in s.accepted if n is not None]
    assert sum(n > 0 for n in accepted) > rows // 5 and accepted.count(0) > rows // 5  # both paths ran
    g = torch.Generator().manual_seed(1)
    for position, exact in zip((1, 2), _exact_marginals(hf, prompt, temperature, vocab), strict=True):
        def tv(samples: torch.Tensor, exact=exact) -> float:
            return 0.5 * (torch.bincount(samples, minlength=vocab).double() / rows - exact).abs().sum().item()

        noise = sorted(tv(torch.multinomial(exact, rows, replacement=True, generator=g)) for _ in range(200))
        got = tv(torch.tensor([out[position] for out in result.output_ids]))
        assert got < 1.2 * noise[197], (position, got, noise[197])


@pytest.fixture(scope="module")
def weak_draft_case(tmp_path_factory):
    """A random draft (its proposals are almost never accepted) on the near-bigram target."""
    hf, spec = near_bigram_target(64, seed=12)
    draft = random_draft(draft_config(spec, block_size=8, anchor_group_size=2))
    return hf, small_engine(tmp_path_factory.mktemp("dlite_ngram"), hf, draft)


@pytest.mark.parametrize("verify_drafts", [2, 7])
def test_dlite_with_lookup_is_lossless_and_uses_the_lookup(weak_draft_case, verify_drafts, monkeypatch):
    """DLite's step verifying n-gram proposals where the lookup matches: greedy output equals
    target-only (batch of uneven rows, at a narrow and the full width), and the lookup's proposals
    are what gets accepted (the random draft alone keeps almost nothing). Steps where every row
    has a proposal run the target alone (the ``decode`` graph): the draft is skipped, and counted."""
    from dlite_trt.runtime.engine import EngineGenerator

    hf, engine = weak_draft_case
    gen = EngineGenerator(engine.runner, engine.manifest, verify_drafts)
    prompts = [_prompts(3, (5,))[0] * 4, _prompts(4, (2,))[0], _prompts(5, (9,))[0] * 3]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW)
    alone = gen.generate(prompts, params)
    session = gen.session(prompts)
    drafter = PromptLookupDrafter(3, PromptLookupConfig(min_ngram=1))
    graphs = _recording_graphs(engine, monkeypatch)
    looked = session._collect(lambda p, timer: session.stream(p, timer, lookup=drafter), params)
    assert alone.output_ids == want and looked.output_ids == want
    per_step = [g for g in graphs if not g.startswith("prefill:")]
    assert len(per_step) == len(looked.steps) and {"step", "decode"} <= set(per_step)  # one call per step, both kinds
    running = [sum(d is not None for d in s.draft_tokens) for s in looked.steps]
    assert session.skipped_drafts == sum(n for n, g in zip(running, per_step, strict=True) if g == "decode")
    kept = [n for s in looked.steps for n in s.accepted if n is not None]
    assert max(kept) >= 3 and len(looked.steps) < len(alone.steps)
    if verify_drafts < 7:  # a lookup proposal longer than the width widened the block
        assert any(len(d) > verify_drafts for s in looked.steps for d in s.draft_tokens if d)
    with pytest.raises(EngineError, match="greedily"):
        next(gen.session(prompts).stream(SamplingParams(max_new_tokens=4, temperature=0.7), lookup=drafter))


def _unsettled_prompt(hf) -> list[int]:
    """A prompt holding the target's own greedy continuation with every fourth token changed: the
    lookup (the server's n-gram sizes) matches, misses and matches again, so steps of both kinds
    follow each other."""
    start = _prompts(2, (6,))[0]
    chain = hf_greedy(hf, start, 40)
    return start + [t if i % 4 != 3 else (t + 7) % 64 for i, t in enumerate(chain)] + start


def _recording_steps(engine, monkeypatch) -> list[tuple[str, object]]:
    """Every engine call from here on: its graph, and a step call's block and past_len."""
    calls, infer = [], engine.runner.infer
    monkeypatch.setattr(engine.runner, "infer", lambda graph, feeds, cache: (calls.append(
        (graph, (feeds["block"].copy(), feeds["past_len"].copy()) if graph == "step" else None)),
        infer(graph, feeds, cache))[1])
    return calls


def _check_steps_after_a_skip(calls, made: list[tuple[int, list[int]]], k: int, sequence: list[int]) -> int:
    """Of one request's calls: a step call right after a decode-graph step verifies [anchor, the
    lookup's guess] (0 where it has none; at batch 1 such a step runs only at a lookup miss), a step
    call after a step call the set width. Returns how many of those guesses were right."""
    from dlite_trt.runtime.engine import UNDRAFTED_WIDTH

    guesses = dict(made)  # sequence length -> the guess made after it
    pairs = list(zip(calls, calls[1:]))
    after_skip = [fed for (before, _), (graph, fed) in pairs if before == "decode" and graph == "step"]
    after_step = [fed for (before, _), (graph, fed) in pairs if before != "decode" and graph == "step"]
    assert after_skip and {block.shape[1] for block, _ in after_skip} == {UNDRAFTED_WIDTH}
    assert after_step and {block.shape[1] for block, _ in after_step} == {k + 1}
    fed = [(int(block[0, 1]), guesses.get(int(past[0]) + 1, [])) for block, past in after_skip]
    assert all(token == (guess[0] if guess else 0) for token, guess in fed), fed
    return sum(bool(guess) and sequence[int(past[0]) + 1] == guess[0]
               for (_, past), (_, guess) in zip(after_skip, fed, strict=True))


def _guessing_prompts(hf) -> list[list[int]]:
    """Prompts whose greedy continuation hits the lookup, then misses: ``_unsettled_prompt``, and random
    tokens (chosen) where a step after a skip has a right guess."""
    return [_unsettled_prompt(hf), _prompts(2, (24,))[0]]


def test_a_step_after_a_skipped_draft_verifies_the_narrowest_block(weak_draft_case, monkeypatch):
    """After a step that verified lookup proposals on the decode graph (the draft did not run), the
    block holds no drafts made from its anchor: the next step call verifies [anchor, the lookup's
    1-gram guess] alone and drafts again, and a step call after a step call verifies the set width.
    A right guess there is kept. Output: target-only greedy."""
    from dlite_trt.runtime.engine import EngineGenerator

    hf, engine = weak_draft_case
    k = 5
    gen = EngineGenerator(engine.runner, engine.manifest, k)
    right = 0
    for prompt in _guessing_prompts(hf):
        calls = _recording_steps(engine, monkeypatch)
        made = _recording_guesses(monkeypatch)
        session = gen.session([prompt])
        drafter = PromptLookupDrafter(1, PromptLookupConfig(num_tokens=engine.cfg.num_proposals))  # as the server's
        result = session._collect(lambda p, timer, s=session, d=drafter: s.stream(p, timer, lookup=d),
                                  SamplingParams(max_new_tokens=NEW))
        assert result.output_ids == [hf_greedy(hf, prompt, NEW)]
        right += _check_steps_after_a_skip(calls, made, k, prompt + result.output_ids[0])
        monkeypatch.undo()
    assert right, "no step call after a skipped draft kept a right guess"


def test_the_servers_step_after_a_skipped_draft_verifies_the_narrowest_block(weak_draft_case, monkeypatch):
    """The same in the OpenAI server's scheduler (`--speculative dlite-ngram`, one request at a time):
    a step call right after a decode-graph step verifies [anchor, the guess] alone, one after a step
    call the calibrated width (here fixed at 5); the tokens are target-only greedy's."""
    from dlite_trt.runtime.engine import EngineGenerator

    hf, engine = weak_draft_case
    k = 5
    right = 0
    for prompt in _guessing_prompts(hf):
        calls = _recording_steps(engine, monkeypatch)
        made = _recording_guesses(monkeypatch)
        tokens = _served(EngineGenerator(engine.runner, engine.manifest, k), prompt)
        assert tokens == hf_greedy(hf, prompt, NEW)
        right += _check_steps_after_a_skip(calls, made, k, prompt + tokens)
        monkeypatch.undo()
    assert right, "no step call after a skipped draft kept a right guess"


def _served(gen, prompt: list[int], misses=None, speculative: str = "dlite-ngram", **scheduler) -> list[int]:
    """The tokens of one greedy request through the OpenAI server's scheduler (`--speculative dlite-ngram`
    unless given), its lookup's miss counts starting from ``misses`` where given."""
    import queue

    from dlite_trt.serve.scheduler import Scheduler

    sched = Scheduler(gen, speculative=speculative, **scheduler)
    if misses is not None:
        sched.calls.misses = misses
    sched.start()
    updates: queue.Queue = queue.Queue()
    try:
        sched.submit(prompt, SamplingParams(max_new_tokens=NEW), updates.put)
        tokens = []
        while True:
            update = updates.get(timeout=120)
            assert update.error is None, update.error
            tokens += update.tokens
            if update.finish_reason:
                return tokens
    finally:
        sched.stop()


# when drafting for the next step pays: a calibrated table (batch 1, 256 cached tokens) under which a drafted step
# gains a lot or nothing, and the lookup's miss counts to start from (a thousand steps after a hit and after a miss)
POLICIES = {"never": (0.02, 0.5, 0.5), "after a miss": (0.9, 0.01, 0.9), "always": (0.9, 0.9, 0.9)}


def _policy(most: int, policy: str):
    from dlite_trt.runtime import verify_width
    from dlite_trt.runtime.prompt_lookup import MissRuns

    accept, after_hit, after_miss = POLICIES[policy]
    costs = {w: 1.1 + 0.05 * w for w in range(1, most + 1)}  # a decode call costs 1.0
    table = verify_width.choose(costs, [accept] * most, decode_ms=1.0, context_ms={256: (costs, 1.0)})
    return table, MissRuns(1000, int(1000 * after_miss), 1000, int(1000 * after_hit))


def _check_policy(policy: str, calls: list[str], skipped: int) -> None:
    """Never: no step call follows a decode-graph step (a miss there decodes); after a miss: one does,
    and steps where the lookup proposes still skip the draft; always: no step skips the draft. Every
    decode-graph step counts the draft as skipped. The prefill drafts the first block (its last chunk
    on the prefill graph) only where drafting at a hit pays (always); else it runs target-only's
    decode graph; the chunks before the last run the decode graph either way (no draft)."""
    prefills = [g for g in calls if g.startswith("prefill:")]
    assert len(prefills) > 1 and set(prefills[:-1]) == {"prefill:decode"}, prefills  # the prompt spans chunks
    assert prefills[-1] == ("prefill:prefill" if policy == "always" else "prefill:decode"), prefills
    per_step = [g for g in calls if not g.startswith("prefill:")]
    step_after_decode = any(a == "decode" and b == "step" for a, b in zip(per_step, per_step[1:]))
    assert step_after_decode == (policy == "after a miss"), per_step
    assert ("decode" in per_step) == (policy != "always"), per_step
    assert skipped == per_step.count("decode")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_dlite_ngram_drafts_for_the_next_step_only_where_it_pays(weak_draft_case, monkeypatch, policy):
    """Whether a DLite + n-gram step drafts for the next one, under calibrated tables where a drafted
    step gains nothing, or a lot with the lookup rarely missing after a hit (drafting pays at a miss
    only), or often (it pays at every step). Output: target-only greedy each time."""
    from dlite_trt.runtime.engine import EngineGenerator

    hf, engine = weak_draft_case
    most = engine.cfg.num_proposals
    table, misses = _policy(most, policy)
    missed_before = misses.repeated + misses.missed_after_hit
    gen = EngineGenerator(engine.runner, engine.manifest, 3, widths=table)
    prompt = _unsettled_prompt(hf)
    calls = _recording_graphs(engine, monkeypatch)
    session = gen.session([prompt])
    drafter = PromptLookupDrafter(1, PromptLookupConfig(num_tokens=most))
    drafter.misses = misses
    result = session._collect(lambda p, timer: session.stream(p, timer, lookup=drafter), SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, prompt, NEW)]
    assert misses.after_miss > 1000 and misses.after_hit > 1000  # both kinds of step were counted
    # every miss's 1-gram guess was checked against the target's token, drafted or not
    assert misses.guesses == misses.repeated + misses.missed_after_hit - missed_before > 0
    _check_policy(policy, calls, session.skipped_drafts)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_server_drafts_for_the_next_step_only_where_it_pays(weak_draft_case, monkeypatch, policy):
    """The same rule in the OpenAI server's scheduler (`--speculative dlite-ngram`), its skipped drafts
    read from the server's metrics."""
    from dlite_trt.runtime.engine import EngineGenerator
    from dlite_trt.serve.metrics import ServerMetrics

    hf, engine = weak_draft_case
    most = engine.cfg.num_proposals
    table, misses = _policy(most, policy)
    missed_before = misses.repeated + misses.missed_after_hit
    prompt = _unsettled_prompt(hf)
    calls = _recording_graphs(engine, monkeypatch)
    metrics = ServerMetrics(most)
    gen = EngineGenerator(engine.runner, engine.manifest, 3, widths=table)
    assert _served(gen, prompt, misses, metrics=metrics) == hf_greedy(hf, prompt, NEW)
    assert misses.after_miss > 1000 and misses.after_hit > 1000
    assert misses.guesses == misses.repeated + misses.missed_after_hit - missed_before > 0  # every miss's guess
    _check_policy(policy, calls, metrics.registry.get_sample_value("dlite_draft_skipped_total"))


def test_the_bench_shares_dlite_ngrams_lookup_statistics_within_a_workload(weak_draft_case):
    """`dlite-trt bench` runs each request in its own session; DLite + n-gram's lookup statistics
    (``MissRuns``: where its draft runs) carry over between the requests of one workload, as the
    server keeps them over its requests, and start afresh for another workload."""
    from dlite_trt.bench.methods import Method
    from dlite_trt.runtime.engine import EngineGenerator

    hf, engine = weak_draft_case
    gen = EngineGenerator(engine.runner, engine.manifest, 3)
    method = Method("dlite-ngram", gen)
    prompt = _unsettled_prompt(hf)
    first, second, other = (method.start([prompt], w) for w in ("agentic", "agentic", "chat"))
    assert first.drafter.misses is second.drafter.misses
    assert other.drafter.misses is not first.drafter.misses
    before = first.drafter.misses.after_hit + first.drafter.misses.after_miss
    stream = first.stream(SamplingParams(max_new_tokens=NEW), StageTimer())
    tokens = [t for event in stream for t in event.new_tokens[0]]
    assert tokens == hf_greedy(hf, prompt, NEW)
    assert second.drafter.misses.after_hit + second.drafter.misses.after_miss > before
    assert other.drafter.misses.after_hit + other.drafter.misses.after_miss == 0


def test_the_servers_dlite_prefill_runs_its_leading_chunks_on_the_decode_graph(weak_draft_case, monkeypatch):
    """The server preloads the decode graph: plain DLite's prefill (`--speculative dlite`) runs a
    prompt's chunks before the last there, without the draft (only the last chunk's drafts serve).
    Output: target-only greedy."""
    from dlite_trt.runtime.engine import open_engine

    hf, engine = weak_draft_case
    gen = open_engine(engine.runner.engine_dir, preload=("prefill", "step", "decode"))
    calls = _recording_graphs(gen, monkeypatch)
    prompt = _prompts(31, (21,))[0]  # three chunks of at most 8
    assert _served(gen, prompt, speculative="dlite") == hf_greedy(hf, prompt, NEW)
    assert [g for g in calls if g.startswith("prefill:")] == ["prefill:decode", "prefill:decode", "prefill:prefill"]
