"""What one timed request yields, and the per-workload, per-method summary of many.

A request is one call that generates (one turn of a session, for a batch of one or more
sequences). ``measure`` times a stream of ``StepEvent``s: the first event is the prefill
(time to first token), each later one a step whose tokens per sequence make the acceptance
lengths (n + 1 per speculative step, 1 per target-only decode step).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dlite_trt.runtime.session import StepEvent

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    workload: str
    method: str
    task_id: str
    turn: int
    batch: int
    context_tokens: int  # longest sequence's context when the call started (prompt + earlier turns)
    output_tokens: int = 0  # generated, all sequences
    ttft_s: float = 0.0  # until the prefill's token
    total_s: float = 0.0
    step_tokens: list[int] = field(default_factory=list)  # tokens per step per sequence (n + 1, or 1 for a decode)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    stage_s: dict[str, float] = field(default_factory=dict)  # the generator's own stage timers
    draft_context_tokens: int = 0  # context tokens the drafter processed outside decoding (a new turn)
    draft_state_bytes: int = 0  # what the drafter keeps between steps, at the end of the request
    output_ids: list[list[int]] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, per sequence (None with a single token)."""
        per_row = self.output_tokens / max(self.batch, 1)
        return (self.total_s - self.ttft_s) / (per_row - 1) if per_row > 1 else None


def measure(events: Iterable[StepEvent], record: RequestRecord,
            clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """Consume a generator's stream, filling the record's timings, tokens and acceptance counts."""
    start = clock()
    outputs: list[list[int]] = []
    first = True
    for event in events:
        now = clock()
        if not outputs:
            outputs = [[] for _ in event.new_tokens]
        for row, toks in enumerate(event.new_tokens):
            outputs[row].extend(toks)
        if first:
            record.ttft_s = now - start
            first = False
        elif event.record is None:  # a target-only decode step: one token per active sequence
            record.step_tokens += [len(toks) for toks in event.new_tokens if toks]
        else:
            step = event.record
            for row, drafts in enumerate(step.draft_tokens):
                if drafts is not None:
                    record.step_tokens.append(step.kept[row])
                    record.proposed += len(drafts)
                    record.accepted += step.kept_drafts(row)
    record.total_s = clock() - start
    record.output_ids = outputs
    record.output_tokens = sum(map(len, outputs))
    return record


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> int | None:
    """The first output index where two requests' tokens differ (over the batch's rows; a shorter
    output differs where it ends), or None when they are equal."""
    indexes = []
    for a, b in zip(got, want, strict=True):
        common = min(len(a), len(b))
        n = next((i for i in range(common) if a[i] != b[i]), common)
        if n < max(len(a), len(b)):
            indexes.append(n)
    return min(indexes, default=None)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def add_speedups(rows: dict[str, dict], baseline: str = "ar") -> None:
    """Each row's tokens/s (and decode-phase tokens/s, where present) over the baseline row's."""
    if baseline not in rows:
        return
    base = rows[baseline]
    for row in rows.values():
        row["speedup_over_ar"] = row["tokens_per_second"] / base["tokens_per_second"]
        if row.get("decode_tokens_per_second") and base.get("decode_tokens_per_second"):
            row["decode_speedup_over_ar"] = row["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        if row.get("mean_step_s") and base.get("mean_step_s"):  # decode speedup ~ AL / this
            row["step_time_over_ar"] = row["mean_step_s"] / base["mean_step_s"]


def paired_rounds(records: dict[str, Sequence[RequestRecord]], baseline: str = "ar") -> dict[str, dict]:
    """Each method against the baseline round by round (a round: one task, which every method ran
    back to back): its tokens/s and its decode-phase step time over the baseline's in that round,
    as median, p10 and p90 over the rounds. A busy machine moves one method's round and not the
    other's, so their spread is the noise a pooled ratio hides; and since both ran the same
    contexts, the step ratio's spread is (nearly) noise alone."""
    def per_task(rs: Sequence[RequestRecord]) -> dict[str, tuple[float, float]]:
        totals: dict[str, list[float]] = {}
        for r in rs:
            t = totals.setdefault(r.task_id, [0.0, 0.0, 0.0, 0.0])
            t[0] += r.output_tokens
            t[1] += r.total_s
            t[2] += r.total_s - r.ttft_s
            t[3] += len(r.step_tokens)
        return {task: (tok / sec if sec else 0.0, dec / n if n else 0.0) for task, (tok, sec, dec, n) in totals.items()}

    if baseline not in records:
        return {}
    base = per_task(records[baseline])
    out = {}
    for name, rs in records.items():
        if name == baseline:
            continue
        speed, step = [], []
        for task, (rate, step_s) in per_task(rs).items():
            b_rate, b_step = base.get(task, (0.0, 0.0))
            if rate and b_rate:
                speed.append(rate / b_rate)
            if step_s and b_step:
                step.append(step_s / b_step)
        out[name] = {"rounds": len(speed), "speedup_over_ar": spread(speed), "step_time_over_ar": spread(step)}
    return out


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, p10 and p90 (None without values)."""
    if not values:
        return None
    p10, median, p90 = (float(v) for v in np.percentile(values, (10, 50, 90)))
    return {"median": median, "p10": p10, "p90": p90}


def summarize(records: Sequence[RequestRecord], max_step_tokens: int) -> dict:
    """Every figure of one method on one workload, from its requests."""
    tokens = sum(r.output_tokens for r in records)
    seconds = sum(r.total_s for r in records)
    steps = [n for r in records for n in r.step_tokens]
    proposed = sum(r.proposed for r in records)
    histogram = Counter(steps)
    draft_s = sum(r.stage_s.get("draft", 0.0) for r in records)  # drafting during decoding steps
    decode_s = sum(r.total_s - r.ttft_s for r in records)
    decode_tokens = sum(r.output_tokens - r.batch for r in records)  # all but each sequence's first
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "decode_tokens_per_second": decode_tokens / decode_s if decode_s else None,
        "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
        "mean_step_s": decode_s / len(steps) if steps else None,  # wall time of a decode-phase step (host work in)
        "acceptance_histogram": {str(n): histogram.get(n, 0) for n in range(1, max_step_tokens + 1)},
        "steps": len(steps),
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": sum(r.accepted for r in records),
        "acceptance_rate": sum(r.accepted for r in records) / proposed if proposed else None,
        "ttft_s": percentiles([r.ttft_s for r in records]),
        "tpot_s": percentiles([t for r in records if (t := r.tpot_s) is not None]),
        "host_draft_share": draft_s / decode_s if decode_s and draft_s else None,
        "draft_context_tokens": sum(r.draft_context_tokens for r in records),
        "draft_context_s": sum(r.stage_s.get("draft_context", 0.0) for r in records),
        "draft_state_bytes_max": max((r.draft_state_bytes for r in records), default=0),
        "context_tokens": {"mean": sum(r.context_tokens for r in records) / len(records) if records else None,
                           "max": max((r.context_tokens for r in records), default=0)},
    }
