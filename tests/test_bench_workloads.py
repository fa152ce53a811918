"""Workload generators are deterministic for a seed, and datasets round-trip through JSONL;
a malformed dataset line is an error that names the line and the problem."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dlite_trt.bench.workloads import (
    Task,
    Turn,
    agentic,
    build_workloads,
    chat,
    long_context,
    read_jsonl,
    source_files,
    write_jsonl,
)
from dlite_trt.bundled import bundled_pair
from dlite_trt.errors import DLiteError


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_pair()[0])


def _dump(workloads: dict[str, list[Task]]) -> str:
    return json.dumps({k: [t.to_json() for t in v] for k, v in workloads.items()})


def test_each_generator_is_deterministic_for_a_seed(tokenizer):
    first, again = build_workloads(tokenizer, seed=3), build_workloads(tokenizer, seed=3)
    assert _dump(first) == _dump(again)
    other = build_workloads(tokenizer, seed=4)
    for name in first:  # and the seed matters, for every workload
        assert _dump({name: first[name]}) != _dump({name: other[name]}), name


def test_agentic_sessions_grow_and_change_every_turn():
    files = source_files()
    tasks = agentic(files, seed=0, sessions=3, turns=4)
    assert len(tasks) == 3
    for task in tasks:
        assert len(task.turns) == 4
        assert len({t.prompt for t in task.turns}) == 4  # each turn appends something new
        assert all(t.prompt.rstrip().endswith("# assistant:") for t in task.turns)
        assert all(t.output_tokens <= 64 for t in task.turns)  # short answers
        tools = [t.prompt.split("# tool: ")[1].split()[0] for t in task.turns]
        assert set(tools) >= {"cat", "grep", "python"}  # a file, a grep, a test log
    repo = {f.name for f in files}
    assert all(name in repo for name in tasks[0].turns[0].prompt.splitlines()[0][len("# repository: "):].split(", "))


def test_long_context_prompts_reach_their_lengths(tokenizer):
    lengths = (2048, 8192)
    tasks = long_context(source_files(), tokenizer, seed=0, lengths=lengths)
    for task, length in zip(tasks, lengths, strict=True):
        n = len(task.turns[0].ids(tokenizer))
        assert 0.95 * length <= n <= length, (task.task_id, n)


def test_chat_prompts_are_short_with_long_answers(tokenizer):
    tasks = chat(source_files(), seed=0, count=5)
    assert len(tasks) == 5
    for task in tasks:
        assert len(task.turns[0].ids(tokenizer)) < 600
        assert task.turns[0].output_tokens >= 192


def test_jsonl_round_trip(tmp_path):
    tasks = [Task("a", (Turn(5, prompt="def f():"), Turn(3, input_ids=(1, 2, 3)))),
             Task("b", (Turn(7, input_ids=(4,)),))]
    write_jsonl(tasks, tmp_path / "d.jsonl")
    assert read_jsonl(tmp_path / "d.jsonl") == tasks
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    assert first == {"task_id": "a", "prompt": "def f():", "output_tokens": 5,
                     "turns": [{"input_ids": [1, 2, 3], "output_tokens": 3}]}  # trtllm-bench's fields + turns


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected an object"),
    ('{"task_id": "x", "output_tokens": 4}', "exactly one of prompt"),
    ('{"task_id": "x", "prompt": "a", "input_ids": [1], "output_tokens": 4}', "exactly one of prompt"),
    ('{"task_id": "x", "prompt": "a"}', "output_tokens must be an integer >= 1"),
    ('{"task_id": "x", "prompt": "a", "output_tokens": -3}', "output_tokens must be an integer >= 1"),
    ('{"task_id": "x", "input_ids": [1, "2"], "output_tokens": 4}', "input_ids must be a non-empty list of integers"),
    ('{"task_id": "x", "prompt": "a", "output_tokens": 4, "temperature": 1}', "unknown fields ['temperature']"),
    ('{"task_id": "x", "prompt": "a", "output_tokens": 4, "turns": [{"prompt": "b"}]}', "turn 1: output_tokens"),
])
def test_malformed_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task_id": "ok", "prompt": "fine", "output_tokens": 2}\n' + line + "\n")
    with pytest.raises(DLiteError, match="bad.jsonl:2") as err:
        read_jsonl(path)
    assert message in str(err.value)


def test_duplicate_ids_and_empty_files_are_errors(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"task_id": "a", "prompt": "x", "output_tokens": 2}\n' * 2)
    with pytest.raises(DLiteError, match="appears twice"):
        read_jsonl(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DLiteError, match="holds no tasks"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(DLiteError, match="no dataset file"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_long_context_lengths_fit_the_engine():
    """Prompts whose answer would pass the engine's --max-seq-len are skipped, and one prompt at the
    longest that fits runs instead, so the workload reaches what the engine allows."""
    from dlite_trt.bench.suite import fit_lengths
    from dlite_trt.bench.workloads import LONG_CONTEXT_ANSWER_TOKENS

    answer = LONG_CONTEXT_ANSWER_TOKENS[1]
    assert fit_lengths((2048, 16384), 16384 + answer) == ([2048, 16384], [])
    assert fit_lengths((2048, 16384), 4096) == ([2048, 4096 - answer], [16384])
    assert fit_lengths((2048, 4096, 8192), 2048 + answer) == ([2048], [4096, 8192])
    assert fit_lengths((2048,), 300) == ([], [2048])  # no long prompt fits: the workload is skipped
