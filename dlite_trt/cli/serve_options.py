"""Options shared by `dlite-trt serve` and `dlite-trt triton-repo`."""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.cli.inputs import THREADS

ENGINE = click.option("--engine", required=True, type=click.Path(path_type=Path), metavar="DIRECTORY",
                      help="Engine directory from `dlite-trt build`.")  # not an engine: check_engine_dir, exit 1
INSTANCES = click.option("--instances", default=1, show_default=True, type=click.IntRange(min=1),
                         help="Model instances (each its own process with its own engine session).")
MAX_BATCH = click.option("--max-batch", type=click.IntRange(min=1),
                         help="Requests Triton batches into one engine batch [default: the engine's --max-batch].")
THREADS = click.option("--threads", type=THREADS,
                       help="ONNX Runtime intra-op threads per instance (default: one per core).")
