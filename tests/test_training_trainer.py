"""The training loop: resuming gives the uninterrupted run's weights exactly; 2-process gloo
DDP training keeps identical replicas."""

from __future__ import annotations

import copy

import torch
import torch.multiprocessing as mp
from helpers import draft_config, make_target, random_draft

from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.examples import draft_examples, target_states
from dlite_trt.training.stages import stage2_loss
from dlite_trt.training.trainer import TrainSettings, train


def _setup():
    hf, spec = make_target(64, seed=2)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2)
    target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    hidden, logits = target_states(target, tokens)
    embed = target.embed_weight.detach()

    def batch_fn(step: int, rank: int, world: int):
        g = torch.Generator().manual_seed(1000 + step)  # the batch is a function of the step
        anchors = torch.randint(1, 15, (4, 6), generator=g)
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)  # this rank's shard
        return draft_examples(tokens[rows], hidden[rows], logits[rows], anchors[rows], cfg.anchor_group_size,
                              cfg.num_proposals)

    def loss_fn(model, ex):
        return stage2_loss(model, ex, embed)

    return cfg, batch_fn, loss_fn


def test_resume_equals_uninterrupted(tmp_path):
    cfg, batch_fn, loss_fn = _setup()
    settings = TrainSettings(steps=6, lr=3e-3, warmup_steps=2)
    whole = random_draft(cfg, seed=9).train()
    train(whole, loss_fn, batch_fn, settings, tmp_path / "whole")
    first = random_draft(cfg, seed=9).train()
    assert train(first, loss_fn, batch_fn, TrainSettings(steps=3, lr=3e-3, warmup_steps=2), tmp_path / "split") == 3
    resumed = random_draft(cfg, seed=10).train()  # other init: the checkpoint must replace it
    assert train(resumed, loss_fn, batch_fn, settings, tmp_path / "split") == 3  # steps 3..5 only
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.norm.weight, random_draft(cfg, seed=9).norm.weight)  # it trained


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        cfg, batch_fn, loss_fn = _setup()
        model = random_draft(cfg, seed=9).train()
        train(model, loss_fn, batch_fn, TrainSettings(steps=2, lr=3e-3))
        torch.save(model.state_dict(), f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_process_gloo_ddp_keeps_replicas_identical(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    a = torch.load(tmp_path / "rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "rank1.pt", weights_only=True)
    cfg, _, _ = _setup()
    init = random_draft(cfg, seed=9).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # replicas agree after the steps
    assert any(not torch.equal(a[n], init[n]) for n in a)  # and they trained


def test_bf16_trains_as_fp32_does_on_bf16_products():
    """TrainSettings.bf16: the forward's products are bf16 (autocast), the weights stay fp32, and
    the run follows the fp32 run's losses within bf16's rounding."""
    cfg, batch_fn, loss_fn = _setup()
    runs = {}
    for bf16 in (False, True):
        model, dtypes, losses = random_draft(cfg, seed=9).train(), set(), []
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda module, inputs, output, dtypes=dtypes: dtypes.add(output.dtype))
        train(model, loss_fn, batch_fn, TrainSettings(steps=8, lr=3e-3, bf16=bf16),
              log=lambda step, terms, losses=losses: losses.append(terms["loss"]))
        runs[bf16] = model, dtypes, losses
    assert runs[False][1] == {torch.float32} and runs[True][1] == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in runs[True][0].parameters())
    fp32_losses, bf16_losses = runs[False][2], runs[True][2]
    assert bf16_losses[-1] < bf16_losses[0]  # it trains
    assert bf16_losses != fp32_losses  # on other arithmetic
    for a, b in zip(fp32_losses, bf16_losses, strict=True):
        assert abs(a - b) < 0.05 * a, (fp32_losses, bf16_losses)


def test_a_bf16_target_gives_fp32_states_near_the_fp32_ones():
    hf, spec = make_target(64, seed=2)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
    fp32 = target_states(TargetAdapter(hf, spec, cfg.target_layer_ids).eval(), tokens)
    bf16 = target_states(TargetAdapter(copy.deepcopy(hf).to(torch.bfloat16), spec, cfg.target_layer_ids).eval(),
                         tokens)
    assert all(t.dtype == torch.float32 for t in bf16)
    assert not torch.equal(bf16[1], fp32[1])
    torch.testing.assert_close(bf16[0], fp32[0], rtol=0.1, atol=0.1)
    assert (bf16[1].argmax(-1) == fp32[1].argmax(-1)).float().mean() > 0.9
