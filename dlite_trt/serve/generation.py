"""Running requests on an engine: greedy requests batched into engine batches, the rest one by
one, and streaming; stop strings, stop tokens and acceptance statistics per request.

Greedy output does not depend on the batch it runs in nor on how far the batch runs, so greedy
requests run together (packed so the batch fits the engine's --max-seq-len, and sharing the
engine's end tokens unless they ignore them), to the batch's longest ``max_tokens``; each
request's tokens are then cut at its own ``max_tokens``, stop tokens and stop strings: exactly
what the request alone gives. Sampled requests (their own seeds) run alone. A request that fails
(its engine batch raised) gets its own error and the others their replies: a failed batch is
re-run one request at a time, which greedy output allows.

A stop string ends the output where it first completes: the text is cut before it, the ids keep
the tokens that complete it. Streaming holds back text that could be the start of a stop string
or half of a character split across tokens, so the streamed text always equals the final text.
Closing a stream early (a client that cancelled) closes its engine session: no further step runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from dlite_trt.runtime.session import SamplingParams
from dlite_trt.serve.protocol import Request


@dataclass
class Reply:
    output_ids: list[int]
    text: str
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # per step: (tokens kept, n, K proposed)

    def _kept_steps(self) -> Iterator[tuple[int, int, int]]:
        """(tokens kept, drafts accepted and kept, drafts proposed) per step whose tokens are in the output."""
        left = len(self.output_ids) - 1  # the first token came from the prefill
        for emitted, n, proposed in self.steps:
            if left <= 0:
                return
            kept = min(emitted, left)
            yield kept, min(n, kept), proposed
            left -= kept

    @property
    def accepted(self) -> int:
        return sum(a for _, a, _ in self._kept_steps())

    @property
    def proposed(self) -> int:
        return sum(p for _, _, p in self._kept_steps())

    @property
    def step_count(self) -> int:
        """Speculative steps whose tokens are in the output."""
        return sum(1 for _ in self._kept_steps())

    @property
    def mean_acceptance_length(self) -> float:
        """Output tokens per speculative step (prefill token excluded); 0 when no step ran."""
        kept = [k for k, _, _ in self._kept_steps()]
        return sum(kept) / len(kept) if kept else 0.0


class RequestRunner:
    """Runs requests on an opened engine (``engine.load.LoadedEngine``)."""

    def __init__(self, loaded: Any) -> None:
        self.generator = loaded.generator
        self.tokenizer = loaded.tokenizer
        self.engine_stops = tuple(loaded.stop_token_ids)
        limits = self.generator.manifest.limits
        self.max_batch, self.max_seq_len = limits.max_batch, limits.max_seq_len
        self.fault_prompt: tuple[int, ...] | None = None  # tests only: see _session

    def stop_ids(self, request: Request) -> tuple[int, ...]:
        return (() if request.ignore_eos else self.engine_stops) + request.stop_token_ids

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- whole replies ---------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[Reply]:
        """Replies in request order: greedy requests in engine batches, sampled ones alone. Raises
        the first failed request's error (``run_each`` answers the others)."""
        results = self.run_each(requests)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    def run_each(self, requests: Sequence[Request]) -> list[Reply | Exception]:
        """Like ``run``, but a request that fails gets its exception in its place and the others
        their replies. A failed engine batch is re-run one request at a time (greedy output does
        not depend on the batch), so only the requests that fail alone get an exception."""
        results: list[Reply | Exception | None] = [None] * len(requests)
        for rows in self._greedy_batches(requests):
            for i, result in zip(rows, self._greedy_results([requests[i] for i in rows]), strict=True):
                results[i] = result
        for i, request in enumerate(requests):
            if results[i] is None:
                results[i] = _attempt(self._run_alone, request)
        return results

    def _greedy_results(self, group: Sequence[Request]) -> list[Reply | Exception]:
        """One engine batch's replies; if the batch fails, each request runs again alone, so the
        others in it are still answered and only a request that fails alone gets an exception."""
        try:
            return self._run_greedy(group)
        except Exception as exc:  # noqa: BLE001 - which request failed it? running each alone tells
            if len(group) == 1:
                return [exc]
        return [_attempt(lambda r: self._run_greedy([r])[0], request) for request in group]

    def _run_greedy(self, group: Sequence[Request]) -> list[Reply]:
        """One engine batch of greedy requests, to its longest max_tokens; each reply cut at its own."""
        stops = () if group[0].ignore_eos else self.engine_stops  # shared by the whole group
        result = self._session([r.prompt for r in group]).generate(
            SamplingParams(max_new_tokens=max(r.max_tokens for r in group), stop_token_ids=stops))
        replies = []
        for row, request in enumerate(group):
            ids, text = self._cut_text(request, self._cut_tokens(request, result.output_ids[row]))
            steps = [(s.kept[row], s.accepted[row], len(s.draft_tokens[row]))
                     for s in result.steps if s.kept[row] is not None]
            replies.append(Reply(ids, text, steps))
        return replies

    def _run_alone(self, request: Request) -> Reply:
        """A sampled (or empty) request: its stream's final reply."""
        final = Reply([], "")
        for _, _, final in self.stream(request):
            pass
        return final

    def _session(self, prompts: Sequence[Sequence[int]]) -> Any:
        """An engine session on these prompts. ``fault_prompt`` is a test-only fault hook (see
        ``serve.triton_model``): a session that holds exactly that prompt fails as a broken engine would."""
        if self.fault_prompt is not None and self.fault_prompt in [tuple(p) for p in prompts]:
            raise RuntimeError(f"injected test fault: prompt {list(self.fault_prompt)} (DLITE_TRT_TEST_FAULT_PROMPT)")
        return self.generator.session([list(p) for p in prompts])

    def _greedy_batches(self, requests: Sequence[Request]) -> list[list[int]]:
        """Greedy requests with tokens to make, packed into batches of at most max_batch rows whose
        longest prompt plus largest max_tokens fits the engine, with the same end-token handling."""
        order = sorted((i for i, r in enumerate(requests) if r.greedy and r.max_tokens > 0),
                       key=lambda i: (requests[i].ignore_eos, len(requests[i].prompt)))
        batches: list[list[int]] = []
        for i in order:
            r = requests[i]
            last = batches[-1] if batches else None
            if (last is not None and len(last) < self.max_batch and requests[last[0]].ignore_eos == r.ignore_eos
                    and max(len(requests[j].prompt) for j in [*last, i])
                    + max(requests[j].max_tokens for j in [*last, i]) <= self.max_seq_len):
                last.append(i)
            else:
                batches.append([i])
        return batches

    def _cut_tokens(self, request: Request, ids: list[int]) -> list[int]:
        ids = ids[: request.max_tokens]
        stops = set(self.stop_ids(request))
        for k, tok in enumerate(ids):
            if tok in stops:
                return ids[: k + 1]
        return ids

    def _cut_text(self, request: Request, ids: list[int]) -> tuple[list[int], str]:
        return cut_at_stop(self.decode, ids, request.stop)

    # -- streaming -------------------------------------------------------------------------------
    def stream(self, request: Request) -> Iterator[tuple[str, list[int], Reply]]:
        """Yield (new text, new ids, reply so far) as the engine accepts tokens; the last reply is final.

        Each engine step runs when the next piece is asked for; closing this generator early (the
        client cancelled) closes the engine's stream, so no further step runs and its session goes.
        """
        if request.max_tokens == 0:
            return
        params = SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature,
                                seed=request.seed, stop_token_ids=self.stop_ids(request))
        with closing(self._session([request.prompt]).stream(params)) as events:
            yield from self._pieces(request, events)

    def _pieces(self, request: Request, events: Iterator[Any]) -> Iterator[tuple[str, list[int], Reply]]:
        text = ReplyText(self.decode, request.stop)
        for event in events:
            record = event.record
            steps = () if record is None or record.kept[0] is None else \
                ((record.kept[0], record.accepted[0], len(record.draft_tokens[0])),)
            yield text.add(event.new_tokens[0], steps)
            if text.done:
                return
        tail = text.finish()
        if tail is not None:
            yield tail


class ReplyText:
    """A reply assembled call by call: its ids, its text cut at the first stop string, and the text
    safe to send so far (held back: a tail that could begin a stop string or half a character), so
    the streamed pieces always add up to the final text."""

    def __init__(self, decode: Any, stops: Sequence[str]) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.borders = [_borders(s) for s in self.stops]
        self.reply = Reply([], "")
        self.done = False  # a stop string completed: the reply ends here

    def add(self, new_ids: Sequence[int], steps: Sequence[tuple[int, int, int]] = ()) -> tuple[str, list[int], Reply]:
        """One call's tokens (and its step statistics): (new text, new ids, the reply so far)."""
        reply, sent = self.reply, len(self.reply.output_ids)
        reply.steps.extend(steps)
        reply.output_ids += [int(t) for t in new_ids]
        full = self.decode(reply.output_ids)
        if any(s in full for s in self.stops):  # a stop string completed in this call: end here
            reply.output_ids, text = cut_at_stop(self.decode, reply.output_ids, self.stops, start=sent)
            self.done = True
            return _advance(reply, text), reply.output_ids[sent:], reply
        return _advance(reply, self._settled(full)), reply.output_ids[sent:], reply

    def _settled(self, text: str) -> str:
        """The part of ``text`` that later tokens cannot change or cut: without a trailing split
        character and without a tail that could begin a stop string (found in time linear in the
        tail it scans: at most each stop's length)."""
        text = text.rstrip("\ufffd")
        hold = max((_overlap(text, s, b) for s, b in zip(self.stops, self.borders, strict=True)), default=0)
        return text[: len(text) - hold]

    def take(self, tokens: Sequence[int], step: tuple[int, int, int] | None, ended: bool) -> list[tuple[str, list[int]]]:
        """What one engine call's update (``serve.scheduler.Update``: its tokens, its step, whether the
        output ended there) adds: (text, ids) pieces, the held-back text last when it ended."""
        out = []
        if tokens or step:
            delta, ids, _ = self.add(tokens, [step] if step else [])
            out.append((delta, ids))
        if ended and not self.done:
            tail = self.finish()
            if tail is not None:
                out.append((tail[0], []))
        return out

    def finish(self) -> tuple[str, list[int], Reply] | None:
        """What was held back, once the output has ended (None: nothing was)."""
        final = self.decode(self.reply.output_ids)
        return None if final == self.reply.text else (_advance(self.reply, final), [], self.reply)


def cut_at_stop(decode: Any, ids: list[int], stops: Sequence[str], start: int = 0) -> tuple[list[int], str]:
    """Where a stop string first completes: the fewest tokens that complete it, the text before it.
    ``start``: tokens known not to complete one (those of earlier calls), so the search begins after them."""
    text = decode(ids)
    if not any(s in text for s in stops):
        return ids, text
    for k in [*range(start + 1, len(ids) + 1), *range(1, start + 1)]:
        prefix = decode(ids[:k])
        starts = [prefix.find(s) for s in stops if s in prefix]
        if starts:
            return ids[:k], prefix[: min(starts)]
    raise AssertionError("unreachable: the whole text contains a stop string")


def _borders(s: str) -> list[int]:
    """Knuth-Morris-Pratt's table: for each prefix of ``s``, its longest proper prefix that is also its suffix."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        k += s[i] == s[k]
        table[i] = k
    return table


def _overlap(text: str, stop: str, borders: list[int]) -> int:
    """The longest k < len(stop) such that ``text`` ends with stop[:k], scanning the last len(stop) - 1
    characters once."""
    k = 0
    for ch in text[max(len(text) - len(stop) + 1, 0):] if len(stop) > 1 else "":
        while k and stop[k] != ch:
            k = borders[k - 1]
        k += stop[k] == ch
        if k == len(stop):
            k = borders[k - 1]
    return k


def _attempt(run: Any, *args: Any) -> Any:
    """``run(*args)``, or the exception it raised (it becomes that request's error response)."""
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - one request's failure is its own answer
        return exc


def _advance(reply: Reply, text: str) -> str:
    """Set the reply's text (it only grows) and return what was added."""
    delta = text[len(reply.text):]
    reply.text = text
    return delta
