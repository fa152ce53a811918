#!/usr/bin/env python
"""Reproduce the bundled small models from scratch (seeded): tokenizer, target, DLite draft.

1. a byte-level BPE on the standard library's training split (held-out files never seen);
2. a small Qwen3 target pretrained as a causal LM on the same files;
3. training data: prompts cut from the training files, answered greedily by the target;
4. the history-aware teacher, then the student in two stages (or one, --single-stage);
5. the acceptance length on held-out files (continue a file, given its opening), greedy,
   written to OUT/acceptance.json.

    python build_scripts/train_bundled_models.py --out models/bundled
    python build_scripts/train_bundled_models.py --out /tmp/smoke --budget smoke   # minutes, not an hour
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

BUDGETS = {  # steps per phase; "full" is sized for under an hour on a 2-core CPU
    "smoke": {"pretrain": 30, "cuts": 1, "prompts": 16, "teacher": 20, "stage1": 10, "stage2": 20},
    "full": {"pretrain": 3000, "cuts": 12, "prompts": 2000, "teacher": 1500, "stage1": 800, "stage2": 2500},
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
        session = pair.generator.session([prompt])
        result = session.generate(SamplingParams(max_new_tokens=new_tokens))
        baseline = pair.generator.session([prompt]).generate_target_only(SamplingParams(max_new_tokens=new_tokens))
        lossless &= result.output_ids == baseline.output_ids
        lengths += result.acceptance_lengths(0)
    return {"mean_acceptance_length": sum(lengths) / len(lengths), "steps": len(lengths), "files": files,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "greedy_equals_target_only": lossless}


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("models/bundled"),
              show_default=True)
@click.option("--budget", type=click.Choice(sorted(BUDGETS)), default="full", show_default=True)
@click.option("--single-stage", is_flag=True, help="Train the student with stage 2 only (the ablation).")
@click.option("--seed", default=0, show_default=True, type=int)
def main(out: Path, budget: str, single_stage: bool, seed: int) -> None:
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
    started = time.perf_counter()
    times = {}
    torch.manual_seed(seed)
    target_dir, draft_dir = out / "target", out / "draft"
    files = stdlib_files("train")
    tok = train_tokenizer(files, 2048, target_dir)
    ids = tok.convert_tokens_to_ids
    spec = tiny_target_spec(len(tok), eos_token_id=(ids("<|im_end|>"), ids("<|endoftext|>")))
    model = Qwen3ForCausalLM(Qwen3Config(**spec.to_hf_config()))
    stream = token_stream(files, tok, ids("<|endoftext|>"))
    pretrain(model, WindowBatches(stream, seq_len=256, batch=16, seed=seed),
             TrainSettings(steps=steps["pretrain"], lr=3e-3, warmup_steps=min(100, steps["pretrain"] // 10)),
             out / "runs" / "target")
    model.eval().save_pretrained(target_dir)
    times["target_s"] = time.perf_counter() - started

    cfg = DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=3, mask_token_id=ids("<|mask|>"),
                                 anchor_group_size=2, block_size=8, sequential_rank=64)
    adapter = TargetAdapter(model, spec, cfg.target_layer_ids).eval().requires_grad_(False)
    prompts = prompts_from_files(files, tok, max_prompt_tokens=192, seed=seed, cuts=steps["cuts"])
    prompts = [prompts[i] for i in torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))]
    prompts = prompts[: steps["prompts"]]
    sequences = answer_prompts(SpeculativeGenerator.target_only(adapter), prompts, max_new_tokens=128,
                               batch_size=16, stop_token_ids=())
    write_sequences(sequences, out / "runs" / "data" / "sequences.jsonl")
    times["data_s"] = time.perf_counter() - started - times["target_s"]

    torch.manual_seed(seed + 1)
    init = DLiteDraft(cfg)
    batches = BatchSettings(seq_len=128, batch_seqs=8, anchors=16, seed=seed)
    teacher = None
    if not single_stage:
        teacher = train_teacher(adapter, sequences, init, out / "runs" / "teacher",
                                TrainSettings(steps=steps["teacher"], lr=1e-3), batches, window=16)
    plan = (StudentPlan(0, steps["stage1"] + steps["stage2"], lr=1e-3) if single_stage
            else StudentPlan(steps["stage1"], steps["stage2"], lr=1e-3))
    train_student(adapter, sequences, init, draft_dir, plan, batches, teacher)
    times["draft_s"] = time.perf_counter() - started - times["target_s"] - times["data_s"]

    report = measure_acceptance(target_dir, draft_dir, files=8, prompt_tokens=256, new_tokens=128)
    report |= {"budget": budget, "single_stage": single_stage, "seconds": time.perf_counter() - started, **times}
    (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
