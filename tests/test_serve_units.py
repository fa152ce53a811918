"""Serving without a server: request parsing and its errors, the generated Triton config, and the
request runner (batched greedy requests, stops, streaming) against target-only greedy decoding.

The engine serves the bundled trained pair, whose drafts are often accepted (steps keep 1..8
tokens), so stops land inside multi-token steps and the acceptance statistics count real drafts."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
from helpers import cut_at_stop_string, hf_greedy, stop_inside_a_step, stop_string_inside_a_step
from transformers import AutoModelForCausalLM, AutoTokenizer

from dlite_trt.bundled import bundled_pair
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.engine.load import load_engine
from dlite_trt.engine.manifest import load_manifest
from dlite_trt.errors import DLiteError
from dlite_trt.export.contract import EngineLimits
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.serve.generation import Reply, RequestRunner
from dlite_trt.serve.protocol import INPUTS, Request, parse_request
from dlite_trt.serve.triton_repo import render_config, write_repository

LIMITS = {"vocab_size": 512, "max_seq_len": 64}


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 512 for c in text]


def _parse(**inputs):
    return parse_request({k: np.asarray(v) for k, v in inputs.items()}, tokenizer=_Tok(), **LIMITS)


def test_parse_valid_requests():
    r = _parse(text_input=np.array([b"abc"], dtype=object), max_tokens=np.array([[5]], np.int32),
               temperature=np.array([0.5], np.float32), seed=np.array([3]),
               stop=np.array([b"\n\n", b"END"], dtype=object),
               stop_token_ids=np.array([[7, 8]]), ignore_eos=np.array([True]))
    assert r == Request((97, 98, 99), 5, 0.5, 3, ("\n\n", "END"), (7, 8), True)
    assert _parse(input_ids=np.array([[1, 2, 3]])) == Request((1, 2, 3), max_tokens=61)  # the room left
    assert not _parse(input_ids=np.array([1]), temperature=np.array([0.7], np.float32)).greedy


@pytest.mark.parametrize(("inputs", "message"), [
    ({}, "exactly one of text_input"),
    ({"text_input": np.array([b"a"], dtype=object), "input_ids": np.array([1])}, "exactly one of text_input"),
    ({"input_ids": np.array([1]), "prompt": np.array([1])}, "unknown inputs ['prompt']"),
    ({"input_ids": np.array([1.0], np.float32)}, "input input_ids has datatype float32, expected INT64"),
    ({"input_ids": np.array([[1], [2]])}, "one request carries one prompt"),
    ({"input_ids": np.array([1]), "max_tokens": np.array([-1], np.int32)}, "max_tokens must be >= 0"),
    ({"input_ids": np.arange(60), "max_tokens": np.array([10], np.int32)},
     "70 tokens, past the engine's --max-seq-len 64"),
    ({"input_ids": np.array([1, 600])}, "outside the vocabulary [0, 512): [600]"),
    ({"input_ids": np.array([1]), "temperature": np.array([-0.5], np.float32)}, "must be a finite number >= 0"),
    ({"input_ids": np.array([1]), "temperature": np.array([np.inf], np.float32)}, "must be a finite number >= 0"),
    ({"input_ids": np.array([1]), "stop": np.array([b""], dtype=object)}, "stop strings must not be empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, "not valid UTF-8"),
    ({"input_ids": np.array([], np.int64)}, "the prompt is empty"),
    ({"input_ids": np.array([1]), "max_tokens": np.array([1, 2], np.int32)}, "must hold one value"),
])
def test_parse_errors_name_the_problem(inputs, message):
    with pytest.raises(DLiteError) as err:
        _parse(**inputs)
    assert message in str(err.value)


def test_parse_rejects_unknown_parameters_and_missing_tokenizer():
    with pytest.raises(DLiteError, match=r"unknown request parameters \['top_p'\]"):
        parse_request({"input_ids": np.array([1])}, tokenizer=None, parameters={"top_p": 0.9}, **LIMITS)
    with pytest.raises(DLiteError, match="no tokenizer; send input_ids"):
        parse_request({"text_input": np.array([b"a"], dtype=object)}, tokenizer=None, **LIMITS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("units") / "engine"
    build_engine(*bundled_pair(), out, BuildSettings(limits=EngineLimits(max_batch=2, max_seq_len=256, max_chunk=64)),
                 progress=False)
    return out


def test_config_comes_from_the_engine(engine):
    manifest = load_manifest(engine)
    text = render_config("dlite", manifest, instances=3, max_batch=2, decoupled=False)
    assert "max_batch_size: 2" in text and "count: 3, kind: KIND_CPU" in text
    assert "dynamic_batching" in text and "decoupled" not in text
    assert text.count("name: ") == 1 + len(INPUTS) + 5
    assert 'key: "max_seq_len" value: { string_value: "256" }' in text
    assert "TYPE_INT64" in text.split('name: "input_ids"')[1].split("}")[0]  # the contract's input_ids dtype
    stream = render_config("dlite_stream", manifest, instances=1, max_batch=1, decoupled=True, engine_dir="../e")
    assert "model_transaction_policy { decoupled: true }" in stream and "dynamic_batching" not in stream
    with pytest.raises(DLiteError, match="above the engine's --max-batch 2"):
        render_config("dlite", manifest, instances=1, max_batch=3, decoupled=False)
    gpu = render_config("dlite", dataclasses.replace(manifest, backend="tensorrt"), instances=2, max_batch=2,
                        decoupled=False)  # a TensorRT engine's instances run on GPUs
    cpu = render_config("dlite", manifest, instances=2, max_batch=2, decoupled=False)
    assert "count: 2, kind: KIND_GPU" in gpu and gpu.replace("KIND_GPU", "KIND_CPU") == cpu


def test_write_repository(engine, tmp_path):
    names = write_repository(engine, tmp_path / "repo", streaming=True)
    assert names == ["dlite", "dlite_stream"]
    assert (tmp_path / "repo/dlite/1/engine/manifest.json").is_file()
    assert not (tmp_path / "repo/dlite_stream/1/engine").exists()  # one engine copy
    assert "dlite_trt.serve.triton_model" in (tmp_path / "repo/dlite/1/model.py").read_text()
    write_repository(engine, tmp_path / "repo")  # replaces its own repository
    assert not (tmp_path / "repo/dlite_stream").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other/keep.txt").write_text("x")
    with pytest.raises(DLiteError, match="not a dlite-trt model repository"):
        write_repository(engine, tmp_path / "other")
    assert (tmp_path / "other/keep.txt").is_file()


@pytest.fixture(scope="module")
def served(engine):
    target = bundled_pair()[0]
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    return RequestRunner(load_engine(engine)), hf, AutoTokenizer.from_pretrained(target)


def _ids(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(5, 500, n))


def _alone(server, request: Request, **params):
    """The engine's own speculative generate of one request (no serving code): ids and per-step records."""
    params = {"max_new_tokens": request.max_tokens, "temperature": request.temperature, "seed": request.seed} | params
    result = server.generator.session([list(request.prompt)]).generate(SamplingParams(**params))
    return result.output_ids[0], [(s.kept[0], s.accepted[0], len(s.draft_tokens[0])) for s in result.steps]


def _check_statistics(reply: Reply, steps: list[tuple[int, int, int]]) -> None:
    """The reply's figures are those of ``steps`` (kept, n, K per step, from an independent run):
    per-step kept tokens plus the prefill's token are the output."""
    assert sum(k for k, _, _ in steps) + 1 == len(reply.output_ids)
    assert reply.accepted == sum(min(n, k) for k, n, _ in steps) > 0
    assert reply.proposed == sum(p for _, _, p in steps)
    assert reply.mean_acceptance_length == pytest.approx((len(reply.output_ids) - 1) / len(steps))


def test_batched_greedy_requests_equal_each_alone(served):
    server, hf, _ = served
    requests = [Request(_ids(i, 4 + 7 * i), max_tokens=m, ignore_eos=True) for i, m in enumerate((40, 7, 0, 33, 1))]
    replies = server.run(requests)  # 4 greedy requests with tokens: two engine batches (max batch 2)
    for request, reply in zip(requests, replies, strict=True):
        want = hf_greedy(hf, list(request.prompt), request.max_tokens) if request.max_tokens else []
        assert reply.output_ids == want
        if request.max_tokens > 1:  # its figures: the request's own steps, cut at its own max_tokens
            ids, steps = _alone(server, request)
            assert ids == want
            _check_statistics(reply, steps)
    assert max(k for k, _, _ in replies[0].steps) >= 3  # drafts were accepted, several in one step
    assert replies[2].output_ids == [] and replies[2].text == ""
    assert replies[4].output_ids == want[:1] and replies[4].accepted == replies[4].proposed == 0  # the prefill's


def test_stops(served):
    server, hf, tok = served
    prompt = _ids(3, 10)
    full = hf_greedy(hf, list(prompt), 40)
    stop_id = full[12]
    reply = server.run([Request(prompt, 40, stop_token_ids=(stop_id,), ignore_eos=True)])[0]
    assert reply.output_ids == full[: full.index(stop_id) + 1]
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    reply = server.run([Request(prompt, 40, stop=(stop,), ignore_eos=True)])[0]
    assert reply.text == text[: text.index(stop)]
    assert stop in tok.decode(reply.output_ids, skip_special_tokens=True)
    assert stop not in tok.decode(reply.output_ids[:-1], skip_special_tokens=True)


def _streamed(server, request: Request) -> tuple[list[int], str, Reply, int]:
    pieces = list(server.stream(request))
    ids = [t for _, new, _ in pieces for t in new]
    return ids, "".join(delta for delta, _, _ in pieces), pieces[-1][2], len(pieces)


def test_stops_inside_a_multi_token_step(served):
    """A stop token and a stop string chosen at the first token of a step that accepted >= 2
    drafts: the batched and the streamed output end there, as target-only greedy cut at that
    place, and the cut step counts only the draft it kept."""
    server, hf, tok = served
    prompt, n = _ids(3, 10), 60
    full = hf_greedy(hf, list(prompt), n)
    ids, steps = _alone(server, Request(prompt, n, ignore_eos=True))
    assert ids == full
    kept = [k for k, _, _ in steps]
    step, at = stop_inside_a_step(kept, full)
    want_steps = [*steps[:step], (1, steps[step][1], steps[step][2])]  # the cut step keeps d_1 only
    request = Request(prompt, n, stop_token_ids=(full[at],), ignore_eos=True)
    want = full[: full.index(full[at]) + 1]
    batched, (streamed, _, reply, _) = server.run([request])[0], _streamed(server, request)
    assert batched.output_ids == streamed == reply.output_ids == want
    _check_statistics(batched, want_steps)
    _check_statistics(reply, want_steps)

    decode = partial(tok.decode, skip_special_tokens=True)
    step, at, stop = stop_string_inside_a_step(decode, kept, full)
    want_steps = [*steps[:step], (1, steps[step][1], steps[step][2])]
    want_ids, want_text = cut_at_stop_string(decode, full, stop)
    assert want_ids == full[: at + 1]
    request = Request(prompt, n, stop=(stop,), ignore_eos=True)
    batched, (streamed, text, reply, _) = server.run([request])[0], _streamed(server, request)
    assert batched.output_ids == streamed == want_ids and batched.text == text == reply.text == want_text
    _check_statistics(batched, want_steps)
    _check_statistics(reply, want_steps)


def test_streaming_pieces_add_up_to_the_whole(served):
    """The pieces against what does not stream: greedy, the batched path (it never calls stream);
    sampled, the engine's own generate with the same seed, decoded by the tokenizer."""
    server, hf, tok = served
    greedy = Request(_ids(5, 8), 40, ignore_eos=True)
    ids, text, reply, pieces = _streamed(server, greedy)
    whole = server.run([greedy, Request(_ids(7, 8), 40, ignore_eos=True)])[0]  # an engine batch of two
    assert ids == whole.output_ids == hf_greedy(hf, list(greedy.prompt), 40)
    assert text == whole.text == tok.decode(ids, skip_special_tokens=True)
    assert list(reply._kept_steps()) == list(whole._kept_steps()) and reply.accepted > 0
    assert pieces >= len(reply.steps) + 1  # one piece per engine call

    sampled = Request(_ids(6, 8), 40, temperature=0.8, seed=1, ignore_eos=True)
    ids, text, reply, pieces = _streamed(server, sampled)
    want, steps = _alone(server, sampled)
    assert ids == want and text == tok.decode(want, skip_special_tokens=True)
    assert reply.steps == steps and pieces >= len(steps) + 1
    assert want != hf_greedy(hf, list(sampled.prompt), 40)  # it really sampled


def test_one_failing_request_does_not_fail_the_others(served):
    """The test-only fault hook fails the engine batch that holds one prompt: that request gets
    the exception, the greedy request batched with it and a sampled one their replies."""
    server, hf, _ = served
    bad, good, sampled = (Request(_ids(60, 6), 12, ignore_eos=True), Request(_ids(61, 9), 20, ignore_eos=True),
                          Request(_ids(62, 7), 10, temperature=0.7, seed=3, ignore_eos=True))
    assert server._greedy_batches([bad, good]) == [[0, 1]]  # one engine batch
    server.fault_prompt = bad.prompt
    try:
        results = server.run_each([bad, good, sampled])
        with pytest.raises(RuntimeError, match="injected test fault"):
            server.run([good, bad])
    finally:
        server.fault_prompt = None
    assert isinstance(results[0], RuntimeError) and "injected test fault" in str(results[0])
    assert results[1].output_ids == hf_greedy(hf, list(good.prompt), 20)
    assert results[2].output_ids == _alone(server, sampled)[0]


def test_a_long_and_a_short_prompt_are_not_batched_past_the_engine(served):
    """Each fits alone; together (longest prompt + largest max_tokens) they would not."""
    server, hf, _ = served
    long_, short = Request(_ids(20, 240), 8, ignore_eos=True), Request(_ids(21, 5), 200, ignore_eos=True)
    assert server._greedy_batches([long_, short]) == [[1], [0]]
    replies = server.run([long_, short])
    assert replies[0].output_ids == hf_greedy(hf, list(long_.prompt), 8)
    assert replies[1].output_ids == hf_greedy(hf, list(short.prompt), 200)


def test_end_tokens_stop_a_batch_early(served):
    """Rows stop at the engine's end tokens inside the batch (the engine here: one whose end token
    is a token the greedy output reaches), so the batch does not run on to max_tokens."""
    server, hf, _ = served
    a, b = _ids(30, 9), _ids(31, 12)
    full_a, full_b = hf_greedy(hf, list(a), 60), hf_greedy(hf, list(b), 60)
    saved = server.engine_stops
    server.engine_stops = (full_a[5], full_b[8])
    try:
        replies = server.run([Request(a, 60), Request(b, 60)])
    finally:
        server.engine_stops = saved
    for reply, full in zip(replies, (full_a, full_b), strict=True):
        stop = next(k for k, t in enumerate(full) if t in (full_a[5], full_b[8]))
        assert reply.output_ids == full[: stop + 1]
        assert sum(k for k, _, _ in reply._kept_steps()) == len(reply.output_ids) - 1


def test_streaming_a_stop_string_that_spans_tokens(served):
    server, hf, tok = served
    prompt = _ids(40, 10)
    full = hf_greedy(hf, list(prompt), 40)
    pieces = [tok.decode([t], skip_special_tokens=True) for t in full]
    k = next(k for k in range(3, 39) if pieces[k] and pieces[k + 1] and tok.decode(full[: k + 2]).count(
        pieces[k][-1] + pieces[k + 1][0]) == 1)
    stop = pieces[k][-1] + pieces[k + 1][0]  # ends one token, begins the next
    request = Request(prompt, 40, stop=(stop,), ignore_eos=True)
    streamed = list(server.stream(request))
    whole = server.run([request])[0]
    text = tok.decode(full, skip_special_tokens=True)
    assert whole.text == text[: text.index(stop)]
    assert "".join(t for t, _, _ in streamed) == whole.text  # never a piece of the stop string
    assert [i for _, ids, _ in streamed for i in ids] == whole.output_ids == full[: k + 2]
    assert list(streamed[-1][2]._kept_steps()) == list(whole._kept_steps())  # the same statistics


def test_acceptance_statistics_count_only_kept_tokens():
    reply = Reply(output_ids=list(range(10)), text="", steps=[(3, 2, 7), (1, 0, 7), (8, 7, 7), (8, 7, 7)])
    # 9 tokens after the prefill's: 3 + 1 + 5 of the third step's 8; the fourth step is not in the output
    assert list(reply._kept_steps()) == [(3, 2, 7), (1, 0, 7), (5, 5, 7)]
    assert (reply.accepted, reply.proposed, reply.mean_acceptance_length) == (7, 21, 3.0)
    assert Reply([1], "").mean_acceptance_length == 0.0
