"""Training data from the target itself (DESIGN 1.4): prompts, answered by the target.

Prompts come from a JSONL file (one object per line: ``{"prompt": text}``, ``{"messages":
[...]}`` rendered with the tokenizer's chat template, or ``{"input_ids": [...]}``) or from a
directory of text files cut into agent-style prompts (a file's opening, to be continued). The
target answers them (greedy or sampled) through any generator of the runtime (the PyTorch
reference or an engine); sequences are stored as token ids in JSONL
(``{"prompt_ids": [...], "answer_ids": [...]}``). Target hidden states are computed on the fly
when training (``examples.target_states``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlite_trt.errors import ConfigError
from dlite_trt.jsonl import json_lines
from dlite_trt.runtime.session import GeneratorBase, SamplingParams


@dataclass(frozen=True)
class TrainingSequence:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.answer_ids]


def _prompt_from_record(record: Any, tokenizer: Any, where: str) -> list[int]:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ConfigError(f"{where}: input_ids must be a list of token ids")
        return ids
    if tokenizer is None:
        raise ConfigError(f"{where}: text prompts need the target's tokenizer; give input_ids instead")
    if "messages" in record:
        return list(tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if "prompt" in record:
        return tokenizer.encode(record["prompt"], add_special_tokens=False)
    raise ConfigError(f"{where}: expected a prompt, messages or input_ids field, got keys {sorted(record)}")


def read_prompts(source: Path, tokenizer: Any | None, *, max_prompt_tokens: int, max_prompts: int | None = None,
                 seed: int = 0) -> list[list[int]]:
    """Prompts as token ids (each cut to its last ``max_prompt_tokens`` tokens).

    A directory gives one prompt per text file (``*.py``, ``*.txt``, ``*.md``, in name order): its
    opening, cut at a seeded random length between a quarter and all of ``max_prompt_tokens``.
    """
    source = Path(source)
    prompts: list[list[int]] = []
    if source.is_dir():
        if tokenizer is None:
            raise ConfigError(f"{source} holds text files; prompts from text need the target's tokenizer")
        files = sorted(p for p in source.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        prompts = prompts_from_files(files, tokenizer, max_prompt_tokens=max_prompt_tokens, seed=seed)
    elif source.is_file():
        for where, record in json_lines(source):
            prompts.append(_prompt_from_record(record, tokenizer, where)[-max_prompt_tokens:])
    else:
        raise ConfigError(f"prompt source {source} does not exist; pass a JSONL file or a directory of text files")
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ConfigError(f"no prompts found in {source}")
    return prompts[:max_prompts] if max_prompts else prompts


def prompts_from_files(files: Sequence[Path], tokenizer: Any, *, max_prompt_tokens: int, seed: int = 0,
                       cuts: int = 1) -> list[list[int]]:
    """Agent-style prompts: "the file so far", to be continued. With ``cuts`` = 1, each file's
    opening, cut at a seeded random length between a quarter and all of ``max_prompt_tokens``;
    with more, ``cuts`` seeded cut points anywhere in the file, each prompt the (at most
    ``max_prompt_tokens``) tokens before its cut. Files under 2 tokens are skipped."""
    rng = random.Random(seed)
    prompts = []
    for path in files:
        text = path.read_text(errors="replace")
        if cuts == 1:
            ids = tokenizer.encode(text[: 16 * max_prompt_tokens], add_special_tokens=False)
            if len(ids) >= 2:
                prompts.append(ids[: rng.randint(max(1, max_prompt_tokens // 4), max_prompt_tokens)])
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < 2:
            continue
        for _ in range(cuts):
            end = rng.randint(1, len(ids) - 1)
            prompts.append(ids[max(0, end - max_prompt_tokens): end])
    return prompts


def answer_prompts(generator: GeneratorBase, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   temperature: float = 0.0, seed: int = 0, batch_size: int = 8,
                   stop_token_ids: Iterable[int] = ()) -> list[TrainingSequence]:
    """The target's own answers (target-only decoding, so the data is exactly the target's output)."""
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start: start + batch_size]]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start,
                                stop_token_ids=tuple(stop_token_ids))
        result = generator.session(batch).generate_target_only(params)
        out += [TrainingSequence(tuple(p), tuple(a)) for p, a in zip(batch, result.output_ids, strict=True)]
    return out


def write_sequences(sequences: Iterable[TrainingSequence], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for s in sequences:
            f.write(json.dumps({"prompt_ids": list(s.prompt_ids), "answer_ids": list(s.answer_ids)}) + "\n")
    return path


def read_sequences(path: Path, vocab_size: int) -> list[TrainingSequence]:
    sequences = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            seq = TrainingSequence(tuple(record["prompt_ids"]), tuple(record["answer_ids"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number} is not a training sequence ({exc!r}); regenerate the data") from exc
        bad = [t for t in seq.tokens if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"{path}:{number} has token ids outside [0, {vocab_size}): {bad[:5]}; the data was "
                              "made for another target")
        sequences.append(seq)
    if not sequences:
        raise ConfigError(f"{path} holds no training sequences")
    return sequences


def window_starts(sequences: Sequence[TrainingSequence], length: int, rows: Sequence[int], seed: int) -> list[int]:
    """Where each chosen sequence's ``length``-token window starts: seeded, ending in its answer
    when possible; negative for a sequence shorter than the window (left padding)."""
    rng = random.Random(seed)
    starts = []
    for r in rows:
        tokens = sequences[r].tokens
        if len(tokens) <= length:
            starts.append(len(tokens) - length)
            continue
        answer_start = len(sequences[r].prompt_ids)
        lo = max(0, min(answer_start - length // 2, len(tokens) - length))
        starts.append(rng.randint(lo, len(tokens) - length))
    return starts


def windows(sequences: Sequence[TrainingSequence], length: int, rows: Sequence[int], seed: int) -> torch.Tensor:
    """[len(rows), length] token windows at ``window_starts`` (short sequences are left-padded by
    repeating their first token)."""
    return window_tokens(sequences, length, rows, window_starts(sequences, length, rows, seed))


def window_tokens(sequences: Sequence[TrainingSequence], length: int, rows: Sequence[int],
                  starts: Sequence[int]) -> torch.Tensor:
    """[len(rows), length] tokens of the windows at ``starts`` (negative positions repeat token 0)."""
    out = torch.empty(len(rows), length, dtype=torch.long)
    for i, (r, start) in enumerate(zip(rows, starts, strict=True)):
        tokens = sequences[r].tokens
        out[i] = torch.tensor([tokens[max(0, j)] for j in range(start, start + length)])
    return out
