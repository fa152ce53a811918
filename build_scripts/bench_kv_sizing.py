#!/usr/bin/env python
"""KV cache sizing: a step costs what the sequence holds, not what its token budget allows.

Side by side in one run, interleaved, medians (this machine is shared and noisy):
1. the same prompt, the prefill and 10 greedy steps, at max_new_tokens 64 and 16000: the time of
   the 10 steps (they make the same tokens; the budget must not change their cost), and at 16000
   with the cache reserved up front as before, for scale;
2. at prompts of 256, 2k and 8k tokens (64 new tokens): the prefill and the mean step time with
   the cache sized as the sequence grows (``KVCache.reserve``, today's engine) against the cache
   reserved for prompt + max_new_tokens up front (the sizing before it, reproduced by reserving
   that capacity in the session before it generates).
Writes every figure to --out (JSON) and prints a table.

    dlite-trt build --out engines/bundled --max-seq-len 16640
    python build_scripts/bench_kv_sizing.py --engine engines/bundled
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from dlite_trt.bench.workloads import held_out_ids
from dlite_trt.runtime.session import SamplingParams

GRANULE = 128  # the sizing before: prompt + max_new_tokens + block, rounded up to this


def _prompt(tokenizer, length: int) -> list[int]:
    return held_out_ids(tokenizer, length)  # held-out standard-library code, files concatenated


def _run(engine, prompt: list[int], max_new_tokens: int, steps: int, upfront: bool) -> dict:
    """Prefill and ``steps`` steps; returns their times and the cache capacity the steps ran on."""
    session = engine.session([prompt])
    if upfront:
        block = engine.manifest.draft_config.block_size
        cap = -(-(len(prompt) + max_new_tokens + block) // GRANULE) * GRANULE
        session.cache.ensure_capacity(cap, max_capacity=cap)
    stream = session.stream(SamplingParams(max_new_tokens=max_new_tokens))
    start = time.perf_counter()
    next(stream)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        if next(stream, None) is None:
            break
        times.append(time.perf_counter() - start)
    stream.close()
    return {"prefill_s": prefill, "steps_s": sum(times), "step_s": statistics.mean(times), "steps": len(times),
            "capacity": session.cache.capacity, "tokens": list(session.tokens[0][len(prompt):])}


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="an ONNX Runtime engine directory with --max-seq-len of at least 16256")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1), help="interleaved repeats")
@click.option("--contexts", default="256,2048,8192", show_default=True, help="prompt lengths for part 2")
@click.option("--out", default=Path("kv_sizing.json"), show_default=True, type=click.Path(path_type=Path),
              help="where the JSON goes")
def main(engine_dir: Path, rounds: int, contexts: str, out: Path) -> None:
    from dlite_trt.engine.load import load_engine

    loaded = load_engine(engine_dir)
    engine, tokenizer = loaded.generator, loaded.tokenizer
    short = _prompt(tokenizer, 24)
    cases = {"64": (64, False), "16000": (16000, False), "16000_reserved_up_front": (16000, True)}
    budgets = {name: [] for name in cases}
    for budget, upfront in cases.values():  # warm-up: shapes planned, arenas allocated
        _run(engine, short, budget, 10, upfront)
    for i in range(rounds):
        for name, (budget, upfront) in list(cases.items())[:: 1 if i % 2 else -1]:  # the order alternates
            budgets[name].append(_run(engine, short, budget, 10, upfront))
    same_tokens = len({tuple(runs[0]["tokens"][:20]) for runs in budgets.values()}) == 1
    part1 = {b: {"ten_steps_ms": statistics.median(r["steps_s"] for r in runs) * 1e3,
                 "capacity": runs[0]["capacity"]} for b, runs in budgets.items()}
    part1["ratio_16000_over_64"] = part1["16000"]["ten_steps_ms"] / part1["64"]["ten_steps_ms"]
    part1["same_tokens"] = same_tokens

    part2 = {}
    for ctx in (int(c) for c in contexts.split(",")):
        prompt = _prompt(tokenizer, ctx)
        runs = {"sized_by_sequence": [], "reserved_up_front": []}
        for name, upfront in (("sized_by_sequence", False), ("reserved_up_front", True)):
            _run(engine, prompt, 64, 4, upfront)  # warm-up at this shape
        for i in range(rounds):
            for name, upfront in (("sized_by_sequence", False), ("reserved_up_front", True))[:: 1 if i % 2 else -1]:
                runs[name].append(_run(engine, prompt, 64, 10, upfront))
        part2[str(ctx)] = {name: {"prefill_ms": statistics.median(r["prefill_s"] for r in rs) * 1e3,
                                  "step_ms": statistics.median(r["step_s"] for r in rs) * 1e3,
                                  "capacity": rs[0]["capacity"]} for name, rs in runs.items()}
        part2[str(ctx)]["same_tokens"] = runs["sized_by_sequence"][0]["tokens"] == \
            runs["reserved_up_front"][0]["tokens"]
    report = {"engine": str(engine_dir), "rounds": rounds, "budget": part1, "contexts": part2}
    out.write_text(json.dumps(report, indent=2))
    click.echo(f"10 steps, 24-token prompt: max_new_tokens 64 {part1['64']['ten_steps_ms']:.1f} ms (cache "
               f"{part1['64']['capacity']}), 16000 {part1['16000']['ten_steps_ms']:.1f} ms (cache "
               f"{part1['16000']['capacity']}): ratio {part1['ratio_16000_over_64']:.3f}, same tokens {same_tokens}; "
               f"16000 with the cache reserved up front (the sizing before): "
               f"{part1['16000_reserved_up_front']['ten_steps_ms']:.1f} ms (cache "
               f"{part1['16000_reserved_up_front']['capacity']})")
    click.echo(f"{'context':>8} {'prefill new/old ms':>22} {'step new/old ms':>20} {'cache new/old':>15}")
    for ctx, row in part2.items():
        new, old = row["sized_by_sequence"], row["reserved_up_front"]
        click.echo(f"{ctx:>8} {new['prefill_ms']:>10.1f} / {old['prefill_ms']:<9.1f} {new['step_ms']:>9.2f} / "
                   f"{old['step_ms']:<8.2f} {new['capacity']:>7} / {old['capacity']:<6} same tokens {row['same_tokens']}")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
