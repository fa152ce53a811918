"""The draft block against DESIGN 1.2, written out naively here. Tier: fp32 ~1e-5."""

from __future__ import annotations

import pytest
import torch
from helpers import draft_config, make_target, random_draft

from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.sequential_head import recurrence

ATOL = 2e-5


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    # x [h, L, D], pos [L]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_block(draft: DLiteDraft, chs, group, embed, uniform_free=True):
    """One sequence, DESIGN 1.2 step by step: chs [S, H], group [G'] -> (draft_hidden [K, H], tokens [K])."""
    cfg, sd = draft.cfg, draft.state_dict()
    eps, d, k_props = cfg.rms_norm_eps, cfg.head_dim, cfg.num_proposals
    gl = len(group)
    ctx = _rms(chs + sd["layer_depth_embedding.weight"][list(cfg.target_layer_ids)], sd["context_norm.weight"], eps)
    x = torch.cat([embed[group], embed[cfg.mask_token_id].repeat(k_props, 1)])  # [G'+K, H]
    q_pos = torch.arange(gl + k_props)
    k_pos = torch.cat([torch.full((len(ctx),), max(gl - 2, 0)), q_pos])
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(len(a), -1, d).transpose(0, 1)
        kv_in = torch.cat([ctx, a])
        k = (kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(len(kv_in), -1, d).transpose(0, 1)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(len(kv_in), -1, d).transpose(0, 1)
        q, k = _rms(q, sd[p + "self_attn.q_norm.weight"], eps), _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, q_pos, cfg.rope_theta), _rope(k, k_pos, cfg.rope_theta)
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = torch.softmax(q @ k.transpose(1, 2) * d ** -0.5, -1) @ v  # no mask: non-causal
        x = x + att.transpose(0, 1).reshape(len(x), -1) @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (m @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    hidden = _rms(x, sd["norm.weight"], eps)[-k_props:]
    # sequential head
    h = "sequential_head."
    r = cfg.sequential_rank

    def step(s, prev, hid):
        e = sd[h + "prev_token_embedding.weight"][prev]
        gc = torch.cat([s, e]) @ sd[h + "state_proj.weight"].T + sd[h + "state_proj.bias"]
        g = torch.sigmoid(gc[:r])
        s = g * s + (1 - g) * torch.tanh(gc[r:])
        z = torch.cat([s, hid]) @ sd[h + "state_hidden_mlp.weight"].T + sd[h + "state_hidden_mlp.bias"]
        return z, s

    s = torch.zeros(r)
    if cfg.anchor_group_size > 1:
        _, s = step(s, group[-2], torch.zeros(cfg.hidden_size))
    prev, tokens = group[-1], []
    for j in range(k_props):
        z, s = step(s, prev, hidden[j])
        prev = int((z @ sd[h + "output_proj.weight"].T).argmax())
        tokens.append(prev)
    return hidden, tokens


@pytest.mark.parametrize("g,block", [(1, 8), (2, 4), (3, 8)])
def test_draft_block_matches_the_design(g, block):
    hf, spec = make_target(80, seed=g)
    cfg = draft_config(spec, block_size=block, anchor_group_size=g, sequential_rank=24)
    torch.manual_seed(11)
    draft = random_draft(cfg)
    with torch.no_grad():  # sharper head logits, so argmax ties cannot hide a mistake
        draft.sequential_head.output_proj.weight.mul_(50)
    embed = hf.model.embed_tokens.weight.detach()
    chs = torch.randn(3, cfg.chs_num_layers, cfg.hidden_size)
    groups = torch.randint(0, 80, (3, g))
    with torch.no_grad():
        hidden = draft.backbone(chs, groups, torch.full((3,), g), embed)
        out = draft(chs, groups, torch.full((3,), g), embed)
        for b in range(3):
            want_hidden, want_tokens = naive_block(draft, chs[b], groups[b], embed)
            torch.testing.assert_close(hidden[b], want_hidden, atol=ATOL, rtol=0)
            assert out.tokens[b].tolist() == want_tokens


@pytest.mark.parametrize("drafts", [1, 3])
def test_the_head_over_the_first_positions_drafts_the_first_tokens(drafts):
    """The recurrence over draft_hidden's first D positions, written out for all K steps (as the
    exported node's body is), makes the design's first D tokens; its steps past D make nothing."""
    hf, spec = make_target(80, seed=3)
    cfg = draft_config(spec, block_size=8, anchor_group_size=2, sequential_rank=24)
    torch.manual_seed(5)
    draft = random_draft(cfg)
    with torch.no_grad():
        draft.sequential_head.output_proj.weight.mul_(50)
    embed = hf.model.embed_tokens.weight.detach()
    chs = torch.randn(3, cfg.chs_num_layers, cfg.hidden_size)
    groups = torch.randint(0, 80, (3, 2))
    with torch.no_grad():
        hidden = draft.backbone(chs, groups, torch.full((3,), 2), embed)
        out = recurrence(draft.sequential_head.weights(), hidden[:, :drafts], groups[:, -1], groups[:, -2],
                         steps=cfg.num_proposals)
    assert out.tokens.shape == (3, drafts) and out.logits.shape == (3, drafts, 80)
    for b in range(3):
        assert out.tokens[b].tolist() == naive_block(draft, chs[b], groups[b], embed)[1][:drafts]


def test_short_group_left_padded_equals_unpadded():
    """A sequence with G' < G (anchor near the start) is computed as if the group were G' long."""
    hf, spec = make_target(80, seed=5)
    cfg3 = draft_config(spec, anchor_group_size=3)
    draft3 = random_draft(cfg3)
    embed = hf.model.embed_tokens.weight.detach()
    chs = torch.randn(2, cfg3.chs_num_layers, cfg3.hidden_size)
    groups = torch.randint(2, 80, (2, 3))
    groups[1, 0] = 0  # padding slot of the short row
    with torch.no_grad():
        padded = draft3.backbone(chs, groups, torch.tensor([3, 2]), embed)
        for b, gl in ((0, 3), (1, 2)):
            want, _ = naive_block(draft3, chs[b], groups[b, 3 - gl:], embed)
            torch.testing.assert_close(padded[b], want, atol=ATOL, rtol=0)
        junk = groups.clone()
        junk[1, 0] = 77  # whatever sits in the padding slot must not matter
        torch.testing.assert_close(draft3.backbone(chs, junk, torch.tensor([3, 2]), embed), padded, atol=0, rtol=0)


def test_draft_rejects_wrong_shapes():
    hf, spec = make_target(80)
    cfg = draft_config(spec, anchor_group_size=2)
    draft = random_draft(cfg)
    embed = hf.model.embed_tokens.weight.detach()
    with pytest.raises(ValueError, match=r"chs must be \[B, 3, 64\]"):
        draft.backbone(torch.randn(1, 2, 64), torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), embed)
    with pytest.raises(ValueError, match="group_ids must be"):
        draft.backbone(torch.randn(1, 3, 64), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), embed)
