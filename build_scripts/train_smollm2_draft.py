#!/usr/bin/env python
"""Train the bundled DLite draft for SmolLM2-135M-Instruct from scratch (seeded, resumable).

1. an untrained dlite_v1 draft shaped for the target (`dlite-trt train init`);
2. training data from the target itself: coding prompts made from the standard library's
   training split (the file so far, cut at several places; docstring-style; chat-style through
   the chat template), answered greedily and batched by the reference target, with the draft's
   layers' hidden states and the target's top-k cached on disk (training/state_cache.py);
3. the target-informed initialisation of that draft (training/informed_init.py, from the
   cached states), then the history-aware teacher, then the student in two stages (stage 1: KL
   to the teacher; stage 2: CE + TV against the target), every block anchored in the target's
   own answers (what decoding drafts);
4. with --ablation, a single-stage student (stage 2 only) for the same number of optimizer
   steps (teacher + stage 1 + stage 2) on the same batches;
5. the acceptance length, greedy: held-out standard-library files (each continued from its
   first 256 tokens for 128 new tokens), chat-style instructions made from held-out files, and
   another package's code (never trained on), with n-gram prompt lookup's on the same prompts;
6. the better of the two drafts on held-out files (the two-stage one without --ablation) in
   fp16 -> --out (the bundled draft), with acceptance.json.

Every stage resumes where it stopped when the command is run again with the same --work.

    python build_scripts/train_smollm2_draft.py --ablation              # rewrites the bundled draft
    python build_scripts/train_smollm2_draft.py --budget smoke --work /tmp/w --out /tmp/draft
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click

from dlite_trt.training.losses import LossWeights

BUDGETS = {
    "smoke": {"prompts": {"file": 4, "docstring": 2, "chat": 2}, "answer_tokens": 12, "prompt_tokens": 96,
              "more_prompts": {"file": 2, "chat": 1}, "more_take": 2, "more_answer_tokens": 8,
              "teacher": 4, "stage1": 2, "stage2": 4, "batch_seqs": 2, "anchors": 8, "seq_len": 64,
              "measure": {"files": 1, "chat": 1, "other": 1, "prompt_tokens": 64, "new_tokens": 16}},
    "full": {"prompts": {"file": 420, "docstring": 120, "chat": 120}, "answer_tokens": 96, "prompt_tokens": 320,
             "more_prompts": {"file": 360, "docstring": 180, "chat": 180}, "more_take": 240, "more_answer_tokens": 128,
             "teacher": 100, "stage1": 100, "stage2": 500, "batch_seqs": 8, "anchors": 16, "seq_len": 256,
             "measure": {"files": 24, "chat": 16, "other": 16, "prompt_tokens": 256, "new_tokens": 128}},
}
DRAFT_SHAPE = {"num_hidden_layers": 2, "chs_num_layers": 5, "block_size": 8, "anchor_group_size": 2,
               "sequential_rank": 128}
OTHER_PACKAGE = "click"  # code from outside the standard library, never trained on
ANCHOR_REGION = "answer"  # blocks drafting the target's own answers (docs/training.md, levers)
DATA_BATCH = 16  # prompts answered together
LR = 1e-3  # peak (cosine to a tenth)
LOSS = LossWeights()


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
            tokens = torch.tensor([prompt + output])
            if len(output) < 3:
                continue
            hidden, logits = target_states(adapter, tokens)
            anchors = torch.arange(len(prompt), tokens.shape[1] - 1)[None]
            ex = draft_examples(tokens, hidden, logits, anchors, draft.cfg.anchor_group_size, draft.cfg.num_proposals)
            out = student_logits(draft, ex, adapter.embed_weight)
            hits.append(out.logits.argmax(-1) == ex.labels)
            confs.append(ex.target_probs[..., 0])
            valids.append(ex.valid)
    hit, conf, valid = torch.cat(hits), torch.cat(confs), torch.cat(valids)
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


Prompts = list[tuple[str, list[int]]]  # (kind, token ids)


def training_prompts(tokenizer, budget: dict, seed: int) -> tuple[Prompts, Prompts]:
    """The two prompt sets answered for the data, [(kind, ids)] each: the first, and the second
    the cache grows by (the first ``more_take`` of another draw: other cuts, other functions' prompts;
    exact repeats of the first dropped)."""
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.prompts import coding_prompts

    files = stdlib_files("train")
    first = coding_prompts(files, tokenizer, counts=budget["prompts"], max_prompt_tokens=budget["prompt_tokens"],
                           seed=seed)
    seen = {tuple(p) for _, p in first}
    more = [(kind, p) for kind, p in coding_prompts(files, tokenizer, counts=budget["more_prompts"],
                                                    max_prompt_tokens=budget["prompt_tokens"], seed=seed + 1)
            if tuple(p) not in seen]
    return first, more[: budget["more_take"]]


def training_answers(cache, prompts: Prompts, kind: str, min_answer: int, limit: int) -> tuple[list, list]:
    """(prompts, answers) of the first ``limit`` cached sequences whose prompt is of ``kind`` with an
    answer of at least ``min_answer`` tokens: answers a draft was trained on (memorisation)."""
    of_kind = {tuple(p) for k, p in prompts if k == kind}
    seen = [s for s in cache.sequences if tuple(s.prompt_ids) in of_kind and len(s.answer_ids) >= min_answer][:limit]
    return [list(s.prompt_ids) for s in seen], [list(s.answer_ids) for s in seen]


class Target:
    """The SmolLM2 target, loaded once: HF model, spec, tokenizer, stop tokens."""

    def __init__(self) -> None:
        import torch

        from dlite_trt.targets import build_hf_model, load_tokenizer, resolve_target, stop_token_ids

        self.source = resolve_target("smollm2-135m", progress=False)
        self.spec = self.source.spec
        self.hf = build_hf_model(self.source, torch.float32).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(self.source)
        self.stops = stop_token_ids(self.source, self.tokenizer)


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("dlite_trt/bundled/smollm2"),
              show_default=True, help="Where the trained draft (fp16) and acceptance.json go.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=Path("build/smollm2-draft-runs"),
              show_default=True, help="Resumable state: data, state cache, training runs, the ablation's draft.")
@click.option("--budget", type=click.Choice(sorted(BUDGETS)), default="full", show_default=True)
@click.option("--ablation", is_flag=True, help="Also train single-stage at the same budget and measure both.")
@click.option("--until", type=click.Choice(["data", "teacher", "two-stage", "all"]), default="all", show_default=True,
              help="Stop after this stage (rerun to go on).")
@click.option("--seed", default=0, show_default=True, type=int)
def main(out: Path, work: Path, budget: str, ablation: bool, until: str, seed: int) -> None:
    from safetensors.torch import load_file

    from dlite_trt.checkpoint import load_draft, save_draft
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.informed_init import DEFAULT_PARTS, informed_init, sample_states
    from dlite_trt.training.init_draft import pick_mask_token, write_initial_draft
    from dlite_trt.training.pipeline import BatchSettings, StudentPlan, load_teacher, train_student, train_teacher
    from dlite_trt.training.prompts import coding_prompts
    from dlite_trt.training.state_cache import StateCache, write_state_cache
    from dlite_trt.training.trainer import TrainSettings

    b = BUDGETS[budget]
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
              "lr": LR, "informed_init": list(DEFAULT_PARTS), "anchor_region": ANCHOR_REGION,
              "loss_weights": asdict(LOSS), "seed": seed}
    recorded = work / "recipe.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != json.loads(json.dumps(recipe)):
        raise click.ClickException(f"{work} holds a run with other settings ({recorded}); pass a new --work "
                                   "(or delete it to start over).")
    if not recorded.is_file():
        if any((work / part).exists() for part in ("teacher", "two-stage", "single-stage", "informed-init")):
            raise click.ClickException(f"{work} holds training runs of an earlier recipe (no recipe.json); pass a "
                                       "new --work (its data/ can be copied there: the cache grows).")
        work.mkdir(parents=True, exist_ok=True)
        recorded.write_text(json.dumps(recipe, indent=2) + "\n")
    target = Target()
    init_dir = work / "init"
    if not (init_dir / "config.json").is_file():
        mask = pick_mask_token(target.tokenizer, target.spec, target.stops, None)
        write_initial_draft(init_dir, target.spec, mask, seed=seed, **DRAFT_SHAPE)
    cfg = load_draft(init_dir, target=target.spec).cfg
    adapter = TargetAdapter(target.hf, target.spec, cfg.target_layer_ids).eval()

    first, more = training_prompts(target.tokenizer, b, seed)
    prompts = first + more

    def kinds_of(part: Prompts) -> dict[str, int]:
        return {k: sum(1 for kind, _ in part if kind == k) for k in ("file", "docstring", "chat")}

    kinds = kinds_of(prompts)
    for upto, answer_tokens in ((first, b["answer_tokens"]), (prompts, b["more_answer_tokens"])):
        say(f"data: {len(upto)} prompts {kinds_of(upto)}, answers up to {answer_tokens} tokens -> {work / 'data'}")
        write_state_cache(adapter, [p for _, p in upto], work / "data", layer_ids=cfg.target_layer_ids,
                          max_new_tokens=answer_tokens, stop_token_ids=target.stops, batch_size=DATA_BATCH,
                          target_name="smollm2-135m",
                          log=lambda done, total, rate: say(f"data {done}/{total} prompts, {rate:.0f} answer tok/s"))
    lap("data")
    if until == "data":
        return
    cache = StateCache(work / "data", cfg.target_layer_ids, target.spec.vocab_size)
    informed_dir = work / "informed-init"
    if not (informed_dir / "model.safetensors").is_file():  # written whole, then renamed: a kill leaves none
        draft = load_draft(init_dir, target=target.spec).float()
        informed_init(draft, target.hf.lm_head.weight, target.hf.model.norm.weight, None,
                      sample_states(cache, 200, seed=seed), DEFAULT_PARTS)
        save_draft(draft, work / "informed-init.tmp")
        (work / "informed-init.tmp").replace(informed_dir)
    batches = BatchSettings(seq_len=b["seq_len"], batch_seqs=b["batch_seqs"], anchors=b["anchors"], seed=seed,
                            anchor_region=ANCHOR_REGION)
    init = load_draft(informed_dir, target=target.spec).float()
    if (work / "teacher" / "teacher.safetensors").is_file():
        teacher = load_teacher(work / "teacher")
    else:
        teacher = train_teacher(adapter, cache, init, work / "teacher", TrainSettings(steps=b["teacher"], lr=LR),
                                batches, window=16, weights=LOSS)
    lap("teacher")
    if until == "teacher":
        return
    two_stage = work / "two-stage"
    if not (two_stage / "model.safetensors").is_file():
        train_student(adapter, cache, load_draft(informed_dir, target=target.spec).float(), two_stage,
                      StudentPlan(b["stage1"], b["stage2"], lr=LR, snapshot_every=max(1, b["stage2"] // 4)), batches,
                      teacher, weights=LOSS, runs=work / "two-stage-runs")
    lap("two_stage")
    if until == "two-stage":
        return
    single = work / "single-stage"
    if ablation and not (single / "model.safetensors").is_file():
        total = b["teacher"] + b["stage1"] + b["stage2"]
        train_student(adapter, cache, load_draft(informed_dir, target=target.spec).float(), single,
                      StudentPlan(0, total, lr=LR, snapshot_every=max(1, total // 4)), batches,
                      weights=LOSS, runs=work / "single-stage-runs")
    lap("single_stage")

    m = b["measure"]
    tok = target.tokenizer

    def opening(path: Path) -> list[int]:
        return tok.encode(path.read_text(errors="replace"), add_special_tokens=False)[: m["prompt_tokens"]]

    held_out = stdlib_files("held_out")
    prompt_sets = {
        "held_out_stdlib_files": [opening(p) for p in held_out[: m["files"]]],
        "held_out_chat_instructions": [ids for _, ids in coding_prompts(held_out, tok, counts={"chat": m["chat"]},
                                                                         max_prompt_tokens=512, seed=seed + 1)],
        f"{OTHER_PACKAGE}_files": [opening(p) for p in other_package_files()[: m["other"]]],
    }
    params = SamplingParams(max_new_tokens=m["new_tokens"], stop_token_ids=target.stops)
    baseline_gen = SpeculativeGenerator.target_only(adapter)
    baselines = {name: [list(o) for o in baseline_gen.session(ps).generate_target_only(params).output_ids]
                 for name, ps in prompt_sets.items()}
    lap("target_only_baseline")
    drafts = {"two_stage": two_stage, **({"single_stage": single} if ablation else {})}
    report = {name: measure(target, load_draft(path, target=target.spec), prompt_sets, m["new_tokens"], baselines)
              for name, path in drafts.items()}
    report["ngram_prompt_lookup"] = {}
    for name, ps in prompt_sets.items():
        kept = [k for p, o in zip(ps, baselines[name], strict=True) for k in ngram_acceptance(p, o, cfg.block_size)]
        report["ngram_prompt_lookup"][name] = {"mean_acceptance_length": round(sum(kept) / len(kept), 3),
                                               "steps": len(kept), "prompts": len(ps)}
    lap("measure")
    files_set = {"held_out_stdlib_files": prompt_sets["held_out_stdlib_files"]}
    report["agreement"] = {name: {set_name: agreement(target, load_draft(path, target=target.spec).float(),
                                                      prompt_sets[set_name], baselines[set_name])
                                  for set_name in prompt_sets}
                           for name, path in drafts.items()}
    # memorisation: the same agreement on answers the drafts were trained on (file prompts of the
    # first set), against the held-out files' above
    seen_prompts, seen_answers = training_answers(cache, first, "file", min(64, b["answer_tokens"] // 2), m["files"])
    if seen_prompts:
        for name, path in drafts.items():
            report["agreement"][name]["training_file_answers"] = agreement(
                target, load_draft(path, target=target.spec).float(), seen_prompts, seen_answers)
    # the training-steps curve: held-out files' acceptance length at the two-stage student's
    # stage-2 snapshots (the last one is the final draft, measured above)
    curve = {f"stage2_step_{b['stage2']}": report["two_stage"]["held_out_stdlib_files"]["mean_acceptance_length"]}
    for snap in (work / "two-stage-runs" / "stage2-run").glob("snapshot-*.safetensors"):
        if int(snap.stem[9:]) < b["stage2"]:
            draft = DLiteDraft(cfg)
            draft.load_state_dict(load_file(str(snap)), strict=True)
            got = measure(target, draft, files_set, m["new_tokens"], baselines)["held_out_stdlib_files"]
            curve[f"stage2_step_{snap.stem[9:]}"] = got["mean_acceptance_length"]
    report["steps_curve"] = dict(sorted(curve.items(), key=lambda item: int(item[0].rsplit("_", 1)[1])))
    lap("diagnosis")

    # chosen on the held-out files, so the bundled draft's figure there is the better of two
    # measured; the chat and other-package sets play no part in the choice
    bundled = max(drafts, key=lambda name: report[name]["held_out_stdlib_files"]["mean_acceptance_length"])
    out.mkdir(parents=True, exist_ok=True)
    save_draft(load_draft(drafts[bundled], target=target.spec).half(), out)
    data_tokens = {"sequences": len(cache.sequences), "prompt_tokens": sum(len(s.prompt_ids) for s in cache.sequences),
                   "answer_tokens": sum(len(s.answer_ids) for s in cache.sequences), "prompt_kinds": kinds}
    report |= {**recipe, "measure": m, "bundled": bundled, "data": data_tokens, "seconds": seconds,
               "total_seconds": round(sum(seconds.values()), 1), "command": " ".join(["python", *sys.argv])}
    (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
