"""Serving requests on an engine: greedy requests batched into one engine batch, the rest one by
one, and streaming; stop strings, stop tokens and acceptance statistics per request.

Greedy output does not depend on the batch it runs in nor on how far the batch runs, so a batch
of greedy requests runs to its longest ``max_tokens`` and each request's tokens are then cut at
its own stop tokens, stop strings and ``max_tokens``: exactly what the request alone gives.
Sampled requests (their own seeds) run alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dlite_trt.runtime.session import SamplingParams
from dlite_trt.runtime.stats import StepRecord
from dlite_trt.serve.protocol import Request


@dataclass
class Reply:
    output_ids: list[int]
    text: str
    steps: int = 0  # speculative steps that produced this request's tokens
    accepted: int = 0
    proposed: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per speculative step (n + 1 each), 0 when no step ran."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


class Server:
    """Runs requests on an opened engine (``engine.load.LoadedEngine``)."""

    def __init__(self, loaded: Any) -> None:
        self.generator = loaded.generator
        self.tokenizer = loaded.tokenizer
        self.engine_stops = tuple(loaded.stop_token_ids)
        self.max_batch = self.generator.manifest.limits.max_batch

    def stop_ids(self, request: Request) -> tuple[int, ...]:
        return (() if request.ignore_eos else self.engine_stops) + request.stop_token_ids

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- whole replies ---------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[Reply]:
        """Replies in request order: greedy requests in engine batches, sampled ones alone."""
        replies: list[Reply | None] = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.greedy and r.max_tokens > 0]
        for start in range(0, len(greedy), self.max_batch):
            rows = greedy[start : start + self.max_batch]
            result = self.generator.session([list(requests[i].prompt) for i in rows]).generate(
                SamplingParams(max_new_tokens=max(requests[i].max_tokens for i in rows)))
            for row, i in enumerate(rows):
                ids = self._cut_tokens(requests[i], result.output_ids[row])
                replies[i] = self._finish(requests[i], ids, result.steps, row)
        for i, request in enumerate(requests):
            if replies[i] is None:
                pieces = list(self.stream(request))
                replies[i] = pieces[-1][2] if pieces else Reply([], "")
        return replies

    def _cut_tokens(self, request: Request, ids: list[int]) -> list[int]:
        ids = ids[: request.max_tokens]
        stops = set(self.stop_ids(request))
        for k, tok in enumerate(ids):
            if tok in stops:
                return ids[: k + 1]
        return ids

    def _finish(self, request: Request, ids: list[int], steps: Sequence[StepRecord], row: int) -> Reply:
        ids, text = self._cut_text(request, ids)
        reply = Reply(ids, text)
        emitted = 1 if ids else 0  # the prefill's token
        for step in steps:
            if emitted >= len(ids):
                break
            n = step.accepted[row]
            if n is None:
                break
            reply.steps += 1
            reply.accepted += n
            reply.proposed += len(step.draft_tokens[row])
            emitted += n + 1
        return reply

    def _cut_text(self, request: Request, ids: list[int]) -> tuple[list[int], str]:
        """At the first stop string: the text before it, the fewest tokens that contain it."""
        text = self.decode(ids)
        hits = [(text.find(s), s) for s in request.stop if s in text]
        if not hits:
            return ids, text
        cut, stop = min(hits)
        for k in range(1, len(ids) + 1):
            if stop in self.decode(ids[:k]):
                return ids[:k], text[:cut]
        return ids, text[:cut]

    # -- streaming -------------------------------------------------------------------------------
    def stream(self, request: Request) -> Iterator[tuple[str, list[int], Reply]]:
        """Yield (new text, new ids, reply so far) as the engine accepts tokens; the last reply is final.

        Text is decoded from all tokens so far and sent as the difference; a character still split
        across tokens is held back until complete. A stop string ends the stream before it."""
        reply, sent = Reply([], ""), 0
        if request.max_tokens == 0:
            return
        params = SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature,
                                seed=request.seed, stop_token_ids=self.stop_ids(request))
        for event in self.generator.session([list(request.prompt)]).stream(params):
            if event.record is not None and event.record.accepted[0] is not None:
                reply.steps += 1
                reply.accepted += event.record.accepted[0]
                reply.proposed += len(event.record.draft_tokens[0])
            reply.output_ids += event.new_tokens[0]
            ids, text = self._cut_text(request, reply.output_ids)
            if len(ids) < len(reply.output_ids):  # a stop string: end here
                reply.output_ids = ids
                yield text[len(reply.text):], ids[sent:], _with_text(reply, text)
                return
            stable = text.rstrip("\ufffd")  # a character still split across tokens waits for the rest
            delta = stable[len(reply.text):]
            yield delta, reply.output_ids[sent:], _with_text(reply, stable)
            sent = len(reply.output_ids)
        full = self.decode(reply.output_ids)
        if full != reply.text:  # the output ended mid-character: send what was held back
            yield full[len(reply.text):], [], _with_text(reply, full)


def _with_text(reply: Reply, text: str) -> Reply:
    reply.text = text
    return reply
