"""A real Triton Inference Server (started and stopped here, on 127.0.0.1) serving an engine of the
bundled trained pair (its drafts are often accepted, several per step): HTTP and gRPC requests
return exactly the target-only greedy output with acceptance statistics that add up, streaming
returns the same tokens in order, stops inside a multi-token step cut there, 16 concurrent
clients are all served, malformed requests get clear errors and the server keeps serving, a
request that fails in the engine fails alone, a cancelled stream stops and frees the instance,
and nothing is left running after shutdown."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
from helpers import cut_at_stop_string, stop_inside_a_step, stop_string_inside_a_step

from dlite_trt.bundled import bundled_pair
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.engine.manifest import load_manifest
from dlite_trt.export.contract import EngineLimits
from dlite_trt.serve.server import TritonServer, free_port, group_members, port_free
from dlite_trt.serve.triton_model import FAULT_PROMPT_ENV
from dlite_trt.serve.triton_repo import write_repository

httpclient = pytest.importorskip("tritonclient.http", reason="needs dlite-trt[triton]")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs dlite-trt[triton]")
pytest.importorskip("pytriton", reason="needs dlite-trt[triton] (nvidia-pytriton bundles the server)")

MAX_SEQ_LEN = 1024  # room for a stream long enough to cancel in the middle
FAULT_PROMPT = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3]  # the test-only fault hook fails this prompt (and no other)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "engine"
    build_engine(*bundled_pair(), out, BuildSettings(limits=EngineLimits(max_batch=4, max_seq_len=MAX_SEQ_LEN,
                                                                    max_chunk=64)), progress=False)
    return out


@pytest.fixture(scope="module")
def repo(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("repo") / "repo"
    write_repository(engine, out, instances=1, streaming=True, threads=1)
    return out


def _ports() -> dict:
    return {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}


@pytest.fixture(scope="module")
def server(repo):
    server = TritonServer(repo, **_ports(), env={FAULT_PROMPT_ENV: ",".join(map(str, FAULT_PROMPT))}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(tiny_oracle):
    return tiny_oracle


@pytest.fixture(scope="module")
def proposals(engine) -> int:
    """Drafts each speculative step proposes (K)."""
    return load_manifest(engine).draft_config.num_proposals


def _prompt(i: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(i).integers(5, 500, n)]


def _inputs(module, prompt, max_tokens, more=()):
    inputs = []
    for name, value, dtype in (("input_ids", np.array([prompt], np.int64), "INT64"),
                               ("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
                               ("ignore_eos", np.array([[True]]), "BOOL"), *more):
        t = module.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    return inputs


def _http_infer(server, prompt, max_tokens, **extra):
    client = extra.get("client") or httpclient.InferenceServerClient(server.http_url)
    return client.infer("dlite", _inputs(httpclient, prompt, max_tokens, extra.get("more", ())))


def _stop_token(token: int) -> tuple:
    return ("stop_token_ids", np.array([[token]], np.int64), "INT64")


def _stop_string(stop: str) -> tuple:
    return ("stop", np.array([[stop.encode()]], dtype=np.object_), "BYTES")


def _sampled(temperature: float, seed: int) -> tuple:
    return (("temperature", np.array([[temperature]], np.float32), "FP32"),
            ("seed", np.array([[seed]], np.int64), "INT64"))


def _stats_of(result) -> dict:
    return {name: result.as_numpy(name).item()
            for name in ("accepted_draft_tokens", "proposed_draft_tokens", "mean_acceptance_length")}


def _grpc_stream(server, prompt, max_tokens, more=()) -> tuple[list[list[int]], str, dict]:
    """A gRPC stream to dlite_stream: each response's ids (one per engine call), the text, the last
    statistics."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("dlite_stream", _inputs(grpcclient, prompt, max_tokens, more),
                                  enable_empty_final_response=True)
        pieces, text, stats = [], "", {}
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return pieces, text, stats
            pieces.append(result.as_numpy("output_ids").reshape(-1).tolist())
            text += result.as_numpy("text_output").reshape(-1)[0].decode()
            stats = _stats_of(result)
    finally:
        client.stop_stream()


def _check_statistics(stats: dict, output: list[int], steps: int, proposals: int) -> None:
    """``steps`` speculative steps after the prefill made ``output``: the figures add up to it."""
    assert stats["mean_acceptance_length"] == pytest.approx((len(output) - 1) / steps)
    assert stats["proposed_draft_tokens"] == proposals * steps
    # every step keeps its n drafts and a bonus token, but the last may be cut before its bonus
    assert 0 < len(output) - 1 - steps <= stats["accepted_draft_tokens"] <= len(output) - steps


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_infer_equals_target_only_greedy(server, oracle, proposals):
    greedy, _ = oracle
    for i in range(3):
        prompt = _prompt(i, 5 + 9 * i)
        result = _http_infer(server, prompt, 48)
        output = result.as_numpy("output_ids").reshape(-1).tolist()
        assert output == greedy(prompt, 48)
        steps, _, _ = _grpc_stream(server, prompt, 48)  # the same request's engine steps
        assert [t for piece in steps for t in piece] == output
        _check_statistics(_stats_of(result), output, len(steps) - 1, proposals)


def test_http_generate_endpoint_with_text(server, oracle):
    greedy, tok = oracle
    text = "def parse_args(argv):\n    "
    status, body = _post(server, "/v2/models/dlite/generate", {"text_input": text, "max_tokens": 20,
                                                                "ignore_eos": True})
    assert status == 200, body
    want = greedy(tok.encode(text, add_special_tokens=False), 20)
    assert body["output_ids"] == want
    assert body["text_output"] == tok.decode(want, skip_special_tokens=True)


def test_grpc_infer_equals_target_only_greedy(server, oracle):
    greedy, _ = oracle
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt = _prompt(7, 30)
    inputs = [grpcclient.InferInput("input_ids", [1, len(prompt)], "INT64"),
              grpcclient.InferInput("max_tokens", [1, 1], "INT32"), grpcclient.InferInput("ignore_eos", [1, 1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt], np.int64))
    inputs[1].set_data_from_numpy(np.array([[32]], np.int32))
    inputs[2].set_data_from_numpy(np.array([[True]]))
    result = client.infer("dlite", inputs)
    assert result.as_numpy("output_ids").reshape(-1).tolist() == greedy(prompt, 32)


def test_grpc_streaming_sends_the_same_tokens_in_order(server, oracle, proposals):
    greedy, tok = oracle
    prompt = _prompt(11, 9)
    pieces, text, stats = _grpc_stream(server, prompt, 40)
    ids = [t for piece in pieces for t in piece]
    want = greedy(prompt, 40)
    assert ids == want
    assert text == tok.decode(want, skip_special_tokens=True)
    assert 1 < len(pieces) < 40 and len(pieces[0]) == 1  # one response per engine call, some steps keep several
    _check_statistics(stats, ids, len(pieces) - 1, proposals)


def test_concurrent_streams_share_the_in_flight_batch(server, oracle):
    """dlite_stream runs on the in-flight scheduler: streams sent together (different lengths, so
    they join and leave at different steps) are each exactly target-only greedy."""
    greedy, _ = oracle
    jobs = [(_prompt(60 + i, 6 + 2 * i), 10 + 6 * i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda job: [t for p in _grpc_stream(server, *job)[0] for t in p], jobs))
    assert got == [greedy(*job) for job in jobs]


def test_stops_inside_a_multi_token_step(server, oracle, proposals):
    """A stop token and a stop string at the first token of a step that accepted >= 2 drafts
    (found from a first stream's responses, one per step): over HTTP (the batched path) and a
    gRPC stream the output ends there, as target-only greedy cut at that place, and the cut
    step counts the one draft it kept."""
    greedy, tok = oracle
    prompt, n = _prompt(12, 10), 80
    pieces, _, _ = _grpc_stream(server, prompt, n)
    full = greedy(prompt, n)
    assert [t for piece in pieces for t in piece] == full
    kept = [len(piece) for piece in pieces[1:]]
    decode = partial(tok.decode, skip_special_tokens=True)
    token_step, at = stop_inside_a_step(kept, full)
    text_step, text_at, stop = stop_string_inside_a_step(decode, kept, full)
    cut_ids, cut_text = cut_at_stop_string(decode, full, stop)
    assert cut_ids == full[: text_at + 1]
    cases = [(_stop_token(full[at]), full[: at + 1], decode(full[: at + 1]), token_step),
             (_stop_string(stop), cut_ids, cut_text, text_step)]
    for more, want_ids, want_text, step in cases:
        # the steps before the cut one keep n + 1 tokens each; the cut one keeps its first draft
        want_stats = {"accepted_draft_tokens": sum(kept[:step]) - step + 1,
                      "proposed_draft_tokens": proposals * (step + 1),
                      "mean_acceptance_length": pytest.approx((len(want_ids) - 1) / (step + 1))}
        result = _http_infer(server, prompt, n, more=[more])
        assert result.as_numpy("output_ids").reshape(-1).tolist() == want_ids
        assert result.as_numpy("text_output").reshape(-1)[0].decode() == want_text
        assert _stats_of(result) == want_stats
        streamed, text, stats = _grpc_stream(server, prompt, n, [more])
        assert [t for piece in streamed for t in piece] == want_ids and text == want_text
        assert stats == want_stats


def test_sixteen_concurrent_clients(server, oracle):
    greedy, _ = oracle
    before = _stats(server)
    prompts = [_prompt(100 + i, 4 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _http_infer(server, p, 16).as_numpy("output_ids").reshape(-1).tolist(),
                                prompts))
    assert results == [greedy(p, 16) for p in prompts]
    after = _stats(server)
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == 16 and executions < 16  # concurrent requests were batched into engine batches


def _stats(server) -> dict:
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/dlite/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return {"inference_count": int(stats.get("inference_count", 0)),
            "execution_count": int(stats.get("execution_count", 0))}


@pytest.mark.parametrize(("body", "message"), [
    ({"max_tokens": 4}, "exactly one of text_input (a string) or input_ids"),
    ({"text_input": "x", "max_tokens": -3}, "max_tokens must be >= 0"),
    ({"text_input": "x", "max_tokens": 4, "top_k": 5}, "unknown request parameters ['top_k']"),
    ({"input_ids": list(range(5, 250)), "max_tokens": 900}, f"past the engine's --max-seq-len {MAX_SEQ_LEN}"),
    ({"input_ids": [5, 6, 100000], "max_tokens": 4}, "outside the vocabulary"),
    ({"text_input": "x", "temperature": -1.0}, "temperature must be a finite number >= 0"),
], ids=["missing-input", "negative-max-tokens", "unknown-parameter", "too-long", "bad-token", "bad-temperature"])
def test_malformed_requests_get_clear_errors_and_the_server_goes_on(server, oracle, body, message):
    status, reply = _post(server, "/v2/models/dlite/generate", body)
    assert status == 400 and message in reply["error"], reply
    greedy, _ = oracle
    assert _http_infer(server, _prompt(1), 8).as_numpy("output_ids").reshape(-1).tolist() == greedy(_prompt(1), 8)


def test_wrong_dtype_and_unknown_input_are_refused_by_triton(server):
    status, reply = _post(server, "/v2/models/dlite/infer", {"inputs": [
        {"name": "input_ids", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    assert status == 400 and "expects 'INT64'" in reply["error"]
    status, reply = _post(server, "/v2/models/dlite/infer", {"inputs": [
        {"name": "prompt", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]})
    assert status == 400 and "prompt" in reply["error"]
    status, reply = _post(server, "/v2/models/dlite/generate", {"text_input": "def f():", "max_tokens": 4})
    assert status == 200, reply


def _shm() -> set:
    from pathlib import Path

    return set(Path("/dev/shm").glob("triton_python_backend_shm_region_*"))


def test_shutdown_leaves_nothing_running(repo):
    ports = _ports()
    shm_before = _shm()
    server = TritonServer(repo, **ports).start()
    group, work = server.process.pid, server._work.name
    assert len(group_members(group)) >= 3  # the server and one backend stub per model
    assert _shm() - shm_before  # the stubs' shared memory
    server.stop()
    assert group_members(group) == []
    assert server.process.poll() is not None
    assert all(port_free("127.0.0.1", p) for p in ports.values())
    assert _shm() - shm_before == set()  # freed by the server's own shutdown
    from pathlib import Path

    assert not Path(work).exists()


def test_long_and_short_prompts_arriving_together(server, oracle):
    """Batched together they would pass the engine's --max-seq-len; each is served correctly."""
    greedy, _ = oracle
    long_, short = _prompt(50, MAX_SEQ_LEN - 16), _prompt(51, 5)
    jobs = [(long_, 8), (short, 200)] * 4
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: _http_infer(server, *job).as_numpy("output_ids").reshape(-1).tolist(), jobs))
    want = [greedy(p, n) for p, n in jobs[:2]] * 4
    assert got == want


def test_grpc_errors_are_invalid_argument(server):
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    n = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    n.set_data_from_numpy(np.array([[4]], np.int32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("dlite", [n])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "exactly one of text_input" in err.value.message()


def _cancel_lines(server) -> list[tuple[int, int]]:
    """(tokens made, max_tokens) of every stream the model logged as cancelled by its client."""
    pattern = r"stream cancelled by its client after (\d+) of max_tokens (\d+) tokens"
    return [(int(a), int(b)) for a, b in re.findall(pattern, server.log_path.read_text(errors="replace"))]


def test_a_cancelled_stream_stops_and_frees_the_instance(server, oracle):
    """A gRPC client cancels its stream after the first response: the model stops at its next
    step, short of max_tokens (it logs how far it got), and its only instance serves the next
    request. Without the check the stream would run all its steps and log nothing."""
    greedy, _ = oracle
    prompt, n = _prompt(90, 12), MAX_SEQ_LEN - 24
    before = _cancel_lines(server)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("dlite_stream", _inputs(grpcclient, prompt, n), enable_empty_final_response=True)
    result, error = responses.get(timeout=60)
    client.stop_stream(cancel_requests=True)  # at once: the whole stream takes a few seconds
    assert error is None and result.as_numpy("output_ids").reshape(-1).tolist() == greedy(prompt, 1)
    pieces, _, _ = _grpc_stream(server, _prompt(91, 6), 8)  # the same (only) instance
    assert [t for piece in pieces for t in piece] == greedy(_prompt(91, 6), 8)
    deadline = time.monotonic() + 30  # the stub's log lines reach the server's log asynchronously
    while len(after := _cancel_lines(server)) == len(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(after) == len(before) + 1, server.log_tail(20)
    (made, limit), = after[len(before):]
    assert limit == n and 1 <= made < n, (made, limit)


def _batch_sizes(server) -> dict[int, int]:
    """Executions of the dlite model per batch size so far."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/dlite/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}


def test_a_request_that_fails_in_the_engine_fails_alone(server, oracle):
    """The test-only fault hook (FAULT_PROMPT fails inside its engine run) in one Triton batch with
    a greedy request (the same engine batch) and a sampled one: only it gets an error; the others
    are answered as when alone. A long request sent first keeps the instance busy so the three
    queue up and the dynamic batcher joins them; repeated until the batch sizes show it did."""
    greedy, _ = oracle
    sampled_prompt = _prompt(93, 9)
    sampled_alone = _http_infer(server, sampled_prompt, 12, more=_sampled(0.8, 5)).as_numpy("output_ids")
    busy = (_prompt(94, 10), 200, ())
    jobs = [busy, (FAULT_PROMPT, 8, ()), (_prompt(92, 7), 16, ()), (sampled_prompt, 12, _sampled(0.8, 5))]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for _ in range(10):
        before, answers = _batch_sizes(server), [queue.Queue() for _ in jobs]
        for inputs, answer in [(_inputs(grpcclient, *job), answer) for job, answer in zip(jobs, answers, strict=True)]:
            client.async_infer("dlite", inputs, callback=lambda result, error, a=answer: a.put((result, error)))
        (long_, error), (_, failed), (good, good_error), (sampled, sampled_error) = (a.get(timeout=60) for a in answers)
        assert failed is not None and "injected test fault" in failed.message(), failed
        assert failed.status() == "StatusCode.INTERNAL"
        assert error is None and long_.as_numpy("output_ids").reshape(-1).tolist() == greedy(*busy[:2])
        assert good_error is None and good.as_numpy("output_ids").reshape(-1).tolist() == greedy(_prompt(92, 7), 16)
        assert sampled_error is None and sampled.as_numpy("output_ids").tolist() == sampled_alone.tolist()
        after = _batch_sizes(server)
        batches = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        # no request alone, or only the long one (sent first: the three after it cannot all pass the failing one)
        if batches.get(1, 0) == 0 or batches == {1: 1, 3: 1}:
            return
    pytest.fail("the failing request never shared a Triton batch")


def test_serve_command_runs_until_ctrl_c(engine, tmp_path):
    """`dlite-trt serve` starts a real server, answers, and on Ctrl-C stops it and everything it started."""
    import re
    import signal
    import subprocess
    import sys
    import time

    ports = _ports()
    proc = subprocess.Popen([sys.executable, "-m", "dlite_trt.cli", "serve", "--frontend", "triton", "--engine", str(engine),
                             "--threads", "1",
                             *(f"--{k.replace('_', '-')}={v}" for k, v in ports.items())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.monotonic() + 180
        while time.monotonic() < deadline and not any("Ctrl-C stops it" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
        output = "".join(lines)
        assert "bundled with nvidia-pytriton" in output or "tritonserver on PATH" in output, output
        server_pid = int(re.search(r"\(pid (\d+)\)", output).group(1))
        url = f"http://127.0.0.1:{ports['http_port']}/v2/models/dlite/generate"
        body = json.dumps({"input_ids": [5, 6, 7], "max_tokens": 4}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=60) as r:
            assert len(json.loads(r.read())["output_ids"]) <= 4
        proc.send_signal(signal.SIGINT)
        # the server gets 30 s to unload its models (TritonServer.stop), then its group is killed;
        # on a loaded CI machine the whole shutdown has taken more than 60 s
        try:
            code = proc.wait(150)
        except subprocess.TimeoutExpired:  # say what the process was doing with its signals
            from pathlib import Path

            status = Path(f"/proc/{proc.pid}/status").read_text()
            raise AssertionError("serve did not stop on SIGINT: "
                                 + " ".join(line for line in status.splitlines() if line.startswith("Sig"))) from None
        assert code == 0, proc.stdout.read()
        assert group_members(server_pid) == []
        assert all(port_free("127.0.0.1", p) for p in ports.values())
    finally:
        if proc.poll() is None:
            proc.kill()


def test_triton_repo_command(engine, tmp_path):
    from click.testing import CliRunner

    from dlite_trt.cli import main

    result = CliRunner().invoke(main, ["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "r"),
                                       "--instances", "2", "--max-batch", "2", "--streaming"])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "r/dlite/config.pbtxt").read_text()
    assert "max_batch_size: 2" in config and "count: 2" in config
    assert (tmp_path / "r/dlite_stream/config.pbtxt").is_file()
    result = CliRunner().invoke(main, ["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "r2"),
                                       "--max-batch", "9"])
    assert result.exit_code != 0 and "above the engine's --max-batch 4" in result.output
