"""A real Triton Inference Server (started and stopped here, on 127.0.0.1) serving a tiny engine:
HTTP and gRPC requests return exactly the target-only greedy output, streaming returns the same
tokens in order, 16 concurrent clients are all served, malformed requests get clear errors and
the server keeps serving, and nothing is left running after shutdown."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
from helpers import hf_greedy

from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.export.contract import EngineLimits
from dlite_trt.serve.server import TritonServer, free_port, group_members, port_free
from dlite_trt.serve.triton_repo import write_repository

httpclient = pytest.importorskip("tritonclient.http", reason="needs dlite-trt[triton]")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs dlite-trt[triton]")
pytest.importorskip("pytriton", reason="needs dlite-trt[triton] (nvidia-pytriton bundles the server)")

MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "engine"
    build_engine(*tiny_pair, out, BuildSettings(limits=EngineLimits(max_batch=4, max_seq_len=MAX_SEQ_LEN,
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
    server = TritonServer(repo, **_ports()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(tiny_pair):
    """Target-only greedy continuations from transformers, and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    return partial(hf_greedy, hf), AutoTokenizer.from_pretrained(tiny_pair[0])


def _prompt(i: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(i).integers(5, 500, n)]


def _http_infer(server, prompt, max_tokens, **extra):
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = []
    for name, value, dtype in (("input_ids", np.array([prompt], np.int64), "INT64"),
                               ("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
                               ("ignore_eos", np.array([[True]]), "BOOL"), *extra.get("more", ())):
        t = httpclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    return client.infer("dlite", inputs)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_infer_equals_target_only_greedy(server, oracle):
    greedy, _ = oracle
    for i in range(3):
        prompt = _prompt(i, 5 + 9 * i)
        result = _http_infer(server, prompt, 24)
        assert result.as_numpy("output_ids").reshape(-1).tolist() == greedy(prompt, 24)
        assert result.as_numpy("proposed_draft_tokens").item() >= result.as_numpy("accepted_draft_tokens").item()


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


def test_grpc_streaming_sends_the_same_tokens_in_order(server, oracle):
    greedy, tok = oracle
    prompt = _prompt(11, 9)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = [grpcclient.InferInput("input_ids", [1, len(prompt)], "INT64"),
              grpcclient.InferInput("max_tokens", [1, 1], "INT32"), grpcclient.InferInput("ignore_eos", [1, 1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt], np.int64))
    inputs[1].set_data_from_numpy(np.array([[40]], np.int32))
    inputs[2].set_data_from_numpy(np.array([[True]]))
    client.async_stream_infer("dlite_stream", inputs, enable_empty_final_response=True)
    ids, text, pieces = [], "", 0
    while True:
        result, error = responses.get(timeout=60)
        assert error is None, str(error)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
        ids += result.as_numpy("output_ids").reshape(-1).tolist()
        text += result.as_numpy("text_output").reshape(-1)[0].decode()
        pieces += 1
    client.stop_stream()
    want = greedy(prompt, 40)
    assert ids == want
    assert text == tok.decode(want, skip_special_tokens=True)
    assert 1 < pieces <= 40  # one response per engine step


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
    ({"input_ids": list(range(5, 250)), "max_tokens": 100}, f"past the engine's --max-seq-len {MAX_SEQ_LEN}"),
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
    long_, short = _prompt(50, 240), _prompt(51, 5)
    jobs = [(long_, 8), (short, 200)] * 4
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: _http_infer(server, *job).as_numpy("output_ids").reshape(-1).tolist(), jobs))
    assert got == [greedy(p, n) for p, n in jobs]


def test_grpc_errors_are_invalid_argument(server):
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    n = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    n.set_data_from_numpy(np.array([[4]], np.int32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("dlite", [n])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "exactly one of text_input" in err.value.message()


def test_serve_command_runs_until_ctrl_c(engine, tmp_path):
    """`dlite-trt serve` starts a real server, answers, and on Ctrl-C stops it and everything it started."""
    import re
    import signal
    import subprocess
    import sys
    import time

    ports = _ports()
    proc = subprocess.Popen([sys.executable, "-m", "dlite_trt.cli", "serve", "--engine", str(engine), "--threads", "1",
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
        assert proc.wait(60) == 0, proc.stdout.read()
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
