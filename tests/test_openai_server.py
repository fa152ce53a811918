"""The OpenAI-compatible server as a real process on 127.0.0.1 (started and stopped here), driven by
the real `openai` client and raw HTTP, on an engine of the bundled trained tiny pair (its drafts
are accepted, several per step on code): greedy output equals transformers' greedy decoding of
the target token for token (ids through the ``return_token_ids`` extension), streaming adds up
to the whole answer, concurrent clients are batched in flight, follow-up turns reuse the KV of
the previous turn and answer as an uncached request would, memory stays within --kv-cache-gb,
malformed requests get OpenAI's error shape and the server goes on, a client that goes away
frees its row, a request that fails in the engine fails alone, and SIGINT leaves nothing behind."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from helpers import SERVE_MAX_SEQ_LEN as MAX_SEQ_LEN
from helpers import cut_at_stop_string, stop_inside_a_step, stop_string_inside_a_step

from dlite_trt.serve.openai_process import OpenAIServerProcess
from dlite_trt.serve.scheduler import FAULT_PROMPT_ENV
from dlite_trt.serve.server import group_members, port_free
from dlite_trt.tiny_models import stdlib_files

openai = pytest.importorskip("openai", reason="the tests drive the server with the real openai client")
hypothesis = pytest.importorskip("hypothesis")

FAULT_PROMPT = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3]  # the test-only fault hook fails this prompt (and no other)
MODEL = "tiny"


class Server(OpenAIServerProcess):
    """``dlite-trt serve --frontend openai`` in a subprocess, with the real openai client."""

    def __init__(self, engine, *args: str, env: dict | None = None) -> None:
        super().__init__(engine, *args, model=MODEL, threads=1, env=env, start_timeout=120)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _calls(metrics: dict) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("dlite_engine_calls_total"))


@pytest.fixture(scope="module")
def engine(serve_engine):
    return serve_engine


@pytest.fixture(scope="module")
def server(engine):
    server = Server(engine, "--speculative", "dlite", env={FAULT_PROMPT_ENV: ",".join(map(str, FAULT_PROMPT))})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(tiny_oracle):
    return tiny_oracle


@pytest.fixture(scope="module")
def code(oracle):
    """40 pieces of 600 tokens of held-out standard-library code (which the tiny draft predicts well),
    starting 300 tokens apart."""
    _, tok = oracle
    ids = [t for p in stdlib_files("held_out") for t in tok.encode(p.read_text(errors="replace"),
                                                                     add_special_tokens=False)]
    assert len(ids) >= 40 * 300 + 600
    return [ids[300 * i: 300 * i + 600] for i in range(40)]


def _complete(server, prompt, max_tokens, **extra):
    """A completion through the openai client: (output ids, text, the response as a dict)."""
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True,
                                                     **extra.pop("extra_body", {})}, **extra).model_dump()
    return r["choices"][0]["token_ids"], r["choices"][0]["text"], r


def _stream(server, prompt, max_tokens, **extra):
    """A streamed completion: (each chunk's ids, the text, the final chunk, the usage chunk)."""
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra.pop("extra_body", {})}, **extra))
    chunks = [c.model_dump() for c in chunks]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] is not None
    body = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"] is None]
    final = chunks[-2]
    return [c["choices"][0]["token_ids"] for c in body], "".join(c["choices"][0]["text"] for c in body), final, usage


def test_completions_equal_target_only_greedy_with_multi_token_steps(server, oracle, code):
    greedy, tok = oracle
    steps = []
    for prompt in code[:3]:
        prompt = prompt[:48]
        ids, text, r = _complete(server, prompt, 40)
        assert ids == greedy(prompt, 40)
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert r["choices"][0]["finish_reason"] == "length" and r["object"] == "text_completion"
        assert r["usage"]["prompt_tokens"] == len(prompt) and r["usage"]["completion_tokens"] == 40
        spec = r["speculative"]
        assert spec["mean_acceptance_length"] == pytest.approx(39 / spec["steps"], abs=1e-3)
        assert spec["proposed_draft_tokens"] == 7 * spec["steps"]
        steps.append(spec["mean_acceptance_length"])
    assert max(steps) > 1.5  # drafts are accepted: multi-token steps are what these tests exercise


def test_a_text_prompt_and_the_model_list(server, oracle):
    greedy, tok = oracle
    text = "def parse_args(argv):\n    "
    ids, out, _ = _complete(server, text, 24)
    assert ids == greedy(tok.encode(text, add_special_tokens=False), 24)
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.get("/health")[0] == 200


def test_chat_completions_use_the_chat_template(server, oracle):
    greedy, tok = oracle
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Parse a file."}]
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r["prompt_token_ids"] == list(prompt)
    assert r["choices"][0]["token_ids"] == greedy(list(prompt), 30)
    assert r["choices"][0]["message"] == {**r["choices"][0]["message"], "role": "assistant",
                                          "content": tok.decode(greedy(list(prompt), 30), skip_special_tokens=True)}
    stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        r["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streaming_adds_up_to_the_whole_answer(server, code):
    prompt = code[3][:40]
    ids, text, r = _complete(server, prompt, 48)
    pieces, streamed, final, usage = _stream(server, prompt, 48)
    assert [t for p in pieces for t in p] == ids and streamed == text
    assert len(pieces[0]) == 1 and max(map(len, pieces)) > 1  # the prefill's token, then whole steps
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["speculative"] == r["speculative"]
    assert usage["usage"]["completion_tokens"] == 48


def test_stops_inside_a_multi_token_step(server, oracle, code):
    """A stop token id and a stop string at the first token of a step that accepted >= 2 drafts
    (found from a first stream's chunks, one per engine call): the output ends there, as greedy
    cut at that place, finish_reason is "stop", and the cut step counts the one draft it kept."""
    greedy, tok = oracle
    prompt, n = code[5][:30], 80
    pieces, _, _, _ = _stream(server, prompt, n)
    full = greedy(prompt, n)
    assert [t for p in pieces for t in p] == full
    kept = [len(p) for p in pieces[1:]]
    decode = partial(tok.decode, skip_special_tokens=True)
    token_step, at = stop_inside_a_step(kept, full)
    text_step, text_at, stop = stop_string_inside_a_step(decode, kept, full)
    cut_ids, cut_text = cut_at_stop_string(decode, full, stop)
    cases = [({"extra_body": {"stop_token_ids": [full[at]]}}, full[: at + 1], decode(full[: at + 1]), token_step),
             ({"stop": [stop]}, cut_ids, cut_text, text_step)]
    for extra, want_ids, want_text, step in cases:
        ids, text, r = _complete(server, prompt, n, **extra)
        assert (ids, text) == (want_ids, want_text)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["speculative"]["accepted_draft_tokens"] == sum(kept[:step]) - step + 1
        assert r["speculative"]["proposed_draft_tokens"] == 7 * (step + 1)
        streamed_ids, streamed, final, _ = _stream(server, prompt, n, **extra)
        assert ([t for p in streamed_ids for t in p], streamed) == (want_ids, want_text)
        assert final["choices"][0]["finish_reason"] == "stop"


def test_sixteen_concurrent_clients_are_batched_in_flight(server, oracle, code):
    """16 clients with different lengths through a 4-row engine: all exact, fewer engine calls than
    the same requests one by one, and requests joined the batch while others were mid-generation."""
    greedy, _ = oracle
    jobs = [(code[10 + i][: 20 + 3 * i], 12 + 2 * i) for i in range(16)]
    want = [greedy(p, n) for p, n in jobs]
    before = server.metrics()
    alone = [_complete(server, p, n)[0] for p, n in jobs]
    middle = server.metrics()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda job: _complete(server, *job)[0], jobs))
    after = server.metrics()
    assert alone == want and together == want
    assert _calls(after) - _calls(middle) < _calls(middle) - _calls(before)
    assert after["dlite_requests_joined_running_batch_total"] > middle["dlite_requests_joined_running_batch_total"]


def test_a_follow_up_turn_reuses_the_previous_turn(server, oracle, code):
    greedy, _ = oracle
    turn1 = code[30][:60]
    answer1, _, r1 = _complete(server, turn1, 20)
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = turn1 + answer1 + code[31][:25]  # the whole context so far, then a new "user" turn
    before = server.metrics()
    answer2, _, r2 = _complete(server, turn2, 20)
    assert answer2 == greedy(turn2, 20)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(turn1) <= cached < len(turn2)
    after = server.metrics()
    assert after["dlite_prefix_cache_reused_tokens_total"] - before["dlite_prefix_cache_reused_tokens_total"] == cached
    # diverging inside the kept sequence: its common prefix is reused, the rest prefilled
    fork = turn1[:33] + code[32][:20]
    answer3, _, r3 = _complete(server, fork, 20)
    assert answer3 == greedy(fork, 20)
    kept = turn2 + answer2  # longer than the fork: compare the fork's length only
    common = next(i for i in range(len(fork)) if fork[i] != kept[i])
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == common


def _wait_for_generation(server, before: dict, timeout: float = 60.0) -> None:
    """Returns once the server has generated tokens since `before` (a fixed sleep is too short on a loaded
    machine, where the requests may not have been admitted yet)."""
    deadline = time.monotonic() + timeout
    while server.metrics()["dlite_generation_tokens_total"] == before["dlite_generation_tokens_total"]:
        assert time.monotonic() < deadline, "the server generated nothing in time"
        time.sleep(0.01)


def test_seeded_sampling_is_reproducible_with_reuse_and_in_a_mixed_batch(server, engine, oracle, code):
    """A seeded sampled request gives the tokens the engine gives it alone (a batch of one), again
    when it reuses its own kept prefix, and while sharing the batch with greedy requests (which
    stay exact)."""
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    greedy, _ = oracle
    prompt = code[33][:40]
    alone = list(open_engine(engine, threads=1).session([prompt]).generate(
        SamplingParams(max_new_tokens=24, temperature=0.8, seed=5)).output_ids[0])

    def sampled():
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.8, seed=5,
                                             extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
        return r["choices"][0]["token_ids"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, _ = sampled()
    again, cached = sampled()
    assert first == alone and again == alone and cached > 0
    jobs = [(code[34 + i][:30], 120) for i in range(3)]
    before = server.metrics()
    with ThreadPoolExecutor(4) as pool:
        greedy_runs = [pool.submit(_complete, server, *job) for job in jobs]
        _wait_for_generation(server, before)  # they are mid-generation when the sampled one joins
        mixed = pool.submit(sampled)
        greedy_out = [f.result()[0] for f in greedy_runs]
    assert mixed.result()[0] == alone
    assert greedy_out == [greedy(p, n) for p, n in jobs]
    joined = server.metrics()["dlite_requests_joined_running_batch_total"]
    assert joined > before["dlite_requests_joined_running_batch_total"]  # it did share a running batch


BAD = [  # (body or raw text, status, fragment of the message, param)
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": -1}, 400, "greater than or equal to 1", "max_tokens"),
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens"),
    ({"model": MODEL, "prompt": [5, 6], "temperature": 2.5}, 400, "less than or equal to 2", "temperature"),
    ({"model": MODEL, "prompt": [5, 6], "top_k": 40}, 400, "set it to -1", "top_k"),
    ({"model": MODEL, "prompt": [5, 6], "repetition_penalty": 1.2}, 400, "set it to 1", "repetition_penalty"),
    ({"model": MODEL, "prompt": [5, 6], "min_tokens": 3}, 400, "ignore_eos", "min_tokens"),
    ({"model": MODEL, "prompt": [5, 6], "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "include_usage", "stream_options.continuous_usage_stats"),
    ({"model": MODEL, "prompt": [5, 6], "temperature": -0.5}, 400, "greater than or equal to 0", "temperature"),
    ({"model": MODEL, "prompt": [5] * (MAX_SEQ_LEN - 4), "max_tokens": 16}, 400, "--max-seq-len", "max_tokens"),
    ({"model": MODEL, "prompt": [5] * (MAX_SEQ_LEN + 4)}, 400, "shorten it", "prompt"),
    ({"model": MODEL, "prompt": [5, 6], "max_tokens": "ten"}, 400, "valid integer", "max_tokens"),
    ({"model": MODEL, "prompt": [5, 6], "frobnicate": True}, 400, "unknown field", "frobnicate"),
    ({"model": MODEL, "prompt": [5, 6], "n": 2}, 400, "one choice per request", "n"),
    ({"model": MODEL, "prompt": [5, 6], "top_p": 0.5}, 400, "top_p", "top_p"),
    ({"model": MODEL, "prompt": [5, 6], "stop": [""]}, 400, "must not be empty", "stop"),
    ({"model": MODEL, "prompt": [5, 10**6]}, 400, "outside the vocabulary", "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt is empty", "prompt"),
    ({"model": MODEL, "prompt": [5, 6], "stream_options": {"include_usage": True}}, 400, "only allowed with stream",
     "stream_options"),
    ({"prompt": [5, 6]}, 400, "required", "model"),
    ({"model": "gpt-4", "prompt": [5, 6]}, 404, "does not exist", "model"),
    ('{"model": "tiny", "prompt": [5, 6', 400, "not valid JSON", None),
]


@pytest.mark.parametrize(("body", "status", "fragment", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_requests_get_openai_errors_and_the_server_goes_on(server, oracle, body, status, fragment, param):
    greedy, _ = oracle
    got, reply = server.post("/v1/completions", body)
    assert got == status, reply
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
    assert fragment in reply["error"]["message"] and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    assert _complete(server, [9, 8, 7], 6)[0] == greedy([9, 8, 7], 6)


def test_fields_clients_echo_back_are_taken(server, oracle):
    """What agent frameworks send with the history (an assistant message's null tool_calls and
    refusal, metadata, store): taken and ignored, the answer unchanged."""
    greedy, tok = oracle
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "tool_calls": None, "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "Write a loop."}]}]
    status, r = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 12,
                                                     "temperature": 0, "metadata": {"run": "1"}, "store": False,
                                                     "ignore_eos": True, "return_token_ids": True})
    assert status == 200, r
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "Write a loop."}
             for m in messages]
    prompt = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r["choices"][0]["token_ids"] == greedy(list(prompt), 12)


def test_what_openai_and_vllm_clients_send_is_taken(server, oracle):
    """Newer OpenAI parameters that change nothing here, vLLM's extensions at their no-op values
    and chat_template_kwargs: the answer is target-only greedy's of the rendered prompt. OpenAI's
    developer role renders as the template's system role; continue_final_message continues the
    assistant's message; a completion without max_tokens runs 16 tokens (OpenAI's default)."""
    greedy, tok = oracle

    def chat(messages, **extra):
        status, r = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                         "temperature": 0, "return_token_ids": True, **extra})
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == greedy(r["prompt_token_ids"], 8)
        return r["prompt_token_ids"]

    ask = [{"role": "user", "content": "Write a loop."}]
    assert chat(ask, prompt_cache_key="k", prompt_cache_retention="24h", safety_identifier="u1", verbosity="low",
                top_k=-1, min_p=0.0, repetition_penalty=1.0, min_tokens=0, chat_template_kwargs={"enable_thinking": 0},
                add_generation_prompt=True) == tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True,
                                                                       return_dict=False)
    terse = [{"role": "system", "content": "Be terse."}, *ask]
    assert chat([{"role": "developer", "content": "Be terse."}, *ask]) == tok.apply_chat_template(
        terse, add_generation_prompt=True, tokenize=True, return_dict=False)
    started = [*ask, {"role": "assistant", "content": "for i in"}]
    assert chat(started, add_generation_prompt=False, continue_final_message=True) == tok.apply_chat_template(
        started, continue_final_message=True, tokenize=True, return_dict=False)
    r = server.client.completions.create(model=MODEL, prompt=[9, 8, 7], temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].model_extra["token_ids"] == greedy([9, 8, 7], 16)
    assert server.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")


def test_a_body_that_is_not_a_json_object_says_so(server):
    """Sent without the JSON Content-Type (curl -d), or empty: the error names the fix."""
    for data, headers in [(json.dumps({"model": MODEL, "prompt": [5]}).encode(),
                           {"Content-Type": "application/x-www-form-urlencoded"}), (b"", {})]:
        req = urllib.request.Request(server.url + "/v1/completions", data=data, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 400
        assert "Content-Type: application/json" in json.loads(err.value.read())["error"]["message"]


def test_an_api_key_guards_the_v1_routes(engine, oracle):
    """--api-key (vLLM's): the openai client with another key or none gets 401, with it the answer;
    /health stays open."""
    greedy, _ = oracle
    server = Server(engine, "--api-key", "s3cret")
    try:
        for key in ("wrong", "unused"):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError, match="--api-key"):
                client.models.list()
        assert server.get("/health")[0] == 200
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0, timeout=120)
        assert _complete(server, [9, 8, 7], 6)[0] == greedy([9, 8, 7], 6)
    finally:
        server.stop()


def test_chat_errors(server):
    for body, fragment, param in [
            ({"model": MODEL, "messages": []}, "at least 1 item", "messages"),
            ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "messages.0.role"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
             "tools.0.function: required", "tools.0.function"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
             "greater than or equal to 1", "max_completion_tokens"),
            ({"model": MODEL, "messages": [{"role": "user", "content": None}]}, "needs content", "messages.0.content"),
            ({"model": MODEL, "messages": [{"role": "user"}]}, "needs content", "messages.0.content"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
             "may not set tools", "chat_template_kwargs"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
             "must be an assistant message", "continue_final_message"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "web_search_options": {}},
             "web search", "web_search_options"),
            # a history of calls where the engine's template renders none: not dropped silently
            ({"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]}, "--chat-template", "messages"),
            ({"model": MODEL, "messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "1", "type": "function"}]}]},
             "messages.0.tool_calls.0.function: required", "messages.0.tool_calls.0.function")]:
        status, reply = server.post("/v1/chat/completions", body)
        assert status == 400 and fragment in reply["error"]["message"] and reply["error"]["param"] == param, reply
    status, reply = server.post("/v1/nothing", {})
    assert status == 404 and "no route" in reply["error"]["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, oracle, code):
    greedy, _ = oracle
    before = server.metrics()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": code[38][:20], "max_tokens": 900,
                                                        "temperature": 0, "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first chunk: the row is running
    with ThreadPoolExecutor(2) as pool:
        others = pool.map(lambda job: _complete(server, *job)[0], [(code[39][:20], 30), (code[37][:20], 30)])
        conn.sock.shutdown(2)
        conn.close()
        assert list(others) == [greedy(code[39][:20], 30), greedy(code[37][:20], 30)]
    cancelled = 'dlite_requests_total{finish_reason="cancelled"}'
    deadline = time.monotonic() + 30
    while ((after := server.metrics()).get(cancelled, 0) == before.get(cancelled, 0)
           or after["dlite_running_batch_size"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    made = after["dlite_generation_tokens_total"] - before["dlite_generation_tokens_total"]
    assert made < 900  # it stopped well short of max_tokens
    assert after["dlite_running_batch_size"] == 0


def test_a_request_that_fails_in_the_engine_fails_alone(server, engine, oracle, code):
    """The test-only fault hook fails the engine call of every step that holds FAULT_PROMPT (after the
    step's random draws). It joins a batch of a greedy and a seeded sampled request: the batched
    call fails and is retried one row at a time with the same draws, so only it gets an error
    (500) and the others get exactly what they get alone."""
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    greedy, _ = oracle
    greedy_job, sampled_prompt = (code[20][:30], 80), code[21][:30]
    alone = list(open_engine(engine, threads=1).session([sampled_prompt]).generate(
        SamplingParams(max_new_tokens=60, temperature=0.8, seed=11)).output_ids[0])
    before = server.metrics()
    with ThreadPoolExecutor(3) as pool:
        good = pool.submit(_complete, server, *greedy_job)
        sampled = pool.submit(lambda: server.client.completions.create(
            model=MODEL, prompt=sampled_prompt, max_tokens=60, temperature=0.8, seed=11,
            extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()["choices"][0]["token_ids"])
        time.sleep(0.2)  # they are running when the failing one joins their batch
        status, reply = server.post("/v1/completions", {"model": MODEL, "prompt": FAULT_PROMPT, "max_tokens": 8})
        assert good.result()[0] == greedy(*greedy_job) and sampled.result() == alone
    assert status == 500 and "injected test fault" in reply["error"]["message"]
    assert reply["error"]["type"] == "server_error"
    assert server.metrics()["dlite_engine_call_retries_total"] > before["dlite_engine_call_retries_total"]


def test_metrics_names(server):
    text = server.get("/metrics")[1]
    for name in ("dlite_requests_total", "dlite_prompt_tokens_total", "dlite_generation_tokens_total",
                 "dlite_time_to_first_token_seconds_bucket", "dlite_time_per_output_token_seconds_bucket",
                 "dlite_queue_depth", "dlite_running_batch_size", "dlite_speculative_steps_total",
                 "dlite_draft_tokens_proposed_total", "dlite_draft_tokens_accepted_total",
                 'dlite_accepted_tokens_per_position_total{position="7"}', "dlite_prefix_cache_queries_total",
                 "dlite_prefix_cache_hits_total", "dlite_prefix_cache_reused_tokens_total",
                 "dlite_prefix_cache_evictions_total", "dlite_kv_cache_bytes", "dlite_engine_calls_total"):
        assert re.search(rf"^{re.escape(name)}", text, re.M), name


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(fields=hypothesis.strategies.fixed_dictionaries({}, optional={
    "model": hypothesis.strategies.sampled_from([MODEL, "other", "", 3]),
    "prompt": hypothesis.strategies.one_of(hypothesis.strategies.text(max_size=20),
                                           hypothesis.strategies.lists(hypothesis.strategies.integers(-3, 600),
                                                                       max_size=12),
                                           hypothesis.strategies.none(), hypothesis.strategies.just([["x"]])),
    "messages": hypothesis.strategies.lists(hypothesis.strategies.fixed_dictionaries(
        {"role": hypothesis.strategies.sampled_from(["user", "system", "assistant", "bot"])},
        optional={"content": hypothesis.strategies.one_of(hypothesis.strategies.text(max_size=10),
                                                          hypothesis.strategies.integers())}), max_size=3),
    "max_tokens": hypothesis.strategies.one_of(hypothesis.strategies.integers(-3, 8), hypothesis.strategies.text(
        max_size=3), hypothesis.strategies.floats(allow_nan=False), hypothesis.strategies.none()),
    "temperature": hypothesis.strategies.one_of(hypothesis.strategies.floats(-1, 3), hypothesis.strategies.text(
        max_size=2)),
    "seed": hypothesis.strategies.one_of(hypothesis.strategies.integers(-2**70, 2**70), hypothesis.strategies.none()),
    "stop": hypothesis.strategies.one_of(hypothesis.strategies.text(max_size=3),
                                         hypothesis.strategies.lists(hypothesis.strategies.text(max_size=3),
                                                                     max_size=3)),
    "stream": hypothesis.strategies.booleans(),
    "n": hypothesis.strategies.integers(-1, 3),
    "return_token_ids": hypothesis.strategies.booleans(),
}), unknown=hypothesis.strategies.dictionaries(hypothesis.strategies.text(max_size=4),
                                               hypothesis.strategies.integers(), max_size=1),
   path=hypothesis.strategies.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_request_bodies_never_get_a_5xx(server, fields, unknown, path):
    """Bodies built from valid and invalid values of every field (now and then an unknown one):
    never a 5xx, never a hang."""
    body = {**unknown, **fields}
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status = r.status
            r.read()
    except urllib.error.HTTPError as e:
        status = e.code
        error = json.loads(e.read())
        assert set(error["error"]) == {"message", "type", "param", "code"}
    assert status < 500, body


def test_after_the_fuzz_the_server_answers_exactly(server, oracle):
    greedy, _ = oracle
    assert _complete(server, [11, 12, 13], 10)[0] == greedy([11, 12, 13], 10)


def test_memory_stays_within_the_kv_budget(engine, oracle, code):
    """A burst of long two-turn sessions on a server whose --kv-cache-gb holds the running batch and
    a few kept sequences: kept sequences are evicted, the KV bytes never pass the budget, and
    every answer is exact (a turn whose prefix was evicted just prefills it)."""
    greedy, _ = oracle
    server = Server(engine, "--kv-cache-gb", "0.01")
    try:
        sessions = [code[i][:400] for i in range(8)]

        def session(prompt):
            first = _complete(server, prompt, 12)[0]
            follow = prompt + first + [5, 6, 7]
            return first, follow, _complete(server, follow, 12)[0]

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(session, sessions))
        for prompt, (first, follow, second) in zip(sessions, results, strict=True):
            assert first == greedy(prompt, 12) and second == greedy(follow, 12)
        m = server.metrics()
        assert m["dlite_prefix_cache_evictions_total"] > 0
        assert 0 < m["dlite_kv_cache_peak_bytes"] <= m["dlite_kv_cache_budget_bytes"] == int(0.01 * 2**30)
    finally:
        server.stop()


@pytest.mark.parametrize("method", ["ngram", "none", "dlite-ngram"])
def test_the_servers_own_baselines(engine, oracle, code, method):
    """The baselines, and DLite with n-gram lookup: exact; dlite-ngram skips the draft on steps
    where every row has a lookup proposal (the decode graph) and drafts on the others."""
    greedy, _ = oracle
    server = Server(engine, "--speculative", method)
    try:
        prompt = code[2][:50]
        repeated = prompt[:20] * 3  # text that repeats: the lookup finds matches
        ids, _, r = _complete(server, prompt, 40)
        assert ids == greedy(prompt, 40)
        assert _complete(server, repeated, 40)[0] == greedy(repeated, 40)
        if method == "none":
            assert r["speculative"]["proposed_draft_tokens"] == 0
            assert r["speculative"]["mean_acceptance_length"] == 1.0
        if method == "dlite-ngram":
            m = server.metrics()
            assert m['dlite_engine_calls_total{graph="step"}'] > 0 and m['dlite_engine_calls_total{graph="decode"}'] > 0
            # batches of one, each prompt one chunk: two prefill calls (on the prefill graph, or on the decode
            # graph where drafting the first block does not pay), every other decode call a step that skipped the draft
            calls = (m['dlite_engine_calls_total{graph="decode"}']
                     + m.get('dlite_engine_calls_total{graph="prefill"}', 0))
            assert m["dlite_draft_skipped_total"] > 0
            assert m["dlite_draft_skipped_total"] == calls - 2
    finally:
        server.stop()


@pytest.mark.parametrize("speculative", ["dlite", "dlite-ngram"])
def test_each_batch_size_verifies_its_calibrated_width(engine, oracle, code, tmp_path, speculative):
    """verify_width.json's per-batch widths drive the scheduler: a batch of one that calibrated to 2
    verifies 2 drafts a step; batch sizes that calibrated to 0 decode on the decode graph with no
    draft (counted as skipped); the output is target-only greedy's either way, across the switches."""
    import shutil

    from dlite_trt.runtime import verify_width

    greedy, _ = oracle
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    k_max = 7
    ms = {k: 1.0 + k for k in range(1, k_max + 1)}
    planted = verify_width.WidthChoice(2, (0.5,) * k_max, ms, 1.0, "planted", {
        1: verify_width.BatchWidth(2, ms, 1.0), 2: verify_width.BatchWidth(0, ms, 1.0)})
    verify_width.save(copy, planted)
    server = Server(copy, "--speculative", speculative)
    try:
        prompt = code[4][:60]
        ids, _, r = _complete(server, prompt, 30)
        assert ids == greedy(prompt, 30)
        m = server.metrics()
        if speculative == "dlite":  # alone: every step verified exactly 2 drafts
            assert r["speculative"]["proposed_draft_tokens"] == 2 * m['dlite_engine_calls_total{graph="step"}'] > 0
            assert m.get("dlite_draft_skipped_total", 0) == 0
        prompts = [code[i][:40 + 8 * i] for i in range(4)]
        with ThreadPoolExecutor(4) as pool:  # they join one batch: widths 0 (2..4 rows) and 2 (the last one left)
            outs = list(pool.map(lambda p: _complete(server, p, 40)[0], prompts))
        assert outs == [greedy(p, 40) for p in prompts]
        after = server.metrics()
        assert after["dlite_draft_skipped_total"] > m.get("dlite_draft_skipped_total", 0)
        assert after['dlite_engine_calls_total{graph="decode"}'] > m.get('dlite_engine_calls_total{graph="decode"}', 0)
    finally:
        server.stop()


def test_bench_serve_replays_agent_sessions(engine, code, tmp_path):
    """`dlite-trt bench-serve` (the agentic replay, no tools) on this engine, two configs and two
    concurrencies, over sessions of three turns: every turn of every config gives the same tokens
    (the replay's own check), later turns reuse the earlier turns' prefix, and the report is whole."""
    from click.testing import CliRunner

    from dlite_trt.cli import main

    dataset = tmp_path / "sessions.jsonl"
    dataset.write_text("".join(json.dumps({"task_id": f"s{i}", "input_ids": code[i][:80], "output_tokens": 12,
                                           "turns": [{"input_ids": code[i + 10][:30], "output_tokens": 12}] * 2})
                               + "\n" for i in range(2)))
    result = CliRunner().invoke(main, ["bench-serve", "--engine", str(engine), "--dataset", str(dataset),
                                       "--concurrency", "1,2", "--speculative", "dlite,none", "--reuse", "on",
                                       "--threads", "1", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["greedy_mismatches"] == 0 and set(report["configs"]) == {"dlite/reuse", "none/reuse"}
    assert report["turns"] == 6 and report["turns_cut_to_fit_the_engine"] == 0
    for config in report["configs"].values():
        for concurrency in ("1", "2"):
            run = config["by_concurrency"][concurrency]
            assert run["requests"] == 6 and run["output_tokens_per_s"] > 0 and run["tool_calls"] == 0
            assert all(t["cached_tokens"] > 0 for t in run["turns"] if t["turn"] > 0)


def test_sigint_stops_the_server_and_leaves_nothing(engine, oracle):
    greedy, _ = oracle
    server = Server(engine)
    assert any("(speculative: dlite-ngram)" in line for line in server.log), server.log  # the default
    assert _complete(server, [4, 5, 6], 5)[0] == greedy([4, 5, 6], 5)
    pid = server.proc.pid
    assert server.stop() == 0
    assert group_members(pid) == [] and port_free("127.0.0.1", server.port)
