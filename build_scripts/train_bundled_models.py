#!/usr/bin/env python
"""Reproduce the bundled small models from scratch (seeded): tokenizer, target, DLite draft.

1. a byte-level BPE on the standard library's training split (held-out files never seen);
2. a small Qwen3 target pretrained as a causal LM on the same files;
3. training data: prompts cut from the training files, answered greedily by the target;
4. the history-aware teacher, then the student in two stages;
5. with --ablation, a second student trained single-stage (stage 2 only) for the same number of
   optimizer steps (teacher + stage 1 + stage 2) on the same batches;
6. the acceptance length on held-out files (continue a file, given the file so far), greedy,
   block size 8, written to OUT/acceptance.json.

    python build_scripts/train_bundled_models.py --ablation     # rewrites dlite_trt/bundled
    python build_scripts/train_bundled_models.py --out /tmp/smoke --work /tmp/smoke-runs --budget smoke
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

BUDGETS = {  # steps per phase and data sizes; "full" is sized for under an hour on a 2-core CPU
    "smoke": {"pretrain": 30, "cuts": 1, "prompts": 16, "answer_tokens": 32, "teacher": 20, "stage1": 10,
              "stage2": 20, "held_out": {"files": 2, "prompt_tokens": 64, "new_tokens": 32}},
    "full": {"pretrain": 3000, "cuts": 12, "prompts": 2000, "answer_tokens": 128, "teacher": 1500, "stage1": 800,
             "stage2": 2500, "held_out": {"files": 8, "prompt_tokens": 256, "new_tokens": 128}},
}


def measure_acceptance(target: Path, draft: Path, files: int, prompt_tokens: int, new_tokens: int) -> dict:
    """Mean acceptance length (tokens per step, bonus included) continuing held-out files, greedy."""
    from dlite_trt.loading import load_pair
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.tiny_models import stdlib_files

    pair = load_pair(target, draft)
    lengths, lossless = [], True
    for path in stdlib_files("held_out")[:files]:
        prompt = pair.tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)[:prompt_tokens]
        result = pair.generator.session([prompt]).generate(SamplingParams(max_new_tokens=new_tokens))
        baseline = pair.generator.session([prompt]).generate_target_only(SamplingParams(max_new_tokens=new_tokens))
        lossless &= result.output_ids == baseline.output_ids
        lengths += result.acceptance_lengths(0)
    return {"mean_acceptance_length": sum(lengths) / len(lengths), "steps": len(lengths), "files": files,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "greedy_equals_target_only": lossless}


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("dlite_trt/bundled"),
              show_default=True, help="Where target/, draft/ and acceptance.json go.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=Path("build/bundled-runs"),
              show_default=True, help="Training runs (resumable state), data and the ablation's draft.")
@click.option("--budget", type=click.Choice(sorted(BUDGETS)), default="full", show_default=True)
@click.option("--vocab-size", default=512, show_default=True, type=click.IntRange(min=300))
@click.option("--hidden-size", default=128, show_default=True, type=click.IntRange(min=32),
              help="The target's hidden size (4 heads of hidden/4, MLP 3x hidden, 4 layers).")
@click.option("--anchor-group-size", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--ablation", is_flag=True, help="Also train single-stage at the same budget and measure both.")
@click.option("--seed", default=0, show_default=True, type=int)
def main(out: Path, work: Path, budget: str, vocab_size: int, hidden_size: int, anchor_group_size: int, ablation: bool,
         seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dlite_trt.config import DraftConfig
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.tiny_models import stdlib_files, tiny_target_spec, train_tokenizer
    from dlite_trt.training.data import answer_prompts, prompts_from_files, write_sequences
    from dlite_trt.training.pipeline import BatchSettings, StudentPlan, train_student, train_teacher
    from dlite_trt.training.pretrain import WindowBatches, pretrain, token_stream
    from dlite_trt.training.trainer import TrainSettings

    steps = BUDGETS[budget]
    clock = time.perf_counter()
    seconds = {}

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    torch.manual_seed(seed)
    target_dir, draft_dir = out / "target", out / "draft"
    files = stdlib_files("train")
    tok = train_tokenizer(files, vocab_size, target_dir)
    ids = tok.convert_tokens_to_ids
    spec = tiny_target_spec(len(tok), hidden_size=hidden_size, head_dim=hidden_size // 4,
                            intermediate_size=3 * hidden_size, eos_token_id=(ids("<|im_end|>"), ids("<|endoftext|>")))
    model = Qwen3ForCausalLM(Qwen3Config(**spec.to_hf_config()))
    stream = token_stream(files, tok, ids("<|endoftext|>"))
    pretrain(model, WindowBatches(stream, seq_len=256, batch=16, seed=seed),
             TrainSettings(steps=steps["pretrain"], lr=3e-3, warmup_steps=min(100, steps["pretrain"] // 10)),
             work / "target")
    model.eval().save_pretrained(target_dir)
    lap("target")

    cfg = DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=3, mask_token_id=ids("<|mask|>"),
                                 anchor_group_size=anchor_group_size, block_size=8, sequential_rank=64)
    adapter = TargetAdapter(model, spec, cfg.target_layer_ids).eval().requires_grad_(False)
    prompts = prompts_from_files(files, tok, max_prompt_tokens=192, seed=seed, cuts=steps["cuts"])
    prompts = [prompts[i] for i in torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))]
    sequences = answer_prompts(SpeculativeGenerator.target_only(adapter), prompts[: steps["prompts"]],
                               max_new_tokens=steps["answer_tokens"], batch_size=16, stop_token_ids=())
    write_sequences(sequences, work / "data" / "sequences.jsonl")
    lap("data")

    torch.manual_seed(seed + 1)
    init = DLiteDraft(cfg).state_dict()

    def student() -> DLiteDraft:  # both students start from the same initial weights
        draft = DLiteDraft(cfg)
        draft.load_state_dict(init, strict=True)
        return draft

    batches = BatchSettings(seq_len=128, batch_seqs=8, anchors=16, seed=seed)
    teacher = train_teacher(adapter, sequences, student(), work / "teacher",
                            TrainSettings(steps=steps["teacher"], lr=3e-3), batches, window=16)
    train_student(adapter, sequences, student(), draft_dir,
                  StudentPlan(steps["stage1"], steps["stage2"], lr=3e-3), batches, teacher, runs=work / "student")
    lap("two_stage_draft")
    report = {"two_stage": measure_acceptance(target_dir, draft_dir, **steps["held_out"])}
    lap("measure")
    if ablation:
        single_dir = work / "single-stage-draft"
        total = steps["teacher"] + steps["stage1"] + steps["stage2"]
        train_student(adapter, sequences, student(), single_dir, StudentPlan(0, total, lr=3e-3), batches)
        lap("single_stage_draft")
        report["single_stage"] = measure_acceptance(target_dir, single_dir, **steps["held_out"])
        lap("measure_single")
    report |= {"budget": budget, "steps": steps, "vocab_size": len(tok), "hidden_size": hidden_size,
               "anchor_group_size": anchor_group_size,
               "seed": seed, "seconds": seconds, "total_seconds": round(sum(seconds.values()), 1),
               "command": " ".join(["python", *sys.argv])}
    (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
