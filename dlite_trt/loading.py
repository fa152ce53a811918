"""Load a target and a draft into a reference generator, with every compatibility check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.checkpoint import load_draft
from dlite_trt.dtypes import TORCH
from dlite_trt.model.target import TargetAdapter
from dlite_trt.runtime.reference import SpeculativeGenerator
from dlite_trt.targets import (
    TargetSource,
    build_hf_model,
    load_tokenizer,
    resolve_target,
    stop_token_ids,
)



@dataclass
class LoadedPair:
    generator: SpeculativeGenerator
    tokenizer: Any | None
    source: TargetSource

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return stop_token_ids(self.source, self.tokenizer)


def load_pair(target: str | Path, draft: Path, *, dtype: str = "fp32", random_weights: bool = False,
              device: str = "cpu", progress: bool = True) -> LoadedPair:
    """Resolve and load the target, load the draft (checked against it), build the generator."""
    if dtype not in TORCH:
        raise ValueError(f"dtype must be one of {sorted(TORCH)}, got {dtype!r}")
    torch_dtype = TORCH[dtype]
    source = resolve_target(target, random_weights=random_weights, progress=progress)
    draft_model = load_draft(Path(draft), dtype=torch_dtype, target=source.spec).to(device)
    hf_model = build_hf_model(source, torch_dtype).to(device)
    adapter = TargetAdapter(hf_model, source.spec, draft_model.cfg.target_layer_ids)
    return LoadedPair(SpeculativeGenerator(adapter, draft_model), load_tokenizer(source), source)
