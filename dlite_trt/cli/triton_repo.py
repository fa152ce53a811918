"""`dlite-trt triton-repo`: a Triton model repository that serves an engine."""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.cli.inputs import check_engine_dir
from dlite_trt.cli.serve_options import ENGINE, INSTANCES, MAX_BATCH, THREADS


@click.command("triton-repo")
@ENGINE
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Repository directory to write (replaced if it is a dlite-trt repository).")
@INSTANCES
@MAX_BATCH
@click.option("--streaming", is_flag=True,
              help="Also a decoupled model, dlite_stream, that streams each step's tokens.")
@THREADS
def command(engine: Path, out: Path, instances: int, max_batch: int | None, streaming: bool,
            threads: int | None) -> None:
    """Write a Triton model repository that serves an engine (Python backend)."""
    check_engine_dir(engine)
    from dlite_trt.serve.triton_repo import write_repository

    names = write_repository(engine, out, instances=instances, max_batch=max_batch, streaming=streaming,
                             threads=threads)
    click.echo(f"wrote {out}: models {', '.join(names)}; serve it with "
               f"`tritonserver --model-repository {out}` where dlite-trt[triton] is installed")
