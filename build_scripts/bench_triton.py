#!/usr/bin/env python
"""Serving figures through a real Triton Inference Server: requests/s and latency p50/p99 at
concurrency 1, 4 and 16, and the overhead of Triton over calling the runtime directly.

Greedy requests of held-out standard-library code (PROMPT_TOKENS tokens each, --max-tokens new
tokens), sent over HTTP by one client thread per concurrent request (tritonclient). The direct
figure runs the same requests through `dlite_trt.serve.generation.RequestRunner` in this process, one
at a time, alternating with the concurrency-1 Triton runs. Writes every figure to --out (JSON).

    python build_scripts/bench_triton.py --engine engines/bundled
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

PROMPT_TOKENS = 256


def _percentiles(latencies: list[float]) -> dict:
    return {"p50_ms": float(np.percentile(latencies, 50)) * 1e3, "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
            "mean_ms": statistics.mean(latencies) * 1e3}


def triton_run(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import tritonclient.http as httpclient

    def one(prompt: list[int]) -> float:
        client = httpclient.InferenceServerClient(url)
        inputs = [httpclient.InferInput("input_ids", [1, len(prompt)], "INT64"),
                  httpclient.InferInput("max_tokens", [1, 1], "INT32"),
                  httpclient.InferInput("ignore_eos", [1, 1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt], np.int64))
        inputs[1].set_data_from_numpy(np.array([[max_tokens]], np.int32))
        inputs[2].set_data_from_numpy(np.array([[True]]))
        start = time.perf_counter()
        result = client.infer("dlite", inputs)
        elapsed = time.perf_counter() - start
        assert result.as_numpy("output_ids").size == max_tokens
        return elapsed

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(prompts), "requests_per_second": len(prompts) / wall,
            "output_tokens_per_second": len(prompts) * max_tokens / wall, **_percentiles(latencies)}


@click.command()
@click.option("--engine", type=click.Path(path_type=Path, file_okay=False),
              help="Engine directory [default: the bundled pair, built here].")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_triton.json"), show_default=True)
@click.option("--requests", "n_requests", default=48, show_default=True, type=click.IntRange(min=1),
              help="Requests per concurrency level.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default="1,4,16", show_default=True)
@click.option("--instances", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", type=click.IntRange(min=1), help="ONNX Runtime threads per instance and in the direct run.")
def main(engine: Path | None, out: Path, n_requests: int, max_tokens: int, concurrency: str, instances: int,
         threads: int | None) -> None:
    from transformers.utils import logging as hf_logging

    from dlite_trt.bench.workloads import held_out_ids
    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine, package_versions
    from dlite_trt.engine.load import load_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.serve.generation import RequestRunner
    from dlite_trt.serve.protocol import Request
    from dlite_trt.serve.server import TritonServer, free_port
    from dlite_trt.serve.triton_repo import write_repository

    hf_logging.disable_progress_bar()
    levels = [int(c) for c in concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if engine is None:
            engine = Path(tmp) / "engine"
            build_engine(*bundled_pair(), engine, BuildSettings(limits=EngineLimits(max_seq_len=1024)), progress=False)
        loaded = load_engine(engine, threads=threads)
        text = held_out_ids(loaded.tokenizer, PROMPT_TOKENS * 8)
        prompts = [text[(i % 8) * PROMPT_TOKENS : (i % 8 + 1) * PROMPT_TOKENS] for i in range(n_requests)]
        direct = RequestRunner(loaded)
        write_repository(engine, Path(tmp) / "repo", instances=instances, threads=threads)
        report = {"versions": package_versions(), "prompt_tokens": PROMPT_TOKENS, "max_tokens": max_tokens,
                  "instances": instances, "threads": threads or "default", "triton": []}
        with TritonServer(Path(tmp) / "repo", http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port()) as server:
            report["server"] = server.binary.describe()
            triton_run(server.http_url, prompts[:4], max_tokens, 1)  # warm-up: shapes, arenas
            direct.run([Request(tuple(p), max_tokens, ignore_eos=True) for p in prompts[:4]])
            direct_lat, triton_lat = [], []
            for p in prompts:  # concurrency 1: Triton and direct alternate request by request
                start = time.perf_counter()
                direct.run([Request(tuple(p), max_tokens, ignore_eos=True)])
                direct_lat.append(time.perf_counter() - start)
                triton_lat += [triton_run(server.http_url, [p], max_tokens, 1)["mean_ms"] / 1e3]
            report["direct_concurrency_1"] = _percentiles(direct_lat)
            report["triton_concurrency_1_alternating"] = _percentiles(triton_lat)
            report["overhead_p50_ms"] = (report["triton_concurrency_1_alternating"]["p50_ms"]
                                         - report["direct_concurrency_1"]["p50_ms"])
            report["overhead_p50_ratio"] = (report["triton_concurrency_1_alternating"]["p50_ms"]
                                            / report["direct_concurrency_1"]["p50_ms"])
            for c in levels:
                report["triton"].append(triton_run(server.http_url, prompts, max_tokens, c))
    out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"server: {report['server']}; {n_requests} requests of {PROMPT_TOKENS} prompt tokens, "
               f"{max_tokens} new tokens, greedy; {instances} instance(s)")
    for row in report["triton"]:
        click.echo(f"concurrency {row['concurrency']:>2}: {row['requests_per_second']:.1f} requests/s "
                   f"({row['output_tokens_per_second']:.0f} tokens/s), p50 {row['p50_ms']:.1f} ms, "
                   f"p99 {row['p99_ms']:.1f} ms")
    d, t = report["direct_concurrency_1"], report["triton_concurrency_1_alternating"]
    click.echo(f"concurrency 1, p50: direct {d['p50_ms']:.1f} ms, through Triton {t['p50_ms']:.1f} ms: overhead "
               f"{report['overhead_p50_ms']:.1f} ms ({report['overhead_p50_ratio']:.2f}x)")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
