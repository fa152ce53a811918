"""The bench's outputs: a table in the terminal (rich), the JSON report and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dlite_trt.bench.names import METHOD_TITLES
from dlite_trt.runtime.verify_width import IMPOSSIBLE_STEP

SCHEMA = "dlite-trt-bench/1"


DLITE_METHODS = ("dlite", "dlite-ngram")  # the methods the targets are checked for

# (goal name, the methods it compares DLite with (the fastest that ran counts), the ratio DLite must
# reach, the engine weights it applies to, the DLite methods it is checked for); the issues'
# targets, declared once
TARGETS = (
    ("over_ar", ("ar",), 2.0, "float", DLITE_METHODS),
    ("over_ngram", ("ngram",), 1.3, "float", DLITE_METHODS),
    ("at_least_ngram", ("ngram",), 1.0, "float", ("dlite-ngram",)),  # the lookup's own proposals + the draft
    ("over_hf", ("hf",), 2.5, "float", DLITE_METHODS),
    ("over_ort_genai", ("ort-genai", "ort-genai-ngram"), 1.0, "float", DLITE_METHODS),
    ("over_ort_genai_int4", ("ort-genai-int4", "ort-genai-int4-ngram"), 1.0, "int4", DLITE_METHODS),
    ("over_llama_cpp", ("llama-cpp", "llama-cpp-lookup"), 1.0, "int4", DLITE_METHODS),
)
STEP_CALL_OVER_DECODE = 1.25  # the step call at the calibrated width, at the shortest measured context


def _targets(m: dict, variant: str, weights: str, noise: dict) -> dict:
    """``variant``'s tokens/s over each target's fastest peer mode that ran, against what it needs,
    and the same ratio of decode-phase tokens/s (prefill excluded) where both have it. ``met`` is
    None (not judged) when the run's timings are impossible or its rounds spread wider than the
    distance between the ratio and what it needs (``noise``)."""
    out = {}
    for goal, peers, need, applies, variants in TARGETS:
        ran = [p for p in peers if p != variant and m.get(p, {}).get("tokens_per_second")]
        if applies != weights or variant not in variants or not ran:
            continue
        best = max(ran, key=lambda p: m[p]["tokens_per_second"])
        ratio = m[variant]["tokens_per_second"] / m[best]["tokens_per_second"]
        unsure = noise["impossible"] or noise["rounds"] < MIN_ROUNDS or \
            (noise["round_spread"] or 0.0) > abs(ratio / need - 1.0)
        out[goal] = {"fastest": best, "ratio": ratio, "need": need, "met": None if unsure else ratio >= need}
        decode = [m[k].get("decode_tokens_per_second") for k in (variant, best)]
        if all(decode):
            out[goal]["decode_phase_ratio"] = decode[0] / decode[1]
    return out


MIN_ROUNDS = 3  # rounds (tasks) below which a workload's spread says nothing, and no goal is judged


def noise(summary: dict) -> dict:
    """How far one workload's timings of a speculative method can be trusted: ``impossible`` when
    its step measured well below a decode step (a DLite step verifies K+1 tokens and drafts; a
    DLite + n-gram step without the draft verifies its proposal on the decode graph: neither can
    cost less than a decode call), which only a machine busy with something else can make happen;
    ``round_spread``, half the p10-p90 width of its round-by-round step time over target-only's,
    relative to the median: both methods ran each round's same contexts back to back, so the
    spread of that ratio is (nearly) noise alone, where the speedups' spread also holds the
    rounds' different acceptance."""
    paired = summary.get("paired") or {}
    step = [v for v in (summary.get("step_time_over_ar"), (paired.get("step_time_over_ar") or {}).get("median"))
            if v is not None]
    rounds = paired.get("step_time_over_ar")
    out = {"rounds": paired.get("rounds", 0), "impossible": bool(step) and min(step) < IMPOSSIBLE_STEP,
           "step_time_over_ar": min(step, default=None), "step_rounds": rounds,
           "round_spread": (rounds["p90"] - rounds["p10"]) / (2 * rounds["median"]) if rounds and rounds["median"]
           else None}
    why = []
    if out["impossible"]:
        why.append(f"a step measured {out['step_time_over_ar']:.2f}x a decode step, which physics rules out (it "
                   "verifies at least as many tokens as a decode call): the machine was busy")
    if out["rounds"] < MIN_ROUNDS:
        why.append(f"only {out['rounds']} rounds (tasks): too few to tell noise (at least {MIN_ROUNDS})")
    if out["round_spread"] is not None:
        why.append(f"step time rounds spread +-{out['round_spread']:.0%} over {out['rounds']} rounds")
    out["summary"] = "; ".join(why)
    return out


def goals(report: dict) -> dict:
    """The targets, checked on this report, per workload: DLite's tokens/s over each peer's fastest
    mode that ran (``TARGETS``; the int4 ones on an int4 engine, the others on a float one),
    losslessness, and the decomposition that explains the speedup over target-only (mean AL,
    step time over a decode step's, the draft's share); plus DLite's speedup against 0.8 x its
    mean acceptance length, and the draft's time per step at the longest measured context
    against the shortest's."""
    out: dict[str, Any] = {}
    weights = report.get("engine", {}).get("weights", {}).get("format", "float")
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
        row["noise"] = {variant: noise(m[variant]) for variant in DLITE_METHODS if variant in m}
        row["targets"] = {variant: _targets(m, variant, weights, row["noise"][variant])
                          for variant in DLITE_METHODS if variant in m}
        row["lossless"] = {k: m[k]["lossless"]["mismatches"] for k in (*DLITE_METHODS, "ngram")
                           if k in m and "lossless" in m[k]}
        row["decomposition"] = {"mean_acceptance_length": d["mean_acceptance_length"],
                                "step_time_over_decode_step": d.get("step_time_over_ar"),
                                "draft_share_of_step": d.get("draft_share")}
        out[name] = row
    calls = report.get("context_cost", {}).get("call_times") or {}
    if calls:
        ctx = min(calls, key=int)
        ratio = calls[ctx]["step_over_decode"]
        out["step_call_over_decode"] = {"context": int(ctx), "verify_width": calls[ctx].get("verify_width"),
                                        "ratio": ratio, "need": STEP_CALL_OVER_DECODE,
                                        "met": ratio <= STEP_CALL_OVER_DECODE}
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
    loss = s["lossless"]
    bad = loss["mismatches"]
    if bad is None:
        return "-"
    if bad == 0:
        return "yes"
    if not loss.get("expected_identical", True):  # other numerics: where it leaves target-only's tokens
        return f"diverges at {min(loss['divergence_index'].values())} ({bad} requests)"
    return f"NO ({bad} requests)"


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

    _print_verify_width(report["engine"], console)
    for name, why in report.get("methods_skipped", {}).items():
        console.print(f"skipping method {name}: {why}")
    for name, why in report.get("methods_failed", {}).items():
        console.print(f"method {name} FAILED and is left out of the tables: {why}")

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
                      "decode call of the k+1 tokens a DLite step verifies there); kernels: ONNX Runtime's "
                      "profiler on the unoptimized step graph.")
        if cost.get("step_profile_skipped"):
            console.print(f"kernels not profiled: {cost['step_profile_skipped']}")
    if cost["skipped"]:
        console.print(f"contexts not measured: {cost['skipped']} (past the engine's --max-seq-len); measured: "
                      f"{cost['contexts'] or 'none'}")
    for name, g in report["goals"].items():
        if name == "step_call_over_decode":
            console.print(f"a step call (verifying {g['verify_width'] or '?'} tokens, drafting) after {g['context']} "
                          f"tokens of context: {g['ratio']:.2f}x a decode call (need <= {g['need']}: "
                          f"{'met' if g['met'] else 'NOT met'})")
            continue
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
        dec = g["decomposition"]
        if dec["step_time_over_decode_step"]:
            line += (f"; a DLite step takes {dec['step_time_over_decode_step']:.2f}x a decode step"
                     + (f", the draft {dec['draft_share_of_step']:.0%} of it" if dec["draft_share_of_step"] else ""))
        console.print(line)
        for variant, targets in g["targets"].items():
            console.print(f"  {METHOD_TITLES[variant]}: {target_phrases(targets)}")
            if g["noise"][variant]["summary"]:
                console.print(f"    noise: {g['noise'][variant]['summary']}")


def target_phrases(targets: dict) -> str:
    """A method's goals, one phrase per peer it was compared with: goals on the same ratio (DLite +
    n-gram against n-gram lookup: the 1.3x goal and the 1.0x one) share it, each need with its verdict."""
    by_peer: dict[str, list[dict]] = {}
    for t in targets.values():
        by_peer.setdefault(t["fastest"], []).append(t)
    return "; ".join(
        f"{ts[0]['ratio']:.2f}x {METHOD_TITLES.get(peer, peer)} ("
        + "; ".join(f"need {t['need']}: {_verdict(t['met'])}" for t in ts) + f"{_decode_phase(ts[0])})"
        for peer, ts in by_peer.items())


def _decode_phase(target: dict) -> str:
    ratio = target.get("decode_phase_ratio")
    return "" if ratio is None else f"; decode phase {ratio:.2f}x"


def _verdict(met: bool | None) -> str:
    return "not judged: too noisy, see below; rerun on a quiet machine" if met is None else \
        "met" if met else "NOT met"


def _print_verify_width(engine: dict, console: Any) -> None:
    """The drafts a DLite step verified, and the calibration curve that k came from."""
    choice, k, most = engine.get("verify_width"), engine["verify_drafts"], engine["block_size"] - 1
    if choice is None:
        how = " (the engine is not calibrated)"
    elif choice["drafts"] == k:
        how = f" (the calibrated choice; {choice['source']})"
    else:
        how = f" (set by --verify-drafts; the calibrated choice is {choice['drafts']})"
    console.print(f"DLite steps verify {k} of the draft's {most} drafts{how}")
    if choice is not None:
        console.print("  k: predicted tokens/step, step ms, speedup over a decode call: " + ", ".join(
            f"{k}: {r['tokens_per_step']:.2f}, {r['step_ms']:.1f}, {r.get('speedup_over_decode', 0):.2f}x"
            for k, r in choice["rows"].items()))
        for problem in choice.get("noise", ()):
            console.print(f"  WARNING, calibration timings not clean: {problem}")
        if choice.get("measured_elsewhere"):
            console.print(f"  WARNING: {choice['measured_elsewhere']}; rerun `dlite-trt calibrate` here")
        if choice.get("by_batch"):
            console.print("  calibrated width per batch size (the batch sweep takes k >= 1; the server's 0 is plain "
                          "decoding): " + ", ".join(f"{b}: {w['drafts']}" for b, w in choice["by_batch"].items()))


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
