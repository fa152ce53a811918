"""Step cost against context length: the history-free claim, measured through the engine.

- ``step_vs_decode``: wall time (host work included) of one speculative step and of one
  target-only decode step, per context length, methods and contexts interleaved each round;
- ``call_times``: wall time of single engine calls: the step graph, the verify pass alone (a
  decode call of the k+1 tokens a DLite step verifies after that context) and a one-token
  decode; step minus verify is the draft's wall time;
- ``step_profile``: the step graph's kernel time per call split into the target (verify) and
  the draft, from ONNX Runtime's profiler. It profiles the unoptimized step graph, whose node
  names keep their module scopes (``/target/...`` for the target; the draft's modules and the
  inlined ``LowRankRecurrence`` body for the draft). Each figure is the median over calls.
  A history-free draft's time must not grow with the context; the target's does.
"""

from __future__ import annotations

import bisect
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dlite_trt.runtime.session import SamplingParams, StepEvent


def step_times(stream: Iterator[StepEvent]) -> list[float]:
    """Wall seconds of each engine call after the prefill, timed around the stream's iterator."""
    next(stream)  # the prefill
    times = []
    while True:
        start = time.perf_counter()
        try:
            next(stream)
        except StopIteration:
            return times
        times.append(time.perf_counter() - start)


def step_vs_decode(engine: Any, prompts: dict[int, list[int]], steps: int, rounds: int,
                   progress: Any = None) -> dict[str, dict]:
    """Median ms of a speculative step and of a decode step per context (``prompts``: context -> ids)."""
    params = SamplingParams(max_new_tokens=steps)
    times: dict[int, dict[str, list[float]]] = {ctx: {"spec": [], "decode": []} for ctx in prompts}
    for round_ in range(rounds + 1):  # round 0 warms up every context's shapes
        for ctx, prompt in prompts.items():
            spec = step_times(engine.session([prompt]).stream(params))
            dec = step_times(engine.session([prompt]).stream_target_only(params))
            if round_:
                times[ctx]["spec"] += spec
                times[ctx]["decode"] += dec
            if progress is not None:
                progress()
    rows = {}
    for ctx in prompts:
        spec_s, dec_s = (statistics.median(times[ctx][k]) for k in ("spec", "decode"))
        rows[str(ctx)] = {"speculative_step_ms": spec_s * 1e3, "decode_step_ms": dec_s * 1e3,
                          "ratio": spec_s / dec_s, "samples": len(times[ctx]["spec"])}
    base = rows[str(next(iter(prompts)))]["ratio"]
    for row in rows.values():
        row["ratio_vs_first_context"] = row["ratio"] / base
    return rows


def step_profile(engine_dir: Path, contexts: Sequence[int], *, drafts: int | None = None, runs: int = 50,
                 threads: int | None = None, progress: Any = None) -> dict[str, dict]:
    """Median kernel ms per step-graph call (verifying ``drafts`` drafts, default all K) in the target,
    the draft and the rest, per context."""
    import numpy as np
    import onnxruntime as ort

    from dlite_trt.engine.manifest import load_manifest
    from dlite_trt.export.contract import cache_capacity_max, dummy_inputs, steady_step
    from dlite_trt.export.recurrence import OP_NAME
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.runtime.ort_runner import run_in_place

    manifest = load_manifest(engine_dir)
    draft_scopes = tuple(f"/{name}" for name, _ in DLiteDraft(manifest.draft_config).named_children())
    spec = manifest.contract["step"]
    largest_cache = cache_capacity_max(manifest.limits, manifest.draft_config.block_size)
    warmup = 5
    sessions, feeds = {}, {}
    for ctx in contexts:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"dlite_step_profile_{ctx}")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        sessions[ctx] = ort.InferenceSession(str(engine_dir / manifest.graphs["step"]["onnx"]), so,
                                             providers=["CPUExecutionProvider"])
        cache = min(ctx + 128, largest_cache)  # room for the block, within the engine's largest cache
        sizes = {"batch": 1, "cache": cache} | ({} if drafts is None else steady_step(drafts))
        feeds[ctx] = dummy_inputs(spec, sizes, vocab_size=manifest.target_spec.vocab_size,
                                  rng=np.random.default_rng(0))
        feeds[ctx]["past_len"][:] = ctx
    for _ in range(runs + warmup):  # contexts interleaved call by call: load bursts hit them all alike
        for ctx in contexts:
            run_in_place(sessions[ctx], spec, feeds[ctx])  # attention "gqa": the cache written in place
    rows = {}
    for ctx in contexts:
        profile = Path(sessions[ctx].end_profiling())
        events = json.loads(profile.read_text())
        profile.unlink()
        starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
        per_run = [{"target": 0.0, "draft": 0.0, "other": 0.0} for _ in starts]
        for e in events:
            name = e.get("name", "")
            if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
                continue
            part = ("target" if name.startswith("/target/") else
                    "draft" if name.startswith(draft_scopes) or name.startswith(f"_inlfunc_{OP_NAME}") else "other")
            per_run[bisect.bisect_right(starts, e["ts"]) - 1][part] += e["dur"] / 1e3
        timed = per_run[warmup:]
        rows[str(ctx)] = {f"{k}_ms": statistics.median(r[k] for r in timed) for k in ("target", "draft", "other")}
        rows[str(ctx)]["runs"] = len(timed)
        if progress is not None:
            progress()
    return rows


def decode_feed(manifest: Any, sizes: dict[str, int], width: int, ctx: int, rng: Any) -> dict:
    """Random inputs of a greedy ``decode`` call of ``width`` tokens after ``ctx`` cached ones, or
    as many as the runtime feeds a call at least (a target-only step's token and its dummy:
    ``runtime.engine.min_call_tokens``), every one's next token wanted (``every_output``)."""
    import numpy as np

    from dlite_trt.export.contract import dummy_inputs
    from dlite_trt.runtime.engine import min_call_tokens

    width = max(width, min_call_tokens(manifest))
    feed = dummy_inputs(manifest.contract["decode"], sizes | {"chunk": width, "outputs": width},
                        vocab_size=manifest.target_spec.vocab_size, rng=rng)
    feed["output_index"][:] = np.arange(width)
    feed["past_len"][:] = ctx
    return feed


def timing_cache(runner: Any, batch: int, slots: int) -> Any:
    """A KV cache of ``batch`` rows and at least ``slots`` slots whose every entry has been written,
    for timing calls on it: a new cache's buffers are zeroed pages the host never wrote (calloc), which
    read as one shared zero page, so a call over them reads its past from cache instead of memory (an
    int4 SmolLM2 decode call after 3,900 tokens timed 17 ms there against 27 ms in a session)."""
    cache = runner.new_cache(batch)
    cache.ensure_capacity(slots)
    cache.k.fill_(1.0)
    cache.v.fill_(1.0)
    return cache


def burst_medians(engine: Any, calls: dict[Any, tuple[Any, dict[str, tuple[str, dict]]]], runs: int,
                   progress: Any, burst: int = 10) -> dict[Any, dict[str, float]]:
    """Median wall seconds per (key, call name) over every round of ``burst_rounds``."""
    rounds = burst_rounds(engine, calls, runs, progress, burst)
    return {key: {name: statistics.median(t for r in per_round for t in r) for name, per_round in named.items()}
            for key, named in rounds.items()}


def burst_rounds(engine: Any, calls: dict[Any, tuple[Any, dict[str, tuple[str, dict]]]], runs: int,
                 progress: Any, burst: int = 10) -> dict[Any, dict[str, list[list[float]]]]:
    """Wall seconds per (key, call name), one list per round. ``calls``: key (a context, a batch size,
    or both) -> (cache, name -> (graph, feed)). Calls run in bursts of ``burst`` consecutive calls of one
    graph at one key (as in decoding: a shape change between calls costs ONNX Runtime extra work), the
    first of a burst untimed; each of the ``runs // burst`` rounds runs one burst of every call of every
    key, so load bursts hit every key and call alike."""
    times = {key: {name: [] for name in named} for key, (_, named) in calls.items()}
    for _ in range(max(1, runs // burst)):
        for key, (cache, named) in calls.items():
            for name, (graph, feed) in named.items():
                timed = []
                for i in range(burst + 1):
                    start = time.perf_counter()
                    engine.runner.infer(graph, feed, cache)
                    if i:
                        timed.append(time.perf_counter() - start)
                times[key][name].append(timed)
        if progress is not None:
            progress()
    return times


def call_times(engine: Any, contexts: Sequence[int], *, runs: int = 100, progress: Any = None) -> dict[str, dict]:
    """Median wall ms of single engine calls per context: the ``step`` graph (verify + draft), a
    ``decode`` call of k+1 tokens (the same verify pass alone: what n-gram lookup runs per step;
    k the drafts a DLite step verifies after that context, ``verify_width`` = k+1) and of 1 token
    (a target-only decode step). Inputs are random (the cache's contents do not
    change the work, but it must be in memory: ``timing_cache``), nothing is stored; see
    ``burst_rounds`` for the timing."""
    import numpy as np

    from dlite_trt.export.contract import dummy_inputs, steady_step

    manifest = engine.manifest
    block = manifest.draft_config.block_size
    rng = np.random.default_rng(0)
    calls, widths = {}, {}
    for ctx in contexts:
        width = widths[ctx] = engine.greedy_drafts(1, context=ctx) + 1  # the block a DLite step verifies there
        cache = timing_cache(engine.runner, 1, ctx + 2 * block)
        sizes = {"batch": 1, "cache": cache.capacity}
        step = dummy_inputs(manifest.contract["step"], sizes | steady_step(width - 1),
                            vocab_size=manifest.target_spec.vocab_size, rng=rng)
        step["past_len"][:] = ctx
        calls[ctx] = (cache, {"step": ("step", step),
                              "verify": ("decode", decode_feed(manifest, sizes, width, ctx, rng)),
                              "decode": ("decode", decode_feed(manifest, sizes, 1, ctx, rng))})
    medians = burst_medians(engine, calls, runs, progress)
    rows = {}
    for ctx in contexts:
        step, verify, decode = (medians[ctx][k] * 1e3 for k in ("step", "verify", "decode"))
        rows[str(ctx)] = {"step_call_ms": step, "verify_call_ms": verify, "decode_call_ms": decode,
                          "draft_ms": max(step - verify, 0.0), "verify_over_decode": verify / decode,
                          "step_over_decode": step / decode, "verify_width": widths[ctx],
                          "runs": max(1, runs // 10) * 10}
    return rows


def verify_cost(engine: Any, contexts: Sequence[int], widths: Sequence[int] = (1, 2, 4, 8), *, runs: int = 100,
                progress: Any = None) -> dict[str, dict]:
    """The verify-cost curve: median wall ms of one target call (``decode`` graph) of each width
    after each context, and its ratio to the 1-token call. Speculative decoding gains at most
    acceptance length x t(1) / t(width)."""
    import numpy as np

    manifest = engine.manifest
    rng = np.random.default_rng(0)
    calls = {}
    for ctx in contexts:
        cache = timing_cache(engine.runner, 1, ctx + max(widths))
        sizes = {"batch": 1, "cache": cache.capacity}
        calls[ctx] = (cache, {str(w): ("decode", decode_feed(manifest, sizes, w, ctx, rng)) for w in widths})
    medians = burst_medians(engine, calls, runs, progress)
    return {str(ctx): {w: {"ms": t * 1e3, "over_one_token": t / medians[ctx][str(widths[0])]}
                       for w, t in medians[ctx].items()} for ctx in contexts}
