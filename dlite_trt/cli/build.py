"""`dlite-trt build`: compile a target and a DLite draft into an engine directory."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from dlite_trt.cli.inputs import check_random_weights
from dlite_trt.export.nbits_levels import (
    BLOCK_FORMS,
    DEFAULT_BLOCKS,
    DEFAULT_HEAD,
    DRAFT_FORMATS,
    HEAD_WEIGHTS,
    PREFILL_WEIGHTS,
    ZP_SCHEME,
)

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
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16", "int4"]), default="fp32", show_default=True,
              help="Engine precision (bf16: tensorrt only). int4: the target's projection matrices 4-bit "
                   "(onnxruntime), fp32 between the matmuls (see --int4-accuracy-level and --int4-blocks).")
@click.option("--int4-blocks", "int4_blocks", type=click.Choice(BLOCK_FORMS), default=None,
              help=f"With --dtype int4: the target's 4-bit blocks [default: {DEFAULT_BLOCKS}]. native: ONNX Runtime's own form, a scale and a "
                   "4-bit zero point per block of 32 (a Q4_0 GGUF's blocks as they are, a Q4_1 GGUF's re-fitted "
                   "from its weights, other targets quantized into it): the fastest. ggml: llama.cpp's, a Q4_1/Q4_0 "
                   "GGUF's own blocks exactly (other targets round-to-nearest Q4_1); Q4_1's float minima then cost "
                   "an extra float product per matrix (docs/engine.md).")
@click.option("--int4-accuracy-level", "int4_accuracy_level", type=click.Choice(["4", "0"]), default=None,
              help="With --dtype int4: MatMulNBits' accuracy level [default: 4 with --attention gqa, else 0]. "
                   "4: int8 activations inside the quantized matmuls (per block of 32, as onnxruntime-genai's CPU "
                   "int4 models run) and the LM head quantized (--head-weights), faster "
                   "(docs/engine.md). 0: fp32 compute, weight-only: fp32 arithmetic on the dequantized weights, the LM head "
                   "float. Speculative output equals the engine's target-only greedy at both levels with "
                   "--attention gqa; with --attention ops only at level 0 (a verify and a decode call sum "
                   "attention in another order, which level 4's int8 rounding turns into other tokens at near-ties).")
@click.option("--head-weights", "head_weights", type=click.Choice(HEAD_WEIGHTS), default=None,
              help="With --dtype int4 at accuracy level 4: the LM head's blocks [default: " + DEFAULT_HEAD + "]. "
                   "Q8_0: 8-bit (a GGUF's own Q8_0 head exactly). Q4_0: 4-bit symmetric, round-to-nearest (as "
                   "onnxruntime-genai's int4 models store their head): half the head's bytes a token reads, "
                   "another rounding of the logits. Speculative output equals the engine's own target-only greedy "
                   "either way (docs/engine.md).")
@click.option("--prefill-weights", "prefill_weights", type=click.Choice(PREFILL_WEIGHTS), default=None,
              help="With --dtype int4: how the prefill multiplies by the target's matrices [default: int8 at "
                   "accuracy level 4, else int4]. int8: the 4-bit blocks as int8 columns, the prompt's rows "
                   "quantized to int8 one by one, on ONNX Runtime's integer GEMM (AMX or VNNI): a long prompt's "
                   "prefill about 1.8x faster; decode and verify calls unchanged, so speculative output still "
                   "equals the engine's own target-only greedy (a reused prefix's entries, made by decode calls, "
                   "round otherwise than a prefill's). int4: MatMulNBits on the 4-bit blocks, as every other call "
                   "(docs/engine.md).")
@click.option("--draft-weights", "--int4-draft", "draft_weights", type=click.Choice(DRAFT_FORMATS), default=None,
              help="How the draft's matrices (its layers' projections and its head's vocabulary-sized output "
                   "projection) are stored [default: Q8_0 in onnxruntime fp32 engines and in int4 ones at accuracy "
                   "level 4, else float]. Quantized drafts run on MatMulNBits with int8 activations (onnxruntime "
                   "fp32 and int4 at level 4 only). Output stays exact at any setting (the target verifies every "
                   "token in its own precision); it moves the draft's cost and how many of its tokens are kept "
                   "(docs/engine.md).")
@click.option("--attention", type=click.Choice(["gqa", "ops"]), default=None,
              help="How the target attends over the KV cache [default: gqa for onnxruntime fp32 and int4 where "
                   "the target's head_dim is a multiple of 8, else ops]. gqa: ONNX Runtime's GroupQueryAttention, writing each call's entries into the cache in "
                   "place and reading every key from its own slot, so a verify and a decode call compute a position "
                   "alike. ops: standard ONNX ops over the cache's slots and the call's new keys (TensorRT, fp16).")
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
@click.option("--no-calibrate", "no_calibrate", is_flag=True,
              help="Skip measuring the verify width (`dlite-trt calibrate` does it later; until then steps verify "
                   "all K drafts).")
@click.option("--quiet", is_flag=True, help="No progress display.")
def command(target: str | None, draft: Path | None, out: Path, backend: str, dtype: str,
            int4_accuracy_level: str | None, int4_blocks: str | None, head_weights: str | None,
            prefill_weights: str | None, draft_weights: str | None, attention: str | None,
            workspace_gb: float,
            timing_cache: Path | None, max_seq_len: int | None,
            max_batch: int, max_chunk: int, random_weights: bool, no_calibrate: bool, quiet: bool) -> None:
    """Compile a target (Qwen3, Llama or Qwen2) and a DLite draft into an engine directory.

    Without --target and --draft: SmolLM2-135M-Instruct and the DLite draft trained for it."""
    from transformers.utils import logging as hf_logging

    from dlite_trt.bundled import pair_or_default
    from dlite_trt.dtypes import WEIGHT_ONLY_DTYPES
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    check_random_weights(random_weights, target)
    # SIGTERM (timeout, docker stop, a batch scheduler) unwinds as Ctrl-C does: the partial engine is removed
    signal.signal(signal.SIGTERM, _terminated)
    for option, value in (("--int4-accuracy-level", int4_accuracy_level), ("--int4-blocks", int4_blocks),
                          ("--head-weights", head_weights), ("--prefill-weights", prefill_weights)):
        if value is not None and dtype != "int4":
            raise click.UsageError(f"{option} applies to --dtype int4 only.")
    hf_logging.disable_progress_bar()
    target, draft = pair_or_default(target, draft)
    dtype, weights = WEIGHT_ONLY_DTYPES.get(dtype, (dtype, "float"))
    level = {} if int4_accuracy_level is None else {"int4_accuracy_level": int(int4_accuracy_level)}
    settings = BuildSettings(backend=backend, dtype=dtype, weights=weights, random_weights=random_weights,
                             workspace_gb=workspace_gb, attention=attention, draft_weights=draft_weights,
                             head_weights=head_weights, prefill_weights=prefill_weights,
                             int4_blocks=int4_blocks or DEFAULT_BLOCKS, **level,
                             timing_cache=timing_cache, fit_seq_len_to_target=max_seq_len is None,
                             limits=EngineLimits(max_batch=max_batch, max_seq_len=max_seq_len or DEFAULT_MAX_SEQ_LEN,
                                                 max_chunk=max_chunk))
    calibrated: list[str] = []  # what calibration prints, after the progress display

    def calibrate(engine: Path) -> None:
        from dlite_trt.bench.calibrate import calibrate_engine

        calibrated.append(calibrate_engine(engine, shown_as=out)[1])

    manifest = build_engine(target, draft, out, settings, progress=not quiet,
                            calibrate=None if no_calibrate or random_weights else calibrate)  # random: nothing accepts
    total = sum(r["bytes"] for r in manifest.files.values())
    vocab = manifest.draft_config.draft_vocab_size
    drafts = "" if vocab is None else f", draft vocabulary {vocab} of {manifest.target_spec.vocab_size} tokens"
    click.echo(f"engine {out}: {backend} {manifest.weights.describe(dtype)}, block size {manifest.block_size}"
               f"{drafts}, attention {manifest.attention}, "
               f"max batch {max_batch}, max seq len {manifest.limits.max_seq_len}; {len(manifest.files)} files, {total / 2**20:.1f} MiB, "
               f"built in {manifest.build['seconds']:.1f} s")
    if manifest.weights.origin == "gguf" and ZP_SCHEME in manifest.weights.schemes:
        click.echo("int4: the GGUF's Q4_1 blocks were re-fitted into ONNX Runtime's own 4-bit form (faster; its "
                   "logits are a second 4-bit rounding away from the GGUF's, docs/engine.md); --int4-blocks ggml "
                   "keeps the GGUF's blocks exactly.")
    for text in calibrated:
        click.echo(text)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
