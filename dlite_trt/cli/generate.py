"""`dlite-trt generate`: speculative decoding with an engine (--engine) or the PyTorch reference."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from dlite_trt.cli.inputs import (
    SEED,
    TEMPERATURE,
    THREADS,
    VERIFY_DRAFTS,
    check_engine_dir,
    check_random_weights,
)
from dlite_trt.errors import DLiteError


def _parse_ids(value: str) -> list[int]:
    try:
        ids = [int(tok) for tok in value.replace(" ", "").split(",") if tok]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers like 1,2,3, got {value!r}",
                                 param_hint="'--input-ids'") from exc
    if not ids:
        raise click.BadParameter("no token ids given; pass at least one, e.g. --input-ids 1,2,3",
                                 param_hint="'--input-ids'")
    return ids


def _check_options(engine: Path | None, target: str | None, prompt: str | None, chat: bool, random_weights: bool,
                   threads: int | None) -> None:
    """Usage errors (exit 2) found from the options alone, before anything loads."""
    if prompt == "" and not chat:
        raise click.BadParameter("the prompt is empty; give some text (or --input-ids 1,2,3)", param_hint="'--prompt'")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # argv's invalid bytes arrive as surrogate escapes
            bad = ord(prompt[exc.start])
            shown = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"\\u{bad:04x}"
            raise click.BadParameter(f"the prompt is not valid UTF-8 text ({shown} at character {exc.start}); pass "
                                     "UTF-8 text, or --input-ids 1,2,3", param_hint="'--prompt'") from None
    if chat and prompt is None:
        raise click.UsageError("--chat needs --prompt (a text to wrap in the chat template)")
    if threads is not None and engine is None:
        raise click.UsageError("--threads sets ONNX Runtime's threads for an engine; pass --engine DIR, or drop "
                               "--threads (the PyTorch reference uses torch's threads)")
    check_random_weights(random_weights, target)


@click.command("generate")
@click.option("--engine", type=click.Path(path_type=Path), metavar="DIRECTORY",
              help="Engine directory from `dlite-trt build`. With --target/--draft, checks it was built from them.")
@click.option("--verify", is_flag=True,
              help="With --engine: hash every engine file (by default files above 64 MiB are only size-checked).")
@click.option("--target", help="Model directory, .gguf file or preset name (smollm2-135m, qwen3-8b, ...); "
                               "without it and --engine, smollm2-135m.")
@click.option("--draft", type=click.Path(path_type=Path),
              help="dlite_v1 draft checkpoint directory; without it and --engine, the draft bundled for SmolLM2.")
@click.option("--prompt", help="Prompt text (tokenized with the target's tokenizer).")
@click.option("--input-ids", "input_ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=0),
              help="Most tokens to generate (fewer when an end-of-sequence token comes first).")
@click.option("--temperature", default=0.0, show_default=True, type=TEMPERATURE,
              help="0 = greedy (lossless); > 0 = speculative rejection sampling.")
@click.option("--seed", type=SEED, help="Seed for sampling (same seed, same output), from -2**63 to 2**64 - 1.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the target's end-of-sequence tokens.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]),
              help="Reference precision [default: fp32]; an engine runs in the dtype it was built with.")
@click.option("--random-weights", is_flag=True, help="With a preset --target: random weights of that shape.")
@click.option("--threads", type=THREADS,
              help="With --engine: ONNX Runtime intra-op threads (default: one per physical core).")
@VERIFY_DRAFTS
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--trace", is_flag=True, help="Include each step's draft tokens and accepted count.")
def command(engine: Path | None, verify: bool, target: str | None, draft: Path | None, prompt: str | None,
            input_ids: str | None, max_new_tokens: int, temperature: float, seed: int | None, chat: bool,
            ignore_eos: bool, dtype: str | None,
            random_weights: bool, threads: int | None, verify_drafts: int | str, as_json: bool, trace: bool) -> None:
    """Generate with a target and a DLite draft (speculative decoding)."""
    if (prompt is None) == (input_ids is None):
        raise click.UsageError("pass exactly one of --prompt TEXT or --input-ids 1,2,3")
    ids = _parse_ids(input_ids) if input_ids is not None else None
    _check_options(engine, target, prompt, chat, random_weights, threads)

    from dlite_trt.bundled import check_pair_options, pair_or_default

    check_pair_options(target, draft)
    if verify and engine is None:
        raise click.UsageError("--verify checks an engine directory; pass --engine DIR")
    if verify_drafts != "auto" and engine is None:
        raise click.UsageError("--verify-drafts sets an engine's verify width; pass --engine DIR (the PyTorch "
                               "reference verifies all K drafts)")
    if engine is not None:
        check_engine_dir(engine)  # after the usage errors: opening a path is the runtime part (exit 1)

    from transformers.utils import logging as hf_logging

    from dlite_trt.runtime.session import SamplingParams

    hf_logging.disable_progress_bar()  # this command prints its own summary

    if engine is not None:
        from dlite_trt.engine.load import load_engine
        from dlite_trt.runtime.sampling import GREEDY_EPS

        graphs = ("prefill", "step") if temperature <= GREEDY_EPS else ("prefill_sampling", "step_sampling")
        pair = load_engine(engine, target=target, draft=draft, random_weights=random_weights, verify=verify,
                           preload=graphs, threads=threads, verify_drafts=verify_drafts)
        if dtype is not None and dtype != pair.generator.manifest.dtype:
            raise click.UsageError(f"the engine was built for {pair.generator.manifest.dtype}; drop --dtype "
                                   "or rebuild the engine with that --dtype")
    else:
        from dlite_trt.loading import load_pair

        target, draft = pair_or_default(target, draft)
        pair = load_pair(target, draft, dtype=dtype or "fp32", random_weights=random_weights)
    tok = pair.tokenizer
    if ids is None:
        if tok is None:
            raise DLiteError(f"the target {pair.name} has no tokenizer; pass --input-ids instead of --prompt.")
        if chat:
            if not getattr(tok, "chat_template", None):
                raise DLiteError("the target's tokenizer has no chat template; drop --chat.")
            ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
        else:
            ids = tok.encode(prompt, add_special_tokens=False)
    stops = () if ignore_eos else pair.stop_token_ids
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop_token_ids=stops)
    start = time.perf_counter()
    result = pair.generator.generate([ids], params)
    seconds = time.perf_counter() - start
    out = result.output_ids[0]
    text = tok.decode(out, skip_special_tokens=False) if tok is not None else None
    tps = len(out) / seconds if seconds > 0 else 0.0
    if as_json:
        payload = {
            "output_ids": out,
            "acceptance_lengths": result.acceptance_lengths(0),
            "mean_acceptance_length": result.mean_acceptance_length(0),
            "stop_reason": result.stop_reasons[0],
            "tokens_per_second": tps,
            "timings": result.timings,
        }
        if engine is not None:
            manifest = pair.generator.manifest
            payload["engine"] = {"weights": manifest.weights.to_dict(), "dtype": manifest.dtype,
                                 "verify_drafts": pair.generator.verify_drafts}
        if text is not None:
            payload["text"] = text
        if trace:
            payload["steps"] = [{"draft_tokens": list(s.draft_tokens[0]), "accepted": s.accepted[0], "kept": s.kept[0]}
                                for s in result.steps if s.kept[0] is not None]
        click.echo(json.dumps(payload))
        return
    click.echo(text if text is not None else ",".join(map(str, out)))
    if trace:
        for i, s in enumerate(result.steps):
            if s.kept[0] is not None:
                click.echo(f"step {i}: draft {list(s.draft_tokens[0])} accepted {s.accepted[0]} kept {s.kept[0]}",
                           err=True)
    how = ""
    if engine is not None:
        gen = pair.generator
        how = f" ({gen.manifest.weights.describe(gen.manifest.dtype)}; steps verify {gen.verify_drafts} drafts)"
    accepted = f"mean acceptance length {result.mean_acceptance_length(0):.2f}" if result.steps else \
        "no speculative step (the prefill's token only)"
    click.echo(f"\n{len(out)} token{'' if len(out) == 1 else 's'}, {accepted}, {tps:.1f} tokens/s{how}", err=True)
