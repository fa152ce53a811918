"""Training data: prompts from JSONL or text files, the target's own answers, stored ids."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import draft_config, generator, hf_greedy, make_target, random_draft

from dlite_trt.errors import ConfigError
from dlite_trt.training.data import answer_prompts, read_prompts, read_sequences, windows, write_sequences


def test_jsonl_prompts_and_answers_are_the_targets_greedy_output(tmp_path):
    hf, spec = make_target(64, seed=1)
    gen = generator(hf, spec, random_draft(draft_config(spec)))
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps({"input_ids": ids}) for ids in ([1, 2, 3], [4, 5], [6] * 9)) + "\n")
    prompts = read_prompts(src, None, max_prompt_tokens=6)
    assert prompts == [[1, 2, 3], [4, 5], [6] * 6]
    sequences = answer_prompts(gen, prompts, max_new_tokens=7, batch_size=2)
    for s, p in zip(sequences, prompts, strict=True):
        assert list(s.prompt_ids) == p and list(s.answer_ids) == hf_greedy(hf, p, 7)
    path = write_sequences(sequences, tmp_path / "data" / "sequences.jsonl")
    assert read_sequences(path, 64) == sequences
    with pytest.raises(ConfigError, match="outside"):
        read_sequences(path, 5)


def test_text_directory_prompts(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "b.md").write_text("# Title\n\nSome documentation text. " * 20)
    (tmp_path / "skip.bin").write_bytes(b"\0\1")
    prompts = read_prompts(tmp_path, tok, max_prompt_tokens=40, seed=3)
    assert len(prompts) == 2 and all(10 <= len(p) <= 40 for p in prompts)
    assert prompts == read_prompts(tmp_path, tok, max_prompt_tokens=40, seed=3)  # seeded


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl", None, max_prompt_tokens=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "text"}\n')
    with pytest.raises(ConfigError, match="tokenizer"):
        read_prompts(bad, None, max_prompt_tokens=8)
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1 is not valid JSON"):
        read_prompts(bad, None, max_prompt_tokens=8)


def test_windows_are_seeded_and_cover_answers():
    from dlite_trt.training.data import TrainingSequence

    seqs = [TrainingSequence(tuple(range(30)), tuple(range(100, 120))), TrainingSequence((5, 6), (7,))]
    w = windows(seqs, 16, [0, 1], seed=4)
    assert w.shape == (2, 16) and torch.equal(w, windows(seqs, 16, [0, 1], seed=4))
    assert (w[0] >= 100).any()  # reaches into the answer
    assert w[1].tolist() == [5] * 13 + [5, 6, 7]


def test_prompts_cut_anywhere_in_files(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    from dlite_trt.training.data import prompts_from_files

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    path = tmp_path / "a.py"
    path.write_text("def f(x):\n    return x + 1\n" * 40)
    full = tok.encode(path.read_text(), add_special_tokens=False)
    prompts = prompts_from_files([path], tok, max_prompt_tokens=16, seed=2, cuts=5)
    assert len(prompts) == 5 and prompts == prompts_from_files([path], tok, max_prompt_tokens=16, seed=2, cuts=5)
    for p in prompts:  # each is a contiguous piece of the file: the tokens before some cut
        assert 1 <= len(p) <= 16 and any(full[i: i + len(p)] == p for i in range(len(full) - len(p) + 1))
