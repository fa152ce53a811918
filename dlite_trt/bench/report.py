"""The bench's outputs: a table in the terminal (rich), the JSON report and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dlite_trt.bench.names import METHOD_TITLES

SCHEMA = "dlite-trt-bench/1"


def goals(report: dict) -> dict:
    """The issue's targets, checked on this report: per workload, DLite's speedup over target-only
    decoding against 0.8 x its mean acceptance length and its tokens/s against n-gram lookup's;
    the draft's time per step at the longest measured context against the shortest's."""
    out: dict[str, Any] = {}
    for name, w in report["workloads"].items():
        m = w["methods"]
        if "dlite" not in m or "ar" not in m:
            continue
        d = m["dlite"]
        row = {"speedup_over_ar": d["speedup_over_ar"], "mean_acceptance_length": d["mean_acceptance_length"],
               "speedup_over_al": d["speedup_over_ar"] / d["mean_acceptance_length"]}
        row["speedup_at_least_0.8_al"] = row["speedup_over_al"] >= 0.8
        if d.get("decode_speedup_over_ar"):  # prefill excluded: what the drafting itself gains
            row["decode_speedup_over_ar"] = d["decode_speedup_over_ar"]
            row["decode_speedup_over_al"] = d["decode_speedup_over_ar"] / d["mean_acceptance_length"]
        if "ngram" in m:
            row["dlite_over_ngram"] = d["tokens_per_second"] / m["ngram"]["tokens_per_second"]
            row["ahead_of_ngram"] = row["dlite_over_ngram"] > 1.0
        out[name] = row
    profile = report.get("context_cost", {}).get("step_profile") or {}
    if len(profile) >= 2:
        contexts = sorted(profile, key=int)
        lo, hi = profile[contexts[0]]["draft_ms"], profile[contexts[-1]]["draft_ms"]
        out["draft_time_flat"] = {"contexts": [int(contexts[0]), int(contexts[-1])], "ratio": hi / lo,
                                  "within_10_percent": abs(hi / lo - 1.0) <= 0.10}
    return out


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_records(records: list, path: Path) -> None:
    """One JSON line per request (``metrics.RequestRecord``), without the generated ids."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({k: v for k, v in asdict(r).items() if k != "output_ids"}) + "\n"
                            for r in records))


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _lossless(s: dict) -> str:
    bad = s["lossless"]["mismatches"]
    return "-" if bad is None else "yes" if bad == 0 else f"NO ({bad} requests)"


_ROWS = (  # (row label, cell from a method's summary)
    ("output tokens/s", lambda s: _fmt(s["tokens_per_second"], ".0f")),
    ("speedup over target-only", lambda s: _fmt(s.get("speedup_over_ar"), ".2f")),
    ("decode-phase speedup (no prefill)", lambda s: _fmt(s.get("decode_speedup_over_ar"), ".2f")),
    ("mean acceptance length", lambda s: _fmt(s["mean_acceptance_length"], ".2f")),
    ("draft acceptance rate", lambda s: _fmt(s["acceptance_rate"], ".0%")),
    ("TTFT p50 ms", lambda s: _fmt(s["ttft_s"]["p50"], ".1f", 1e3)),
    ("TPOT p50 / p90 / p99 ms", lambda s: " / ".join(_fmt(s["tpot_s"][p], ".2f", 1e3) for p in ("p50", "p90", "p99"))),
    ("draft share of step time", lambda s: _fmt(s.get("draft_share"), ".0%")),
    ("draft work on new context (tokens)", lambda s: str(s["draft_context_tokens"])),
    ("draft state (bytes)", lambda s: str(s["draft_state_bytes_max"])),
    ("target KV (bytes)", lambda s: str(s["target_kv_bytes_max"])),
    ("same tokens as target-only", _lossless),
)


def print_tables(report: dict, console: Any) -> None:
    from rich.table import Table

    for name, w in report["workloads"].items():
        table = Table(title=f"{name}: {w['tasks']} tasks, {w['requests']} requests, context up to "
                            f"{w['context_tokens_max']} tokens", title_justify="left")
        methods = w["methods"]
        table.add_column("")
        for method in methods:
            table.add_column(METHOD_TITLES[method], justify="right")
        for label, cell in _ROWS:
            table.add_row(label, *(cell(s) for s in methods.values()))
        console.print(table)
    if report.get("batch_sweep"):
        sweep = report["batch_sweep"]
        table = Table(title=f"batch sweep: output tokens/s ({report['settings']['sweep_tokens']} new tokens each)",
                      title_justify="left")
        table.add_column("method")
        for b in sweep:
            table.add_column(f"batch {b}", justify="right")
        for method in next(iter(sweep.values())):
            table.add_row(METHOD_TITLES[method], *(f"{sweep[b][method]['tokens_per_second']:.0f}"
                                                  + (f" ({sweep[b][method]['speedup_over_ar']:.2f}x)"
                                                     if "speedup_over_ar" in sweep[b][method] else "")
                                                  for b in sweep))
        console.print(table)
    for name, skip in report.get("workloads_skipped", {}).items():
        console.print(f"{name} prompts of {skip['prompt_tokens']} tokens not run ({skip['why']}); ran "
                      f"{skip['prompt_tokens_run'] or 'none'}")
    if report["batch_sweep_skipped"]:
        console.print(f"batch sizes not run: {report['batch_sweep_skipped']} (above the engine's --max-batch "
                      f"{report['engine']['limits']['max_batch']}, or no engine method to sweep)")
    cost = report["context_cost"]
    if cost.get("step_vs_decode"):
        table = Table(title="step cost vs context, ms (the draft is history-free: its time must stay flat)",
                      title_justify="left")
        for col in ("context", "DLite step", "decode step", "step call", "verify call", "decode call",
                    "draft kernels", "verify kernels"):
            table.add_column(col, justify="right")
        for ctx, row in cost["step_vs_decode"].items():
            call, prof = cost["call_times"][ctx], cost.get("step_profile", {}).get(ctx, {})
            table.add_row(ctx, *(_fmt(v, ".2f") for v in (
                row["speculative_step_ms"], row["decode_step_ms"], call["step_call_ms"], call["verify_call_ms"],
                call["decode_call_ms"], prof.get("draft_ms"), prof.get("target_ms"))))
        console.print(table)
        console.print("DLite/decode step: whole steps with host work; calls: one engine call each (verify = a "
                      "decode call of K+1 tokens); kernels: ONNX Runtime's profiler on the unoptimized step graph.")
        if cost.get("step_profile_skipped"):
            console.print(f"kernels not profiled: {cost['step_profile_skipped']}")
    if cost["skipped"]:
        console.print(f"contexts not measured: {cost['skipped']} (past the engine's --max-seq-len); measured: "
                      f"{cost['contexts'] or 'none'}")
    for name, g in report["goals"].items():
        if name == "draft_time_flat":
            console.print(f"draft time per step, {g['contexts'][1]} vs {g['contexts'][0]} tokens of context: "
                          f"{g['ratio']:.3f}x ({'within' if g['within_10_percent'] else 'NOT within'} 10%)")
            continue
        line = (f"{name}: DLite {g['speedup_over_ar']:.2f}x over target-only = {g['speedup_over_al']:.2f} x AL "
                f"{g['mean_acceptance_length']:.2f} ({'>=' if g['speedup_at_least_0.8_al'] else '<'} 0.8)")
        if "decode_speedup_over_al" in g:
            line += f" (decode phase: {g['decode_speedup_over_al']:.2f} x AL)"
        if "dlite_over_ngram" in g:
            line += f"; {g['dlite_over_ngram']:.2f}x n-gram lookup's tokens/s"
        console.print(line)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """speedup.png (per workload and method), acceptance.png (AL histograms), context_cost.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    workloads = report["workloads"]
    methods = list(next(iter(workloads.values()))["methods"])

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [w["methods"][method].get("speedup_over_ar") or 0.0 for w in workloads.values()]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=METHOD_TITLES[method])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(workloads))], list(workloads))
    ax.set_ylabel("output tokens/s over target-only")
    ax.set_title("speedup per workload")
    ax.legend()
    paths.append(_save(fig, out_dir / "speedup.png"))

    drafted = [m for m in methods if m != "ar"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.5), squeeze=False)
    for ax, (name, w) in zip(axes[0], workloads.items(), strict=True):
        for i, method in enumerate(drafted):
            hist = w["methods"][method]["acceptance_histogram"]
            total = sum(hist.values()) or 1
            ax.bar([int(k) + (i - (len(drafted) - 1) / 2) * 0.8 / max(len(drafted), 1) for k in hist],
                   [v / total for v in hist.values()], 0.8 / max(len(drafted), 1), label=METHOD_TITLES[method])
        ax.set_title(name)
        ax.set_xlabel("tokens per step")
    axes[0][0].set_ylabel("share of steps")
    if drafted:
        axes[0][0].legend()
    paths.append(_save(fig, out_dir / "acceptance.png"))

    cost = report["context_cost"]
    if cost.get("step_vs_decode"):
        fig, ax = plt.subplots(figsize=(7, 4))
        ctx = sorted(cost["step_vs_decode"], key=int)
        x = [int(c) for c in ctx]
        ax.plot(x, [cost["step_vs_decode"][c]["speculative_step_ms"] for c in ctx], "o-", label="DLite step (wall)")
        ax.plot(x, [cost["step_vs_decode"][c]["decode_step_ms"] for c in ctx], "s-", label="decode step (wall)")
        ax.plot(x, [cost["call_times"][c]["verify_call_ms"] for c in ctx], "d:", label="verify-only call (wall)")
        if cost.get("step_profile"):
            ax.plot(x, [cost["step_profile"][c]["draft_ms"] for c in ctx], "^--", label="draft kernels (profiler)")
            ax.plot(x, [cost["step_profile"][c]["target_ms"] for c in ctx], "v--", label="verify kernels (profiler)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per call")
        ax.set_title("step cost vs context")
        ax.legend()
        paths.append(_save(fig, out_dir / "context_cost.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
