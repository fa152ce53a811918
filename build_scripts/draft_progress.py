#!/usr/bin/env python
"""A quick reading of a training run of train_smollm2_draft.py while it runs: the teacher-forced
acceptance length (and per-position agreement) of a stage-2 snapshot on the target's own greedy
output, over a few held-out standard-library files and chat instructions from held-out
functions (``train_smollm2_draft.agreement``); with --bigram, the same for a bigram table of the
run's corpus (each token's most frequent successor, chained), the floor a draft must clear.

A trend, not the recipe's measurement (which runs at the end: more prompts, 128 new tokens,
every step verifying the whole block).

    python build_scripts/draft_progress.py --work /work/runs/smollm2-corpus --step 500 [--bigram]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_smollm2_draft import Target, agreement  # noqa: E402  (the same target and measurement)


def bigram_table(corpus_dir: Path, vocab_size: int):
    """[V] int64: each token's most frequent successor in every part of the corpus."""
    import numpy as np

    from dlite_trt.training.corpus import read_corpus_mix

    pairs = np.concatenate([np.asarray(p.tokens[:-1], dtype=np.int64) * vocab_size + np.asarray(p.tokens[1:])
                            for p in read_corpus_mix(corpus_dir, vocab_size).parts])
    unique, counts = np.unique(pairs, return_counts=True)
    first, second = unique // vocab_size, unique % vocab_size
    order = np.lexsort((-counts, first))  # by token, most frequent successor first
    lead = np.r_[True, first[order][1:] != first[order][:-1]]
    table = np.zeros(vocab_size, dtype=np.int64)
    table[first[order][lead]] = second[order][lead]
    return table


def chained_bigram(table, outputs: list[list[int]], block: int) -> dict:
    """Teacher-forced reading of the bigram table as a draft: at each output position, how many
    of its chained proposals match the target's output."""
    kept, first_hits = [], []
    for out in outputs:
        for i in range(len(out) - 1):
            prev, n = out[i], 0
            while n < block - 1 and i + 1 + n < len(out) and table[prev] == out[i + 1 + n]:
                prev, n = out[i + 1 + n], n + 1
            kept.append(1 + n)
            first_hits.append(table[out[i]] == out[i + 1])
    return {"teacher_forced_acceptance_length": round(sum(kept) / len(kept), 3),
            "agreement_k1": round(sum(first_hits) / len(first_hits), 3)}


@click.command()
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="train_smollm2_draft.py's --work.")
@click.option("--step", type=click.IntRange(min=1), help="The stage-2 snapshot to read.")
@click.option("--bigram", is_flag=True, help="Also the bigram table of the run's corpus.")
@click.option("--prompts", default=6, show_default=True, type=click.IntRange(min=1), help="Prompts per set.")
@click.option("--new-tokens", default=96, show_default=True, type=click.IntRange(min=2))
def main(work: Path, step: int | None, bigram: bool, prompts: int, new_tokens: int) -> None:
    from safetensors.torch import load_file

    from dlite_trt.checkpoint import load_draft
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.prompts import coding_prompts

    if step is None and not bigram:
        raise click.UsageError("pass --step N, --bigram, or both")
    target = Target()
    cfg = load_draft(work / "init").cfg
    tok = target.tokenizer
    held = stdlib_files("held_out")
    sets = {"held_out_stdlib_files": [tok.encode(p.read_text(errors="replace"), add_special_tokens=False)[:256]
                                      for p in held[:prompts]],
            "held_out_chat_instructions": [ids for _, ids in coding_prompts(held, tok, counts={"chat": prompts},
                                                                             max_prompt_tokens=512, seed=1)]}
    adapter = TargetAdapter(target.hf, target.spec, cfg.target_layer_ids).eval()
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=target.stops)
    outputs = {name: [list(o) for o in SpeculativeGenerator.target_only(adapter).session(ps)
                      .generate_target_only(params).output_ids] for name, ps in sets.items()}
    report: dict = {"prompts": prompts, "new_tokens": new_tokens}
    if step is not None:
        snapshot = work / "student-runs" / "stage2-run" / f"snapshot-{step}.safetensors"
        if not snapshot.is_file():
            raise click.ClickException(f"{snapshot} does not exist (snapshots: every 250 steps of the full budget)")
        draft = DLiteDraft(cfg)
        draft.load_state_dict(load_file(str(snapshot)), strict=True)
        report[f"step_{step}"] = {name: {k: v for k, v in agreement(target, draft.eval(), sets[name], outs).items()
                                         if k in ("teacher_forced_acceptance_length", "per_position_agreement")}
                                  for name, outs in outputs.items()}
    if bigram:
        table = bigram_table(work / "corpus", target.spec.vocab_size)
        report["bigram"] = {name: chained_bigram(table, outs, cfg.block_size) for name, outs in outputs.items()}
    click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
