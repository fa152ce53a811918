#!/usr/bin/env python
"""How fast the SmolLM2 draft trains on this CPU: draft blocks/s of a training step and the
target's teacher-forced tokens/s, fp32 against bf16, the full vocabulary against reduced ones.

Every configuration runs the same batch (real corpus windows when --corpus is given, else the
standard library's training split), rounds interleaved (one step of each configuration per
round, so load on the machine hits all alike), medians reported. bf16 here is
``torch.autocast("cpu", torch.bfloat16)`` around the forward (fp32 master weights and
optimizer), the way the trainer would use it; the target in bf16 is a bf16 copy of its
weights. Also: how often the bf16 target's argmax differs from the fp32 one's (labels from a
bf16 pass are that noisy at near-ties).

    python build_scripts/bench_draft_training.py --rounds 5 --out bench_draft_training.json
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import click

CONFIGS = {  # name -> (rank, draft vocabulary size or None, autocast bf16)
    "r128-full-fp32 (the previous recipe's draft)": (128, None, False),
    "r128-full-bf16": (128, None, True),
    "r256-16384-fp32 (this recipe's draft)": (256, 16384, False),
    "r256-16384-bf16": (256, 16384, True),
    "r256-8192-fp32": (256, 8192, False),
}


@click.command()
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--windows", default=4, show_default=True, type=click.IntRange(min=1), help="Windows per step.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=16))
@click.option("--anchors", default=192, show_default=True, type=click.IntRange(min=1), help="Blocks per window.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=Path("bench_draft_training.json"),
              show_default=True)
def main(rounds: int, windows: int, seq_len: int, anchors: int, threads: int, out: Path) -> None:
    import torch

    from dlite_trt.config import DraftConfig
    from dlite_trt.model.draft import DLiteDraft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.targets import build_hf_model, load_tokenizer, resolve_target
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.examples import TargetTopK, draft_examples, target_states
    from dlite_trt.training.stages import stage2_loss

    torch.set_num_threads(threads)
    source = resolve_target("smollm2-135m", progress=False)
    hf = build_hf_model(source, torch.float32).eval().requires_grad_(False)
    hf_bf16 = build_hf_model(source, torch.bfloat16).eval().requires_grad_(False)
    tok = load_tokenizer(source)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files("train")[:40])
    ids = tok.encode(text, add_special_tokens=False)[: windows * seq_len]
    tokens = torch.tensor(ids).view(windows, seq_len)

    def draft_for(rank: int, vocab: int | None) -> DLiteDraft:
        cfg = DraftConfig.for_target(source.spec, num_hidden_layers=2, chs_num_layers=5, mask_token_id=0,
                                     block_size=8, anchor_group_size=2, sequential_rank=rank, draft_vocab_size=vocab)
        torch.manual_seed(0)
        return DLiteDraft(cfg).train()

    layers = draft_for(128, None).cfg.target_layer_ids
    targets = {"fp32": TargetAdapter(hf, source.spec, layers).eval(),
               "bf16": TargetAdapter(hf_bf16, source.spec, layers).eval()}
    hidden, logits = target_states(targets["fp32"], tokens)
    _, logits_bf16 = target_states(targets["bf16"], tokens)
    argmax_differs = float((logits.argmax(-1) != logits_bf16.argmax(-1)).float().mean())
    top = TargetTopK.of_logits(logits, 32)
    anchor_pos = torch.randint(32, seq_len - 1, (windows, anchors), generator=torch.Generator().manual_seed(0))
    ex = draft_examples(tokens, hidden, top, anchor_pos, 2, 7, exact_only=True)
    embed = targets["fp32"].embed_weight
    drafts = {name: draft_for(rank, vocab) for name, (rank, vocab, _) in CONFIGS.items()}
    optimizers = {name: torch.optim.AdamW(d.parameters(), lr=1e-4) for name, d in drafts.items()}

    def step(name: str) -> float:
        bf16 = CONFIGS[name][2]
        started = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = stage2_loss(drafts[name], ex, embed)["loss"]
        optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[name].step()
        return time.perf_counter() - started

    def target_pass(dtype: str) -> float:
        started = time.perf_counter()
        _, lg = target_states(targets[dtype], tokens)
        TargetTopK.of_logits(lg, 32)
        return time.perf_counter() - started

    for name in drafts:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in [*drafts, "target fp32", "target bf16"]}
    for r in range(rounds):
        for name in drafts:
            times[name].append(step(name))
        for dtype in ("fp32", "bf16"):
            times[f"target {dtype}"].append(target_pass(dtype))
        click.echo(f"round {r + 1}/{rounds}", err=True)
    blocks = windows * anchors
    report = {
        "batch": {"windows": windows, "seq_len": seq_len, "blocks": blocks, "threads": threads, "rounds": rounds},
        "draft_step_blocks_per_s": {name: round(blocks / statistics.median(times[name]), 1) for name in drafts},
        "target_tokens_per_s": {dtype: round(windows * seq_len / statistics.median(times[f"target {dtype}"]), 1)
                                for dtype in ("fp32", "bf16")},
        "bf16_target_argmax_differs": round(argmax_differs, 4),
        "cpu_flags": sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                             if f.startswith(("amx", "avx512_bf16"))}),
        "spread_seconds": {name: [round(min(t), 3), round(max(t), 3)] for name, t in times.items()},
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
