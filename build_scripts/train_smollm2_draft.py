#!/usr/bin/env python
"""Train the bundled DLite draft for SmolLM2-135M-Instruct from scratch (seeded, resumable).

Corpus mode (DESIGN 1.4): the target runs once over real code, and every position is an anchor
whose labels are its exact greedy continuation up to the first place the text leaves it
(training/corpus.py); half the windows come from the target's own greedy answers to prompts made
from the same code (training/answers.py: the text it drafts on in use, exact to full depth).

1. the corpus, an explicit allow-list (CORPUS_PACKAGES, pinned; downloaded as wheels by this
   script, only their .py files read; plus the standard library's training split), as raw files
   and as chat turns (a request built from each documented function's signature and docstring,
   the real code as the answer, through the chat template): four parts, sampled by MIX;
1b. the answers part: ANSWERS' prompts (file cuts, docstrings, chat requests) from seeded files of
   the allow-list, answered greedily by the bf16 target in batches (transformers' generate),
   appended to WORK/answers.jsonl batch by batch (the longest stage on a CPU: resumable);
   --answer-rounds N makes N such prompt sets from disjoint slices of the shuffled files (round 1's
   prompts, and so the answers of a one-round JSONL, stay the same and are not answered again);
2. a reduced draft vocabulary: the DRAFT_VOCAB most frequent ids of the corpus (the mask token
   among them); its coverage of the target's greedy tokens on the held-out sets is measured;
3. an untrained draft (`dlite-trt train init`) with it, then the target-informed initialisation
   (training/informed_init.py) from the target's states over corpus windows;
4. the student, single-stage (stage 2: CE + TV against the target), on corpus windows: the
   target over each window, anchors drawn in proportion to their exact labels, every label past
   the first disagreement masked; snapshots for the training curve;
5. the acceptance length, greedy, the whole block verified: held-out standard-library files (each
   continued from its first 256 tokens for 128 new tokens), chat-style instructions made from
   held-out functions, and another package's code (never trained on), with n-gram prompt
   lookup's on the same prompts; at every snapshot on the held-out files (the curve);
6. the draft in fp16 -> --out (the bundled draft), with acceptance.json.

Everything not on the allow-list is held out: the standard library's held-out split, click (the
other package measured) and every smaller package. Every stage resumes where it stopped when the
command is run again with the same --work (outside the repository: it holds the corpus and the
runs).

    python build_scripts/train_smollm2_draft.py --work /work/runs/smollm2-corpus      # rewrites the bundled draft
    python build_scripts/train_smollm2_draft.py --budget smoke --work /tmp/w --out /tmp/draft
    # the bundled draft: the GPU run's draft trained further here (--init-from: no informed init)
    python build_scripts/train_smollm2_draft.py --work W --bf16 --init-from DRAFT --lr 2e-4 --steps 450

On a GPU (``--budget gpu --device cuda``: 8 times the blocks a step, TF32; the bundled draft was
trained so): the corpus and the answers are made here (``--until answers``) and read there (``--corpus-from``,
with the draft vocabulary and the held-out prompts made here), ``--until curve`` measures each
snapshot teacher-forced there, and the draft is measured here. build_scripts/gpu_train_draft.sh
and device_transfer.py carry it to a machine without network; docs/training.md has the commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from itertools import chain
from pathlib import Path

import click

from dlite_trt.training.losses import LossWeights

# large packages only (each at least 5 MB of Python source), pinned; nothing else is trained on
CORPUS_PACKAGES = {"torch": "2.13.0", "transformers": "5.24.0", "sympy": "1.14.0", "numpy": "1.26.4"}
# windows drawn per part: the corpus at half, the target's own answers (ANSWERS_PART) at half
MIX = {"stdlib": 0.125, "chat-stdlib": 0.075, "packages": 0.2, "chat-packages": 0.1, "answers": 0.5}
ANSWERS_PART = "answers"
ANSWERS_FILE = "answers.jsonl"  # in --work: every answer so far, by prompt index (resumable)
# on-policy answers: prompts from files of the allow-list (seeded), answered greedily by the bf16 target
ANSWERS = {"files": 3000, "counts": {"file": 2000, "docstring": 500, "chat": 1000}, "max_prompt_tokens": 256,
           "new_tokens": 128, "batch": 64}
BUDGETS = {
    "smoke": {"packages": ["sympy"], "max_files": 6, "seq_len": 96, "batch_seqs": 2, "anchors": 16,
              "min_context": 8, "steps": 6, "snapshots": 2, "draft_vocab": 4096, "init_windows": 2,
              "answers": {"files": 6, "counts": {"file": 3, "docstring": 1, "chat": 2}, "max_prompt_tokens": 64,
                          "new_tokens": 8, "batch": 2},
              "measure": {"files": 1, "chat": 1, "other": 1, "prompt_tokens": 64, "new_tokens": 16}},
    "full": {"packages": sorted(CORPUS_PACKAGES), "max_files": None, "seq_len": 512, "batch_seqs": 4,
             "anchors": 192, "min_context": 32, "steps": 1500, "snapshots": 6, "draft_vocab": 16384,
             "init_windows": 24, "answers": ANSWERS,
             "measure": {"files": 24, "chat": 16, "other": 16, "prompt_tokens": 256, "new_tokens": 128}},
    # the same recipe at a GPU's scale (an H200: --device cuda, the corpus built here and carried there)
    "gpu": {"packages": sorted(CORPUS_PACKAGES), "max_files": None, "seq_len": 512, "batch_seqs": 32,
            "anchors": 192, "min_context": 32, "steps": 2000, "snapshots": 8, "draft_vocab": 16384,
            "init_windows": 64, "answers": ANSWERS,
            "measure": {"files": 24, "chat": 16, "other": 16, "prompt_tokens": 256, "new_tokens": 128}},
}
DRAFT_SHAPE = {"num_hidden_layers": 2, "chs_num_layers": 5, "block_size": 8, "anchor_group_size": 2,
               "sequential_rank": 256}
OTHER_PACKAGE = "click"  # code from outside the allow-list, never trained on
LR = 1e-3  # peak (cosine to a tenth)
TOP_K = 32  # the target's distribution kept per position (TV over these + the rest)
LOSS = LossWeights()
VOCAB_FILE = "draft_vocab.json"  # beside the corpus parts: the draft vocabulary (target ids), chosen once
PROMPTS_FILE = "held_out_prompts.json"  # beside them: the held-out prompt sets (token ids), made once


def other_package_files() -> list[Path]:
    import importlib

    root = Path(importlib.import_module(OTHER_PACKAGE).__file__).parent
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size > 2000)


def ngram_acceptance(prompt: list[int], output: list[int], block_size: int) -> list[int]:
    """Tokens kept per step by n-gram prompt lookup on a greedy output (exact: greedy verification
    keeps a proposal's leading tokens that equal the target's own output)."""
    from dlite_trt.runtime.prompt_lookup import NgramIndex, PromptLookupConfig

    index = NgramIndex(PromptLookupConfig(num_tokens=block_size - 1))
    kept, i = [], 1  # the prefill emitted output[0]
    while i < len(output):
        proposal = index.propose(prompt + output[:i], block_size - 1)
        n = 0
        while n < len(proposal) and i + n < len(output) and proposal[n] == output[i + n]:
            n += 1
        step = min(n + 1, len(output) - i)
        kept.append(step)
        i += step
    return kept


def measure(target, draft, prompt_sets: dict[str, list[list[int]]], new_tokens: int,
            baselines: dict[str, list[list[int]]]) -> dict:
    """Mean acceptance length per prompt set (reference generator, greedy, batched), and whether
    the output equals target-only greedy decoding."""
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.runtime.session import SamplingParams

    adapter = TargetAdapter(target.hf, target.spec, draft.cfg.target_layer_ids).eval()
    generator = SpeculativeGenerator(adapter, draft.float().eval())
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=target.stops)
    report = {}
    for name, prompts in prompt_sets.items():
        result = generator.session(prompts).generate(params)
        kept = [k for row in range(len(prompts)) for k in result.acceptance_lengths(row)]
        report[name] = {"mean_acceptance_length": round(sum(kept) / len(kept), 3), "steps": len(kept),
                        "prompts": len(prompts),
                        "greedy_equals_target_only": [list(o) for o in result.output_ids] == baselines[name]}
    return report


def agreement(target, draft, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """Where the draft agrees with the target, teacher-forced over the target's own greedy outputs
    (a block anchored at every output position; on the target's output, teacher forcing is what
    decoding feeds until the first miss): per block position k, by the target's confidence (its
    top probability at that position), and the acceptance length that implies."""
    import torch

    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.training.examples import draft_examples, target_states
    from dlite_trt.training.teacher import student_logits

    adapter = TargetAdapter(target.hf, target.spec, draft.cfg.target_layer_ids).eval()
    hits, confs, valids = [], [], []
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs, strict=True):
            tokens = torch.tensor([prompt + output], device=adapter.embed_weight.device)
            if len(output) < 3:
                continue
            hidden, logits = target_states(adapter, tokens)
            anchors = torch.arange(len(prompt), tokens.shape[1] - 1, device=tokens.device)[None]
            ex = draft_examples(tokens, hidden, logits, anchors, draft.cfg.anchor_group_size, draft.cfg.num_proposals)
            out = student_logits(draft, ex, adapter.embed_weight)
            hits.append(draft.sequential_head.to_target(out.logits.argmax(-1)) == ex.labels)  # rows -> ids
            confs.append(ex.target_probs[..., 0])
            valids.append(ex.valid)
    hit, conf, valid = torch.cat(hits).cpu(), torch.cat(confs).cpu(), torch.cat(valids).cpu()
    prefix = torch.cumprod((hit | ~valid).long(), dim=1) * valid  # accepted through position k
    buckets = {}
    for lo, hi in ((0.0, 0.5), (0.5, 0.9), (0.9, 1.01)):
        sel = valid & (conf >= lo) & (conf < hi)
        buckets[f"target_top_p_{lo}-{min(hi, 1.0)}"] = {"share_of_positions": round(float(sel.sum() / valid.sum()), 3),
                                                       "draft_agrees": round(float(hit[sel].float().mean()), 3)}
    return {"per_position_agreement": [round(float(hit[:, k][valid[:, k]].float().mean()), 3)
                                       for k in range(hit.shape[1])],
            "by_target_confidence": buckets, "blocks": int(hit.shape[0]),
            "teacher_forced_acceptance_length": round(1 + float(prefix.sum(1).float().mean()), 3),
            "teacher_forced_acceptance_length_by_block_size": {  # the same blocks cut to fewer proposals
                str(k + 1): round(1 + float(prefix[:, :k].sum(1).float().mean()), 3)
                for k in range(1, hit.shape[1] + 1)}}


def package_sources(name: str, version: str, work: Path) -> Path:
    """The package's wheel at the pinned version (pip download, no dependencies), its .py files
    extracted under ``work/sources/name-version``: the directory of the package's sources."""
    root = work / "sources" / f"{name}-{version}"
    done = root / ".complete"
    if not done.is_file():
        wheels = work / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                        f"{name}=={version}"], check=True)
        found = sorted(wheels.glob(f"{name}-{version}*.whl")) or sorted(wheels.glob(f"{name}-{version}+*.whl"))
        if not found:
            raise click.ClickException(f"pip downloaded no wheel of {name}=={version} into {wheels}")
        with zipfile.ZipFile(found[0]) as wheel:
            for member in wheel.namelist():
                if member.endswith(".py") and member.startswith(f"{name}/"):
                    wheel.extract(member, root)
        done.touch()
    return root / name


def allow_list(work: Path, budget: dict) -> tuple[list[Path], Path, list[tuple[Path, str, list[Path]]]]:
    """The allow-list's files: the standard library's training split (and its root), and each
    package's (root, name, files)."""
    from dlite_trt.tiny_models import stdlib_files

    def limited(files: list[Path]) -> list[Path]:
        return files[: budget["max_files"]] if budget["max_files"] else files

    stdlib = limited(stdlib_files("train"))
    packages = [(package_sources(name, CORPUS_PACKAGES[name], work), name) for name in budget["packages"]]
    return stdlib, stdlib[0].parent, [(root, name, limited(sorted(root.rglob("*.py")))) for root, name in packages]


def build_corpus(tokenizer, vocab_size: int, parts_dir: Path, work: Path, budget: dict, seed: int) -> None:
    """The four corpus parts of real text (raw and chat, the standard library's training split and
    the packages), each written once."""
    from dlite_trt.training.corpus import META, chat_documents, file_documents, write_corpus

    stdlib, stdlib_root, package_files = allow_list(work, budget)

    def raw_packages():
        for root, name, files in package_files:
            yield from file_documents(files, root, tokenizer, label=name)

    def chat_packages():
        for root, name, files in package_files:
            yield from chat_documents(files, root, tokenizer, label=name, seed=seed)

    makers = {"stdlib": lambda: file_documents(stdlib, stdlib_root, tokenizer, label="stdlib"),
              "chat-stdlib": lambda: chat_documents(stdlib, stdlib_root, tokenizer, label="stdlib", seed=seed),
              "packages": raw_packages, "chat-packages": chat_packages}
    for part, make in makers.items():
        out = parts_dir / part
        if not (out / META).is_file():
            write_corpus(make(), out, eos_id=tokenizer.eos_token_id, tokenizer_name="smollm2-135m",
                         vocab_size=vocab_size)


def build_answers(target: "Target", parts_dir: Path, work: Path, budget: dict, seed: int, say,
                  rounds: int = 1) -> None:
    """The answers part: prompts from ``budget["answers"]["files"]`` seeded files of the allow-list
    (file cuts, docstrings to implement, chat requests) per round, each round's from the next slice of
    the shuffled files, answered greedily by the bf16 target in batches (``work/answers.jsonl``,
    appended as each batch ends: resumable), written once."""
    import random

    from dlite_trt.training.answers import answer_documents, answer_to_file
    from dlite_trt.training.corpus import META, write_corpus
    from dlite_trt.training.prompts import coding_prompts

    out = parts_dir / ANSWERS_PART
    if (out / META).is_file():
        return
    a = budget["answers"]
    stdlib, _, package_files = allow_list(work, budget)
    files = sorted(chain(stdlib, *(files for _, _, files in package_files)))
    random.Random(seed + 5).shuffle(files)
    if (rounds - 1) * a["files"] >= len(files):  # the last round's slice may be short, not empty
        raise click.ClickException(f"--answer-rounds {rounds}: the allow-list's {len(files)} files make at most "
                                   f"{-(-len(files) // a['files'])} rounds of {a['files']}.")
    prompts = [p for r in range(rounds)
               for p in coding_prompts(files[r * a["files"]: (r + 1) * a["files"]], target.tokenizer,
                                       counts=a["counts"], max_prompt_tokens=a["max_prompt_tokens"], seed=seed + 5 + r)]
    start = time.perf_counter()

    def progress(done: int, total: int, tokens: int) -> None:
        say(f"answers: {done}/{total} prompts, {tokens} answer tokens ({time.perf_counter() - start:.0f} s)")

    tok = target.tokenizer
    records = answer_to_file(target.bf16_copy().eval(), prompts, work / ANSWERS_FILE,
                             max_new_tokens=a["new_tokens"], stop_ids=target.stops,
                             pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                             batch_size=a["batch"], progress=progress)
    write_corpus(answer_documents(records.values(), label=ANSWERS_PART), out, eos_id=tok.eos_token_id,
                 tokenizer_name="smollm2-135m", vocab_size=target.spec.vocab_size)


def greedy_coverage(vocab, outputs: list[list[int]]) -> float:
    """Share of the target's greedy tokens that the draft vocabulary holds."""
    chosen = set(int(i) for i in vocab)
    tokens = [t for o in outputs for t in o]
    return round(sum(t in chosen for t in tokens) / max(1, len(tokens)), 4)


class Target:
    """The SmolLM2 target, loaded once: HF model, spec, tokenizer, stop tokens."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        from dlite_trt.targets import build_hf_model, load_tokenizer, resolve_target, stop_token_ids

        self.source = resolve_target("smollm2-135m", progress=False)
        self.spec = self.source.spec
        self.hf = build_hf_model(self.source, torch.float32).eval().requires_grad_(False).to(device)
        self.tokenizer = load_tokenizer(self.source)
        self.stops = stop_token_ids(self.source, self.tokenizer)

    def bf16_copy(self):
        """The target's model with bf16 weights, where the fp32 one is (for training's teacher-forced pass)."""
        import torch

        from dlite_trt.targets import build_hf_model

        return build_hf_model(self.source, torch.bfloat16).requires_grad_(False).to(self.hf.device)


def held_out_prompts(tok, m: dict, seed: int) -> dict[str, list[list[int]]]:
    """The three held-out prompt sets (token ids), from this machine's standard library and click."""
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.prompts import coding_prompts

    def opening(path: Path) -> list[int]:
        return tok.encode(path.read_text(errors="replace"), add_special_tokens=False)[: m["prompt_tokens"]]

    held_out = stdlib_files("held_out")
    return {
        "held_out_stdlib_files": [opening(p) for p in held_out[: m["files"]]],
        "held_out_chat_instructions": [ids for _, ids in coding_prompts(held_out, tok, counts={"chat": m["chat"]},
                                                                         max_prompt_tokens=512, seed=seed + 1)],
        f"{OTHER_PACKAGE}_files": [opening(p) for p in other_package_files()[: m["other"]]],
    }


def label_precision(adapter, mix, windows: int, seq_len: int, seed: int) -> dict:
    """On a GPU: how often the target's argmax (the labels) with TF32 matmuls differs from full
    fp32 over seeded corpus windows."""
    import torch

    from dlite_trt.training.examples import target_states

    tokens = mix.windows(windows, seq_len, torch.Generator().manual_seed(seed + 17)).to(adapter.embed_weight.device)
    choices, before = {}, torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            choices[precision] = target_states(adapter, tokens)[1].argmax(-1)
    finally:
        torch.set_float32_matmul_precision(before)
    return {"positions": tokens.numel(),
            "tf32_argmax_differs_from_fp32": round(float((choices["high"] != choices["highest"]).float().mean()), 5)}


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("dlite_trt/bundled/smollm2"),
              show_default=True, help="Where the trained draft (fp16) and acceptance.json go.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Resumable state, outside the repository: the corpus, the runs, the snapshots.")
@click.option("--budget", type=click.Choice(sorted(BUDGETS)), default="full", show_default=True)
@click.option("--until", type=click.Choice(["corpus", "answers", "train", "curve", "all"]), default="all",
              show_default=True,
              help="Stop after this stage (rerun to go on). answers: the target's greedy answers (the longest stage "
                   "on a CPU). curve: after training, the teacher-forced "
                   "acceptance length of each snapshot on the held-out sets (cheap on a GPU), then stop.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Training steps (default: the budget's).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the target and the draft train: cpu, or cuda (TF32 matmuls; the labels' precision is "
                   "measured and recorded).")
@click.option("--bf16", is_flag=True,
              help="Train with the target's pass in bf16 (a bf16 copy of its weights) and the draft's forward under "
                   "bf16 autocast: about 1.7x a step on a CPU with AMX; labels differ from fp32's at near-ties. The "
                   "measurements still run the fp32 target.")
@click.option("--corpus-from", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="A corpus this recipe built elsewhere (WORK/corpus of a run stopped with --until corpus, with "
                   f"its {VOCAB_FILE} and {PROMPTS_FILE}): read instead of built, e.g. on a machine with no network.")
@click.option("--init-from", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Start the student from this trained dlite_v1 draft (its shape and draft vocabulary) instead of "
                   "an informed initialisation: e.g. the bundled draft, trained further on this machine.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=LR, show_default=True,
              help="Peak learning rate (cosine to a tenth).")
@click.option("--answer-rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prompt sets of the budget's answers size to answer, each from its own slice of the allow-list's "
                   "shuffled files; round 1 is the one-round set (a new --work may start with a one-round run's "
                   f"{ANSWERS_FILE} in it: its answers are kept).")
def main(out: Path, work: Path, budget: str, until: str, seed: int, steps: int | None, device: str, bf16: bool,
         corpus_from: Path | None, init_from: Path | None, lr: float, answer_rounds: int) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from dlite_trt.checkpoint import DRAFT_VOCAB, load_draft, save_draft
    from dlite_trt.engine.manifest import sha256_file
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.runtime.verify_width import this_machine
    from dlite_trt.training.corpus import frequent_vocabulary, read_corpus_mix, write_mix
    from dlite_trt.training.informed_init import DEFAULT_PARTS, informed_init, sample_corpus_states
    from dlite_trt.training.init_draft import pick_mask_token, write_initial_draft
    from dlite_trt.training.pipeline import BatchSettings, StudentPlan, train_student

    if corpus_from is not None and answer_rounds > 1:  # the answers are made where the corpus is built
        raise click.ClickException("--answer-rounds makes answers where the corpus is built; with --corpus-from the "
                                   "corpus's answers part is read as it is. Pass it to the run that builds the corpus.")
    b = dict(BUDGETS[budget], **({"steps": steps} if steps else {}))
    seconds: dict[str, float] = json.loads((work / "seconds.json").read_text()) if (work / "seconds.json").is_file() \
        else {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - clock, 1)
        clock = time.perf_counter()
        work.mkdir(parents=True, exist_ok=True)
        (work / "seconds.json").write_text(json.dumps(seconds, indent=2))

    def say(text: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {text}", err=True)

    # what every stage's output depends on: a --work made with other settings is refused, not reused
    recipe = {"budget": budget, "settings": {k: v for k, v in b.items() if k != "measure"}, "draft_shape": DRAFT_SHAPE,
              "corpus_packages": CORPUS_PACKAGES, "mix": MIX, "lr": lr, "top_k": TOP_K,
              "informed_init": list(DEFAULT_PARTS), "loss_weights": asdict(LOSS), "seed": seed,
              **({"bf16": True} if bf16 else {}),  # recorded only when set: fp32 work directories stay resumable
              **({"answer_rounds": answer_rounds} if answer_rounds > 1 else {}),  # likewise
              **({"init_from": {"path": str(init_from), "sha256": sha256_file(init_from / "model.safetensors")}}
                 if init_from else {})}
    recorded = work / "recipe.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != json.loads(json.dumps(recipe)):
        raise click.ClickException(f"{work} holds a run with other settings ({recorded}); pass a new --work "
                                   "(or delete it to start over).")
    if not recorded.is_file():
        if work.exists() and any(p.name != ANSWERS_FILE for p in work.iterdir()):  # answers carried in: checked
            raise click.ClickException(f"{work} is not empty and holds no recipe.json; pass a new --work (it may "
                                       f"hold only an {ANSWERS_FILE} of this recipe's, whose answers are kept).")
        work.mkdir(parents=True, exist_ok=True)
        recorded.write_text(json.dumps(recipe, indent=2) + "\n")
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32: labels may differ at near-ties (measured below)
    target = Target(device)
    vocab_size = target.spec.vocab_size
    m = b["measure"]
    corpus_dir = corpus_from or work / "corpus"
    if corpus_from is None:
        say("corpus: the allow-list's sources, tokenized")
        build_corpus(target.tokenizer, vocab_size, corpus_dir, work, b, seed)
    say(f"corpus: {sorted(p.name for p in corpus_dir.iterdir() if p.is_dir())}")
    lap("corpus")
    if until == "corpus":
        return
    if corpus_from is None:
        build_answers(target, corpus_dir, work, b, seed, say, answer_rounds)
        write_mix(corpus_dir, MIX)  # `dlite-trt train ... --data corpus_dir` draws windows as this recipe does
    mix = read_corpus_mix(corpus_dir, vocab_size)
    sizes = {part.directory.name: {"tokens": part.meta["tokens"], "documents": part.meta["documents"]}
             for part in mix.parts}
    mask = pick_mask_token(target.tokenizer, target.spec, target.stops, None)
    if not (corpus_dir / VOCAB_FILE).is_file():  # the N most frequent ids of the whole corpus, chosen once
        counts = sum(part.token_counts(vocab_size) for part in mix.parts)
        ids = frequent_vocabulary(counts, b["draft_vocab"], must_include=[mask])
        (corpus_dir / VOCAB_FILE).write_text(json.dumps([int(i) for i in ids]) + "\n")
    draft_vocab = np.array(json.loads((corpus_dir / VOCAB_FILE).read_text()), dtype=np.int64)
    if init_from is not None:  # the trained draft keeps its own vocabulary
        draft_vocab = load_draft(init_from, target=target.spec).state_dict()[DRAFT_VOCAB].numpy()
    if not (corpus_dir / PROMPTS_FILE).is_file():  # made where the held-out code is (this machine's)
        (corpus_dir / PROMPTS_FILE).write_text(json.dumps(held_out_prompts(target.tokenizer, m, seed)) + "\n")
    prompt_sets = json.loads((corpus_dir / PROMPTS_FILE).read_text())
    say(f"corpus and answers: {sizes}")
    lap("answers")
    if until == "answers":
        return

    init_dir = work / "init" if init_from is None else init_from
    if not (init_dir / "config.json").is_file():
        write_initial_draft(work / "init.tmp", target.spec, mask, seed=seed, draft_vocab=draft_vocab.tolist(),
                            **DRAFT_SHAPE)
        (work / "init.tmp").replace(init_dir)
    cfg = load_draft(init_dir, target=target.spec).cfg
    adapter = TargetAdapter(target.hf, target.spec, cfg.target_layer_ids).eval()
    if device.startswith("cuda") and not (work / "label_precision.json").is_file():
        (work / "label_precision.json").write_text(json.dumps(label_precision(adapter, mix, 8, b["seq_len"], seed)))
    informed_dir = work / "informed-init" if init_from is None else init_from
    if not (informed_dir / "model.safetensors").is_file():  # written whole, then renamed: a kill leaves none
        draft = load_draft(init_dir, target=target.spec).float()
        states = sample_corpus_states(adapter, mix, b["init_windows"], b["seq_len"], seed=seed)
        informed_init(draft, target.hf.lm_head.weight.cpu(), target.hf.model.norm.weight.cpu(), None, states,
                      DEFAULT_PARTS)
        save_draft(draft, work / "informed-init.tmp")
        (work / "informed-init.tmp").replace(informed_dir)
    lap("init")

    batches = BatchSettings(seq_len=b["seq_len"], batch_seqs=b["batch_seqs"], anchors=b["anchors"], seed=seed,
                            anchor_weight="depth", min_context=b["min_context"], top_k=TOP_K)
    student_dir = work / "student"
    if not (student_dir / "model.safetensors").is_file():
        say(f"training: {b['steps']} steps of {b['batch_seqs']} windows x {b['anchors']} blocks, on {device}")
        trainer_target = TargetAdapter(target.bf16_copy(), target.spec, cfg.target_layer_ids).eval() if bf16 \
            else adapter
        train_student(trainer_target, mix, load_draft(informed_dir, target=target.spec).float().to(device),
                      student_dir,
                      StudentPlan(0, b["steps"], lr=lr, snapshot_every=max(1, b["steps"] // b["snapshots"]),
                                  checkpoint_every=max(1, min(50, b["steps"] // 4)), bf16=bf16),
                      batches, weights=LOSS, runs=work / "student-runs")
    lap("train")
    if until == "train":
        return

    params = SamplingParams(max_new_tokens=m["new_tokens"], stop_token_ids=target.stops)
    baselines_file = work / "target_only_outputs.json"
    if not baselines_file.is_file():
        baseline_gen = SpeculativeGenerator.target_only(adapter)
        baselines_file.write_text(json.dumps(
            {name: [list(o) for o in baseline_gen.session(ps).generate_target_only(params).output_ids]
             for name, ps in prompt_sets.items()}) + "\n")
    baselines = json.loads(baselines_file.read_text())
    lap("target_only_baseline")
    per_step = {"blocks": b["batch_seqs"] * b["anchors"], "positions": b["batch_seqs"] * b["seq_len"]}

    def snapshots():
        """(step, draft) of each snapshot before the last step, in order, loaded one at a time."""
        found = {int(f.stem.removeprefix("snapshot-")): f
                 for f in (work / "student-runs" / "stage2-run").glob("snapshot-*.safetensors")}
        for step in sorted(k for k in found if k < b["steps"]):
            draft = DLiteDraft(cfg)
            draft.load_state_dict(load_file(str(found[step])), strict=True)
            yield step, draft

    if until == "curve":  # teacher-forced on the target's own outputs: one forward per prompt and snapshot
        curve = []
        for step, draft in chain(snapshots(), [(b["steps"], load_draft(student_dir, target=target.spec))]):
            draft = draft.float().to(device).eval()
            curve.append({"step": step, "blocks_seen": step * per_step["blocks"],
                          "corpus_positions_seen": step * per_step["positions"],
                          **{name: agreement(target, draft, prompt_sets[name], baselines[name])
                             ["teacher_forced_acceptance_length"] for name in prompt_sets}})
        (work / "teacher_forced_curve.json").write_text(json.dumps(curve, indent=2) + "\n")
        lap("curve")
        click.echo(json.dumps(curve))
        return

    report = {"student": measure(target, load_draft(student_dir, target=target.spec).to(device), prompt_sets,
                                 m["new_tokens"], baselines)}
    report["ngram_prompt_lookup"] = {}
    for name, ps in prompt_sets.items():
        kept = [k for p, o in zip(ps, baselines[name], strict=True) for k in ngram_acceptance(p, o, cfg.block_size)]
        report["ngram_prompt_lookup"][name] = {"mean_acceptance_length": round(sum(kept) / len(kept), 3),
                                               "steps": len(kept), "prompts": len(ps)}
    report["draft_vocab_coverage"] = {name: greedy_coverage(draft_vocab, outs) for name, outs in baselines.items()}
    lap("measure")
    report["agreement"] = {set_name: agreement(target, load_draft(student_dir, target=target.spec).float().to(device),
                                               prompt_sets[set_name], baselines[set_name])
                           for set_name in prompt_sets}
    # the training curve: held-out files' acceptance length at each snapshot, against blocks and
    # corpus positions seen (the last snapshot is the final draft, measured above)
    files_set = {"held_out_stdlib_files": prompt_sets["held_out_stdlib_files"]}
    curve = {b["steps"]: report["student"]["held_out_stdlib_files"]["mean_acceptance_length"]}
    for step, draft in snapshots():
        curve[step] = measure(target, draft.to(device), files_set, m["new_tokens"],
                              baselines)["held_out_stdlib_files"]["mean_acceptance_length"]
    report["training_curve"] = [{"step": step, "blocks_seen": step * per_step["blocks"],
                                 "corpus_positions_seen": step * per_step["positions"], "held_out_files_al": al}
                                for step, al in sorted(curve.items())]
    if (work / "label_precision.json").is_file():
        report["label_precision"] = json.loads((work / "label_precision.json").read_text())
    lap("diagnosis")

    out.mkdir(parents=True, exist_ok=True)
    save_draft(load_draft(student_dir, target=target.spec).half(), out)
    report |= {**recipe, "measure": m, "corpus": sizes, "seconds": seconds,
               "total_seconds": round(sum(seconds.values()), 1), "command": " ".join(["python", *sys.argv]),
               "trained_on": {"device": device, "cpu": this_machine()["cpu"], "torch": torch.__version__,
                              "threads": torch.get_num_threads()}}
    if init_from is not None and (init_from / "acceptance.json").is_file():  # where the draft it started from came from
        report["init_from"]["acceptance"] = json.loads((init_from / "acceptance.json").read_text())
    (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
