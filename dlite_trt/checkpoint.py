"""Official dlite_v1 draft checkpoints: load and save, strictly (DESIGN 1.1).

A checkpoint is a directory with ``config.json`` and ``model.safetensors``, or sharded
``model-XXXXX-of-YYYYY.safetensors`` files with ``model.safetensors.index.json``. Weights are
read with safetensors only (never pickle). Every way a checkpoint can be wrong gets its own
error that names the problem and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dlite_trt.config import DRAFT_VOCAB_KEY, DraftConfig, TargetSpec
from dlite_trt.errors import CheckpointError, ConfigError, IncompatibleDraftError
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.sequential_head import draft_vocab_problem
from dlite_trt.paths import pickles_in

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DRAFT_VOCAB = "sequential_head.draft_vocab"  # [V_d] int64, only in drafts with a reduced draft vocabulary
HEAD_VOCAB_WEIGHTS = ("sequential_head.prev_token_embedding.weight", "sequential_head.output_proj.weight")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}); it is truncated or corrupt. "
            "Re-download or re-save the checkpoint."
        ) from exc


def _shard_files(ckpt: Path) -> dict[Path, list[str]]:
    """Weight files of a checkpoint and the names each must hold."""
    single, index = ckpt / WEIGHTS_NAME, ckpt / INDEX_NAME
    if single.is_file():
        return {single: []}
    if not index.is_file():
        pickles = pickles_in(ckpt)
        if pickles:
            raise CheckpointError(f"{ckpt} holds its weights only as {', '.join(pickles[:3])} (PyTorch pickles), which "
                                  "dlite-trt never loads: a pickle can run code. Save the draft's state dict with "
                                  f"safetensors (safetensors.torch.save_file) as {WEIGHTS_NAME}, where you trust the "
                                  "file.")
        raise CheckpointError(
            f"{ckpt} has no {WEIGHTS_NAME} and no {INDEX_NAME}: no weights to load. "
            "Pass the directory that holds the draft's safetensors files."
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is corrupt ({exc!r}); it needs a 'weight_map' object.") from exc
    shards: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        shards.setdefault(ckpt / file, []).append(name)
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(
                f"{index} names shard {shard.name}, which is missing from {ckpt}; the download is incomplete."
            )
    return shards


def read_draft_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """All tensors of a draft checkpoint, single-file or sharded, as stored."""
    state: dict[str, torch.Tensor] = {}
    for shard, expected in _shard_files(ckpt).items():
        tensors = _read_safetensors(shard)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise CheckpointError(
                f"{shard.name} lacks {missing[:5]} that {INDEX_NAME} assigns to it; the shard is stale or corrupt."
            )
        for name, tensor in tensors.items():
            if name in state:
                raise CheckpointError(f"weight {name!r} appears in more than one shard of {ckpt}.")
            state[name] = tensor
    return state


def check_state_dict(state: Mapping[str, torch.Tensor], model: torch.nn.Module, where: str) -> None:
    """Names and shapes must match the model exactly; say which ones differ and how."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(
            f"{where} is missing {len(missing)} weight(s), e.g. {missing[:5]}; the checkpoint is incomplete "
            "or was saved with another layout (dlite_v1 names have no prefix, e.g. 'layers.0.self_attn.q_proj.weight')."
        )
    if unexpected:
        raise CheckpointError(
            f"{where} has {len(unexpected)} unexpected weight(s), e.g. {unexpected[:5]}; it is not a dlite_v1 "
            "student checkpoint for this config (a teacher, or a prefixed state dict?)."
        )
    wrong = [(n, tuple(state[n].shape), tuple(t.shape)) for n, t in expected.items() if state[n].shape != t.shape]
    if wrong:
        detail = "; ".join(f"{n}: file {got}, config needs {want}" for n, got, want in wrong[:5])
        head = (" (the head's vocabulary rows follow dlite_config.draft_vocab_size when it is set, else vocab_size)"
                if {n for n, _, _ in wrong} & {*HEAD_VOCAB_WEIGHTS, DRAFT_VOCAB} else "")
        raise CheckpointError(
            f"{where} has {len(wrong)} weight(s) whose shape does not match config.json ({detail}){head}; "
            "config.json and the weights come from different models."
        )


def check_draft_vocab(state: Mapping[str, torch.Tensor], cfg: DraftConfig, where: str) -> None:
    """The draft vocabulary tensor is there iff the config sets draft_vocab_size, and is valid."""
    ids = state.get(DRAFT_VOCAB)
    if cfg.draft_vocab_size is None:
        if ids is not None:
            raise CheckpointError(
                f"{where} holds {DRAFT_VOCAB} {tuple(ids.shape)} but config.json has no dlite_config."
                f"{DRAFT_VOCAB_KEY}; add \"{DRAFT_VOCAB_KEY}\": {ids.numel()} to dlite_config, or drop the tensor "
                "for a full-vocabulary draft."
            )
        return
    if ids is None:
        raise CheckpointError(
            f"{where}: config.json sets dlite_config.{DRAFT_VOCAB_KEY}={cfg.draft_vocab_size} but the weights have no "
            f"{DRAFT_VOCAB} (the target id of each draft row, [{cfg.draft_vocab_size}] int64); save the draft "
            f"vocabulary with the weights, or remove {DRAFT_VOCAB_KEY} for a full-vocabulary draft."
        )
    if ids.dtype != torch.int64:
        raise CheckpointError(f"{where}: {DRAFT_VOCAB} is {ids.dtype}; it must be int64 (target token ids). "
                              "Re-save it as int64.")
    problem = draft_vocab_problem(ids, cfg.vocab_size, cfg.mask_token_id) if ids.ndim == 1 else None
    if problem is not None:
        raise CheckpointError(f"{where}: {DRAFT_VOCAB}: {problem}; list each target id at most once, all in "
                              f"[0, vocab_size), including mask_token_id={cfg.mask_token_id}, and re-save the draft.")


def check_dtypes(state: Mapping[str, torch.Tensor], where: str, *, uniform: bool) -> None:
    """Weights must be floating point; without a cast, all of one dtype. (The draft vocabulary, token ids,
    is checked by ``check_draft_vocab``.)"""
    state = {n: t for n, t in state.items() if n != DRAFT_VOCAB}
    not_float = sorted(n for n, t in state.items() if not t.is_floating_point())
    if not_float:
        raise CheckpointError(
            f"{where} has non-floating-point weights, e.g. {not_float[:5]} "
            f"({state[not_float[0]].dtype}); the file is corrupt or is not a DLite draft."
        )
    dtypes = sorted({str(t.dtype) for t in state.values()})
    if uniform and len(dtypes) > 1:
        raise CheckpointError(
            f"{where} mixes weight dtypes {dtypes}; load it with a dtype (e.g. dtype=torch.bfloat16) to cast them."
        )


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """NaN or infinite weights (a corrupt file, a training run that diverged) are refused by name:
    they would run, and decode garbage or nothing, without a word."""
    bad = [n for n, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CheckpointError(f"{where} has NaN or infinite values in {', '.join(bad[:5])}{more}; the file is "
                              "corrupt or the run that wrote it diverged. Use another checkpoint (e.g. an earlier "
                              "snapshot of that run).")


def load_draft_config(ckpt: Path) -> DraftConfig:
    ckpt = Path(ckpt)
    if not ckpt.exists():
        raise CheckpointError(f"draft checkpoint {ckpt} does not exist; pass the directory of a dlite_v1 draft.")
    if not ckpt.is_dir():
        raise CheckpointError(f"draft checkpoint {ckpt} is a file; pass a dlite_v1 draft's directory (config.json + "
                              f"{WEIGHTS_NAME}).")
    cfg_path = ckpt / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{ckpt} has no {CONFIG_NAME}; a dlite_v1 draft directory holds config.json and weights.")
    try:
        return DraftConfig.from_json_file(cfg_path)
    except ConfigError as exc:
        raise CheckpointError(f"draft checkpoint {ckpt}: {exc}") from exc


def load_draft(ckpt: Path, *, dtype: torch.dtype | None = torch.float32,
               target: TargetSpec | None = None) -> DLiteDraft:
    """Load a dlite_v1 draft. With ``target``, also check that the draft fits it."""
    ckpt = Path(ckpt)
    cfg = load_draft_config(ckpt)
    if target is not None:
        check_draft_fits_target(cfg, target)
    state = read_draft_state_dict(ckpt)
    with torch.device("meta"):
        model = DLiteDraft(cfg)
    check_draft_vocab(state, cfg, f"draft checkpoint {ckpt}")
    check_state_dict(state, model, f"draft checkpoint {ckpt}")
    check_dtypes(state, f"draft checkpoint {ckpt}", uniform=dtype is None)
    check_finite(state.items(), f"draft checkpoint {ckpt}")
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_draft(model: DLiteDraft, out: Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write config.json and the weights (sharded when above ``max_shard_bytes``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for stale in [out / WEIGHTS_NAME, out / INDEX_NAME, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def check_draft_fits_target(cfg: DraftConfig, target: TargetSpec) -> None:
    """A draft is trained for one target shape; say exactly what does not fit."""
    pairs = (
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("vocab_size", cfg.vocab_size, target.vocab_size),
        ("num_target_layers", cfg.num_target_layers, target.num_hidden_layers),
    )
    for name, draft_value, target_value in pairs:
        if draft_value != target_value:
            raise IncompatibleDraftError(
                f"the draft does not fit the target: draft {name}={draft_value} but the target has "
                f"{target_value}. A DLite draft is trained for one target; pair it with the target it was "
                "trained for (the Qwen3 size in the draft's name) or train one for this target."
            )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise IncompatibleDraftError(
            f"the draft's mask_token_id={cfg.mask_token_id} is outside the target's embedding "
            f"({target.vocab_size} rows); DLite embeds the mask query with a real row of the target's "
            "embed_tokens. Fix dlite_config.mask_token_id or pair the draft with its own target."
        )
