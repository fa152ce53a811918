"""The engine graphs as PyTorch modules built from the reference model (DESIGN 2).

Each module's forward takes its graph's inputs in contract order (``export/contract.py``) and
returns its outputs in contract order, so the same module runs eagerly (parity tests) and
traces into ONNX. Everything a step needs happens inside: verify, accept, gather the pivot,
draft the next block; the host only binds inputs and stores the accepted KV entries.
"""

from __future__ import annotations

import torch
from torch import nn

from dlite_trt.export.contract import PAD_TOKEN, SAMPLING_SUFFIX, GraphSpec, present_output
from dlite_trt.export.recurrence import low_rank_recurrence
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.target import TargetAdapter, TargetOutput
from dlite_trt.runtime.sampling import greedy_accept, rejection_accept, row_temperature, sample_from_logits


class _EngineGraph(nn.Module):
    """Shared plumbing: named inputs in contract order, the target over a chunk on the cache."""

    uses_draft = True  # whether the graph contains the draft (and so the LowRankRecurrence node)

    def __init__(self, graph: GraphSpec, target: TargetAdapter, draft: DLiteDraft | None) -> None:
        super().__init__()
        self.graph = graph
        self.target = target
        self.draft = draft
        self.num_layers = target.spec.num_hidden_layers
        self.sampling = graph.name.endswith(SAMPLING_SUFFIX)  # else greedy: argmax, no draft logits out
        # the contract's attention "gqa": the graph returns the cache buffers it writes in place
        self.writes_cache = any(present_output(n) is not None for n in graph.output_names)

    def named(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        names = self.graph.input_names
        if len(inputs) != len(names):
            raise ValueError(f"graph {self.graph.name} takes {len(names)} inputs ({names[:4]}...), got {len(inputs)}")
        return dict(zip(names, inputs, strict=True))

    def run_target(self, x: dict[str, torch.Tensor], ids: torch.Tensor, output_index: torch.Tensor) -> TargetOutput:
        """The target on ids [B, T] at positions past_len.. on top of the per-layer cache."""
        t = ids.shape[1]
        positions = x["past_len"][:, None] + torch.arange(t, device=ids.device)[None, :]  # [B, T]
        past_k = [x[f"past_key.{i}"] for i in range(self.num_layers)]
        past_v = [x[f"past_value.{i}"] for i in range(self.num_layers)]
        return self.target(ids, positions, past_k, past_v, x["past_len"], output_index, write_cache=self.writes_cache)

    @staticmethod
    def cache_outputs(out: TargetOutput) -> tuple[torch.Tensor, ...]:
        """new_key, new_value; or (attention "gqa": the graph writes the cache) present_key.{i},
        present_value.{i} per layer."""
        if out.new_k is None:
            return tuple(t for pair in zip(out.present_k, out.present_v, strict=True) for t in pair)
        return out.new_k, out.new_v

    def draft_block(self, x: dict[str, torch.Tensor], chs: torch.Tensor, prefix: torch.Tensor | None,
                    anchor: torch.Tensor, anchor_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft from the pivot chs [B, S, H] and the group [prefix, anchor] -> (next_block [B, D + 1],
        draft_logits): D = next_width's width - 1 where the graph takes it (the greedy step), else all K.
        The backbone sees the whole block; the sequential head runs D steps, so its first D drafts are
        those of K steps."""
        g = self.draft.cfg.anchor_group_size
        group = anchor[:, None] if prefix is None else torch.cat([prefix, anchor[:, None]], dim=1)  # [B, G]
        group_len = (anchor_pos + 1).clamp(max=g)  # [B] G' = min(G, anchor_pos + 1)
        hidden = self.draft.backbone(chs, group, group_len, self.target.embed_weight)  # [B, K, H]
        if "next_width" in x:
            hidden = hidden[:, : x["next_width"].shape[1] - 1]  # [B, D, H]
        seed_prev = group[:, -2] if g > 1 else None
        head = low_rank_recurrence(self.draft.sequential_head, hidden, anchor, seed_prev, x.get("temperature"),
                                   x.get("u_draft"), self.draft.cfg.num_proposals)
        return torch.cat([anchor[:, None], head.tokens], dim=1), head.logits


class PrefillGraph(_EngineGraph):
    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.named(inputs)
        ids = x["input_ids"]  # [B, T]
        last = (x["chunk_len"] - 1).clamp_min(0)[:, None]  # [B, 1]
        out = self.run_target(x, ids, last)
        logits = out.logits[:, 0]  # [B, V] after the last prompt token
        anchor = sample_from_logits(logits, x["temperature"], x["u_anchor"]) if self.sampling else logits.argmax(-1)
        chs = out.hidden[:, 0]  # [B, S, H] at the last prompt token
        next_block, draft_logits = self.draft_block(x, chs, x.get("group_prefix"), anchor,
                                                    x["past_len"] + x["chunk_len"])
        return next_block, *([draft_logits] if self.sampling else []), chs, *self.cache_outputs(out)


class StepGraph(_EngineGraph):
    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.named(inputs)
        block = x["block"]  # [B, K+1] = [anchor, d_1..d_K]
        b, width = block.shape
        index = torch.arange(width, device=block.device)  # [K+1]
        out = self.run_target(x, block, index[None, :].expand(b, width))  # logits [B, K+1, V]
        drafts = block[:, 1:]  # [B, K]
        n, anchor = greedy_accept(drafts, out.logits)  # [B], [B]
        if self.sampling:  # rows with temperature > 1e-5: rejection sampling
            greedy, safe_t = row_temperature(x["temperature"], 3)  # [B, 1, 1]
            n_sampled, anchor_sampled = rejection_accept(
                drafts, torch.softmax(x["draft_logits"] / safe_t, dim=-1),
                torch.softmax(out.logits.float() / safe_t, dim=-1), x["u_accept"], x["u_resample"])
            n = torch.where(greedy[:, 0, 0], n, n_sampled)
            anchor = torch.where(greedy[:, 0, 0], anchor, anchor_sampled)
        s, h = out.hidden.shape[2:]
        chs = out.hidden.gather(1, n[:, None, None, None].expand(b, 1, s, h))[:, 0]  # [B, S, H] at index n
        # emitted: d_1..d_n, the new anchor, then padding
        padded = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)  # [B, K+1]
        emitted = torch.where(index[None, :] < n[:, None], padded,
                              torch.where(index[None, :] == n[:, None], anchor[:, None],
                                          torch.full_like(padded, PAD_TOKEN)))
        outputs = [n, emitted]
        prefix = x.get("group_prefix")
        if prefix is not None:  # the G-1 tokens ending at block index n: ext[n+1 .. n+G-1]
            ext = torch.cat([prefix, block], dim=1)  # [B, G-1 + K+1]
            offsets = torch.arange(1, prefix.shape[1] + 1, device=block.device)
            prefix = ext.gather(1, n[:, None] + offsets[None, :])  # [B, G-1]
        next_block, draft_logits = self.draft_block(x, chs, prefix, anchor, x["past_len"] + n + 1)
        outputs.append(next_block)
        if prefix is not None:
            outputs.append(prefix)
        return (*outputs, *([draft_logits] if self.sampling else []), *self.cache_outputs(out))


class DecodeGraph(_EngineGraph):
    uses_draft = False

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.named(inputs)
        out = self.run_target(x, x["input_ids"], x["output_index"])  # logits [B, R, V]
        if self.sampling:
            next_tokens = sample_from_logits(out.logits, x["temperature"], x["uniforms"])  # [B, R]
        else:
            next_tokens = out.logits.argmax(dim=-1)
        return next_tokens, *self.cache_outputs(out)


GRAPH_MODULES = {"prefill": PrefillGraph, "step": StepGraph, "decode": DecodeGraph}


def graph_module(graph: GraphSpec, target: TargetAdapter, draft: DLiteDraft) -> _EngineGraph:
    return GRAPH_MODULES[graph.name.removesuffix(SAMPLING_SUFFIX)](graph, target, draft).eval()
