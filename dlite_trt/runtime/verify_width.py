"""How many of its K drafts a greedy step verifies: the width that gives the most tokens per second.

A step that verifies the first k drafts emits 1 + min(n, k) tokens, n being the drafts the
target would accept out of all K (greedy acceptance of d_i depends on d_1..d_i only), so

    E[tokens per step | k] = 1 + sum_{i <= k} P(n >= i),

and it costs c(k), the wall time of the step call at width k + 1 (the target's verify grows
with k; the draft's part is the same at every k). The engine verifies the k that maximises
E[tokens | k] / c(k). On a GPU at batch 1 verifying K costs about what verifying 1 does and
k = K; on a CPU (or a busy GPU) verification is compute-bound and a smaller k can pay more.

``dlite_trt.bench.calibrate`` measures both on the engine at hand (the acceptance curve from
greedy generations at full width, the costs from step calls at every width, and a decode call
for the predicted speedup over target-only decoding); ``dlite-trt build`` and ``dlite-trt
calibrate`` write the choice to ``verify_width.json`` in the engine directory, and
``open_engine`` verifies that many drafts.

A batch of B sequences costs more per call than a batch of one while each row still gains its
own acceptance, so the width that pays changes with B, and on a compute-bound machine no width
may pay at all. Calibration therefore also measures the step at every width and a plain decode
call at each batch size the engine serves (``by_batch``), and picks k in 0..K there, 0 meaning
plain decoding (the target's decode graph, no draft). The OpenAI server's scheduler runs the k
of the batch it is running (greedy batches only: a sampled row's draws must not depend on what
it is batched with); the batch-1 ``drafts`` (>= 1) is what a DLite session verifies.

The draft's cost is about the same at every context while a decode call grows with it, so a width
that pays after 1,024 cached tokens may not after 256 (SmolLM2 int4 on 2 cores: calibrated at
1,024 to verify 2 drafts, a chat step then cost 1.50x a decode step for 1.50 tokens). Calibration
also measures the batch-1 costs after a short and a long context (``by_context``), and a DLite
session verifies, each step, the width of the calibrated context nearest its own (log scale).

A step verifying more drafts does more work, so its true cost never falls with k; a measured table
that falls (load on a shared machine hit one width's bursts) is fitted nondecreasing before the
choice (``nondecreasing``: adjacent violators pooled to their mean), so a width that merely timed
lucky cannot win.

Timings on a shared machine can be wrong in ways no fit repairs (a step measured cheaper than a
decode call, a call after 1,024 cached tokens dearer than after 2,048), and a width is only right
for the machine it was measured on. Calibration therefore checks its costs against what physics
allows (``implausible``), measures again where they fail, and records what it could not clear
(``noise``) and the machine it ran on (``machine``); opening the engine on another machine says so.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlite_trt.errors import DLiteError, EngineError

WIDTH_FILE = "verify_width.json"
MAX_MISS_RATE = 0.95  # caps p in drafting_pays (p / (1 - p) grows without bound)
IMPOSSIBLE_STEP = 0.9  # a step this much cheaper than a decode call (it verifies at least its tokens) is noise
TOLERANCE = 0.15  # a call this much dearer than one that does more work (longer context, more rows) is noise
MAX_ROUND_SPREAD = 0.15  # half the p10-p90 width of a call's round medians over their median, at most


def this_machine() -> dict[str, Any]:
    """What a calibration is valid for: the CPU's model and how many logical CPUs this process sees."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:  # not Linux
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpus": os.cpu_count()}


Key = tuple[int, int]  # (batch size, cached tokens) of one set of calls


def implausible(costs: Mapping[Key, tuple[Mapping[int, float], float]],
                spreads: Mapping[Key, Mapping[str, float]] | None = None) -> list[str]:
    """What in measured call costs physics rules out, one line each (empty: nothing). ``costs``:
    (batch, context) -> (k -> step ms, decode ms); ``spreads``: the same keys -> call name
    ("decode", "step k=1", ...) -> half the p10-p90 width of its round medians over their median.
    Ruled out: a step call cheaper than ``IMPOSSIBLE_STEP`` x a decode call; a call dearer by more
    than ``TOLERANCE`` than the same call after more cached tokens or with more rows; rounds
    spread past ``MAX_ROUND_SPREAD``. Meant for calls timed in the same interleaved rounds."""
    problems = []
    for (batch, context), (step_ms, decode_ms) in sorted(costs.items()):
        cheapest = min(step_ms, key=step_ms.__getitem__)
        if step_ms[cheapest] < IMPOSSIBLE_STEP * decode_ms:
            problems.append(f"batch {batch} after {context} tokens: a step call at k = {cheapest} took "
                            f"{step_ms[cheapest]:.1f} ms, {step_ms[cheapest] / decode_ms:.2f}x a decode call "
                            f"({decode_ms:.1f} ms), though it verifies at least as many tokens and drafts too")
    for less, more, what in _ordered_pairs(costs):
        calls = {"decode": (costs[less][1], costs[more][1])} | {
            f"step k={k}": (ms, costs[more][0][k]) for k, ms in costs[less][0].items() if k in costs[more][0]}
        name, (a, b) = max(calls.items(), key=lambda item: item[1][0] / item[1][1])
        if a > (1.0 + TOLERANCE) * b:
            problems.append(f"the {name} call at batch {less[0]} after {less[1]} tokens took {a:.1f} ms, "
                            f"{a / b:.2f}x the same call with {what} (batch {more[0]} after {more[1]} tokens)")
    for (batch, context), calls in sorted((spreads or {}).items()):
        name, worst = max(calls.items(), key=lambda item: item[1])
        if worst > MAX_ROUND_SPREAD:
            problems.append(f"batch {batch} after {context} tokens: the {name} call's rounds spread +-{worst:.0%}")
    return problems


def _ordered_pairs(keys: Iterable[Key]) -> list[tuple[Key, Key, str]]:
    """Pairs (less work, more work, how) of keys that differ in context alone or in batch size alone."""
    ordered = sorted(keys)
    return [(a, b, "more cached tokens" if a[0] == b[0] else "more rows")
            for i, a in enumerate(ordered) for b in ordered[i + 1:]
            if (a[0] == b[0] and a[1] < b[1]) or (a[1] == b[1] and a[0] < b[0])]


def acceptance_curve(accepted: Sequence[int], max_drafts: int) -> list[float]:
    """P(n >= i) for i = 1..K from the drafts accepted per step at full width (each n in 0..K)."""
    if not accepted:
        raise DLiteError("no steps to estimate the acceptance curve from; generate some tokens first.")
    bad = [n for n in accepted if not 0 <= n <= max_drafts]
    if bad:
        raise DLiteError(f"accepted counts {bad[:5]} are outside 0..{max_drafts}.")
    return [sum(n >= i for n in accepted) / len(accepted) for i in range(1, max_drafts + 1)]


def expected_tokens(curve: Sequence[float], drafts: int) -> float:
    """Tokens a step emits on average when it verifies ``drafts`` drafts: 1 + sum_{i <= k} P(n >= i)."""
    return 1.0 + sum(curve[:drafts])


def nondecreasing(step_ms: Mapping[int, float]) -> dict[int, float]:
    """The least-squares nondecreasing fit of step costs over k (pool adjacent violators): where a
    wider step timed cheaper than a narrower one, both take their pooled mean."""
    pools: list[tuple[float, list[int]]] = []  # (mean ms, the widths pooled)
    for k in sorted(step_ms):
        mean, ks = step_ms[k], [k]
        while pools and pools[-1][0] > mean:
            before, joined = pools.pop()
            mean, ks = (before * len(joined) + mean * len(ks)) / (len(joined) + len(ks)), joined + ks
        pools.append((mean, ks))
    return {k: mean for mean, ks in pools for k in ks}


def best_drafting_width(curve: Sequence[float], step_ms: Mapping[int, float]) -> int:
    """The k >= 1 of ``step_ms`` (k -> cost) with the most expected tokens per ms; ties go to the larger k."""
    return max(step_ms, key=lambda k: (expected_tokens(curve, k) / step_ms[k], k))


def speculation_pays(curve: Sequence[float], step_ms: Mapping[int, float], decode_ms: float) -> int:
    """The k in 0..K that gives the most tokens per ms, 0 (plain decoding: one token per decode call)
    included; a tie with plain decoding goes to it (it risks nothing), one between widths to the larger."""
    rate = {0: 1.0 / decode_ms} | {k: expected_tokens(curve, k) / ms for k, ms in step_ms.items()}
    return max(rate, key=lambda k: (rate[k], k == 0, k))


@dataclass(frozen=True)
class BatchWidth:
    """What a greedy step of a batch of this many sequences verifies (0: plain decoding pays more),
    and the per-call costs it was chosen from."""

    drafts: int
    step_ms: Mapping[int, float]  # k -> step call wall ms at this batch
    decode_ms: float  # a target-only decode call at this batch

    def to_dict(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "step_ms": {str(k): v for k, v in sorted(self.step_ms.items())},
                "decode_ms": self.decode_ms}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchWidth:
        return cls(_int(data["drafts"]), {int(k): float(v) for k, v in data["step_ms"].items()},
                   float(data["decode_ms"]))


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class WidthChoice:
    """The chosen number of drafts to verify, with the curve it was chosen from."""

    drafts: int
    curve: Sequence[float]  # P(n >= i), i = 1..K
    step_ms: Mapping[int, float]  # k -> step call wall ms
    decode_ms: float | None = None  # a one-token decode call, for the predicted speedup
    source: str = ""  # what the figures were measured on
    by_batch: Mapping[int, BatchWidth] = field(default_factory=dict)  # batch size -> its width (0..K)
    by_context: Mapping[int, BatchWidth] = field(default_factory=dict)  # cached tokens -> batch 1's width there
    machine: Mapping[str, Any] = field(default_factory=dict)  # this_machine() where it was measured ({}: unknown)
    noise: Sequence[str] = ()  # what ``implausible`` still found in the costs kept (empty: nothing)

    def measured_elsewhere(self) -> str | None:
        """Why this choice may not fit this machine (None when it was measured on one like it, or unknown)."""
        here = this_machine()
        if not self.machine or dict(self.machine) == here:
            return None
        return (f"calibrated on {self.machine.get('cpu')} ({self.machine.get('cpus')} CPUs), running on "
                f"{here['cpu']} ({here['cpus']} CPUs)")

    def drafts_for(self, batch: int, *, drafting: bool = False, context: int | None = None) -> int:
        """Drafts a greedy step of ``batch`` sequences verifies, 0..K: at batch 1 with ``context``
        (the longest sequence's cached tokens) the entry of the calibrated context nearest it (log
        scale); else the entry of the smallest calibrated batch size at least ``batch`` (the largest
        one past them); ``drafts`` without a table (a file from before batch sizes were calibrated).
        ``drafting``: a step that drafts anyway (a DLite session), so the best k >= 1 there."""
        width = self.costs_for(batch, context)
        if width is None:
            return self.drafts
        if width.drafts or not drafting:
            return width.drafts
        return best_drafting_width(self.curve, width.step_ms)

    def costs_for(self, batch: int, context: int | None = None) -> BatchWidth | None:
        """The calibrated entry ``drafts_for`` reads (None in a file from before batch sizes were calibrated)."""
        if batch == 1 and context is not None and self.by_context:
            return self.by_context[min(self.by_context, key=lambda c: abs(math.log(c) - math.log(max(context, 1))))]
        if self.by_batch:
            sizes = sorted(self.by_batch)
            return self.by_batch[next((b for b in sizes if b >= batch), sizes[-1])]
        return None

    def drafting_pays(self, batch: int, context: int, undrafted: int, p_miss: float, *, hit: bool = False,
                      p_guess: float = 0.0) -> bool:
        """Whether a step of DLite + n-gram lookup should run the step graph, and so draft for the next
        step, rather than a decode call without the draft. The drafts pay only at a later lookup miss,
        each such step gaining what a drafted step gains over the decode calls a miss runs without drafts,
        each keeping 1 + ``p_guess`` tokens (its token, and the lookup's 1-gram guess beside it where
        right), gain = E[tokens | k] x decode / (1 + p_guess) - step(k); drafting now costs overhead =
        step(undrafted) - decode
        (the call emits what the decode call would). At a miss with no drafts at hand (``hit`` False;
        ``p_miss`` = P(a miss follows a miss)) the misses expected to follow, p / (1 - p), each gain;
        at a step where every row's lookup proposes (``hit``; ``p_miss`` = P(a miss follows a hit)) the
        next step gains with probability p. It pays where that expected gain is at least the overhead.
        Without a calibrated table: True at a miss (drafting as plain DLite would), False at a hit."""
        width = self.costs_for(batch, context)
        if width is None:
            return not hit
        k = self.drafts_for(batch, drafting=True, context=context)
        gain = expected_tokens(self.curve, k) * width.decode_ms / (1.0 + p_guess) - width.step_ms[k]
        overhead = width.step_ms[undrafted] - width.decode_ms
        p = min(p_miss, MAX_MISS_RATE)
        return gain > 0 and (p if hit else p / (1.0 - p)) * gain >= overhead

    def rows(self) -> dict[int, dict[str, float]]:
        """Per k: tokens per step, step ms, tokens per ms and (with decode_ms) the predicted speedup."""
        out = {}
        for k, ms in sorted(self.step_ms.items()):
            tokens = expected_tokens(self.curve, k)
            row = {"tokens_per_step": tokens, "step_ms": ms, "tokens_per_ms": tokens / ms}
            if self.decode_ms:
                row["speedup_over_decode"] = tokens * self.decode_ms / ms
            out[k] = row
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"drafts": self.drafts, "acceptance_at_least": list(self.curve),
                "step_ms": {str(k): v for k, v in sorted(self.step_ms.items())}, "decode_ms": self.decode_ms,
                "source": self.source, "rows": {str(k): v for k, v in self.rows().items()},
                "by_batch": {str(b): w.to_dict() for b, w in sorted(self.by_batch.items())},
                "by_context": {str(c): w.to_dict() for c, w in sorted(self.by_context.items())},
                "machine": dict(self.machine), "noise": list(self.noise)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WidthChoice:
        if not isinstance(data, Mapping) or not isinstance(data.get("step_ms"), Mapping):
            raise TypeError("expected an object with a step_ms object")
        return cls(_int(data["drafts"]), tuple(float(p) for p in data["acceptance_at_least"]),
                   {int(k): float(v) for k, v in data["step_ms"].items()},
                   None if data.get("decode_ms") is None else float(data["decode_ms"]), str(data.get("source", "")),
                   {int(b): BatchWidth.from_dict(w) for b, w in data.get("by_batch", {}).items()},
                   {int(c): BatchWidth.from_dict(w) for c, w in data.get("by_context", {}).items()},
                   dict(data.get("machine", {})), tuple(str(n) for n in data.get("noise", ())))


Costs = Mapping[int, tuple[Mapping[int, float], float]]  # batch size or context -> (k -> step ms, decode ms)


def choose(step_ms: Mapping[int, float], curve: Sequence[float], *, decode_ms: float | None = None,
           source: str = "", batch_ms: Costs | None = None, context_ms: Costs | None = None,
           machine: Mapping[str, Any] | None = None, noise: Sequence[str] = ()) -> WidthChoice:
    """The k of ``step_ms`` (k -> cost) that maximises expected tokens per step / cost; ties go to the
    larger k. ``batch_ms`` (batch size -> (step_ms, decode_ms) there) adds each batch size's width
    in 0..K (``speculation_pays``), ``context_ms`` (cached tokens -> the same at batch 1) each context's.
    Every table of step costs is fitted ``nondecreasing`` in k first, and kept fitted."""
    tables = {}
    for what, given in (("batch", batch_ms), ("context", context_ms)):
        tables[what] = {}
        for key, (ms, dec) in sorted((given or {}).items()):
            _check_costs(ms, len(curve))
            if not key >= 1 or not dec > 0:
                raise DLiteError(f"{what} {key}: {what}s must be >= 1 and decode costs positive, got {dec}.")
            ms = nondecreasing(ms)
            tables[what][key] = BatchWidth(speculation_pays(curve, ms, dec), ms, dec)
    _check_costs(step_ms, len(curve))
    step_ms = nondecreasing(step_ms)
    return WidthChoice(best_drafting_width(curve, step_ms), tuple(curve), step_ms, decode_ms, source,
                       tables["batch"], tables["context"], dict(machine or {}), tuple(noise))


def _check_costs(step_ms: Mapping[int, float], most: int) -> None:
    if not step_ms:
        raise DLiteError("no step costs to choose a verify width from.")
    bad = [k for k in step_ms if not 1 <= k <= most]
    if bad:
        raise DLiteError(f"verify widths {bad} are outside 1..{most} (the draft's K).")
    if any(not ms > 0 for ms in step_ms.values()):
        raise DLiteError(f"step costs must be positive, got {dict(step_ms)}.")


def save(engine_dir: Path, choice: WidthChoice) -> Path:
    path = Path(engine_dir) / WIDTH_FILE
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(choice.to_dict(), indent=2) + "\n")
    partial.replace(path)  # a reader never sees half a file
    return path


def load(engine_dir: Path, max_drafts: int) -> WidthChoice | None:
    """The engine's calibrated choice, or None when it has none (an engine calibrated by nothing)."""
    path = Path(engine_dir) / WIDTH_FILE
    if not path.is_file():
        return None
    try:
        choice = WidthChoice.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path} is corrupt ({exc!r}); delete it and run `dlite-trt calibrate --engine "
                          f"{engine_dir}`.") from exc
    if not 1 <= choice.drafts <= max_drafts or len(choice.curve) != max_drafts or \
            any(not 0 <= w.drafts <= max_drafts for w in [*choice.by_batch.values(), *choice.by_context.values()]):
        raise EngineError(f"{path} is for a draft of {len(choice.curve)} proposals (chose {choice.drafts}), this "
                          f"engine's draft makes {max_drafts}; run `dlite-trt calibrate --engine {engine_dir}`.")
    return choice
