"""In-flight (continuous) batching on one engine, with prefix (KV) reuse across requests.

One thread owns the engine. Each iteration: rows whose client went away leave; waiting
requests join (up to the engine's --max-batch rows and the KV budget), each first taking the
longest kept prefix of its prompt (``prefix_cache``) and prefilling only the rest; then one
call advances every running row by its own acceptance (a DLite step: verify, accept, draft
the next block; or n-gram proposals verified by the target; or one target token), and rows
that finished leave, their KV entries kept for the next turn.

The running rows sit in slots 0..n-1 of one KV cache of --max-batch rows; a call binds the
slots it runs on (``KVCache.rows``: consecutive rows of each layer are contiguous, so nothing
is copied), and a row that leaves from the middle has the last row moved into its slot.

Greedy and sampled rows share a batch: when any row samples, the call runs the sampling graph,
in which rows at temperature 0 stay greedy. Each row draws its uniforms from its own generator
in the order a batch of one draws them, so a seeded request gives the same tokens whatever it
is batched with and whatever prefix it reused. A call that raises is retried one row at a time
with the same draws: only a row that fails alone gets the error.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlite_trt.errors import DLiteError
from dlite_trt.export.contract import SAMPLING_SUFFIX, cache_capacity_max
from dlite_trt.runtime.engine import (
    UNDRAFTED_WIDTH,
    EngineGenerator,
    EngineSession,
    decode_inputs,
    every_output,
    min_call_tokens,
    next_width,
    padded_ids,
    widened,
)
from dlite_trt.runtime.kv_cache import GRANULE, KVCache
from dlite_trt.runtime.prompt_lookup import MissRuns, NgramIndex, PromptLookupConfig, fill_padding
from dlite_trt.runtime.sampling import is_greedy
from dlite_trt.runtime.session import SamplingParams, cut_emission
from dlite_trt.serve.metrics import ServerMetrics
from dlite_trt.serve.prefix_cache import PrefixCache

SPECULATIVE = ("dlite", "dlite-ngram", "ngram", "none")
FAULT_PROMPT_ENV = "DLITE_TRT_TEST_FAULT_PROMPT"  # tests only: a row with exactly this prompt fails its calls


class QueueFull(DLiteError):
    """The waiting queue is at --max-queue: the server answers 503."""


@dataclass(frozen=True)
class Update:
    """What one engine call gave a request. The last update has ``finish_reason`` or ``error``."""

    tokens: tuple[int, ...]
    step: tuple[int, int, int] | None = None  # (tokens kept, drafts accepted, drafts proposed)
    finish_reason: str | None = None  # "stop_token" | "max_new_tokens"
    error: BaseException | None = None


@dataclass
class Handle:
    """A submitted request: ``cancel()`` frees its row at the next iteration."""

    prompt_tokens: int
    cached_tokens: int = 0  # set when it joins the batch, before its first update
    cancelled: bool = False
    reason: str = "cancelled"  # what /metrics counts it as: "cancelled" (client gone) or "stop_string"

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled:
            self.reason, self.cancelled = reason, True


@dataclass
class _Result:
    """One row's share of a call, applied to the row only once the call has succeeded."""

    tokens: list[int]
    cache_len: int
    state: dict[str, Any] = field(default_factory=dict)
    drafts: int | None = None  # proposals verified (None: a prefill)
    accepted: int = 0


class _Row:
    def __init__(self, prompt: Sequence[int], params: SamplingParams, deliver: Callable[[Update], None],
                 handle: Handle) -> None:
        self.prompt = tuple(prompt)
        self.tokens = list(prompt)
        self.params, self.deliver, self.handle = params, deliver, handle
        self.cache_len = 0
        self.emitted = 0
        self.state: dict[str, Any] = {}  # per-row carry: next block, "drafted", group prefix, draft logits
        self.draws: dict[str, np.ndarray] = {}  # this call's uniforms (kept for a retry)
        self.sampling = not is_greedy(params.temperature)
        self.rng = None
        if self.sampling:
            self.rng = torch.Generator()
            if params.seed is None:
                self.rng.seed()
            else:
                self.rng.manual_seed(params.seed)
        self.arrival = time.perf_counter()
        self.first_at = self.last_at = 0.0

    def draw(self, *names_shapes: tuple[str, tuple[int, ...]]) -> None:
        """This call's uniforms, in the order a batch of one draws them (zeros when greedy)."""
        self.draws = {name: (torch.rand(*shape, generator=self.rng).numpy() if self.sampling
                             else np.zeros(shape, np.float32)) for name, shape in names_shapes}


class Scheduler:
    def __init__(self, generator: EngineGenerator, *, speculative: str = "dlite", kv_budget_bytes: int = 4 << 30,
                 prefix_cache: bool = True, max_queue: int = 256, metrics: ServerMetrics | None = None) -> None:
        if speculative not in SPECULATIVE:
            raise DLiteError(f"--speculative must be one of {', '.join(SPECULATIVE)}, got {speculative!r}.")
        self.counter = _CountingRunner(generator.runner)
        self.generator = EngineGenerator(self.counter, generator.manifest, generator.verify_drafts, generator.widths)
        manifest = generator.manifest
        self.limits, self.cfg, self.spec = manifest.limits, manifest.draft_config, manifest.target_spec
        self.speculative = speculative
        self.calls = {"dlite": _DLiteCalls, "dlite-ngram": _DLiteNgramCalls}.get(
            speculative, lambda s: _DecodeCalls(s, speculative == "ngram"))(self)
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics(self.cfg.num_proposals)
        self.counter.on_call = lambda graph: self.metrics.engine_calls.labels(graph=graph).inc()
        self.prefix = PrefixCache(kv_budget_bytes, enabled=prefix_cache)
        self.metrics.watch_kv(self.kv_figures)
        spec = self.spec
        self.bytes_per_entry = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * \
            torch.empty((), dtype=_cache_dtype(self.counter)).element_size()  # one token's K and V, all layers
        self._live = self.counter.new_cache(1)  # rows and slots grow as requests join (_reserve)
        self._rows: list[_Row] = []
        self._waiting: deque[_Row] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        fault = os.environ.get(FAULT_PROMPT_ENV)
        self.fault_prompt = tuple(int(t) for t in fault.split(",")) if fault else None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._loop, name="dlite-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests --------------------------------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise DLiteError (the server's 400) for a request the engine can never run."""
        longest = prompt_len + max_new_tokens
        if longest > self.limits.max_seq_len:
            raise DLiteError(f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new_tokens}) is {longest} "
                             f"tokens, past the engine's --max-seq-len {self.limits.max_seq_len}; shorten the prompt "
                             "or lower max_tokens (or rebuild the engine with a larger --max-seq-len).")
        need = self._live_bytes_for(longest, 1)
        if need > self.prefix.budget_bytes:
            raise DLiteError(f"this request needs {need / 2**30:.2f} GiB of KV cache ({longest} positions), more than "
                             f"--kv-cache-gb {self.prefix.budget_bytes / 2**30:.2f}; raise --kv-cache-gb or shorten "
                             "the request (max_tokens counts).")

    def submit(self, prompt: Sequence[int], params: SamplingParams, deliver: Callable[[Update], None]) -> Handle:
        """Queue a request; ``deliver`` gets its updates on the scheduler's thread."""
        self.check(len(prompt), params.max_new_tokens)
        handle = Handle(len(prompt))
        if params.max_new_tokens == 0:
            deliver(Update((), finish_reason="max_new_tokens"))
            return handle
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down; retry on another server.")
            # the queue: requests waiting beyond the batch rows free now (they join at the next step)
            queued = len(self._waiting) - max(0, self.limits.max_batch - len(self._rows))
            if queued >= self.max_queue:
                raise QueueFull(f"the server has {queued} requests waiting for a batch row (--max-queue "
                                f"{self.max_queue}); retry later or add servers.")
            self._waiting.append(_Row(prompt, params, deliver, handle))
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()
        return handle

    def kv_figures(self) -> dict[str, float]:
        s = self.prefix.stats
        return {"queries": s.queries, "hits": s.hits, "reused_tokens": s.reused_tokens, "evictions": s.evictions,
                "kv_cache_bytes": self.prefix.kept_bytes + self._live.nbytes,
                "kv_cache_budget_bytes": self.prefix.budget_bytes, "kv_cache_peak_bytes": self.prefix.peak_bytes,
                "prefix_cache_sequences": len(self.prefix)}

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._rows:
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception as exc:  # noqa: BLE001 - a scheduler bug: fail the rows, keep serving
                for row in self._rows:
                    row.deliver(Update((), error=exc))
                self._rows = []
                self._live = self.counter.new_cache(1)
        for row in [*self._rows, *self._waiting]:
            row.deliver(Update((), error=DLiteError("the server is shutting down.")))

    def _iteration(self) -> None:
        for i in reversed(range(len(self._rows))):
            if self._rows[i].handle.cancelled and "finish" not in self._rows[i].state:
                self._leave(i, self._rows[i].handle.reason)
        with self._cv:  # requests cancelled while queued leave the queue (and are counted) now
            for row in [r for r in self._waiting if r.handle.cancelled]:
                self._waiting.remove(row)
                self.metrics.requests.labels(finish_reason=row.handle.reason).inc()
        joined = self._admit()
        if joined:
            self._run(joined, len(self._rows) - len(joined), self.calls.prefill)
            self._leave_finished()  # so the running rows fill slots 0..n-1
        if self._rows:
            self._run(list(self._rows), 0, self.calls.step)
            self._leave_finished()
        if not self._rows:  # idle: the live cache goes back to nothing
            self._live = self.counter.new_cache(1)
        self.prefix.fit(self._live.nbytes)
        self.metrics.running.set(len(self._rows))

    def _leave_finished(self) -> None:
        for i in reversed(range(len(self._rows))):
            if "finish" in self._rows[i].state:
                self._leave(i, self._rows[i].state["finish"])

    def _live_bytes_for(self, longest: int, rows: int) -> int:
        """Bytes of a live cache of ``rows`` rows whose longest sequence reaches ``longest`` tokens."""
        slots = min(-(-(longest + self.cfg.block_size) // GRANULE) * GRANULE,
                    cache_capacity_max(self.limits, self.cfg.block_size))
        return slots * rows * self.bytes_per_entry

    def _admit(self) -> list[_Row]:
        """Move waiting requests into free slots while the live cache fits the budget."""
        joined, running = [], len(self._rows)
        with self._cv:
            while self._waiting and len(self._rows) < self.limits.max_batch:
                row = self._waiting[0]
                longest = max(len(r.prompt) + r.params.max_new_tokens for r in [*self._rows, row])
                if self._rows and self._live_bytes_for(longest, self._rows_for(len(self._rows) + 1)) > \
                        self.prefix.budget_bytes:
                    break  # it waits for running rows to finish (kept sequences are evicted first)
                self._waiting.popleft()
                self._rows.append(row)
                joined.append(row)
            self.metrics.queue_depth.set(len(self._waiting))
        if not joined:
            return []
        if running:
            self.metrics.joined_running.inc(len(joined))
        self._reserve()
        for row in joined:
            self.metrics.prompt_tokens.inc(len(row.prompt))
            kept, n = self.prefix.lookup(row.prompt)
            if n:
                self._live.load_row(self._rows.index(row), kept.k[:, :, :n], kept.v[:, :, :n])
            row.cache_len = row.handle.cached_tokens = n
        return joined

    def _rows_for(self, n: int) -> int:
        """Rows of the live cache that holds ``n`` sequences: it grows in powers of two (never shrinks
        while busy) up to --max-batch."""
        return max(self._live.batch, min(self.limits.max_batch, 1 << (n - 1).bit_length()))

    def _reserve(self) -> None:
        """Room in the live cache for every row to its end: rows and slots grow (what is cached is kept)."""
        longest = max(len(r.prompt) + r.params.max_new_tokens for r in self._rows)
        limit = cache_capacity_max(self.limits, self.cfg.block_size)
        rows = self._rows_for(len(self._rows))
        self.prefix.fit(max(self._live.nbytes, self._live_bytes_for(longest, rows)))  # room first, then grow
        if rows > self._live.batch:
            grown = self.counter.new_cache(rows)
            grown.reserve(max(self._live.capacity, min(longest + self.cfg.block_size, limit)), limit)
            for slot, row in enumerate(self._rows[: self._live.batch]):
                if row.cache_len:
                    grown.load_row(slot, self._live.k[:, slot, :, : row.cache_len],
                                   self._live.v[:, slot, :, : row.cache_len])
            self._live = grown
        self._live.reserve(min(longest + self.cfg.block_size, limit), limit)

    def _run(self, rows: list[_Row], start: int, call: Callable[[list[_Row], KVCache], list[_Result]]) -> None:
        """``call`` on rows in slots start.., each row then advanced; on an error, each row alone."""
        try:
            results = self._guarded(rows, start, call)
        except Exception:  # noqa: BLE001 - which row failed it? running each alone tells
            self.metrics.retries.inc()
            for row in rows:
                slot = self._rows.index(row)
                try:
                    self._apply(row, self._guarded([row], slot, call)[0])
                except Exception as exc:  # noqa: BLE001 - this row's failure is its own answer
                    row.state["finish"] = "error"
                    row.deliver(Update((), error=exc))
            return
        for row, result in zip(rows, results, strict=True):
            self._apply(row, result)

    def _guarded(self, rows: list[_Row], start: int, call) -> list[_Result]:
        # the test-only fault: the engine call of a step holding that row raises, after the draws
        self.counter.fail_next = call == self.calls.step and self.fault_prompt is not None and \
            any(r.prompt == self.fault_prompt for r in rows)
        return call(rows, self._live.rows(start, start + len(rows)))

    def _apply(self, row: _Row, result: _Result) -> None:
        """A successful call's tokens into the row (cut at its stops), and its update delivered."""
        row.state.update(result.state, ready=True)
        kept, reason = cut_emission(result.tokens, row.emitted, row.params)
        row.tokens += kept
        row.emitted += len(kept)
        row.cache_len = min(result.cache_len, len(row.tokens) - 1)  # the last token stays uncached
        now = time.perf_counter()
        if row.emitted == len(kept):
            row.first_at = now
            self.metrics.ttft.observe(now - row.arrival)
        row.last_at = now
        self.metrics.generation_tokens.inc(len(kept))
        step = None
        if result.drafts is not None:
            step = (len(kept), result.accepted, result.drafts)
            if result.drafts:
                self.metrics.step(result.drafts, min(result.accepted, len(kept)))
        if reason is not None:
            row.state["finish"] = reason
        row.deliver(Update(tuple(kept), step, reason))

    def _leave(self, slot: int, reason: str) -> None:
        """Row ``slot`` leaves the batch; its entries are kept for reuse; the last row takes its slot."""
        row = self._rows[slot]
        if row.cache_len and self._live.capacity:
            self.prefix.keep(row.tokens[: row.cache_len], row.cache_len * self.bytes_per_entry,
                             lambda: self._live.save_row(slot, row.cache_len), self._live.nbytes)
        last = len(self._rows) - 1
        if slot != last:
            self._live.copy_row(slot, last, self._rows[last].cache_len)
            self._rows[slot] = self._rows[last]
        self._rows.pop()
        self.metrics.requests.labels(finish_reason=reason).inc()
        if row.emitted > 1:
            self.metrics.tpot.observe((row.last_at - row.first_at) / (row.emitted - 1))


class _DLiteCalls:
    """DLite: prefill -> the first block; each step verifies it and drafts the next, in one call.

    A greedy batch verifies the width calibrated for its size (``verify_width``: 0..K); at 0 the
    target decodes alone on the decode graph and no draft runs (``dlite_draft_skipped_total``),
    so speculation costs nothing at batch sizes where it does not pay."""

    def __init__(self, sched: Scheduler, ngram: bool = False) -> None:
        self.sched, self.k, self.g = sched, sched.cfg.num_proposals, sched.cfg.anchor_group_size
        self.decode = _DecodeCalls(sched, ngram)

    def drafts_for(self, rows: list[_Row]) -> int:
        """Drafts a greedy step of these rows verifies (0: none, plain decoding)."""
        return self.sched.generator.greedy_drafts(len(rows), drafting=False)

    def prefill(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        sampling = any(r.sampling for r in rows)
        for row in rows:
            if not row.draws:
                row.draw(("u_anchor", (1,)), ("u_draft", (1, self.k)))
        session = EngineSession(self.sched.generator, [r.tokens for r in rows], cache=view)
        session.cache_len = [r.cache_len for r in rows]
        feeds = {"group_prefix": session._group_prefix()} if self.g > 1 else {}
        if sampling:
            feeds |= _stacked(rows, ("u_anchor", "u_draft")) | {"temperature": _temperatures(rows)}
        out = session._prefill("prefill" + SAMPLING_SUFFIX * sampling, feeds,
                               lead=self.sched.generator.leads_on_decode(self.decode.lookup is not None))
        out = _outputs(out)
        results, logits = [], _host(out.get("next_draft_logits"))
        for i, row in enumerate(rows):
            state = {"block": out["next_block"][i], "logits": None if logits is None else logits[i], "drafted": True}
            if self.g > 1:
                state["prefix"] = feeds["group_prefix"][i]
            results.append(_Result([int(out["next_block"][i, 0])], len(row.tokens), state))
            row.draws = {}
        return results

    def step(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        sampling = any(r.sampling for r in rows)
        k = self.k if sampling else self.drafts_for(rows)  # a greedy step verifies d_1..d_k
        if k == 0:
            return self._without_draft(rows, view, [[] for _ in rows])
        width = k + 1 if sampling else self._greedy_width(rows, k)
        return self._verify_and_draft(rows, view, np.stack([widened(r.state["block"], width) for r in rows]))

    @staticmethod
    def _greedy_width(rows: list[_Row], k: int) -> int:
        """k + 1, or the narrowest step where no row's block holds drafts made from its anchor
        (every row's last step ran without the draft: ``UNDRAFTED_WIDTH``)."""
        return k + 1 if any(r.state["drafted"] for r in rows) else UNDRAFTED_WIDTH

    def _without_draft(self, rows: list[_Row], view: KVCache, proposals: list[list[int]]) -> list[_Result]:
        """A greedy step on the decode graph: the target alone verifies ``proposals`` (none: it decodes
        one token); the next block is each row's anchor alone, and the next step call drafts again
        (at ``UNDRAFTED_WIDTH``: it has nothing from the draft to verify)."""
        for row in rows:  # a retried row may hold a step's draws: greedy, so nothing of them is lost
            row.draws = {}
        results = self._undrafted(rows, self.decode.verify(rows, view, proposals))
        self.sched.metrics.draft_skipped.inc(len(rows))
        return results

    def _undrafted(self, rows: list[_Row], results: list[_Result]) -> list[_Result]:
        """``results`` of a call without the draft, each row's next block its anchor alone (the last
        token the call emitted) and its group prefix the G - 1 tokens before that."""
        for row, result in zip(rows, results, strict=True):
            block = np.zeros(self.k + 1, np.int64)
            block[0] = result.tokens[-1]
            result.state = {"block": block, "drafted": False}
            if self.g > 1:
                before = [*row.tokens, *result.tokens[:-1]][-(self.g - 1):]
                result.state["prefix"] = np.array([0] * (self.g - 1 - len(before)) + before, np.int64)
        return results

    def _verify_and_draft(self, rows: list[_Row], view: KVCache, block: np.ndarray) -> list[_Result]:
        """One step call: verify ``block`` ([anchor, drafts] per row), accept, draft the next block."""
        sampling = any(r.sampling for r in rows)
        for row in rows:
            if not row.draws:
                row.draw(("u_accept", (1, self.k)), ("u_resample", (1,)), ("u_draft", (1, self.k)))
        past_len = np.array([r.cache_len for r in rows], np.int64)
        k = block.shape[1] - 1
        feeds = {"block": block, "past_len": past_len}
        if self.g > 1:
            feeds["group_prefix"] = np.stack([r.state["prefix"] for r in rows])
        if not sampling:  # draft what a step of this batch size verifies
            feeds["next_width"] = next_width(len(rows), self.sched.generator.greedy_drafts(len(rows)))
        if sampling:
            vocab = self.sched.spec.vocab_size
            feeds |= _stacked(rows, ("u_accept", "u_resample", "u_draft")) | {
                "temperature": _temperatures(rows),
                "draft_logits": np.stack([r.state["logits"] if r.state.get("logits") is not None
                                          else np.zeros((self.k, vocab), np.float32) for r in rows])}
        view.reserve(int(past_len.max()) + k + 1, view.capacity)
        out = self.sched.counter.infer("step" + SAMPLING_SUFFIX * sampling, feeds, view)
        out = _outputs(out)
        n = out["accepted"].tolist()
        view.store(out, past_len.tolist(), [a + 1 for a in n])
        results, logits = [], _host(out.get("next_draft_logits"))
        for i, row in enumerate(rows):
            state = {"block": out["next_block"][i], "logits": None if logits is None else logits[i], "drafted": True}
            if self.g > 1:
                state["prefix"] = out["next_group_prefix"][i]
            results.append(_Result(out["emitted"][i, : n[i] + 1].tolist(), int(past_len[i]) + n[i] + 1, state,
                                   drafts=k, accepted=n[i]))
            row.draws = {}
        return results


class _DLiteNgramCalls(_DLiteCalls):
    """DLite + n-gram prompt lookup (greedy batches): a row's lookup proposal, where it has one,
    replaces its drafts in the block the step verifies; when every row has one, the target alone
    verifies them on the decode graph and the draft is skipped (``dlite_draft_skipped_total``),
    unless drafting for the next step pays; when no row holds drafts (the last step skipped the
    draft) and some row's lookup misses, the step call (for those rows the lookup's 1-gram guess and
    the target's token) runs only where the misses expected next pay for it, else rows without a
    proposal decode one token, the guess beside it. Both decisions are
    ``EngineGenerator.runs_step_graph``, from how often a row's lookup has missed right after a hit
    and right after a miss and how often its 1-gram guess at a miss was the target's token, over the
    server's rows (``misses``), as a DLite
    + n-gram session decides them. A batch with a sampled row runs plain DLite."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched, ngram=True)
        self.misses = MissRuns()

    def prefill(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        """DLite's prefill, or (greedy rows, where drafting the first block does not pay:
        ``EngineGenerator.drafts_at_prefill``) target-only's, as n-gram lookup prefills."""
        if any(r.sampling for r in rows) or self.sched.generator.drafts_at_prefill(
                len(rows), max(len(r.tokens) for r in rows), self.misses):
            results = super().prefill(rows, view)
        else:
            results = self._undrafted(rows, self.decode.prefill(rows, view))
        for result in results:
            result.state |= {"ngram": NgramIndex(self.decode.lookup), "missed": False}
        return results

    def step(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        if any(r.sampling for r in rows):
            return super().step(rows, view)
        proposals = [r.state["ngram"].propose(r.tokens, min(self.k, self.decode.width - 1)) for r in rows]
        for row, proposal in zip(rows, proposals, strict=True):
            self.misses.record(row.state["missed"], not proposal)
            row.state["missed"] = not proposal
        guesses = [None if p else r.state["ngram"].guess(r.tokens, 1) for r, p in zip(rows, proposals, strict=True)]
        results = self._lookup_step(rows, view, proposals)
        self.misses.record_guesses(guesses, [r.tokens for r in results])
        return results

    def _lookup_step(self, rows: list[_Row], view: KVCache, proposals: list[list[int]]) -> list[_Result]:
        """One greedy step of rows whose lookup proposed ``proposals`` (empty: a miss)."""
        k = self.drafts_for(rows)
        # where the batch's width is 0, or drafting would not pay, rows without a proposal decode one token
        if k == 0 or not self.sched.generator.runs_step_graph(
                len(rows), max(r.cache_len for r in rows), self.misses, hit=all(proposals),
                drafted=any(r.state["drafted"] for r in rows)):
            return self._without_draft(rows, view, proposals)
        width = max(self._greedy_width(rows, k), *(len(p) + 1 for p in proposals))
        proposals = fill_padding(proposals, width, lambda i, room: [] if rows[i].state["drafted"] else
                                 rows[i].state["ngram"].guess(rows[i].tokens, room))  # no drafts at hand: the guess
        block = np.stack([widened(r.state["block"], width) for r in rows])
        for i, proposal in enumerate(proposals):
            block[i, 1: 1 + len(proposal)] = proposal
        return self._verify_and_draft(rows, view, block)


class _DecodeCalls:
    """The target verifying n-gram proposals (``ngram``), or one token per call (``none``), on the
    engine's decode graph: the server's own baselines."""

    def __init__(self, sched: Scheduler, ngram: bool) -> None:
        self.sched = sched
        self.lookup = PromptLookupConfig(num_tokens=sched.cfg.num_proposals) if ngram else None
        self.min_tokens = min_call_tokens(sched.generator.manifest)
        self.width = min(sched.cfg.block_size, sched.limits.max_chunk)

    def prefill(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        for row in rows:
            if not row.draws:
                row.draw(("uniforms", (1, 1)))
        session = EngineSession(self.sched.generator, [r.tokens for r in rows], cache=view)
        session.cache_len = [r.cache_len for r in rows]
        tokens = session.prefill_target(_temperatures(rows), lambda: _stacked(rows, ("uniforms",))["uniforms"])
        results = []
        for i, row in enumerate(rows):
            state = {"ngram": NgramIndex(self.lookup)} if self.lookup else {}
            results.append(_Result([int(tokens[i])], len(row.tokens), state))
            row.draws = {}
        return results

    def step(self, rows: list[_Row], view: KVCache) -> list[_Result]:
        proposals = [r.state["ngram"].propose(r.tokens, self.width - 1) if self.lookup else [] for r in rows]
        return self.verify(rows, view, proposals)

    def verify(self, rows: list[_Row], view: KVCache, proposals: list[list[int]]) -> list[_Result]:
        """The target alone on [last token, proposal] per row: the proposal's agreeing prefix and its next
        token. Greedy rows with a lookup and no proposal take its guess in the slots the call computes
        anyway (``fill_padding``)."""
        proposals = fill_padding(proposals, self.min_tokens, lambda i, room: rows[i].state["ngram"].guess(
            rows[i].tokens, room) if "ngram" in rows[i].state and not rows[i].sampling else [])
        fed = [[r.tokens[-1], *p] for r, p in zip(rows, proposals, strict=True)]
        for row, f in zip(rows, fed, strict=True):
            if not row.draws:
                row.draw(("uniforms", (1, len(f))))
        ids = padded_ids(fed, self.min_tokens)  # the kernels a verify uses (runtime.engine.MIN_CALL_TOKENS)
        past_len = np.array([len(r.tokens) - 1 for r in rows], np.int64)
        view.reserve(int(past_len.max()) + ids.shape[1], view.capacity)
        def uniforms() -> np.ndarray:  # each row's draws for its fed tokens' next, zeros at the padding
            wide = np.zeros(ids.shape, np.float32)
            for i, (row, f) in enumerate(zip(rows, fed, strict=True)):
                wide[i, : len(f)] = row.draws["uniforms"][0]
            return wide

        graph, sampling = decode_inputs(_temperatures(rows), uniforms)
        feeds = {"input_ids": ids, "past_len": past_len, "output_index": every_output(ids)}
        out = self.sched.counter.infer(graph, feeds | sampling, view)
        out = _outputs(out)
        view.store(out, past_len.tolist(), [len(f) for f in fed])
        results = []
        for i, (row, want) in enumerate(zip(rows, proposals, strict=True)):
            got = out["next_tokens"][i].tolist()
            n = 0
            while n < len(want) and got[n] == want[n]:
                n += 1
            results.append(_Result([*want[:n], got[n]], int(past_len[i]) + n + 1, drafts=len(want), accepted=n))
            row.draws = {}
        return results


class _CountingRunner:
    """The engine's runner, reporting each call's graph (the server's engine_calls metric)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.fail_next = False  # tests only: see Scheduler._guarded
        self.on_call: Callable[[str], None] = lambda graph: None

    def infer(self, graph: str, feeds: dict[str, Any], cache: KVCache) -> dict[str, Any]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError(f"injected test fault ({FAULT_PROMPT_ENV})")
        out = self.runner.infer(graph, feeds, cache)
        self.on_call(graph)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def _outputs(out: dict[str, Any]) -> dict[str, Any]:
    """A call's outputs on the host (TensorRT returns device tensors), but for the new KV entries,
    which go into the cache where the backend keeps it."""
    return {name: value if name in ("new_key", "new_value") else _host(value) for name, value in out.items()}


def _cache_dtype(runner: Any) -> torch.dtype:
    return runner.new_cache(1).k.dtype


def _temperatures(rows: Sequence[_Row]) -> np.ndarray:
    return np.array([r.params.temperature for r in rows], np.float32)


def _stacked(rows: Sequence[_Row], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Each row's draws of these names, concatenated along the batch (each was drawn with batch 1)."""
    return {name: np.concatenate([r.draws[name] for r in rows]) for name in names}


def _host(value: Any) -> np.ndarray | None:
    """An output that may be a backend value (ONNX Runtime's OrtValue, a torch tensor) as a numpy array."""
    if value is None:
        return None
    if hasattr(value, "cpu"):  # torch
        value = value.cpu()
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)
