#!/usr/bin/env python
"""Attention "gqa" (GroupQueryAttention writing the cache in place) against "ops" (standard ops
over the cache's slots and the new keys), call by call, in one process.

For each precision (fp32; int4 at accuracy levels 4 and 0), an engine of each attention is built
(or reused) under --work; then in --rounds interleaved rounds every engine times, at each
--contexts length, a target-only decode call (the tokens the runtime feeds: a decode token and
its dummy, ``runtime.engine.min_call_tokens``) and a step call verifying 1 and K drafts
(``bench.context_cost.burst_medians``: bursts of consecutive calls, the first untimed). Reported:
median ms per call, and the per-round ratio gqa / ops (median and range: pairs measured
seconds apart, so load shared by both cancels). One JSON object on stdout and in --out.

    python build_scripts/bench_attention.py --work /tmp/attention-engines --threads 2
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import click

PRECISIONS = {"fp32": {}, "int4-l4": {"weights": "int4", "int4_accuracy_level": 4},
              "int4-l0": {"weights": "int4", "int4_accuracy_level": 0}}
ATTENTIONS = ("ops", "gqa")


def _engine(work: Path, target: str, draft: str, precision: str, attention: str, max_seq_len: int) -> Path:
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    out = work / f"{precision}-{attention}"
    if not (out / "manifest.json").is_file():
        build_engine(target, draft, out, BuildSettings(attention=attention, limits=EngineLimits(
            max_batch=1, max_seq_len=max_seq_len, max_chunk=512), **PRECISIONS[precision]), progress=False)
    return out


def _calls(gen, context: int):
    import numpy as np

    from dlite_trt.bench.context_cost import decode_feed
    from dlite_trt.export.contract import dummy_inputs, steady_step
    from dlite_trt.runtime.engine import min_call_tokens

    manifest, k_max = gen.manifest, gen.cfg.num_proposals
    rng = np.random.default_rng(0)
    cache = gen.runner.new_cache(1)
    cache.reserve(context + 2 * gen.cfg.block_size, context + 2 * gen.cfg.block_size)
    sizes = {"batch": 1, "cache": cache.capacity}
    named = {"decode": ("decode", decode_feed(manifest, sizes, min_call_tokens(manifest), context, rng))}
    for k in (1, k_max):
        feed = dummy_inputs(manifest.contract["step"], sizes | steady_step(k),
                            vocab_size=manifest.target_spec.vocab_size, rng=rng)
        feed["past_len"][:] = context
        named[f"step k={k}"] = ("step", feed)
    return cache, named


@click.command()
@click.option("--target", default=None, help="[default: SmolLM2-135M-Instruct]")
@click.option("--draft", default=None, help="[default: the draft bundled for the target]")
@click.option("--work", required=True, type=click.Path(file_okay=False, path_type=Path), help="Engines go here.")
@click.option("--precisions", default="fp32,int4-l4,int4-l0", show_default=True)
@click.option("--contexts", default="256,2048", show_default=True)
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--runs", default=20, show_default=True, type=click.IntRange(min=10), help="Timed calls per round.")
@click.option("--threads", default=None, type=click.IntRange(min=1))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path))
def main(target: str | None, draft: str | None, work: Path, precisions: str, contexts: str, rounds: int, runs: int,
         threads: int | None, out: Path | None) -> None:
    from dlite_trt.bench.context_cost import burst_medians
    from dlite_trt.bundled import pair_or_default
    from dlite_trt.runtime.engine import open_engine

    target, draft = pair_or_default(target, draft)
    lengths = [int(c) for c in contexts.split(",")]
    names = [p for p in precisions.split(",") if p]
    unknown = set(names) - set(PRECISIONS)
    if unknown:
        raise click.UsageError(f"unknown precisions {sorted(unknown)}; choose from {sorted(PRECISIONS)}")
    engines = {(p, a): open_engine(_engine(work, str(target), str(draft), p, a, max(lengths) + 64), threads=threads)
               for p in names for a in ATTENTIONS}
    calls = {key: {ctx: _calls(gen, ctx) for ctx in lengths} for key, gen in engines.items()}
    times: dict = {key: [] for key in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for key in order:
            times[key].append(burst_medians(engines[key], calls[key], runs, None))
    report: dict = {"target": str(target), "draft": str(draft), "threads": threads, "rounds": rounds,
                    "machine": platform.processor() or platform.machine(), "calls": {}}
    for p in names:
        for ctx in lengths:
            for call in calls[(p, "ops")][ctx][1]:
                ms = {a: [t[ctx][call] * 1e3 for t in times[(p, a)]] for a in ATTENTIONS}
                ratios = [g / o for g, o in zip(ms["gqa"], ms["ops"], strict=True)]
                report["calls"][f"{p} ctx={ctx} {call}"] = {
                    **{f"{a}_ms": round(statistics.median(ms[a]), 2) for a in ATTENTIONS},
                    "gqa_over_ops": round(statistics.median(ratios), 3),
                    "gqa_over_ops_range": [round(min(ratios), 3), round(max(ratios), 3)]}
    text = json.dumps(report)
    click.echo(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
