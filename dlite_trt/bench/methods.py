"""The decoding methods `dlite-trt bench` runs side by side, each behind one small interface.

``start(prompts)`` opens a live batch; the returned ``Run`` extends it with a new turn and
streams a generation (``StepEvent``s). Our methods decode with the same target in the same
runtime, so the differences measured are the drafting method's alone; peer methods
(bench/peers.py) are other libraries on the same target, behind the same interface.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlite_trt.bench.live import Run
from dlite_trt.bench.names import METHOD_NAMES, METHOD_TITLES, PEER_NAMES, check_names
from dlite_trt.runtime.prompt_lookup import MissRuns, PromptLookupConfig, PromptLookupDrafter
from dlite_trt.runtime.session import SamplingParams, SessionBase, StepEvent
from dlite_trt.runtime.stats import StageTimer


class _TargetOnly(Run):
    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream_target_only(params, timer)


class _DLite(Run):
    """History-free: between steps the engine's draft keeps only the next block and the anchor
    group's prefix (step outputs fed back; greedy); the PyTorch reference also keeps the pivot
    states it drafts from. An appended turn costs it nothing."""

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream(params, timer)

    def draft_state_bytes(self) -> int:
        draft = getattr(self.session.gen, "draft", None)  # the reference generator's model
        cfg = draft.cfg if draft is not None else self.session.gen.cfg
        ids = 8 * (cfg.block_size + cfg.anchor_group_size - 1)  # int64 ids per sequence
        pivots = 0
        if draft is not None:  # chs [S, H] per sequence, in the model's dtype
            param = next(draft.parameters())
            pivots = len(cfg.target_layer_ids) * cfg.hidden_size * param.element_size()
        return self.session.batch_size * (ids + pivots)


class _Ngram(Run):
    def __init__(self, session: SessionBase, cfg: PromptLookupConfig, misses: MissRuns | None = None) -> None:
        super().__init__(session)
        self.drafter = PromptLookupDrafter(session.batch_size, cfg, misses)

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream_drafted(params, self.drafter, timer)

    @property
    def draft_context_tokens(self) -> int:
        return self.drafter.context_tokens

    def draft_state_bytes(self) -> int:
        return self.drafter.state_bytes()


class _DLiteLookup(_Ngram):
    """DLite whose step verifies n-gram prompt lookup's proposal instead of the draft's where the
    lookup finds a match (``EngineSession.stream(lookup=...)``); greedy, engine only. It keeps
    both drafters' state; the lookup's statistics that decide where the draft runs (``MissRuns``)
    carry over from request to request of a workload, as the OpenAI server keeps them server-wide."""

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream(params, timer, lookup=self.drafter)

    def draft_state_bytes(self) -> int:
        return _DLite(self.session).draft_state_bytes() + super().draft_state_bytes()


@dataclass(frozen=True)
class Method:
    name: str
    generator: Any  # an EngineGenerator, or the PyTorch reference SpeculativeGenerator
    ngram: PromptLookupConfig | None = None
    # DLite + n-gram's lookup statistics per workload (``start``'s ``workload``), shared by its requests
    misses: dict[str | None, MissRuns] = field(default_factory=dict, compare=False, repr=False)

    peer_method = False  # ours: any batch size the engine takes
    exact = True  # its greedy tokens must equal target-only decoding's

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.name]

    def start(self, prompts: Sequence[Sequence[int]], workload: str | None = None) -> Run:
        """A live batch of ``prompts``; ``workload``: the requests that share DLite + n-gram's lookup
        statistics (None: those started without one)."""
        session = self.generator.session(prompts)
        if self.name == "ar":
            return _TargetOnly(session)
        if self.name == "ngram":
            return _Ngram(session, self.ngram or PromptLookupConfig())
        if self.name == "dlite-ngram":
            misses = self.misses.setdefault(workload, MissRuns())
            return _DLiteLookup(session, self.ngram or PromptLookupConfig(), misses)
        return _DLite(session)


def make_methods(names: Sequence[str], engine: Any, reference: Any | None = None,
                 ngram: PromptLookupConfig | None = None, *, log: Callable[[str], None] | None = None) -> list:
    """The methods named, in order: ours (``Method``) and the peers that can run here
    (``peers.PeerMethod``, on the engine's target, with the engine's --threads); a peer that
    cannot (its library missing) is left out, with a line saying why (``log``: stderr)."""
    check_names(names, METHOD_NAMES, "methods")
    ngram = ngram or PromptLookupConfig()
    peers: dict[str, Any] = {}
    if any(n in PEER_NAMES for n in names):
        from dlite_trt.bench.peers import make_peer_methods

        log = log or (lambda line: print(line, file=sys.stderr))
        threads = getattr(getattr(engine, "runner", None), "threads", None)
        peers = {m.name: m for m in make_peer_methods(names, engine.manifest, threads=threads, lookup=ngram, log=log)}
    return [peers[n] if n in PEER_NAMES else Method(n, reference if n == "reference" else engine, ngram)
            for n in names if n not in PEER_NAMES or n in peers]


def skipped_methods(names: Sequence[str], manifest: Any) -> dict[str, str]:
    """The methods named that ``make_methods`` leaves out, with why (for the report)."""
    if not any(n in PEER_NAMES for n in names):
        return {}
    from dlite_trt.bench.peers import skipped_peers

    return skipped_peers(names, manifest.target_name)
