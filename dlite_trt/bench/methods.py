"""The decoding methods `dlite-trt bench` runs side by side, each behind one small interface.

``start(prompts)`` opens a live batch; the returned ``Run`` extends it with a new turn and
streams a generation (``StepEvent``s). Every method decodes with the same target in the same
runtime, so the differences measured are the drafting method's alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dlite_trt.runtime.prompt_lookup import PromptLookupConfig, PromptLookupDrafter, stream_prompt_lookup
from dlite_trt.runtime.session import SamplingParams, SessionBase, StepEvent
from dlite_trt.runtime.stats import StageTimer

METHOD_NAMES = ("ar", "dlite", "ngram", "reference")
METHOD_TITLES = {"ar": "target-only", "dlite": "DLite", "ngram": "n-gram lookup", "reference": "DLite (PyTorch)"}


class Run:
    """One live batch of a method: what a multi-turn session keeps between turns."""

    def __init__(self, session: SessionBase) -> None:
        self.session = session

    def extend(self, ids: Sequence[Sequence[int]]) -> None:
        self.session.extend(ids)

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        raise NotImplementedError

    @property
    def draft_context_tokens(self) -> int:
        """Context tokens the drafter has processed outside decoding steps (0: nothing to catch up on)."""
        return 0

    def draft_state_bytes(self) -> int:
        """Bytes the drafter keeps per batch between steps."""
        return 0


class _TargetOnly(Run):
    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream_target_only(params, timer)


class _DLite(Run):
    """History-free: between steps the draft keeps only the next block and the anchor group's prefix
    (the engine's step outputs fed back); an appended turn costs it nothing."""

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return self.session.stream(params, timer)

    def draft_state_bytes(self) -> int:
        cfg = getattr(self.session.gen, "cfg", None) or self.session.gen.draft.cfg
        return 8 * self.session.batch_size * (cfg.block_size + cfg.anchor_group_size - 1)  # int64 ids


class _Ngram(Run):
    def __init__(self, session: SessionBase, cfg: PromptLookupConfig) -> None:
        super().__init__(session)
        self.drafter = PromptLookupDrafter(session.batch_size, cfg)

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        return stream_prompt_lookup(self.session, params, self.drafter, timer)

    @property
    def draft_context_tokens(self) -> int:
        return self.drafter.context_tokens

    def draft_state_bytes(self) -> int:
        return self.drafter.state_bytes()


@dataclass(frozen=True)
class Method:
    name: str
    generator: Any  # an EngineGenerator, or the PyTorch reference SpeculativeGenerator
    ngram: PromptLookupConfig | None = None

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.name]

    def start(self, prompts: Sequence[Sequence[int]]) -> Run:
        session = self.generator.session(prompts)
        if self.name == "ar":
            return _TargetOnly(session)
        if self.name == "ngram":
            return _Ngram(session, self.ngram or PromptLookupConfig())
        return _DLite(session)


def make_methods(names: Sequence[str], engine: Any, reference: Any | None = None,
                 ngram: PromptLookupConfig | None = None) -> list[Method]:
    unknown = [n for n in names if n not in METHOD_NAMES]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHOD_NAMES)}")
    return [Method(n, reference if n == "reference" else engine, ngram) for n in names]
