"""Corpus-mode training data (DESIGN 1.4): exact greedy labels from one pass over real text.

Run the target once over a text (teacher forcing). At anchor a, its argmax at a, a+1, ... is
its greedy continuation from a for as long as the text agrees with its choices: if tokens
a+1..a+j-1 equal its argmax one position earlier, its argmax at a+j-1 is the j-th greedy token.
So every position of a corpus is an anchor whose labels are exact up to and including the
first disagreement (``exact_depth``), at the cost of a prefill instead of decoding.

A corpus on disk (``write_corpus`` / ``Corpus``) is a token stream: documents tokenized once
and stored back to back, each ended by the tokenizer's EOS token, in ``tokens.bin`` (int32)
with ``corpus.json`` (the documents' sources and offsets, the tokenizer, the counts).
Documents are source files as raw text, or a documented function framed as a chat turn (a
user request built from its docstring, the real code as the assistant's answer, through the
target's chat template: ``chat_document``), so chat-style positions are covered too.
Training cuts windows anywhere in the stream (``Corpus.window``).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlite_trt.errors import ConfigError

TOKENS = "tokens.bin"
META = "corpus.json"
MIX = "mix.json"  # beside corpus parts: {part: weight}


def exact_depth(tokens: torch.Tensor, greedy: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, L] int64: at each anchor a, how many of its labels are exact, 1..max_depth.

    ``tokens`` [B, L] the text, ``greedy`` [B, L] the target's argmax at each position (its
    choice for the next token). Label k (the argmax at a+k-1) is the k-th token of the target's
    greedy continuation from a iff tokens a+1..a+k-1 equal the argmax one position before
    each. Labels past the window's end do not count (at most L - a of them)."""
    if tokens.shape != greedy.shape or tokens.ndim != 2:
        raise ValueError(f"tokens and greedy must be the same [B, L], got {tuple(tokens.shape)} and "
                         f"{tuple(greedy.shape)}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    b, length = tokens.shape
    pos = torch.arange(length, device=tokens.device)
    agree = torch.zeros_like(tokens, dtype=torch.bool)  # agree[i]: token i is the argmax at i-1
    agree[:, 1:] = tokens[:, 1:] == greedy[:, :-1]
    # the first disagreement at or after each position (L when none): a reversed running minimum
    stop = torch.where(agree, length, pos.expand(b, length))
    first_miss = stop.flip(1).cummin(1).values.flip(1)  # [B, L]
    after = torch.cat([first_miss[:, 1:], torch.full((b, 1), length, device=tokens.device)], dim=1)
    run = after - (pos + 1)  # agreements from a+1 on: tokens a+1..a+run agree
    return torch.minimum(run + 1, length - pos).clamp(1, max_depth)


@dataclass(frozen=True)
class Document:
    """One document of a corpus: where it came from, and its token ids."""

    source: str  # e.g. "stdlib:json/decoder.py" or "chat:torch:nn/modules/linear.py:Linear.forward"
    ids: tuple[int, ...]


def raw_document(source: str, text: str, tokenizer: Any) -> Document:
    return Document(source, tuple(tokenizer.encode(text, add_special_tokens=False)))


def chat_document(source: str, request: str, code: str, tokenizer: Any) -> Document:
    """A user request and the real code as the assistant's answer, through the chat template."""
    messages = [{"role": "user", "content": request},
                {"role": "assistant", "content": f"```python\n{code.rstrip()}\n```"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return Document(source, tuple(int(i) for i in ids))


def write_corpus(documents: Iterable[Document], out: Path, *, eos_id: int, tokenizer_name: str,
                 vocab_size: int) -> dict:
    """Write the documents back to back (each followed by ``eos_id``) to ``out``; returns the
    metadata. Written to temporary names and renamed, so a killed run leaves no half corpus."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp_tokens = out / f".{TOKENS}.tmp"
    sources, offsets, total = [], [0], 0
    with open(tmp_tokens, "wb") as f:
        for doc in documents:
            if not doc.ids:
                continue
            ids = np.asarray([*doc.ids, eos_id], dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ConfigError(f"document {doc.source} has token ids outside [0, {vocab_size})")
            f.write(ids.astype(np.int32).tobytes())
            total += len(ids)
            sources.append(doc.source)
            offsets.append(total)
    if total < 2:
        raise ConfigError(f"no text to write to the corpus {out}: every document was empty")
    meta = {"tokens": total, "documents": len(sources), "tokenizer": tokenizer_name, "vocab_size": vocab_size,
            "eos_id": eos_id, "sources": sources, "offsets": offsets}
    tmp_meta = out / f".{META}.tmp"
    tmp_meta.write_text(json.dumps(meta) + "\n")
    os.replace(tmp_tokens, out / TOKENS)
    os.replace(tmp_meta, out / META)
    return meta


class Corpus:
    """Read side: the memory-mapped token stream of ``write_corpus``."""

    def __init__(self, directory: Path, vocab_size: int) -> None:
        directory = Path(directory)
        try:
            self.meta = json.loads((directory / META).read_text())
            total, vocab = int(self.meta["tokens"]), int(self.meta["vocab_size"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{directory} holds no readable corpus ({META}: {exc!r}); build it with "
                              "`dlite-trt train data --corpus`.") from exc
        if vocab != vocab_size:
            raise ConfigError(f"{directory} was tokenized for a {vocab}-token vocabulary, the target has "
                              f"{vocab_size}; build the corpus with this target's tokenizer.")
        path = directory / TOKENS
        if not path.is_file() or path.stat().st_size != 4 * total:
            raise ConfigError(f"{path} should hold {total} int32 tokens; the corpus is damaged. Rebuild it.")
        self.directory = directory
        self.tokens = np.memmap(path, dtype=np.int32, mode="r", shape=(total,))

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, starts: Sequence[int], length: int) -> torch.Tensor:
        """[len(starts), length] int64 tokens of the windows starting at ``starts``."""
        if min(starts) < 0 or max(starts) + length > len(self.tokens):
            raise ValueError(f"windows of {length} tokens must lie in the corpus' {len(self.tokens)} tokens")
        return torch.from_numpy(np.stack([np.asarray(self.tokens[s: s + length]) for s in starts]).astype(np.int64))

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64 how often each token id occurs in the stream."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        chunk = 1 << 24
        for start in range(0, len(self.tokens), chunk):
            counts += np.bincount(np.asarray(self.tokens[start: start + chunk]), minlength=vocab_size)
        return counts


def frequent_vocabulary(counts: np.ndarray, size: int, must_include: Sequence[int] = ()) -> np.ndarray:
    """The ``size`` most frequent ids (ties by id), with ``must_include`` (e.g. the mask token)
    replacing the least frequent where missing; sorted ascending: a draft vocabulary."""
    if not len(must_include) < size <= len(counts):
        raise ConfigError(f"a draft vocabulary of {size} tokens must lie in ({len(must_include)}, {len(counts)}]")
    must = sorted({int(i) for i in must_include})
    order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first, then by id
    rest = [int(i) for i in order if int(i) not in must][: size - len(must)]
    return np.array(sorted(rest + must), dtype=np.int64)


def file_documents(files: Sequence[Path], root: Path, tokenizer: Any, *, label: str,
                   max_chars: int = 400_000) -> Iterable[Document]:
    """Each file's text as a raw document (files above ``max_chars`` are cut there)."""
    for path in files:
        text = path.read_text(errors="replace")[:max_chars]
        if text.strip():
            yield raw_document(f"{label}:{path.relative_to(root)}", text, tokenizer)


def chat_documents(files: Sequence[Path], root: Path, tokenizer: Any, *, label: str, seed: int = 0,
                   max_code_chars: int = 4_000) -> Iterable[Document]:
    """Every documented function of the files as a chat turn: the request built from its
    signature and docstring (``prompts.instruction``), its real code as the answer."""
    from dlite_trt.training.prompts import documented_functions, instruction

    rng = random.Random(seed)
    for path in files:
        for fn in documented_functions(path):
            if len(fn.code) <= max_code_chars:
                yield chat_document(f"chat-{label}:{path.relative_to(root)}:{fn.name}", instruction(fn, rng),
                                    fn.code, tokenizer)


class CorpusMix:
    """Several corpora sampled with fixed weights (e.g. raw files and chat turns, the standard
    library and large packages): windows are drawn from a part chosen by weight, at a uniform
    start inside it."""

    def __init__(self, parts: Sequence[Corpus], weights: Sequence[float]) -> None:
        if not parts or len(parts) != len(weights) or min(weights) <= 0:
            raise ConfigError(f"a corpus mix needs one positive weight per part, got {len(parts)} parts and "
                              f"weights {list(weights)}")
        self.parts = tuple(parts)
        self.weights = torch.tensor([float(w) for w in weights])

    def windows(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[count, length] int64 token windows, seeded by ``generator``."""
        short = [p.directory for p in self.parts if len(p) <= length]
        if short:
            raise ConfigError(f"corpora {short} hold at most {length} tokens; windows need more")
        which = torch.multinomial(self.weights, count, replacement=True, generator=generator).tolist()
        starts = [int(torch.randint(0, len(self.parts[w]) - length + 1, (1,), generator=generator)) for w in which]
        return torch.cat([self.parts[w].window([s], length) for w, s in zip(which, starts, strict=True)])


def write_mix(directory: Path, weights: dict[str, float]) -> None:
    """``directory/mix.json``: the weight of each corpus part (a subdirectory) in the windows drawn."""
    (Path(directory) / MIX).write_text(json.dumps(weights, indent=2) + "\n")


def read_corpus_mix(directory: Path, vocab_size: int) -> CorpusMix | None:
    """The corpus in ``directory``: itself (a ``corpus.json`` there), or its subdirectories that
    hold one, weighted by ``mix.json`` (else by their tokens); None when it holds no corpus."""
    directory = Path(directory)
    if (directory / META).is_file():
        return CorpusMix([Corpus(directory, vocab_size)], [1.0])
    parts = {p.name: p for p in sorted(directory.iterdir()) if (p / META).is_file()} if directory.is_dir() else {}
    if not parts:
        return None
    corpora = {name: Corpus(path, vocab_size) for name, path in parts.items()}
    if not (directory / MIX).is_file():
        return CorpusMix(list(corpora.values()), [len(c) for c in corpora.values()])
    try:
        weights = json.loads((directory / MIX).read_text())
        if not isinstance(weights, dict) or set(weights) != set(corpora):
            raise ValueError(f"it names {sorted(weights) if isinstance(weights, dict) else weights}, the parts "
                             f"are {sorted(corpora)}")
        return CorpusMix([corpora[n] for n in corpora], [float(weights[n]) for n in corpora])
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{directory / MIX} must map each corpus part to a positive weight ({exc}); fix or "
                          "delete it (without it, parts are weighted by their tokens).") from exc


def listed_sources(listing: Path) -> dict[Path, list[Path]]:
    """The Python files a corpus is built from, by root: ``listing`` is a directory (its ``*.py``
    files, recursively) or a text file naming files and directories, one per line (``#`` comments)."""
    listing = Path(listing)
    if listing.is_dir():
        entries = [listing]
    elif listing.is_file():
        lines = [line.split("#", 1)[0].strip() for line in listing.read_text().splitlines()]
        entries = [Path(line).expanduser() for line in lines if line]
    else:
        raise ConfigError(f"--corpus {listing} does not exist; pass a directory or a file listing paths")
    found: dict[Path, list[Path]] = {}
    for entry in entries:
        if entry.is_dir():
            found.setdefault(entry, []).extend(sorted(entry.rglob("*.py")))
        elif entry.is_file():
            found.setdefault(entry.parent, []).append(entry)
        else:
            raise ConfigError(f"{listing} names {entry}, which does not exist")
    if not any(found.values()):
        raise ConfigError(f"{listing} leads to no Python files")
    return found


def write_corpus_parts(sources: dict[Path, list[Path]], tokenizer: Any, out: Path, *, chat_share: float,
                       eos_id: int, tokenizer_name: str, vocab_size: int, seed: int = 0) -> dict[str, dict]:
    """``out/raw`` (the files) and, with ``chat_share`` > 0, ``out/chat`` (their documented
    functions as chat turns), mixed by that share (``mix.json``); returns each part's counts."""
    if not 0 <= chat_share < 1:
        raise ConfigError(f"the chat share must lie in [0, 1), got {chat_share}")
    makers = {"raw": lambda: (d for root, files in sources.items()
                              for d in file_documents(files, root, tokenizer, label=root.name))}
    if chat_share:
        makers["chat"] = lambda: (d for root, files in sources.items()
                                  for d in chat_documents(files, root, tokenizer, label=root.name, seed=seed))
    sizes = {}
    for part, make in makers.items():
        meta = write_corpus(make(), Path(out) / part, eos_id=eos_id, tokenizer_name=tokenizer_name,
                            vocab_size=vocab_size)
        sizes[part] = {"tokens": meta["tokens"], "documents": meta["documents"]}
    write_mix(out, {"raw": 1 - chat_share, "chat": chat_share} if chat_share else {"raw": 1.0})
    return sizes
