"""The bundled tiny pair: it loads unchanged, decodes losslessly, its draft is trained (blocks
are accepted), the CLI builds and runs it, and the script that reproduces it runs end to end.
(The CLI's default pair, SmolLM2 with its trained draft: tests/test_smollm2.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import hf_greedy

from dlite_trt.bundled import bundled_pair
from dlite_trt.cli import main as cli
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.tiny_models import stdlib_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    from dlite_trt.loading import load_pair

    return load_pair(*bundled_pair())


@pytest.fixture(scope="module")
def hf_target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_pair()[0]).eval()


@pytest.fixture(scope="module")
def held_out_prompts(pair) -> list[list[int]]:
    """The opening 200 tokens of four held-out standard-library files."""
    texts = [path.read_text(errors="replace") for path in stdlib_files("held_out")[:4]]
    return [pair.tokenizer.encode(text, add_special_tokens=False)[:200] for text in texts]


def test_bundled_files_are_small_and_complete():
    target, draft = bundled_pair()
    sizes = sum(f.stat().st_size for d in (target, draft) for f in d.iterdir())
    assert sizes <= 25 * 2**20, f"bundled models take {sizes / 2**20:.1f} MiB; the limit is 25"
    assert (target / "tokenizer.json").is_file()
    report = json.loads((target.parent / "acceptance.json").read_text())
    assert report["two_stage"]["greedy_equals_target_only"] is True


def test_bundled_pair_is_lossless_and_its_draft_is_trained(pair, hf_target, held_out_prompts):
    lengths = []
    for prompt in held_out_prompts:
        result = pair.generator.generate([prompt], SamplingParams(max_new_tokens=64))
        assert result.output_ids[0] == hf_greedy(hf_target, prompt, 64)
        lengths += result.acceptance_lengths(0)
    # A random draft's blocks are rejected at the first token (mean 1.0); the trained one's are not.
    assert sum(lengths) / len(lengths) >= 1.5


def test_held_out_files_are_not_training_files():
    assert not set(stdlib_files("held_out")) & set(stdlib_files("train"))


def _tiny_pair_options() -> list[str]:
    target, draft = bundled_pair()
    return ["--target", str(target), "--draft", str(draft)]


def test_build_runs_the_tiny_pair(tmp_path, hf_target, held_out_prompts):
    out = tmp_path / "engine"
    res = CliRunner().invoke(cli, ["build", *_tiny_pair_options(), "--out", str(out), "--max-seq-len", "512",
                                   "--max-batch", "2", "--quiet"])
    assert res.exit_code == 0, res.output
    ids = ",".join(map(str, held_out_prompts[0][:50]))
    res = CliRunner().invoke(cli, ["generate", "--engine", str(out), "--input-ids", ids, "--max-new-tokens", "24",
                                   "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["output_ids"]
    assert got == hf_greedy(hf_target, held_out_prompts[0][:50], 24)


def test_generate_runs_the_tiny_pair(hf_target, held_out_prompts):
    ids = ",".join(map(str, held_out_prompts[1][:40]))
    res = CliRunner().invoke(cli, ["generate", *_tiny_pair_options(), "--input-ids", ids, "--max-new-tokens", "16", "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["output_ids"] == hf_greedy(hf_target, held_out_prompts[1][:40], 16)


@pytest.mark.parametrize("command", ["build", "generate"])
def test_target_without_draft_is_a_usage_error(tmp_path, command):
    target, _ = bundled_pair()
    args = [command, "--target", str(target)]
    args += ["--out", str(tmp_path / "e")] if command == "build" else ["--input-ids", "1,2"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2
    assert "both --target and --draft, or neither" in res.output


def test_reproduction_script_runs_end_to_end(tmp_path):
    """The smoke budget of build_scripts/train_bundled_models.py, with its ablation."""
    out = tmp_path / "models"
    proc = subprocess.run([sys.executable, str(ROOT / "build_scripts" / "train_bundled_models.py"), "--out", str(out),
                           "--work", str(tmp_path / "runs"), "--budget", "smoke", "--ablation"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "acceptance.json").read_text())
    for variant in ("two_stage", "single_stage"):
        assert report[variant]["greedy_equals_target_only"] is True
        assert report[variant]["steps"] > 0
    from dlite_trt.checkpoint import load_draft

    load_draft(out / "draft")


def test_the_default_draft_is_small_fp16_and_fits_smollm2():
    """The draft bundled for SmolLM2 (the CLI's default): at most 40 MB, fp16 weights (and the
    int64 ids of its draft vocabulary), shaped for the preset, and its record says it was lossless
    where it was measured."""
    from safetensors import safe_open

    from dlite_trt.bundled import default_pair
    from dlite_trt.checkpoint import check_draft_fits_target, load_draft_config
    from dlite_trt.presets import PRESETS

    name, draft = default_pair()
    assert name == "smollm2-135m"
    size = sum(f.stat().st_size for f in draft.iterdir())
    assert size <= 40_000_000, f"the bundled SmolLM2 draft takes {size / 1e6:.1f} MB; the limit is 40"
    check_draft_fits_target(load_draft_config(draft), PRESETS[name].spec)
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {k for k, d in dtypes.items() if d != "F16"} <= {"sequential_head.draft_vocab"}
    assert dtypes.get("sequential_head.draft_vocab", "I64") == "I64"
    report = json.loads((draft / "acceptance.json").read_text())
    assert len(report["student"]) == 3
    for measured in report["student"].values():
        assert measured["greedy_equals_target_only"] is True and measured["steps"] > 0
