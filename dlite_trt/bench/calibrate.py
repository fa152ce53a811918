"""Calibrate an engine's verify width on the machine at hand (runtime/verify_width.py).

Two measurements, each on the engine itself:
- the acceptance curve P(n >= i): greedy generations at full width on calibration prompts
  (by default code continuations and coding requests, the latter through the chat template as
  a chat client sends them, made from the held-out standard-library sources: the kind of text
  `dlite-trt bench` runs, other functions; pass your own prompts for your traffic);
- the cost of a step call at every width k + 1 (k = 1..K) and of a one-token decode call,
  after ``context`` cached tokens, in bursts of one shape (as decoding runs), bursts
  interleaved across widths so load bursts on a shared machine hit every width alike;
  the same at each batch size up to the engine's --max-batch, where the server's scheduler
  picks its width per batch, plain decoding (k = 0) included, and at batch 1 after a short and a
  long context (``CONTEXTS``), where a DLite session picks its width per step by its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dlite_trt.bench.context_cost import burst_medians, decode_feed, timing_cache
from dlite_trt.bench.workloads import chat, held_out_ids, source_files
from dlite_trt.errors import DLiteError
from dlite_trt.export.contract import dummy_inputs
from dlite_trt.runtime import verify_width
from dlite_trt.runtime.engine import EngineGenerator
from dlite_trt.runtime.session import SamplingParams

CALIBRATION_SEED = 1000  # the bench's workloads use seed 0: other functions, the same kind of text
CODE_PROMPT_TOKENS = 384
CONTEXTS = (256, 2048)  # besides ``context``: batch-1 costs after this many cached tokens (within the engine)


def default_prompts(tokenizer: Any, *, code: int = 2, requests: int = 4) -> list[list[int]]:
    """Code continuations (held-out sources) and coding requests through the chat template, as token ids."""
    if tokenizer is None:
        raise DLiteError("calibration makes its prompts from text, but the engine has no tokenizer; pass prompts "
                         "as token ids.")
    prompts = [held_out_ids(tokenizer, CODE_PROMPT_TOKENS, offset=2 * i) for i in range(code)]
    for task in chat(source_files(), seed=CALIBRATION_SEED, count=requests):
        text = task.turns[0].prompt
        if getattr(tokenizer, "chat_template", None):
            prompts.append(list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)))
        else:
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def acceptance(gen: EngineGenerator, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[int]:
    """Drafts accepted at each step of greedy generations that verify all K drafts."""
    full = EngineGenerator(gen.runner, gen.manifest, gen.cfg.num_proposals)
    counts: list[int] = []
    for prompt in prompts:
        result = full.session([list(prompt)]).generate(SamplingParams(max_new_tokens=new_tokens))
        counts += [step.accepted[0] for step in result.steps if step.accepted[0] is not None]
    return counts


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a width is calibrated at: powers of two up to the engine's --max-batch, and it."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})


def call_ms(gen: EngineGenerator, context: int, runs: int,
            batches: Sequence[int] = (1,)) -> dict[int, tuple[dict[int, float], float]]:
    """Per batch size: median wall ms of the greedy step call at every width (k -> ms) and of a
    target-only decode call, every row after ``context`` cached tokens; batch sizes interleaved."""
    manifest = gen.manifest
    k_max = gen.cfg.num_proposals
    rng = np.random.default_rng(0)
    calls = {}
    for batch in batches:
        cache = timing_cache(gen.runner, batch, context + 2 * gen.cfg.block_size)
        sizes = {"batch": batch, "cache": cache.capacity}
        named = {}
        for k in range(1, k_max + 1):
            feed = dummy_inputs(manifest.contract["step"], sizes | {"verify": k + 1},
                                vocab_size=manifest.target_spec.vocab_size, rng=rng)
            feed["past_len"][:] = context
            named[str(k)] = ("step", feed)
        named["decode"] = ("decode", decode_feed(manifest, sizes, 1, context, rng))
        calls[batch] = (cache, named)
    medians = burst_medians(gen, calls, runs, None)
    return {batch: ({k: m[str(k)] * 1e3 for k in range(1, k_max + 1)}, m["decode"] * 1e3)
            for batch, m in medians.items()}


def calibrate(gen: EngineGenerator, prompts: Sequence[Sequence[int]], *, new_tokens: int = 48,
              context: int = 1024, runs: int = 20) -> verify_width.WidthChoice:
    """Measure the acceptance curve and the call costs on ``gen`` (at every batch size it serves);
    the verify widths they give."""
    if "verify" not in {d.name for d in gen.manifest.contract["step"].dims}:
        raise DLiteError("this engine's step graph verifies a fixed block; rebuild it with this dlite-trt.")
    longest = gen.manifest.limits.max_seq_len
    if longest < 4 * gen.cfg.block_size:
        raise DLiteError(f"the engine's --max-seq-len {longest} is too short to calibrate a verify width on (it needs "
                         f"{4 * gen.cfg.block_size}); pass --no-calibrate to the build, or --verify-drafts N.")
    new_tokens = min(new_tokens, longest // 2)
    prompts = [list(p)[-(longest - new_tokens):] for p in prompts]  # each prompt's end, within the engine
    context = max(1, min(context, longest - 2 * gen.cfg.block_size))
    curve = verify_width.acceptance_curve(acceptance(gen, prompts, new_tokens), gen.cfg.num_proposals)
    batches = batch_sizes(gen.manifest.limits.max_batch)
    costs = call_ms(gen, context, runs, batches)
    contexts = sorted({min(c, longest - 2 * gen.cfg.block_size) for c in CONTEXTS} - {context})
    by_context = {context: costs[1]} | {c: call_ms(gen, c, runs)[1] for c in contexts}
    source = (f"{len(prompts)} prompts x {new_tokens} new tokens at full width; calls after {context} cached "
              f"tokens, batch sizes {', '.join(map(str, batches))}, and at batch 1 after "
              f"{', '.join(map(str, sorted(by_context)))}; medians of {max(1, runs // 10) * 10}, "
              "fitted nondecreasing in k")
    step_ms, decode_ms = costs[1]
    return verify_width.choose(step_ms, curve, decode_ms=decode_ms, source=source, batch_ms=costs,
                               context_ms=by_context)


def describe(choice: verify_width.WidthChoice) -> str:
    """The choice and its curve, for the build's and `dlite-trt calibrate`'s output."""
    lines = [f"verify width: {choice.drafts} of {len(choice.curve)} drafts a step ({choice.source})",
             "  k  P(n>=k)  tokens/step  step ms  tokens/ms" + ("  vs decode" if choice.decode_ms else "")]
    for k, row in choice.rows().items():
        mark = " <" if k == choice.drafts else ""
        speed = f"  {row['speedup_over_decode']:9.2f}x" if "speedup_over_decode" in row else ""
        lines.append(f"  {k}  {choice.curve[k - 1]:7.3f}  {row['tokens_per_step']:11.2f}  {row['step_ms']:7.1f}  "
                     f"{row['tokens_per_ms']:9.4f}{speed}{mark}")
    if choice.by_batch:
        lines.append("  the OpenAI server's greedy steps, per batch size (0: plain decoding pays more):")
        for batch, width in sorted(choice.by_batch.items()):
            gain = (verify_width.expected_tokens(choice.curve, width.drafts) / width.step_ms[width.drafts]
                    * width.decode_ms) if width.drafts else 1.0
            lines.append(f"  batch {batch:3d}: k = {width.drafts}  ({gain:.2f}x plain decoding predicted)")
    if choice.by_context:
        lines.append("  a DLite session's steps, per context (batch 1; the calibrated context nearest its length):")
        for context, width in sorted(choice.by_context.items()):
            k = choice.drafts_for(1, drafting=True, context=context)
            gain = verify_width.expected_tokens(choice.curve, k) / width.step_ms[k] * width.decode_ms
            lines.append(f"  after {context:5d} tokens: k = {k}  ({gain:.2f}x plain decoding predicted)")
    return "\n".join(lines)


def calibrate_engine(engine_dir: Any, *, threads: int | None = None,
                     prompts: Sequence[Sequence[int]] | None = None) -> tuple[verify_width.WidthChoice | None, str]:
    """Calibrate an engine directory and write its ``verify_width.json``; returns the choice (None
    when there is nothing to calibrate on: no tokenizer and no prompts) and what to print."""
    from pathlib import Path

    from dlite_trt.engine.load import load_engine

    loaded = load_engine(Path(engine_dir), threads=threads, preload=("prefill", "step", "decode"),
                         verify_drafts=None)
    if prompts is None and loaded.tokenizer is None:
        return None, ("verify width: not calibrated (the engine has no tokenizer to make prompts with); steps "
                      f"verify all {loaded.generator.cfg.num_proposals} drafts. Run `dlite-trt calibrate --engine "
                      f"{engine_dir} --prompts FILE` with token-id prompts to calibrate.")
    choice = calibrate(loaded.generator, prompts if prompts is not None else default_prompts(loaded.tokenizer))
    path = verify_width.save(Path(engine_dir), choice)
    return choice, f"{describe(choice)}\nwritten to {path}"
