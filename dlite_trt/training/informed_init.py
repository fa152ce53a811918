"""A target-informed initialisation of a dlite_v1 draft (the format is unchanged).

dlite_v1's default initialisation is random; a draft for a real target starts better from what
the target already knows (measured on SmolLM2-135M, docs/training.md "Levers, measured"):
- ``center``: ``layer_depth_embedding`` of each selected layer set to minus that layer's mean
  state, so the context slots are centred before ``context_norm``. A target with massive
  activations (SmolLM2: three dimensions hold 51-62% of a middle layer's energy) otherwise
  hands the draft states that are mostly one constant direction;
- ``head``: the head's output side a rank-r factorisation of the target's LM head, whitened by
  the target's final states (the rank-r map closest to the LM head on the states it sees), and
  the hidden side of ``state_hidden_mlp`` its other factor, so a draft_hidden equal to the
  target's final state is read as the target would read it (through rank r);
- ``prev_embedding``: the head's token embedding the top-r principal directions of the LM head's
  rows (a token's embedding, tied in SmolLM2), scaled to unit spread;
- ``norm``: the draft's final norm the target's;
- ``layers``: the draft layers copied from the target's last ones (measured: no gain).

``states`` [N, S, H] are the target's hidden states of the draft's S selected layers at N
positions (``sample_states``: from a state cache); the last selected layer is N-1, the target's
final normed state, which its LM head reads.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from torch import nn

from dlite_trt.errors import ConfigError
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.corpus import CorpusMix
from dlite_trt.training.examples import target_states
from dlite_trt.training.state_cache import StateCache

PARTS = ("center", "head", "prev_embedding", "norm", "layers")
DEFAULT_PARTS = ("center", "head", "prev_embedding", "norm")
SINK = 4  # positions skipped at a sequence's start (the attention sink's states are outliers)


def sample_states(cache: StateCache, rows: int, seed: int = 0) -> torch.Tensor:
    """[N, S, H] float32 cached states of ``rows`` random sequences, positions past the sink."""
    picked = np.random.default_rng(seed).choice(len(cache.sequences), min(rows, len(cache.sequences)), replace=False)
    parts = [cache.window(int(r), SINK, len(cache.sequences[r].tokens) - SINK)["hidden"].float() for r in picked
             if len(cache.sequences[r].tokens) > SINK + 1]
    if not parts:
        raise ConfigError(f"the state cache has no sequence longer than {SINK + 1} tokens to initialise from")
    return torch.cat(parts)


@torch.no_grad()
def sample_corpus_states(target: TargetAdapter, corpus: CorpusMix, windows: int, length: int,
                         seed: int = 0) -> torch.Tensor:
    """[N, S, H] the target's states of the draft's layers over ``windows`` seeded corpus windows
    of ``length`` tokens, positions past the sink; on the CPU, wherever the target runs."""
    tokens = corpus.windows(windows, length, torch.Generator().manual_seed(seed)).to(target.embed_weight.device)
    hidden = torch.cat([target_states(target, row[None])[0].cpu() for row in tokens])  # [W, L, S, H]
    return hidden[:, SINK:].flatten(0, 1)


def whitened_factors(lm_head: torch.Tensor, final_states: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [V, r], B [r, H]) with A @ B the rank-r W minimising E||(W - A B) h||^2 over the states h."""
    h = final_states.double()
    eigval, eigvec = torch.linalg.eigh(h.T @ h / len(h))
    eigval = eigval.clamp_min(1e-6 * eigval.max())
    root, inv_root = (eigvec * eigval.sqrt()) @ eigvec.T, (eigvec / eigval.sqrt()) @ eigvec.T
    u, s, vh = torch.linalg.svd(lm_head.double() @ root, full_matrices=False)
    half = s[:rank].sqrt()
    return (u[:, :rank] * half).float(), (half[:, None] * vh[:rank] @ inv_root).float()


@torch.no_grad()
def informed_init(draft: DLiteDraft, lm_head: torch.Tensor, final_norm: torch.Tensor,
                  target_layers: nn.ModuleList | None, states: torch.Tensor,
                  parts: Collection[str] = DEFAULT_PARTS) -> None:
    """Overwrite ``parts`` of ``draft``'s weights from the target (its LM head [V, H], final norm
    weight [H], decoder layers for ``layers``) and its cached ``states`` [N, S, H]."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ConfigError(f"unknown informed-initialisation parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    cfg, sd = draft.cfg, draft.state_dict()
    if states.ndim != 3 or tuple(states.shape[1:]) != (cfg.chs_num_layers, cfg.hidden_size):
        raise ConfigError(f"states must be [N, {cfg.chs_num_layers}, {cfg.hidden_size}] (the draft's selected "
                          f"layers), got {tuple(states.shape)}")
    rank, lm_head = cfg.sequential_rank, lm_head.detach().float()
    if draft.sequential_head.draft_vocab is not None:  # the head's rows: the draft vocabulary's tokens
        lm_head = lm_head[draft.sequential_head.draft_vocab]
    if {"head", "prev_embedding"} & set(parts) and rank > min(cfg.hidden_size, cfg.head_vocab_size):
        raise ConfigError(f"the head's rank r = {rank} exceeds the target's hidden size {cfg.hidden_size} (or "
                          "vocabulary): the LM head has no more directions to initialise it from; leave out the "
                          "'head' and 'prev_embedding' parts, or use r <= H")
    if "center" in parts:
        for slot, layer in enumerate(cfg.target_layer_ids):
            sd["layer_depth_embedding.weight"][layer] = -states[:, slot].mean(0)
    if "head" in parts:  # the last slot is the target's final (normed) state
        out_side, in_side = whitened_factors(lm_head, states[:, -1], rank)
        sd["sequential_head.output_proj.weight"] = out_side
        mlp = torch.zeros(rank, rank + cfg.hidden_size)
        mlp[:, rank:] = in_side  # the recurrent state's columns start at zero
        sd["sequential_head.state_hidden_mlp.weight"] = mlp
        sd["sequential_head.state_hidden_mlp.bias"] = torch.zeros(rank)
    if "prev_embedding" in parts:
        centred = lm_head - lm_head.mean(0)
        projected = centred @ torch.linalg.svd(centred, full_matrices=False)[2][:rank].T
        sd["sequential_head.prev_token_embedding.weight"] = projected / projected.std()
    if "norm" in parts:
        sd["norm.weight"] = final_norm.detach().float().clone()
    if "layers" in parts:
        if target_layers is None:
            raise ConfigError("the 'layers' part needs the target's decoder layers")
        for i, layer in enumerate(target_layers[-cfg.num_hidden_layers:]):
            theirs = layer.state_dict()
            mine = [key for key in sd if key.startswith(f"layers.{i}.")]
            for key in mine:
                name = key.removeprefix(f"layers.{i}.")
                if name not in theirs or theirs[name].shape != sd[key].shape:
                    raise ConfigError(f"cannot copy the target's layer into draft layer {i}: {name} "
                                      f"{'is missing' if name not in theirs else 'has another shape'} there")
                sd[key] = theirs[name].detach().float().clone()
    draft.load_state_dict(sd, strict=True)
