"""The engine generator: speculative decoding where each step is ONE engine call.

``EngineGenerator`` drives an engine directory's graphs through a runner (ONNX Runtime now,
TensorRT later) with the same API and behaviour as the reference ``SpeculativeGenerator``:
``session(prompts)`` -> ``extend`` / ``generate`` / ``stream`` / ``generate_target_only``.
Per step the host binds the previous call's outputs as inputs (block, group prefix, draft
logits), stores the accepted KV entries, and emits the accepted tokens; everything else
(verify, accept, pivot gather, draft) happens inside the step graph.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.engine.manifest import Manifest
from dlite_trt.errors import EngineError
from dlite_trt.export.contract import SAMPLING_SUFFIX, cache_capacity_max
from dlite_trt.export.nbits_levels import FP32_COMPUTE
from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.runtime.sampling import is_greedy
from dlite_trt.runtime.session import GeneratorBase, SamplingParams, SessionBase, StepEvent
from dlite_trt.runtime.stats import StageTimer

log = logging.getLogger(__name__)


# Every engine call feeds at least this many tokens per sequence (a decode call's one token gets
# a dummy after it, whose output and KV entry are dropped). ONNX Runtime's MLAS computes a
# 1-row product on other kernels than a 2-or-more-row one (fp32 MatMul of two activations, as in
# attention: SgemmKernelM1Routine; MatMulNBits on AVX2: SQ4BitGemmM1Kernel_CompInt8), which round
# differently, while rows of any 2-or-more-row product are bitwise those of any other: so a
# target-only decode call computes its position on the kernels a speculative step's verify uses.
# Measured (one SmolLM2-shaped [M, 576] x [576, 12288] product, 1 thread, medians of 30): fp32
# MatMul 2.87 ms at M = 1, 1.61 at M = 2; MatMulNBits level 4: 0.55 and 0.55. Not at int4
# accuracy level 0 (``min_call_tokens``): there the 1-row product is a fused dequantizing kernel
# and 2 rows dequantize the whole matrix first, 0.98 ms against 4.67.
MIN_CALL_TOKENS = 2

# A greedy step whose block holds no drafts made from its anchor (the step after a call without
# the draft: n-gram proposals verified on the decode graph, or plain decoding where speculation did
# not pay) emits the target's token alone whatever it verifies, so it verifies the narrowest block
# the step graph takes ([anchor, d_1]; the contract's ``verify`` starts at 2): the call is there to
# draft. SmolLM2 fp32 on 2 cores, after 256 cached tokens: 24.8 ms at k = 1 against 26.2 at k = 3.
UNDRAFTED_WIDTH = 2


def min_call_tokens(manifest: Manifest) -> int:
    """``MIN_CALL_TOKENS``, but 1 on an int4 engine at accuracy level 0 (see above)."""
    weights = manifest.weights
    fused = weights.format == "int4" and weights.accuracy_level == FP32_COMPUTE
    return 1 if fused else min(MIN_CALL_TOKENS, manifest.limits.max_chunk)


def padded_ids(rows: Sequence[Sequence[int]], minimum: int = MIN_CALL_TOKENS) -> np.ndarray:
    """[B, T] int64 right-padded with 0, T at least ``minimum``."""
    ids = np.zeros((len(rows), max(minimum, *map(len, rows))), np.int64)
    for row, toks in enumerate(rows):
        ids[row, : len(toks)] = toks
    return ids


def every_output(ids: np.ndarray) -> np.ndarray:
    """A decode call's output_index [B, T] for every position of ``ids`` [B, T], the padding's too (its
    outputs are dropped): the LM head then runs on as many rows as the call has, the rows a verify's
    head runs on, not a 1-row product."""
    b, t = ids.shape
    return np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))


def decode_inputs(temperature: np.ndarray, uniforms: Callable[[], np.ndarray]) -> tuple[str, dict[str, np.ndarray]]:
    """The decode graph for rows of these temperatures [B] and its sampling inputs: ``decode``
    (greedy, an argmax) and none when every row is greedy, else ``decode_sampling`` with the
    temperatures and ``uniforms()`` [B, T] (drawn only then; greedy rows take the argmax)."""
    if all(is_greedy(float(t)) for t in temperature):
        return "decode", {}
    return "decode" + SAMPLING_SUFFIX, {"temperature": temperature, "uniforms": uniforms()}


@dataclass(frozen=True)
class _Chunk:
    ids: np.ndarray  # [B, T] int64, right-padded
    chunk_len: np.ndarray  # [B] valid tokens (1 for rows with nothing in this call)
    past_len: np.ndarray  # [B] position of ids[:, 0]
    count: list[int]  # [B] entries to store (0 for rows with nothing in this call)


class EngineGenerator(GeneratorBase):
    def __init__(self, runner: Any, manifest: Manifest, verify_drafts: int | None = None,
                 widths: Any = None) -> None:
        """``verify_drafts``: how many of the draft's K proposals a greedy step verifies (None: all K);
        ``widths``: the engine's calibrated ``verify_width.WidthChoice`` when ``verify_drafts`` came
        from it (the server's scheduler then verifies the width of each batch size)."""
        self.runner = runner
        self.widths = widths
        self.manifest = manifest
        self.cfg = manifest.draft_config
        self.spec = manifest.target_spec
        self.verify_drafts = self.check_verify_drafts(self.cfg.num_proposals if verify_drafts is None
                                                      else verify_drafts)

    def check_verify_drafts(self, k: int) -> int:
        """``k`` if a greedy step of this engine can verify k drafts, else a clear error."""
        most = self.cfg.num_proposals
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= most:
            raise EngineError(f"the verify width (--verify-drafts) must be an integer in 1..{most} (the draft proposes "
                              f"{most} tokens a step), got {k!r}.")
        return k

    def greedy_drafts(self, batch: int, *, drafting: bool = True, context: int | None = None) -> int:
        """Drafts a greedy step of ``batch`` sequences verifies: the engine's calibrated width for that
        batch size (and at batch 1 for that ``context``, the longest row's cached tokens; ``drafting``:
        at least 1, the step drafts; else 0 where plain decoding pays more), or ``verify_drafts``
        where that was given."""
        if self.widths is None:
            return self.verify_drafts
        return self.widths.drafts_for(batch, drafting=drafting, context=context)

    def runs_step_graph(self, batch: int, context: int, misses: Any, *, hit: bool, drafted: bool) -> bool:
        """Whether a greedy DLite + n-gram step runs the step graph (verifying the block and drafting
        for the next step) rather than the decode graph without the draft. ``hit``: every row's lookup
        proposes now; ``drafted``: some row holds drafts made from its anchor. A miss with drafts at
        hand verifies them (always); otherwise it runs only where drafting for the next step pays
        (``WidthChoice.drafting_pays`` at ``batch`` rows, the longest with ``context`` cached tokens,
        from the lookup's ``misses`` (``MissRuns``) after a hit or after a miss; at a miss it emits the
        target's token alone, ``UNDRAFTED_WIDTH``). Without a calibrated table: at a miss only."""
        if drafted and not hit:
            return True
        if self.widths is None:
            return not hit
        return self.widths.drafting_pays(batch, context, UNDRAFTED_WIDTH - 1, misses.rate(after_miss=not hit), hit=hit,
                                         p_guess=misses.guess_rate())

    def drafts_at_prefill(self, batch: int, context: int, misses: Any) -> bool:
        """Whether a greedy DLite + n-gram prefill of ``batch`` rows (the longest ``context`` tokens
        after it) runs the prefill graph, drafting the first block, rather than target-only's prefill
        (``prefill_target``, as n-gram lookup alone prefills). The drafts pay only where the first
        step's lookup misses, so it is decided as drafting at a step where every row's lookup
        proposes (``runs_step_graph`` with ``hit``). Always where the prefill graph computes the prompt
        otherwise (``Manifest.prefill_differs``): target-only's prefill runs it too."""
        return self.manifest.prefill_differs or self.runs_step_graph(batch, context, misses, hit=True, drafted=False)

    def leads_on_decode(self, lookup: bool) -> bool:
        """Whether a prefill runs the prompt's chunks before the last on the decode graph
        (``EngineSession._prefill``'s ``lead``), without the draft the prefill graph runs at every
        chunk, of which only the last chunk's drafts serve: where that graph runs anyway (n-gram
        ``lookup``) or is loaded already (the server's, the bench's). It is not loaded for this alone:
        each ONNX Runtime session holds its own copy of the weights."""
        return lookup or self.runner.loaded("decode")

    def session(self, prompts: Sequence[Sequence[int]]) -> EngineSession:
        return EngineSession(self, prompts)


class EngineSession(SessionBase):
    """A live batch on an engine; it owns its KV cache (and the runner's bindings to it), so sessions
    on one engine can interleave, and run on different threads (one thread per session at a time)."""

    def __init__(self, gen: EngineGenerator, prompts: Sequence[Sequence[int]], cache: KVCache | None = None) -> None:
        """``cache``: run on these rows of a cache someone else owns and has reserved room in
        (``KVCache.rows``; a scheduler's batch), instead of a cache of its own."""
        super().__init__(prompts, gen.spec.vocab_size)
        limits = gen.manifest.limits
        if self.batch_size > limits.max_batch:
            raise EngineError(f"{self.batch_size} sequences in one batch, but the engine was built with "
                              f"--max-batch {limits.max_batch}; split the batch or rebuild with a larger --max-batch.")
        self.gen = gen
        self.runner = gen.runner
        if cache is not None and cache.batch != self.batch_size:
            raise EngineError(f"a cache of {cache.batch} rows for {self.batch_size} sequences")
        self.cache = self.runner.new_cache(self.batch_size) if cache is None else cache
        self.k = gen.cfg.num_proposals
        self.g = gen.cfg.anchor_group_size
        self.min_tokens = min_call_tokens(gen.manifest)
        self.skipped_drafts = 0  # steps (per row) that verified n-gram proposals without running the draft

    def _check_length(self, longest: int) -> None:
        limit = self.gen.manifest.limits.max_seq_len
        if longest > limit:
            raise EngineError(f"a sequence would reach {longest} tokens (prompt + max_new_tokens), past the engine's "
                              f"--max-seq-len {limit}; shorten the prompt, lower max_new_tokens, or rebuild the engine "
                              "with a larger --max-seq-len.")

    # -- helpers -------------------------------------------------------------------------------
    def _chunks(self) -> Iterator[_Chunk]:
        """The uncached suffixes in calls of at most max_chunk tokens, aligned so every row ends in the last call."""
        size = self.gen.manifest.limits.max_chunk
        suffixes = [t[c:] for t, c in zip(self.tokens, self.cache_len, strict=True)]
        calls = math.ceil(max(map(len, suffixes)) / size)
        for j in range(calls):
            pieces, starts = [], []
            for s in suffixes:
                end = len(s) - (calls - 1 - j) * size
                start = max(0, end - size)
                pieces.append(s[start:end] if end > 0 else [])
                starts.append(start)
            yield _Chunk(padded_ids(pieces, self.min_tokens), np.array([max(1, len(p)) for p in pieces], np.int64),
                         np.array([c + st for c, st in zip(self.cache_len, starts, strict=True)], np.int64),
                         [len(p) for p in pieces])

    def _group_prefix(self, anchored: bool = False) -> np.ndarray:
        """[B, G-1]: the G-1 tokens of each sequence before the anchor, left-padded with 0: its last
        G-1 (at the prefill, which makes the anchor), or those before its last (``anchored``: the
        sequence ends with its anchor)."""
        prefix = np.zeros((self.batch_size, self.g - 1), np.int64)
        for row, toks in enumerate(self.tokens):
            end = len(toks) - anchored
            tail = toks[max(end - (self.g - 1), 0): end]
            prefix[row, self.g - 1 - len(tail):] = tail
        return prefix

    def _infer(self, graph: str, feeds: dict[str, Any]) -> dict[str, Any]:
        """One engine call, the cache first grown to hold this call's tokens. A call attends over
        the whole cache, so it is sized by what the sequences hold (``KVCache.reserve``), never by
        what max_new_tokens would let them reach."""
        ids = feeds["block"] if "block" in feeds else feeds["input_ids"]  # [B, T]
        limit = cache_capacity_max(self.gen.manifest.limits, self.gen.cfg.block_size)
        longest = int(feeds["past_len"].max())
        if longest + ids.shape[1] > limit:  # rows of a batch share the call's width T, padding included
            raise EngineError(f"a {graph} call of {ids.shape[1]} tokens on a sequence of {longest} cached tokens needs "
                              f"{longest + ids.shape[1]} KV slots, past the engine's {limit}: batch prompts of "
                              "similar length together, or rebuild the engine with a larger --max-seq-len.")
        self.cache.reserve(longest + ids.shape[1], limit)
        return self.runner.infer(graph, feeds, self.cache)

    def _call(self, graph: str, feeds: dict[str, Any], start: list[int], count: list[int]) -> dict[str, Any]:
        """One engine call; then store the first count[b] new KV entries of row b at start[b]."""
        out = self._infer(graph, feeds)
        self._store(out, start, count)
        return out

    def _store(self, out: dict[str, Any], start: list[int], count: list[int]) -> None:
        self.cache.store(out, start, count)

    def _prefill(self, graph: str, feeds: dict[str, Any], *, lead: bool = False) -> dict[str, Any]:
        """The uncached suffixes through ``graph`` with ``feeds``, chunk by chunk; returns the last
        chunk's outputs. ``lead``: every chunk but the last runs the greedy decode graph, which
        computes the same target without the draft a prefill graph runs at each chunk (only the last
        chunk's drafts serve); where the engine's prefill graph computes the prompt otherwise
        (``Manifest.prefill_differs``) every chunk stays on ``graph``."""
        out = {}
        chunks = list(self._chunks())
        lead = lead and not self.gen.manifest.prefill_differs
        for j, chunk in enumerate(chunks):
            name = "decode" if lead and j < len(chunks) - 1 else graph
            call = {"input_ids": chunk.ids, "past_len": chunk.past_len, **(feeds if name == graph else {})}
            if not name.startswith("decode"):  # prefill, prefill_sampling
                call["chunk_len"] = chunk.chunk_len
            else:
                call["output_index"] = (chunk.chunk_len - 1)[:, None]
            out = self._call(name, call, chunk.past_len.tolist(), chunk.count)
        self.cache_len = [len(t) for t in self.tokens]
        return out

    # -- decoding --------------------------------------------------------------------------------
    def stream(self, params: SamplingParams, timer: StageTimer | None = None,
               lookup: Any = None) -> Iterator[StepEvent]:
        """Yield the tokens each engine call emits, per sequence, until every sequence stops.

        ``lookup`` (greedy only; a ``PromptLookupDrafter``): where n-gram prompt lookup finds a match,
        its proposal replaces the draft's in the block the step verifies (``_looked_up``). The draft's
        drafts are needed only at a later miss, so a step runs the draft only where that pays
        (``EngineGenerator.runs_step_graph``, from how often the lookup has missed right after a hit and
        right after a miss, ``MissRuns``, and the engine's calibrated costs): when every running
        sequence has a match and drafting for the next step does not pay, the step verifies the
        proposals through the ``decode`` graph (as n-gram lookup alone does) and skips the draft
        (counted in ``skipped_drafts``); the next ``step`` call then holds no drafts made from its
        anchors, so it verifies the narrowest block (``UNDRAFTED_WIDTH``, wider only for a proposal;
        a row without a proposal verifies the lookup's 1-gram guess there, ``_guessed``), keeps the
        target's token (and the guess where right) and drafts again, which at a miss runs only when
        the misses expected to follow gain more than the call costs over a decode call, else the step
        decodes one token as n-gram lookup alone does. The prefill drafts the first block only where
        that pays as at a hit (``EngineGenerator.drafts_at_prefill``), else it prefills as n-gram
        lookup does, without the draft. Verification does not care where drafts came from, so the output
        stays the target's greedy output.

        Greedy runs use the ``prefill``/``step`` graphs; sampling runs the ``*_sampling`` ones,
        with uniforms drawn in the reference's order (anchor, then per step: accept tests,
        resample, next draft), so a seed gives the reference's tokens.
        """
        timer = timer or StageTimer()
        b, k = self.batch_size, self.k
        sampling = not is_greedy(params.temperature)
        if lookup is not None and sampling:
            raise EngineError("DLite with n-gram lookup decodes greedily; use temperature 0, or drop the lookup.")
        draw = self._start(params)
        if params.max_new_tokens == 0:
            return
        if lookup is not None:
            with timer.time("draft_context"):
                lookup.sync(self.tokens)
        suffix = SAMPLING_SUFFIX if sampling else ""
        temperature = np.full(b, params.temperature, np.float32)

        def random_feeds(*names_shapes: tuple[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
            if not sampling:
                return {}
            return {"temperature": temperature} | {name: _host(draw, *shape) for name, shape in names_shapes}

        prefix = {"group_prefix": self._group_prefix()} if self.g > 1 else {}
        # ``block`` holds drafts made from its anchors (not so after a call without the draft)
        drafted = lookup is None or self.gen.drafts_at_prefill(b, max(map(len, self.tokens)), lookup.misses)
        carried = {}
        with timer.time("prefill"):
            if drafted:
                out = self._prefill("prefill" + suffix, prefix | random_feeds(("u_anchor", (b,)), ("u_draft", (b, k))),
                                    lead=self.gen.leads_on_decode(lookup is not None))
                block = out["next_block"]
                carried = {"draft_logits": out["next_draft_logits"]} if sampling else {}
            else:  # the anchors alone, as n-gram lookup prefills
                block = np.array([[t] + [0] * k for t in self._target_first(params, draw)], np.int64)
        yield StepEvent(tuple(self._emit(row, [int(block[row, 0])], params) for row in range(b)), None)
        if not drafted and self.g > 1:
            prefix = {"group_prefix": self._group_prefix(anchored=True)}
        engine_before = self.cache.engine_seconds
        while any(self._active):
            most = min(self.k, self.max_verify_tokens() - 1)  # a skip step verifies on the decode graph
            proposals = None if lookup is None else self._proposals(lookup, most)
            guesses = None if lookup is None else [lookup.guess(row, t, 1) if a and not p else None for row, (t, p, a)
                                                   in enumerate(zip(self.tokens, proposals, self._active, strict=True))]
            if proposals is not None and not self.gen.runs_step_graph(
                    self.batch_size, max(self.cache_len), lookup.misses, drafted=drafted,
                    hit=all(p for p, a in zip(proposals, self._active, strict=True) if a)):
                with timer.time("verify"):  # every running row has a proposal, or a miss with no drafts at
                    # hand (those rows decode one token, a guess beside it), and drafting for the next step would not pay
                    event = self._verify_proposals(self._guessed(proposals, lookup), params, draw)
                block = np.array([[t[-1]] + [0] * k for t in self.tokens], np.int64)  # the anchors; no drafts
                if self.g > 1:
                    prefix = {"group_prefix": self._group_prefix(anchored=True)}
                drafted = False
                lookup.misses.record_guesses(guesses, event.new_tokens)
                yield event
                continue
            with timer.time("step"):
                past_len = np.array(self.cache_len, np.int64)  # = anchor position of every active row
                if sampling:
                    width = k + 1
                elif drafted:  # a greedy step verifies d_1..d_k, k calibrated for this batch and context
                    width = self.gen.greedy_drafts(b, context=int(past_len.max())) + 1
                else:
                    width = UNDRAFTED_WIDTH
                    if proposals is not None:  # no drafts at hand: rows without a proposal verify the lookup's guess
                        proposals = self._guessed(proposals, lookup, width)
                block = np.ascontiguousarray(block[:, :width]) if proposals is None else \
                    self._looked_up(block, width, proposals)
                feeds = {"block": block, "past_len": past_len, **prefix, **carried,
                         **random_feeds(("u_accept", (b, k)), ("u_resample", (b,)), ("u_draft", (b, k)))}
                if not sampling:  # draft what the next step verifies (it verifies no more than that)
                    feeds["next_width"] = next_width(b, self.gen.greedy_drafts(b, context=int(past_len.max()) + width))
                out = self._infer("step" + suffix, feeds)
                n = out["accepted"].tolist()
                self._store(out, past_len.tolist(), [n[r] + 1 if a else 0 for r, a in enumerate(self._active)])
                emitted = out["emitted"]
                event = self._finish_step(block[:, 1:].tolist(), n,
                                          lambda row, n_row, e=emitted: e[row, : n_row + 1].tolist(), past_len, params)
                block, drafted = out["next_block"], True
                if self.g > 1:
                    prefix = {"group_prefix": out["next_group_prefix"]}
                if sampling:
                    carried = {"draft_logits": out["next_draft_logits"]}
            if lookup is not None:
                lookup.misses.record_guesses(guesses, event.new_tokens)
            yield event
        timer.seconds["engine"] += self.cache.engine_seconds - engine_before

    def _proposals(self, lookup: Any, most: int) -> list[list[int]]:
        """Every running row's n-gram proposal (recorded in ``lookup.misses``), [] for finished rows."""
        proposals = []
        for row, active in enumerate(self._active):
            proposals.append(lookup.propose(row, self.tokens[row], most) if active else [])
            if active:
                lookup.record(row, proposals[-1])
        return proposals

    def _looked_up(self, block: np.ndarray, width: int, proposals: list[list[int]]) -> np.ndarray:
        """[anchor, drafts]: per active row the n-gram proposal after its tokens (which end with the
        anchor: it was emitted by the previous call) where there is one, else the draft's first
        width-1 drafts; the block widens to the longest proposal (at most K), rows with shorter
        ones keep the draft's drafts after theirs."""
        out = widened(block, max(width, 1 + max(map(len, proposals))))
        for row, proposal in enumerate(proposals):
            out[row, 1 : 1 + len(proposal)] = proposal
        return out

    def _verify_proposals(self, proposals: list[list[int]], params: SamplingParams, uniforms) -> StepEvent:
        self.skipped_drafts += sum(self._active)  # a step of n-gram proposals: the draft does not run
        return super()._verify_proposals(proposals, params, uniforms)

    def _target_first(self, params: SamplingParams, uniforms) -> list[int]:
        return self.prefill_target(self._temperature(params), lambda: _host(uniforms, self.batch_size, 1))

    def prefill_target(self, temperature: np.ndarray, uniforms: Callable[[], np.ndarray]) -> list[int]:
        """The target over the uncached suffixes, without the draft's block: the next token per row,
        sampled with ``uniforms()`` [B, 1] where a row's temperature is above 0. On the decode graph, or on
        the prefill graph (its drafted block unused) where that graph computes the prompt otherwise
        (``Manifest.prefill_differs``: an int8 prefill), so that a prompt's KV entries and first token
        are the same whatever decodes it (target-only, n-gram lookup, DLite)."""
        graph, feeds = decode_inputs(temperature, uniforms)
        if not self.gen.manifest.prefill_differs:
            return self._prefill(graph, feeds)["next_tokens"][:, 0].tolist()
        sampling = graph != "decode"
        prefill = {"group_prefix": self._group_prefix()} if self.g > 1 else {}
        if sampling:  # the anchor is sampled as the decode graph samples, from the same uniform
            prefill |= {"temperature": feeds["temperature"], "u_anchor": feeds["uniforms"][:, 0],
                        "u_draft": np.zeros((self.batch_size, self.gen.cfg.num_proposals), np.float32)}
        return self._prefill("prefill" + SAMPLING_SUFFIX * sampling, prefill)["next_block"][:, 0].tolist()

    def _target_next(self, tokens: list[int], pos: list[int], params: SamplingParams, uniforms) -> list[int]:
        return [row[0] for row in self._decode([[t] for t in tokens], pos, [int(a) for a in self._active],
                                               params, uniforms)]

    def _target_verify(self, fed: list[list[int]], pos: list[int], params: SamplingParams,
                       uniforms) -> list[list[int]]:
        return self._decode(fed, pos, self._padded(fed)[1], params, uniforms)

    def _decode(self, fed: list[list[int]], pos: list[int], count: list[int], params: SamplingParams,
                uniforms) -> list[list[int]]:
        """One decode call of fed[b] at positions pos[b].. (storing count[b] entries): the target's
        token after each fed token."""
        ids = padded_ids(fed, self.min_tokens)

        def padded() -> np.ndarray:  # one per fed token's next, zeros at the padding
            wide = np.zeros(ids.shape, np.float32)
            wide[:, : max(map(len, fed))] = _host(uniforms, len(fed), max(map(len, fed)))
            return wide

        graph, sampling = decode_inputs(self._temperature(params), padded)
        feeds = {"input_ids": ids, "past_len": np.array(pos, np.int64), "output_index": every_output(ids)}
        out = self._call(graph, feeds | sampling, pos, count)
        return [out["next_tokens"][row, : len(toks)].tolist() for row, toks in enumerate(fed)]

    def _temperature(self, params: SamplingParams) -> np.ndarray:
        return np.full(self.batch_size, params.temperature, np.float32)

    def max_verify_tokens(self) -> int:
        # the KV capacity reserved past the longest sequence, and at most one decode chunk
        return min(self.gen.cfg.block_size, self.gen.manifest.limits.max_chunk)


def widened(block: np.ndarray, width: int) -> np.ndarray:
    """The first ``width`` entries of the last axis of ``block`` ([..., D + 1]: [anchor, drafts]), a new
    array, zeros past D where the step drafted fewer (verified as any draft: kept only where they are
    the target's own tokens)."""
    out = np.zeros((*block.shape[:-1], width), np.int64)
    out[..., : min(width, block.shape[-1])] = block[..., :width]
    return out


def next_width(batch: int, drafts: int) -> np.ndarray:
    """The greedy step's ``next_width`` input: [B, D + 1], only its width counts: the step drafts D, as
    many as the next step verifies. Each draft is a sequential step of the draft's head, so a step
    that drafted the block's K where the next verifies fewer paid for the rest (SmolLM2 fp32 on 2
    cores: 4% of a decode call at 4 verified drafts of 7)."""
    return np.zeros((batch, drafts + 1), np.int64)


def _host(uniforms, *shape: int) -> np.ndarray:
    """Uniforms as a float32 array (zeros when the run is greedy: ``uniforms`` then draws nothing)."""
    u = uniforms(*shape)
    return np.zeros(shape, np.float32) if u is None else u.numpy()


def open_engine(engine_dir: Path, *, threads: int | None = None, verify: bool = False,
                preload: tuple[str, ...] = ("prefill", "step"), cuda_graphs: bool = True,
                verify_drafts: int | str | None = "auto") -> EngineGenerator:
    """Load and check an engine directory; returns a ready generator. ``preload`` graphs are
    loaded now (each ONNX Runtime session holds its own prepacked weights); the others on first use.
    ``cuda_graphs``: a TensorRT engine replays its step as a CUDA graph (no effect on ONNX Runtime).
    ``verify_drafts``: drafts a greedy step verifies; "auto" takes the engine's calibrated choice
    (``verify_width.json``, written by build and ``dlite-trt calibrate``), all K without one; None: all K."""
    from dlite_trt.engine.manifest import load_manifest
    from dlite_trt.runtime import verify_width
    from dlite_trt.runtime.ort_runner import OrtRunner

    manifest = load_manifest(Path(engine_dir), verify=verify)
    choice = None
    if verify_drafts == "auto":
        choice = verify_width.load(Path(engine_dir), manifest.draft_config.num_proposals)
        verify_drafts = manifest.draft_config.num_proposals if choice is None else choice.drafts
        elsewhere = None if choice is None else choice.measured_elsewhere()
        if elsewhere:
            log.warning("%s: verify widths %s; they may not pay here. Run `dlite-trt calibrate --engine %s` on this "
                        "machine.", engine_dir, elsewhere, engine_dir)
    if manifest.backend == "tensorrt":
        from dlite_trt.runtime.trt_runner import TrtRunner

        runner = TrtRunner(Path(engine_dir), manifest, cuda_graphs=cuda_graphs)
    else:
        runner = OrtRunner(Path(engine_dir), manifest, threads=threads)
    return EngineGenerator(runner.activate(preload), manifest, verify_drafts, choice)
