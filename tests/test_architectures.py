"""Llama (with Llama 3.x RoPE scaling, untied and tied) and Qwen2 (with q/k/v biases) targets:
greedy speculative decoding through the reference generator and through an ONNX Runtime engine
equals transformers' own greedy output, token for token, fp32, at batch 1 and 3 with prompts
of different lengths. The graphs' parity with their eager reference is in test_engine_graphs.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ARCH_TARGETS, bigram_draft, draft_config, generator, hf_greedy, make_target, random_draft, \
    small_engine

from dlite_trt.runtime.session import SamplingParams

NEW = 24
VOCAB = 64
# batch 1, and batch 3 with prompts of different lengths; 41 + 24 positions cross the llama3
# target's original context (32) so its scaled and unscaled frequencies both matter
LENGTHS = {"batch1": (11,), "batch3": (3, 41, 17)}


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(len(lengths))
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(ARCH_TARGETS))
def case(request, tmp_path_factory):
    """A full-strength random target of the architecture and two drafts: a random one (almost
    never right) and a bigram one of a near-bigram target of the same architecture (often right)."""
    kind = ARCH_TARGETS[request.param]
    # initializer_range 0.1: attention sharp enough that positions (RoPE) change the greedy tokens
    hf, spec = make_target(VOCAB, seed=3, num_hidden_layers=4, initializer_range=0.1, **kind)
    near, near_spec = make_target(VOCAB, seed=4, initializer_range=0.1, attention_scale=0.01, **kind)
    cfg = draft_config(spec, block_size=4, anchor_group_size=2)
    near_draft = bigram_draft(near, cfg)
    engine = small_engine(tmp_path_factory.mktemp(request.param), hf, random_draft(cfg), max_seq_len=96)
    return {"hf": hf, "spec": spec, "cfg": cfg, "near": near, "near_spec": near_spec, "near_draft": near_draft,
            "engine": engine}


def test_the_targets_are_what_they_claim(case):
    """The quirk each case is for is really on (the test would prove nothing otherwise)."""
    hf, spec = case["hf"], case["spec"]
    assert type(hf).__name__ == spec.arch.hf_class
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied == spec.tie_word_embeddings
    if spec.rope_scaling is not None:
        inv_freq = hf.model.rotary_emb.inv_freq
        plain = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2).float() / spec.head_dim)
        assert not torch.equal(inv_freq, plain)
    if spec.architecture == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().max() > 0.05


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_reference_greedy_equals_transformers(case, lengths):
    prompts = _prompts(lengths)
    for hf, spec, draft in ((case["hf"], case["spec"], random_draft(case["cfg"])),
                            (case["near"], case["near_spec"], case["near_draft"])):
        result = generator(hf, spec, draft).generate(prompts, SamplingParams(max_new_tokens=NEW))
        assert result.output_ids == [hf_greedy(hf, p, NEW) for p in prompts]


def test_the_bigram_draft_is_accepted_on_the_near_bigram_target(case):
    """So the reference runs above verified multi-token acceptances, not only rejections."""
    prompts = _prompts(LENGTHS["batch3"])
    result = generator(case["near"], case["near_spec"], case["near_draft"]).generate(
        prompts, SamplingParams(max_new_tokens=NEW))
    accepted = [n for s in result.steps for n in s.accepted if n is not None]
    assert max(accepted) >= 2


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_engine_greedy_equals_transformers(case, lengths):
    prompts = _prompts(lengths)  # 17 and 41 tokens prefill in several chunks of 8
    result = case["engine"].generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert result.output_ids == [hf_greedy(case["hf"], p, NEW) for p in prompts]


def test_engine_records_the_architecture(case):
    """The manifest's target config round-trips the architecture and its RoPE type."""
    manifest = case["engine"].manifest
    assert manifest.target_spec == case["spec"]
    assert manifest.to_dict()["target"]["config"]["architectures"] == [case["spec"].arch.hf_class]
