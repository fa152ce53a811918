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
from dlite_trt.bench.methods import make_methods
from dlite_trt.bench.report import SCHEMA, goals
from dlite_trt.bench.run import batch_sweep, nearest_context, prepare, run_workload, warm_up
from dlite_trt.bench.workloads import (
    LONG_CONTEXT_TOKENS,
    WORKLOAD_NAMES,
    Task,
    agentic,
    chat,
    held_out_ids,
    long_context,
    read_jsonl,
    source_files,
)
from dlite_trt.engine.build import package_versions
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.prompt_lookup import PromptLookupConfig

SWEEP_PROMPT_TOKENS = 1024
Phase = Callable[[str, int], Callable[[], None]]  # (description, total) -> advance


@dataclass(frozen=True)
class BenchSettings:
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    datasets: tuple[Path, ...] = ()  # user JSONL files: each is a workload named after the file
    methods: tuple[str, ...] = ("ar", "dlite", "ngram")
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    sweep_tokens: int = 128
    sweep_rounds: int = 2
    contexts: tuple[int, ...] = (256, 2048, 8192, 16384)
    context_steps: int = 64
    context_rounds: int = 3
    profile_runs: int = 60
    seed: int = 0
    ngram: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    quick: bool = False

    @classmethod
    def quick_run(cls, **overrides: Any) -> BenchSettings:
        """About a minute on a laptop CPU with the bundled models: fewer, shorter tasks and samples."""
        return replace(cls(batch_sizes=(1, 4), sweep_tokens=32, sweep_rounds=1, contexts=(256, 16384),
                           context_steps=32, context_rounds=1, profile_runs=30, quick=True), **overrides)


def default_workloads(names: Sequence[str], tokenizer: Any, *, seed: int, quick: bool) -> dict[str, list[Task]]:
    """The generated workloads (seeded, from the held-out standard-library sources)."""
    files = source_files()
    makers = {
        "agentic": lambda: agentic(files, seed=seed, sessions=1 if quick else 4, turns=3 if quick else 5),
        "long-context": lambda: long_context(files, tokenizer, seed=seed,
                                             lengths=(2048, 16384) if quick else LONG_CONTEXT_TOKENS),
        "chat": lambda: chat(files, seed=seed, count=2 if quick else 6,
                             answer_tokens=(64, 96) if quick else (192, 320)),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise DLiteError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOAD_NAMES)} "
                         "or pass --dataset FILE.")
    return {name: makers[name]() for name in names}


def run_bench(loaded: Any, settings: BenchSettings, *, reference: Any = None, threads: int | None = None,
              phase: Phase | None = None, command: str = "") -> tuple[dict, dict[str, list[Task]], list]:
    """Run everything on an opened engine (``engine.load.LoadedEngine``); returns the report, the
    workloads it ran and the raw request records."""
    phase = phase or (lambda _desc, _total: (lambda: None))
    engine = loaded.generator
    manifest = engine.manifest
    workloads = default_workloads(settings.workloads, loaded.tokenizer, seed=settings.seed, quick=settings.quick)
    for path in settings.datasets:
        workloads[Path(path).stem] = read_jsonl(Path(path))
    if not workloads:
        raise DLiteError("no workloads to run; pass --workloads or --dataset FILE.")
    prepared = prepare(workloads, loaded.tokenizer, manifest.limits.max_seq_len)
    methods = make_methods(settings.methods, engine, reference, settings.ngram)
    warm_up(methods, next(iter(prepared.values()))[0].turns[0][:256])

    spec = manifest.target_spec
    kv_bytes_per_token = (2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim
                          * _dtype_bytes(manifest.dtype))
    report: dict[str, Any] = {"schema": SCHEMA, "command": command,
                              "machine": machine(threads), "versions": {"engine_built_with": manifest.versions,
                                                                        "running": package_versions()},
                              "engine": {"backend": manifest.backend, "dtype": manifest.dtype,
                                         "limits": asdict(manifest.limits), "target": manifest.target_name,
                                         "block_size": manifest.draft_config.block_size},
                              "settings": settings_json(settings), "workloads": {}}
    records = []
    for name, tasks in prepared.items():
        advance = phase(f"workload {name}", len(tasks) * len(methods))
        summary, recs = run_workload(name, tasks, methods, block_size=manifest.draft_config.block_size,
                                     kv_bytes_per_token=kv_bytes_per_token, advance=advance)
        records += recs
        report["workloads"][name] = {"tasks": len(tasks), "requests": sum(len(p.turns) for p in tasks),
                                     "context_tokens_max": max(p.longest for p in tasks), "methods": summary}

    fits = [b for b in settings.batch_sizes if b <= manifest.limits.max_batch]
    sweep_methods = [m for m in methods if m.name != "reference"]
    if fits:  # the first turns of the workload with the shortest prompts, at most SWEEP_PROMPT_TOKENS each
        tasks = min(prepared.values(), key=lambda ts: sum(len(p.turns[0]) for p in ts) / len(ts))
        prompts = [p.turns[0][-SWEEP_PROMPT_TOKENS:] for p in tasks]
        advance = phase("batch sweep", len(fits) * settings.sweep_rounds * len(sweep_methods))
        report["batch_sweep"] = batch_sweep(prompts, sweep_methods, fits, settings.sweep_tokens,
                                            settings.sweep_rounds, advance)
    report["batch_sweep_skipped"] = [b for b in settings.batch_sizes if b not in fits]

    contexts = [c for c in settings.contexts if c + settings.context_steps + 2 * manifest.draft_config.block_size
                <= manifest.limits.max_seq_len]
    report["context_cost"] = {"contexts": contexts, "skipped": [c for c in settings.contexts if c not in contexts]}
    if contexts and "dlite" in settings.methods:
        prompts = {c: held_out_ids(loaded.tokenizer, c) for c in contexts}
        advance = phase("step cost vs context", (settings.context_rounds + 1) * len(contexts) + len(contexts))
        report["context_cost"]["step_vs_decode"] = context_cost.step_vs_decode(
            engine, prompts, settings.context_steps, settings.context_rounds, advance)
        report["context_cost"]["step_profile"] = context_cost.step_profile(
            engine.runner.engine_dir, contexts, runs=settings.profile_runs, threads=threads, progress=advance)
        _draft_shares(report, contexts)
    for w in report["workloads"].values():
        for name, s in w["methods"].items():
            if name != "dlite":
                s["draft_share"] = s["host_draft_share"]
    report["machine"]["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["goals"] = goals(report)
    return report, workloads, records


def _draft_shares(report: dict, contexts: Sequence[int]) -> None:
    """DLite's draft share of step time per workload, from the step profile at the nearest context."""
    profile = report["context_cost"]["step_profile"]
    for w in report["workloads"].values():
        s = w["methods"].get("dlite")
        if s is None:
            continue
        ctx = nearest_context(contexts, s["context_tokens"]["mean"])
        row = profile[str(ctx)]
        s["draft_share"] = row["draft_ms"] / (row["draft_ms"] + row["target_ms"] + row["other_ms"])
        s["draft_share_source"] = f"step graph profile at context {ctx}"


def settings_json(settings: BenchSettings) -> dict:
    out = asdict(settings)
    out["datasets"] = [str(p) for p in settings.datasets]
    return out


def machine(threads: int | None) -> dict:
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime_threads": threads or "default (one per physical core)",
            "torch_threads": torch.get_num_threads(), "ci": bool(os.environ.get("CI"))}


def _dtype_bytes(dtype: str) -> int:
    return {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
