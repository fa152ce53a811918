#!/usr/bin/env python
"""Issue 29's figures, measured on real `dlite-trt serve` processes (the tests check the same
behaviours without timing them): how long /health takes to answer while the heaviest single
request is handled, how soon abandoned non-streamed requests leave the batch (in engine steps),
and the server's peak memory around a 20 MB body.

    python build_scripts/hostile_server_check.py [--engine DIR] [--out hostile_server_check.json]

Without --engine it builds the bundled tiny pair's engine (max_batch 4, max_seq_len 1024).
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import click


def _post(url_port: int, body: dict, timeout: float = 600) -> tuple[int, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, time.monotonic() - start


def _health_during(server, body: dict) -> dict:
    """The request's status and seconds, and /health's answer times (s) while it ran."""
    result, done, times = [], threading.Event(), []

    def run():
        result.append(_post(server.port, body))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.wait(0.05):
        start = time.monotonic()
        server.get("/health")
        if not done.is_set():
            times.append(time.monotonic() - start)
    status, seconds = result[0]
    return {"status": status, "request_s": round(seconds, 2), "health_answers": len(times),
            "health_max_s": round(max(times, default=0.0), 3),
            "health_median_s": round(statistics.median(times), 3) if times else None}


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _abandoned(server, prompt: list[int], model: str) -> dict:
    """Eight non-streamed requests of 1,000 tokens whose clients hang up after 0.3 s: engine step
    calls and seconds from just after the hang-up until the batch and the queue are empty."""
    metrics = server.metrics

    def steps(m: dict) -> float:
        return sum(v for k, v in m.items() if k.startswith("dlite_engine_calls_total") and 'graph="step' in k)

    before = metrics()
    server.abandon("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1000, "temperature": 0,
                                       "ignore_eos": True}, count=8, after_s=0.3)
    closed, at_close = time.monotonic(), metrics()  # just after the hang-up
    while (m := metrics())["dlite_running_batch_size"] or m["dlite_queue_depth"]:
        time.sleep(0.005)
    empty_s = time.monotonic() - closed
    made_steps = steps(at_close) - steps(before)
    step_s = 0.3 / made_steps if made_steps else float("nan")
    cancelled = 'dlite_requests_total{finish_reason="cancelled"}'
    return {"cancelled": m.get(cancelled, 0) - before.get(cancelled, 0),
            "steps_after_hang_up": steps(m) - steps(at_close), "seconds_to_empty": round(empty_s, 3),
            "mean_step_s_before": round(step_s, 4)}


@click.command()
@click.option("--engine", type=click.Path(path_type=Path, file_okay=False))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default="hostile_server_check.json",
              show_default=True)
def main(engine: Path | None, out: Path) -> None:
    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.serve.openai_process import OpenAIServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        if engine is None:
            engine = Path(tmp) / "engine"
            build_engine(*bundled_pair(), engine, BuildSettings(limits=EngineLimits(max_batch=4, max_seq_len=1024,
                                                                                   max_chunk=64)), progress=False)
        model, report = "m", {}
        huge = ("def handler(event, context):\n    return {'status': event.get('status', 200)}\n" * 270_000)[:20 << 20]
        heavy = {"20mb_prompt": {"model": model, "prompt": huge, "max_tokens": 1},
                 "1m_char_stop": {"model": model, "prompt": "x", "stop": "a" * 1_000_000, "max_tokens": 1}}
        raised = ("--max-body-mb", "64", "--max-prompt-chars", "100000000", "--max-stop-chars", "2000000")
        for limits, args in [("default_limits", ()), ("raised_limits", raised)]:
            with OpenAIServerProcess(engine, *args, model=model, threads=1) as server:
                for name, body in heavy.items():
                    peak = _peak_rss_mib(server.proc.pid)
                    report[f"{limits}_{name}"] = {**_health_during(server, body), "peak_rss_mib_before_after":
                                                  [round(peak, 1), round(_peak_rss_mib(server.proc.pid), 1)]}
                if not args:
                    report["abandoned"] = _abandoned(server, list(range(20, 40)), model)
    out.write_text(json.dumps(report, indent=1) + "\n")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
