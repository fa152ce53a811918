"""Run the workloads, the batch sweep and the context-cost measurement; return every figure.

Methods run in the same process on the same engine (target-only decoding and n-gram lookup
use the engine's ``decode`` graph, DLite its ``step`` graph), request by request, in an order
that rotates with each task and reverses on every other (``round_order``), so a burst of load on a
shared machine does not land on one method, nor what one method leaves behind on another.
Generations ignore end-of-sequence tokens (as trtllm-bench does), so every method produces the
same number of tokens, and each method's tokens are compared with target-only greedy decoding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dlite_trt.bench.methods import Method
from dlite_trt.bench.metrics import (
    RequestRecord,
    add_speedups,
    first_difference,
    measure,
    paired_rounds,
    summarize,
)
from dlite_trt.bench.workloads import Task
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.runtime.stats import StageTimer

Advance = Callable[[], None]


@dataclass(frozen=True)
class PreparedTask:
    task: Task
    turns: tuple[tuple[int, ...], ...]  # token ids per turn

    @property
    def longest(self) -> int:
        """Tokens the session reaches: every turn and every answer."""
        return sum(len(ids) + turn.output_tokens for ids, turn in zip(self.turns, self.task.turns, strict=True))


def prepare(workloads: dict[str, Sequence[Task]], tokenizer: Any, max_seq_len: int) -> dict[str, list[PreparedTask]]:
    """Tokenize every turn and check every session fits the engine, before anything runs."""
    prepared = {}
    for name, tasks in workloads.items():
        prepared[name] = [PreparedTask(t, tuple(tuple(turn.ids(tokenizer)) for turn in t.turns)) for t in tasks]
        for p in prepared[name]:
            if p.longest > max_seq_len:
                raise DLiteError(f"task {p.task.task_id} ({name}) reaches {p.longest} tokens with its answers, past "
                                 f"the engine's --max-seq-len {max_seq_len}; rebuild the engine with --max-seq-len "
                                 f"{p.longest} or more, or drop the task.")
    return prepared


def run_task(method: Method, workload: str, p: PreparedTask) -> list[RequestRecord]:
    """All turns of one task (a session) with one method; one record per turn."""
    run = method.start([list(p.turns[0])], workload)
    records = []
    for i, (ids, turn) in enumerate(zip(p.turns, p.task.turns, strict=True)):
        if i:
            run.extend([list(ids)])
        record = RequestRecord(workload, method.name, p.task.task_id, i, 1, len(run.session.tokens[0]))
        timer = StageTimer()
        context_before = run.draft_context_tokens
        measure(run.stream(SamplingParams(max_new_tokens=turn.output_tokens), timer), record)
        record.stage_s = timer.as_dict()
        record.draft_context_tokens = run.draft_context_tokens - context_before
        record.draft_state_bytes = run.draft_state_bytes()
        records.append(record)
    return records


def run_workload(name: str, tasks: Sequence[PreparedTask], methods: Sequence[Method], *, block_size: int,
                 kv_bytes_per_token: int, advance: Advance) -> tuple[dict, list[RequestRecord]]:
    """Every method on every task of a workload: summaries, losslessness and memory per method,
    and the raw request records."""
    records: dict[str, list[RequestRecord]] = {m.name: [] for m in methods}
    for i, p in enumerate(tasks):
        for method in round_order(methods, i):
            records[method.name] += run_task(method, name, p)
            advance()
    # a peer whose worker died is left out of the summaries (its raw records stay, as far as it got)
    failed = {m.name for m in methods if getattr(m, "failure", None)}
    out = {}
    baseline = records.get("ar")
    for method in (m for m in methods if m.name not in failed):
        summary = summarize(records[method.name], max_step_tokens=block_size)
        summary["lossless"] = _mismatches(records[method.name], baseline, exact=method.exact)
        summary["target_kv_bytes_max"] = kv_bytes_per_token * max(p.longest for p in tasks)
        out[method.name] = summary
    add_speedups(out)
    for method, rounds in paired_rounds({n: rs for n, rs in records.items() if n not in failed}).items():
        out[method]["paired"] = rounds
    return out, [r for rs in records.values() for r in rs]


def round_order(methods: Sequence[Method], i: int) -> list[Method]:
    """The order methods run task ``i`` in: from method i (each starts a round in turn), forward on
    even tasks and backward on odd ones, so no method always runs right after the same other one. A
    fixed cycle lets what a method leaves behind (the machine's state after it: caches, another
    process's threads winding down) land on the same successor every round: in three fp32 benches
    n-gram lookup, always run right after DLite then, prefilled the long-context prompts 0.4-10%
    faster than target-only, which prefills them on the same graph, on each of the 9 tasks."""
    step = -1 if i % 2 else 1
    return [methods[(i + step * j) % len(methods)] for j in range(len(methods))]


def _mismatches(records: Sequence[RequestRecord], baseline: Sequence[RequestRecord] | None,
                exact: bool = True) -> dict:
    """Requests whose tokens differ from target-only greedy decoding's (None without the baseline),
    and where each first differs. ``exact``: the method runs the same numerics (so any difference
    is a bug); a peer with other numerics (int4, llama.cpp's Q4) reports where it diverges."""
    if baseline is None:
        return {"checked": 0, "mismatches": None}
    want = {(r.task_id, r.turn): r.output_ids for r in baseline}
    diverged = {f"{r.task_id}/turn {r.turn}": i for r in records
                if (i := first_difference(r.output_ids, want[(r.task_id, r.turn)])) is not None}
    return {"checked": len(records), "mismatches": len(diverged), "first": list(diverged)[:5],
            "expected_identical": exact, "divergence_index": dict(list(diverged.items())[:20])}


def batch_sweep(prompts: Sequence[Sequence[int]], methods: Sequence[Method], batch_sizes: Sequence[int],
                new_tokens: int, rounds: int, advance: Advance) -> dict:
    """Output tokens/s of each method with B sequences decoded together (one static batch)."""
    out: dict[str, dict] = {}
    for b in batch_sizes:
        batch = [list(prompts[i % len(prompts)]) for i in range(b)]
        warm_up(methods, batch[0], batch=b)  # this batch size's shapes, untimed
        totals = {m.name: [0, 0.0] for m in methods}
        for r in range(rounds):
            for method in methods[r % len(methods):] + methods[: r % len(methods)]:
                record = RequestRecord("sweep", method.name, f"batch-{b}", 0, b, max(map(len, batch)))
                measure(method.start(batch).stream(SamplingParams(max_new_tokens=new_tokens), StageTimer()), record)
                totals[method.name][0] += record.output_tokens
                totals[method.name][1] += record.total_s
                advance()
        out[str(b)] = {name: {"tokens_per_second": n / s} for name, (n, s) in totals.items()}
        add_speedups(out[str(b)])
    return out


def warm_up(methods: Sequence[Method], prompt: Sequence[int], new_tokens: int = 16, batch: int = 1) -> None:
    """One short generation per method: graphs load, and first runs at these shapes allocate, untimed."""
    for method in methods:
        run = method.start([list(prompt)] * batch)
        for _ in run.stream(SamplingParams(max_new_tokens=new_tokens), StageTimer()):
            pass


def nearest_context(contexts: Sequence[int], tokens: float) -> int:
    """The measured context closest to ``tokens`` on a log scale."""
    return min(contexts, key=lambda c: abs(math.log(c) - math.log(max(tokens, 1.0))))
