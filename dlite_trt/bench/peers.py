"""Peer methods: other libraries decoding the same target, run by `dlite-trt bench` beside ours.

Each peer is the library's own greedy generation (and its own prompt lookup / n-gram drafting) on
the weights the engine's target came from, driven the way a user of that library drives it, and
streamed as the library produces tokens, so TTFT and TPOT are real:

- ``hf``, ``hf-lookup``: transformers ``generate(do_sample=False)``, and with
  ``prompt_lookup_num_tokens`` (its prompt lookup decoding), on the Hugging Face directory of the
  target, in the engine's dtype, on ``--threads`` torch threads.
- ``ort-genai*``: onnxruntime-genai on models its model builder makes from that directory (fp32 or
  int4, CPU), built once into the cache (``ort_genai_model``); ``-ngram``: its n-gram speculative
  decoding (``speculative.ngram_size``, ``max_draft_tokens``).
- ``llama-cpp*``: llama-cpp-python on the GGUF file itself (greedy: top_k=1, temperature 0;
  lookup: ``LlamaPromptLookupDecoding`` as its draft model). Only for a target given as a GGUF file.

Drafting peers use our ``ngram`` settings (--ngram-max, K proposals per step) where the library
takes them. Peers decode one sequence at a time (the batch sweep leaves them out). A new turn:
``hf``, ``ort-genai*`` and ``llama-cpp*`` keep their KV cache and process only the appended tokens
(transformers' ``cache``, onnxruntime-genai's ``append_tokens``, llama.cpp's prefix reuse);
``hf-lookup`` runs ``generate`` over the whole context again, because transformers' prompt lookup
does not continue a passed cache correctly (see ``_HF_LOOKUP_REUSES_CACHE``). Generations ignore
end-of-sequence tokens, as ours do: an EOS is emitted and decoding goes on.

Each peer method runs in a worker process of its own (bench/peer_process.py), started by its first
session: the library, its model and each session's KV cache live there, and only token ids, step
events and timings cross the pipe. A peer whose worker dies (a crash in the library's native code, a
kill) or whose library raises is reported once, with what to do (``crash_hint``), and the bench goes on
without it: its later requests are empty (``PeerMethod.failure``). The runs below run in the worker;
``PeerMethod`` and ``_WorkerRun`` are the bench's side.

The optional libraries are imported inside the functions that use them; a peer whose library is
missing is skipped with the command that installs it (``peer_unavailable``).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dlite_trt.bench.live import Run, default_threads
from dlite_trt.bench.names import METHOD_TITLES, PEER_NAMES
from dlite_trt.bench.peer_process import PeerFailed, PeerWorker, serve
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.prompt_lookup import PromptLookupConfig
from dlite_trt.runtime.session import SamplingParams, StepEvent
from dlite_trt.runtime.stats import StageTimer, StepRecord

Log = Callable[[str], None]
Chunk = tuple[list[int], StepRecord | None]  # tokens one library step produced, and its drafts if known

ORT_GENAI_BUILD_RECORD = "dlite_trt_build.json"
# transformers 5.24's assisted generation (prompt lookup) given a filled cache returns a wrong first
# token (checked against plain greedy decoding), so hf-lookup re-runs the whole context each turn
_HF_LOOKUP_REUSES_CACHE = False


@dataclass(frozen=True)
class Peer:
    """One peer method: the library, how it is installed, its weights and whether it drafts."""

    name: str
    library: str  # "transformers" | "onnxruntime-genai" | "llama-cpp-python"
    modules: tuple[str, ...]  # what must be importable: the library and what it imports that pip may have left out
    install: str  # the command that installs it
    weights: str  # "engine": the target in the engine's dtype; "fp32"/"int4": built by the library; "gguf"
    lookup: bool  # the library's own prompt lookup / n-gram drafting


_HF = ("transformers", ("transformers",), "pip install transformers")
_ORT = ("onnxruntime-genai", ("onnxruntime_genai", "onnx_ir"),  # onnx-ir: its model builder's
        "pip install 'dlite-trt[peers]' (onnxruntime-genai and onnx-ir)")
_LLAMA = ("llama-cpp-python", ("llama_cpp", "diskcache", "jinja2"),
          "pip install llama-cpp-python (compiles llama.cpp: minutes; with --no-deps, also diskcache and jinja2)")
PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("hf", *_HF, "engine", False),
    Peer("hf-lookup", *_HF, "engine", True),
    Peer("ort-genai", *_ORT, "fp32", False),
    Peer("ort-genai-ngram", *_ORT, "fp32", True),
    Peer("ort-genai-int4", *_ORT, "int4", False),
    Peer("ort-genai-int4-ngram", *_ORT, "int4", True),
    Peer("llama-cpp", *_LLAMA, "gguf", False),
    Peer("llama-cpp-lookup", *_LLAMA, "gguf", True),
)}
assert tuple(PEERS) == PEER_NAMES, "names.PEER_NAMES and PEERS list the same peers"
# how a library is known to crash, and the fix (the start of what a failed peer's message says to do)
KNOWN_CRASHES = {
    "llama-cpp-python": "llama-cpp-python built from source with ggml's AMX backend segfaults on its first generate "
                        "on CPUs with AMX (Intel Sapphire Rapids and later): rebuild it with AMX off (the command is "
                        "in docs/bench.md, Peers). ",
}


@dataclass(frozen=True)
class PeerSource:
    """What the peers run: the files the engine's target came from, and the engine's settings."""

    hf_dir: Path  # the Hugging Face directory (for a GGUF target: its conversion, see gguf_import)
    gguf: Path | None  # the GGUF file, where the target is one
    sha256: str  # the target weights' digest, as the engine's manifest records it
    dtype: str  # the engine's dtype
    engine_weights: str  # how the engine stores its weights: "float" (in ``dtype``) or "int4"
    max_seq_len: int  # the engine's: every session fits it (bench.run.prepare checks)
    threads: int | None  # intra-op threads (None: each library's default)
    lookup: PromptLookupConfig


def peer_source(manifest: Any, *, threads: int | None, lookup: PromptLookupConfig) -> PeerSource:
    """The target files of an engine (``engine.manifest.Manifest``), checked against its digest."""
    from dlite_trt.engine.manifest import checkpoint_sha256
    from dlite_trt.targets import resolve_target

    source = resolve_target(manifest.target_name, progress=False)
    if source.is_random:
        raise DLiteError(f"the engine's target {manifest.target_name} has random weights; peers need model files. "
                         "Build the engine from a model directory or a .gguf file.")
    if checkpoint_sha256(source.path) != manifest.target_sha256:
        raise DLiteError(f"{source.path} (the engine's target {manifest.target_name}) no longer holds the weights the "
                         "engine was built from; peers would run other weights. Rebuild the engine.")
    return PeerSource(source.path, target_gguf(manifest.target_name), manifest.target_sha256, manifest.dtype,
                      getattr(getattr(manifest, "weights", None), "format", "float"), manifest.limits.max_seq_len,
                      threads, lookup)


def target_gguf(target_name: str) -> Path | None:
    """The GGUF file a target (as a manifest names it) was converted from, or None."""
    from dlite_trt.errors import TargetNotFoundError
    from dlite_trt.gguf_import import wheel_file
    from dlite_trt.presets import PRESETS

    if Path(target_name).suffix.lower() == ".gguf":
        return Path(target_name).expanduser()
    preset = PRESETS.get(target_name.lower())
    if preset is None or preset.gguf is None:
        return None
    try:
        return wheel_file(preset.gguf.package, preset.gguf.filename, preset.gguf.install_hint)
    except TargetNotFoundError:
        return None


def crash_hint(peer: Peer) -> str:
    """What to do when ``peer``'s worker dies or its library raises."""
    return (KNOWN_CRASHES.get(peer.library, "") + f"To see it again alone: --methods ar,{peer.name}. To reinstall "
            f"{peer.library}: {peer.install}. Or leave {peer.name} out of --methods.")


def peer_unavailable(name: str, gguf: Path | None) -> str | None:
    """Why a peer cannot run here (with what to do), or None."""
    peer = PEERS[name]
    missing = [m for m in peer.modules if find_spec(m) is None]
    if missing:
        return f"{peer.library} is not installed (no module {', '.join(missing)}); install it: {peer.install}"
    if peer.weights == "gguf" and gguf is None:
        return "llama.cpp runs GGUF files and the engine's target is not one (build the engine from a .gguf target)"
    return None


# --------------------------------------------------------------------------------------------- runs


class _Context:
    """The one sequence of a peer run: prompt, answers and appended turns (what ``run_task`` reads)."""

    batch_size = 1

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens = [[int(t) for t in prompt]]

    def extend(self, new_tokens: Sequence[Sequence[int]]) -> None:
        if len(new_tokens) != 1:
            raise DLiteError(f"a peer run holds one sequence; extend got {len(new_tokens)}.")
        self.tokens[0].extend(int(t) for t in new_tokens[0])


def _check_greedy(params: SamplingParams) -> None:
    if params.temperature != 0.0 or params.stop_token_ids:
        raise DLiteError("peer methods decode greedily to a fixed length (temperature 0, no stop tokens), "
                         f"got temperature {params.temperature}, stop tokens {params.stop_token_ids}.")


class _PeerRun(Run):
    """One session of a peer: each library yields the tokens of its steps (``_steps``); the
    emission, the budget and the events are the same for all."""

    def __init__(self, prompt: Sequence[int]) -> None:
        super().__init__(_Context(prompt))

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        _check_greedy(params)
        budget = params.max_new_tokens
        if budget == 0:
            return
        emitted = 0
        steps = self._steps(budget, timer)
        try:
            for toks, record in steps:
                toks = toks[: budget - emitted]
                if not toks:
                    continue
                if record is not None and len(toks) < record.kept[0]:  # cut by the budget
                    record = StepRecord(record.draft_tokens, record.accepted, (len(toks),))
                self.session.tokens[0].extend(toks)
                emitted += len(toks)
                yield StepEvent((tuple(toks),), record if emitted > len(toks) else None)
                if emitted >= budget:
                    return
        finally:
            steps.close()
        raise DLiteError(f"{type(self).__name__} stopped after {emitted} of {budget} tokens.")

    def _steps(self, budget: int, timer: StageTimer) -> Iterator[Chunk]:
        """At least ``budget`` new tokens after ``session.tokens``, a library step at a time (the
        first chunk ends the prefill); may be closed early."""
        raise NotImplementedError


class _HFRun(_PeerRun):
    """transformers ``generate`` in a worker thread, its streamer feeding a queue: one chunk per
    decoding step (a prompt lookup step's accepted tokens and the target's own come together)."""

    def __init__(self, prompt: Sequence[int], model: Any, lookup: PromptLookupConfig | None) -> None:
        super().__init__(prompt)
        self.model, self.lookup = model, lookup
        self.cache = None  # the KV cache of the tokens generate has processed, reused by the next turn

    def _steps(self, budget: int, timer: StageTimer) -> Iterator[Chunk]:
        import torch
        from transformers import DynamicCache, GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        chunks: queue.Queue = queue.Queue()
        done = object()

        class Streamer(BaseStreamer):
            prompt_seen = False

            def put(self, value: torch.Tensor) -> None:
                if self.prompt_seen:
                    chunks.put(value.reshape(-1).tolist())
                self.prompt_seen = True  # generate's first put is the prompt

            def end(self) -> None:
                chunks.put(done)

        drafting = {} if self.lookup is None else {"prompt_lookup_num_tokens": self.lookup.num_tokens,
                                                   "max_matching_ngram_size": self.lookup.max_ngram}
        config = GenerationConfig(do_sample=False, max_new_tokens=budget, return_dict_in_generate=True,
                                  pad_token_id=getattr(self.model.config, "pad_token_id", None) or 0, **drafting)
        reuse = self.lookup is None or _HF_LOOKUP_REUSES_CACHE
        cache = self.cache if reuse and self.cache is not None else DynamicCache(config=self.model.config)
        ids = torch.tensor([self.session.tokens[0]])  # [1, T]
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                with torch.inference_mode():
                    result["out"] = self.model.generate(ids, generation_config=config, streamer=Streamer(), cache=cache)
            except Exception as exc:  # noqa: BLE001 (handed to the consumer, which raises it)
                result["error"] = exc
                chunks.put(done)

        worker = threading.Thread(target=work, name="hf-generate", daemon=True)
        worker.start()
        try:
            stage = "prefill"
            while True:
                with timer.time(stage):
                    chunk = chunks.get()
                if chunk is done:
                    break
                stage = "step" if self.lookup else "decode"
                yield chunk, None
        finally:  # also when the consumer stops at the budget: generate ends there too
            worker.join()
            self.cache = result["out"].past_key_values if reuse and "out" in result else None
        if "error" in result:
            raise DLiteError(f"transformers generate failed: {result['error']}") from result["error"]


class _OrtGenAIRun(_PeerRun):
    """An onnxruntime-genai ``Generator``: ``append_tokens`` for the prompt and each new turn (the
    KV cache of earlier turns is kept), ``generate_next_token`` per token. With n-gram decoding a round verifies several tokens and
    the library hands them out one call at a time; the calls of one round are one chunk."""

    def __init__(self, prompt: Sequence[int], model: Any, max_length: int, lookup: PromptLookupConfig | None) -> None:
        import onnxruntime_genai as og

        super().__init__(prompt)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=max_length)
        if lookup is not None:
            params.set_speculative_options(ngram_size=max(lookup.max_ngram, 2), max_draft_tokens=min(lookup.num_tokens, 16))
        self.generator = og.Generator(model, params)
        self.max_length, self.lookup = max_length, lookup
        self.pending_eos: int | None = None

    def _append(self, ids: Sequence[int]) -> None:
        import numpy as np

        self.generator.append_tokens(np.asarray([ids], dtype=np.int32))  # [1, n]

    def _next(self) -> int:
        """One ``generate_next_token``. An EOS ends the library's generation without entering its
        sequence; it is appended back, so decoding goes on past it (as ours ignores EOS)."""
        g = self.generator
        if self.pending_eos is not None:
            self._append([self.pending_eos])
            self.pending_eos = None
        before = g.token_count()
        g.generate_next_token()
        token = int(g.get_next_tokens()[0])
        if g.token_count() == before:  # not appended: it was an end-of-sequence token
            if before >= self.max_length:
                raise DLiteError(f"onnxruntime-genai reached its max_length {self.max_length}.")
            self.pending_eos = token
        return token

    def _buffered(self) -> int:
        return int(self.generator.get_speculative_stats().get("tokens_buffered", 0)) if self.lookup else 0

    def _steps(self, budget: int, timer: StageTimer) -> Iterator[Chunk]:
        g = self.generator
        with timer.time("prefill"):
            if self.pending_eos is not None:  # the last answer ended on an EOS: appended with the turn
                self.pending_eos = None
            elif g.token_count() and self.lookup is None:  # the last answer's last token is not in the KV
                g.rewind_to(g.token_count() - 1)  # cache, and append_tokens skips it: take it back, append it again
            self._append(self.session.tokens[0][g.token_count():])
            first = self._next()
        yield [first], None
        while True:
            with timer.time("step" if self.lookup else "decode"):
                chunk = [self._next()]
                while self.pending_eos is None and self._buffered():  # the rest of this round: computed already
                    chunk.append(self._next())
            yield chunk, None


class _LlamaCppRun(_PeerRun):
    """llama-cpp-python's ``Llama.generate`` over the whole context: it keeps the KV cache of the
    longest common prefix (its own prefix reuse) and evaluates the rest. It yields a token at a
    time; the tokens one ``eval`` verified are one chunk, with the drafts it evaluated."""

    def __init__(self, prompt: Sequence[int], llama: Any) -> None:
        super().__init__(prompt)
        self.llama = llama
        llama.reset()  # a new session: nothing of an earlier one is reused

    def _steps(self, budget: int, timer: StageTimer) -> Iterator[Chunk]:
        llama = self.llama
        tokens = llama.generate(self.session.tokens[0], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True)
        try:
            with timer.time("prefill"):
                first = next(tokens)
            yield [int(first)], None
            produced, chunk = 1, []
            drafts: tuple[int, ...] = ()
            evals = llama.evals
            while True:
                with timer.time("step" if llama.draft_model is not None else "decode"):
                    token = int(next(tokens))
                produced += 1
                if llama.evals != evals:  # an eval ran for this token: the step before it is complete
                    if chunk:
                        yield chunk, _drafted(drafts, chunk)
                    evals, drafts, chunk = llama.evals, llama.last_drafts, []
                chunk.append(token)
                if produced >= budget:  # nothing comes after: hand it over now
                    yield chunk, _drafted(drafts, chunk)
                    chunk = []
        finally:
            tokens.close()


def _drafted(drafts: tuple[int, ...], chunk: list[int]) -> StepRecord | None:
    """A step's record from the drafts llama.cpp evaluated with its anchor: the chunk's leading
    tokens are accepted drafts, its last the target's own."""
    if not drafts:
        return None
    return StepRecord((drafts,), (len(chunk) - 1,), (len(chunk),))


# --------------------------------------------------------------------------------------------- methods


# a failed peer's request: one event without tokens (one empty output row, which run.py compares
# with target-only's and measure records as 0 tokens)
_NOTHING = StepEvent(((),), None)


class PeerMethod:
    """A peer as ``run.py`` drives a method: ``name``, ``title``, ``start(prompts) -> Run``. Its
    library runs in a worker process (``PeerWorker``, started by the first ``start``). When the worker
    dies or the library raises, the peer is ``failure``: said once in the log, with what to do, and
    its later requests are empty; the bench goes on with the other methods."""

    peer_method = True  # batch 1 only: the batch sweep leaves it out

    def __init__(self, peer: Peer, source: PeerSource, log: Log) -> None:
        self.peer, self.source, self.log = peer, source, log
        self.worker = PeerWorker(peer.name, peer.library, f"{__name__}:serve_worker", (peer.name, source),
                                 hint=crash_hint(peer), log=log)
        self.failure: str | None = None
        self.sessions = 0  # the worker holds the last one only

    @property
    def name(self) -> str:
        return self.peer.name

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.peer.name]

    @property
    def exact(self) -> bool:
        """Whether its numerics are ours, so its greedy tokens must equal target-only decoding's
        (otherwise the bench reports where they diverge). Not once it failed: its requests stopped
        short (where the failure came) or are empty."""
        if self.failure is not None:
            return False
        if self.source.engine_weights != "float":  # an int4 engine: no peer computes what it computes
            return False
        return self.peer.weights == "engine" or self.peer.weights == self.source.dtype

    def start(self, prompts: Sequence[Sequence[int]], workload: str | None = None) -> Run:
        """A peer's live session of one prompt (``workload``: unused; each peer keeps its own state)."""
        if len(prompts) != 1:
            raise DLiteError(f"peer method {self.name} decodes one sequence at a time, got a batch of {len(prompts)}.")
        self.sessions += 1
        run = _WorkerRun(self, prompts[0], self.sessions)
        if self.failure is None:
            try:
                self.worker.start(prompts[0])
            except PeerFailed as exc:
                self.fail(exc)
        return run

    def fail(self, exc: PeerFailed) -> None:
        """The peer is out of the run: said once, with what to do."""
        self.failure = str(exc)
        self.worker.close()
        self.log(f"{exc}\nThe bench goes on without {self.name}: its requests from here on are empty (0 tokens).")


class _WorkerRun(Run):
    """A session of a peer, on the bench's side: the context (what ``run_task`` reads) is kept here,
    the library's state in the worker; a turn's new tokens go with the next generation."""

    def __init__(self, method: PeerMethod, prompt: Sequence[int], session: int) -> None:
        super().__init__(_Context(prompt))
        self.method, self.id = method, session
        self.appended: list[int] = []  # tokens the worker has not seen yet

    def extend(self, new_tokens: Sequence[Sequence[int]]) -> None:
        self.session.extend(new_tokens)
        self.appended += [int(t) for t in new_tokens[0]]

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        _check_greedy(params)
        method = self.method
        if self.id != method.sessions:
            raise DLiteError(f"peer {method.name} started session {method.sessions} after this one ({self.id}); "
                             "its worker keeps only the newest: stream from that one.")
        if params.max_new_tokens == 0:
            return
        if method.failure is not None:
            yield _NOTHING
            return
        appended, self.appended = self.appended, []
        events = 0
        steps = method.worker.generate(appended, params.max_new_tokens, timer)
        try:
            for event in steps:
                self.session.tokens[0].extend(event.new_tokens[0])
                events += 1
                yield event
        except PeerFailed as exc:
            method.fail(exc)
            if not events:
                yield _NOTHING
        finally:  # also when the consumer stops early: the worker's rest of the generation is read
            steps.close()


def open_run(peer: Peer, backends: _Backends, prompt: Sequence[int]) -> _PeerRun:
    """A new session of ``peer`` on its library (in its worker process)."""
    lookup = backends.source.lookup if peer.lookup else None
    if peer.library == "transformers":
        return _HFRun(prompt, backends.hf_model, lookup)
    if peer.library == "onnxruntime-genai":
        return _OrtGenAIRun(prompt, backends.ort_genai_model(peer.weights), backends.source.max_seq_len, lookup)
    return _LlamaCppRun(prompt, backends.llama(lookup))


def serve_worker() -> None:
    """A peer's worker process (``PeerMethod.worker`` starts it): its model loads on the first
    session, with the threads the bench runs every method on (``_Backends``)."""
    def open_runs(init: tuple[str, PeerSource], log: Log) -> Callable[[Sequence[int]], _PeerRun]:
        name, source = init
        peer, backends = PEERS[name], _Backends(source, log)
        return lambda prompt: open_run(peer, backends, prompt)

    serve(open_runs)


class _Backends:
    """The models a peer's worker loads, once (a worker runs one peer method)."""

    def __init__(self, source: PeerSource, log: Log) -> None:
        self.source, self.log = source, log
        self._ort: dict[str, Any] = {}
        self._llama: dict[bool, Any] = {}

    @cached_property
    def hf_model(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from dlite_trt.dtypes import TORCH

        if self.source.threads:
            torch.set_num_threads(self.source.threads)
        model = AutoModelForCausalLM.from_pretrained(self.source.hf_dir, dtype=TORCH[self.source.dtype],
                                                     use_safetensors=True).eval()
        model.generation_config.eos_token_id = None  # generate to the budget, as ours (EOS is emitted, not a stop)
        return model

    def ort_genai_model(self, precision: str) -> Any:
        if precision not in self._ort:
            import onnxruntime_genai as og

            config = og.Config(str(ort_genai_model(self.source.hf_dir, self.source.sha256, precision, log=self.log)))
            if self.source.threads:
                config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                    "intra_op_num_threads": self.source.threads, "inter_op_num_threads": 1}}}}))
            self._ort[precision] = og.Model(config)
        return self._ort[precision]

    def llama(self, lookup: PromptLookupConfig | None) -> Any:
        key = lookup is not None
        if key not in self._llama:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            class CountingLlama(Llama):
                """Counts ``eval`` calls and keeps the drafts of the last (what a step verified)."""

                evals = 0
                last_drafts: tuple[int, ...] = ()

                def eval(self, tokens: Sequence[int]) -> None:
                    self.evals += 1
                    self.last_drafts = tuple(int(t) for t in tokens[1:]) if self.draft_model is not None else ()
                    super().eval(tokens)

            draft = None if lookup is None else LlamaPromptLookupDecoding(max_ngram_size=lookup.max_ngram,
                                                                          num_pred_tokens=lookup.num_tokens)
            threads = self.source.threads or default_threads()
            self.log(f"peers: llama.cpp loads {self.source.gguf} (n_ctx {self.source.max_seq_len}, {threads} threads"
                     + (f", prompt lookup: {lookup.max_ngram}-grams, {lookup.num_tokens} tokens)" if lookup else ")"))
            self._llama[key] = CountingLlama(str(self.source.gguf), n_ctx=self.source.max_seq_len, n_threads=threads,
                                             n_threads_batch=threads, draft_model=draft, verbose=False,
                                             # with a draft model it keeps every position's logits, but sizes
                                             # their buffer by this flag (0.3.36): n_batch rows, overrun past it
                                             logits_all=draft is not None)
        return self._llama[key]


def skipped_peers(names: Sequence[str], target_name: str) -> dict[str, str]:
    """The peers among ``names`` that cannot run here, with why (and the command that fixes it)."""
    gguf = target_gguf(target_name) if any(PEERS[n].weights == "gguf" for n in names if n in PEERS) else None
    return {n: why for n in names if n in PEERS and (why := peer_unavailable(n, gguf)) is not None}


def make_peer_methods(names: Sequence[str], manifest: Any, *, threads: int | None, lookup: PromptLookupConfig,
                      log: Log) -> list[PeerMethod]:
    """The peers among ``names`` that can run here (each other one is logged, with why), each to run
    in a worker process of its own, started by its first session."""
    skipped = skipped_peers(names, manifest.target_name)
    for name, why in skipped.items():
        log(f"skipping method {name}: {why}")
    names = [n for n in names if n in PEERS and n not in skipped]
    if not names:
        return []
    source = peer_source(manifest, threads=threads, lookup=lookup)
    return [PeerMethod(PEERS[n], source, log) for n in names]


# --------------------------------------------------------------------------------------------- builds


def ort_genai_model(hf_dir: Path, sha256: str, precision: str, *, log: Log) -> Path:
    """onnxruntime-genai's model of a Hugging Face directory (its model builder, CPU), built once into
    ``cache_root()/ort-genai/<weights sha256[:16]>-<precision>-cpu-<onnxruntime-genai version>/``."""
    import onnxruntime_genai as og

    from dlite_trt.gguf_import import cache_root

    if precision not in ("fp32", "int4"):
        raise DLiteError(f"onnxruntime-genai peers build fp32 or int4 models, not {precision!r}.")
    final = cache_root() / "ort-genai" / f"{sha256[:16]}-{precision}-cpu-{og.__version__}"
    record = final / ORT_GENAI_BUILD_RECORD
    if record.is_file() and json.loads(record.read_text()).get("sha256") == sha256:
        log(f"peers: onnxruntime-genai {precision} model of {hf_dir}: {final} (cached)")
        return final
    shutil.rmtree(final, ignore_errors=True)  # incomplete or stale: rebuild
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp / "model"),
               "-p", precision, "-e", "cpu", "-c", str(tmp / "builder-cache")]
    log(f"peers: building the onnxruntime-genai {precision} model of {hf_dir} into {final}: "
        + " ".join(command[1:]))
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise DLiteError(f"onnxruntime-genai's model builder failed (exit {done.returncode}) on {hf_dir}:\n"
                             + (done.stderr or done.stdout)[-2000:])
        (tmp / "model" / ORT_GENAI_BUILD_RECORD).write_text(json.dumps(
            {"source": str(hf_dir), "sha256": sha256, "precision": precision, "execution_provider": "cpu",
             "onnxruntime_genai": og.__version__, "command": command[1:]}, indent=1))
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp / "model", final)
        except OSError:  # another process built it first
            if not record.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"peers: built {final}")
    return final
