"""The verify width: the choice is exact on constructed costs and acceptance curves, and a greedy
step that verifies k < K drafts is lossless at every k. Tiers: arithmetic exact; token ids exact."""

from __future__ import annotations

import json
import random

import pytest
from helpers import (
    bigram_draft,
    draft_config,
    hf_greedy,
    near_bigram_target,
    small_engine,
)

from dlite_trt.errors import DLiteError, EngineError
from dlite_trt.runtime import verify_width
from dlite_trt.runtime.engine import EngineGenerator, open_engine
from dlite_trt.runtime.session import SamplingParams

NEW = 40


def test_expected_tokens_equal_the_mean_of_truncated_steps():
    """E[1 + min(n, k)] over observed full-width counts n equals 1 + sum_{i<=k} P(n >= i), at every k."""
    rng = random.Random(0)
    counts = [min(int(rng.expovariate(0.6)), 7) for _ in range(500)]
    curve = verify_width.acceptance_curve(counts, 7)
    for k in range(1, 8):
        mean = sum(1 + min(n, k) for n in counts) / len(counts)
        assert verify_width.expected_tokens(curve, k) == pytest.approx(mean, abs=1e-12)


def test_acceptance_curve_by_hand():
    assert verify_width.acceptance_curve([0, 1, 3, 3], 4) == [0.75, 0.5, 0.5, 0.0]
    with pytest.raises(DLiteError, match="outside 0..4"):
        verify_width.acceptance_curve([5], 4)
    with pytest.raises(DLiteError, match="no steps"):
        verify_width.acceptance_curve([], 4)


@pytest.mark.parametrize("curve, costs, want", [
    # by hand: tokens/ms = 1.9/1.1, 2.7/1.2, 3.4/1.3, 4.0/2.0 -> 1.727, 2.25, 2.615, 2.0
    ([0.9, 0.8, 0.7, 0.6], {1: 1.1, 2: 1.2, 3: 1.3, 4: 2.0}, 3),
    # a GPU at batch 1: every width costs the same, so verify all K
    ([0.5, 0.3, 0.1, 0.05], {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, 4),
    # a CPU with a weak draft: 1.3/1.1 = 1.18 beats 1.4/1.3 = 1.08, 1.45/1.5, 1.47/1.8
    ([0.3, 0.1, 0.05, 0.02], {1: 1.1, 2: 1.3, 3: 1.5, 4: 1.8}, 1),
    # only some widths measured
    ([0.9, 0.9, 0.9, 0.9], {2: 1.2, 4: 1.3}, 4),
])
def test_choice_is_exact(curve, costs, want):
    choice = verify_width.choose(costs, curve, decode_ms=1.0)
    assert choice.drafts == want
    rows = choice.rows()
    assert rows[want]["tokens_per_step"] == pytest.approx(1 + sum(curve[:want]))
    assert rows[want]["speedup_over_decode"] == pytest.approx(rows[want]["tokens_per_step"] / costs[want])


def test_a_width_that_timed_cheaper_than_a_narrower_one_cannot_win():
    """Step costs are fitted nondecreasing in k (pool adjacent violators) before the choice: a wide
    width that timed lucky is pooled with the narrower ones it undercut, in every table."""
    assert verify_width.nondecreasing({1: 1.0, 2: 1.5, 3: 1.0}) == {1: 1.0, 2: 1.25, 3: 1.25}
    assert verify_width.nondecreasing({1: 3.0, 2: 2.0, 3: 1.0, 4: 5.0}) == {1: 2.0, 2: 2.0, 3: 2.0, 4: 5.0}
    assert verify_width.nondecreasing({2: 1.2, 4: 1.3}) == {2: 1.2, 4: 1.3}
    curve = [0.5, 0.1, 0.05]
    lucky = {1: 1.0, 2: 1.5, 3: 1.0}  # raw: 1.65 tokens/ms at k = 3; fitted: 1.32, below k = 1's 1.5
    choice = verify_width.choose(lucky, curve, decode_ms=1.0, batch_ms={1: (lucky, 1.0)},
                                 context_ms={256: (lucky, 1.4)})
    assert choice.drafts == 1 and choice.step_ms == {1: 1.0, 2: 1.25, 3: 1.25}
    assert choice.by_batch[1].drafts == 1 and choice.by_context[256].drafts == 1
    assert choice.by_context[256].step_ms == choice.step_ms


def test_choice_refuses_bad_inputs():
    with pytest.raises(DLiteError, match="outside 1..2"):
        verify_width.choose({3: 1.0}, [0.5, 0.2])
    with pytest.raises(DLiteError, match="positive"):
        verify_width.choose({1: 0.0}, [0.5, 0.2])
    with pytest.raises(DLiteError, match="no step costs"):
        verify_width.choose({}, [0.5])


def test_each_batch_size_gets_its_own_width_down_to_plain_decoding():
    """Per batch size, the k in 0..K with the most tokens per ms (0: a decode call, one token); a
    batch between calibrated sizes takes the next larger one's; a drafting session takes k >= 1."""
    curve = [0.5, 0.25, 0.1]
    batch_ms = {1: ({1: 1.2, 2: 1.3, 3: 1.6}, 1.0),  # tokens/ms 1.25, 1.346, 1.156; decode 1.0: k = 2
                2: ({1: 1.6, 2: 1.9, 3: 2.2}, 1.1),  # 0.9375, 0.921, 0.841; decode 0.909: k = 1
                4: ({1: 2.0, 2: 2.6, 3: 3.2}, 1.5),  # 0.75, 0.673, 0.578; decode 0.667: k = 1
                8: ({1: 4.0, 2: 5.0, 3: 6.0}, 2.0)}  # 0.375, 0.35, 0.308; decode 0.5: plain decoding
    choice = verify_width.choose(batch_ms[1][0], curve, decode_ms=1.0, batch_ms=batch_ms)
    assert choice.drafts == 2
    assert {b: w.drafts for b, w in choice.by_batch.items()} == {1: 2, 2: 1, 4: 1, 8: 0}
    assert [choice.drafts_for(b) for b in (1, 2, 3, 4, 5, 8, 16)] == [2, 1, 1, 1, 0, 0, 0]
    assert choice.drafts_for(8, drafting=True) == 1  # 1.5/4.0 beats 1.75/5.0 and 1.85/6.0
    # a tie between decoding and speculation goes to decoding
    assert verify_width.speculation_pays([0.5], {1: 1.5}, 1.0) == 0
    assert verify_width.speculation_pays([0.5], {1: 1.49}, 1.0) == 1
    assert verify_width.WidthChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice
    old = {k: v for k, v in choice.to_dict().items() if k != "by_batch"}  # a file from before batch sizes
    assert verify_width.WidthChoice.from_dict(old).drafts_for(8) == 2
    with pytest.raises(DLiteError, match="outside 1..3"):
        verify_width.choose(batch_ms[1][0], curve, batch_ms={2: ({4: 1.0}, 1.0)})
    with pytest.raises(DLiteError, match="decode costs positive"):
        verify_width.choose(batch_ms[1][0], curve, batch_ms={2: ({1: 1.0}, 0.0)})


def test_a_session_takes_the_width_of_the_nearest_calibrated_context():
    """Batch 1 with a context: the width calibrated at the context nearest it on a log scale (the
    draft's cost is flat while a decode call grows, so short contexts verify fewer drafts); other
    batch sizes, or no context, keep the batch table; a file without contexts behaves as before."""
    curve = [0.4, 0.2, 0.1]
    context_ms = {256: ({1: 1.25, 2: 1.5, 3: 1.8}, 1.0),  # 1.12, 1.07, 0.944 tokens/ms; decode 1.0: k = 1
                  2048: ({1: 2.2, 2: 2.3, 3: 2.5}, 2.0)}  # 0.636, 0.696, 0.68; decode 0.5: k = 2
    batch_ms = {1: ({1: 1.6, 2: 1.7, 3: 2.0}, 1.3), 2: ({1: 3.0, 2: 3.5, 3: 4.0}, 2.0)}
    choice = verify_width.choose(batch_ms[1][0], curve, decode_ms=1.3, batch_ms=batch_ms, context_ms=context_ms)
    assert {c: w.drafts for c, w in choice.by_context.items()} == {256: 1, 2048: 2}
    # 724 = sqrt(256 * 2048) is the boundary
    assert [choice.drafts_for(1, context=c) for c in (0, 100, 256, 700, 750, 2048, 9000)] == [1, 1, 1, 1, 2, 2, 2]
    assert choice.drafts_for(1) == choice.by_batch[1].drafts == 2  # no context: the batch table
    assert choice.drafts_for(2, context=100) == choice.by_batch[2].drafts  # batch > 1: the batch table
    slow = verify_width.choose({1: 2.0}, [0.3], context_ms={256: ({1: 2.0}, 1.0)})  # 0.65 < 1.0 tokens/ms
    assert slow.drafts_for(1, context=300) == 0 and slow.drafts_for(1, context=300, drafting=True) == 1
    assert verify_width.WidthChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice
    old = {k: v for k, v in choice.to_dict().items() if k != "by_context"}
    assert verify_width.WidthChoice.from_dict(old).drafts_for(1, context=100) == 2
    with pytest.raises(DLiteError, match="context 0"):
        verify_width.choose({1: 1.0}, [0.5], context_ms={0: ({1: 1.0}, 1.0)})


def test_drafting_for_the_next_step_pays_past_the_break_even_miss_rate():
    """At a lookup miss with no drafts: drafting (a step call emitting one token) pays when the misses
    expected next, p / (1 - p), times a drafted step's gain over decode calls exceed its cost over a
    decode call. By hand: k = 2 verifies 1 + 0.5 + 0.25 = 1.75 tokens for 13 ms against 17.5 ms of
    decode calls (gain 4.5 ms); the undrafted step costs 12 ms against a 10 ms decode (2 ms more), so
    p / (1 - p) = 2 / 4.5, p = 4 / 13 = 0.3077 is the break-even."""
    costs = {1: 12.0, 2: 13.0}
    choice = verify_width.choose(costs, [0.5, 0.25], decode_ms=10.0, context_ms={256: (costs, 10.0)})
    pays = [choice.drafting_pays(1, 256, 1, p) for p in (0.0, 0.30, 0.31, 0.9, 1.0)]
    assert pays == [False, False, True, True, True]
    slow = verify_width.choose({1: 12.0, 2: 18.0}, [0.5, 0.25], context_ms={256: ({1: 12.0, 2: 18.0}, 10.0)})
    # k = 1 there: gain 3 ms, so p / (1 - p) must reach 2 / 3
    assert not slow.drafting_pays(1, 256, 1, 0.35) and slow.drafting_pays(1, 256, 1, 0.45)
    losing = verify_width.choose({1: 16.0, 2: 18.0}, [0.5, 0.25], context_ms={256: ({1: 16.0, 2: 18.0}, 10.0)})
    assert not losing.drafting_pays(1, 256, 1, 1.0)  # no width gains anything
    # at a step where the lookup proposes, the next step gains with probability p: p x 4.5 >= 2, p >= 0.444
    assert [choice.drafting_pays(1, 256, 1, p, hit=True) for p in (0.0, 0.44, 0.45, 1.0)] == [False, False, True, True]
    assert verify_width.WidthChoice(1, [0.5], {1: 1.0}).drafting_pays(1, 256, 1, 0.0)  # no table: at a miss
    assert not verify_width.WidthChoice(1, [0.5], {1: 1.0}).drafting_pays(1, 256, 1, 1.0, hit=True)  # not at a hit
    # where a miss's decode call keeps the lookup's guess beside its token a quarter of the time, it keeps 1.25
    # tokens for 10 ms: the drafted step's 1.75 tokens are worth 14 ms, gain 1 ms; at a hit p x 1 < 2 always
    assert not any(choice.drafting_pays(1, 256, 1, p, hit=True, p_guess=0.25) for p in (0.45, 1.0))
    # at a miss p / (1 - p) x 1 >= 2: p >= 2 / 3
    assert [choice.drafting_pays(1, 256, 1, p, p_guess=0.25) for p in (0.66, 0.67)] == [False, True]
    assert not choice.drafting_pays(1, 256, 1, 0.9, p_guess=0.75)  # 1.75 tokens for 13 ms lose to 1.75 for 10


def test_the_lookup_counts_misses_after_misses_and_after_hits():
    """``MissRuns``: a step counts by whether its row missed the step before; each rate has one miss and
    one hit as prior."""
    from dlite_trt.runtime.prompt_lookup import PromptLookupDrafter

    drafter = PromptLookupDrafter(2)
    assert drafter.misses.rate() == 0.5
    for row0, row1 in [([], [3]), ([], []), ([1], []), ([], [2]), ([4], [])]:
        drafter.record(0, row0)
        drafter.record(1, row1)
    # row 0: miss, miss (repeat), hit (after a miss), miss, hit (after a miss) -> 3 after a miss, 1 repeat
    # row 1: hit, miss, miss (repeat), hit (after a miss), miss -> 2 after a miss, 1 repeat
    assert (drafter.misses.after_miss, drafter.misses.repeated) == (5, 2)
    assert drafter.misses.rate() == 3 / 7
    # and after a hit (a row's first step counts as one): row 0's steps 1 and 4 (both missed), row 1's 1, 2 and 5
    assert (drafter.misses.after_hit, drafter.misses.missed_after_hit) == (5, 4)
    assert drafter.misses.rate(after_miss=False) == 5 / 7


CLEAN = {(1, 256): ({1: 11.0, 2: 12.0}, 9.0), (1, 1024): ({1: 17.0, 2: 18.0}, 12.0),
         (1, 2048): ({1: 27.0, 2: 30.0}, 25.0), (2, 1024): ({1: 22.0, 2: 25.0}, 19.0)}
BUSY_1024 = CLEAN | {(1, 1024): ({1: 63.7, 2: 63.7}, 32.1)}  # a real fp32 calibration that load hit after 1,024
CHEAP_STEP = CLEAN | {(1, 256): ({1: 5.0, 2: 12.0}, 9.0)}


def test_costs_that_physics_rules_out_are_named():
    """Planted timings: a step call cheaper than a decode call, a call dearer than the same call
    after more cached tokens or with more rows, rounds spread wide; each is flagged, clean costs
    (and differences inside the tolerance) are not."""
    quiet = {key: {"decode": 0.02, "step k=1": 0.05} for key in CLEAN}
    assert verify_width.implausible(CLEAN, quiet) == []
    within = CLEAN | {(1, 256): ({1: 14.0, 2: 15.0}, 12.0 * 1.1)}  # 1.1x the decode call after 1,024: noise allowed
    assert verify_width.implausible(within) == []
    busy = verify_width.implausible(BUSY_1024)
    assert len(busy) == 2 and all("after 1024 tokens took 63.7 ms" in p for p in busy)
    assert any("more cached tokens (batch 1 after 2048" in p for p in busy)
    assert any("more rows (batch 2 after 1024" in p for p in busy)
    cheap = verify_width.implausible(CHEAP_STEP)
    assert len(cheap) == 1 and "a step call at k = 1 took 5.0 ms, 0.56x a decode call" in cheap[0]
    spread = verify_width.implausible(CLEAN, quiet | {(2, 1024): {"decode": 0.30, "step k=1": 0.05}})
    assert spread == ["batch 2 after 1024 tokens: the decode call's rounds spread +-30%"]


def test_calibration_measures_again_and_keeps_the_cleanest(monkeypatch):
    """Planted measurements: costs that fail the check are measured again; clean ones end it; when
    every attempt fails, the one with the fewest problems is kept with its problems, and the choice
    carries them into its file and its printout."""
    from dlite_trt.bench import calibrate as cal

    def planted(*attempts):
        it = iter(attempts)
        monkeypatch.setattr(cal, "call_costs", lambda gen, keys, runs: (next(it), {}))

    planted(BUSY_1024, CLEAN, CHEAP_STEP)
    assert cal.measured_costs(None, list(CLEAN), 20) == (CLEAN, [], 2)
    planted(BUSY_1024, CHEAP_STEP, BUSY_1024, CLEAN)
    costs, noise, attempts = cal.measured_costs(None, list(CLEAN), 20)
    assert (costs, noise, attempts) == (CHEAP_STEP, verify_width.implausible(CHEAP_STEP), cal.ATTEMPTS)
    curve = [0.6, 0.3]
    choice = verify_width.choose(costs[(1, 1024)][0], curve, decode_ms=costs[(1, 1024)][1], noise=noise,
                                 machine=verify_width.this_machine())
    assert verify_width.WidthChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice
    text = cal.describe(choice)
    assert "WARNING, timings not clean: batch 1 after 256 tokens: a step call at k = 1" in text


def test_a_width_measured_on_another_machine_says_so():
    here = verify_width.this_machine()
    assert here["cpu"] and here["cpus"] >= 1
    choice = verify_width.choose({1: 2.0}, [0.5], decode_ms=1.0, machine=here)
    assert choice.measured_elsewhere() is None
    assert verify_width.choose({1: 2.0}, [0.5]).measured_elsewhere() is None  # a file from before: unknown
    other = verify_width.choose({1: 2.0}, [0.5], machine={"cpu": "Some Other CPU 9000", "cpus": 512})
    assert other.measured_elsewhere() == f"calibrated on Some Other CPU 9000 (512 CPUs), running on {here['cpu']} " \
                                        f"({here['cpus']} CPUs)"


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    hf, spec = near_bigram_target(64, seed=11)
    draft = bigram_draft(hf, draft_config(spec, block_size=8, anchor_group_size=2))
    tmp = tmp_path_factory.mktemp("verify_width")
    return hf, small_engine(tmp, hf, draft), tmp / "engine"


def test_every_width_is_lossless(bigram):
    """At every k, greedy output equals transformers' greedy; each step proposes k drafts, and full
    acceptance at width k occurs (the block really is that wide)."""
    hf, engine, _ = bigram
    prompts = [[3, 5, 7, 9, 11, 2, 4], [1, 2]]
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    k_max = engine.cfg.num_proposals
    for k in range(1, k_max + 1):
        result = EngineGenerator(engine.runner, engine.manifest, k).generate(prompts,
                                                                             SamplingParams(max_new_tokens=NEW))
        assert result.output_ids == want, k
        rows = [(s.draft_tokens[r], s.accepted[r]) for s in result.steps for r in range(2) if s.accepted[r] is not None]
        assert {len(d) for d, _ in rows} == {k}
        assert max(n for _, n in rows) == k


def test_each_step_drafts_the_width_it_verifies(bigram, monkeypatch):
    """A greedy step drafts only what the next step verifies: at k drafts a step, every step call's
    next_block holds k drafts (its head ran k steps, not K), and the output is transformers' greedy."""
    hf, engine, _ = bigram
    drafted, infer = [], engine.runner.infer

    def recording(graph, feeds, cache):
        out = infer(graph, feeds, cache)
        if graph == "step":
            drafted.append(out["next_block"].shape[1] - 1)
        return out

    monkeypatch.setattr(engine.runner, "infer", recording)
    prompt = [3, 5, 7, 9, 11, 2, 4]
    for k in (1, 3):
        drafted.clear()
        gen = EngineGenerator(engine.runner, engine.manifest, k)
        result = gen.generate([prompt], SamplingParams(max_new_tokens=NEW))
        assert result.output_ids == [hf_greedy(hf, prompt, NEW)]
        assert len(drafted) == len(result.steps) and set(drafted) == {k} and k < engine.cfg.num_proposals


def test_a_session_verifies_the_width_of_its_context(bigram):
    """A calibrated choice whose width grows with the context: each greedy step verifies the width
    of the context it runs at (so the width changes within one generation), losslessly."""
    hf, engine, _ = bigram
    prompt = [3, 5, 7, 9, 11, 2, 4, 6, 8, 10, 12, 14]
    curve = [0.5] * engine.cfg.num_proposals
    ms = {k: 1.0 for k in range(1, engine.cfg.num_proposals + 1)}
    choice = verify_width.choose(ms, curve, decode_ms=1.0, context_ms={8: ({**ms, 1: 0.1}, 1.0), 32: (ms, 1.0)})
    assert {c: w.drafts for c, w in choice.by_context.items()} == {8: 1, 32: engine.cfg.num_proposals}
    gen = EngineGenerator(engine.runner, engine.manifest, choice.drafts, choice)
    session = gen.session([prompt])
    result = session.generate(SamplingParams(max_new_tokens=40))
    assert result.output_ids == [hf_greedy(hf, prompt, 40)]
    context, widths = len(prompt), []
    for step in result.steps:  # the anchor's position is the context a step runs at
        widths.append((len(step.draft_tokens[0]), choice.drafts_for(1, drafting=True, context=context)))
        context += step.accepted[0] + 1
    assert all(got == want for got, want in widths) and {w for w, _ in widths} == {1, engine.cfg.num_proposals}


def test_sampling_ignores_the_width(bigram):
    """A sampling step verifies all K (its draft logits are [B, K, V]): the same seeded tokens at any k."""
    _, engine, _ = bigram
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3)
    outs = [EngineGenerator(engine.runner, engine.manifest, k).generate([[4, 8, 15]], params) for k in (1, 7)]
    assert outs[0].output_ids == outs[1].output_ids
    assert {len(s.draft_tokens[0]) for s in outs[0].steps} == {engine.cfg.num_proposals}


def test_width_out_of_range_is_refused(bigram):
    _, engine, _ = bigram
    for k in (0, engine.cfg.num_proposals + 1, True):
        with pytest.raises(EngineError, match="verify-drafts"):
            EngineGenerator(engine.runner, engine.manifest, k)


def test_calibration_file_is_used_and_checked(bigram, tmp_path):
    """open_engine takes the calibrated k; a corrupt or foreign verify_width.json is refused clearly."""
    _, engine, engine_dir = bigram
    from dlite_trt.bench.calibrate import calibrate

    choice = calibrate(engine, [[3, 5, 7, 9], [1, 2, 3]], new_tokens=16, context=32, runs=10)
    assert set(choice.step_ms) == set(range(1, engine.cfg.num_proposals + 1)) and choice.decode_ms > 0
    batches = [b for b in (1, 2, 4, 8, 16) if b <= engine.manifest.limits.max_batch]
    assert sorted(choice.by_batch) == sorted({*batches, engine.manifest.limits.max_batch})
    assert all(set(w.step_ms) == set(choice.step_ms) and w.decode_ms > 0 for w in choice.by_batch.values())
    assert choice.by_batch[1].step_ms == choice.step_ms
    assert 32 in choice.by_context and choice.by_context[32] == choice.by_batch[1] and len(choice.by_context) >= 2
    forced = verify_width.WidthChoice(2, choice.curve, choice.step_ms, choice.decode_ms)
    path = verify_width.save(engine_dir, forced)
    try:
        assert open_engine(engine_dir).verify_drafts == 2
        assert open_engine(engine_dir, verify_drafts=5).verify_drafts == 5
        assert verify_width.load(engine_dir, engine.cfg.num_proposals) == forced
        path.write_text("{not json")
        with pytest.raises(EngineError, match="corrupt"):
            open_engine(engine_dir)
        path.write_text(json.dumps(forced.to_dict() | {"acceptance_at_least": [0.5]}))
        with pytest.raises(EngineError, match="calibrate"):
            open_engine(engine_dir)
        path.write_text(json.dumps(forced.to_dict() | {"by_batch": {"4": {"drafts": 9, "step_ms": {"1": 1.0},
                                                                         "decode_ms": 1.0}}}))
        with pytest.raises(EngineError, match="calibrate"):
            open_engine(engine_dir)
        for bad in ({"step_ms": []}, {"step_ms": 3}, {"drafts": 2.7}, {"drafts": True}, {"by_batch": {"2": {}}},
                    {"by_batch": {"x": {"drafts": 1, "step_ms": {}, "decode_ms": 1.0}}}):
            path.write_text(json.dumps(forced.to_dict() | bad))
            with pytest.raises(EngineError, match="corrupt"):
                open_engine(engine_dir)
        path.write_text("[1, 2]")
        with pytest.raises(EngineError, match="corrupt"):
            open_engine(engine_dir)
    finally:
        path.unlink()
    assert open_engine(engine_dir).verify_drafts == engine.cfg.num_proposals


def test_opening_an_engine_calibrated_elsewhere_warns(bigram, caplog):
    _, engine, engine_dir = bigram
    curve = [0.5] * engine.cfg.num_proposals
    choice = verify_width.choose({1: 2.0}, curve, decode_ms=1.0, machine={"cpu": "Some Other CPU 9000", "cpus": 512})
    path = verify_width.save(engine_dir, choice)
    try:
        with caplog.at_level("WARNING", logger="dlite_trt.runtime.engine"):
            assert open_engine(engine_dir).verify_drafts == 1
        assert "calibrated on Some Other CPU 9000" in caplog.text and "dlite-trt calibrate --engine" in caplog.text
        caplog.clear()
        verify_width.save(engine_dir, verify_width.choose({1: 2.0}, curve, machine=verify_width.this_machine()))
        with caplog.at_level("WARNING", logger="dlite_trt.runtime.engine"):
            open_engine(engine_dir)
        assert caplog.text == ""
    finally:
        path.unlink()


def test_a_build_calibrates_before_the_engine_is_in_place(tiny_pair, tmp_path):
    """Nothing can open an engine while its build still calibrates it: the calibration runs on the
    complete engine before it moves to --out, and a failed calibration leaves --out as it was."""
    from dlite_trt.bench.calibrate import calibrate_engine
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    settings = BuildSettings(limits=EngineLimits(max_batch=1, max_seq_len=64, max_chunk=16))
    out, seen = tmp_path / "engine", {}

    def calibrate(engine):
        seen.update(out_exists=out.exists(), engine=engine, text=calibrate_engine(
            engine, prompts=[[3, 5, 7, 9, 11], [1, 2, 3]], shown_as=out)[1])

    build_engine(*tiny_pair, out, settings, progress=False, calibrate=calibrate)
    assert seen["out_exists"] is False and seen["engine"] != out and not seen["engine"].exists()
    assert f"written to {out / verify_width.WIDTH_FILE}" in seen["text"]
    choice = verify_width.load(out, open_engine(out, verify_drafts=None).cfg.num_proposals)
    assert choice is not None and choice.machine == verify_width.this_machine()
    assert open_engine(out).verify_drafts == choice.drafts

    def fails(engine):
        raise RuntimeError("calibration failed")

    with pytest.raises(RuntimeError, match="calibration failed"):
        build_engine(*tiny_pair, tmp_path / "other", settings, progress=False, calibrate=fails)
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other*"))
