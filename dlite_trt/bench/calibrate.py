"""Calibrate an engine's verify width on the machine at hand (runtime/verify_width.py).

Two measurements, each on the engine itself:
- the acceptance curve P(n >= i): greedy generations at full width on calibration prompts
  (by default code continuations and coding requests, the latter through the chat template as
  a chat client sends them, made from the held-out standard-library sources: the kind of text
  `dlite-trt bench` runs, other functions; pass your own prompts for your traffic);
- the cost of a step call at every width k + 1 (k = 1..K) and of a one-token decode call,
  after ``context`` cached tokens, at each batch size up to the engine's --max-batch (where the
  server's scheduler picks its width per batch, plain decoding (k = 0) included), and at batch 1
  after a short and a long context (``CONTEXTS``, where a DLite session picks its width per step
  by its length): in bursts of one shape (as decoding runs), every call of every batch size and
  context once per round, rounds interleaved so load bursts on a shared machine hit them alike.

The costs are then checked against physics (``verify_width.implausible``: a step cheaper than a
decode call, a call dearer than the same call with more work, rounds spread wide): where the
check fails the costs are measured again, up to ``ATTEMPTS`` times, and the cleanest attempt is
kept with what it still failed (``WidthChoice.noise``, printed as a warning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dlite_trt.bench.context_cost import burst_rounds, decode_feed, timing_cache
from dlite_trt.bench.metrics import spread
from dlite_trt.bench.workloads import chat, held_out_ids, source_files
from dlite_trt.errors import DLiteError
from dlite_trt.export.contract import dummy_inputs, steady_step
from dlite_trt.runtime import verify_width
from dlite_trt.runtime.engine import EngineGenerator
from dlite_trt.runtime.session import SamplingParams

CALIBRATION_SEED = 1000  # the bench's workloads use seed 0: other functions, the same kind of text
CODE_PROMPT_TOKENS = 384
CONTEXTS = (256, 2048)  # besides ``context``: batch-1 costs after this many cached tokens (within the engine)
ATTEMPTS = 3  # measurements of the costs at most, while ``verify_width.implausible`` finds a problem
BURST = 5  # consecutive calls of one shape per round (plus one untimed)


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


def call_costs(gen: EngineGenerator, keys: Sequence[verify_width.Key], runs: int, burst: int = BURST) -> tuple[
        dict[verify_width.Key, tuple[dict[int, float], float]], dict[verify_width.Key, dict[str, float]]]:
    """Per (batch size, cached tokens): median wall ms of the greedy step call at every width (k ->
    ms) and of a target-only decode call, and each call's round spread (half the p10-p90 width of
    its per-round medians over their median); every call of every key in each round."""
    manifest = gen.manifest
    k_max = gen.cfg.num_proposals
    rng = np.random.default_rng(0)
    calls = {}
    for batch, context in keys:
        cache = timing_cache(gen.runner, batch, context + 2 * gen.cfg.block_size)
        sizes = {"batch": batch, "cache": cache.capacity}
        named = {}
        for k in range(1, k_max + 1):
            feed = dummy_inputs(manifest.contract["step"], sizes | steady_step(k),
                                vocab_size=manifest.target_spec.vocab_size, rng=rng)
            feed["past_len"][:] = context
            named[f"step k={k}"] = ("step", feed)
        named["decode"] = ("decode", decode_feed(manifest, sizes, 1, context, rng))
        calls[(batch, context)] = (cache, named)
    costs, spreads = {}, {}
    for key, named in burst_rounds(gen, calls, runs, None, burst).items():
        ms = {name: 1e3 * np.median([t for r in rounds for t in r]) for name, rounds in named.items()}
        costs[key] = ({k: float(ms[f"step k={k}"]) for k in range(1, k_max + 1)}, float(ms["decode"]))
        rounds = {name: spread([float(np.median(r)) for r in per_round]) for name, per_round in named.items()}
        spreads[key] = {name: (r["p90"] - r["p10"]) / (2 * r["median"]) for name, r in rounds.items()}
    return costs, spreads


def measured_costs(gen: EngineGenerator, keys: Sequence[verify_width.Key], runs: int) -> tuple[
        dict[verify_width.Key, tuple[dict[int, float], float]], list[str], int]:
    """``call_costs`` measured until ``verify_width.implausible`` finds nothing, ``ATTEMPTS`` times at
    most: the costs with the fewest problems, those problems, and the attempts made."""
    best = None
    for attempt in range(1, ATTEMPTS + 1):
        costs, spreads = call_costs(gen, keys, runs)
        problems = verify_width.implausible(costs, spreads)
        if best is None or len(problems) < len(best[1]):
            best = (costs, problems)
        if not problems:
            break
    return best[0], best[1], attempt


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
    contexts = sorted({min(c, longest - 2 * gen.cfg.block_size) for c in CONTEXTS} | {context})
    keys = [(b, context) for b in batches] + [(1, c) for c in contexts if c != context]
    costs, noise, attempts = measured_costs(gen, keys, runs)
    source = (f"{len(prompts)} prompts x {new_tokens} new tokens at full width; calls after {context} cached "
              f"tokens, batch sizes {', '.join(map(str, batches))}, and at batch 1 after "
              f"{', '.join(map(str, contexts))}; medians of {max(1, runs // BURST)} interleaved rounds of "
              f"{BURST} calls{f' (measured {attempts} times)' if attempts > 1 else ''}, fitted nondecreasing in k")
    step_ms, decode_ms = costs[(1, context)]
    return verify_width.choose(step_ms, curve, decode_ms=decode_ms, source=source,
                               batch_ms={b: costs[(b, context)] for b in batches},
                               context_ms={c: costs[(1, c)] for c in contexts},
                               machine=verify_width.this_machine(), noise=noise)


def describe(choice: verify_width.WidthChoice) -> str:
    """The choice and its curve, for the build's and `dlite-trt calibrate`'s output."""
    lines = [f"verify width: {choice.drafts} of {len(choice.curve)} drafts a step ({choice.source})",
             *(f"  WARNING, timings not clean: {problem}" for problem in choice.noise),
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


def calibrate_engine(engine_dir: Any, *, threads: int | None = None, prompts: Sequence[Sequence[int]] | None = None,
                     shown_as: Any = None) -> tuple[verify_width.WidthChoice | None, str]:
    """Calibrate an engine directory and write its ``verify_width.json``; returns the choice (None
    when there is nothing to calibrate on: no tokenizer and no prompts) and what to print, where
    the engine is named ``shown_as`` (default ``engine_dir``: a build calibrates before it installs)."""
    from pathlib import Path

    from dlite_trt.engine.load import load_engine

    shown_as = Path(engine_dir if shown_as is None else shown_as)
    loaded = load_engine(Path(engine_dir), threads=threads, preload=("prefill", "step", "decode"),
                         verify_drafts=None)
    if prompts is None and loaded.tokenizer is None:
        return None, ("verify width: not calibrated (the engine has no tokenizer to make prompts with); steps "
                      f"verify all {loaded.generator.cfg.num_proposals} drafts. Run `dlite-trt calibrate --engine "
                      f"{shown_as} --prompts FILE` with token-id prompts to calibrate.")
    choice = calibrate(loaded.generator, prompts if prompts is not None else default_prompts(loaded.tokenizer))
    verify_width.save(Path(engine_dir), choice)
    text = f"{describe(choice)}\nwritten to {shown_as / verify_width.WIDTH_FILE}"
    if choice.noise:
        text += (f"\nWARNING: the machine was busy while calibrating ({len(choice.noise)} problems above, after "
                 f"{ATTEMPTS} tries); the widths may be wrong. Rerun `dlite-trt calibrate --engine {shown_as}` when "
                 "nothing else runs.")
    return choice, text
