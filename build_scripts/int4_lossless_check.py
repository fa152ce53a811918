#!/usr/bin/env python
"""Does DLite's greedy output equal the same engine's target-only greedy output, per attention?

Builds (or reuses, under --work) an engine of the pair at --dtype / --int4-accuracy-level for
each of --attention gqa and ops, then on the openings of the held-out standard-library files
decodes each prompt greedily twice on each engine: speculatively (``generate``) and target-only
(``generate_target_only``). Prints one JSON line per attention: the prompts whose two outputs
differ, with the index of the first difference. docs/engine.md, int4 weights.

    python build_scripts/int4_lossless_check.py --work /tmp/lossless --threads 1
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--target", default=None, help="[default: SmolLM2-135M-Instruct]")
@click.option("--draft", default=None, help="[default: the draft bundled for the target]")
@click.option("--work", required=True, type=click.Path(file_okay=False, path_type=Path), help="Engines go here.")
@click.option("--weights", type=click.Choice(["int4", "float"]), default="int4", show_default=True)
@click.option("--int4-accuracy-level", "level", type=click.Choice(["4", "0"]), default="4", show_default=True)
@click.option("--prompts", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--new-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=None, type=click.IntRange(min=1))
def main(target: str | None, draft: str | None, work: Path, weights: str, level: str, prompts: int,
         prompt_tokens: int, new_tokens: int, threads: int | None) -> None:
    from dlite_trt.bundled import pair_or_default
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.loading import load_pair
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.tiny_models import stdlib_files

    target, draft = pair_or_default(target, draft)
    tokenizer = load_pair(target, draft).tokenizer
    texts = [f.read_text(errors="replace") for f in stdlib_files("held_out")[:prompts]]
    ids = [tokenizer.encode(t, add_special_tokens=False)[:prompt_tokens] for t in texts]
    params = SamplingParams(max_new_tokens=new_tokens)
    int4 = {"int4_accuracy_level": int(level)} if weights == "int4" else {}
    for attention in ("gqa", "ops"):
        out = work / f"{weights}-{level if int4 else 'float'}-{attention}"
        if not (out / "manifest.json").is_file():
            build_engine(target, draft, out, BuildSettings(weights=weights, attention=attention, limits=EngineLimits(
                max_batch=1, max_seq_len=prompt_tokens + new_tokens + 64, max_chunk=prompt_tokens), **int4),
                progress=False)
        engine = open_engine(out, threads=threads)
        differ = []
        for row, prompt in enumerate(ids):
            speculative = engine.generate([prompt], params).output_ids[0]
            target_only = engine.session([prompt]).generate_target_only(params).output_ids[0]
            first = next((i for i, (a, b) in enumerate(zip(speculative, target_only)) if a != b), None)
            if first is not None:
                differ.append({"prompt": row, "first_difference": first})
        click.echo(json.dumps({"attention": attention, "weights": weights, "level": int(level) if int4 else None,
                               "prompts": len(ids), "differ": differ}))


if __name__ == "__main__":
    main()
