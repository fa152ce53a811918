"""Small real models for tests: Qwen3 targets built from configs and DLite drafts for them."""

from __future__ import annotations

import torch

from dlite_trt.config import DraftConfig, TargetSpec
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter
from dlite_trt.runtime.reference import SpeculativeGenerator
from dlite_trt.tiny_models import tiny_target_spec


def make_target(vocab_size: int = 64, *, seed: int = 0, num_hidden_layers: int = 4, hidden_size: int = 64,
                initializer_range: float = 0.02, attention_scale: float = 1.0, eos_token_id: int | None = None):
    """A transformers Qwen3ForCausalLM with seeded random weights, fp32, and its TargetSpec.

    ``attention_scale`` < 1 shrinks every o_proj: the target then depends mostly on the
    current token, so a ``bigram_draft`` of it is often but not always right (0.01 with
    initializer_range 0.1 gives a mix of full, partial and no acceptance).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = tiny_target_spec(vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                            head_dim=16, intermediate_size=2 * hidden_size, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(Qwen3Config(**spec.to_hf_config(), initializer_range=initializer_range)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
    return hf, spec


def near_bigram_target(vocab_size: int = 64, *, seed: int = 0, **kwargs):
    """A target a bigram_draft predicts well but not perfectly (see make_target)."""
    return make_target(vocab_size, seed=seed, initializer_range=0.1, attention_scale=0.01, **kwargs)


def draft_config(spec: TargetSpec, *, block_size: int = 8, anchor_group_size: int = 1,
                 sequential_rank: int | None = None, chs_num_layers: int = 3) -> DraftConfig:
    return DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=chs_num_layers, mask_token_id=1,
                                  block_size=block_size, anchor_group_size=anchor_group_size,
                                  sequential_rank=sequential_rank or max(32, spec.vocab_size))


def random_draft(cfg: DraftConfig, seed: int = 1) -> DLiteDraft:
    torch.manual_seed(seed)
    return DLiteDraft(cfg).eval()


@torch.no_grad()
def bigram_draft(hf_target, cfg: DraftConfig, seed: int = 1, sharpness: float = 20.0) -> DLiteDraft:
    """A real DLiteDraft whose head proposes the target's one-token greedy successor of each token.

    The sequential head is set so that s = tanh(sharpness * onehot(prev)) and logits pick
    successor(prev); the backbone keeps random weights (its output is ignored by this head).
    Its proposals agree with the target often but not always, so verification sees every case.
    """
    v, r = cfg.vocab_size, cfg.sequential_rank
    if r < v:
        raise ValueError("bigram_draft needs sequential_rank >= vocab_size")
    draft = random_draft(cfg, seed)
    successor = hf_target(torch.arange(v)[:, None]).logits[:, 0].argmax(-1)  # [V]
    head = draft.sequential_head
    eye = torch.eye(v, r)
    head.prev_token_embedding.weight.copy_(eye)
    head.state_proj.weight.zero_()
    head.state_proj.weight[r:, r:] = sharpness * torch.eye(r)
    head.state_proj.bias.zero_()
    head.state_proj.bias[:r] = -sharpness  # gate ~ 0: the state is the new candidate
    head.state_hidden_mlp.weight.zero_()
    head.state_hidden_mlp.weight[:, :r] = torch.eye(r)
    head.state_hidden_mlp.bias.zero_()
    out = torch.zeros(v, r)
    out[successor, torch.arange(v)] = 1.0
    head.output_proj.weight.copy_(out)
    return draft


def generator(hf_target, spec: TargetSpec, draft: DLiteDraft) -> SpeculativeGenerator:
    return SpeculativeGenerator(TargetAdapter(hf_target, spec, draft.cfg.target_layer_ids), draft)


@torch.no_grad()
def hf_greedy(hf_target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with transformers generate (the losslessness oracle)."""
    ids = torch.tensor([prompt])
    out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
