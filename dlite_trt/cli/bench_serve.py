"""`dlite-trt bench-serve`: the agentic replay benchmark through the OpenAI API (real servers)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from dlite_trt.cli.inputs import THREADS, check_engine_dir


def _list(value: str, option: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if allowed is not None and v not in allowed]
    if not items or bad:
        raise click.BadParameter(f"expected a comma-separated list of {', '.join(allowed or ('values',))}; got "
                                 f"{value!r}", param_hint=option)
    return items


@click.command("bench-serve")
@click.option("--engine", required=True, type=click.Path(path_type=Path), metavar="DIRECTORY",
              help="Engine directory from `dlite-trt build`.")
@click.option("--dataset", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Sessions as bench JSONL (a `turns` list per line) [default: the bench's agentic workload].")
@click.option("--sessions", type=click.IntRange(min=1), help="Agentic sessions [default: the largest concurrency; "
                                                             "4 with --quick].")
@click.option("--turns", type=click.IntRange(min=1), help="Turns per agentic session [default: 5; 3 with --quick].")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Concurrent clients, comma-separated.")
@click.option("--speculative", "methods", default="dlite,dlite-ngram,ngram,none", show_default=True,
              help="Server drafting methods, comma-separated.")
@click.option("--reuse", default="on,off", show_default=True, help="Prefix reuse settings, comma-separated.")
@click.option("--tools", is_flag=True, help="The tool-using agent replay: chat requests with tools (read_file, grep, "
                                          "run_tests), the model's calls run and their results sent back.")
@click.option("--quick", is_flag=True, help="4 sessions of 3 turns at concurrency 1 and 4, dlite and none.")
@click.option("--kv-cache-gb", default=4.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="Each server's --kv-cache-gb.")
@click.option("--threads", type=THREADS, help="ONNX Runtime threads of the server (default: one per core).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the generated sessions.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("bench-serve"),
              show_default=True, help="report.json and ttft_by_turn.png go here.")
def command(engine: Path, dataset: Path | None, sessions: int | None, turns: int | None, concurrency: str,
            methods: str, reuse: str, tools: bool, quick: bool, kv_cache_gb: float, threads: int | None, seed: int,
            out: Path) -> None:
    """Replay multi-turn agent sessions as concurrent OpenAI clients, each turn sending the whole
    context so far; per-turn TTFT, TPOT, tokens/s, prefix-cache hits and acceptance, for each
    --speculative method with prefix reuse on and off, and the server against the runtime."""
    check_engine_dir(engine)
    from rich.console import Console

    from dlite_trt.bench.serve_replay import print_table, run, write_plot
    from dlite_trt.bench.workloads import agentic, read_jsonl, source_files, tool_agentic

    if quick:
        concurrency, methods, reuse = "1,4", "dlite,none", "on,off"
        sessions, turns = sessions or 4, turns or 3
    levels = tuple(int(c) for c in _list(concurrency, "--concurrency") if c.isdigit() and int(c) > 0)
    if len(levels) != len(_list(concurrency, "--concurrency")):
        raise click.BadParameter(f"expected integers >= 1, got {concurrency!r}", param_hint="--concurrency")
    chosen = _list(methods, "--speculative", ("dlite", "dlite-ngram", "ngram", "none"))
    settings = tuple(v == "on" for v in _list(reuse, "--reuse", ("on", "off")))
    if tools and dataset is not None:
        raise click.UsageError("--tools replays generated tool-using sessions; drop --dataset or --tools")
    if tools:
        tasks = tool_agentic(source_files(), seed=seed, sessions=sessions or max(levels), turns=turns or 3)
    elif dataset is not None:
        tasks = read_jsonl(dataset)
    else:
        tasks = agentic(source_files(), seed=seed, sessions=sessions or max(levels), turns=turns or 5)
    console = Console(width=120)
    report = run(engine, tasks, methods=chosen, reuse=settings, concurrency=levels, threads=threads,
                 kv_cache_gb=kv_cache_gb, log=console.print)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_plot(report, out / "ttft_by_turn.png")
    print_table(report, console)
    console.print(f"wrote {out / 'report.json'} and {out / 'ttft_by_turn.png'}")
