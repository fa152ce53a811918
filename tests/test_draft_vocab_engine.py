"""An ONNX Runtime engine built from a draft with a reduced draft vocabulary is lossless: greedy output
equals transformers' target-only greedy output, also where the target emits a token the draft cannot
name (which then anchors the next block, read by the draft as the mask token); it takes the same steps
as the PyTorch reference generator; seeded sampling reproduces itself and the reference.
Tiers: token ids exact everywhere. (Graph-level parity: test_engine_graphs.py's ``-vocab40`` cases.)"""

from __future__ import annotations

import json

import pytest
from helpers import OutsideVocabCase, bigram_draft, draft_config, generator, outside_vocab_case, small_engine

from dlite_trt.engine.manifest import MANIFEST
from dlite_trt.runtime.session import SamplingParams

VOCAB, DRAFT_VOCAB_SIZE = 64, 40
NEW = 40
LENGTHS = (7, 13, 21, 2)  # batch 4 (traced at 2); 13 and 21 prefill in 2 and 3 chunks of max_chunk 8


@pytest.fixture(scope="module")
def case() -> OutsideVocabCase:
    return outside_vocab_case(VOCAB, DRAFT_VOCAB_SIZE, LENGTHS, NEW, seed=3)


@pytest.fixture(scope="module")
def built(case, tmp_path_factory):
    """The bigram draft (G 2, block 8) of the case's target in its draft vocabulary, and its engine."""
    cfg = draft_config(case.spec, block_size=8, anchor_group_size=2, draft_vocab_size=DRAFT_VOCAB_SIZE)
    draft = bigram_draft(case.hf, cfg, draft_vocab=case.draft_vocab)
    out = tmp_path_factory.mktemp("vocab-engine")
    return draft, small_engine(out, case.hf, draft), out / "engine"


def test_greedy_engine_equals_target_only(case, built):
    _, engine, _ = built
    result = engine.generate(case.prompts, SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == case.want
    assert any(case.missing in out for out in result.output_ids)  # a token the draft cannot name, emitted
    proposed = {t for s in result.steps for row in s.draft_tokens if row is not None for t in row}
    assert proposed <= set(case.draft_vocab.tolist())
    accepted = [n for s in result.steps for n in s.accepted if n is not None]
    assert max(accepted) >= 2 and 0 in accepted  # multi-token acceptance and rejections both ran


def test_engine_steps_equal_reference_steps(case, built):
    """The same proposals and acceptances step by step, including the blocks anchored at the missing token."""
    draft, engine, _ = built
    params = SamplingParams(max_new_tokens=NEW)
    want = generator(case.hf, case.spec, draft).generate(case.prompts, params)
    got = engine.generate(case.prompts, params)
    assert got.output_ids == want.output_ids
    assert got.steps == want.steps


def test_sampling_is_seeded_and_matches_the_reference(case, built):
    draft, engine, _ = built
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=11)
    first = engine.generate(case.prompts, params)
    assert engine.generate(case.prompts, params).output_ids == first.output_ids
    assert engine.generate(case.prompts, SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=12)).output_ids \
        != first.output_ids
    assert first.output_ids == generator(case.hf, case.spec, draft).generate(case.prompts, params).output_ids
    proposed = {t for s in first.steps for row in s.draft_tokens if row is not None for t in row}
    assert proposed <= set(case.draft_vocab.tolist())  # sampled from q, which is 0 outside the draft vocabulary


def test_manifest_records_the_draft_vocabulary(built):
    _, _, engine_dir = built
    draft = json.loads((engine_dir / MANIFEST).read_text())["draft"]
    assert draft["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    assert draft["config"]["dlite_config"]["draft_vocab_size"] == DRAFT_VOCAB_SIZE
