"""Write a Triton model repository that serves an engine directory through dlite-trt's runtime.

    REPO/dlite/config.pbtxt            the request/response tensors (serve.protocol), batching and
                                       instances, from the engine's manifest and I/O contract
    REPO/dlite/1/model.py              imports dlite_trt.serve.triton_model
    REPO/dlite/1/engine/               a copy of the engine directory (the repository is self-contained)
    REPO/dlite_stream/...              with streaming: the same model, decoupled (one response per
                                       step), reading the engine copy under REPO/dlite

A stock Triton server with the Python backend loads it, in an environment where dlite-trt is
installed (``pip install dlite-trt[triton]``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dlite_trt.engine.manifest import Manifest, load_manifest
from dlite_trt.errors import DLiteError
from dlite_trt.paths import writable_dir
from dlite_trt.serve.protocol import INPUTS, INPUTS_BY_NAME, OUTPUTS, TRITON_TYPES, ServeTensor

INSTANCE_KINDS = {"onnxruntime": "KIND_CPU", "tensorrt": "KIND_GPU"}  # where an engine's instances run
MODEL_NAME = "dlite"
STREAM_MODEL_NAME = "dlite_stream"
MODEL_PY = '''"""Triton Python-backend entry point: the model is dlite_trt.serve.triton_model."""

from dlite_trt.serve.triton_model import TritonPythonModel  # noqa: F401
'''


def render_config(name: str, manifest: Manifest, *, instances: int, max_batch: int, decoupled: bool,
                  engine_dir: str = "engine", threads: int | None = None, queue_delay_us: int = 2000) -> str:
    """config.pbtxt for one model. The prompt's dtype comes from the engine's I/O contract, the
    batch limit and the engine facts from its manifest."""
    ids_dtype = manifest.contract["prefill"].tensor("input_ids").dtype
    if TRITON_TYPES.get(ids_dtype) != TRITON_TYPES[INPUTS_BY_NAME["input_ids"].dtype]:
        raise DLiteError(f"the engine takes {ids_dtype} token ids; this dlite-trt serves engines with "
                         f"{INPUTS_BY_NAME['input_ids'].dtype} ids. Rebuild the engine with this dlite-trt.")
    limits = manifest.limits
    if max_batch > limits.max_batch:
        raise DLiteError(f"--max-batch {max_batch} is above the engine's --max-batch {limits.max_batch}; lower it or "
                         "rebuild the engine with a larger --max-batch.")

    def tensor(t: ServeTensor, kind: str) -> str:
        dims = ", ".join(map(str, t.dims))
        fields = [f'name: "{t.name}"', f"data_type: {TRITON_TYPES[t.dtype]}", f"dims: [ {dims} ]"]
        if kind == "input":
            fields.append(f"optional: {'true' if t.optional else 'false'}")
            if t.dims == (-1,):
                fields.append("allow_ragged_batch: true")  # requests of any length batch together
        return "  {\n    " + "\n    ".join(fields) + "\n  }"

    params = {"engine_dir": engine_dir, "max_seq_len": str(limits.max_seq_len), "block_size": str(manifest.block_size),
              "target": manifest.target_name, "threads": str(threads or 0)}
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch}",
             "input [\n" + ",\n".join(tensor(t, "input") for t in INPUTS) + "\n]",
             "output [\n" + ",\n".join(tensor(t, "output") for t in OUTPUTS) + "\n]",
             f"instance_group [ {{ count: {instances}, kind: {INSTANCE_KINDS[manifest.backend]} }} ]"]
    if decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    elif max_batch > 1:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}")
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


def write_repository(engine_dir: Path, out: Path, *, instances: int = 1, max_batch: int | None = None,
                     streaming: bool = False, threads: int | None = None) -> list[str]:
    """Write the repository (replacing ``out``); returns the model names."""
    engine_dir, out = Path(engine_dir), Path(out)
    manifest = load_manifest(engine_dir)
    if manifest.backend not in INSTANCE_KINDS:
        raise DLiteError(f"{engine_dir} is a {manifest.backend} engine; this dlite-trt serves "
                         f"{' and '.join(INSTANCE_KINDS)} engines.")
    if instances < 1:
        raise DLiteError(f"--instances must be >= 1, got {instances}.")
    max_batch = manifest.limits.max_batch if max_batch is None else max_batch
    if out.exists():
        if not (out / MODEL_NAME / "config.pbtxt").is_file():
            raise DLiteError(f"{out} exists and is not a dlite-trt model repository; choose another --out.")
    writable_dir(out.parent, f"--out {out}")
    if out.exists():
        shutil.rmtree(out)
    names = [MODEL_NAME] + ([STREAM_MODEL_NAME] if streaming else [])
    for name in names:
        version = out / name / "1"
        version.mkdir(parents=True)
        (version / "model.py").write_text(MODEL_PY)
        decoupled = name == STREAM_MODEL_NAME
        (out / name / "config.pbtxt").write_text(render_config(
            name, manifest, instances=instances, max_batch=1 if decoupled else max_batch, decoupled=decoupled,
            engine_dir=f"../../{MODEL_NAME}/1/engine" if decoupled else "engine", threads=threads))
    shutil.copytree(engine_dir, out / MODEL_NAME / "1" / "engine")  # once; the streaming model points at it
    return names
