"""Typed, validated configs: the DLite draft (official dlite_v1 schema) and the target.

Both are frozen dataclasses validated on construction. ``DraftConfig`` reads and writes the
official ``config.json`` of a dlite_v1 checkpoint as is (DESIGN 1.1); keys it does not model
are kept in ``extra`` so that a load/save round trip preserves the file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dlite_trt.architectures import ARCHITECTURES, ROPE_TYPES, Architecture, supported
from dlite_trt.errors import ConfigError

ARCHITECTURE_VERSION = "dlite_v1"
MODEL_ROLE = "pivot_q_student"
SEQUENTIAL_HEADS = ("rnn",)
DRAFT_ARCHITECTURE = "DLiteDraftModel"
SILU_NAMES = ("silu", "swish")  # transformers maps both to SiLU


def select_target_layer_ids(num_target_layers: int, chs_num_layers: int) -> tuple[int, ...]:
    """The fixed dlite_v1 selection: {0, N-1} plus S-2 evenly spaced ids (DESIGN 1.1)."""
    n, s = int(num_target_layers), int(chs_num_layers)
    if n < 2:
        raise ConfigError(f"DLite needs a target with at least 2 layers, got num_target_layers={n}.")
    if not 2 <= s <= n:
        raise ConfigError(f"chs_num_layers must be in [2, {n}] for a {n}-layer target, got {s}.")
    ids = {0, n - 1}
    middle = s - 2
    for i in range(middle):
        f = 0.5 if middle == 1 else i / (middle - 1)
        ids.add(1 + round(f * (n - 3)))
    if len(ids) != s:
        raise ConfigError(f"cannot select {s} distinct layers from a {n}-layer target (got {sorted(ids)}).")
    return tuple(sorted(ids))


MAX_BLOCK_SIZE = 64  # tokens a block; a larger one is a typo whose graphs take forever to export


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE type other than the default, with its parameters (transformers' rope_parameters).

    Only types with fixed inverse frequencies (``architectures.ROPE_TYPES``): linear divides
    them by ``factor``; llama3 (Llama 3.1+) divides the low frequencies by ``factor``, keeps
    the high ones and blends those between."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def to_dict(self) -> dict[str, Any]:
        keys = ROPE_TYPES[self.rope_type]
        return {"rope_type": self.rope_type, **{k: getattr(self, k) for k in keys}}


def _rope(raw: Mapping[str, Any], rope_types: tuple[str, ...], where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from a transformers 4.x (rope_theta + rope_scaling) or 5.x
    (rope_parameters) config."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    block = {**scaling, **params}
    kind = block.get("rope_type", block.get("type", "default"))
    if kind not in rope_types:
        raise ConfigError(
            f"{where}: rope_type {kind!r} is not supported (only {' / '.join(rope_types)} RoPE here; dynamic, "
            "YaRN and LongRoPE scaling are not); use a model without it."
        )
    if block.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {block['partial_rotary_factor']} is not supported "
                          "(RoPE over the whole head only).")
    theta = raw.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{where}: no rope_theta (neither top-level nor in rope_parameters).")
    theta = _num({"rope_theta": theta}, "rope_theta", where, float)
    if kind == "default":
        return theta, None
    _require(block, ROPE_TYPES[kind], f"{where} rope parameters ({kind})")
    values = {k: _num(block, k, where, int if k == "original_max_position_embeddings" else float)
              for k in ROPE_TYPES[kind]}
    return theta, RopeScaling(kind, **values)


def _require(raw: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ConfigError(f"{where} is missing required keys {missing}; is this the right file?")


def _num(raw: Mapping[str, Any], key: str, where: str, kind: type = int, default: Any = None) -> Any:
    """raw[key] as an int (or float); a missing or null key takes ``default`` when one is given."""
    value = raw.get(key)
    if value is None:
        value = default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (kind is int and value != int(value)):
        raise ConfigError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}.")
    return kind(value)


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}.")


def _check_attention_shape(cfg: TargetSpec | DraftConfig, who: str) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{who} num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}."
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"{who} head_dim must be even for RoPE, got {cfg.head_dim}.")


@dataclass(frozen=True)
class TargetSpec:
    """Shape of a target (what its Hugging Face config.json describes), of one of the
    ``architectures.ARCHITECTURES``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    architecture: str = "qwen3"  # a model_type of ARCHITECTURES
    rope_scaling: RopeScaling | None = None  # None: default RoPE
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
        _check_attention_shape(self, "target")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"target architecture {self.architecture!r} is not supported; supported: {supported()}.")
        for key, default in (("attention_bias", False), ("mlp_bias", False)):
            if key not in self.arch.layout_keys and getattr(self, key) != default:
                raise ConfigError(f"{key} does not apply to {self.arch.hf_class} targets.")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in self.arch.rope_types:
            raise ConfigError(f"rope_type {self.rope_scaling.rope_type!r} is not supported for {self.arch.hf_class}.")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any], where: str = "target config.json") -> TargetSpec:
        model_type = raw.get("model_type")
        arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise ConfigError(
                f"{where}: model_type is {model_type!r}; dlite-trt compiles {supported()}. "
                "Pass a model directory (or GGUF file) of one of those."
            )
        if raw.get("hidden_act", "silu") not in SILU_NAMES:
            raise ConfigError(f"{where}: hidden_act {raw.get('hidden_act')!r} is not supported (silu only).")
        if arch.sliding_window_key and raw.get(arch.sliding_window_key):
            raise ConfigError(f"{where}: sliding-window attention is not supported; set "
                              f"{arch.sliding_window_key} false.")
        _require(raw, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size"), where)
        heads = _num(raw, "num_attention_heads", where)
        hidden = _num(raw, "hidden_size", where)
        # transformers: head_dim from the key; when it is null, hidden_size // heads; when it is
        # absent, the config class's default (Qwen3Config: 128)
        if "head_dim" in raw or arch.head_dim_if_absent is None:
            head_dim = _num(raw, "head_dim", where, default=hidden // heads)
        else:
            head_dim = arch.head_dim_if_absent
        theta, scaling = _rope(raw, arch.rope_types, where)
        eos = raw.get("eos_token_id")
        layout = {k: bool(raw.get(k, default)) for k, default in arch.layout_keys.items()}
        return cls(
            vocab_size=_num(raw, "vocab_size", where),
            hidden_size=hidden,
            num_hidden_layers=_num(raw, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=_num(raw, "num_key_value_heads", where, default=heads),
            head_dim=head_dim,
            intermediate_size=_num(raw, "intermediate_size", where),
            rms_norm_eps=_num(raw, "rms_norm_eps", where, float, 1e-6),
            rope_theta=theta,
            max_position_embeddings=_num(raw, "max_position_embeddings", where, default=arch.default_max_positions),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            architecture=arch.model_type,
            rope_scaling=scaling,
            **layout,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict for this shape (what the architecture's transformers config accepts)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        arch = self.arch
        rope = self.rope_scaling.to_dict() if self.rope_scaling is not None else {"rope_type": "default"}
        return {
            "architectures": [arch.hf_class],
            "model_type": arch.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            **{k: getattr(self, k) for k in arch.layout_keys},
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)


# Keys of the draft's config.json that DraftConfig models (everything else goes to `extra`).
_DRAFT_KEYS = (
    "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "attention_bias", "block_size",
    "num_target_layers",
)
_DLITE_KEYS = (
    "architecture_version", "model_role", "anchor_group_size", "chs_num_layers", "target_layer_ids",
    "sequential_head", "sequential_rank", "mask_token_id",
)
# Optional dlite_config keys: written only when set (official dlite_v1 configs have none of them).
DRAFT_VOCAB_KEY = "draft_vocab_size"


@dataclass(frozen=True)
class DraftConfig:
    """A dlite_v1 draft: a Qwen3-style config plus ``dlite_config`` (DESIGN 1.1)."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 8
    anchor_group_size: int = 1
    sequential_rank: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    sequential_head: str = "rnn"
    architecture_version: str = ARCHITECTURE_VERSION
    model_role: str = MODEL_ROLE
    # V_d: a reduced draft vocabulary (the head proposes among V_d of the target's V ids, listed by
    # the checkpoint's sequential_head.draft_vocab); None: the full vocabulary, as dlite_v1 ships.
    draft_vocab_size: int | None = None
    # config.json keys not modelled above (transformers_version, torch_dtype, ...), kept verbatim.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
        if self.architecture_version != ARCHITECTURE_VERSION:
            raise ConfigError(
                f"draft architecture_version is {self.architecture_version!r}, expected "
                f"{ARCHITECTURE_VERSION!r}: dlite-trt loads official dlite_v1 checkpoints only; "
                "re-export the draft with the current DLite release."
            )
        if self.model_role != MODEL_ROLE:
            raise ConfigError(
                f"draft model_role is {self.model_role!r}, expected {MODEL_ROLE!r}: this looks like a "
                "teacher or another model's checkpoint; pass the history-free student draft."
            )
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ConfigError(
                f"sequential_head {self.sequential_head!r} is not supported; expected one of {SEQUENTIAL_HEADS}."
            )
        _positive(self, "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "num_target_layers",
                  "anchor_group_size", "sequential_rank")
        if not isinstance(self.block_size, int) or not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be an int in 2..{MAX_BLOCK_SIZE} (1 anchor + K >= 1 proposals; "
                              f"DLite's are 8 or 16), got {self.block_size!r}.")
        _check_attention_shape(self, "draft")
        if not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool) or self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}.")
        self._check_draft_vocab_size()
        expected = select_target_layer_ids(self.num_target_layers, len(self.target_layer_ids))
        if self.target_layer_ids != expected:
            raise ConfigError(
                f"target_layer_ids {list(self.target_layer_ids)} differ from the fixed dlite_v1 selection "
                f"{list(expected)} for a {self.num_target_layers}-layer target with "
                f"chs_num_layers={len(self.target_layer_ids)}; the checkpoint was not trained for this "
                "layout (fix dlite_config.target_layer_ids or retrain)."
            )

    def _check_draft_vocab_size(self) -> None:
        size = self.draft_vocab_size
        if size is None:
            return
        if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= self.vocab_size:
            raise ConfigError(
                f"dlite_config.{DRAFT_VOCAB_KEY} must be an int in [2, vocab_size={self.vocab_size}], got {size!r}; "
                f"set it to the length of sequential_head.draft_vocab, or remove it for a full-vocabulary draft."
            )

    @property
    def head_vocab_size(self) -> int:
        """Rows of the sequential head's prev_token_embedding and output_proj: V_d, else V."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def num_proposals(self) -> int:
        """K: draft tokens proposed after the anchor."""
        return self.block_size - 1

    @property
    def chs_num_layers(self) -> int:
        """S: number of target layers the draft reads at the pivot."""
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "draft config.json") -> DraftConfig:
        dlite = raw.get("dlite_config")
        if not isinstance(dlite, Mapping):
            raise ConfigError(
                f"{where} has no dlite_config block: this is not a DLite draft checkpoint "
                "(an official dlite_v1 config.json carries dlite_config with architecture_version)."
            )
        if dlite.get("architecture_version") != ARCHITECTURE_VERSION:
            raise ConfigError(
                f"{where}: dlite_config.architecture_version is {dlite.get('architecture_version')!r}, "
                f"expected {ARCHITECTURE_VERSION!r}: dlite-trt loads official dlite_v1 checkpoints only; "
                "re-export the draft with the current DLite release."
            )
        if "anchor_group_size" not in dlite:
            raise ConfigError(
                f"{where}: dlite_config has no anchor_group_size (the official dlite_v1 loader requires it). "
                'If the draft was trained with queries [anchor, mask x K] and no token group, add '
                '"anchor_group_size": 1 to dlite_config; otherwise add the G it was trained with.'
            )
        for key, value, want in (("model_type", raw.get("model_type", "qwen3"), "qwen3"),
                                 ("hidden_act", "silu" if raw.get("hidden_act", "silu") in SILU_NAMES
                                  else raw["hidden_act"], "silu"),
                                 ("architectures", raw.get("architectures", [DRAFT_ARCHITECTURE]),
                                  [DRAFT_ARCHITECTURE])):
            if value != want:
                raise ConfigError(f"{where}: {key} is {value!r}, expected {want!r}; this is not a dlite_v1 "
                                  "draft (DLite drafts are Qwen3-style DLiteDraftModel configs).")
        _require(raw, _DRAFT_KEYS, where)
        _require(dlite, _DLITE_KEYS, f"{where} dlite_config")
        layer_ids = dlite["target_layer_ids"]
        if not isinstance(layer_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in layer_ids):
            raise ConfigError(f"{where}: dlite_config.target_layer_ids must be a list of ints, got {layer_ids!r}.")
        if _num(dlite, "chs_num_layers", where) != len(layer_ids):
            raise ConfigError(
                f"{where}: chs_num_layers={dlite['chs_num_layers']} but target_layer_ids has "
                f"{len(dlite['target_layer_ids'])} entries; they must agree."
            )
        known = set(_DRAFT_KEYS) | {"dlite_config", "rope_theta", "architectures", "model_type", "hidden_act"}
        extra = {k: v for k, v in raw.items() if k not in known}
        extra_dlite = {k: v for k, v in dlite.items() if k not in (*_DLITE_KEYS, DRAFT_VOCAB_KEY)}
        if extra_dlite:
            extra["dlite_config"] = extra_dlite
        return cls(
            hidden_size=_num(raw, "hidden_size", where),
            vocab_size=_num(raw, "vocab_size", where),
            num_hidden_layers=_num(raw, "num_hidden_layers", where),
            num_attention_heads=_num(raw, "num_attention_heads", where),
            num_key_value_heads=_num(raw, "num_key_value_heads", where),
            head_dim=_num(raw, "head_dim", where),
            intermediate_size=_num(raw, "intermediate_size", where),
            num_target_layers=_num(raw, "num_target_layers", where),
            target_layer_ids=tuple(dlite["target_layer_ids"]),
            mask_token_id=dlite["mask_token_id"],
            block_size=raw["block_size"],
            anchor_group_size=dlite["anchor_group_size"],
            sequential_rank=dlite["sequential_rank"],
            rms_norm_eps=_num(raw, "rms_norm_eps", where, float),
            rope_theta=_rope(raw, ("default",), where)[0],  # drafts: default RoPE
            attention_bias=bool(raw["attention_bias"]),
            sequential_head=str(dlite["sequential_head"]).lower(),
            architecture_version=dlite["architecture_version"],
            model_role=str(dlite["model_role"]).lower(),
            draft_vocab_size=dlite.get(DRAFT_VOCAB_KEY),
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """The official config.json layout (rope_theta at top level, as the release writes it;
        a rope_parameters block read from a newer file is kept beside it)."""
        extra = dict(self.extra)
        extra_dlite = dict(extra.pop("dlite_config", {}))
        out: dict[str, Any] = {
            "architectures": [DRAFT_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_act": "silu",
            **extra,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dlite_config": {
                **extra_dlite,
                "architecture_version": self.architecture_version,
                "model_role": self.model_role,
                "anchor_group_size": self.anchor_group_size,
                "chs_num_layers": self.chs_num_layers,
                "target_layer_ids": list(self.target_layer_ids),
                "sequential_head": self.sequential_head,
                "sequential_rank": self.sequential_rank,
                "mask_token_id": self.mask_token_id,
                **({} if self.draft_vocab_size is None else {DRAFT_VOCAB_KEY: self.draft_vocab_size}),
            },
        }
        return out

    @classmethod
    def from_json_file(cls, path: Path) -> DraftConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); the checkpoint's config.json is corrupt.") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}.")
        return cls.from_dict(raw, where=str(path))

    def replace(self, **changes: Any) -> DraftConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, target: TargetSpec, *, num_hidden_layers: int = 5, chs_num_layers: int = 5,
                   mask_token_id: int, **overrides: Any) -> DraftConfig:
        """A draft shaped for ``target`` (the layout the DLite release uses for Qwen3)."""
        fields: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=select_target_layer_ids(target.num_hidden_layers, chs_num_layers),
            mask_token_id=mask_token_id,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )
        fields.update(overrides)
        return cls(**fields)
