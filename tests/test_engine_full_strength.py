"""The engine at full target strength with controlled proposals (cf. test_lossless_full_strength).

A proxy runner replaces each step's proposals with the target's own greedy continuation,
corrupted at seeded positions, so acceptance covers 0..K against a target whose attention
matters fully: a misplaced KV entry, a wrong position, pivot or token group changes the output.
Before replacing them, it checks the engine's real proposals (drafted inside the previous
engine call from the pivot and group the graph selected) against the reference draft run on
hidden states from transformers for the same context. Tiers: all token ids exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import draft_config, hf_greedy, make_target, random_draft

from dlite_trt.checkpoint import save_draft
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.export.contract import EngineLimits
from dlite_trt.runtime.engine import open_engine
from dlite_trt.runtime.session import SamplingParams

V = 200


class OracleRunner:
    """Wraps a runner: checks the incoming proposals, then swaps in corrupted oracle ones."""

    def __init__(self, runner, session, hf, draft, corrupt: float, seed: int) -> None:
        self.runner, self.session, self.hf, self.draft = runner, session, hf, draft
        self.rng = np.random.default_rng(seed)
        self.corrupt = corrupt
        self.expected: list[list[int]] = []  # per row: context + the target's greedy continuation
        self.accepted: list[int] = []
        self.checked = 0

    @torch.no_grad()
    def reference_proposals(self, context: list[int]) -> list[int]:
        """The reference draft on the target's hidden states at the pivot (the token before the anchor)."""
        cfg = self.draft.cfg
        states = self.hf(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
        chs = torch.stack([states[k + 1][0, -1] for k in cfg.target_layer_ids])[None]  # [1, S, H]
        g = cfg.anchor_group_size
        tail = context[-g:]
        group = torch.zeros(1, g, dtype=torch.long)
        group[0, g - len(tail):] = torch.tensor(tail)
        out = self.draft(chs, group, torch.tensor([len(tail)]), self.hf.model.embed_tokens.weight)
        return out.tokens[0].tolist()

    def infer(self, graph, feeds, cache):
        if graph != "step":
            return self.runner.infer(graph, feeds, cache)
        block = np.array(feeds["block"])
        k = block.shape[1] - 1
        for row, context in enumerate(self.session.tokens):
            if not self.session._active[row]:
                continue
            assert block[row, 0] == context[-1]  # the anchor is the last emitted token
            assert block[row, 1:].tolist() == self.reference_proposals(context), f"row {row} at {len(context)}"
            self.checked += 1
            want = self.expected[row][len(context): len(context) + k]
            want += [0] * (k - len(want))
            flip = self.rng.random(k) < self.corrupt
            block[row, 1:] = [(t + 1) % V if f else t for t, f in zip(want, flip, strict=True)]
        out = self.runner.infer(graph, {**feeds, "block": block}, cache)
        self.accepted += [int(n) for n, a in zip(out["accepted"], self.session._active, strict=True) if a]
        return out


@pytest.fixture(scope="module", params=[(1, 8), (2, 4), (2, 8)], ids=lambda p: f"G{p[0]}-block{p[1]}")
def case(request, tmp_path_factory):
    g, block = request.param
    hf, spec = make_target(V, seed=3, num_hidden_layers=3, hidden_size=64)
    draft = random_draft(draft_config(spec, block_size=block, anchor_group_size=g, sequential_rank=32))
    root = tmp_path_factory.mktemp(f"full{g}{block}")
    hf.save_pretrained(root / "target")
    save_draft(draft, root / "draft")
    build_engine(root / "target", root / "draft", root / "engine",
                 BuildSettings(limits=EngineLimits(max_batch=4, max_seq_len=160, max_chunk=8), draft_weights="float"),
                 progress=False)  # the draft float: its proposals are checked against the reference's
    return hf, draft, open_engine(root / "engine")


def _run(case, prompts, turns, new, stop=(), corrupt=0.25, seed=0):
    hf, draft, engine = case
    session = engine.session(prompts)
    oracle = OracleRunner(session.runner, session, hf, draft, corrupt, seed)
    session.runner = oracle
    k = draft.cfg.num_proposals
    for turn in (None, *turns):
        if turn is not None:
            session.extend(turn)
        contexts = [list(t) for t in session.tokens]
        oracle.expected = [c + hf_greedy(hf, c, new + k + 1) for c in contexts]
        result = session.generate(SamplingParams(max_new_tokens=new, stop_token_ids=stop))
        for row, context in enumerate(contexts):
            want = hf_greedy(hf, context, new)
            cuts = [i for i, t in enumerate(want) if t in stop]
            assert result.output_ids[row] == (want[: cuts[0] + 1] if cuts else want)
    return oracle


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def test_every_acceptance_count_batch_and_chunked_prefill(case):
    oracle = _run(case, _prompts(1, (3, 19, 1)), [], 30)  # 19 tokens: 3 prefill chunks of <= 8
    k = case[1].cfg.num_proposals
    assert {0, k} <= set(oracle.accepted) and len(set(oracle.accepted)) >= 3
    assert oracle.checked >= 10


def test_multiturn_extend(case):
    prompts = _prompts(2, (5, 12))
    oracle = _run(case, prompts, [_prompts(3, (9, 1)), _prompts(4, (17, 4))], 14)
    assert oracle.checked >= 6


def test_stop_token_cut(case):
    hf = case[0]
    stop = hf_greedy(hf, [5, 6, 7], 30)[7]
    _run(case, [[5, 6, 7], _prompts(5, (10,))[0]], [_prompts(6, (3, 3))], 20, stop=(stop,))


def test_full_acceptance(case):
    oracle = _run(case, _prompts(7, (4, 9)), [], 30, corrupt=0.0)
    assert set(oracle.accepted) == {case[1].cfg.num_proposals}


def test_engine_reads_the_cache_in_place(case):
    """The cache inputs are bound once, by address: an in-place edit of the session's buffer
    (without any rebinding) changes what the next engine call computes, so ONNX Runtime reads
    the buffer itself and no copy is made per call."""
    hf, _, engine = case
    prompt = _prompts(8, (12,))
    want = hf_greedy(hf, prompt[0], 12)
    params = SamplingParams(max_new_tokens=12)
    intact = [t for e in engine.session(prompt).stream(params) for t in e.new_tokens[0]]
    assert intact == want
    session = engine.session(prompt)
    stream = session.stream(params)
    got = list(next(stream).new_tokens[0]) + list(next(stream).new_tokens[0])  # prefill, one step
    buffers = session.cache.k.data_ptr(), session.cache.v.data_ptr()
    session.cache.k[:, :, :, :10].mul_(-3.0)  # corrupt the prompt's keys in place
    got += [t for e in stream for t in e.new_tokens[0]]
    assert (session.cache.k.data_ptr(), session.cache.v.data_ptr()) == buffers
    assert got != want
