"""`dlite-trt build`: compile a target and a DLite draft into an engine directory."""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.cli.inputs import check_random_weights

DEFAULT_MAX_SEQ_LEN = 4096  # lowered to the target's max_position_embeddings when that is less


@click.command("build")
@click.option("--target", help="Model directory, .gguf file or preset name (smollm2-135m, qwen3-8b, ...) "
                                  "[default: smollm2-135m, SmolLM2-135M-Instruct].")
@click.option("--draft", type=click.Path(path_type=Path),
              help="dlite_v1 draft checkpoint directory [default: the draft bundled for SmolLM2].")
@click.option("--out", required=True, type=click.Path(path_type=Path), metavar="DIRECTORY",  # a file: exit 1
              help="Engine directory to write (replaced only once the new engine is complete).")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default="onnxruntime", show_default=True,
              help="tensorrt: TensorRT plans (needs dlite-trt[trt] and an NVIDIA GPU).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Engine precision (bf16: tensorrt only).")
@click.option("--workspace", "workspace_gb", default=8.0, show_default=True, type=click.FloatRange(min=0.1),
              help="tensorrt: builder workspace, GB.")
@click.option("--timing-cache", type=click.Path(path_type=Path, dir_okay=False),
              help="tensorrt: timing cache file, read if present and updated (faster rebuilds).")
@click.option("--max-seq-len", type=click.IntRange(min=1),
              help="Longest sequence (prompt + generated tokens) the engine accepts "
                   f"[default: min({DEFAULT_MAX_SEQ_LEN}, the target's max_position_embeddings)].")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(min=1),
              help="Most sequences per batch.")
@click.option("--max-chunk", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens per prefill call; longer prompts are prefilled in chunks.")
@click.option("--random-weights", is_flag=True, help="With a preset --target: random weights of that shape.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def command(target: str | None, draft: Path | None, out: Path, backend: str, dtype: str, workspace_gb: float,
            timing_cache: Path | None, max_seq_len: int | None, max_batch: int, max_chunk: int, random_weights: bool,
            quiet: bool) -> None:
    """Compile a target (Qwen3, Llama or Qwen2) and a DLite draft into an engine directory.

    Without --target and --draft: SmolLM2-135M-Instruct and the DLite draft trained for it."""
    from transformers.utils import logging as hf_logging

    from dlite_trt.bundled import pair_or_default
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    check_random_weights(random_weights, target)
    hf_logging.disable_progress_bar()
    target, draft = pair_or_default(target, draft)
    settings = BuildSettings(backend=backend, dtype=dtype, random_weights=random_weights, workspace_gb=workspace_gb,
                             timing_cache=timing_cache, fit_seq_len_to_target=max_seq_len is None,
                             limits=EngineLimits(max_batch=max_batch, max_seq_len=max_seq_len or DEFAULT_MAX_SEQ_LEN,
                                                 max_chunk=max_chunk))
    manifest = build_engine(target, draft, out, settings, progress=not quiet)
    total = sum(r["bytes"] for r in manifest.files.values())
    click.echo(f"engine {out}: {backend} {dtype}, block size {manifest.block_size}, max batch {max_batch}, "
               f"max seq len {manifest.limits.max_seq_len}; {len(manifest.files)} files, {total / 2**20:.1f} MiB, "
               f"built in {manifest.build['seconds']:.1f} s")
