#!/usr/bin/env python
"""Write a tiny Qwen3 target (config, safetensors, BPE tokenizer trained on the Python standard
library) and a matching random-initialised dlite_v1 draft. Seeded: the same files every run.

    python build_scripts/make_tiny_models.py --out models/tiny
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("models/tiny"), show_default=True)
@click.option("--vocab-size", default=2048, show_default=True, type=click.IntRange(min=300))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--anchor-group-size", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--block-size", default=8, show_default=True, type=click.IntRange(min=2))
def main(out: Path, vocab_size: int, seed: int, anchor_group_size: int, block_size: int) -> None:
    from dlite_trt.tiny_models import make_tiny_pair

    target, draft = make_tiny_pair(out, vocab_size=vocab_size, seed=seed,
                                   anchor_group_size=anchor_group_size, block_size=block_size)
    click.echo(f"target: {target}\ndraft:  {draft}")


if __name__ == "__main__":
    main()
