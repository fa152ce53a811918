"""Pretraining the small target: the LM loss goes down on a fixed corpus; batches are seeded."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dlite_trt.tiny_models import stdlib_files, tiny_target_spec
from dlite_trt.training.pretrain import WindowBatches, lm_loss, pretrain, token_stream
from dlite_trt.training.trainer import TrainSettings


def test_lm_loss_goes_down(tiny_pair):
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    stream = token_stream(stdlib_files("train")[:3], tok, tok.convert_tokens_to_ids("<|endoftext|>"))
    batches = WindowBatches(stream, seq_len=32, batch=4, seed=1)
    assert torch.equal(batches(5, 0, 1), batches(5, 0, 1)) and not torch.equal(batches(5, 0, 1), batches(6, 0, 1))
    assert torch.equal(torch.cat([batches(5, 0, 2), batches(5, 1, 2)]), batches(5, 0, 1))  # shards of one batch
    spec = tiny_target_spec(len(tok), hidden_size=64, num_hidden_layers=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**spec.to_hf_config()))
    fixed = batches(0, 0, 1)
    first = lm_loss(model, fixed)["loss"].item()
    pretrain(model, lambda step, rank, world: fixed, TrainSettings(steps=15, lr=1e-2))
    assert lm_loss(model, fixed)["loss"].item() < 0.7 * first
