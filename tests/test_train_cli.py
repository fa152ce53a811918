"""`dlite-trt train data | teacher | student` end to end on the tiny pair: the result is a
dlite_v1 checkpoint the loader takes unchanged, and it decodes losslessly. On a target whose
greedy continuation is learnable in seconds, training raises the acceptance length well above
the untrained draft's."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import draft_config, hf_greedy, near_bigram_target, random_draft

from dlite_trt.checkpoint import load_draft, save_draft
from dlite_trt.cli import main
from dlite_trt.loading import load_pair
from dlite_trt.runtime.session import SamplingParams

SMALL = ["--seq-len", "32", "--batch-seqs", "2", "--anchors", "4", "--quiet"]
LEARN_NEW = 24  # answer tokens per prompt, in the data and when measuring


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    root = tmp_path_factory.mktemp("train")
    texts = root / "texts"
    texts.mkdir()
    for i, body in enumerate(["def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 0\n",
                              "import os\nprint(os.getcwd())\n"]):
        (texts / f"f{i}.py").write_text(body * 8)
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result

    run("train", "data", "--target", target, "--prompts", texts, "--out", root / "data",
        "--max-prompt-tokens", "24", "--max-new-tokens", "16")
    common = ["--target", target, "--data", root / "data", "--init", draft, *SMALL]
    run("train", "teacher", *common, "--out", root / "teacher", "--window", "4", "--steps", "3")
    run("train", "student", *common, "--teacher", root / "teacher", "--out", root / "student",
        "--stage1-steps", "2", "--stage2-steps", "2")
    run("train", "student", *common, "--out", root / "single", "--single-stage", "--stage1-steps", "2",
        "--stage2-steps", "2")
    return target, draft, root, run, common


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """A target whose greedy next token depends mostly on the current one (a draft can learn it
    in a few dozen steps), its `train data` from 24 prompts, 8 held-out prompts, random-init
    drafts of one config (the init among them), and students trained from the init by the
    CLI on a budget of seconds: two-stage and single-stage."""
    root = tmp_path_factory.mktemp("learn")
    hf, spec = near_bigram_target(64, seed=3)
    hf.save_pretrained(root / "target")
    cfg = draft_config(spec, block_size=8, anchor_group_size=2)
    untrained = []
    for seed in (1, 2, 3):
        save_draft(random_draft(cfg, seed=seed), root / f"random{seed}")
        untrained.append(root / f"random{seed}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (8,), generator=g).tolist() for _ in range(32)]
    train_prompts, held_out = prompts[:24], prompts[24:]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in train_prompts))
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output

    run("train", "data", "--target", root / "target", "--prompts", root / "prompts.jsonl", "--out", root / "data",
        "--max-new-tokens", LEARN_NEW)
    common = ["--target", root / "target", "--data", root / "data", "--init", untrained[0], "--seq-len", "32",
              "--batch-seqs", "4", "--anchors", "8", "--lr", "1e-2", "--quiet"]
    run("train", "teacher", *common, "--out", root / "teacher", "--window", "4", "--steps", "20")
    run("train", "student", *common, "--teacher", root / "teacher", "--out", root / "student",
        "--stage1-steps", "20", "--stage2-steps", "20")
    run("train", "student", *common, "--out", root / "single", "--single-stage", "--stage1-steps", "0",
        "--stage2-steps", "40")
    run("train", "student", *common, "--out", root / "single-bf16", "--single-stage", "--stage1-steps", "0",
        "--stage2-steps", "40", "--bf16")  # a bf16 copy of the target, the draft's products in bf16
    return hf, root / "target", untrained, held_out, {name: root / name
                                                      for name in ("student", "single", "single-bf16")}


def test_data_is_the_targets_own_greedy_output(trained):
    target, _, root, _, _ = trained
    rows = [json.loads(line) for line in (root / "data" / "sequences.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        want = hf_greedy(target, row["prompt_ids"], 16)
        assert row["answer_ids"] == want[: len(row["answer_ids"])] and row["answer_ids"]


def test_student_is_a_loadable_lossless_dlite_v1_checkpoint(trained, learnable):
    """Loadable, changed by training and lossless on the tiny pair; and where the target is
    learnable, trained students (in bf16 too) accept far more per step than any untrained draft of
    their config on held-out prompts, still losslessly (so accepted drafts were verified)."""
    hf, learn_target, untrained, held_out, students = learnable
    want = [hf_greedy(hf, p, LEARN_NEW) for p in held_out]

    def acceptance(draft_dir) -> float:
        result = load_pair(learn_target, draft_dir).generator.generate(held_out,
                                                                       SamplingParams(max_new_tokens=LEARN_NEW))
        assert result.output_ids == want
        return result.mean_acceptance_length()

    baseline = max(acceptance(d) for d in untrained)  # random drafts: ~1 token per step
    assert baseline < 1.5, baseline
    for name, student in students.items():
        gained = acceptance(student)
        assert gained >= max(baseline + 1.5, 2 * baseline), (name, gained, baseline)
        assert json.loads((student / "training.json").read_text())["plan"]["bf16"] is name.endswith("bf16")

    target, draft, root, _, _ = trained
    for name in ("student", "single"):
        trained_draft = load_draft(root / name)
        initial = load_draft(draft)
        assert any(not torch.equal(a, b) for a, b in zip(trained_draft.state_dict().values(),
                                                           initial.state_dict().values(), strict=True))
        pair = load_pair(target, root / name)
        prompt = [5, 6, 7, 100, 200]
        out = pair.generator.generate([prompt], SamplingParams(max_new_tokens=20)).output_ids[0]
        assert out == hf_greedy(target, prompt, 20)
    plan = json.loads((root / "single" / "training.json").read_text())["plan"]
    assert plan == {"stage1_steps": 0, "stage2_steps": 4, "lr": 3e-4, "snapshot_every": 0, "checkpoint_every": 100,
                    "bf16": False}


def test_rerun_resumes_and_changes_nothing(trained):
    _, _, root, run, common = trained
    before = load_draft(root / "student").state_dict()
    run("train", "student", *common, "--teacher", root / "teacher", "--out", root / "student",
        "--stage1-steps", "2", "--stage2-steps", "2")
    after = load_draft(root / "student").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_two_stage_needs_a_teacher(trained):
    target, draft, root, _, common = trained
    result = CliRunner().invoke(main, ["train", "student", *map(str, common), "--out", str(root / "x")])
    assert result.exit_code == 2 and "--teacher" in result.output


def test_data_that_train_data_did_not_write_is_refused_before_the_target_loads(trained, tmp_path):
    target, draft, root, _, common = trained
    args = [str(a) for a in common]
    args[args.index("--data") + 1] = str(tmp_path / "nope")
    result = CliRunner().invoke(main, ["train", "teacher", *args, "--out", str(tmp_path / "t")])
    assert result.exit_code == 1 and "is not what `dlite-trt train data` writes" in result.output, result.output
    assert "Traceback" not in result.output
    (tmp_path / "file").write_text("x\n")
    result = CliRunner().invoke(main, ["train", "teacher", *map(str, common), "--out", str(tmp_path / "file" / "t")])
    assert result.exit_code == 2 and "is a file, not a directory" in result.output, result.output


def test_torchrun_two_processes(trained, tmp_path):
    """`torchrun --nproc-per-node 2 -m dlite_trt.cli train student ...` (gloo on CPU) runs and
    writes a checkpoint that loads; rank 0 alone writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    _, _, _, _, common = trained
    import socket

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "dlite_trt.cli", "train",
           "student", *map(str, common), "--out", str(tmp_path / "ddp"), "--single-stage", "--stage1-steps", "1",
           "--stage2-steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    load_draft(tmp_path / "ddp")


def test_train_init_writes_a_draft_that_fits_the_target(tiny_pair, tmp_path):
    """`train init`: an untrained dlite_v1 draft shaped for the target, with the tokenizer's mask
    token, that loads against the target and generates exactly what the target does."""
    from transformers import AutoTokenizer

    target = tiny_pair[0]
    out = tmp_path / "init"
    result = CliRunner().invoke(main, ["train", "init", "--target", str(target), "--out", str(out), "--layers", "1",
                                       "--chs-layers", "2", "--block-size", "4", "--rank", "16"])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(target)
    cfg = load_draft(out).cfg
    assert (cfg.num_hidden_layers, cfg.chs_num_layers, cfg.block_size, cfg.sequential_rank) == (1, 2, 4, 16)
    assert cfg.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")  # the tiny tokenizer has one
    pair = load_pair(target, out)
    prompt = tokenizer.encode("def parse(argv):")
    got = pair.generator.generate([prompt], SamplingParams(max_new_tokens=12)).output_ids[0]
    assert got == hf_greedy(target, prompt, 12)
    again = CliRunner().invoke(main, ["train", "init", "--target", str(target), "--out", str(out)])
    assert again.exit_code == 1 and "exists and is not empty" in again.output
    bad = CliRunner().invoke(main, ["train", "init", "--target", str(target), "--out", str(tmp_path / "x"),
                                    "--mask-token-id", "999999"])
    assert bad.exit_code == 1 and "outside the target's vocabulary" in bad.output
    # the default reads 5 target layers, or all of them where the target has fewer (the tiny one: 4)
    default = CliRunner().invoke(main, ["train", "init", "--target", str(target), "--out", str(tmp_path / "d")])
    assert default.exit_code == 0, default.output
    assert load_draft(tmp_path / "d").cfg.chs_num_layers == 4
    many = CliRunner().invoke(main, ["train", "init", "--target", str(target), "--out", str(tmp_path / "m"),
                                     "--chs-layers", "9"])
    assert many.exit_code == 2 and "--chs-layers" in many.output and "pass at most 4" in many.output, many.output


def test_data_with_cached_states_trains_without_the_target_forward(trained, monkeypatch):
    """`train data --states-for DRAFT` answers as plain `train data` does and caches the states;
    teacher and student then read them (the target's forward is never called)."""
    target, draft, root, run, common = trained
    texts = root / "texts"
    run("train", "data", "--target", target, "--prompts", texts, "--out", root / "cached", "--max-prompt-tokens", "24",
        "--max-new-tokens", "16", "--states-for", draft)
    plain = (root / "data" / "sequences.jsonl").read_text().splitlines()
    cached = (root / "cached" / "sequences.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in cached] == [json.loads(line) for line in plain]
    from dlite_trt.training import pipeline

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran although its states are cached")

    monkeypatch.setattr(pipeline, "target_states", no_forward)
    cached_common = [str(root / "cached") if a == root / "data" else a for a in common]
    run("train", "teacher", *cached_common, "--out", root / "cached-teacher", "--window", "4", "--steps", "2")
    run("train", "student", *cached_common, "--teacher", root / "cached-teacher", "--out", root / "cached-student",
        "--stage1-steps", "1", "--stage2-steps", "1")
    load_draft(root / "cached-student")


def test_inform_then_train_on_answer_anchors(trained):
    """`train inform`: a dlite_v1 checkpoint whose head reads the target's final state much as the
    target's LM head does (through rank r; the trained tiny draft's head does not) and whose
    context slots are centred on the cached states; a student trains from it on answer
    anchors; bad input is refused with the fix."""
    from dlite_trt.targets import build_hf_model, resolve_target
    from dlite_trt.training.informed_init import sample_states
    from dlite_trt.training.state_cache import StateCache

    target, draft, root, run, common = trained
    run("train", "data", "--target", target, "--prompts", root / "texts", "--out", root / "inform-data",
        "--max-prompt-tokens", "24", "--max-new-tokens", "16", "--states-for", draft)
    run("train", "inform", "--target", target, "--data", root / "inform-data", "--init", draft,
        "--out", root / "informed")
    informed = load_draft(root / "informed").float()
    cfg = informed.cfg
    cache = StateCache(root / "inform-data", cfg.target_layer_ids, cfg.vocab_size)
    states = sample_states(cache, 200)  # the command's default sample
    depth = informed.layer_depth_embedding.weight[list(cfg.target_layer_ids)]
    torch.testing.assert_close((states + depth).mean(0), torch.zeros_like(depth), atol=1e-4, rtol=0)
    hf = build_hf_model(resolve_target(str(target)), torch.float32)
    final = states[:, -1]
    from dlite_trt.model.sequential_head import recurrence

    def agreement(model) -> float:  # the head on the target's own final state vs its LM head
        with torch.no_grad():
            got = recurrence(model.sequential_head.weights(), final[:, None], torch.zeros(len(final), dtype=torch.long),
                             None).logits[:, 0]
            return (got.argmax(-1) == (final @ hf.lm_head.weight.T).argmax(-1)).float().mean().item()

    assert agreement(informed) > max(0.8, agreement(load_draft(draft).float()) + 0.3)
    informed_common = [str(root / "inform-data") if a == root / "data" else a for a in common]
    informed_common[informed_common.index(draft)] = str(root / "informed")
    run("train", "student", *informed_common, "--out", root / "informed-student", "--single-stage",
        "--stage1-steps", "0", "--stage2-steps", "2", "--anchor-region", "answer")
    load_draft(root / "informed-student")
    again = CliRunner().invoke(main, ["train", "inform", "--target", str(target), "--data", str(root / "inform-data"),
                                      "--init", str(draft), "--out", str(root / "informed")])
    assert again.exit_code == 1 and "exists and is not empty" in again.output
    not_cache = CliRunner().invoke(main, ["train", "inform", "--target", str(target), "--data", str(root / "data"),
                                          "--init", str(draft), "--out", str(root / "x")])
    assert not_cache.exit_code == 2 and "--states-for" in not_cache.output


def test_corpus_mode_end_to_end(tiny_pair, tmp_path):
    """`train data --corpus` (real code, raw and as chat turns), `train init --draft-vocab-size
    --vocab-from` (the corpus' most frequent tokens, the mask token among them), `train inform`
    and `train student` on the corpus: a loadable dlite_v1 draft with a reduced draft
    vocabulary that decodes losslessly on the tiny pair; bad corpus arguments are refused."""
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.corpus import read_corpus_mix

    target, _ = tiny_pair
    listing = tmp_path / "files.txt"
    listing.write_text("".join(f"{p}\n" for p in stdlib_files("train")[:3]) + "# a comment\n")
    runner = CliRunner()

    def run(*args, code: int = 0):
        result = runner.invoke(main, [str(a) for a in args])
        assert result.exit_code == code, result.output
        return result.output

    run("train", "data", "--target", target, "--corpus", listing, "--out", tmp_path / "corpus", "--chat-share", "0.25")
    mix = read_corpus_mix(tmp_path / "corpus", load_draft(tiny_pair[1]).cfg.vocab_size)
    assert mix is not None and len(mix.parts) == 2 and sorted(mix.weights.tolist()) == [0.25, 0.75]
    run("train", "init", "--target", target, "--out", tmp_path / "init", "--layers", "1", "--rank", "16",
        "--chs-layers", "3", "--anchor-group-size", "2", "--draft-vocab-size", "300", "--vocab-from", tmp_path / "corpus")
    init = load_draft(tmp_path / "init")
    assert init.cfg.draft_vocab_size == 300 and init.cfg.mask_token_id in init.sequential_head.draft_vocab.tolist()
    run("train", "inform", "--target", target, "--data", tmp_path / "corpus", "--init", tmp_path / "init",
        "--out", tmp_path / "informed", "--sequences", "2")
    run("train", "student", "--target", target, "--data", tmp_path / "corpus", "--init", tmp_path / "informed",
        "--out", tmp_path / "student", "--single-stage", "--stage1-steps", "0", "--stage2-steps", "3",
        "--seq-len", "48", "--batch-seqs", "2", "--anchors", "8", "--anchor-weight", "depth", "--min-context", "4",
        "--quiet")
    pair = load_pair(target, tmp_path / "student")
    prompt = [5, 6, 7, 100, 200]
    assert pair.generator.generate([prompt], SamplingParams(max_new_tokens=20)).output_ids[0] == \
        hf_greedy(target, prompt, 20)
    assert "either --prompts" in run("train", "data", "--target", target, "--out", tmp_path / "x", code=2)
    assert "does not exist" in run("train", "data", "--target", target, "--corpus", tmp_path / "missing",
                                   "--out", tmp_path / "y", code=1)
    assert "go together" in run("train", "init", "--target", target, "--out", tmp_path / "z",
                                "--draft-vocab-size", "300", code=2)
