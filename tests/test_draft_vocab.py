"""A reduced draft vocabulary (``dlite_config.draft_vocab_size`` + ``sequential_head.draft_vocab``):
the config key, the head's mapping against the reference ``recurrence`` run in draft rows, the
reference generator's losslessness, checkpoint round trips and one clear error per way the draft
vocabulary can be wrong. Tiers: token ids exact; logits exact (the same ops on the same values).
The ONNX Runtime engine: tests/test_draft_vocab_engine.py; the exported graphs: test_engine_graphs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bit_exact,
    bigram_draft,
    draft_config,
    edit_config,
    OutsideVocabCase,
    generator,
    make_target,
    outside_vocab_case,
    raises_with,
    random_draft,
    reduced_vocab,
    rewrite_weights,
)

from dlite_trt.checkpoint import DRAFT_VOCAB, WEIGHTS_NAME, load_draft, save_draft
from dlite_trt.config import DraftConfig
from dlite_trt.errors import CheckpointError, ConfigError
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.sequential_head import recurrence
from dlite_trt.runtime.session import SamplingParams

VOCAB, DRAFT_VOCAB_SIZE, MASK = 64, 40, 1  # helpers.draft_config's mask token
NEW = 40


@pytest.fixture(scope="module")
def spec():
    return make_target(VOCAB, hidden_size=64)[1]


@pytest.fixture(scope="module")
def cfg(spec) -> DraftConfig:
    return draft_config(spec, draft_vocab_size=DRAFT_VOCAB_SIZE)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return reduced_vocab(VOCAB, DRAFT_VOCAB_SIZE, seed=5)  # [V_d]


@pytest.fixture
def draft(cfg, ids) -> DLiteDraft:
    return random_draft(cfg, seed=3, draft_vocab=ids)


def outside(ids: torch.Tensor) -> list[int]:
    """Target ids the draft vocabulary lacks."""
    return sorted(set(range(VOCAB)) - set(ids.tolist()))


def rows_of(ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The convention, written out: a token's draft row, the mask token's row for tokens outside."""
    row = {int(t): i for i, t in enumerate(ids)}
    return torch.tensor([row.get(int(t), row[MASK]) for t in tokens])


# ---------------------------------------------------------------------------------------------
# config


def test_config_key_round_trips_and_is_written_only_when_set(spec, cfg):
    raw = cfg.to_dict()
    assert raw["dlite_config"]["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    assert DraftConfig.from_dict(json.loads(json.dumps(raw))) == cfg
    assert cfg.head_vocab_size == DRAFT_VOCAB_SIZE
    official = draft_config(spec)
    assert "draft_vocab_size" not in official.to_dict()["dlite_config"]
    assert official.draft_vocab_size is None and official.head_vocab_size == VOCAB


@pytest.mark.parametrize("size", [0, 1, VOCAB + 1, True, "40", 40.0])
def test_config_rejects_bad_sizes(spec, size):
    with raises_with(ConfigError, "draft_vocab_size must be an int in [2, vocab_size=64]", "remove it"):
        draft_config(spec, draft_vocab_size=size)


# ---------------------------------------------------------------------------------------------
# the head


def test_a_new_draft_has_a_head_of_the_draft_vocabulary_size(cfg):
    head = DLiteDraft(cfg).sequential_head
    assert head.draft_vocab_size == DRAFT_VOCAB_SIZE
    assert head.prev_token_embedding.weight.shape[0] == head.output_proj.weight.shape[0] == DRAFT_VOCAB_SIZE
    assert MASK in head.draft_vocab.tolist() and len(set(head.draft_vocab.tolist())) == DRAFT_VOCAB_SIZE
    assert "draft_vocab" in head.state_dict() and "target_to_draft" not in head.state_dict()


def test_mapping_tables_and_helpers(draft, ids):
    head = draft.sequential_head
    assert torch.equal(head.draft_vocab, ids)
    table = head.target_to_draft  # [V]
    assert table.shape == (VOCAB,) and table.dtype == torch.long
    assert torch.equal(table[ids], torch.arange(DRAFT_VOCAB_SIZE))
    assert (table[outside(ids)] == DRAFT_VOCAB_SIZE).all()  # the sentinel
    every = torch.arange(VOCAB)
    assert torch.equal(head.to_draft(every), rows_of(ids, every))
    assert torch.equal(head.to_target(torch.arange(DRAFT_VOCAB_SIZE)), ids)
    logits = torch.randn(2, 3, DRAFT_VOCAB_SIZE)
    full = head.full_logits(logits)  # [2, 3, V]
    assert full.shape == (2, 3, VOCAB)
    assert torch.equal(full[..., ids], logits)
    assert torch.isneginf(full[..., outside(ids)]).all()


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_forward_is_the_recurrence_in_draft_rows(draft, ids, sampling):
    """forward = recurrence on the mapped anchor and seed; tokens mapped back, logits spread over V."""
    head = draft.sequential_head
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 5, head.hidden_size, generator=g)  # [B, K, H]
    anchor = torch.tensor([ids[0], outside(ids)[0], MASK, outside(ids)[-1]])
    seed = torch.tensor([outside(ids)[1], ids[3], ids[7], MASK])
    temperature = torch.tensor([0.0, 0.8, 1.2, 0.0]) if sampling else 0.0
    uniforms = torch.rand(4, 5, generator=g) if sampling else None
    with torch.no_grad():
        got = head(hidden, anchor, seed, temperature, uniforms)
        want = recurrence(head.weights(), hidden, rows_of(ids, anchor), rows_of(ids, seed), temperature, uniforms)
    assert torch.equal(got.tokens, ids[want.tokens])
    assert torch.equal(got.logits[..., ids], want.logits)
    assert torch.isneginf(got.logits[..., outside(ids)]).all()


def test_an_anchor_outside_the_draft_vocabulary_is_read_as_the_mask_token(draft, ids):
    head = draft.sequential_head
    hidden = torch.randn(2, 7, head.hidden_size, generator=torch.Generator().manual_seed(1))
    missing = torch.tensor(outside(ids)[:2])
    with torch.no_grad():
        got = head(hidden, missing, missing)
        want = head(hidden, torch.full_like(missing, MASK), torch.full_like(missing, MASK))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logits, want.logits)


def test_without_a_draft_vocabulary_the_head_is_the_recurrence(spec):
    head = random_draft(draft_config(spec)).sequential_head
    assert head.draft_vocab is None and head.target_to_draft is None and head.draft_vocab_size is None
    assert set(head.state_dict()) == {"prev_token_embedding.weight", "output_proj.weight", "state_proj.weight",
                                      "state_proj.bias", "state_hidden_mlp.weight", "state_hidden_mlp.bias"}
    hidden, anchor = torch.randn(3, 4, head.hidden_size), torch.tensor([0, 5, 63])
    with torch.no_grad():
        got, want = head(hidden, anchor, None), recurrence(head.weights(), hidden, anchor, None)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logits, want.logits)
    assert head.to_draft(anchor) is anchor and head.to_target(anchor) is anchor


@pytest.mark.parametrize(("make_ids", "fragment"), [
    (lambda ids: torch.cat([ids[:-1], ids[:1]]), "more than once"),
    (lambda ids: torch.cat([ids[:-1], torch.tensor([VOCAB])]), "outside the target vocabulary [0, 64)"),
    (lambda ids: torch.cat([ids[:-1], torch.tensor([-1])]), "outside the target vocabulary [0, 64)"),
    (lambda ids: torch.where(ids == MASK, torch.tensor(outside(ids)[0]), ids), "lacks the mask token 1"),
    (lambda ids: ids.int(), "1-D int64"),
    (lambda ids: ids[:-1], "the head's 40 rows"),
], ids=["duplicate", "too_large", "negative", "no_mask", "int32", "length"])
def test_set_draft_vocab_refuses_bad_ids(draft, ids, make_ids, fragment):
    with raises_with(ValueError, fragment):
        draft.sequential_head.set_draft_vocab(make_ids(ids))
    assert torch.equal(draft.sequential_head.draft_vocab, ids)  # unchanged


def test_set_draft_vocab_needs_a_head_with_one(spec, ids):
    with raises_with(ValueError, "has no draft vocabulary", "draft_vocab_size"):
        random_draft(draft_config(spec)).sequential_head.set_draft_vocab(ids)


def test_load_state_dict_rebuilds_target_to_draft(cfg, draft, ids):
    fresh = DLiteDraft(cfg).eval()  # its default draft vocabulary
    assert not torch.equal(fresh.sequential_head.target_to_draft, draft.sequential_head.target_to_draft)
    fresh.load_state_dict(draft.state_dict(), strict=True)
    assert torch.equal(fresh.sequential_head.draft_vocab, ids)
    assert torch.equal(fresh.sequential_head.target_to_draft, draft.sequential_head.target_to_draft)
    with torch.device("meta"):  # as load_draft does it
        meta = DLiteDraft(cfg)
    meta.load_state_dict(draft.state_dict(), strict=True, assign=True)
    assert torch.equal(meta.sequential_head.target_to_draft, draft.sequential_head.target_to_draft)


def test_load_state_dict_refuses_a_bad_draft_vocabulary(cfg, draft, ids):
    state = draft.state_dict() | {DRAFT_VOCAB: torch.cat([ids[:-1], ids[:1]])}
    with raises_with(ValueError, "more than once"):
        DLiteDraft(cfg).load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------------
# the reference generator: lossless, and tokens outside the draft vocabulary are emitted


@pytest.fixture(scope="module")
def case() -> OutsideVocabCase:
    return outside_vocab_case(VOCAB, DRAFT_VOCAB_SIZE, (7, 13, 3), NEW)


@pytest.mark.parametrize("g", [1, 2])
def test_reference_greedy_is_lossless_with_tokens_outside_the_draft_vocabulary(case, g):
    hf, spec, prompts, want, missing, ids = case
    cfg = draft_config(spec, block_size=8, anchor_group_size=g, draft_vocab_size=DRAFT_VOCAB_SIZE)
    result = generator(hf, spec, bigram_draft(hf, cfg, draft_vocab=ids)).generate(prompts,
                                                                                 SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == want
    assert any(missing in out for out in want)  # emitted, as the target's own token
    proposed = {t for s in result.steps for row in s.draft_tokens if row is not None for t in row}
    assert proposed <= set(ids.tolist())  # the draft only ever proposed ids of its vocabulary
    assert max(n for s in result.steps for n in s.accepted if n is not None) >= 2  # and they were accepted


# ---------------------------------------------------------------------------------------------
# checkpoints


@pytest.fixture
def ckpt(draft, tmp_path) -> Path:
    return save_draft(draft, tmp_path / "draft")


def test_round_trip_is_bit_exact(draft, ckpt):
    assert json.loads((ckpt / "config.json").read_text())["dlite_config"]["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    loaded = load_draft(ckpt, dtype=None)
    assert_bit_exact(loaded, draft)
    assert torch.equal(loaded.sequential_head.target_to_draft, draft.sequential_head.target_to_draft)


def test_round_trip_sharded(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=50_000)
    assert not (out / WEIGHTS_NAME).exists()
    assert_bit_exact(load_draft(out, dtype=None), draft)


def test_fp16_save_keeps_the_draft_vocabulary_int64(draft, tmp_path):
    half = draft.half()
    assert half.sequential_head.draft_vocab.dtype == torch.int64
    out = save_draft(half, tmp_path / "fp16")
    with open(out / WEIGHTS_NAME, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header[DRAFT_VOCAB]["dtype"] == "I64"
    assert {v["dtype"] for k, v in header.items() if k not in (DRAFT_VOCAB, "__metadata__")} == {"F16"}
    loaded = load_draft(out, dtype=None)
    assert_bit_exact(loaded, half)
    up = load_draft(out)  # cast to fp32: the ids stay int64
    assert up.sequential_head.draft_vocab.dtype == torch.int64 and up.norm.weight.dtype == torch.float32


def _drop_key(raw: dict) -> None:
    del raw["dlite_config"]["draft_vocab_size"]


@pytest.mark.parametrize(("edit_weights", "fragments"), [
    (lambda s: s.pop(DRAFT_VOCAB), ["draft_vocab_size=40", f"no {DRAFT_VOCAB}", "save the draft vocabulary"]),
    (lambda s: s.update({DRAFT_VOCAB: torch.cat([s[DRAFT_VOCAB][:-1], s[DRAFT_VOCAB][:1]])}),
     ["more than once", "list each target id at most once"]),
    (lambda s: s.update({DRAFT_VOCAB: torch.cat([s[DRAFT_VOCAB][:-1], torch.tensor([VOCAB])])}),
     ["outside the target vocabulary [0, 64)"]),
    (lambda s: s.update({DRAFT_VOCAB: torch.where(s[DRAFT_VOCAB] == MASK, VOCAB - 1, s[DRAFT_VOCAB])}),
     ["lacks the mask token 1", "including mask_token_id=1"]),
    (lambda s: s.update({DRAFT_VOCAB: s[DRAFT_VOCAB].int()}), ["is torch.int32", "must be int64"]),
    (lambda s: s.update({DRAFT_VOCAB: s[DRAFT_VOCAB][:-1]}), [f"{DRAFT_VOCAB}: file (39,), config needs (40,)"]),
    (lambda s: s.update({"sequential_head.output_proj.weight": torch.zeros(VOCAB, 64)}),
     ["sequential_head.output_proj.weight: file (64, 64), config needs (40, 64)", "draft_vocab_size when it is set"]),
], ids=["missing", "duplicate", "out_of_range", "no_mask", "int32", "length", "head_shape"])
def test_bad_draft_vocabulary_weights(ckpt, edit_weights, fragments):
    rewrite_weights(ckpt, edit_weights)
    with raises_with(CheckpointError, str(ckpt), *fragments):
        load_draft(ckpt)


def test_draft_vocab_tensor_without_the_config_key(ckpt):
    edit_config(ckpt, _drop_key)
    with raises_with(CheckpointError, f"holds {DRAFT_VOCAB} (40,)", "no dlite_config.draft_vocab_size",
                     '"draft_vocab_size": 40'):
        load_draft(ckpt)


def test_full_vocabulary_head_with_the_config_key(spec, tmp_path):
    """An official draft's [V, r] head under a config that sets a draft vocabulary: the missing tensor is named."""
    out = save_draft(random_draft(draft_config(spec)), tmp_path / "official")
    edit_config(out, lambda raw: raw["dlite_config"].update(draft_vocab_size=DRAFT_VOCAB_SIZE))
    with raises_with(CheckpointError, f"no {DRAFT_VOCAB}"):
        load_draft(out)
