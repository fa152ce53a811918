"""Resolve ``--target`` (a directory or a preset name) and load the Qwen3 target.

Resolution order for a value: an existing directory; a preset name found in the local
Hugging Face cache; a preset name with ``random_weights=True`` (random weights of that
shape, for shape-only builds and speed measurements). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlite_trt.config import TargetSpec
from dlite_trt.errors import CheckpointError, TargetNotFoundError
from dlite_trt.presets import PRESETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
RANDOM_WEIGHTS_SEED = 0  # --random-weights targets are seeded: the same weights every time


@dataclass(frozen=True)
class TargetSource:
    """Where a target comes from: a model directory, or random weights of a preset's shape."""

    spec: TargetSpec
    path: Path | None  # None: random weights
    name: str

    @property
    def is_random(self) -> bool:
        return self.path is None


def read_target_spec(path: Path) -> TargetSpec:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"target directory {path} has no config.json; pass a Hugging Face Qwen3 model directory.")
    try:
        raw = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg} is not valid JSON ({exc}).") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg} must hold a JSON object, got {type(raw).__name__}; the file is corrupt.")
    return TargetSpec.from_hf_config(raw, where=str(cfg))


def _cached_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def resolve_target(value: str | Path, *, random_weights: bool = False) -> TargetSource:
    path = Path(value).expanduser()
    if path.is_dir():
        if random_weights:
            raise TargetNotFoundError(f"--random-weights applies to preset names, not to the directory {path}.")
        return TargetSource(read_target_spec(path), path, str(path))
    name = str(value).lower()
    preset = PRESETS.get(name)
    if preset is None:
        if path.exists():
            raise TargetNotFoundError(f"--target {value} is a file; pass the model directory that holds it.")
        raise TargetNotFoundError(
            f"--target {value!r} is neither a directory nor a known preset; presets: {', '.join(PRESETS)}."
        )
    if random_weights:
        return TargetSource(preset.spec, None, name)
    snapshot = _cached_snapshot(preset.hf_repo)
    if snapshot is None:
        raise TargetNotFoundError(
            f"{name} ({preset.hf_repo}) is not in the local Hugging Face cache and dlite-trt never downloads. "
            f"Run `huggingface-cli download {preset.hf_repo}`, pass its directory as --target, or add "
            "--random-weights for random weights of that shape."
        )
    return TargetSource(read_target_spec(snapshot), snapshot, name)


def build_hf_model(source: TargetSource, dtype: torch.dtype, seed: int = RANDOM_WEIGHTS_SEED) -> torch.nn.Module:
    """The transformers Qwen3ForCausalLM for a source, with checked weights (or seeded random ones)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if source.is_random:
        torch.manual_seed(seed)  # built directly in `dtype`: an 8B target never exists in fp32
        return Qwen3ForCausalLM._from_config(Qwen3Config(**source.spec.to_hf_config()), dtype=dtype).eval()
    from safetensors import SafetensorError

    try:
        # ignore_mismatched_sizes only moves shape mismatches into `info`, which is checked below.
        model, info = Qwen3ForCausalLM.from_pretrained(source.path, dtype=dtype, output_loading_info=True,
                                                       ignore_mismatched_sizes=True)
    except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(
            f"cannot load the target weights from {source.path}: {exc}. The files are missing, truncated or corrupt."
        ) from exc
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise CheckpointError(f"target weights in {source.path} do not match its config.json: {problems or info}")
    return model.eval()


def load_tokenizer(source: TargetSource) -> Any | None:
    """The target's tokenizer, or None when its directory has none (ids-only use)."""
    if source.path is None or not any((source.path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path)


def stop_token_ids(source: TargetSource, tokenizer: Any | None) -> tuple[int, ...]:
    """Where the target says generation ends: the union of config.json's eos_token_id,
    generation_config.json's (Qwen3 lists <|im_end|> and <|endoftext|> there) and the tokenizer's."""
    ids = list(source.spec.stop_token_ids)
    gen_cfg = source.path / "generation_config.json" if source.path is not None else None
    if gen_cfg is not None and gen_cfg.is_file():
        try:
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"{gen_cfg} is not a valid JSON object ({exc!r}); fix or delete it.") from exc
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise CheckpointError(f"end-of-sequence ids {bad} of target {source.name} are not token ids; "
                              "fix eos_token_id in its config.json / generation_config.json.")
    return tuple(dict.fromkeys(ids))
