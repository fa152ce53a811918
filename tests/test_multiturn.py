"""Multi-turn: generate, extend the live session, generate again == greedy on the whole context."""

from __future__ import annotations

import torch
from helpers import bigram_draft, draft_config, generator, hf_greedy, near_bigram_target

from dlite_trt.runtime.reference import SamplingParams


def test_extend_then_generate_equals_greedy_on_concatenated_context():
    hf, spec = near_bigram_target(64, seed=3)
    gen = generator(hf, spec, bigram_draft(hf, draft_config(spec, anchor_group_size=2)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 3)]
    session = gen.session(prompts)
    context = [list(p) for p in prompts]
    for turn, (new_len, n_tokens) in enumerate([(0, 20), (5, 15), (1, 9), (12, 25)]):
        if new_len:
            turn_tokens = [torch.randint(0, 64, (new_len + row,), generator=g).tolist() for row in range(2)]
            session.extend(turn_tokens)
            for row in range(2):
                context[row] += turn_tokens[row]
        out = session.generate(SamplingParams(max_new_tokens=n_tokens))
        for row in range(2):
            assert out.output_ids[row] == hf_greedy(hf, context[row], n_tokens), f"turn {turn} row {row}"
            context[row] += out.output_ids[row]
        assert session.tokens == context


def test_extend_after_a_stop_token_discards_tokens_accepted_past_it():
    hf, spec = near_bigram_target(64, seed=0)
    gen = generator(hf, spec, bigram_draft(hf, draft_config(spec)))
    prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    full = hf_greedy(hf, prompt, 40)
    stop = full[9]
    session = gen.session([prompt])
    first = session.generate(SamplingParams(max_new_tokens=40, stop_token_ids=(stop,))).output_ids[0]
    assert first == full[: full.index(stop) + 1]
    session.extend([[5, 6, 7]])
    second = session.generate(SamplingParams(max_new_tokens=12)).output_ids[0]
    assert second == hf_greedy(hf, prompt + first + [5, 6, 7], 12)


def test_extend_does_no_draft_work_and_no_target_work_until_generate():
    hf, spec = near_bigram_target(64, seed=1)
    gen = generator(hf, spec, bigram_draft(hf, draft_config(spec)))
    session = gen.session([[1, 2, 3]])
    session.generate(SamplingParams(max_new_tokens=5))
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in (gen.draft, gen.target)]
    session.extend([list(range(10, 30))])
    assert calls == []  # the draft keeps no history: a context change costs it nothing
    for h in hooks:
        h.remove()
