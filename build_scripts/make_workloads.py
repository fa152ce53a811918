#!/usr/bin/env python
"""Write the bench workloads as JSONL datasets (seeded, reproducible), from real text on this machine.

The text is the held-out split of the standard library's own sources; prompt lengths are
counted with the given tokenizer (default: the bundled target's), so long-context prompts hit
their lengths in *that* tokenizer's tokens. `dlite-trt bench` builds the same workloads itself
(and writes the ones it ran next to its report); this script is for inspecting or editing
them, or feeding them back with `dlite-trt bench --dataset FILE`.

    python build_scripts/make_workloads.py --out workloads --seed 0
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("workloads"), show_default=True)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A model directory with a tokenizer [default: the bundled target's].")
@click.option("--quick", is_flag=True, help="The smaller workloads `dlite-trt bench --quick` runs.")
def main(out: Path, seed: int, tokenizer_dir: Path | None, quick: bool) -> None:
    from transformers import AutoTokenizer

    from dlite_trt.bench.names import WORKLOAD_NAMES
    from dlite_trt.bench.suite import default_workloads
    from dlite_trt.bench.workloads import write_jsonl
    from dlite_trt.bundled import bundled_pair

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or bundled_pair()[0])
    for name, tasks in default_workloads(WORKLOAD_NAMES, tokenizer, seed=seed, quick=quick).items():
        write_jsonl(tasks, out / f"{name}.jsonl")
        tokens = [sum(len(t.ids(tokenizer)) for t in task.turns) for task in tasks]
        click.echo(f"{out / f'{name}.jsonl'}: {len(tasks)} tasks, {sum(len(t.turns) for t in tasks)} turns, "
                   f"prompt tokens {min(tokens)}..{max(tokens)}")


if __name__ == "__main__":
    main()
