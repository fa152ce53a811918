"""What every backend's session shares: the sequences, emission with stop tokens, results.

A session holds a batch of sequences (prompt + everything generated or appended so far) and
how much of each is in its backend's KV cache. Backends (the PyTorch reference, the ONNX
Runtime engine, later TensorRT) implement ``stream`` (speculative) and ``stream_target_only``
(the target alone), each yielding a ``StepEvent`` per engine call; the bookkeeping of what a
call emits, where a sequence stops and what stays cached lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dlite_trt.errors import DLiteError
from dlite_trt.runtime.prompt_lookup import fill_padding
from dlite_trt.runtime.sampling import is_greedy
from dlite_trt.runtime.stats import GenerationResult, StageTimer, StepRecord


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise DLiteError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}.")
        try:
            finite = 0.0 <= self.temperature < float("inf")  # NaN fails both, as in the server's check
        except TypeError:  # not a number
            finite = False
        if not finite:
            raise DLiteError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise DLiteError(f"seed must be an integer, got {self.seed!r}; pass a whole number such as 0.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator().manual_seed takes
            raise DLiteError(f"seed must be in [-2**63, 2**64 - 1] (what torch's generator takes), got {self.seed}; "
                             "pick a smaller seed.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def cut_emission(new: Sequence[int], emitted: int, params: SamplingParams) -> tuple[list[int], str | None]:
    """What an output that has ``emitted`` tokens keeps of a call's ``new`` tokens, and why it
    ends there: "stop_token", "max_new_tokens", or None (it goes on)."""
    kept: list[int] = []
    for tok in new:
        kept.append(int(tok))
        if kept[-1] in params.stop_token_ids:
            return kept, "stop_token"
        if emitted + len(kept) >= params.max_new_tokens:
            return kept, "max_new_tokens"
    return kept, None


@dataclass(frozen=True)
class StepEvent:
    """Tokens emitted by one engine call (the prefill, or one speculative step) per sequence."""

    new_tokens: tuple[tuple[int, ...], ...]
    record: StepRecord | None  # None for the prefill call


Uniforms = Callable[..., torch.Tensor | None]  # uniforms(*shape): float32 in [0, 1), or None when greedy


class Drafter(Protocol):
    """A model-free drafter (e.g. n-gram prompt lookup) for ``SessionBase.stream_drafted``."""

    indexes: Sequence[Any]  # one per sequence

    def sync(self, tokens: Sequence[Sequence[int]]) -> int:
        """Catch up on what the sequences gained outside decoding; returns the tokens processed."""

    def propose(self, row: int, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` draft tokens to follow ``tokens``."""

    def guess(self, row: int, tokens: Sequence[int], limit: int) -> list[int]:
        """A weaker proposal, for slots a call computes anyway where ``propose`` has none."""


class SessionBase:
    """A live batch of sequences: generate, extend with new tokens, generate again."""

    min_tokens = 1  # the fewest tokens per row a target call computes (an engine's: MIN_CALL_TOKENS)

    def __init__(self, prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
        if not prompts:
            raise DLiteError("no prompts given; pass at least one sequence of token ids.")
        self.vocab_size = vocab_size
        self.tokens: list[list[int]] = []
        for row, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise DLiteError(f"the prompt is empty (sequence {row} of the batch); give at least one token.")
            self.tokens.append(self._checked(prompt, f"the prompt (sequence {row} of the batch)"))
        self.cache_len = [0] * len(prompts)  # KV entries valid per sequence
        # per-generate progress, reset by _start()
        self._emitted = [0] * len(prompts)
        self._active = [False] * len(prompts)
        self._stop_reasons = ["max_new_tokens"] * len(prompts)

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    def _checked(self, ids: Sequence[int], what: str) -> list[int]:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DLiteError(f"{what} has token ids outside the target vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}; tokenize with the target's tokenizer.")
        return ids

    def extend(self, new_tokens: Sequence[Sequence[int]]) -> None:
        """Append tokens (a user turn, a tool result) to each sequence; earlier turns are not recomputed."""
        if len(new_tokens) != self.batch_size:
            raise DLiteError(f"extend got {len(new_tokens)} sequences for a batch of {self.batch_size}.")
        for row, ids in enumerate(new_tokens):
            self.tokens[row].extend(self._checked(ids, f"extension {row}"))

    def generate(self, params: SamplingParams) -> GenerationResult:
        """Speculative decoding until every sequence stops; the tokens are added to the session."""
        return self._collect(self.stream, params)

    def generate_target_only(self, params: SamplingParams) -> GenerationResult:
        """The target alone, one token per call (the baseline; the draft is not run)."""
        return self._collect(self.stream_target_only, params)

    def stream(self, params: SamplingParams, timer: StageTimer | None = None) -> Iterator[StepEvent]:
        raise NotImplementedError

    def stream_drafted(self, params: SamplingParams, drafter: Drafter,
                       timer: StageTimer | None = None) -> Iterator[StepEvent]:
        """Speculative decoding with a model-free drafter's proposals, verified by the target.

        Each step feeds [last token, d_1..d_m] (m <= max_verify_tokens() - 1; 0 without a
        proposal) to the target and keeps d_1..d_n while the target's token at each position
        equals the next draft, plus the target's own token after d_n: greedy output is the
        target's own. With sampling, a (one-hot) draft is accepted when the target's sample
        equals it, and the first sample that differs is the correction: exactly rejection
        sampling against a one-hot proposal, so the output follows the target's distribution.
        """
        if len(drafter.indexes) != self.batch_size:
            raise DLiteError(f"the drafter has {len(drafter.indexes)} sequences, the session {self.batch_size}.")
        timer = timer or StageTimer()
        b = self.batch_size
        limit = self.max_verify_tokens() - 1
        uniforms = self._start(params)
        if params.max_new_tokens == 0:
            return
        with timer.time("draft_context"):
            drafter.sync(self.tokens)
        with timer.time("prefill"):
            first = self._target_first(params, uniforms)
        yield StepEvent(tuple(self._emit(row, [first[row]], params) for row in range(b)), None)
        while any(self._active):
            with timer.time("draft"):
                proposals = [drafter.propose(row, self.tokens[row], limit) if self._active[row] else []
                             for row in range(b)]
                if is_greedy(params.temperature):
                    proposals = self._guessed(proposals, drafter)
            with timer.time("verify"):
                event = self._verify_proposals(proposals, params, uniforms)
            yield event

    def _guessed(self, proposals: list[list[int]], drafter: Drafter, width: int | None = None) -> list[list[int]]:
        """Greedy proposals with the drafter's guesses in the slots the verify computes anyway
        (``prompt_lookup.fill_padding``; ``width``: the call's block, else ``min_tokens``). Not when
        sampling: there every fed token draws a uniform, and a seed's tokens would move with the padding."""
        return fill_padding(proposals, self.min_tokens if width is None else width,
                            lambda row, room: drafter.guess(row, self.tokens[row], room) if self._active[row] else [])

    def _verify_proposals(self, proposals: list[list[int]], params: SamplingParams, uniforms: Uniforms) -> StepEvent:
        """One step of model-free drafts: the target alone verifies [last token, proposal] per row,
        keeping the proposal's prefix that agrees with it and its own token after that."""
        pos = [len(t) - 1 for t in self.tokens]  # the last token, not yet cached
        target = self._target_verify([[t[-1], *p] for t, p in zip(self.tokens, proposals, strict=True)],
                                     pos, params, uniforms)
        accepted = []
        for want, got in zip(proposals, target, strict=True):
            n = 0
            while n < len(want) and got[n] == want[n]:
                n += 1
            accepted.append(n)
        return self._finish_step(proposals, accepted, lambda row, n: proposals[row][:n] + [target[row][n]], pos,
                                 params)

    def stream_target_only(self, params: SamplingParams, timer: StageTimer | None = None) -> Iterator[StepEvent]:
        """Yield each call's token per sequence, decoding with the target alone (the baseline)."""
        timer = timer or StageTimer()
        b = self.batch_size
        uniforms = self._start(params)
        if params.max_new_tokens == 0:
            return
        with timer.time("prefill"):
            tokens = self._target_first(params, uniforms)
        while True:
            yield StepEvent(tuple(self._emit(row, [tokens[row]], params) if self._active[row] else ()
                                  for row in range(b)), None)
            if not any(self._active):
                return
            pos = [len(t) - 1 for t in self.tokens]  # the token just emitted, not yet cached
            with timer.time("decode"):
                tokens = self._target_next(tokens, pos, params, uniforms)
            for row in range(b):
                if self._active[row]:
                    self.cache_len[row] = pos[row] + 1

    def _target_first(self, params: SamplingParams, uniforms: Uniforms) -> list[int]:
        """Run the target over the uncached suffixes; the next token per sequence."""
        raise NotImplementedError

    def _target_next(self, tokens: list[int], pos: list[int], params: SamplingParams,
                     uniforms: Uniforms) -> list[int]:
        """Run the target on one token per sequence at ``pos`` (caching it for active rows); the next tokens."""
        raise NotImplementedError

    def max_verify_tokens(self) -> int:
        """The most tokens one ``_target_verify`` call takes per sequence."""
        raise NotImplementedError

    def _target_verify(self, fed: list[list[int]], pos: list[int], params: SamplingParams,
                       uniforms: Uniforms) -> list[list[int]]:
        """Run the target on fed[b] at positions pos[b].. (all cached for active rows, only the
        accepted ones count: ``_finish_step`` sets the lengths); the target's token after each fed token."""
        raise NotImplementedError

    def _padded(self, fed: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """``fed`` right-padded with 0 to one width, and the entries to cache per row (0 for finished rows)."""
        width = max(map(len, fed))
        return ([row + [0] * (width - len(row)) for row in fed],
                [len(row) if active else 0 for row, active in zip(fed, self._active, strict=True)])

    def _finish_step(self, proposals: Sequence[Sequence[int]], accepted: Sequence[int],
                     emitted: Callable[[int, int], list[int]], anchor_pos: Sequence[int],
                     params: SamplingParams) -> StepEvent:
        """Per-row bookkeeping after a verify: cache lengths, emission (with stops), the step record.

        proposals[b] are the K drafts verified, accepted[b] = n, emitted(b, n) the n + 1 tokens
        the step produced for row b (d_1..d_n and the new anchor); finished rows are skipped.
        """
        drafts, counts, new_tokens = [], [], []
        for row in range(self.batch_size):
            if not self._active[row]:
                drafts.append(None)
                counts.append(None)
                new_tokens.append(None)
                continue
            n = int(accepted[row])
            drafts.append(tuple(int(t) for t in proposals[row]))
            counts.append(n)
            self.cache_len[row] = int(anchor_pos[row]) + n + 1  # anchor, d_1..d_n are now cached
            new_tokens.append(self._emit(row, emitted(row, n), params))
        kept = tuple(None if t is None else len(t) for t in new_tokens)
        return StepEvent(tuple(t or () for t in new_tokens), StepRecord(tuple(drafts), tuple(counts), kept))

    def _collect(self, stream, params: SamplingParams) -> GenerationResult:
        result = GenerationResult(output_ids=[[] for _ in self.tokens])
        timer = StageTimer()
        for event in stream(params, timer):
            for row, toks in enumerate(event.new_tokens):
                result.output_ids[row].extend(toks)
            if event.record is not None:
                result.steps.append(event.record)
        result.timings = timer.as_dict()
        result.stop_reasons = list(self._stop_reasons)
        return result

    def _check_length(self, longest: int) -> None:
        """Raise when a sequence would grow past what the backend supports."""

    def _start(self, params: SamplingParams) -> Uniforms:
        """Reset per-generate progress and check lengths; returns the uniform-number source."""
        b = self.batch_size
        self._stop_reasons = ["max_new_tokens"] * b
        self._emitted = [0] * b
        self._active = [params.max_new_tokens > 0] * b
        self._check_length(max(map(len, self.tokens)) + params.max_new_tokens)
        rng = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        sampling = not is_greedy(params.temperature)

        def uniforms(*shape: int) -> torch.Tensor | None:
            return torch.rand(*shape, generator=rng) if sampling else None  # on the CPU, float32

        return uniforms

    def _emit(self, row: int, new: list[int], params: SamplingParams) -> tuple[int, ...]:
        """Append accepted tokens to a sequence, cut at a stop token or max_new_tokens."""
        kept, reason = cut_emission(new, self._emitted[row], params)
        self._emitted[row] += len(kept)
        if reason is not None:
            self._active[row], self._stop_reasons[row] = False, reason
        self.tokens[row].extend(kept)
        # Cached entries past the kept tokens (accepted after a cut) are invalid; the last
        # token always stays uncached so the next generate has a suffix to start from.
        self.cache_len[row] = min(self.cache_len[row], len(self.tokens[row]) - 1)
        return tuple(kept)


class GeneratorBase:
    """What every backend's generator offers: sessions, and one-shot generation."""

    def session(self, prompts: Sequence[Sequence[int]]) -> SessionBase:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationResult:
        """Speculative decoding of a batch from scratch (a fresh session)."""
        return self.session(prompts).generate(params)
