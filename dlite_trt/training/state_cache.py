"""Training data with the target's states cached on disk: answer once, train many epochs.

``write_state_cache`` answers prompts with the target itself (greedy, batched, on the
reference ``TargetAdapter`` with a KV cache) and, in the same forward passes, records at every
position of prompt + answer what training needs from the target: the hidden states of the
draft's S selected layers (fp16) and the top-k of the target's next-token distribution
(token ids and probabilities). Training then costs no target forward (``StateCache`` reads
memory-mapped windows). The files, in the output directory:

- ``sequences.jsonl``: one ``{"prompt_ids", "answer_ids"}`` line per sequence, in order;
- ``hidden.bin`` [T, S, H] fp16, ``top_ids.bin`` [T, k] int32, ``top_probs.bin`` [T, k] fp16:
  the positions of all sequences back to back (T = total tokens);
- ``states.json``: layer ids, S, H, k, vocabulary and the target's name.

The job is resumable: each batch is appended, then its lines; a run that was killed is cut
back to its last complete batch and goes on from there. It also grows: a rerun whose prompt
list starts with the cached prompts (in order) answers only the new ones after them (and one
whose prompts are the first of the cached ones has nothing to do); any other prompt list is
refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dlite_trt.errors import ConfigError
from dlite_trt.model.target import TargetAdapter
from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.training.data import TrainingSequence, read_sequences

SEQUENCES = "sequences.jsonl"
META = "states.json"
ARRAYS = {"hidden": np.float16, "top_ids": np.int32, "top_probs": np.float16}  # name -> dtype of name.bin


@dataclass(frozen=True)
class StateLayout:
    layer_ids: tuple[int, ...]
    hidden_size: int
    top_k: int
    vocab_size: int
    target: str

    def row_shape(self, name: str) -> tuple[int, ...]:
        return (len(self.layer_ids), self.hidden_size) if name == "hidden" else (self.top_k,)

    def row_bytes(self, name: str) -> int:
        return int(np.prod(self.row_shape(name))) * np.dtype(ARRAYS[name]).itemsize

    def to_dict(self) -> dict:
        return {"layer_ids": list(self.layer_ids), "hidden_size": self.hidden_size, "top_k": self.top_k,
                "vocab_size": self.vocab_size, "target": self.target}

    @classmethod
    def read(cls, directory: Path) -> StateLayout:
        try:
            raw = json.loads((directory / META).read_text())
            return cls(tuple(raw["layer_ids"]), int(raw["hidden_size"]), int(raw["top_k"]), int(raw["vocab_size"]),
                       str(raw["target"]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{directory / META} is missing or unreadable ({exc!r}); rerun `dlite-trt train data` "
                              "with --states-for to rebuild the cache.") from exc


@torch.inference_mode()
def _answer_batch(target: TargetAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: frozenset[int], top_k: int) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    """Greedy answers of a batch, with every position's states: [(answer, {name: [T_row, ...]})]."""
    spec = target.spec
    b, width = len(prompts), max(map(len, prompts))
    lens = [len(p) for p in prompts]
    cache = KVCache(spec.num_hidden_layers, b, spec.num_key_value_heads, spec.head_dim,
                    capacity=width + max_new_tokens + 1, dtype=target.embed_weight.dtype)
    ids = torch.zeros(b, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(b, width)
    past_k, past_v = cache.view(0)
    out = target(ids, positions, past_k, past_v, torch.zeros(b, dtype=torch.long), positions)
    cache.write(out.new_k, out.new_v, [0] * b, lens)
    parts = {"hidden": [out.hidden], "top_ids": [], "top_probs": []}

    def record(logits: torch.Tensor) -> torch.Tensor:  # [B, T, V] -> next tokens [B, T]
        probs, top = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        parts["top_ids"].append(top)
        parts["top_probs"].append(probs)
        return top[..., 0]

    nxt = record(out.logits)[torch.arange(b), torch.tensor(lens) - 1]  # [B]
    answers: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(max_new_tokens):
        for row in range(b):
            if not done[row]:
                answers[row].append(int(nxt[row]))
                done[row] = int(nxt[row]) in stop_ids or len(answers[row]) == max_new_tokens
        pos = torch.tensor([n + step for n in lens])  # where this token sits
        past_k, past_v = cache.view(int(pos.max()))
        out = target(nxt[:, None], pos[:, None], past_k, past_v, pos, torch.zeros(b, 1, dtype=torch.long))
        cache.write(out.new_k, out.new_v, pos.tolist(), [1] * b)
        parts["hidden"].append(out.hidden)
        nxt = record(out.logits)[:, 0]
        if all(done):
            break
    stacked = {name: torch.cat(chunks, dim=1) for name, chunks in parts.items()}  # [B, width + steps, ...]
    result = []
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        keep = torch.cat([torch.arange(n), width + torch.arange(len(answers[row]))])  # prompt, then its answer
        result.append((answers[row], {name: t[row, keep].numpy().astype(ARRAYS[name]) for name, t in
                                      stacked.items()}))
    return result


def _completed(directory: Path, layout: StateLayout) -> list[list[int]]:
    """The prompts already answered, in order; cuts the files back to the last complete batch."""
    meta = directory / META
    if meta.is_file():
        if StateLayout.read(directory) != layout:
            raise ConfigError(f"{directory} holds states of another target or draft layout "
                              f"({json.loads(meta.read_text())}); use a new --out directory.")
    else:
        directory.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(layout.to_dict(), indent=2))
    lines_path = directory / SEQUENCES
    lines = lines_path.read_text().splitlines(keepends=True) if lines_path.is_file() else []
    complete = [line for line in lines if line.endswith("\n")]
    records = [json.loads(line) for line in complete]
    tokens = sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
    lines_path.write_text("".join(complete))
    for name in ARRAYS:
        path = directory / f"{name}.bin"
        path.touch()
        if path.stat().st_size < tokens * layout.row_bytes(name):
            raise ConfigError(f"{path} is shorter than {SEQUENCES} says; the cache is damaged. Delete {directory} "
                              "and rerun.")
        with open(path, "r+b") as f:
            f.truncate(tokens * layout.row_bytes(name))
    return [r["prompt_ids"] for r in records]


def write_state_cache(target: TargetAdapter, prompts: Sequence[Sequence[int]], out: Path, *, layer_ids: tuple[int, ...],
                      max_new_tokens: int, stop_token_ids: Sequence[int], top_k: int = 32, batch_size: int = 16,
                      target_name: str = "", log: Callable[[int, int, float], None] | None = None) -> int:
    """Answer ``prompts`` (greedy) and cache their states in ``out``; returns the sequences cached.

    The answers' settings (``max_new_tokens``, stops) are the caller's to keep: a rerun that
    resumes or grows the cache with others mixes answers of both.

    ``target`` must be an adapter over ``layer_ids``. ``log(done, total, tokens_per_s)`` after
    each batch. Prompts are answered in order, so a rerun with the same prompts resumes, and one with
    more prompts after the same ones grows the cache."""
    if tuple(target.layer_ids) != tuple(layer_ids):
        raise ConfigError(f"the target adapter reads layers {target.layer_ids}, the cache wants {layer_ids}")
    if not 1 <= top_k <= target.spec.vocab_size:
        raise ConfigError(f"top_k must be in [1, {target.spec.vocab_size}], got {top_k}")
    layout = StateLayout(tuple(layer_ids), target.spec.hidden_size, top_k, target.spec.vocab_size, target_name)
    cached = _completed(Path(out), layout)
    done = len(cached)
    common = min(done, len(prompts))  # answered already: these must be the same prompts, in order
    if [list(p) for p in prompts[:common]] != cached[:common]:
        raise ConfigError(f"{out} caches the answers to other prompts ({done} cached; to resume or grow the cache "
                          "the prompt list must start with them, in order); use a new --out directory.")
    started, tokens = time.perf_counter(), 0
    stops = frozenset(stop_token_ids)
    for start in range(done, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start: start + batch_size]]
        answered = _answer_batch(target, batch, max_new_tokens, stops, top_k)
        for name in ARRAYS:
            with open(Path(out) / f"{name}.bin", "ab") as f:
                for _, arrays in answered:
                    f.write(np.ascontiguousarray(arrays[name]).tobytes())
        with open(Path(out) / SEQUENCES, "a") as f:
            f.write("".join(json.dumps({"prompt_ids": p, "answer_ids": a}) + "\n"
                            for p, (a, _) in zip(batch, answered, strict=True)))
        tokens += sum(len(a) for a, _ in answered)
        if log is not None:
            log(min(start + batch_size, len(prompts)), len(prompts), tokens / (time.perf_counter() - started))
    return max(done, len(prompts))


class StateCache:
    """Read side: the sequences and memory-mapped windows of their cached states."""

    def __init__(self, directory: Path, layer_ids: tuple[int, ...], vocab_size: int) -> None:
        directory = Path(directory)
        self.layout = StateLayout.read(directory)
        if self.layout.layer_ids != tuple(layer_ids) or self.layout.vocab_size != vocab_size:
            raise ConfigError(f"{directory} caches layers {list(self.layout.layer_ids)} of a {self.layout.vocab_size}-"
                              f"token target; this draft reads layers {list(layer_ids)} of a {vocab_size}-token "
                              "target. Rebuild the cache with --states-for this draft.")
        self.sequences: list[TrainingSequence] = read_sequences(directory / SEQUENCES, vocab_size)
        lengths = np.array([len(s.tokens) for s in self.sequences])
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        total = int(self.offsets[-1])
        self.arrays = {}
        for name, dtype in ARRAYS.items():
            path = directory / f"{name}.bin"
            expected = total * self.layout.row_bytes(name)
            if not path.is_file() or path.stat().st_size != expected:
                raise ConfigError(f"{path} should hold {expected} bytes for {len(self.sequences)} sequences; the "
                                  "cache is incomplete. Rerun `dlite-trt train data` with the same --out to finish it.")
            self.arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=(total, *self.layout.row_shape(name)))

    def window(self, row: int, start: int, length: int) -> dict[str, torch.Tensor]:
        """Positions start..start+length-1 of sequence ``row``; negative ones repeat position 0
        (the left padding of ``data.windows``)."""
        base = int(self.offsets[row])
        index = base + np.clip(np.arange(start, start + length), 0, None)
        out = {name: torch.from_numpy(np.asarray(a[index])) for name, a in self.arrays.items()}
        out["hidden"] = out["hidden"].float()
        out["top_ids"] = out["top_ids"].long()
        out["top_probs"] = out["top_probs"].float()
        return out
