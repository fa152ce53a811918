"""Open an engine directory for generation, checked against the target/draft it should fit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.checkpoint import load_draft_config
from dlite_trt.engine.manifest import check_sources, checkpoint_sha256, target_sha256
from dlite_trt.runtime.engine import EngineGenerator, open_engine
from dlite_trt.targets import resolve_target, tokenizer_in


@dataclass
class LoadedEngine:
    generator: EngineGenerator
    tokenizer: Any | None
    stop_token_ids: tuple[int, ...]
    name: str


def load_engine(engine_dir: Path, *, target: str | Path | None = None, draft: Path | None = None,
                random_weights: bool = False, threads: int | None = None, verify: bool = False,
                preload: tuple[str, ...] = ("prefill", "step"),
                verify_drafts: int | str | None = "auto") -> LoadedEngine:
    """Load an engine; when ``target``/``draft`` are given, refuse unless the engine was built from them.
    ``verify_drafts``: drafts a greedy step verifies (``open_engine``)."""
    engine_dir = Path(engine_dir)
    generator = open_engine(engine_dir, threads=threads, verify=verify, preload=preload, verify_drafts=verify_drafts)
    manifest = generator.manifest
    target_sha = draft_sha = None
    if target is not None:
        target_sha = target_sha256(resolve_target(target, random_weights=random_weights))
    if draft is not None:
        load_draft_config(Path(draft))  # a clear error for a missing or wrong draft directory
        draft_sha = checkpoint_sha256(Path(draft))
    check_sources(manifest, target_sha256=target_sha, draft_sha256=draft_sha, where=str(engine_dir))
    tokenizer = tokenizer_in(engine_dir / "target")
    return LoadedEngine(generator, tokenizer, manifest.stop_token_ids, f"engine {engine_dir}")
