"""The training state cache: answers are the target's greedy output (transformers decides), the
cached states are transformers' hidden states and distribution at every position, a killed run
resumes to the same files, and training batches from the cache equal those computed on the fly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import draft_config, hf_greedy, make_target

from dlite_trt.errors import ConfigError
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.pipeline import BatchSettings, BatchSource
from dlite_trt.training.state_cache import ARRAYS, SEQUENCES, StateCache, write_state_cache

V = 64
NEW = 6


@pytest.fixture(scope="module")
def setup():
    hf, spec = make_target(V, seed=4)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2)
    adapter = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 4, 13, 7, 5)]
    return hf, cfg, adapter, prompts


def _write(adapter, cfg, prompts, out, **kw):
    return write_state_cache(adapter, prompts, out, layer_ids=cfg.target_layer_ids, max_new_tokens=NEW,
                             stop_token_ids=kw.pop("stops", ()), top_k=V, batch_size=2, target_name="t", **kw)


def test_cached_states_are_the_targets(setup, tmp_path):
    hf, cfg, adapter, prompts = setup
    _write(adapter, cfg, prompts, tmp_path)
    cache = StateCache(tmp_path, cfg.target_layer_ids, V)
    for row, prompt in enumerate(prompts):
        seq = cache.sequences[row]
        assert list(seq.prompt_ids) == prompt
        assert list(seq.answer_ids) == hf_greedy(hf, prompt, NEW)  # batched, ragged: still the greedy output
        tokens = torch.tensor([seq.tokens])
        with torch.no_grad():
            ref = hf(tokens, output_hidden_states=True)
        got = cache.window(row, 0, tokens.shape[1])
        want = torch.stack([ref.hidden_states[i + 1][0] for i in cfg.target_layer_ids], dim=1)  # [L, S, H]
        torch.testing.assert_close(got["hidden"], want, atol=2e-3, rtol=1e-2)  # stored fp16
        probs = torch.softmax(ref.logits[0], dim=-1)
        assert (got["top_ids"][:, 0] == probs.argmax(-1)).all()
        torch.testing.assert_close(got["top_probs"], probs.gather(-1, got["top_ids"]), atol=1e-3, rtol=1e-2)


def test_a_stop_token_ends_an_answer(setup, tmp_path):
    hf, cfg, adapter, prompts = setup
    first = hf_greedy(hf, prompts[0], NEW)
    _write(adapter, cfg, prompts[:2], tmp_path, stops=(first[1],))
    answer = StateCache(tmp_path, cfg.target_layer_ids, V).sequences[0].answer_ids
    assert list(answer) == first[: first.index(first[1]) + 1]


def test_a_killed_run_resumes_to_the_same_files(setup, tmp_path):
    _, cfg, adapter, prompts = setup
    _write(adapter, cfg, prompts, tmp_path / "whole")
    killed = tmp_path / "killed"
    _write(adapter, cfg, prompts, killed)
    # as if killed while writing the third batch: two batches kept, half the third's states and
    # a partial line
    lines = (killed / SEQUENCES).read_text().splitlines(keepends=True)
    kept = sum(len(json.loads(line)["prompt_ids"]) + len(json.loads(line)["answer_ids"]) for line in lines[:4])
    layout = StateCache(killed, cfg.target_layer_ids, V).layout
    for name in ARRAYS:
        with open(killed / f"{name}.bin", "r+b") as f:
            f.truncate(kept * layout.row_bytes(name) + 100)
    (killed / SEQUENCES).write_text("".join(lines[:4]) + '{"prompt_ids": [1, 2')
    _write(adapter, cfg, prompts, killed)
    for name in [*(f"{a}.bin" for a in ARRAYS), SEQUENCES]:
        assert (killed / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_more_prompts_after_the_cached_ones_grow_the_cache(setup, tmp_path, monkeypatch):
    from dlite_trt.training import state_cache

    _, cfg, adapter, prompts = setup
    _write(adapter, cfg, prompts, tmp_path / "whole")
    answered = []
    real = state_cache._answer_batch

    def counting(target, batch, *args):
        answered.extend(batch)
        return real(target, batch, *args)

    monkeypatch.setattr(state_cache, "_answer_batch", counting)
    grown = tmp_path / "grown"
    assert _write(adapter, cfg, prompts[:2], grown) == 2
    assert _write(adapter, cfg, prompts, grown) == 5
    assert answered == prompts  # each answered once: the rerun answered only the last three
    for name in [*(f"{a}.bin" for a in ARRAYS), SEQUENCES]:
        assert (grown / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert _write(adapter, cfg, prompts[:4], grown) == 5  # the first of the cached prompts: nothing to do
    assert answered == prompts
    for name in [*(f"{a}.bin" for a in ARRAYS), SEQUENCES]:
        assert (grown / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    with pytest.raises(ConfigError, match="5 cached"):
        _write(adapter, cfg, [prompts[1], *prompts], grown)
    with pytest.raises(ConfigError, match="must start"):
        _write(adapter, cfg, prompts[:3] + prompts[4:], grown)


def test_another_layout_is_refused(setup, tmp_path):
    _, cfg, adapter, prompts = setup
    _write(adapter, cfg, prompts[:2], tmp_path)
    with pytest.raises(ConfigError, match="another target or draft layout"):
        write_state_cache(adapter, prompts, tmp_path, layer_ids=cfg.target_layer_ids, max_new_tokens=NEW,
                          stop_token_ids=(), top_k=8, batch_size=2, target_name="t")
    with pytest.raises(ConfigError, match="other prompts"):
        _write(adapter, cfg, prompts[::-1], tmp_path)
    with pytest.raises(ConfigError, match="this draft reads layers"):
        StateCache(tmp_path, (0, 1), V)
    (tmp_path / "hidden.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="incomplete"):
        StateCache(tmp_path, cfg.target_layer_ids, V)
    meta = json.loads((tmp_path / "states.json").read_text())
    assert meta["layer_ids"] == list(cfg.target_layer_ids)


def test_batches_from_the_cache_equal_batches_on_the_fly(setup, tmp_path):
    from dlite_trt.model.draft import DLiteDraft

    _, cfg, adapter, prompts = setup
    # Windows covering whole sequences: on the fly the target sees only the window (a window cut
    # from a longer sequence loses its earlier context there, never in the cache).
    _write(adapter, cfg, [p[:4] for p in prompts], tmp_path)
    cache = StateCache(tmp_path, cfg.target_layer_ids, V)
    settings = BatchSettings(seq_len=4 + NEW, batch_seqs=3, anchors=4, seed=2)
    draft = DLiteDraft(cfg)
    cached = BatchSource(adapter, cache, draft, settings, window=2)(5, 0, 1)
    fly = BatchSource(adapter, cache.sequences, draft, settings, window=2)(5, 0, 1)
    for name in ("group", "group_len", "teacher_tokens", "labels", "valid", "window_valid"):
        assert torch.equal(getattr(cached, name), getattr(fly, name)), name
    for name in ("chs", "window_states"):
        torch.testing.assert_close(getattr(cached, name), getattr(fly, name), atol=2e-3, rtol=1e-2)
    order = fly.target_ids.argsort(-1)  # both hold the whole distribution (k = V): compare as sets
    torch.testing.assert_close(cached.target_probs.gather(-1, cached.target_ids.argsort(-1)),
                               fly.target_probs.gather(-1, order), atol=1e-3, rtol=1e-2)


def test_answer_anchors_predict_only_the_targets_own_answer(setup):
    """anchor_region="answer": every block's first proposal is an answer token; the default
    ("window") also anchors in the prompt."""
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.training.data import TrainingSequence

    _, cfg, adapter, _ = setup
    # prompts of token 1 only, answers never 1: the first proposal's token says where it lies.
    # In 16-token windows the answers start at different places (a one-token answer: the last)
    sequences = [TrainingSequence((1,) * p, tuple(range(2, 2 + a))) for p, a in ((20, 6), (9, 3), (30, 12), (14, 1))]
    first = {}
    for region in ("window", "answer"):
        for step in range(4):
            settings = BatchSettings(seq_len=16, batch_seqs=4, anchors=8, seed=1, anchor_region=region)
            ex = BatchSource(adapter, sequences, DLiteDraft(cfg), settings)(step, 0, 1)
            first.setdefault(region, []).append(ex.teacher_tokens[:, 0][ex.valid[:, 0]])
    answer, window = torch.cat(first["answer"]), torch.cat(first["window"])
    assert (answer != 1).all() and answer.numel() == 4 * 4 * 8
    assert (answer == 2).any() and (window == 1).any()  # first answer tokens drafted; the default drafts prompts
    with pytest.raises(ConfigError, match="anchor_region"):
        BatchSettings(anchor_region="prompt")
