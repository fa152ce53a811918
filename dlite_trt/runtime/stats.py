"""Per-step records and stage timers of a generation (what `--trace` and bench report)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


class StageTimer:
    """Accumulates wall time per named stage: ``with timer.time("verify"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


@dataclass(frozen=True)
class StepRecord:
    """One speculative step of a batch. Rows that had already finished hold None.

    ``kept`` is the step's acceptance length: the tokens it added to the output, n + 1 unless
    max_new_tokens or a stop token cut the step. Every acceptance figure (CLI, bench, serving,
    training measurements) counts these, so a sequence's per-step figures plus its prefill
    token add up to its output length.
    """

    draft_tokens: tuple[tuple[int, ...] | None, ...]  # [B][K] proposals verified in this step
    accepted: tuple[int | None, ...]  # [B] n: leading drafts the target accepted (verification's result)
    kept: tuple[int | None, ...]  # [B] tokens kept: n + 1, or fewer where the output ended inside the step

    def kept_drafts(self, row: int) -> int | None:
        """Accepted drafts that are in the output (a cut step keeps only its first drafts)."""
        n, kept = self.accepted[row], self.kept[row]
        return None if n is None else min(n, kept)


@dataclass
class GenerationResult:
    output_ids: list[list[int]]  # [B][<= max_new_tokens] generated ids only
    steps: list[StepRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    stop_reasons: list[str] = field(default_factory=list)  # "stop_token" | "max_new_tokens"

    def acceptance_lengths(self, row: int = 0) -> list[int]:
        """Tokens kept per step for one sequence (n + 1, the bonus token included, unless the
        output ended inside the step): with the prefill's token they add up to the output."""
        return [s.kept[row] for s in self.steps if s.kept[row] is not None]

    def mean_acceptance_length(self, row: int | None = None) -> float:
        rows = range(len(self.output_ids)) if row is None else [row]
        lengths = [n for r in rows for n in self.acceptance_lengths(r)]
        return sum(lengths) / len(lengths) if lengths else 0.0
