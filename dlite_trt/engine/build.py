"""``dlite-trt build``: target + draft -> an engine directory.

Layout of an engine directory (backend onnxruntime):
    manifest.json                 build settings, versions, I/O contract, hashes (engine/manifest.py)
    graphs/{prefill,step,decode}.onnx      the exported graphs (ORT lowering of LowRankRecurrence)
    graphs/{prefill,step,decode}.ort.onnx  the same, optimized by ONNX Runtime
    graphs/weights.bin            every weight of those six graphs, each distinct tensor once
    target/                       the target's config, generation config and tokenizer (no weights)
    draft/config.json             the draft's config
The directory is built next to ``out`` and moved into place when complete, so a failed build
never leaves a half-written engine or destroys the previous one.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from dlite_trt.engine.manifest import (
    BACKEND_DTYPES,
    BACKEND_WEIGHTS,
    GRAPH_DIR,
    GQA_BUILDS,
    MANIFEST,
    QUANTIZED_DRAFT_BUILDS,
    Manifest,
    WeightFormat,
    checkpoint_sha256,
    file_records,
    target_sha256,
    write_manifest,
)
from dlite_trt.engine.weights import pack_weights
from dlite_trt.errors import ConfigError, EngineError
from dlite_trt.export.cache_attention import GQA_HEAD_DIM_MULTIPLE, GQA_UNAVAILABLE, onnxruntime_takes_query_seqlens
from dlite_trt.export.contract import ATTENTIONS, GRAPH_NAMES, SAMPLING_SUFFIX, EngineLimits, engine_contract
from dlite_trt.export.int4 import ACCURACY_LEVELS, DRAFT_FORMATS, draft_only, plan_int4, quantize_graph, with_draft
from dlite_trt.export.nbits_levels import (
    BLOCK_FORMS,
    DEFAULT_BLOCKS,
    DEFAULT_HEAD,
    FP32_COMPUTE,
    HEAD_WEIGHTS,
    INT8_ACTIVATIONS,
    PREFILL_WEIGHTS,
    default_accuracy_level,
    default_draft_format,
    default_prefill_weights,
)
from dlite_trt.paths import writable_dir
from dlite_trt.runtime.verify_width import WIDTH_FILE

BACKENDS = tuple(BACKEND_DTYPES)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".ckpt")


@dataclass(frozen=True)
class BuildSettings:
    backend: str = "onnxruntime"
    dtype: str = "fp32"  # activations and KV cache (and every weight, unless `weights` says otherwise)
    weights: str = "float"  # "int4": the target's projections 4-bit weight-only (export/int4.py)
    # int4: MatMulNBits accuracy_level, 4 (and a quantized head) or 0; None: default_accuracy_level(attention), at build
    int4_accuracy_level: int | None = None
    # the draft's matrices, one of DRAFT_FORMATS (quantized: QUANTIZED_DRAFT_BUILDS); None: default_draft_format()
    draft_weights: str | None = None
    # int4: the target's blocks, one of BLOCK_FORMS (export/nbits_levels.py)
    int4_blocks: str = DEFAULT_BLOCKS
    # int4 at accuracy level 4: the LM head's blocks, one of HEAD_WEIGHTS; None: DEFAULT_HEAD
    head_weights: str | None = None
    # int4: the prefill's products of the target's matrices, one of PREFILL_WEIGHTS; None: default_prefill_weights()
    prefill_weights: str | None = None
    # how the target attends over the KV cache (export/contract.py ATTENTIONS); None: default_attention(),
    # chosen at build time (it depends on the target's head_dim)
    attention: str | None = None
    limits: EngineLimits = EngineLimits()
    random_weights: bool = False
    workspace_gb: float = 8.0  # tensorrt: builder workspace
    timing_cache: Path | None = None  # tensorrt: read, then updated
    # True: limits.max_seq_len is an upper bound, lowered to the target's max_position_embeddings
    # (the default of `dlite-trt build`); False: exactly that, or an error past the target's positions
    fit_seq_len_to_target: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in BACKEND_DTYPES[self.backend]:
            raise ConfigError(f"the {self.backend} backend builds {BACKEND_DTYPES[self.backend]}, not {self.dtype!r}")
        if self.weights not in BACKEND_WEIGHTS[self.backend]:
            raise ConfigError(f"the {self.backend} backend builds {BACKEND_WEIGHTS[self.backend]} weights, not "
                              f"{self.weights!r} (int4 runs on ONNX Runtime's MatMulNBits)")
        if self.weights == "int4" and self.dtype != "fp32":
            raise ConfigError(f"int4 weights run with fp32 activations, not {self.dtype}")
        if self.attention is not None and self.attention not in ATTENTIONS:
            raise ConfigError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.attention == "gqa" and (self.backend, self.dtype) not in GQA_BUILDS:
            raise ConfigError(f"attention 'gqa' is ONNX Runtime's GroupQueryAttention in fp32 (and int4) engines, not "
                              f"a {self.backend} {self.dtype} one; use attention 'ops'")
        if self.attention == "gqa" and not onnxruntime_takes_query_seqlens():
            raise ConfigError(GQA_UNAVAILABLE)
        if self.int4_accuracy_level is not None and self.int4_accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"the int4 accuracy level must be one of {ACCURACY_LEVELS}, got "
                              f"{self.int4_accuracy_level!r}")
        if self.int4_blocks not in BLOCK_FORMS:
            raise ConfigError(f"int4 blocks must be one of {BLOCK_FORMS}, got {self.int4_blocks!r}")
        if self.head_weights is not None and self.head_weights not in HEAD_WEIGHTS:
            raise ConfigError(f"the LM head's weights are one of {HEAD_WEIGHTS}, not {self.head_weights!r}")
        if self.head_weights is not None and (self.weights != "int4" or self.int4_accuracy_level == FP32_COMPUTE):
            raise ConfigError(f"--head-weights {self.head_weights}: the LM head is quantized in int4 engines at "
                              f"accuracy level {INT8_ACTIVATIONS} only (elsewhere it stays in the engine's dtype)")
        if self.prefill_weights is not None and self.prefill_weights not in PREFILL_WEIGHTS:
            raise ConfigError(f"the prefill's weights are one of {PREFILL_WEIGHTS}, not {self.prefill_weights!r}")
        if self.prefill_weights is not None and (self.weights != "int4" or (
                self.prefill_weights == "int8" and self.int4_accuracy_level == FP32_COMPUTE)):
            raise ConfigError(f"--prefill-weights {self.prefill_weights}: the prefill's products are chosen in int4 "
                              f"engines (int8 at accuracy level {INT8_ACTIVATIONS} only); elsewhere they run in the "
                              "engine's dtype")
        if self.draft_weights is not None and self.draft_weights not in DRAFT_FORMATS:
            raise ConfigError(f"the draft's weights are one of {DRAFT_FORMATS}, not {self.draft_weights!r}")
        if self.draft_weights not in (None, "float") and (self.backend, self.dtype) not in QUANTIZED_DRAFT_BUILDS:
            raise ConfigError(f"a {self.draft_weights} draft runs on ONNX Runtime's MatMulNBits with fp32 activations "
                              f"({QUANTIZED_DRAFT_BUILDS}), not in a {self.backend} {self.dtype} engine; use "
                              "--draft-weights float there")
        if self.draft_weights not in (None, "float") and self.weights == "int4" and \
                self.int4_accuracy_level == FP32_COMPUTE:
            raise ConfigError(f"a {self.draft_weights} draft runs at int4 accuracy level {INT8_ACTIVATIONS} only (at "
                              f"level {FP32_COMPUTE} a product of more than one row dequantizes the whole matrix "
                              "first); use --draft-weights float there")


def default_attention(backend: str, dtype: str, head_dim: int) -> str:
    """GroupQueryAttention wherever it runs (ONNX Runtime fp32 and int4 engines, an ONNX Runtime with
    query_seqlens, a head_dim its CPU kernel takes): every key at its own slot makes a verify and a decode
    call compute a position alike (int4 accuracy level 4 lossless), and on this CPU it is the faster one
    since RoPE went inside it (fp32 SmolLM2, 2 threads: a decode call 0.90x the standard ops' at 256
    cached tokens, 1.00x at 2,048, a 3,900-token prefill 0.58x; docs/engine.md). Standard ops elsewhere
    (TensorRT, fp16, other head sizes)."""
    runs = (backend, dtype) in GQA_BUILDS and head_dim % GQA_HEAD_DIM_MULTIPLE == 0
    return "gqa" if runs and onnxruntime_takes_query_seqlens() else "ops"


def resolve(settings: BuildSettings, head_dim: int) -> BuildSettings:
    """``settings`` with the attention and the int4 accuracy level chosen for a target of ``head_dim``
    (their defaults where not given: ``default_attention``, ``default_accuracy_level``)."""
    attention = settings.attention or default_attention(settings.backend, settings.dtype, head_dim)
    if attention == "gqa" and head_dim % GQA_HEAD_DIM_MULTIPLE:
        raise ConfigError(f"attention 'gqa': ONNX Runtime's GroupQueryAttention takes a head_dim that is a multiple "
                          f"of {GQA_HEAD_DIM_MULTIPLE}, this target's is {head_dim}; use attention 'ops'")
    level = default_accuracy_level(attention) if settings.int4_accuracy_level is None else settings.int4_accuracy_level
    quantizable = (settings.backend, settings.dtype) in QUANTIZED_DRAFT_BUILDS
    draft = settings.draft_weights or default_draft_format(settings.weights, level, quantizable)
    prefill = settings.prefill_weights or (default_prefill_weights(level) if settings.weights == "int4" else None)
    return replace(settings, attention=attention, int4_accuracy_level=level, draft_weights=draft,
                   prefill_weights=prefill)  # checked again


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for pkg in ("dlite-trt", "torch", "transformers", "onnx", "onnxruntime", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return versions


def optimize_for_onnxruntime(src: Path, dst: Path) -> None:
    """Let ONNX Runtime optimize a graph (function inlined, fusions applied), add the fusions it leaves
    and drop the nodes nothing reads (``export/ort_fusions.py``) and save the result."""
    import onnx
    import onnxruntime as ort

    from dlite_trt.export.ort_fusions import drop_unread_nodes, fuse_skip_norms

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # portable across CPUs
    so.optimized_model_filepath = str(dst)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    model = onnx.load(str(dst), load_external_data=False)  # the weights stay in dst's data file, untouched
    if fuse_skip_norms(model) + drop_unread_nodes(model):
        onnx.save_model(model, str(dst))


def _copy_configs(src: Path | None, dst: Path) -> None:
    """Config, generation config and tokenizer files of a model directory (never weights)."""
    dst.mkdir(parents=True, exist_ok=True)
    if src is None:
        return
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json") \
                and f.stat().st_size <= 64 << 20:
            shutil.copy2(f, dst / f.name)


ENGINE_ENTRIES = (MANIFEST, GRAPH_DIR, "target", "draft", WIDTH_FILE)  # what a build writes in --out


def _prepare_out(out: Path) -> None:
    """Refuse an --out that a build would lose something in (a rebuild replaces the whole directory),
    or cannot write in, before any work."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise EngineError(f"--out {out} exists and is not an engine directory; refusing to overwrite it. "
                          "Pass a new or empty directory.")
    others = sorted(p.name for p in out.iterdir() if p.name not in ENGINE_ENTRIES) if out.is_dir() else []
    if others:
        raise EngineError(f"--out {out} is an engine directory that also holds {', '.join(others[:5])}"
                          f"{' ...' if len(others) > 5 else ''}, which a rebuild would delete; move them out of it "
                          "or pass another --out.")
    writable_dir(out.parent, f"--out {out}")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished build into place, replacing a previous engine only once the new one is complete."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp, *tmp.rglob("*")]:  # mkdtemp and some writers create private (0700/0600) entries
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    backup = None
    if out.exists():
        backup = out.with_name(f".{out.name}.old-{int(time.time())}")
        out.rename(backup)
    try:
        tmp.rename(out)
    except OSError:
        if backup is not None:  # put the previous engine back
            backup.rename(out)
        raise
    if backup is not None:
        shutil.rmtree(backup)


def build_engine(target: str | Path, draft: Path, out: Path, settings: BuildSettings = BuildSettings(), *,
                 progress: bool = True, calibrate: Callable[[Path], object] | None = None) -> Manifest:
    """Export the engine graphs for ``target`` + ``draft``, optimize them, write ``out``.
    ``calibrate``: run on the complete engine (its directory) before it is moved to ``out``, so
    that nothing can open the engine before its verify width is written (a bench started while a
    build calibrated once ran DLite uncalibrated)."""
    from dlite_trt.engine.progress import stages
    from dlite_trt.export.onnx_export import export_graph
    from dlite_trt.loading import load_pair
    from dlite_trt.targets import stop_token_ids

    started = time.perf_counter()
    out = Path(out)
    _prepare_out(out)
    backend_info = {}
    if settings.backend == "tensorrt":  # before any work: TensorRT and a GPU, or a clear error
        from dlite_trt.engine.tensorrt_build import require_tensorrt

        backend_info = require_tensorrt()
    limits = settings.limits
    out.parent.mkdir(parents=True, exist_ok=True)
    int4 = settings.weights == "int4"
    with stages(progress, total=2 + int4 + len(GRAPH_NAMES) + (calibrate is not None)) as advance:
        advance("loading target and draft")
        pair = load_pair(target, Path(draft), dtype=settings.dtype, random_weights=settings.random_weights,
                         progress=progress)
        spec, cfg = pair.source.spec, pair.generator.draft.cfg
        if settings.fit_seq_len_to_target:
            limits = replace(limits, max_seq_len=min(limits.max_seq_len, spec.max_position_embeddings))
        if cfg.block_size >= limits.max_seq_len:
            raise ConfigError(f"the draft's blocks of {cfg.block_size} tokens do not fit --max-seq-len "
                              f"{limits.max_seq_len}; raise --max-seq-len (a prompt and its answer share it).")
        if limits.max_seq_len > spec.max_position_embeddings:
            raise ConfigError(f"--max-seq-len {limits.max_seq_len} is past the target's max_position_embeddings="
                              f"{spec.max_position_embeddings}; lower it.")
        settings = resolve(settings, spec.head_dim)
        contract = engine_contract(spec, cfg, limits, settings.dtype, settings.attention)
        plan, weights = None, WeightFormat()
        if int4:
            advance("int4: the target's projection matrices in 4-bit blocks (a GGUF's own, else round-to-nearest)")
            plan = with_draft(plan_int4(pair.generator.target, spec, pair.source.path, settings.int4_accuracy_level,
                                        settings.int4_blocks, settings.head_weights or DEFAULT_HEAD),
                              pair.generator.draft, settings.draft_weights)
            plan = replace(plan, prefill=settings.prefill_weights)
            weights = WeightFormat("int4", plan.schemes, plan.origin, len(plan.matrices), plan.gguf_sha256,
                                   plan.accuracy_level, plan.head_format, plan.draft_format, len(plan.draft),
                                   plan.prefill)
        elif settings.draft_weights != "float":
            plan = with_draft(draft_only(), pair.generator.draft, settings.draft_weights)
            weights = WeightFormat(draft=plan.draft_format, draft_matrices=len(plan.draft))
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        try:
            def graph_job(name: str) -> dict[str, str]:
                """Export one graph, then optimize it for ONNX Runtime or build its TensorRT plan."""
                onnx_rel = f"{GRAPH_DIR}/{name}.onnx"
                export_graph(contract[name], pair.generator.target, pair.generator.draft, tmp / onnx_rel,
                             lowering=settings.backend)
                if plan is not None:
                    quantize_graph(tmp / onnx_rel, plan, prefill=name.removesuffix(SAMPLING_SUFFIX) == "prefill")
                if settings.backend == "tensorrt":
                    from dlite_trt.engine.tensorrt_build import build_plan

                    runtime_rel = f"{GRAPH_DIR}/{name}.plan"
                    build_plan(tmp / onnx_rel, tmp / runtime_rel, contract[name], workspace_gb=settings.workspace_gb,
                               timing_cache=settings.timing_cache)
                else:
                    runtime_rel = f"{GRAPH_DIR}/{name}.ort.onnx"
                    optimize_for_onnxruntime(tmp / onnx_rel, tmp / runtime_rel)
                return {"onnx": onnx_rel, "runtime": runtime_rel}

            what = "optimizing" if settings.backend == "onnxruntime" else "building the TensorRT plan of"
            graphs = {}
            for name in GRAPH_NAMES:
                advance(f"exporting and {what} the {name} graph")
                graphs[name] = graph_job(name)
            advance("sharing weights between graphs, hashing files")
            pack_weights([tmp / rel for paths in graphs.values() for rel in paths.values() if rel.endswith(".onnx")])
            _copy_configs(pair.source.path, tmp / "target")
            (tmp / "draft").mkdir()
            shutil.copy2(Path(draft) / "config.json", tmp / "draft" / "config.json")
            manifest = Manifest(
                backend=settings.backend, dtype=settings.dtype, limits=limits, target_name=pair.source.name,
                target_spec=spec,
                target_sha256=target_sha256(pair.source),
                draft_config=cfg, draft_sha256=checkpoint_sha256(Path(draft)),
                stop_token_ids=stop_token_ids(pair.source, pair.tokenizer), graphs=graphs, contract=contract,
                files=file_records(tmp, [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()]),
                versions=package_versions(), weights=weights, attention=settings.attention,
                build={"seconds": round(time.perf_counter() - started, 2), "random_weights": settings.random_weights,
                       "target": str(target), "draft": str(draft), "machine": platform.machine(), **backend_info})
            write_manifest(tmp, manifest)
            if calibrate is not None:
                advance("calibrating the verify width on this machine")
                calibrate(tmp)
            _install(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return manifest
