"""One `dlite-trt bench` run: workloads, batch sweep and context cost on one engine, as one report."""

from __future__ import annotations

import os
import platform
import resource
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dlite_trt.bench import context_cost
from dlite_trt.bench.methods import make_methods, skipped_methods
from dlite_trt.bench.names import WORKLOAD_NAMES, check_names, default_methods
from dlite_trt.bench.report import SCHEMA, goals
from dlite_trt.bench.run import (
    batch_sweep,
    nearest_context,
    prepare,
    run_workload,
    warm_up,
)
from dlite_trt.bench.workloads import (
    LONG_CONTEXT_ANSWER_TOKENS,
    LONG_CONTEXT_MIN_TOKENS,
    LONG_CONTEXT_TOKENS,
    QUICK_LONG_CONTEXT_TOKENS,
    Task,
    agentic,
    chat,
    held_out_ids,
    long_context,
    read_jsonl,
    source_files,
)
from dlite_trt.dtypes import TORCH
from dlite_trt.engine.build import package_versions
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.prompt_lookup import PromptLookupConfig

SWEEP_PROMPT_TOKENS = 1024
Phase = Callable[[str, int], Callable[[], None]]  # (description, total) -> advance


@dataclass(frozen=True)
class BenchSettings:
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    datasets: tuple[Path, ...] = ()  # user JSONL files: each is a workload named after the file
    methods: tuple[str, ...] = ()  # (): ``names.default_methods`` for the engine's weights
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    sweep_tokens: int = 64
    sweep_rounds: int = 1
    contexts: tuple[int, ...] = (256, 2048, 8192, 16384)
    context_steps: int = 32
    context_rounds: int = 1
    profile_runs: int = 30
    call_runs: int = 50
    seed: int = 0
    ngram: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    quick: bool = False

    @classmethod
    def quick_run(cls, **overrides: Any) -> BenchSettings:
        """About a minute on a laptop CPU with the bundled models: fewer, shorter tasks and samples."""
        return replace(cls(batch_sizes=(1, 4), sweep_tokens=32, sweep_rounds=1, contexts=(256, 2048),
                           context_steps=16, context_rounds=1, profile_runs=10, call_runs=20, quick=True), **overrides)


def fit_lengths(lengths: Sequence[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """(lengths to run, lengths skipped) of the long-context prompts on an engine: those whose
    prompt and answer fit; when some do not, one more at the longest prompt that does, so the
    workload reaches what the engine allows."""
    cap = max_seq_len - LONG_CONTEXT_ANSWER_TOKENS[1]
    kept = [n for n in lengths if n <= cap]
    skipped = [n for n in lengths if n > cap]
    if skipped and cap > max(kept, default=0) and cap >= LONG_CONTEXT_MIN_TOKENS:
        kept.append(cap)
    return kept, skipped


def default_workloads(names: Sequence[str], tokenizer: Any, *, seed: int, quick: bool,
                      long_lengths: Sequence[int] | None = None) -> dict[str, list[Task]]:
    """The generated workloads (seeded, from the held-out standard-library sources).
    ``long_lengths``: the long-context prompt lengths (default: the run's, see ``fit_lengths``)."""
    files = source_files()
    if long_lengths is None:
        long_lengths = QUICK_LONG_CONTEXT_TOKENS if quick else LONG_CONTEXT_TOKENS
    makers = {
        # 3 sessions (tasks: the paired rounds), so that its goals are judged (report.MIN_ROUNDS)
        "agentic": lambda: agentic(files, seed=seed, sessions=3, turns=2 if quick else 4),
        "long-context": lambda: long_context(files, tokenizer, seed=seed, lengths=long_lengths,
                                             answer_tokens=LONG_CONTEXT_ANSWER_TOKENS),
        "chat": lambda: chat(files, seed=seed, count=2 if quick else 4,
                             answer_tokens=(48, 64) if quick else (128, 128)),
    }
    check_names(names, WORKLOAD_NAMES, "workloads")
    return {name: makers[name]() for name in names}


def run_bench(loaded: Any, settings: BenchSettings, *, reference: Any = None, threads: int | None = None,
              phase: Phase | None = None, command: str = "") -> tuple[dict, dict[str, list[Task]], list]:
    """Run everything on an opened engine (``engine.load.LoadedEngine``); returns the report, the
    workloads it ran and the raw request records."""
    phase = phase or (lambda _desc, _total: (lambda: None))
    engine = loaded.generator
    manifest = engine.manifest
    long_lengths, long_skipped = fit_lengths(QUICK_LONG_CONTEXT_TOKENS if settings.quick else LONG_CONTEXT_TOKENS,
                                             manifest.limits.max_seq_len)
    names = tuple(n for n in settings.workloads if n != "long-context" or long_lengths)
    workloads = default_workloads(names, loaded.tokenizer, seed=settings.seed, quick=settings.quick,
                                  long_lengths=long_lengths)
    for path in settings.datasets:
        name = Path(path).stem
        if name in workloads:
            raise DLiteError(f"two workloads are named {name!r} (datasets are named after their files, and the "
                             f"generated ones are {', '.join(WORKLOAD_NAMES)}); rename {path} or leave the "
                             "generated workload out with --workloads.")
        workloads[name] = read_jsonl(Path(path))
    if not workloads:
        raise DLiteError("no workloads to run; pass --workloads or --dataset FILE.")
    prepared = prepare(workloads, loaded.tokenizer, manifest.limits.max_seq_len)
    settings = replace(settings, methods=settings.methods or default_methods(manifest.weights.format, settings.quick))
    methods = make_methods(settings.methods, engine, reference, settings.ngram)

    spec = manifest.target_spec
    kv_bytes_per_token = (2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim
                          * TORCH[manifest.dtype].itemsize)
    report: dict[str, Any] = {"schema": SCHEMA, "command": command,
                              "machine": machine(threads), "versions": {"engine_built_with": manifest.versions,
                                                                        "running": package_versions()},
                              "engine": {"backend": manifest.backend, "dtype": manifest.dtype,
                                         "weights": manifest.weights.to_dict(),
                                         "limits": asdict(manifest.limits), "target": manifest.target_name,
                                         "block_size": manifest.draft_config.block_size,
                                         "verify_drafts": engine.verify_drafts,
                                         "verify_width": _calibration(engine)},
                              "settings": settings_json(settings), "workloads": {},
                              "workloads_skipped": {}, "methods_skipped": skipped_methods(settings.methods, manifest)}
    if "long-context" in settings.workloads and long_skipped:
        report["workloads_skipped"]["long-context"] = {
            "prompt_tokens": long_skipped, "prompt_tokens_run": long_lengths,
            "why": f"prompt + answer past the engine's --max-seq-len {manifest.limits.max_seq_len}"}
    records = []
    for name, tasks in prepared.items():
        warm_up(methods, max((p.turns[0] for p in tasks), key=len))  # the workload's largest shapes, untimed
        advance = phase(f"workload {name}", len(tasks) * len(methods))
        summary, recs = run_workload(name, tasks, methods, block_size=manifest.draft_config.block_size,
                                     kv_bytes_per_token=kv_bytes_per_token, advance=advance)
        records += recs
        report["workloads"][name] = {"tasks": len(tasks), "requests": sum(len(p.turns) for p in tasks),
                                     "context_tokens_max": max(p.longest for p in tasks), "methods": summary}

    fits = [b for b in settings.batch_sizes if b <= manifest.limits.max_batch]
    sweep_methods = [m for m in methods if m.name != "reference" and not m.peer_method]  # the engine's
    report["batch_sweep_methods_left_out"] = {m.name: "peer methods decode one sequence at a time"
                                              for m in methods if m.peer_method}
    if fits and sweep_methods:  # first turns of the workload with the shortest prompts, cut to SWEEP_PROMPT_TOKENS
        tasks = min(prepared.values(), key=lambda ts: sum(len(p.turns[0]) for p in ts) / len(ts))
        prompts = [p.turns[0][-SWEEP_PROMPT_TOKENS:] for p in tasks]
        advance = phase("batch sweep", len(fits) * settings.sweep_rounds * len(sweep_methods))
        report["batch_sweep"] = batch_sweep(prompts, sweep_methods, fits, settings.sweep_tokens,
                                            settings.sweep_rounds, advance)
    report["batch_sweep_skipped"] = [b for b in settings.batch_sizes if b not in fits or not sweep_methods]

    # contexts past the engine's limit are skipped, and the longest it allows measured instead
    longest = manifest.limits.max_seq_len - settings.context_steps - 2 * manifest.draft_config.block_size
    contexts = [c for c in settings.contexts if c <= longest]
    skipped = [c for c in settings.contexts if c > longest]
    if skipped and longest > max(contexts, default=0) and longest >= min(settings.contexts):
        contexts.append(longest)
    report["context_cost"] = {"contexts": contexts, "skipped": skipped}
    if contexts:
        prompts = {c: held_out_ids(loaded.tokenizer, c) for c in contexts}
        bursts = max(1, settings.call_runs // 10)
        profiled = manifest.backend == "onnxruntime"  # ONNX Runtime's profiler on the step graph
        advance = phase("step cost vs context",
                        (settings.context_rounds + 1) * len(contexts) + bursts + len(contexts) * profiled)
        cost = report["context_cost"]
        cost["step_vs_decode"] = context_cost.step_vs_decode(engine, prompts, settings.context_steps,
                                                             settings.context_rounds, advance)
        cost["call_times"] = context_cost.call_times(engine, contexts, runs=settings.call_runs, progress=advance)
        if profiled:
            cost["step_profile"] = context_cost.step_profile(engine.runner.engine_dir, contexts,
                                                             drafts=engine.verify_drafts,
                                                             runs=settings.profile_runs, threads=threads,
                                                             progress=advance)
        else:
            cost["step_profile_skipped"] = (f"the kernel profile uses ONNX Runtime's profiler; this is a "
                                            f"{manifest.backend} engine (profile it with nsys)")
    _draft_shares(report, contexts)
    report["methods_failed"] = {m.name: m.failure for m in methods if getattr(m, "failure", None)}
    # the bench's process: our methods (the peers run in worker processes, not counted here)
    report["machine"]["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["goals"] = goals(report)
    return report, workloads, records


def _draft_shares(report: dict, contexts: Sequence[int]) -> None:
    """The draft's share of step time per workload and method. DLite's draft runs inside the step
    call; its wall time is the step call minus a verify-only call, taken at the shortest measured
    context (where that difference is least noisy; the profiler shows it does not depend on the
    context), over the step call at the context nearest the workload's mean. Host drafters
    (n-gram lookup, the reference) time their drafting."""
    calls = report["context_cost"].get("call_times")
    for w in report["workloads"].values():
        for name, s in w["methods"].items():
            s["draft_share"], s["draft_share_source"] = s["host_draft_share"], "host time drafting / decode time"
            if name == "dlite":
                s["draft_share"], s["draft_share_source"] = None, "not measured (no context in range)"
                if calls:
                    ctx = nearest_context(contexts, s["context_tokens"]["mean"])
                    draft_ms = calls[str(min(contexts))]["draft_ms"]
                    s["draft_share"] = min(draft_ms / calls[str(ctx)]["step_call_ms"], 1.0)
                    s["draft_share_source"] = (f"(step call - verify-only call) at context {min(contexts)} / "
                                               f"step call at context {ctx}")


def _calibration(engine: Any) -> dict | None:
    """The engine's verify-width calibration (the curve its k was chosen from), if it has one."""
    from dlite_trt.runtime import verify_width

    engine_dir = getattr(engine.runner, "engine_dir", None)
    choice = None if engine_dir is None else verify_width.load(engine_dir, engine.cfg.num_proposals)
    return None if choice is None else choice.to_dict() | {"measured_elsewhere": choice.measured_elsewhere()}


def settings_json(settings: BenchSettings) -> dict:
    out = asdict(settings)
    out["datasets"] = [str(p) for p in settings.datasets]
    return out


def machine(threads: int | None) -> dict:
    import torch

    from dlite_trt.runtime import verify_width

    return {"platform": platform.platform(), "processor": verify_width.this_machine()["cpu"],
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "threads": threads or "each library's default",  # intra-op threads of every method and peer
            "torch_threads": torch.get_num_threads(), "ci": bool(os.environ.get("CI"))}
