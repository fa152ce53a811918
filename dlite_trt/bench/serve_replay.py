"""The agentic replay benchmark: multi-turn sessions through the OpenAI API, as agents send them.

Each client replays its sessions one turn after another; every turn sends the whole context so
far (the previous turns' prompts and answers, then the new tool result and instruction) to
``/v1/completions`` as token ids, streamed, greedy, each answer its turn's ``output_tokens``
long (``ignore_eos``). Clients run concurrently (1, 4, 16 ...). One real server per
(``--speculative`` method, prefix reuse on/off), started and stopped here. Measured per turn:
TTFT (to the first streamed token), TPOT, cached prompt tokens, acceptance; per configuration:
TTFT p50/p99 and by turn index, output tokens/s, the prefix-cache hit rate, mean acceptance
length; and at concurrency 1, the server against the runtime called directly (the same
sessions on an ``EngineSession``, extended turn by turn). Every configuration's tokens are
checked against the first's (greedy: they must be equal).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlite_trt.bench.workloads import Task
from dlite_trt.errors import DLiteError

SCHEMA = "dlite-trt-bench-serve/1"


@dataclass
class TurnRecord:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    seconds: float
    steps: int
    accepted: int
    proposed: int
    output_ids: list[int] = field(repr=False, default_factory=list)
    tool_calls: int = 0  # the tool-using replay: calls the response made (parsed by the server)

    @property
    def tpot_s(self) -> float | None:
        return (self.seconds - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _turn(client: Any, model: str, context: list[int], max_tokens: int) -> tuple[list[int], dict, float, float]:
    """One streamed turn: (output ids, final speculative figures + usage, ttft, seconds)."""
    started = time.perf_counter()
    ttft, ids, final = None, [], {}
    stream = client.completions.create(model=model, prompt=context, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    for chunk in stream:
        data = chunk.model_dump()
        if data["choices"]:
            new = data["choices"][0].get("token_ids") or []
            if new and ttft is None:
                ttft = time.perf_counter() - started
            ids += new
            if data.get("speculative"):
                final["speculative"] = data["speculative"]
        if data.get("usage"):
            final["usage"] = data["usage"]
    return ids, final, ttft or 0.0, time.perf_counter() - started


def _chat_turn(client: Any, model: str, messages: list[dict], max_tokens: int, tool_choice: str) -> tuple[
        list[int], str, list[dict], dict, float, float]:
    """One streamed chat turn with the agent's tools: (output ids, content, tool calls as the
    assistant message holds them, final speculative figures + usage, ttft, seconds)."""
    from dlite_trt.bench.workloads import AGENT_TOOLS

    started = time.perf_counter()
    ttft, ids, content, calls, final = None, [], "", {}, {}
    stream = client.chat.completions.create(model=model, messages=messages, tools=list(AGENT_TOOLS),
                                            tool_choice=tool_choice, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    for chunk in stream:
        data = chunk.model_dump()
        for choice in data["choices"]:
            new = choice.get("token_ids") or []
            if new and ttft is None:
                ttft = time.perf_counter() - started
            ids += new
            delta = choice["delta"] or {}
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                fn = part.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
        if data.get("speculative"):
            final["speculative"] = data["speculative"]
        if data.get("usage"):
            final["usage"] = data["usage"]
    return ids, content, [calls[i] for i in sorted(calls)], final, ttft or 0.0, time.perf_counter() - started


CALLS_PER_ASK = 3  # then the agent asks for an answer (tool_choice none)


def replay_tools(client: Any, model: str, sessions: Sequence[Any], concurrency: int,
                 max_tokens: int = 48) -> tuple[list[TurnRecord], float, int]:
    """Tool-using agent sessions (``workloads.ToolSession``), ``concurrency`` clients at once: each
    request sends the whole conversation so far with the tools; the model's calls are run
    (``run_tool``) and their results sent back, up to CALLS_PER_ASK calls per user instruction,
    then its answer is asked for and the next instruction follows. One record per request; a
    session ends early where its conversation outgrows the engine (a real agent would compact
    it there): the records, the wall time and how many sessions ended so."""
    import openai

    records: list[TurnRecord] = []
    lock = threading.Lock()
    outgrown = [0]

    def client_run(c: int) -> None:
        for session in sessions[c::concurrency]:
            try:
                run_session(session)
            except openai.BadRequestError as exc:
                if "--max-seq-len" not in str(exc):
                    raise
                with lock:
                    outgrown[0] += 1

    def run_session(session: Any) -> None:
        messages: list[dict] = []
        request = 0
        for ask in session.instructions:
            messages.append({"role": "user", "content": ask})
            for n in range(CALLS_PER_ASK + 1):
                ids, content, calls, final, ttft, seconds = _chat_turn(
                    client, model, messages, max_tokens, "auto" if n < CALLS_PER_ASK else "none")
                spec, usage = final["speculative"], final["usage"]
                with lock:
                    records.append(TurnRecord(session.task_id, request, usage["prompt_tokens"],
                                              usage["prompt_tokens_details"]["cached_tokens"], len(ids), ttft,
                                              seconds, spec["steps"], spec["accepted_draft_tokens"],
                                              spec["proposed_draft_tokens"], ids, len(calls)))
                request += 1
                messages.append({"role": "assistant", "content": content or None,
                                 **({"tool_calls": calls} if calls else {})})
                if not calls:
                    break
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": session.run_tool(
                        call["function"]["name"], call["function"]["arguments"], request)})

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client_run, range(concurrency)))
    return records, time.perf_counter() - started, outgrown[0]


def fitted(sessions: Sequence[Task], tokenizer: Any, max_seq_len: int) -> tuple[list[Task], int]:
    """The sessions cut before the first turn whose context and answer would pass the engine's
    --max-seq-len (a real agent would compact its context there); and how many turns were cut."""
    out, cut = [], 0
    for task in sessions:
        length, keep = 0, 0
        for turn in task.turns:
            length += len(turn.ids(tokenizer))
            if length + turn.output_tokens > max_seq_len:
                break
            length += turn.output_tokens
            keep += 1
        cut += len(task.turns) - keep
        if keep:
            out.append(Task(task.task_id, task.turns[:keep]))
    return out, cut


def replay(client: Any, model: str, sessions: Sequence[Task], tokenizer: Any, concurrency: int) -> tuple[
        list[TurnRecord], float]:
    """Every session, ``concurrency`` clients at once (client c takes sessions c, c + concurrency, ...);
    the records and the wall time."""
    records: list[TurnRecord] = []
    lock = threading.Lock()

    def client_run(c: int) -> None:
        for task in sessions[c::concurrency]:
            context: list[int] = []
            for t, turn in enumerate(task.turns):
                context += turn.ids(tokenizer)
                ids, final, ttft, seconds = _turn(client, model, context, turn.output_tokens)
                spec, usage = final["speculative"], final["usage"]
                with lock:
                    records.append(TurnRecord(task.task_id, t, len(context),
                                              usage["prompt_tokens_details"]["cached_tokens"], len(ids), ttft,
                                              seconds, spec["steps"], spec["accepted_draft_tokens"],
                                              spec["proposed_draft_tokens"], ids, 0))  # no tools: no calls
                context += ids

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client_run, range(concurrency)))
    return records, time.perf_counter() - started


def direct(generator: Any, sessions: Sequence[Task], tokenizer: Any) -> tuple[dict[tuple[str, int], list[int]], float]:
    """The same sessions on the runtime itself, one after another (a session per agent, extended
    turn by turn, its KV kept): the outputs and the wall time."""
    from dlite_trt.runtime.session import SamplingParams

    outputs = {}
    started = time.perf_counter()
    for task in sessions:
        session = None
        for t, turn in enumerate(task.turns):
            ids = turn.ids(tokenizer)
            if session is None:
                session = generator.session([ids])
            else:
                session.extend([ids])
            result = session.generate(SamplingParams(max_new_tokens=turn.output_tokens))
            outputs[(task.task_id, t)] = list(result.output_ids[0])
    return outputs, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(records: list[TurnRecord], wall: float) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records]
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]
    turns = sorted({r.turn for r in records})
    steps = sum(r.steps for r in records)
    return {
        "requests": len(records), "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in records) / wall, 3),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5),
        "prefix_cache_hit_rate": round(sum(r.cached_tokens for r in records)
                                       / max(1, sum(r.prompt_tokens for r in records)), 4),
        "reused_tokens": sum(r.cached_tokens for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "tool_calls": sum(r.tool_calls for r in records),
        "mean_acceptance_length": round(sum(r.output_tokens - 1 for r in records) / steps, 4) if steps else None,
        "ttft_by_turn_s": {str(t): statistics.median(r.ttft_s for r in records if r.turn == t) for t in turns},
        "prompt_tokens_by_turn": {str(t): statistics.median(r.prompt_tokens for r in records if r.turn == t)
                                  for t in turns},
    }


def run(engine: Path, sessions: Sequence[Any], *, methods: Sequence[str], reuse: Sequence[bool],
        concurrency: Sequence[int], threads: int | None, kv_cache_gb: float, log: Any = print) -> dict[str, Any]:
    """The whole matrix; the report (JSON-able). ``sessions``: ``Task``s (completions of token
    ids), or ``workloads.ToolSession``s (a tool-using agent through chat with tools: the server
    runs with --tool-call-parser hermes --enable-auto-tool-choice, and the bundled tools
    template where the engine's own template takes no tools)."""
    import openai

    from dlite_trt.bundled import tools_template
    from dlite_trt.engine.load import load_engine
    from dlite_trt.serve.openai_process import OpenAIServerProcess
    from dlite_trt.bench.workloads import ToolSession

    loaded = load_engine(engine, threads=threads, preload=("prefill", "step"))
    tokenizer = loaded.tokenizer
    tools = bool(sessions) and isinstance(sessions[0], ToolSession)
    tool_args = []
    if tools:
        tool_args = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
        if "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
            tool_args += ["--chat-template", str(tools_template())]
        cut = 0
    else:
        sessions, cut = fitted(sessions, tokenizer, loaded.generator.manifest.limits.max_seq_len)
    if not sessions:
        raise DLiteError(f"no session's first turn fits the engine's --max-seq-len "
                         f"{loaded.generator.manifest.limits.max_seq_len}; rebuild it with a larger one.")
    configs: dict[str, Any] = {}
    reference: dict[tuple[str, int], list[int]] | None = None
    mismatches = 0
    for method in methods:
        for on in reuse:
            name = f"{method}/{'reuse' if on else 'no-reuse'}"
            args = ["--speculative", method, "--kv-cache-gb", str(kv_cache_gb),
                    *([] if on else ["--no-prefix-cache"]), *tool_args]
            configs[name] = {"speculative": method, "prefix_reuse": on, "by_concurrency": {}}
            for c in concurrency:  # a fresh server each time: nothing kept from the previous replay
                with OpenAIServerProcess(engine, *args, model="bench", threads=threads) as server:
                    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                           timeout=3600)
                    if tools:
                        records, wall, outgrown = replay_tools(client, "bench", sessions, c)
                        cut = max(cut, outgrown)
                    else:
                        records, wall = replay(client, "bench", sessions, tokenizer, c)
                    got = {(r.session, r.turn): r.output_ids for r in records}
                    if reference is None:
                        reference = got
                    mismatches += sum(got.get(key) != reference[key] for key in reference)
                    summary = summarize(records, wall)
                    configs[name]["by_concurrency"][str(c)] = summary | {
                        "turns": [{k: v for k, v in asdict(r).items() if k != "output_ids"} for r in records]}
                    log(f"{name:18s} c={c:<3d} {summary['output_tokens_per_s']:8.2f} tok/s  TTFT p50 "
                        f"{summary['ttft_p50_s']:.3f}s  hit {summary['prefix_cache_hit_rate']:.2f}  "
                        f"AL {summary['mean_acceptance_length']}")
    report: dict[str, Any] = {"schema": SCHEMA, "engine": str(engine), "sessions": len(sessions),
                              "workload": "tool-using agent" if tools else "agentic",
                              "turns": len(reference or {}), "turns_cut_to_fit_the_engine": cut,
                              "concurrency": list(concurrency), "configs": configs,
                              "greedy_mismatches": mismatches}
    if "dlite" in methods and True in reuse and 1 in concurrency and not tools:
        outputs, wall = direct(loaded.generator, sessions, tokenizer)
        served = configs["dlite/reuse"]["by_concurrency"]["1"]
        direct_tps = sum(len(o) for o in outputs.values()) / wall
        report["direct_runtime"] = {"output_tokens_per_s": round(direct_tps, 3), "wall_s": round(wall, 3),
                                    "server_overhead": round(direct_tps / served["output_tokens_per_s"] - 1, 4),
                                    "outputs_equal_server": outputs == reference}
        log(f"direct runtime     c=1   {direct_tps:8.2f} tok/s  (server overhead "
            f"{report['direct_runtime']['server_overhead']:+.1%})")
    return report


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """TTFT against turn index at the lowest concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, config in report["configs"].items():
        lowest = min(config["by_concurrency"], key=int)
        by_turn = config["by_concurrency"][lowest]["ttft_by_turn_s"]
        ax.plot([int(t) for t in by_turn], list(by_turn.values()), marker="o", label=f"{name} (c={lowest})",
                linestyle="-" if config["prefix_reuse"] else "--")
    ax.set_xlabel("turn index (the context grows every turn)")
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title("Time to first token by turn: prefix reuse on (solid) and off (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"{report.get('workload', 'agentic')} replay: {report['sessions']} sessions, "
                        f"{report['turns']} requests")
    for col in ("config", "clients", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "hit rate", "reused", "AL"):
        table.add_column(col, justify="right")
    for name, config in report["configs"].items():
        for c, s in config["by_concurrency"].items():
            table.add_row(name, c, f"{s['output_tokens_per_s']:.2f}", f"{s['ttft_p50_s']:.3f}",
                          f"{s['ttft_p99_s']:.3f}", "-" if s["tpot_p50_s"] is None else f"{s['tpot_p50_s']:.3f}",
                          f"{s['prefix_cache_hit_rate']:.2f}", str(s["reused_tokens"]),
                          "-" if s["mean_acceptance_length"] is None else f"{s['mean_acceptance_length']:.2f}")
    console.print(table)
    if "direct_runtime" in report:
        d = report["direct_runtime"]
        console.print(f"runtime called directly (c=1): {d['output_tokens_per_s']:.2f} tok/s; the server's overhead "
                      f"{d['server_overhead']:+.1%}; outputs equal: {d['outputs_equal_server']}")
    console.print(f"greedy mismatches across configurations: {report['greedy_mismatches']}")
