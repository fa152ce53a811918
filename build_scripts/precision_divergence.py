#!/usr/bin/env python
"""Where greedy output stops being identical in reduced precision (DESIGN 1.3).

In fp32, greedy speculative decoding equals target-only greedy decoding token for token (the
tests check it, and that target-only decoding here equals transformers'). In fp16/bf16,
verifying K+1 tokens in one call rounds differently from K+1 one-token calls, so they may
diverge. Per dtype and prompt this prints the first index where (a) speculative output differs
from target-only greedy, both through dlite-trt's runtime in that dtype, and (b) either differs
from fp32 target-only greedy. Prompts are the openings of held-out standard-library files.
One JSON object on stdout.

    python build_scripts/precision_divergence.py --target models/tiny/target --draft models/tiny/draft
"""

from __future__ import annotations

import json
from pathlib import Path

import click


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@click.command()
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--draft", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
def main(target: Path, draft: Path, prompts: int, prompt_tokens: int, new_tokens: int) -> None:
    from dlite_trt.loading import load_pair
    from dlite_trt.runtime.reference import SamplingParams
    from dlite_trt.tiny_models import stdlib_files

    params = SamplingParams(max_new_tokens=new_tokens)
    report: dict[str, object] = {"new_tokens": new_tokens, "dtypes": {}}
    texts = [f.read_text(errors="replace") for f in stdlib_files("held_out")[:prompts]]
    fp32_ref: list[list[int]] = []
    ids: list[list[int]] = []
    for name in ("fp32", "bf16", "fp16"):
        pair = load_pair(target, draft, dtype=name)
        if not ids:  # the tokenizer does not depend on the dtype: tokenize once
            if pair.tokenizer is None:
                raise click.ClickException(f"{target} has no tokenizer; this script tokenizes held-out files")
            ids = [pair.tokenizer.encode(t, add_special_tokens=False)[:prompt_tokens] for t in texts]
        rows = []
        for row, prompt in enumerate(ids):
            spec_out = pair.generator.generate([prompt], params).output_ids[0]
            ar = pair.generator.session([prompt]).generate_target_only(params).output_ids[0]
            if name == "fp32":
                fp32_ref.append(ar)
            rows.append({"speculative_vs_target_only": first_divergence(spec_out, ar),
                         "target_only_vs_fp32": first_divergence(ar, fp32_ref[row]),
                         "speculative_vs_fp32": first_divergence(spec_out, fp32_ref[row])})
        report["dtypes"][name] = rows
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
