"""On-policy answers in batches (training/answers.py): the oracle is transformers' greedy
generate of each prompt alone; the answers' text is where corpus-mode labels are exact to full
depth."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_greedy, near_bigram_target

from dlite_trt.errors import ConfigError
from dlite_trt.training.answers import answer_documents, answer_to_file, answered, cut_at_stop, greedy_batch
from dlite_trt.training.corpus import exact_depth

V = 64


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def test_batched_answers_equal_each_prompt_alone_cut_at_the_first_stop():
    hf, _ = near_bigram_target(V, seed=3)
    ps = prompts(7, seed=1)
    alone = [hf_greedy(hf, p, 12) for p in ps]
    stop = alone[0][4]  # a token the first answer emits: its answer must end there
    batched = [a for start in range(0, len(ps), 3)
               for a in greedy_batch(hf, ps[start: start + 3], max_new_tokens=12, stop_ids=[stop], pad_id=0)]
    assert batched == [cut_at_stop(a, [stop]) for a in alone]
    assert batched[0] == alone[0][: alone[0].index(stop) + 1] and batched[0][-1] == stop


def test_a_killed_run_resumes_without_answering_twice(tmp_path):
    hf, _ = near_bigram_target(V, seed=3)
    ps = [("file" if i % 2 else "chat", p) for i, p in enumerate(prompts(5, seed=2))]
    path = tmp_path / "answers.jsonl"
    full = answer_to_file(hf, ps, path, max_new_tokens=6, stop_ids=[], pad_id=0, batch_size=2)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # two batches and a half-written line
    resumed = answer_to_file(hf, ps, path, max_new_tokens=6, stop_ids=[], pad_id=0, batch_size=2)
    assert resumed == full
    indices = [json.loads(line)["index"] for line in path.read_text().splitlines()]
    assert sorted(indices) == list(range(5))  # each prompt once: the half line dropped, nothing repeated
    assert answered(path) == full


def test_answers_to_other_prompts_are_refused_and_kept(tmp_path):
    """A JSONL made from other prompts (other settings or files) is named, not mixed in, and left as it was;
    a longer prompt list that starts with the same prompts (another round) answers only the new ones."""
    hf, _ = near_bigram_target(V, seed=3)
    ps = [("chat", p) for p in prompts(4, seed=5)]
    path = tmp_path / "answers.jsonl"
    answer_to_file(hf, ps[:2], path, max_new_tokens=4, stop_ids=[], pad_id=0, batch_size=2)
    before = path.read_text()
    other = [ps[1], ps[0], *ps[2:]]
    with pytest.raises(ConfigError, match="answers to other prompts \\(index 0, 2 in all\\)"):
        answer_to_file(hf, other, path, max_new_tokens=4, stop_ids=[], pad_id=0, batch_size=2)
    with pytest.raises(ConfigError, match="other prompts \\(index 1, 1 in all\\)"):
        answer_to_file(hf, ps[:1], path, max_new_tokens=4, stop_ids=[], pad_id=0, batch_size=2)
    assert path.read_text() == before
    more = answer_to_file(hf, ps, path, max_new_tokens=4, stop_ids=[], pad_id=0, batch_size=2)
    assert path.read_text().startswith(before) and sorted(more) == [0, 1, 2, 3]
    assert [more[i]["answer_ids"] for i in (2, 3)] == [hf_greedy(hf, p, 4) for _, p in ps[2:]]


def test_answer_text_carries_exact_labels_to_full_depth():
    """The target over prompt + its own answer agrees with the text at every answer position,
    so every anchor there has its labels exact to the block's depth (or the text's end)."""
    hf, _ = near_bigram_target(V, seed=3)
    ps = prompts(3, seed=4)
    records = [{"index": i, "kind": "chat", "prompt_ids": p, "answer_ids": hf_greedy(hf, p, 10)}
               for i, p in reversed(list(enumerate(ps)))]
    docs = list(answer_documents(records))
    assert [d.ids for d in docs] == [tuple(p + r["answer_ids"]) for p, r in zip(ps, reversed(records), strict=True)]
    for doc, p in zip(docs, ps, strict=True):
        tokens = torch.tensor([doc.ids])
        with torch.no_grad():
            greedy = hf(tokens).logits.argmax(-1)
        depth = exact_depth(tokens, greedy, max_depth=5)[0]
        first_anchor = len(p) - 1  # the prompt's last token: its labels are the answer
        assert depth[first_anchor:].tolist() == [min(5, len(doc.ids) - a) for a in range(first_anchor, len(doc.ids))]
