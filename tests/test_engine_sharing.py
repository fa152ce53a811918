"""One engine shared: several threads generating on it at once give exactly the tokens each
request gives alone, and a call attends over what the sequence holds, not over what its
max_new_tokens would let it reach. Tiers: token ids exact; the bound cache extent exact."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import bigram_draft, draft_config, hf_greedy, near_bigram_target, small_engine

from dlite_trt.runtime.kv_cache import GRANULE
from dlite_trt.runtime.session import SamplingParams

NEW = 24


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A near-bigram target (multi-token acceptance) and an engine with room for a long budget."""
    hf, spec = near_bigram_target(64, seed=3)
    draft = bigram_draft(hf, draft_config(spec, block_size=4, anchor_group_size=2))
    return hf, small_engine(tmp_path_factory.mktemp("shared"), hf, draft, max_seq_len=4096, max_chunk=8)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 30, (n,), generator=g)]


def test_threads_sharing_one_engine_get_exact_tokens(shared):
    """3 threads x 6 prompts x 3 rounds on one engine (one session per request, some of batch 2,
    greedy and target-only mixed): every output equals transformers' greedy of its prompt."""
    hf, engine = shared
    prompts = _prompts(6)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW)
    failures: list[str] = []
    start = threading.Barrier(3)

    def work(worker: int) -> None:
        start.wait()  # the threads' calls overlap from the first one
        for round_ in range(3):
            for i in range(worker % 2, len(prompts), 2):
                if (i + round_) % 3 == 0:  # a batch of two rows
                    j = (i + 1) % len(prompts)
                    got = engine.generate([prompts[i], prompts[j]], params).output_ids
                    expected = [want[i], want[j]]
                elif (i + round_) % 3 == 1:
                    got, expected = engine.session([prompts[i]]).generate_target_only(params).output_ids, [want[i]]
                else:
                    got, expected = engine.generate([prompts[i]], params).output_ids, [want[i]]
                if got != expected:
                    failures.append(f"thread {worker} round {round_} prompt {i}: {got} != {expected}")

    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            work(worker)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert not failures, failures


def test_a_short_sequence_under_a_huge_budget_binds_a_short_cache(shared):
    """10 steps of a 20-token prompt with max_new_tokens=4000: the KV length bound to the step
    graph is the sequence's length rounded up to the granule, not prompt + 4000."""
    _, engine = shared
    prompt = _prompts(1)[0][:20]
    for budget in (64, 4000):
        session = engine.session([prompt])
        stream = session.stream(SamplingParams(max_new_tokens=budget))
        for _ in range(11):  # the prefill and 10 steps
            next(stream)
        stream.close()
        longest = len(session.tokens[0]) + engine.manifest.draft_config.block_size
        bound = session.cache.bindings["step"].shape  # what every past_key.{i} of the step graph got
        assert bound[3] == -(-longest // GRANULE) * GRANULE == GRANULE, (budget, bound)
        assert bound == tuple(session.cache.k.shape)


def test_the_cache_grows_with_the_sequence_and_stays_exact(shared):
    """A sequence that outgrows several granules: the cache grows as it goes (never to the
    budget's size up front) and the output stays the target's greedy one."""
    hf, engine = shared
    prompt = _prompts(2)[1]
    session = engine.session([prompt])
    sizes = []
    for _ in session.stream(SamplingParams(max_new_tokens=300)):
        sizes.append(session.cache.capacity)
    assert sizes[0] < sizes[-1] <= len(session.tokens[0]) + GRANULE
    assert len(set(sizes)) >= 2  # it grew at least once, while decoding
    assert session.tokens[0][len(prompt):] == hf_greedy(hf, prompt, 300)
