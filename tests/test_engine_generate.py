"""The ONNX Runtime engine generates exactly what the target alone generates (greedy, fp32),
matches the reference generator's behaviour (multi-turn, stops, sampling with a seed), and
keeps its KV cache in place. Tiers: token ids exact everywhere (greedy and seeded sampling)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    bigram_draft,
    draft_config,
    generator,
    hf_greedy,
    make_target,
    near_bigram_target,
    random_draft,
    small_engine,
)

from dlite_trt.checkpoint import save_draft
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.export.contract import EngineLimits
from dlite_trt.runtime.engine import open_engine
from dlite_trt.runtime.session import SamplingParams

NEW = 40


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=[(1, 4), (1, 8), (2, 4), (2, 8)], ids=lambda p: f"G{p[0]}-block{p[1]}")
def bigram_case(request, tmp_path_factory):
    """A near-bigram target and a bigram draft: acceptance is often full, sometimes partial or zero."""
    g, block = request.param
    hf, spec = near_bigram_target(64, seed=g + block)
    draft = bigram_draft(hf, draft_config(spec, block_size=block, anchor_group_size=g))
    return hf, spec, draft, small_engine(tmp_path_factory.mktemp(f"g{g}b{block}"), hf, draft)


@pytest.mark.parametrize("lengths", [(7,), (2, 13, 21)], ids=["batch1", "batch3"])
def test_greedy_engine_equals_target_only(bigram_case, lengths):
    hf, _, _, engine = bigram_case
    prompts = _prompts(len(lengths), lengths, 64)  # the 13- and 21-token prompts prefill in 2 and 3 chunks
    result = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]
    accepted = [n for s in result.steps for n in s.accepted if n is not None]
    assert max(accepted) >= 2  # multi-token acceptance ran
    if len(lengths) == 3:
        assert 0 in accepted or min(accepted) < max(accepted)  # and rows advanced unevenly


def test_engine_steps_equal_reference_steps(bigram_case):
    """Same proposals, same acceptance per step as the PyTorch reference generator."""
    hf, spec, draft, engine = bigram_case
    prompts = _prompts(5, (3, 9, 6), 64)
    want = generator(hf, spec, draft).generate(prompts, SamplingParams(max_new_tokens=NEW))
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert got.output_ids == want.output_ids
    assert got.steps == want.steps


def test_target_only_through_engine(bigram_case):
    hf, _, _, engine = bigram_case
    prompts = _prompts(2, (5, 17), 64)
    result = engine.session(prompts).generate_target_only(SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]


def test_multiturn_extend_equals_target_only_on_whole_context(bigram_case):
    hf, _, _, engine = bigram_case
    session = engine.session(_prompts(3, (6, 11), 64))
    turns = _prompts(4, (9, 2), 64), _prompts(5, (1, 14), 64)
    for turn in (None, *turns):
        if turn is not None:
            session.extend(turn)
        context = [list(t) for t in session.tokens]
        result = session.generate(SamplingParams(max_new_tokens=12))
        assert result.output_ids == [hf_greedy(hf, c, 12) for c in context]
    # the cache holds every token but each sequence's last one
    assert session.cache_len == [len(t) - 1 for t in session.tokens]


def test_stop_tokens_and_max_new_tokens(bigram_case):
    hf, _, _, engine = bigram_case
    prompts = _prompts(6, (4, 8), 64)
    free = [hf_greedy(hf, p, NEW) for p in prompts]
    stop = free[0][10]
    result = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))
    for row, full in enumerate(free):
        cut = full[: full.index(stop) + 1] if stop in full else full
        assert result.output_ids[row] == cut
        assert result.stop_reasons[row] == ("stop_token" if stop in full else "max_new_tokens")
    assert engine.generate(prompts, SamplingParams(max_new_tokens=1)).output_ids == [f[:1] for f in free]
    assert engine.generate(prompts, SamplingParams(max_new_tokens=0)).output_ids == [[], []]


def test_streaming_yields_each_steps_tokens_in_order(bigram_case):
    hf, _, _, engine = bigram_case
    prompt = _prompts(7, (5,), 64)
    events = list(engine.session(prompt).stream(SamplingParams(max_new_tokens=NEW)))
    assert events[0].record is None and len(events[0].new_tokens[0]) == 1  # the prefill's anchor
    assert all(len(e.new_tokens[0]) == e.record.accepted[0] + 1 for e in events[1:-1])
    assert [t for e in events for t in e.new_tokens[0]] == hf_greedy(hf, prompt[0], NEW)


def test_sampling_is_seeded_and_matches_the_reference(bigram_case):
    """Random numbers are inputs drawn in the reference's order, so a seed reproduces the
    reference's sampled output (and the engine's own) token for token."""
    hf, spec, draft, engine = bigram_case
    prompts = _prompts(8, (4, 10), 64)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=11)
    first = engine.generate(prompts, params)
    assert engine.generate(prompts, params).output_ids == first.output_ids
    assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=12)).output_ids \
        != first.output_ids
    assert first.output_ids == generator(hf, spec, draft).generate(prompts, params).output_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_a_prefill_runs_its_leading_chunks_on_the_decode_graph_once_it_is_loaded(bigram_case, temperature):
    """Only the last chunk's drafts serve, so a prompt's leading chunks run the decode graph where it
    is loaded (the server and the bench preload it), and the prefill graph, drafting, where it is not
    (a prefill does not load it: a second copy of the weights). The tokens are the same either way:
    target-only greedy's, or the same seeded sample."""
    hf, _, _, engine = bigram_case
    fresh = open_engine(engine.runner.engine_dir, preload=("prefill", "step"))
    calls, infer = [], fresh.runner.infer
    fresh.runner.infer = lambda graph, *args: (calls.append(graph), infer(graph, *args))[1]
    prompt = _prompts(13, (21,), 64)  # three chunks of at most 8
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, seed=5)
    suffix = "_sampling" if temperature else ""
    without = fresh.generate(prompt, params).output_ids
    assert calls[:3] == ["prefill" + suffix] * 3 and not fresh.runner.loaded("decode"), calls
    fresh.runner.activate(("decode",))
    calls.clear()
    assert fresh.generate(prompt, params).output_ids == without
    assert calls[:3] == ["decode", "decode", "prefill" + suffix], calls
    if not temperature:
        assert without == [hf_greedy(hf, prompt[0], NEW)]


def test_plain_random_target_full_strength(tmp_path):
    """A target whose attention matters at full strength, G=2, prompts of 1 and 30 tokens."""
    hf, spec = make_target(300, seed=4, num_hidden_layers=5, hidden_size=96)
    cfg = draft_config(spec, block_size=8, anchor_group_size=2, chs_num_layers=4, sequential_rank=64)
    engine = small_engine(tmp_path, hf, random_draft(cfg), max_chunk=16)
    prompts = _prompts(4, (9, 1, 30), 300)
    result = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]


def test_a_step_stores_only_its_block(bigram_case):
    """A step writes O(block) cache entries, right after the prompt (no per-step rewrite of the cache)."""
    _, _, draft, engine = bigram_case
    session = engine.session(_prompts(9, (6,), 64))
    stream = session.stream(SamplingParams(max_new_tokens=NEW))
    next(stream)
    before = session.cache.k.clone()
    next(stream)
    after = session.cache.k[:, :, :, : before.shape[3]]  # (a grown cache keeps its first slots in place)
    changed = torch.nonzero((after != before).any(dim=4).any(dim=2).any(dim=1).any(dim=0))[:, 0]  # slots written
    assert 1 <= len(changed) <= draft.cfg.block_size
    assert changed.min() == 6  # right after the prompt: the anchor's slot


def _poison(buffer: torch.Tensor, row: int, slots: slice, seed: int) -> None:
    """Large values in [:, row, :, slots] of a cache buffer, written in place."""
    view = buffer[:, row, :, slots]
    g = torch.Generator().manual_seed(seed)
    view.copy_(1000.0 * torch.randn(view.shape, generator=g).to(view.dtype))


def test_engine_calls_read_the_sessions_cache_buffer(bigram_case, monkeypatch):
    """The engine reads the session's cache buffer itself, in place: values written into a
    valid slot of ``session.cache`` between two generates change that row's next tokens (and
    only that row's), values past the valid length change nothing, and every cache input ONNX
    Runtime was bound to is the buffer's own memory (no copy, per call or kept)."""
    import onnxruntime.capi.onnxruntime_inference_collection as ort_api

    bound: dict[str, set[int]] = {}  # cache input -> every address it was bound to
    real_bind, real_bind_value = ort_api.IOBinding.bind_input, ort_api.IOBinding.bind_ortvalue_input

    def bind_input(io, name, device_type, device_id, element_type, shape, buffer_ptr):
        bound.setdefault(name, set()).add(buffer_ptr)
        return real_bind(io, name, device_type, device_id, element_type, shape, buffer_ptr)

    def bind_ortvalue_input(io, name, value):
        bound.setdefault(name, set()).add(value.data_ptr())
        return real_bind_value(io, name, value)

    monkeypatch.setattr(ort_api.IOBinding, "bind_input", bind_input)
    monkeypatch.setattr(ort_api.IOBinding, "bind_ortvalue_input", bind_ortvalue_input)

    hf, _, _, engine = bigram_case
    prompts = _prompts(13, (6, 11), 64)
    clean, valid, past = (engine.session(prompts) for _ in range(3))
    for session in (clean, valid, past):
        session.generate(SamplingParams(max_new_tokens=8))
    lengths = clean.cache_len
    assert valid.cache_len == past.cache_len == lengths and min(lengths) > 0
    for buffer in (valid.cache.k, valid.cache.v):  # row 0's cached tokens, every layer
        _poison(buffer, 0, slice(0, lengths[0]), seed=1)
    assert all(past.cache.capacity > n for n in lengths)  # room past the valid entries to poison
    for row, n in enumerate(lengths):  # everything past each row's valid length
        for buffer in (past.cache.k, past.cache.v):
            _poison(buffer, row, slice(n, None), seed=2)
    context = [list(t) for t in clean.tokens]
    want = clean.generate(SamplingParams(max_new_tokens=12)).output_ids
    assert want == [hf_greedy(hf, c, 12) for c in context]
    got = valid.generate(SamplingParams(max_new_tokens=12)).output_ids
    assert got[0] != want[0], "the poisoned cache entries of row 0 were not read: the engine ran on a copy"
    assert got[1] == want[1]  # row 1's entries are untouched
    assert past.generate(SamplingParams(max_new_tokens=12)).output_ids == want  # past the length: never read

    # what ORT read: each session's own buffers (layer i's slice), nothing else (the caches never grew here)
    sessions = (clean, valid, past)
    for i in range(clean.cache.k.shape[0]):
        for kind in ("key", "value"):
            buffers = {(s.cache.k if kind == "key" else s.cache.v)[i].data_ptr() for s in sessions}
            assert bound.get(f"past_{kind}.{i}") == buffers, f"past_{kind}.{i} was bound to a copy of the cache"


def test_sessions_on_one_engine_interleave(bigram_case):
    """Each session owns its cache: alternating two live sessions gives each its own right answer."""
    hf, _, _, engine = bigram_case
    a, b = _prompts(10, (5,), 64), _prompts(11, (8, 3), 64)
    sa, sb = engine.session(a), engine.session(b)
    first_a = sa.generate(SamplingParams(max_new_tokens=6))
    first_b = sb.generate(SamplingParams(max_new_tokens=6))
    second_a = sa.generate(SamplingParams(max_new_tokens=9))
    second_b = sb.generate(SamplingParams(max_new_tokens=9))
    assert first_a.output_ids[0] + second_a.output_ids[0] == hf_greedy(hf, a[0], 15)
    assert [x + y for x, y in zip(first_b.output_ids, second_b.output_ids, strict=True)] == \
        [hf_greedy(hf, p, 15) for p in b]


def test_fp16_engine(tmp_path):
    """An fp16 engine builds, keeps an fp16 cache, and decodes like the fp16 reference generator
    (same dtype, same numerics tier); on this well-separated target both equal fp32 greedy."""
    from dlite_trt.loading import load_pair

    hf, spec = near_bigram_target(64, seed=21)
    draft = bigram_draft(hf, draft_config(spec, block_size=8, anchor_group_size=2))
    hf.save_pretrained(tmp_path / "target")
    save_draft(draft, tmp_path / "draft")
    build_engine(tmp_path / "target", tmp_path / "draft", tmp_path / "engine",
                 BuildSettings(dtype="fp16", limits=EngineLimits(max_batch=4, max_seq_len=128, max_chunk=8)),
                 progress=False)
    engine = open_engine(tmp_path / "engine")
    prompts = _prompts(12, (6, 15), 64)
    session = engine.session(prompts)
    result = session.generate(SamplingParams(max_new_tokens=NEW))
    assert session.cache.k.dtype == torch.float16 and engine.manifest.dtype == "fp16"
    reference = load_pair(tmp_path / "target", tmp_path / "draft", dtype="fp16").generator
    assert result.output_ids == reference.generate(prompts, SamplingParams(max_new_tokens=NEW)).output_ids
    assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]
