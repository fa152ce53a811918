"""A target-only decode call computes its position on the kernels a speculative verify uses
(``runtime.engine.MIN_CALL_TOKENS``): ONNX Runtime computes a 1-row product on other kernels
than a 2-or-more-row one, and they round differently. Checked bitwise on every new KV entry of
every layer, in fp32 and at int4 accuracy level 4 (int8 activations, which turn such
differences into int8-sized ones); a planted row-count dependence (a decode call's entries
one ulp off) fails the same check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlite_trt.bundled import bundled_pair
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.export.contract import EngineLimits
from dlite_trt.export.nbits_levels import INT8_ACTIVATIONS
from dlite_trt.runtime import engine as engine_module
from dlite_trt.runtime.engine import open_engine
from dlite_trt.runtime.session import SamplingParams

PROMPT = list(range(20, 60))
GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module", params=["fp32", "int4-level-4"])
def engine(request, tmp_path_factory):
    settings = {"fp32": {}, "int4-level-4": {"weights": "int4", "int4_accuracy_level": INT8_ACTIVATIONS}}
    out = tmp_path_factory.mktemp(request.param) / "engine"
    build_engine(*bundled_pair(), out, BuildSettings(limits=EngineLimits(max_batch=2, max_seq_len=256, max_chunk=32),
                                                     attention="gqa", **settings[request.param]), progress=False)
    return open_engine(out, threads=1)


def _new_entries(engine, monkeypatch, call) -> np.ndarray:
    """The K entries (layers, batch, heads, tokens, dim) that the decode-graph call ``call(session, first
    token)`` makes right after the prefill of PROMPT writes into the cache (attention "gqa": the graph
    writes them in place, at slots len(PROMPT) onwards, and returns none)."""
    widths, infer = [], engine.runner.infer

    def recording(graph, feeds, cache):
        widths.append((feeds["block"] if "block" in feeds else feeds["input_ids"]).shape[1])
        return infer(graph, feeds, cache)

    monkeypatch.setattr(engine.runner, "infer", recording)
    session = engine.session([PROMPT])
    first = session._target_first(GREEDY, lambda *shape: None)
    call(session, first[0])
    monkeypatch.setattr(engine.runner, "infer", infer)
    return _cache_keys(session, len(PROMPT), widths[-1])


def _cache_keys(session, start: int, width: int) -> np.ndarray:
    return session.cache.k[:, :, :, start : start + width].numpy().copy()


def _decode(session, token):  # what target-only decoding runs
    session._target_next([token], [len(PROMPT)], GREEDY, lambda *shape: None)


def _verify(session, token):  # what a speculative step verifies: the token and two drafts
    session._target_verify([[token, 7, 9]], [len(PROMPT)], GREEDY, lambda *shape: None)


def test_a_decode_call_computes_its_token_as_a_verify_does(engine, monkeypatch):
    decoded, verified = (_new_entries(engine, monkeypatch, call)[..., 0, :] for call in (_decode, _verify))
    assert _new_entries(engine, monkeypatch, _decode).shape[-2] == engine_module.MIN_CALL_TOKENS
    assert np.array_equal(decoded, verified)
    infer = engine.runner.infer

    def rounding_by_rows(graph, feeds, cache):  # planted: a kernel that rounds a 2-row product its own way
        out = infer(graph, feeds, cache)
        if feeds.get("input_ids") is not None and feeds["input_ids"].shape[1] == engine_module.MIN_CALL_TOKENS:
            at = slice(int(feeds["past_len"][0]), int(feeds["past_len"][0]) + engine_module.MIN_CALL_TOKENS)
            cache.k[:, :, :, at] = torch.from_numpy(np.nextafter(cache.k[:, :, :, at].numpy(), np.float32(np.inf)))
        return out

    monkeypatch.setattr(engine.runner, "infer", rounding_by_rows)
    planted = _new_entries(engine, monkeypatch, _decode)[..., 0, :]
    assert not np.array_equal(planted, verified)


def test_a_verified_row_is_what_a_later_decode_call_computes(engine, monkeypatch):
    """The verify's row j (a draft among the call's new tokens) and the decode call that reaches
    that position later (the tokens before it now in the cache): bitwise the same KV entries at
    every layer. The attention reads every key from its own slot (attention "gqa"); over
    [cache slots; new keys] the same key sits at another column in the two calls and the sums
    take another order."""
    assert engine.manifest.attention == "gqa"
    drafts = [7, 9]
    verifying = engine.session([PROMPT])
    first = verifying._target_first(GREEDY, lambda *shape: None)[0]
    _verify(verifying, first)
    verified = _cache_keys(verifying, len(PROMPT) + 1, 2)
    decoding = engine.session([PROMPT])
    decoding._target_first(GREEDY, lambda *shape: None)
    later = []
    for i, token in enumerate([first, *drafts]):
        decoding._target_next([token], [len(PROMPT) + i], GREEDY, lambda *shape: None)
        later.append(_cache_keys(decoding, len(PROMPT) + i, 1)[..., 0, :])  # before the next call writes on
    assert np.array_equal(np.stack(later[1:], axis=-2), verified)
