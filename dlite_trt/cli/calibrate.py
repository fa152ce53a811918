"""`dlite-trt calibrate`: choose how many drafts an engine's greedy step verifies, on this machine."""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.cli.inputs import THREADS, check_engine_dir


@click.command("calibrate")
@click.option("--engine", required=True, type=click.Path(path_type=Path), metavar="DIRECTORY",
              help="Engine directory from `dlite-trt build`.")
@click.option("--prompts", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE.jsonl",
              help="Your traffic: a bench dataset (JSONL; prompts as text, or input_ids; each task's first turn is "
                   "a prompt) [default: code and coding requests from the held-out standard-library sources].")
@click.option("--threads", type=THREADS, help="ONNX Runtime intra-op threads (default: one per core).")
def command(engine: Path, prompts: Path | None, threads: int | None) -> None:
    """Measure the draft's acceptance curve and the step's cost at every width; write the engine's verify width.

    A greedy step then verifies the k of the draft's K proposals that gives the most tokens per
    second on this machine (verify_width.json in the engine directory; `--verify-drafts N` overrides it)."""
    check_engine_dir(engine)
    from dlite_trt.bench.calibrate import calibrate_engine
    from dlite_trt.paths import writable_dir

    writable_dir(engine, f"--engine {engine}")  # before measuring: verify_width.json goes there

    ids = None
    if prompts is not None:
        from dlite_trt.bench.workloads import read_jsonl
        from dlite_trt.engine.load import load_engine

        tokenizer = load_engine(engine, preload=(), verify_drafts=None).tokenizer  # a stale width file is replaced
        ids = [t.turns[0].ids(tokenizer) for t in read_jsonl(prompts)]
    _, text = calibrate_engine(engine, threads=threads, prompts=ids)
    click.echo(text)
