"""``manifest.json``: what an engine directory holds and what it was built from.

The manifest makes an engine self-describing (DESIGN 2): build settings, package versions,
the I/O contract of every graph, block size, dtype, weight format (``WeightFormat``), limits, the sha256 of the target and
draft weights, and the size and sha256 of every file in the directory. ``load_manifest``
refuses engines that are incomplete, corrupt, or written by an incompatible dlite-trt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlite_trt import __version__
from dlite_trt.config import DraftConfig, TargetSpec
from dlite_trt.dtypes import WEIGHT_FORMATS
from dlite_trt.engine.weights import WEIGHTS_FILE
from dlite_trt.errors import DLiteError, EngineError
from dlite_trt.export.contract import ATTENTIONS, GRAPH_NAMES, EngineLimits, GraphSpec, engine_contract
from dlite_trt.export.nbits_levels import (
    ACCURACY_LEVELS,
    DRAFT_FORMATS,
    FP32_COMPUTE,
    HEAD_WEIGHTS,
    INT8_ACTIVATIONS,
    PREFILL_WEIGHTS,
    ZP_SCHEME,
)
from dlite_trt.targets import RANDOM_WEIGHTS_SEED, TargetSource

MANIFEST = "manifest.json"
FORMAT = "dlite-trt-engine"
FORMAT_VERSION = 7  # bump when the graph I/O or directory layout changes incompatibly
# 4: "attention" (its "gqa" graphs return the cache buffers they write). 5: "gqa" graphs rotate inside
# GroupQueryAttention and return no new_key / new_value. 6: "decode" is greedy (no temperature or
# uniforms) and "decode_sampling" samples, as prefill and step; every earlier engine lacks that graph.
# 7: the greedy "step" takes "next_width" and drafts only that many (next_block [B, D + 1])
READ_FORMAT_VERSIONS = (FORMAT_VERSION,)
GRAPH_DIR = "graphs"  # graphs/{name}.onnx, graphs/{name}.ort.onnx, graphs/weights.bin
HASH_AT_LOAD_MAX_BYTES = 64 << 20  # files up to this size are hashed on every load; larger ones on verify
BACKEND_DTYPES = {"onnxruntime": ("fp32", "fp16"), "tensorrt": ("fp32", "fp16", "bf16")}  # what each builds
BACKEND_WEIGHTS = {"onnxruntime": WEIGHT_FORMATS, "tensorrt": ("float",)}  # int4: MatMulNBits, ONNX Runtime only
GQA_BUILDS = (("onnxruntime", "fp32"),)  # (backend, dtype) of engines attention "gqa" runs in (int4 included)
QUANTIZED_DRAFT_BUILDS = (("onnxruntime", "fp32"),)  # where the draft's matrices may run on MatMulNBits (int4 too)


WEIGHT_ORIGINS = ("gguf", "round-to-nearest")  # int4: the GGUF's own blocks, or quantized at build
HEAD_FORMATS = ("float", *HEAD_WEIGHTS)  # int4: the LM head in the engine's dtype, or Q8_0 / Q4_0 blocks
ACCURACY_MEANING = {INT8_ACTIVATIONS: "int8 activations in the quantized matmuls (accuracy level 4)",
                    FP32_COMPUTE: "fp32 compute in the quantized matmuls (accuracy level 0, weight-only)"}


@dataclass(frozen=True)
class WeightFormat:
    """How the engine stores its weights (``dtype`` stays the precision of the activations between
    the matmuls and of the KV cache).

    ``format`` "float": every weight in ``dtype``. "int4": the target's projection matrices in ggml
    4-bit blocks (``schemes``, e.g. Q4_1) on ONNX Runtime's MatMulNBits, from ``origin``: the GGUF's
    own blocks (``gguf_sha256``) or round-to-nearest at build; run at MatMulNBits ``accuracy_level``
    4 (int8 activations per block) or 0 (fp32 compute); ``head`` "Q8_0": the LM head as 8-bit
    blocks from the same origin, "Q4_0": as 4-bit symmetric blocks round-to-nearest (both level 4
    only), "float": in ``dtype``; everything else in ``dtype``.
    ``draft`` "Q8_0" / "Q4_1" (any format; in an int4 engine at level 4 only): the draft's
    ``draft_matrices`` matrices (its layers' projections and its head's output projection)
    round-to-nearest in those blocks, run at accuracy level 4; "float": in ``dtype``.
    An int4 record always states its accuracy level and head (``from_dict`` refuses one without:
    an engine built one way is never read as the other); one without ``draft`` was built before the
    draft could be quantized, and its draft is float."""

    format: str = "float"
    schemes: tuple[str, ...] = ()
    origin: str | None = None
    matrices: int = 0  # target matrices stored int4
    gguf_sha256: str | None = None
    accuracy_level: int | None = None  # int4: MatMulNBits accuracy_level (export/int4.ACCURACY_LEVELS)
    head: str = "float"  # int4: the LM head's format (HEAD_FORMATS)
    draft: str = "float"  # int4: the draft's format (DRAFT_FORMATS)
    draft_matrices: int = 0  # int4: draft matrices stored in ``draft`` blocks
    prefill: str = "int4"  # int4: how the prefill graphs multiply by the target's matrices (PREFILL_WEIGHTS)

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise EngineError(f"weight format must be one of {WEIGHT_FORMATS}, got {self.format!r}")
        quantized = self.format != "float"
        if not quantized == bool(self.schemes) == (self.origin is not None) == (self.matrices > 0) \
                == (self.accuracy_level is not None):
            raise EngineError(f"weight format {self.format!r} with schemes {self.schemes}, origin {self.origin!r}, "
                              f"{self.matrices} matrices, accuracy level {self.accuracy_level!r} is inconsistent")
        if self.origin is not None and self.origin not in WEIGHT_ORIGINS:
            raise EngineError(f"weight origin must be one of {WEIGHT_ORIGINS}, got {self.origin!r}")
        if (self.origin == "gguf") != (self.gguf_sha256 is not None):
            raise EngineError("int4 weights from a GGUF record its sha256, and only those")
        if self.accuracy_level is not None and self.accuracy_level not in ACCURACY_LEVELS:
            raise EngineError(f"int4 accuracy level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level!r}")
        if self.head not in HEAD_FORMATS or (self.head != "float" and self.accuracy_level != INT8_ACTIVATIONS):
            raise EngineError(f"LM head format must be one of {HEAD_FORMATS}, quantized only at accuracy level "
                              f"{INT8_ACTIVATIONS}; got {self.head!r} at level {self.accuracy_level!r}")
        if self.draft not in DRAFT_FORMATS or (self.draft != "float") != (self.draft_matrices > 0) or (
                self.draft != "float" and quantized and self.accuracy_level != INT8_ACTIVATIONS):
            raise EngineError(f"draft format must be one of {DRAFT_FORMATS} (with its matrix count; in an int4 engine "
                              f"quantized only at accuracy level {INT8_ACTIVATIONS}); got {self.draft!r}, "
                              f"{self.draft_matrices} matrices at level {self.accuracy_level!r}")
        if self.prefill not in PREFILL_WEIGHTS or (self.prefill == "int8" and not (
                quantized and self.accuracy_level == INT8_ACTIVATIONS)):
            raise EngineError(f"prefill weights must be one of {PREFILL_WEIGHTS}, int8 only in an int4 engine at "
                              f"accuracy level {INT8_ACTIVATIONS}; got {self.prefill!r} at level {self.accuracy_level!r}")

    def describe(self, dtype: str) -> str:
        """``fp32`` / ``int4 weights (Q4_1 from the GGUF, exact, 210 target matrices; LM head Q8_0),
        int8 activations in the quantized matmuls (accuracy level 4), fp32 elsewhere``."""
        draft = f"draft {self.draft} ({self.draft_matrices} matrices)" if self.draft != "float" else f"draft {dtype}"
        if self.format == "float":
            return dtype if self.draft == "float" else f"{dtype}; {draft}, {ACCURACY_MEANING[INT8_ACTIVATIONS]}"
        refit = "re-fitted from the GGUF's blocks" if ZP_SCHEME in self.schemes else "from the GGUF, exact"
        origin = refit if self.origin == "gguf" else "quantized round-to-nearest at build"
        head = f"LM head {self.head}" if self.head != "float" else f"LM head {dtype}"
        prefill = "; the prefill's products int8 x int8" if self.prefill == "int8" else ""
        return (f"{self.format} weights ({'/'.join(self.schemes)} {origin}, {self.matrices} target matrices; {head}; "
                f"{draft}), {ACCURACY_MEANING[self.accuracy_level]}{prefill}, {dtype} elsewhere")

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "schemes": list(self.schemes), "origin": self.origin,
                "matrices": self.matrices, "gguf_sha256": self.gguf_sha256,
                "accuracy_level": self.accuracy_level, "head": self.head, "draft": self.draft,
                "draft_matrices": self.draft_matrices, "prefill": self.prefill}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "manifest") -> WeightFormat:
        if data["format"] != "float" and not {"accuracy_level", "head"} <= set(data):
            raise EngineError(f"{where}: this {data['format']} engine does not record its MatMulNBits accuracy level "
                              "and LM head format (it was built by an earlier dlite-trt); rebuild it with "
                              "`dlite-trt build --dtype int4`.")
        return cls(format=data["format"], schemes=tuple(data["schemes"]), origin=data["origin"],
                   matrices=data["matrices"], gguf_sha256=data["gguf_sha256"],
                   accuracy_level=data.get("accuracy_level"), head=data.get("head", "float"),
                   draft=data.get("draft", "float"), draft_matrices=data.get("draft_matrices", 0),
                   prefill=data.get("prefill", "int4"))  # recorded since the prefill could run int8


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(files: Iterable[Path]) -> str:
    """One digest over a checkpoint's weight files (names and contents, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def checkpoint_sha256(directory: Path) -> str:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise EngineError(f"{directory} holds no *.safetensors weights to hash.")
    return weights_sha256(files)


def target_sha256(source: TargetSource) -> str:
    """The identity recorded for a target: its weights' sha256, or for a --random-weights target
    (whose weights are seeded) its preset name and seed."""
    if source.is_random:
        return f"random-weights:{source.name}:seed={RANDOM_WEIGHTS_SEED}"
    return checkpoint_sha256(source.path)


@dataclass(frozen=True)
class Manifest:
    backend: str
    dtype: str
    limits: EngineLimits
    target_name: str
    target_spec: TargetSpec
    target_sha256: str
    draft_config: DraftConfig
    draft_sha256: str
    stop_token_ids: tuple[int, ...]
    graphs: dict[str, dict[str, str]]  # graph -> {"onnx": relpath, "runtime": relpath}
    contract: dict[str, GraphSpec]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relpath -> {"bytes", "sha256"}
    versions: dict[str, str] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    weights: WeightFormat = WeightFormat()
    attention: str = "ops"  # export/contract.py ATTENTIONS; "gqa": ONNX Runtime engines only
    dlite_trt_version: str = __version__
    format_version: int = FORMAT_VERSION

    @property
    def prefill_differs(self) -> bool:
        """Whether the prefill graphs multiply by the target's matrices otherwise than the decode graphs (an
        int8 prefill): then every prompt goes through a prefill graph, whatever decodes it."""
        return self.weights.prefill == "int8"

    @property
    def block_size(self) -> int:
        return self.draft_config.block_size

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "dlite_trt_version": self.dlite_trt_version,
            "backend": self.backend,
            "dtype": self.dtype,
            "weights": self.weights.to_dict(),
            "attention": self.attention,
            "limits": self.limits.to_dict(),
            "block_size": self.block_size,
            "target": {"name": self.target_name, "config": self.target_spec.to_hf_config(),
                       "sha256": self.target_sha256},
            # draft_vocab_size: V_d of a reduced draft vocabulary, null for the full vocabulary (also in the
            # config; the draft vocabulary itself is in the draft's weights, which sha256 covers)
            "draft": {"config": self.draft_config.to_dict(), "sha256": self.draft_sha256,
                      "draft_vocab_size": self.draft_config.draft_vocab_size},
            "stop_token_ids": list(self.stop_token_ids),
            "graphs": self.graphs,
            "contract": {name: g.to_dict() for name, g in self.contract.items()},
            "files": self.files,
            "versions": self.versions,
            "build": self.build,
        }

    def check_consistent(self, where: str) -> None:
        """The fields agree with each other: backend/dtype known, one file per graph listed in
        ``files``, and the stored contract equal to the one the configs and limits give."""
        if self.dtype not in BACKEND_DTYPES.get(self.backend, ()):
            raise EngineError(f"{where}: backend {self.backend!r} with dtype {self.dtype!r} is not something this "
                              f"dlite-trt runs ({BACKEND_DTYPES}). Rebuild the engine.")
        if self.weights.format not in BACKEND_WEIGHTS.get(self.backend, ()) or (
                self.weights.format == "int4" and self.dtype != "fp32"):
            raise EngineError(f"{where}: a {self.backend} {self.dtype} engine with {self.weights.format} weights is not "
                              f"something this dlite-trt runs ({BACKEND_WEIGHTS}; int4 with fp32). Rebuild the engine.")
        if set(self.graphs) != set(GRAPH_NAMES) or set(self.contract) != set(GRAPH_NAMES):
            raise EngineError(f"{where} lists graphs {sorted(self.graphs)} / contracts {sorted(self.contract)}, "
                              f"expected {list(GRAPH_NAMES)}; the manifest is corrupt. Rebuild the engine.")
        for name, paths in self.graphs.items():
            if not isinstance(paths, dict) or set(paths) != {"onnx", "runtime"}:
                raise EngineError(f"{where}: graph {name} must record its 'onnx' and 'runtime' files, got {paths!r}; "
                                  "the manifest is corrupt. Rebuild the engine.")
            missing = [rel for rel in (*paths.values(), f"{GRAPH_DIR}/{WEIGHTS_FILE}") if rel not in self.files]
            if missing:
                raise EngineError(f"{where}: graph files {missing} of {name} are not among the manifest's hashed files; "
                                  "the manifest is corrupt. Rebuild the engine.")
        if self.attention not in ATTENTIONS or (self.attention == "gqa" and (self.backend, self.dtype) not in GQA_BUILDS):
            raise EngineError(f"{where}: a {self.backend} {self.dtype} engine with attention {self.attention!r} is not "
                              f"something this dlite-trt runs (attention {' or '.join(ATTENTIONS)}; gqa in "
                              f"{GQA_BUILDS}). Rebuild the engine.")
        if self.weights.draft != "float" and (self.backend, self.dtype) not in QUANTIZED_DRAFT_BUILDS:
            raise EngineError(f"{where}: a {self.backend} {self.dtype} engine with a {self.weights.draft} draft is not "
                              f"something this dlite-trt runs (quantized drafts in {QUANTIZED_DRAFT_BUILDS}). Rebuild "
                              "the engine.")
        want = engine_contract(self.target_spec, self.draft_config, self.limits, self.dtype, self.attention)
        if {n: g.to_dict() for n, g in want.items()} != {n: g.to_dict() for n, g in self.contract.items()}:
            raise EngineError(f"{where}: the I/O contract does not match the target/draft configs and limits it "
                              "records; the manifest was edited or is corrupt. Rebuild the engine.")

    @classmethod
    def from_dict(cls, data: Mapping, where: str) -> Manifest:
        try:
            if data.get("format") != FORMAT:
                raise EngineError(f"{where} is not a dlite-trt engine manifest (format={data.get('format')!r}).")
            version = data.get("format_version")
            if version not in READ_FORMAT_VERSIONS:
                raise EngineError(
                    f"{where} was written by dlite-trt {data.get('dlite_trt_version', '?')} in engine format "
                    f"{version}; this dlite-trt {__version__} reads formats {READ_FORMAT_VERSIONS}. Rebuild the engine "
                    "with `dlite-trt build`.")
            manifest = cls(
                backend=data["backend"], dtype=data["dtype"], limits=EngineLimits(**data["limits"]),
                target_name=data["target"]["name"],
                target_spec=TargetSpec.from_hf_config(data["target"]["config"], where=f"{where} target"),
                target_sha256=data["target"]["sha256"],
                draft_config=DraftConfig.from_dict(data["draft"]["config"], where=f"{where} draft"),
                draft_sha256=data["draft"]["sha256"],
                stop_token_ids=tuple(data["stop_token_ids"]), graphs=dict(data["graphs"]),
                contract={name: GraphSpec.from_dict(name, g) for name, g in data["contract"].items()},
                files=dict(data["files"]), versions=dict(data["versions"]), build=dict(data["build"]),
                # absent: an engine built before weight formats, all float
                weights=WeightFormat.from_dict(data["weights"], where) if "weights" in data else WeightFormat(),
                attention=data["attention"], dlite_trt_version=data["dlite_trt_version"], format_version=version)
            manifest.check_consistent(where)
            if data["draft"].get("draft_vocab_size", manifest.draft_config.draft_vocab_size) \
                    != manifest.draft_config.draft_vocab_size:
                raise EngineError(f"{where}: draft_vocab_size {data['draft']['draft_vocab_size']!r} differs from the "
                                  "draft config's; the manifest was edited or is corrupt. Rebuild the engine.")
            return manifest
        except EngineError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = exc if not isinstance(exc, DLiteError) else str(exc)
            raise EngineError(f"{where} is incomplete or corrupt ({detail!r}); rebuild the engine.") from exc


def write_manifest(engine_dir: Path, manifest: Manifest) -> Path:
    path = engine_dir / MANIFEST
    path.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return path


def file_records(engine_dir: Path, relpaths: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {rel: {"bytes": (engine_dir / rel).stat().st_size, "sha256": sha256_file(engine_dir / rel)}
            for rel in sorted(relpaths)}


def load_manifest(engine_dir: Path, *, verify: bool = False) -> Manifest:
    """Read and check an engine directory's manifest and files.

    Every listed file must exist with its recorded size; files up to 64 MiB (graphs, configs,
    tokenizer) are also hashed, and with ``verify=True`` every file is.
    """
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; build one with `dlite-trt build`.")
    if not path.is_file():
        raise EngineError(f"{engine_dir} has no {MANIFEST}: it is not an engine directory or its build did not "
                          "finish. Rebuild it with `dlite-trt build`.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} is not valid JSON ({exc}); the engine is corrupt. Rebuild it.") from exc
    if not isinstance(data, dict):
        raise EngineError(f"{path} must hold a JSON object; the engine is corrupt. Rebuild it.")
    manifest = Manifest.from_dict(data, str(path))
    for rel, record in manifest.files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise EngineError(f"{path} lists the file {rel!r} outside the engine directory; the manifest is corrupt "
                              "or was tampered with. Rebuild the engine.")
        file = engine_dir / rel
        if not file.is_file():
            raise EngineError(f"engine file {file} is missing; the engine directory is incomplete. Rebuild it.")
        size = file.stat().st_size
        if size != record["bytes"]:
            raise EngineError(f"engine file {file} has {size} bytes, the manifest records {record['bytes']}: it is "
                              "truncated or was replaced. Rebuild the engine.")
        if (verify or size <= HASH_AT_LOAD_MAX_BYTES) and sha256_file(file) != record["sha256"]:
            raise EngineError(f"engine file {file} does not match its sha256 in the manifest: it is corrupt or "
                              "was modified. Rebuild the engine.")
    return manifest


def check_sources(manifest: Manifest, *, target_sha256: str | None, draft_sha256: str | None,
                  where: str) -> None:
    """Refuse to pair an engine with a target or draft other than the ones it was built from."""
    for what, given, built in (("target", target_sha256, manifest.target_sha256),
                               ("draft", draft_sha256, manifest.draft_sha256)):
        if given is not None and given != built:
            raise EngineError(
                f"the engine {where} was built from a different {what} (sha256 {built[:16]}..., "
                f"given {given[:16]}...); rebuild it with `dlite-trt build` for this {what}, or drop --{what}.")
