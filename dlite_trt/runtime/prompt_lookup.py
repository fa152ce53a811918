"""Model-free n-gram prompt lookup, verified by the target: the free baseline for agentic/code traffic.

As transformers' ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` method: the last n tokens of a
sequence (n from ``max_ngram`` down to ``min_ngram``) are looked up earlier in the same sequence
(prompt and output), and the tokens that followed that occurrence are proposed. Here the most
recent occurrence wins (agentic contexts repeat what was just shown). The target verifies the
proposal in one call (``SessionBase.stream_drafted``), exactly as it verifies a DLite block:
greedy keeps the leading drafts the target agrees with, so the output is the target's own greedy
output. A step without a match is a plain decode step, except where the call computes more rows
than it is fed anyway (``fill_padding``): those slots carry the 1-gram lookup's guess.

The index is kept incrementally: each token is indexed once, when it stops being the last token,
so a step costs O(n-gram size), not O(context). What the drafter must process when the context
changes (a new turn, a tool result) is exactly the appended tokens; ``sync`` indexes and counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dlite_trt.errors import DLiteError


@dataclass(frozen=True)
class PromptLookupConfig:
    num_tokens: int = 7  # proposals per step (K)
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise DLiteError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}.")
        if self.num_tokens < 1:
            raise DLiteError(f"prompt lookup needs num_tokens >= 1, got {self.num_tokens}.")


class NgramIndex:
    """For one sequence: n-gram -> the position just after its most recent occurrence."""

    def __init__(self, cfg: PromptLookupConfig) -> None:
        self.cfg = cfg
        self.last: list[dict[tuple[int, ...], int]] = [{} for _ in range(cfg.max_ngram + 1)]
        self.sizes = sorted({1, *range(cfg.min_ngram, cfg.max_ngram + 1)})  # 1: for ``guess``
        self.indexed = 0  # tokens[:indexed] are indexed as n-gram ends (the last token never is)

    def _catch_up(self, tokens: Sequence[int]) -> int:
        """Index every n-gram ending before the last token; returns how many tokens were new."""
        start, end = self.indexed, len(tokens) - 1
        for i in range(start, end):  # an n-gram ending at i is followed by tokens[i + 1]
            for n in self.sizes:
                if i + 1 >= n:
                    self.last[n][tuple(tokens[i + 1 - n : i + 1])] = i + 1
        self.indexed = max(start, end)
        return max(0, end - start)

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest, most recent earlier match of the suffix."""
        self._catch_up(tokens)
        for n in range(min(self.cfg.max_ngram, len(tokens)), self.cfg.min_ngram - 1, -1):
            follow = self.last[n].get(tuple(tokens[len(tokens) - n :]))
            if follow is not None:
                return list(tokens[follow : follow + limit])
        return []

    def guess(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the most recent earlier occurrence of the last token
        alone: a weaker proposal than ``propose`` (right about a sixth of the time where no longer
        n-gram matches, on held-out code), for slots a call computes whatever they hold."""
        self._catch_up(tokens)
        follow = self.last[1].get((tokens[-1],)) if tokens else None
        return [] if follow is None else list(tokens[follow : follow + limit])


def fill_padding(proposals: Sequence[Sequence[int]], min_tokens: int,
                 guess: Callable[[int, int], list[int]]) -> list[list[int]]:
    """Greedy proposals with the rows that have none filled from ``guess(row, room)``, room being
    the drafts the call verifies anyway: a call feeds [last token, proposal] per row, right-padded to
    its widest row and to at least ``min_tokens`` (``runtime.engine.MIN_CALL_TOKENS``), and computes
    the padding's rows too. A guess there costs nothing and keeps a second token when right; a row
    that has a proposal keeps it as it is."""
    room = max(min_tokens, 1 + max(map(len, proposals), default=0)) - 1
    return [list(p) if p or room == 0 else guess(row, room) for row, p in enumerate(proposals)]


# P(the lookup's 1-gram guess at a miss is the target's next token) before a drafter has seen any: "right about
# a sixth of the time where no longer n-gram matches, on held-out code" (``NgramIndex.guess``); the bench's
# workloads on SmolLM2 fp32: 0.56 (agentic), 0.21 (chat), 0.17 (long-context)
GUESS_PRIOR = 1 / 6


@dataclass
class MissRuns:
    """How often the lookup misses (proposes nothing) right after a miss, and right after a hit,
    counted over a drafter's rows and turns: ``rate(after_miss)`` is P(miss | the row's previous step
    missed, or hit), with one miss and one hit as the prior (0.5 before anything is seen; a row's
    first step counts as after a hit). And how often the lookup's 1-gram guess at a miss is the target's
    next token (``guess_rate``, counted at every miss, drafted or not, so that what the policy does cannot
    hide it): a miss without drafts keeps 1 + that many tokens a decode call (``fill_padding``). DLite +
    n-gram reads both to decide whether a step should run the draft for the next one
    (``WidthChoice.drafting_pays``)."""

    after_miss: int = 0  # steps whose row missed the step before
    repeated: int = 0  # of those, the ones that missed again
    after_hit: int = 0  # steps whose row had a proposal the step before
    missed_after_hit: int = 0  # of those, the ones that missed
    guesses: int = 0  # misses whose 1-gram guess was checked against the target's next token
    guesses_right: int = 0  # of those, the ones it equalled

    def rate(self, after_miss: bool = True) -> float:
        if after_miss:
            return (self.repeated + 1) / (self.after_miss + 2)
        return (self.missed_after_hit + 1) / (self.after_hit + 2)

    def record(self, missed_before: bool, missed: bool) -> None:
        """Count one row's step: whether its lookup missed the step before, and now."""
        if missed_before:
            self.after_miss += 1
            self.repeated += missed
        else:
            self.after_hit += 1
            self.missed_after_hit += missed

    def guess_rate(self) -> float:
        """P(the guess at a miss is the target's token), ``GUESS_PRIOR`` weighing as two misses."""
        return (self.guesses_right + 2 * GUESS_PRIOR) / (self.guesses + 2)

    def record_guess(self, guess: Sequence[int], token: int) -> None:
        """Count one row's miss: the lookup's 1-gram guess there (empty: it had none), and the target's
        token after the row's last token (what that step emitted first)."""
        self.guesses += 1
        self.guesses_right += bool(guess) and guess[0] == token

    def record_guesses(self, guesses: Sequence[Sequence[int] | None], emitted: Sequence[Sequence[int]]) -> None:
        """``record_guess`` for each row of a step that missed (``guesses``: None where the row had a
        proposal), against the first token the step ``emitted`` for it (none: a finished row)."""
        for guess, tokens in zip(guesses, emitted, strict=True):
            if guess is not None and tokens:
                self.record_guess(guess, tokens[0])


class PromptLookupDrafter:
    """One index per sequence of a session; keep it for the session's lifetime (multi-turn).
    A ``Drafter`` for ``SessionBase.stream_drafted``."""

    def __init__(self, batch: int, cfg: PromptLookupConfig | None = None, misses: MissRuns | None = None) -> None:
        self.cfg = cfg or PromptLookupConfig()
        self.indexes = [NgramIndex(self.cfg) for _ in range(batch)]
        self.context_tokens = 0  # tokens indexed by ``sync``: the work a new prompt or turn costs
        self.misses = MissRuns() if misses is None else misses  # shared with other drafters where given
        self._missed = [False] * batch  # whether each row's last recorded proposal was empty

    def record(self, row: int, proposal: Sequence[int]) -> None:
        """Count a proposal a step verified (or its absence) in ``misses``."""
        self.misses.record(self._missed[row], not proposal)
        self._missed[row] = not proposal

    def sync(self, tokens: Sequence[Sequence[int]]) -> int:
        """Index what the sequences gained outside decoding (a prompt, an appended turn); returns the count."""
        count = sum(ix._catch_up(t) for ix, t in zip(self.indexes, tokens, strict=True))
        self.context_tokens += count
        return count

    def state_bytes(self) -> int:
        """Index size, counted as 8 bytes per stored integer (the n-gram's ids and its position)."""
        return sum(8 * (n + 1) * len(table) for ix in self.indexes for n, table in enumerate(ix.last))

    def propose(self, row: int, tokens: Sequence[int], limit: int) -> list[int]:
        return self.indexes[row].propose(tokens, min(limit, self.cfg.num_tokens))

    def guess(self, row: int, tokens: Sequence[int], limit: int) -> list[int]:
        return self.indexes[row].guess(tokens, min(limit, self.cfg.num_tokens))
