"""`dlite-trt bench`: DLite against target-only decoding and n-gram prompt lookup, side by side."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from dlite_trt.bench.names import (
    DEFAULT_PEERS,
    METHOD_NAMES,
    PEER_NAMES,
    WORKLOAD_NAMES,
    check_names,
)
from dlite_trt.cli.inputs import THREADS, VERIFY_DRAFTS, check_engine_dir
from dlite_trt.errors import DLiteError

BUILD_MAX_SEQ_LEN = 16384 + 256  # what an engine built here for the bench holds: the longest workload


def _ints(value: str, option: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=option) from exc
    if not out or min(out) < 1:
        raise click.BadParameter(f"expected integers >= 1, got {value!r}", param_hint=option)
    return out


def _names(value: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    try:
        return check_names((v.strip() for v in value.split(",") if v.strip()), allowed, "names")
    except DLiteError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc


@click.command("bench")
@click.option("--engine", type=click.Path(path_type=Path), metavar="DIRECTORY",
              help="Engine directory. Without it, one is built into OUT/engine from --target/--draft "
                   "(default: SmolLM2-135M-Instruct and its bundled draft).")
@click.option("--target", help="Model directory, .gguf file or preset (with --draft): build from it, or check --engine against it.")
@click.option("--draft", type=click.Path(path_type=Path), help="dlite_v1 draft checkpoint directory (with --target).")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("bench-results"),
              show_default=True, help="Directory for bench.json, requests.jsonl, the plots and the workloads run.")
@click.option("--workloads", default=",".join(WORKLOAD_NAMES), show_default=True,
              help="Generated workloads to run (comma-separated; '' for none).")
@click.option("--dataset", "datasets", multiple=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Your own JSONL dataset (task_id, prompt or input_ids, output_tokens, turns); repeatable.")
@click.option("--methods", default="auto", show_default=True,
              help=f"Methods side by side: auto (ar, dlite, ngram, dlite-ngram and, without --quick, the peers for "
                   f"the engine's weights: "
                   f"{', '.join(DEFAULT_PEERS['float'])} for a float engine, {', '.join(DEFAULT_PEERS['int4'])} "
                   f"for an int4 one), or from: {', '.join(METHOD_NAMES)} (reference = the PyTorch generator; "
                   f"{', '.join(PEER_NAMES)}: other libraries on the same target, batch 1, skipped with a line "
                   "saying why where not installed; see docs/bench.md, Peers).")
@click.option("--batch-sizes", default="1,2,4,8", show_default=True, help="Batch sweep sizes [--quick: 1,4].")
@click.option("--contexts", default="256,2048,8192,16384", show_default=True,
              help="Context lengths for step cost vs context [--quick: 256,2048].")
@click.option("--quick", is_flag=True, help="A run of about a minute: fewer, shorter tasks and samples.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the generated workloads.")
@click.option("--threads", type=THREADS,
              help="Intra-op threads of every method and peer (ONNX Runtime, onnxruntime-genai, llama.cpp, torch) "
                   "[default: one per physical core this process may use, as ONNX Runtime's own default].")
@click.option("--ngram-max", default=3, show_default=True, type=click.IntRange(min=1), help="Longest n-gram matched.")
@click.option("--ngram-min", default=2, show_default=True, type=click.IntRange(min=1), help="Shortest n-gram matched.")
@VERIFY_DRAFTS
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def command(engine: Path | None, target: str | None, draft: Path | None, out: Path, workloads: str,
            datasets: tuple[Path, ...], methods: str, batch_sizes: str, contexts: str, quick: bool, seed: int,
            threads: int | None, ngram_max: int, ngram_min: int, verify_drafts: int | str, no_plots: bool) -> None:
    """Benchmark DLite against target-only decoding and n-gram prompt lookup on agentic,
    long-context and chat workloads, in one process on one engine. Writes OUT/bench.json, the
    plots and the workloads as JSONL; prints the tables."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from transformers.utils import logging as hf_logging

    from dlite_trt.bench.report import (
        print_tables,
        write_json,
        write_plots,
        write_records,
    )
    from dlite_trt.bench.live import default_threads
    from dlite_trt.bench.suite import BenchSettings, run_bench
    from dlite_trt.bench.workloads import write_jsonl
    from dlite_trt.bundled import check_pair_options, pair_or_default
    from dlite_trt.runtime.prompt_lookup import PromptLookupConfig

    hf_logging.disable_progress_bar()
    check_pair_options(target, draft)
    threads = threads or default_threads()  # one count for every method and peer, recorded in bench.json
    import torch

    torch.set_num_threads(threads)  # the reference generator and transformers' generate
    if ngram_min > ngram_max:
        raise click.BadParameter(f"--ngram-min {ngram_min} is above --ngram-max {ngram_max}",
                                 param_hint="'--ngram-min'")
    method_names = () if methods == "auto" else _names(methods, METHOD_NAMES, "'--methods'")
    if not method_names and methods != "auto":
        raise click.BadParameter("name at least one method", param_hint="'--methods'")
    options = dict(workloads=_names(workloads, WORKLOAD_NAMES, "'--workloads'"), datasets=datasets,
                   methods=method_names, seed=seed, ngram=PromptLookupConfig(max_ngram=ngram_max, min_ngram=ngram_min))
    given = click.get_current_context().get_parameter_source
    for name, value, option in (("batch_sizes", batch_sizes, "'--batch-sizes'"),
                                ("contexts", contexts, "'--contexts'")):
        if not quick or given(name) is not click.core.ParameterSource.DEFAULT:  # --quick has its own defaults
            options[name] = _ints(value, option)
    settings = BenchSettings.quick_run(**options) if quick else BenchSettings(**options)
    console = Console(stderr=True)
    if engine is None:
        engine = out / "engine"
        if not (engine / "manifest.json").is_file():
            from dlite_trt.engine.build import BuildSettings, build_engine
            from dlite_trt.export.contract import EngineLimits

            src_target, src_draft = pair_or_default(target, draft)
            console.print(f"building an engine into {engine} (max seq len {BUILD_MAX_SEQ_LEN}, or the target's "
                          "max_position_embeddings if less)")
            from dlite_trt.bench.calibrate import calibrate_engine

            build_engine(src_target, src_draft, engine,
                         BuildSettings(limits=EngineLimits(max_batch=8, max_seq_len=BUILD_MAX_SEQ_LEN, max_chunk=512),
                                       fit_seq_len_to_target=True),
                         progress=False, calibrate=lambda built: console.print(
                             calibrate_engine(built, threads=threads, shown_as=engine)[1]))
    else:
        check_engine_dir(engine, hint=", or leave out --engine to build one here")

    from dlite_trt.engine.load import load_engine

    reference = None
    check_target, check_draft = target, draft
    if "reference" in method_names:
        from dlite_trt.loading import load_pair

        check_target, check_draft = pair_or_default(target, draft)
        reference = load_pair(check_target, check_draft).generator
    loaded = load_engine(engine, target=check_target, draft=check_draft, threads=threads,
                         preload=("prefill", "step", "decode"), verify_drafts=verify_drafts)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        def phase(description: str, total: int):
            task = progress.add_task(description, total=total)
            return lambda: progress.advance(task)

        report, ran, records = run_bench(loaded, settings, reference=reference, threads=threads, phase=phase,
                                         command=shlex.join(["dlite-trt", *sys.argv[1:]]))
    report["engine"]["dir"] = str(engine)
    out.mkdir(parents=True, exist_ok=True)
    for name, tasks in ran.items():
        write_jsonl(tasks, out / "workloads" / f"{name}.jsonl")
    write_records(records, out / "requests.jsonl")
    write_json(report, out / "bench.json")
    plots = [] if no_plots else write_plots(report, out)
    print_tables(report, Console())
    click.echo(f"wrote {out / 'bench.json'}, {out / 'requests.jsonl'}"
               + "".join(f", {p}" for p in plots) + f", {out / 'workloads'}/*.jsonl")

