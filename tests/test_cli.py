"""`dlite-trt generate` end to end: the click command on the tiny pair, checked against transformers.

The oracle for greedy runs is target-only greedy decoding with transformers ``generate``
(DESIGN 1.3: greedy speculative decoding is lossless). Stdout is parsed on its own
(``result.stdout``); the human summary and loading bars go to stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import hf_greedy

from dlite_trt.cli import main

TOKENIZER_ARTIFACTS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json",
                       "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model")
PROMPT = "def parse(value):\n    return value"


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture(scope="module")
def near_bigram_pair(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the tiny target reshaped so a bigram draft of it is often but not always right.

    Attention outputs shrunk, matrices sharpened: the next token depends mostly on the current
    one, so acceptance lengths mix 1, partial and full blocks (and the last block gets cut by
    --max-new-tokens), which a random draft (always 1) never exercises.
    """
    from helpers import bigram_draft, draft_config
    from transformers import AutoModelForCausalLM

    from dlite_trt.checkpoint import save_draft
    from dlite_trt.targets import read_target_spec

    out = tmp_path_factory.mktemp("near_bigram")
    target_dir = out / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
        hf.save_pretrained(target_dir)
        block_size = json.loads((tiny_pair[1] / "config.json").read_text())["block_size"]
        cfg = draft_config(read_target_spec(target_dir), block_size=block_size, anchor_group_size=2)
        draft = bigram_draft(hf, cfg)
    save_draft(draft, out / "draft")
    return target_dir, out / "draft"


@pytest.fixture(scope="module")
def no_tokenizer_target(tiny_pair, tmp_path_factory) -> Path:
    """A copy of the tiny target with every tokenizer file removed (weights and config only)."""
    target_dir = tmp_path_factory.mktemp("no_tok") / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    for name in TOKENIZER_ARTIFACTS:
        (target_dir / name).unlink(missing_ok=True)
    assert (target_dir / "config.json").is_file() and not (target_dir / "tokenizer.json").exists()
    return target_dir


def block_size_of(draft_dir: Path) -> int:
    return json.loads((Path(draft_dir) / "config.json").read_text())["block_size"]


def invoke(runner: CliRunner, target: Path | str, draft: Path | str, *args: str):
    return runner.invoke(main, ["generate", "--target", str(target), "--draft", str(draft), *args])


def run_json(runner: CliRunner, target, draft, *args: str) -> dict:
    result = invoke(runner, target, draft, "--json", *args)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)  # stdout holds exactly one JSON object


def assert_clean_error(result, *fragments: str, exit_code: int | None = None) -> None:
    """A failed run that printed a message (with the given fragments) and no traceback."""
    assert result.exit_code != 0, result.output
    if exit_code is not None:
        assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # handled by click, not crashed
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


# --------------------------------------------------------------------------- greedy, --json --trace


@pytest.mark.parametrize("pair_name", ["tiny_pair", "near_bigram_pair"])
@pytest.mark.parametrize("prompt_ids", [[5, 6, 7], [100, 200, 300, 400, 17]])
def test_json_trace_is_lossless_and_consistent(runner, request, pair_name, prompt_ids):
    target_dir, draft_dir = request.getfixturevalue(pair_name)
    n = 30
    k = block_size_of(draft_dir)
    payload = run_json(runner, target_dir, draft_dir, "--input-ids", ",".join(map(str, prompt_ids)),
                       "--max-new-tokens", str(n), "--ignore-eos", "--trace")

    out = payload["output_ids"]
    assert isinstance(out, list) and all(isinstance(t, int) for t in out)
    assert len(out) == n  # generated ids only, no prompt; --ignore-eos: nothing ends it early
    assert out == hf_greedy(target_dir, prompt_ids, n)  # the real oracle

    # Each step's acceptance, recomputed from the oracle alone: a step starting at output
    # position pos accepts the leading drafts that equal the target's greedy tokens there, and
    # keeps them plus the target's next token, cut where --max-new-tokens ends the output.
    want = hf_greedy(target_dir, prompt_ids, n + k)  # past n: the last step's drafts are judged too
    steps = payload["steps"]
    expected_kept, pos = [], 1  # the prefill emitted out[0]
    for step in steps:
        drafts = step["draft_tokens"]
        assert len(drafts) == k - 1
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == want[pos + accepted]:
            accepted += 1
        assert step["accepted"] == accepted, (pos, drafts, want[pos: pos + k])
        expected_kept.append(min(accepted + 1, n - pos))
        assert step["kept"] == expected_kept[-1]
        pos += expected_kept[-1]
    assert pos == n  # the steps end exactly where the output does
    assert payload["acceptance_lengths"] == expected_kept  # tokens kept per step
    assert 1 + sum(payload["acceptance_lengths"]) == len(out)
    assert payload["mean_acceptance_length"] == pytest.approx(sum(expected_kept) / len(expected_kept))
    if pair_name == "near_bigram_pair":  # the fixture really exercises multi-token acceptance
        assert max(s["accepted"] for s in steps) >= 2, steps


def test_json_without_trace_has_no_steps(runner, tiny_pair):
    payload = run_json(runner, *tiny_pair, "--input-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos")
    assert "steps" not in payload
    assert len(payload["output_ids"]) == 4
    assert payload["text"]  # a tokenizer exists


def test_zero_new_tokens(runner, tiny_pair):
    payload = run_json(runner, *tiny_pair, "--input-ids", "5,6,7", "--max-new-tokens", "0", "--trace")
    assert payload["output_ids"] == [] and payload["acceptance_lengths"] == [] and payload["steps"] == []


# --------------------------------------------------------------------------- text prompts


def test_prompt_uses_target_tokenizer(runner, tiny_pair, hf_target, hf_tokenizer):
    n = 24
    payload = run_json(runner, *tiny_pair, "--prompt", PROMPT, "--max-new-tokens", str(n), "--ignore-eos")
    out = payload["output_ids"]
    assert len(out) == n
    prompt_ids = hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(prompt_ids) > 1
    assert out == hf_greedy(hf_target, prompt_ids, n)
    assert payload["text"] == hf_tokenizer.decode(out)


def test_chat_wraps_prompt_in_template(runner, tiny_pair, hf_target, hf_tokenizer):
    n = 24
    payload = run_json(runner, *tiny_pair, "--prompt", PROMPT, "--chat", "--max-new-tokens", str(n),
                       "--ignore-eos")
    messages = [{"role": "user", "content": PROMPT}]
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    assert chat_ids == hf_tokenizer.encode(rendered, add_special_tokens=False)
    expected = hf_greedy(hf_target, chat_ids, n)
    # the check discriminates: the unwrapped prompt continues differently
    assert expected != hf_greedy(hf_target, hf_tokenizer.encode(PROMPT, add_special_tokens=False), n)
    assert payload["output_ids"] == expected
    assert payload["text"] == hf_tokenizer.decode(expected)


def test_chat_needs_prompt(runner, tiny_pair):
    result = invoke(runner, *tiny_pair, "--input-ids", "1,2", "--chat")
    assert_clean_error(result, "--chat", exit_code=2)


def test_chat_without_template_is_a_clean_error(runner, tiny_pair, tmp_path):
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    (target_dir / "chat_template.jinja").unlink()
    result = invoke(runner, target_dir, tiny_pair[1], "--prompt", "hi", "--chat")
    assert_clean_error(result, "chat template")


def test_empty_prompt_is_a_clean_error(runner, tiny_pair):
    assert_clean_error(invoke(runner, *tiny_pair, "--prompt", ""), "empty")


def test_a_prompt_that_is_not_utf8_is_a_clean_error(runner, tiny_pair):
    """argv's invalid bytes reach Python as surrogate escapes ("abc\\xff" -> "abc\\udcff")."""
    assert_clean_error(invoke(runner, *tiny_pair, "--prompt", "abc\udcff"), "not valid UTF-8", "byte 0xff",
                       exit_code=2)


def test_a_thread_count_past_any_machine_is_a_usage_error(runner, tiny_pair):
    assert_clean_error(invoke(runner, *tiny_pair, "--input-ids", "1,2", "--threads", "100000"), "--threads",
                       "1<=x<=1024", exit_code=2)


def test_a_target_whose_weights_are_pickles_is_refused_unread(runner, tiny_pair, tmp_path):
    """pytorch_model.bin is a pickle: refused by name, never opened (this one is not even a pickle,
    so a load attempt would fail with another message)."""
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    for weights in target_dir.glob("*.safetensors"):
        weights.unlink()
    (target_dir / "pytorch_model.bin").write_bytes(b"not opened")
    assert_clean_error(invoke(runner, target_dir, tiny_pair[1], "--input-ids", "1,2"), "pytorch_model.bin",
                       "never loads", "safetensors", exit_code=1)


def test_a_corrupt_tokenizer_is_a_clean_error(runner, tiny_pair, tmp_path):
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target_dir)
    (target_dir / "tokenizer.json").write_text('{"version": ')
    assert_clean_error(invoke(runner, target_dir, tiny_pair[1], "--prompt", "hi"), "cannot load the tokenizer",
                       "tokenizer.json", "corrupt", exit_code=1)


# --------------------------------------------------------------------------- a target without a tokenizer


def test_no_tokenizer_input_ids_work(runner, tiny_pair, hf_target, no_tokenizer_target):
    n = 8
    payload = run_json(runner, no_tokenizer_target, tiny_pair[1], "--input-ids", "5,6,7",
                       "--max-new-tokens", str(n), "--ignore-eos")
    assert "text" not in payload
    assert payload["output_ids"] == hf_greedy(hf_target, [5, 6, 7], n)

    human = invoke(runner, no_tokenizer_target, tiny_pair[1], "--input-ids", "5,6,7", "--max-new-tokens", str(n),
                   "--ignore-eos")
    assert human.exit_code == 0, human.output
    assert human.stdout.strip() == ",".join(map(str, payload["output_ids"]))  # ids, since there is no text


def test_no_tokenizer_prompt_fails_clearly(runner, tiny_pair, no_tokenizer_target):
    result = invoke(runner, no_tokenizer_target, tiny_pair[1], "--prompt", "hello")
    assert_clean_error(result, "no tokenizer", "--input-ids")


# --------------------------------------------------------------------------- human output


def test_human_output(runner, tiny_pair, hf_tokenizer):
    result = invoke(runner, *tiny_pair, "--input-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos")
    assert result.exit_code == 0, result.output
    assert "mean acceptance length" in result.output
    assert "tokens/s" in result.output
    assert "6 tokens" in result.output
    assert not result.stdout.lstrip().startswith("{")  # not JSON
    assert "mean acceptance length" not in result.stdout  # the summary goes to stderr, the text to stdout


def test_human_trace_lists_steps(runner, tiny_pair):
    result = invoke(runner, *tiny_pair, "--input-ids", "5,6,7", "--max-new-tokens", "3", "--ignore-eos", "--trace")
    assert result.exit_code == 0, result.output
    assert "step " in result.stderr and "accepted" in result.stderr


# --------------------------------------------------------------------------- sampling


def test_sampling_is_seeded(runner, tiny_pair):
    n = 30
    k = block_size_of(tiny_pair[1])
    args = ["--input-ids", "5,6,7", "--max-new-tokens", str(n), "--temperature", "0.8", "--ignore-eos"]
    first = run_json(runner, *tiny_pair, *args, "--seed", "7")
    again = run_json(runner, *tiny_pair, *args, "--seed", "7")
    other = run_json(runner, *tiny_pair, *args, "--seed", "8")
    assert first["output_ids"] == again["output_ids"]
    assert first["acceptance_lengths"] == again["acceptance_lengths"]
    assert other["output_ids"] != first["output_ids"]
    for payload in (first, other):
        assert len(payload["output_ids"]) == n
        assert all(1 <= a <= k for a in payload["acceptance_lengths"])
        assert 1 + sum(payload["acceptance_lengths"]) >= n


def test_negative_temperature_is_rejected(runner, tiny_pair):
    result = invoke(runner, *tiny_pair, "--input-ids", "1", "--temperature", "-1")
    assert_clean_error(result, "--temperature", exit_code=2)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("args", [[], ["--prompt", "hi", "--input-ids", "1,2"]])
def test_exactly_one_prompt_source(runner, tiny_pair, args):
    result = invoke(runner, *tiny_pair, *args)
    assert_clean_error(result, "--prompt", "--input-ids", exit_code=2)
    assert "Usage:" in result.output


@pytest.mark.parametrize("value", ["1,x", "", ","])
def test_bad_input_ids(runner, tiny_pair, value):
    result = invoke(runner, *tiny_pair, "--input-ids", value)
    assert_clean_error(result, "Invalid value", exit_code=2)
    if value == "1,x":
        assert "'1,x'" in result.output  # the message quotes what was wrong


def test_missing_draft_is_a_clean_error(runner, tiny_pair, tmp_path):
    missing = tmp_path / "no_such_draft"
    result = invoke(runner, tiny_pair[0], missing, "--input-ids", "1,2")
    assert_clean_error(result, str(missing), "does not exist", exit_code=1)


def test_missing_target_is_a_clean_error(runner, tiny_pair, tmp_path):
    missing = tmp_path / "no_such_target"
    result = invoke(runner, missing, tiny_pair[1], "--input-ids", "1,2")
    assert_clean_error(result, str(missing), exit_code=1)


@pytest.mark.parametrize("ids", ["1,99999", "512", "-1,5"])
def test_out_of_vocab_ids_are_a_clean_error(runner, tiny_pair, ids):
    result = runner.invoke(main, ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                  f"--input-ids={ids}"])
    assert_clean_error(result, "outside the target vocabulary", exit_code=1)


def test_help_lists_generate(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "generate" in result.output
    sub = runner.invoke(main, ["generate", "--help"])
    assert sub.exit_code == 0
    for option in ("--target", "--draft", "--prompt", "--input-ids", "--max-new-tokens", "--temperature", "--seed",
                   "--chat", "--json", "--trace"):
        assert option in sub.output, option


# --------------------------------------------------------------------------- the installed console script


def test_console_script(tiny_pair, hf_target):
    exe = Path(sys.executable).parent / "dlite-trt"
    exe = str(exe) if exe.exists() else shutil.which("dlite-trt")
    assert exe, "the dlite-trt console script is not installed next to the interpreter or on PATH"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    help_run = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert help_run.returncode == 0, help_run.stderr
    assert "generate" in help_run.stdout

    n = 6
    gen = subprocess.run([exe, "generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                          "--input-ids", "5,6,7", "--max-new-tokens", str(n), "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert gen.returncode == 0, gen.stderr
    payload = json.loads(gen.stdout)
    assert payload["output_ids"] == hf_greedy(hf_target, [5, 6, 7], n)
