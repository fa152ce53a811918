"""Small real models for tests: targets (Qwen3, Llama, Qwen2) built from configs and DLite drafts for them."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlite_trt.config import DraftConfig, RopeScaling, TargetSpec
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter
from dlite_trt.runtime.reference import SpeculativeGenerator
from dlite_trt.tiny_models import random_target, tiny_target_spec


# Targets of each non-Qwen3 architecture, with what sets it apart switched on: Llama 3.x RoPE
# scaling (an original context of 32 positions, so prompts and generations cross it) and an untied
# head; a tied-embedding Llama; Qwen2's q/k/v biases (drawn, transformers initialises them to 0).
SERVE_MAX_BATCH, SERVE_MAX_SEQ_LEN = 4, 1024  # conftest.serve_engine: the OpenAI server tests' engine

ARCH_TARGETS = {
    "llama3-rope": dict(architecture="llama", rope_scaling=RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)),
    "llama-tied": dict(architecture="llama", tie_word_embeddings=True),
    "qwen2-bias": dict(architecture="qwen2", bias_std=0.2),
}


def make_target(vocab_size: int = 64, *, seed: int = 0, num_hidden_layers: int = 4, hidden_size: int = 64,
                initializer_range: float = 0.02, attention_scale: float = 1.0, eos_token_id: int | None = None,
                bias_std: float = 0.0, **spec):
    """A transformers target (Qwen3ForCausalLM unless ``spec`` names another architecture, see
    ARCH_TARGETS) with seeded random weights, fp32, and its TargetSpec.

    ``attention_scale`` < 1 shrinks every o_proj: the target then depends mostly on the
    current token, so a ``bigram_draft`` of it is often but not always right (0.01 with
    initializer_range 0.1 gives a mix of full, partial and no acceptance).
    """
    spec = tiny_target_spec(vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                            head_dim=16, intermediate_size=2 * hidden_size, eos_token_id=eos_token_id, **spec)
    hf = random_target(spec, seed=seed, initializer_range=initializer_range, bias_std=bias_std)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
    return hf, spec


def near_bigram_target(vocab_size: int = 64, *, seed: int = 0, **kwargs):
    """A target a bigram_draft predicts well but not perfectly (see make_target)."""
    return make_target(vocab_size, seed=seed, initializer_range=0.1, attention_scale=0.01, **kwargs)


def draft_config(spec: TargetSpec, *, block_size: int = 8, anchor_group_size: int = 1,
                 sequential_rank: int | None = None, chs_num_layers: int = 3,
                 draft_vocab_size: int | None = None) -> DraftConfig:
    return DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=chs_num_layers, mask_token_id=1,
                                  block_size=block_size, anchor_group_size=anchor_group_size,
                                  sequential_rank=sequential_rank or max(32, spec.vocab_size),
                                  draft_vocab_size=draft_vocab_size)


def reduced_vocab(vocab_size: int, size: int, *, mask_token_id: int = 1, seed: int = 0,
                  include: tuple[int, ...] = (), exclude: tuple[int, ...] = ()) -> torch.Tensor:
    """A draft vocabulary: ``size`` distinct target ids in seeded random order, the mask token and
    ``include`` among them, none of ``exclude``: [size] int64."""
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()
    first = list(dict.fromkeys([mask_token_id, *include]))
    ids = first + [i for i in order if i not in first and i not in exclude][: size - len(first)]
    shuffle = torch.randperm(size, generator=torch.Generator().manual_seed(seed + 1))
    return torch.tensor(ids)[shuffle]


class OutsideVocabCase(NamedTuple):
    hf: Any  # a transformers target
    spec: TargetSpec
    prompts: list[list[int]]
    want: list[list[int]]  # the target's greedy continuations (transformers generate)
    missing: int  # a token of those continuations that the draft vocabulary lacks
    draft_vocab: torch.Tensor  # [V_d]


def outside_vocab_case(vocab_size: int, draft_vocab_size: int, lengths: tuple[int, ...], new_tokens: int, *,
                       seed: int = 2) -> OutsideVocabCase:
    """A near-bigram target, prompts and their greedy continuations, and a draft vocabulary that holds every
    token of the continuations but the rarest one: the output has a token the draft cannot name, and a
    bigram draft of the target still gets multi-token acceptances elsewhere."""
    hf, spec = near_bigram_target(vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    used = Counter(t for out in want for t in out)
    used.pop(1, None)  # helpers.draft_config's mask token: always in the draft vocabulary
    missing = min(used, key=lambda t: (used[t], t))
    ids = reduced_vocab(vocab_size, draft_vocab_size, seed=seed, include=tuple(sorted(set(used) - {missing})),
                        exclude=(missing,))
    return OutsideVocabCase(hf, spec, prompts, want, missing, ids)


def random_draft(cfg: DraftConfig, seed: int = 1, draft_vocab: torch.Tensor | None = None) -> DLiteDraft:
    """A draft with seeded random weights; with ``draft_vocab`` (cfg.draft_vocab_size ids) as its draft vocabulary."""
    torch.manual_seed(seed)
    draft = DLiteDraft(cfg).eval()
    if draft_vocab is not None:
        draft.sequential_head.set_draft_vocab(draft_vocab)
    return draft


@torch.no_grad()
def bigram_draft(hf_target, cfg: DraftConfig, seed: int = 1, sharpness: float = 20.0,
                 draft_vocab: torch.Tensor | None = None) -> DLiteDraft:
    """A real DLiteDraft whose head proposes the target's one-token greedy successor of each token.

    The sequential head is set so that s = tanh(sharpness * onehot(prev)) and logits pick
    successor(prev); the backbone keeps random weights (its output is ignored by this head).
    Its proposals agree with the target often but not always, so verification sees every case.
    With ``draft_vocab`` the head works in its rows: a successor outside it is proposed as the mask token
    (the convention for tokens the draft cannot name), so every choice is clear-cut (no near-ties).
    """
    v, r = cfg.head_vocab_size, cfg.sequential_rank
    if r < v:
        raise ValueError("bigram_draft needs sequential_rank >= the head's vocabulary rows")
    draft = random_draft(cfg, seed, draft_vocab)
    head = draft.sequential_head
    ids = torch.arange(v) if head.draft_vocab is None else head.draft_vocab  # [V_d] target id of each row
    successor = hf_target(ids[:, None]).logits[:, 0].argmax(-1)  # [V_d] target ids
    row = head.to_draft(successor)  # [V_d] their rows
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
    out[row, torch.arange(v)] = 1.0
    head.output_proj.weight.copy_(out)
    return draft


def generator(hf_target, spec: TargetSpec, draft: DLiteDraft) -> SpeculativeGenerator:
    return SpeculativeGenerator(TargetAdapter(hf_target, spec, draft.cfg.target_layer_ids), draft)


def small_engine(tmp: Path, hf_target, draft: DLiteDraft, draft_weights: str = "float", **limits):
    """Save a transformers target and a draft under ``tmp``, build an ONNX Runtime engine, open it.
    The draft float by default, so that its proposals are the reference generator's step for step (the
    build's default, its matrices Q8_0, proposes from rounded weights: tests/test_int4.py)."""
    from dlite_trt.checkpoint import save_draft
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.runtime.engine import open_engine

    hf_target.save_pretrained(tmp / "target")
    save_draft(draft, tmp / "draft")
    limits = {"max_batch": 4, "max_seq_len": 128, "max_chunk": 8} | limits
    build_engine(tmp / "target", tmp / "draft", tmp / "engine",
                 BuildSettings(limits=EngineLimits(**limits), draft_weights=draft_weights), progress=False)
    return open_engine(tmp / "engine")


@torch.no_grad()
def hf_greedy(hf_target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with transformers generate (the losslessness oracle).

    ``hf_target`` is a transformers model or a model directory.
    """
    if isinstance(hf_target, (str, Path)):
        from transformers import AutoModelForCausalLM

        hf_target = AutoModelForCausalLM.from_pretrained(hf_target).eval()
    ids = torch.tensor([prompt])
    out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class OracleProposals:
    """Controlled proposals for testing the generator's bookkeeping at full target strength.

    Installed on a Session, it lets the real draft run on the real pivot inputs (and records
    them, with the context each was computed from), then replaces the proposed tokens with the
    target's own greedy continuation, corrupted at seeded random positions. Acceptance then
    covers 0..K for a target whose attention matters fully, so stale or misplaced KV entries,
    wrong positions or a wrong pivot change the output.
    """

    def __init__(self, session, corrupt: float = 0.2, seed: int = 0) -> None:
        self.session = session
        self.corrupt = corrupt
        self.rng = torch.Generator().manual_seed(seed)
        self.expected: list[list[int]] = []  # per row: context + the target's greedy continuation
        self.records: list[tuple] = []  # (chs, group_ids, group_len, contexts, active) per draft call
        real_draft = session._draft
        draft_module = session.gen.draft
        vocab = draft_module.cfg.vocab_size

        def propose(chs, temperature, u):
            seen = []
            hook = draft_module.register_forward_pre_hook(lambda m, args: seen.append(args))
            try:
                out = real_draft(chs, temperature, u)
            finally:
                hook.remove()
            _, group, group_len = seen[0][:3]
            self.records.append((chs.clone(), group.clone(), group_len.clone(),
                                 [list(t) for t in session.tokens], list(session._active)))
            tokens = out.tokens.clone()
            k = tokens.shape[1]
            for row, ctx in enumerate(session.tokens):
                want = self.expected[row][len(ctx): len(ctx) + k]
                want = want + [0] * (k - len(want))
                flip = torch.rand(k, generator=self.rng) < self.corrupt
                flips = flip.tolist()
                tokens[row] = torch.tensor([(t + 1) % vocab if f else t for t, f in zip(want, flips, strict=True)])
            return type(out)(tokens, out.logits)

        session._draft = propose

    def expect(self, hf_target, max_new_tokens: int) -> None:
        """Precompute each row's greedy continuation of its current context (before a generate)."""
        k = self.session.gen.draft.cfg.num_proposals
        self.expected = [ctx + hf_greedy(hf_target, ctx, max_new_tokens + k) for ctx in self.session.tokens]

    @torch.no_grad()
    def check_pivots(self, hf_target, atol: float = 1e-4) -> int:
        """Every active row's draft inputs: chs = the target's selected layers at anchor_pos - 1,
        group = the last G tokens ending with the anchor. Returns how many were checked."""
        cfg = self.session.gen.draft.cfg
        g = cfg.anchor_group_size
        checked = 0
        for chs, group, group_len, contexts, active in self.records:
            for row, ctx in enumerate(contexts):
                if not active[row]:
                    continue
                states = hf_target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
                want = torch.stack([states[k + 1][0, -1] for k in cfg.target_layer_ids])  # [S, H]
                torch.testing.assert_close(chs[row], want, atol=atol, rtol=0)
                tail = ctx[-g:]
                assert int(group_len[row]) == len(tail) and group[row, g - len(tail):].tolist() == tail
                checked += 1
        return checked


def stop_inside_a_step(kept: list[int], output: list[int], *, min_drafts: int = 2) -> tuple[int, int]:
    """Where a stop token lands inside a speculative step: (step index, output position) of the
    first token of a step that kept at least ``min_drafts`` drafts and its bonus token, the token
    not seen earlier in the output. A stop there drops >= min_drafts tokens the step produced.

    ``kept`` holds the tokens each step added (the prefill's first token excluded), as a greedy
    run without stops gives them (``GenerationResult.acceptance_lengths``).
    """
    start = 1  # output[0] came from the prefill
    for step, k in enumerate(kept):
        if k >= min_drafts + 1 and output[start] not in output[:start]:
            return step, start
        start += k
    raise AssertionError(f"no step keeps {min_drafts} drafts and a new token: {kept}")


def stop_string_inside_a_step(decode, kept: list[int], output: list[int], *,
                              min_drafts: int = 2) -> tuple[int, int, str]:
    """Like ``stop_inside_a_step`` for a stop string: (step index, output position, string) where
    the string is the text of the first token of such a step and first completes with that token."""
    start = 1
    for step, k in enumerate(kept):
        before, upto = decode(output[:start]), decode(output[: start + 1])
        piece = upto[len(before):]
        if k >= min_drafts + 1 and upto.startswith(before) and piece.strip() and piece not in before:
            return step, start, piece
        start += k
    raise AssertionError(f"no step keeps {min_drafts} drafts and starts with new text: {kept}")


def cut_at_stop_string(decode, ids: list[int], stop: str) -> tuple[list[int], str]:
    """What a stop string leaves of a greedy output: the fewest tokens whose text contains it, and
    the text before its first occurrence."""
    text = decode(ids)
    k = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
    return ids[:k], text[: text.index(stop)]


# ---------------------------------------------------------------------------------------------
# draft checkpoints: editing a saved one, comparing, errors


def edit_config(ckpt: Path, edit) -> None:
    """Apply ``edit`` to the parsed config.json of the checkpoint directory ``ckpt`` and write it back."""
    path = ckpt / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw, indent=2))


def rewrite_weights(ckpt: Path, edit) -> None:
    """Apply ``edit`` to the state dict of a single-file checkpoint and write it back."""
    from dlite_trt.checkpoint import WEIGHTS_NAME

    path = ckpt / WEIGHTS_NAME
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().flatten().view(torch.uint8)


def assert_bit_exact(loaded: torch.nn.Module, original: torch.nn.Module) -> None:
    want, got = original.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
        assert torch.equal(bits(got[name]), bits(tensor)), name
    assert loaded.cfg == original.cfg


@contextmanager
def raises_with(exc_type, *fragments):
    """pytest.raises(exc_type), and every fragment must be in the message."""
    with pytest.raises(exc_type) as info:
        yield info
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
