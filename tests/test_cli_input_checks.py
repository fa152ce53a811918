"""Bad command-line input gives a clear error naming the problem and the fix, with the same exit
codes in every subcommand: 2 for a wrong command line, 1 for a path that is not what it should be
(the rule is written in ``LazyGroup.invoke``, dlite_trt/cli/__init__.py). Runs the real CLI."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner

from dlite_trt.cli import main
from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_clean_error(result, *fragments: str, exit_code: int) -> None:
    """Failed with ``exit_code``, printed ``Error:`` and every fragment, and no traceback."""
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "Error:" in result.output, result.output
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


# --------------------------------------------------------------------------- 1. --seed


def test_seed_range_is_what_torch_takes():
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises(ValueError, match="Overflow"):
            torch.Generator().manual_seed(seed)
        with pytest.raises(DLiteError, match=r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"):
            SamplingParams(seed=seed)
    for seed in (1.5, "3", True):
        with pytest.raises(DLiteError, match="seed must be an integer"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [str(SEED_MAX + 1), str(SEED_MIN - 1), "99999999999999999999999"])
def test_generate_seed_out_of_range_is_a_usage_error(seed):
    result = cli("generate", "--input-ids", "1,2", "--temperature", "0.8", "--seed", seed)
    assert_clean_error(result, "--seed", "seed must be in [-2**63, 2**64 - 1]", "pick a smaller seed", exit_code=2)


@pytest.mark.parametrize("seed", ["1.5", "seven"])
def test_generate_non_integer_seed_is_a_usage_error(seed):
    assert_clean_error(cli("generate", "--input-ids", "1,2", "--seed", seed), "--seed", "is not a valid integer",
                       exit_code=2)


@pytest.mark.parametrize("seed", [str(SEED_MIN), str(SEED_MAX)])
def test_generate_samples_with_the_extreme_seeds(tiny_pair, seed):
    result = cli("generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--input-ids", "5,6,7",
                 "--max-new-tokens", "3", "--temperature", "0.8", "--seed", seed, "--json")
    assert result.exit_code == 0, (result.output, result.exception)


# --------------------------------------------------------------------------- 2. --temperature


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, "hot"])
def test_sampling_params_refuse_a_non_finite_temperature(value):
    with pytest.raises(DLiteError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("command", [["generate", "--input-ids", "1,2"],
                                     ["train", "data", "--target", "t", "--prompts", "p", "--out", "o"]],
                         ids=["generate", "train-data"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_temperature_is_a_usage_error(command, value):
    result = cli(*command, "--temperature", value)
    assert_clean_error(result, "--temperature", "must be a finite number >= 0", exit_code=2)


# --------------------------------------------------------------------------- 3. options that would be ignored


def test_generate_threads_without_engine_is_a_usage_error():
    result = cli("generate", "--input-ids", "1,2", "--threads", "2")
    assert_clean_error(result, "--threads sets ONNX Runtime's threads for an engine", "pass --engine DIR",
                       exit_code=2)


WITHOUT_TARGET = {"generate": ["generate", "--input-ids", "1,2"],
                  "generate-engine": ["generate", "--input-ids", "1,2", "--engine", "DIR"],
                  "build": ["build", "--out", "DIR"]}


@pytest.mark.parametrize("command", list(WITHOUT_TARGET))
def test_random_weights_without_target_is_a_usage_error(tmp_path, command):
    args = [str(tmp_path / "e") if a == "DIR" else a for a in WITHOUT_TARGET[command]]
    result = cli(*args, "--random-weights")
    assert_clean_error(result, "--random-weights gives a preset --target random weights", "--target PRESET",
                       exit_code=2)
    assert not (tmp_path / "e").exists()


# --------------------------------------------------------------------------- 4. not an engine directory


ENGINE_COMMANDS = {"generate": ["generate", "--input-ids", "1,2"], "bench": ["bench", "--out", "OUT"],
                   "serve": ["serve"], "triton-repo": ["triton-repo", "--out", "OUT"]}


def _not_engines(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("not an engine")
    return {"missing": (tmp_path / "missing", "does not exist"), "file": (tmp_path / "a_file", "is a file"),
            "no_manifest": (tmp_path / "empty", "has no manifest.json")}


@pytest.mark.parametrize("kind", ["missing", "file", "no_manifest"])
@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
def test_not_an_engine_directory_exits_1_in_every_command(tmp_path, command, kind):
    engine, why = _not_engines(tmp_path)[kind]
    args = [str(tmp_path / "out") if a == "OUT" else a for a in ENGINE_COMMANDS[command]]
    result = cli(*args, "--engine", str(engine))
    assert_clean_error(result, f"--engine {engine} is not an engine directory", why, "dlite-trt build --out DIR",
                       exit_code=1)


def test_build_out_that_is_a_file_exits_1(tmp_path):
    out = tmp_path / "a_file"
    out.write_text("keep me")
    assert_clean_error(cli("build", "--out", str(out)), f"--out {out}", "not an engine directory", exit_code=1)
    assert out.read_text() == "keep me"


# --------------------------------------------------------------------------- 5. help


def _options(command: click.Command, path: tuple[str, ...]):
    ctx = click.Context(command, info_name=path[-1])
    for param in command.params:
        if isinstance(param, click.Option):
            yield " ".join(path), param
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            yield from _options(command.get_command(ctx, name), (*path, name))


def test_every_option_of_every_subcommand_has_help():
    options = list(_options(main, ("dlite-trt",)))
    assert {"dlite-trt generate", "dlite-trt train student", "dlite-trt serve"} <= {where for where, _ in options}
    missing = [f"{where} {'/'.join(option.opts)}" for where, option in options if not (option.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


# --------------------------------------------------------------------------- 6. empty prompts


@pytest.mark.parametrize("args", [["--prompt", ""], ["--input-ids", ""], ["--input-ids", " , "]],
                         ids=["prompt", "input-ids", "input-ids-commas"])
def test_generate_empty_prompt_is_a_usage_error(args):
    result = cli("generate", *args)
    fix = "the prompt is empty; give some text" if args[0] == "--prompt" else "pass at least one, e.g. --input-ids"
    assert_clean_error(result, args[0], fix, exit_code=2)
    assert "prompt 0" not in result.output


def test_empty_prompt_in_a_batch_names_the_sequence(tiny_pair):
    from dlite_trt.loading import load_pair

    generator = load_pair(*tiny_pair).generator
    with pytest.raises(DLiteError) as excinfo:
        generator.generate([[5, 6], []], SamplingParams(max_new_tokens=1))
    assert str(excinfo.value) == "the prompt is empty (sequence 1 of the batch); give at least one token."
