"""On-policy answers at batch speed: the target's greedy continuations of many prompts.

The draft learns what the target says, and generated answers are the text where the target
agrees with itself at every position (corpus text leaves it at 0.4 of positions), so their
anchors carry full-depth exact labels. The runtime's generators answer a few prompts at a time;
here transformers' batched ``generate`` (left padding, greedy, bf16 where the CPU has fast bf16
matmuls) answers many at once. Answers are appended to a JSONL file as each batch finishes
(``{"index": i, "kind": ..., "prompt_ids": [...], "answer_ids": [...]}``), so a killed run
resumes where it stopped. They are labels only through the training pass: the target's argmax
over the text decides how deep each anchor's labels are exact (``corpus.exact_depth``), so a
near-tie that bf16 or padding decided differently costs depth, never exactness.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from dlite_trt.errors import ConfigError
from dlite_trt.jsonl import json_lines
from dlite_trt.training.corpus import Document


def cut_at_stop(ids: Sequence[int], stop_ids: Iterable[int]) -> list[int]:
    """``ids`` up to and including the first stop token."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[: i + 1])
    return list(ids)


@torch.inference_mode()
def greedy_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                 pad_id: int) -> list[list[int]]:
    """The greedy answers of ``model`` (a transformers causal LM) to ``prompts``, generated as one
    left-padded batch, in order; each answer cut after its first stop token."""
    batch = [list(p) for p in prompts]
    if not all(batch):
        raise ConfigError(f"an empty prompt among the {len(batch)} prompts of a batch")
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):  # left padding: every prompt ends where generation starts
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    device = next(model.parameters()).device
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad_id,
                         temperature=None, top_p=None, top_k=None)
    return [cut_at_stop(row.tolist(), stop_ids) for row in out[:, width:].cpu()]


def answered(path: Path) -> dict[int, dict]:
    """The answers already in ``path`` (a JSONL file of this module), by prompt index."""
    path = Path(path)
    if not path.is_file():
        return {}
    text = path.read_text()
    if text and not text.endswith("\n"):  # a run killed mid-write: its last batch is answered again
        path.write_text(text[: text.rfind("\n") + 1])
    return {int(r["index"]): r for _, r in json_lines(path)}


def answer_to_file(model, prompts: Sequence[tuple[str, Sequence[int]]], path: Path, *, max_new_tokens: int,
                   stop_ids: Sequence[int], pad_id: int, batch_size: int, progress=None) -> dict[int, dict]:
    """Answer every ``(kind, prompt_ids)`` not yet answered in ``path``, appending each batch as it
    finishes; prompts go longest first in similar-length batches (little padding). Returns all
    answers by prompt index."""
    done = answered(path)
    foreign = sorted(i for i, r in done.items()
                     if i >= len(prompts) or (r["kind"], list(r["prompt_ids"])) != (prompts[i][0], list(prompts[i][1])))
    if foreign:
        raise ConfigError(f"{path} holds answers to other prompts (index {foreign[0]}, {len(foreign)} in all): it "
                          "was made with other settings or files. Move it away to answer these prompts afresh.")
    todo = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: -len(prompts[i][1]))
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start: start + batch_size]
        answers = greedy_batch(model, [prompts[i][1] for i in chunk], max_new_tokens=max_new_tokens,
                               stop_ids=stop_ids, pad_id=pad_id)
        records = [{"index": i, "kind": prompts[i][0], "prompt_ids": list(prompts[i][1]), "answer_ids": a}
                   for i, a in zip(chunk, answers, strict=True)]
        with open(path, "a") as f:  # whole lines, one write per batch: a kill loses at most this batch
            f.write("".join(json.dumps(r) + "\n" for r in records))
        done.update({r["index"]: r for r in records})
        if progress is not None:
            progress(len(done), len(prompts), sum(len(r["answer_ids"]) for r in done.values()))
    return done


def answer_documents(records: Iterable[dict], *, label: str = "answers") -> Iterator[Document]:
    """Each prompt with its answer as one corpus document, in prompt order."""
    for r in sorted(records, key=lambda r: int(r["index"])):
        if r["answer_ids"]:
            yield Document(f"{label}:{r['kind']}:{r['index']}", tuple(int(t) for t in (*r["prompt_ids"],
                                                                                       *r["answer_ids"])))
