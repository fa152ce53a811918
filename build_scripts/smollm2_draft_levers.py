#!/usr/bin/env python
"""Levers on the SmolLM2 draft's acceptance length, each measured against the same control.

Reads the state cache and the initial draft that `train_smollm2_draft.py` left in --work (run
that first, at least `--until data`). Every training experiment is a single-stage student
(stage 2: CE + TV against the target) trained for --steps on the same seeded batches; every
figure is the teacher-forced acceptance length on the same held-out standard-library files
(the first --files, each continued from its first 256 tokens by 128 tokens of target-only
greedy decoding, cached in --out), per block position and by the target's confidence
(`train_smollm2_draft.agreement`).

Experiments (names on the command line; default: all, each skipped when its result exists):
- random:        the control, dlite_v1's default initialisation;
- informed:      a target-informed initialisation (training/informed_init.py): the context slots centred
                 (layer_depth_embedding = minus each layer's mean state, which removes SmolLM2's
                 massive activations before context_norm), the head's output side a whitened
                 rank-r factorisation of the target's LM head, its token embedding the top-r
                 principal directions of the target's, the final norm the target's;
- informed-layers: the same plus the draft layers copied from the target's last layers;
- informed-seed1: informed on other batches (batch seed 1): the noise of one comparison;
- informed-lr3e-3: the same as informed at 3x the learning rate;
- informed-answer-anchors: informed, only blocks whose proposals are the target's own answer
                 (what decoding drafts) instead of blocks anywhere in the window;
- answer-ce1:    informed + answer anchors with the CE term's weight 1 instead of 0.1 (TV's
                 gradient shrinks with the draft's probability of the right token; CE's does not);
- answer-state1: informed + answer anchors plus the draft_hidden regression on the target's own
                 final state (``state_regression``, weight 1);
- answer-ce1-state1: both;
- data-25, data-50: informed on the first 25% / 50% of the cached sequences (the data-volume
                 curve; informed is 100%);
- head-only:     no training: the bundled draft with its backbone's output zeroed (what its head
                 does without the pivot's states);
- head-rank:     no training: the agreement of a linear rank-r readout of the target's own final
                 state with the target's greedy token (the best case of a rank-r head);
- memorisation:  no training: the snapshots of the informed-answer-anchors run in --out, measured
                 the same way on 16 training answers of the file and of the chat kind (answers the
                 draft was trained on) beside the held-out files' figure: the generalisation gap.

    python build_scripts/smollm2_draft_levers.py --work /work/runs/smollm2 --out /work/runs/levers
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_smollm2_draft import (  # noqa: E402  (the same target, prompts and measurement)
    BUDGETS,
    Target,
    agreement,
    training_answers,
    training_prompts,
)

from dlite_trt.training.informed_init import DEFAULT_PARTS, informed_init, sample_states, whitened_factors  # noqa: E402
from dlite_trt.training.losses import LossWeights  # noqa: E402

INFORMED = DEFAULT_PARTS


class Lever(NamedTuple):
    parts: tuple[str, ...] = INFORMED  # the initialisation's informed parts (() : dlite_v1's default)
    lr: float = 1e-3
    share: float = 1.0  # of the cached sequences, the first
    region: str = "window"  # where blocks are anchored
    seed: int = 0  # batch seed
    weights: LossWeights = LossWeights()


TRAINED = {
    "random": Lever(parts=()),
    "informed": Lever(),
    "informed-seed1": Lever(seed=1),
    "informed-layers": Lever(parts=(*INFORMED, "layers")),
    "informed-lr3e-3": Lever(lr=3e-3),
    "informed-answer-anchors": Lever(region="answer"),
    "data-25": Lever(share=0.25),
    "data-50": Lever(share=0.5),
    "answer-ce1": Lever(region="answer", weights=LossWeights(ce=1.0)),
    "answer-state1": Lever(region="answer", weights=LossWeights(state=1.0)),
    "answer-ce1-state1": Lever(region="answer", weights=LossWeights(ce=1.0, state=1.0)),
}
MEASURED = ("head-only", "head-rank", "memorisation")
MEMORISED = "informed-answer-anchors"  # the run whose snapshots memorisation measures


@click.command()
@click.argument("names", nargs=-1, type=click.Choice([*TRAINED, *MEASURED]))
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=Path("build/smollm2-draft-runs"),
              show_default=True, help="train_smollm2_draft.py's --work (its data cache and init draft).")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("build/smollm2-draft-levers"),
              show_default=True, help="Results (NAME.json) and each run's resumable state.")
@click.option("--steps", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--snapshots", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also measure this many evenly spaced snapshots of each trained run (a training-steps curve).")
@click.option("--files", default=12, show_default=True, type=click.IntRange(min=1), help="Held-out files measured.")
@click.option("--draft", "bundled", type=click.Path(path_type=Path, file_okay=False),
              default=Path("dlite_trt/bundled/smollm2"), show_default=True, help="The draft head-only measures.")
def main(names: tuple[str, ...], work: Path, out: Path, steps: int, snapshots: int, files: int,
         bundled: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from dlite_trt.checkpoint import load_draft
    from dlite_trt.model.target import TargetAdapter
    from dlite_trt.runtime.reference import SpeculativeGenerator
    from dlite_trt.runtime.session import SamplingParams
    from dlite_trt.tiny_models import stdlib_files
    from dlite_trt.training.pipeline import BatchSettings, StudentPlan, train_student
    from dlite_trt.training.state_cache import StateCache

    target = Target()
    init_dir = work / "init"
    cfg = load_draft(init_dir, target=target.spec).cfg
    adapter = TargetAdapter(target.hf, target.spec, cfg.target_layer_ids).eval()
    cache = StateCache(work / "data", cfg.target_layer_ids, target.spec.vocab_size)
    out.mkdir(parents=True, exist_ok=True)

    if snapshots > steps:
        raise click.UsageError(f"--snapshots {snapshots} is more than --steps {steps}")
    held = out / "held_out.json"
    if held.is_file() and len(json.loads(held.read_text())["prompts"]) != min(files, len(stdlib_files("held_out"))):
        raise click.UsageError(f"{held} holds another number of held-out files than --files {files}; use another "
                               "--out")
    if not held.is_file():
        tok = target.tokenizer
        prompts = [tok.encode(p.read_text(errors="replace"), add_special_tokens=False)[:256]
                   for p in stdlib_files("held_out")[:files]]
        outputs = SpeculativeGenerator.target_only(adapter).session(prompts).generate_target_only(
            SamplingParams(max_new_tokens=128, stop_token_ids=target.stops)).output_ids
        held.write_text(json.dumps({"prompts": prompts, "outputs": [list(o) for o in outputs]}))
    held_out = json.loads(held.read_text())

    def evaluate(draft) -> dict:
        got = agreement(target, draft.float().eval(), held_out["prompts"], held_out["outputs"])
        return {"teacher_forced_acceptance_length": got["teacher_forced_acceptance_length"],
                "per_position_agreement": got["per_position_agreement"],
                "by_target_confidence": got["by_target_confidence"]}

    results = {}
    for name in names or (*TRAINED, *MEASURED):
        path = out / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
            if name in TRAINED and results[name]["steps"] != steps:
                raise click.UsageError(f"{path} was trained for {results[name]['steps']} steps, not --steps {steps}; "
                                       "use another --out")
            continue
        started = time.perf_counter()
        if name == "head-only":
            draft = load_draft(bundled, target=target.spec).float()
            backbone = draft.backbone
            draft.backbone = lambda *a, **k: torch.zeros_like(backbone(*a, **k))
            result = {"draft": str(bundled), "trained": evaluate(draft)}
        elif name == "memorisation":
            first, more = training_prompts(target.tokenizer, BUDGETS["full"], 0)
            draft = load_draft(init_dir, target=target.spec).float()
            result = {"run": MEMORISED}
            snaps = list((out / f"{MEMORISED}-runs" / "stage2-run").glob("snapshot-*.safetensors"))
            if not snaps:
                raise click.UsageError(f"no snapshots of {MEMORISED} in {out}: train it first with --snapshots N")
            for snap in sorted(snaps, key=lambda p: int(p.stem[9:])):
                draft.load_state_dict(load_file(str(snap)), strict=True)
                step = snap.stem[9:]
                result[f"held_out_{step}"] = evaluate(draft)["teacher_forced_acceptance_length"]
                for kind in ("file", "chat"):
                    seen_prompts, seen_answers = training_answers(cache, first + more, kind, 64, 16)
                    if not seen_prompts:
                        raise click.UsageError(f"{work}'s cache has no {kind} answers of the full budget's prompts")
                    got = agreement(target, draft.eval(), seen_prompts, seen_answers)
                    result[f"{kind}_{step}"] = {"sequences": len(seen_prompts),
                                                "tf_al": got["teacher_forced_acceptance_length"],
                                                "per_position": got["per_position_agreement"]}
        elif name == "head-rank":
            states = sample_states(cache, 160)
            train, test = states[: len(states) * 3 // 4], states[len(states) * 3 // 4:]
            lm_head = target.hf.lm_head.weight.detach().float()
            greedy = (test[:, -1] @ lm_head.T).argmax(-1)
            result = {"positions": len(test)}
            for rank in (128, 192, 256):
                a, b = whitened_factors(lm_head, train[:, -1], rank)
                result[f"rank_{rank}_top1_agreement"] = round(float(((test[:, -1] @ b.T @ a.T).argmax(-1) == greedy)
                                                                    .float().mean()), 3)
        else:
            parts, lr, share, region, seed, weights = TRAINED[name]
            draft = load_draft(init_dir, target=target.spec).float()
            if parts:
                informed_init(draft, target.hf.lm_head.weight, target.hf.model.norm.weight, target.hf.model.layers,
                              sample_states(cache, 200), parts)
            at_init = evaluate(draft)
            everything = cache.sequences
            cache.sequences = everything[: max(1, int(len(everything) * share))]  # the first share: prompts are shuffled
            try:
                every = steps // snapshots if snapshots else 0
                train_student(adapter, cache, draft, out / name, StudentPlan(0, steps, lr=lr, snapshot_every=every),
                              BatchSettings(seq_len=256, batch_seqs=8, anchors=16, seed=seed, anchor_region=region),
                              weights=weights, runs=out / f"{name}-runs",
                              progress=False)
            finally:
                cache.sequences = everything
            result = {"parts": list(parts), "lr": lr, "data_share": share, "anchor_region": region, "batch_seed": seed,
                      "loss_weights": asdict(weights), "steps": steps, "init": at_init,
                      "trained": evaluate(load_draft(out / name, target=target.spec))}
            curve = {}
            for snap in sorted((out / f"{name}-runs" / "stage2-run").glob("snapshot-*.safetensors"),
                               key=lambda p: int(p.stem[9:])):
                draft.load_state_dict(load_file(str(snap)), strict=True)
                curve[snap.stem[9:]] = evaluate(draft)["teacher_forced_acceptance_length"]
            if curve:
                result["steps_curve"] = curve
        result["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")
        results[name] = result
    for name, result in results.items():
        figure = result.get("trained", {}).get("teacher_forced_acceptance_length", "")
        click.echo(f"{name:18s} {figure!s:>6s}  " + json.dumps({k: v for k, v in result.items()
                                                                if k not in ("init", "trained")}))


if __name__ == "__main__":
    main()
