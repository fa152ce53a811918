#!/usr/bin/env python
"""Engine benchmark (issue 3's figures), measured side by side in one run on this machine.

`dlite-trt bench` is the benchmark users run (workloads, baselines, reports); this script keeps
the engine-level figures: the engine against the PyTorch reference, and host overhead.

1. tokens/s of the ONNX Runtime engine vs the PyTorch reference generator: same prompts
   (openings of held-out standard-library files), greedy, batch 1, rounds interleaved;
2. host time outside the engine call as a share of the step time (engine timings);
3. cost of one speculative step / one target-only decode step, both through the engine, at
   contexts of 256, 2k and 8k tokens, and the step graph's kernel time split into target and
   draft by ONNX Runtime's profiler (the draft is history-free: its part must stay flat);
4. optionally (--qwen3-0.6b) a Qwen3-0.6B-shaped target with random weights: build time, peak
   memory, engine size, and a few steps through the engine.
Prints a summary and writes every figure to --out (JSON).

    python build_scripts/bench_engine.py --target models/tiny/target --draft models/tiny/draft
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from dlite_trt.bench.context_cost import step_profile, step_vs_decode
from dlite_trt.bench.workloads import held_out_ids


def throughput(engine, reference, prompts, new_tokens: int, rounds: int) -> dict:
    from dlite_trt.runtime.session import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    totals = {"engine": [0, 0.0], "reference": [0, 0.0]}
    host, step, al = [], [], []
    for gen in (engine, reference):  # warm-up: first runs allocate arenas and plan shapes
        gen.generate([prompts[0]], params)
    for _ in range(rounds):
        for name, gen in (("engine", engine), ("reference", reference)):
            for p in prompts:
                start = time.perf_counter()
                result = gen.generate([p], params)
                totals[name][1] += time.perf_counter() - start
                totals[name][0] += len(result.output_ids[0])
                if name == "engine":
                    step.append(result.timings["step"])
                    host.append(result.timings["step"] - result.timings["engine"])
                    al.append(result.mean_acceptance_length())
    tps = {name: n / s for name, (n, s) in totals.items()}
    return {"tokens_per_second": tps, "engine_over_reference": tps["engine"] / tps["reference"],
            "host_share_of_step_time": sum(host) / sum(step), "mean_acceptance_length": statistics.mean(al),
            "prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": new_tokens, "rounds": rounds}


def qwen3_06b(work: Path, steps: int) -> dict:
    """Build a Qwen3-0.6B-shaped engine with random weights in a subprocess; measure it."""
    from dlite_trt.config import DraftConfig
    from dlite_trt.presets import PRESETS
    from dlite_trt.tiny_models import write_random_draft

    spec = PRESETS["qwen3-0.6b"].spec
    cfg = DraftConfig.for_target(spec, num_hidden_layers=5, chs_num_layers=5, mask_token_id=151669,
                                 anchor_group_size=2, block_size=8, sequential_rank=256)
    write_random_draft(work / "draft", cfg)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dlite_trt.cli", "build", "--target", "qwen3-0.6b", "--random-weights",
                    "--draft", str(work / "draft"), "--out", str(work / "engine"), "--max-seq-len", "2048",
                    "--max-batch", "4", "--quiet"], check=True)
    build_s = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    files = {str(p.relative_to(work / "engine")): p.stat().st_size for p in (work / "engine").rglob("*") if p.is_file()}
    start = time.perf_counter()
    gen = subprocess.run([sys.executable, "-m", "dlite_trt.cli", "generate", "--engine", str(work / "engine"),
                          "--input-ids", ",".join(str(i) for i in range(100, 164)), "--max-new-tokens", str(steps),
                          "--json", "--ignore-eos"], check=True, capture_output=True, text=True)
    result = json.loads(gen.stdout)
    return {"build_seconds": build_s, "build_peak_rss_gib": peak_kib / 2**20,
            "peak_rss_note": "max RSS over child processes (the build is the largest)" if peak_kib > before else "",
            "engine_bytes": sum(files.values()), "largest_file": max(files.items(), key=lambda kv: kv[1]),
            "generate_wall_seconds": time.perf_counter() - start, "new_tokens": len(result["output_ids"]),
            "steps": len(result["acceptance_lengths"]), "timings": result["timings"]}


@click.command()
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Target directory [default: the bundled target].")
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Draft directory [default: the bundled draft].")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine dir (built here when missing).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_engine.json"), show_default=True)
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(min=2))
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--contexts", default="256,2048,8192", show_default=True)
@click.option("--threads", type=click.IntRange(min=1),
              help="ONNX Runtime intra-op threads for the engine (default: ONNX Runtime's, one per physical core).")
@click.option("--qwen3-0.6b", "big", is_flag=True, help="Also build and run a Qwen3-0.6B-shaped random target.")
def main(target: Path | None, draft: Path | None, engine: Path | None, out: Path, prompts: int, prompt_tokens: int,
         new_tokens: int, rounds: int, contexts: str, threads: int | None, big: bool) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from dlite_trt.bundled import bundled_pair, check_pair_options
    from dlite_trt.engine.build import BuildSettings, build_engine, package_versions
    from dlite_trt.engine.load import load_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.loading import load_pair

    hf_logging.disable_progress_bar()
    check_pair_options(target, draft)
    target, draft = (target, draft) if target is not None else bundled_pair()  # default: the tiny pair
    ctx = [int(c) for c in contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if engine is None or not (engine / "manifest.json").is_file():
            engine = engine or Path(tmp) / "engine"
            limits = EngineLimits(max_batch=8, max_seq_len=max(ctx) + 256, max_chunk=512)
            build_engine(target, draft, engine, BuildSettings(limits=limits), progress=False)
        loaded = load_engine(engine, target=target, draft=draft, threads=threads,
                             preload=("prefill", "step", "decode"))
        pair = load_pair(target, draft)
        tok = pair.tokenizer
        prompt_ids = [held_out_ids(tok, prompt_tokens, offset=i) for i in range(prompts)]
        report = {"machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                              "onnxruntime_threads": threads or "default"}, "versions": package_versions()}
        report["throughput"] = throughput(loaded.generator, pair.generator, prompt_ids, new_tokens, rounds)
        report["step_vs_decode"] = step_vs_decode(loaded.generator, {c: held_out_ids(tok, c) for c in ctx},
                                                  steps=32, rounds=rounds)
        report["step_profile"] = step_profile(engine, ctx)
        if big:
            report["qwen3_0.6b_random"] = qwen3_06b(Path(tmp), steps=8)
    out.write_text(json.dumps(report, indent=2) + "\n")
    t = report["throughput"]
    click.echo(f"tokens/s: engine {t['tokens_per_second']['engine']:.1f}, reference "
               f"{t['tokens_per_second']['reference']:.1f} -> {t['engine_over_reference']:.2f}x; "
               f"host share of step time {100 * t['host_share_of_step_time']:.1f}%; "
               f"mean acceptance length {t['mean_acceptance_length']:.2f}")
    for c, row in report["step_vs_decode"].items():
        click.echo(f"context {c:>5}: speculative step {row['speculative_step_ms']:.2f} ms, decode step "
                   f"{row['decode_step_ms']:.2f} ms, ratio {row['ratio']:.2f} ({row['ratio_vs_first_context']:.2f}x "
                   f"the first context's)")
    for c, row in report["step_profile"].items():
        click.echo(f"context {c:>5}, step graph kernels (ORT profiler, unoptimized graph): target "
                   f"{row['target_ms']:.2f} ms, draft {row['draft_ms']:.2f} ms, other {row['other_ms']:.2f} ms")
    if big:
        b = report["qwen3_0.6b_random"]
        click.echo(f"qwen3-0.6b random: build {b['build_seconds']:.0f} s, peak RSS {b['build_peak_rss_gib']:.1f} GiB, "
                   f"engine {b['engine_bytes'] / 2**30:.2f} GiB, {b['new_tokens']} tokens in {b['steps']} steps")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
