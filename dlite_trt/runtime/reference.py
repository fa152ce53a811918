"""The reference speculative generator in PyTorch (DESIGN 1.3): the behaviour every backend matches.

A ``Session`` holds a batch of sequences and the target's KV cache. ``generate``/``stream``
first run the target on each sequence's uncached suffix (the prompt at first; after
``extend``, the appended turn), which yields the first anchor and pivot; then speculative
steps: verify [anchor, d_1..d_K], accept per sequence, draft the next block from the verify
pass's hidden states at the last accepted position. Each sequence advances by its own
acceptance length. The draft keeps no state, so ``extend`` costs it nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from dlite_trt.errors import DLiteError
from dlite_trt.model.draft import DLiteDraft
from dlite_trt.model.sequential_head import HeadOutput
from dlite_trt.model.target import TargetAdapter, TargetOutput
from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.runtime.sampling import (
    greedy_accept,
    is_greedy,
    probs_from_logits,
    rejection_accept,
    sample_from_logits,
)
from dlite_trt.runtime.session import (
    GeneratorBase,
    SamplingParams,
    SessionBase,
    StepEvent,
)
from dlite_trt.runtime.stats import StageTimer

VERIFY_TOKENS = 8  # tokens per verify call for drafts other than DLite (prompt lookup) without a draft


class SpeculativeGenerator(GeneratorBase):
    """Target + DLite draft in PyTorch."""

    def __init__(self, target: TargetAdapter, draft: DLiteDraft | None) -> None:
        if draft is not None and target.layer_ids != draft.cfg.target_layer_ids:
            raise DLiteError(f"target adapter returns layers {target.layer_ids}, the draft reads "
                             f"{draft.cfg.target_layer_ids}")
        self.target = target
        self.draft = draft

    @classmethod
    def target_only(cls, target: TargetAdapter) -> SpeculativeGenerator:
        """A generator without a draft: only ``generate_target_only`` / ``stream_target_only`` work
        (training data is the target's own output)."""
        return cls(target, None)

    def session(self, prompts: Sequence[Sequence[int]]) -> Session:
        return Session(self, prompts)


class Session(SessionBase):
    """A live batch of sequences on the reference generator."""

    def __init__(self, gen: SpeculativeGenerator, prompts: Sequence[Sequence[int]]) -> None:
        super().__init__(prompts, gen.target.spec.vocab_size)
        self.gen = gen
        self.spec = gen.target.spec
        param = next(gen.target.parameters())
        self.device, self.dtype = param.device, param.dtype
        spec = self.spec
        self.cache = KVCache(spec.num_hidden_layers, len(prompts), spec.num_key_value_heads, spec.head_dim,
                             capacity=max(map(len, self.tokens)) + 64, dtype=self.dtype, device=self.device)

    def _check_length(self, longest: int) -> None:
        if longest > self.spec.max_position_embeddings:
            raise DLiteError(
                f"a sequence would reach {longest} tokens, past the target's max_position_embeddings="
                f"{self.spec.max_position_embeddings}; shorten the prompt or lower max_new_tokens."
            )
        self.cache.ensure_capacity(longest + self.max_verify_tokens())

    def _u(self, uniforms, *shape: int) -> torch.Tensor | None:
        u = uniforms(*shape)
        return None if u is None else u.to(self.device)

    @torch.inference_mode()
    def _target_first(self, params: SamplingParams, uniforms) -> list[int]:
        out = self._run_suffix()
        return sample_from_logits(out.logits[:, 0], params.temperature, self._u(uniforms, self.batch_size)).tolist()

    @torch.inference_mode()
    def _target_next(self, tokens: list[int], pos: list[int], params: SamplingParams, uniforms) -> list[int]:
        b = self.batch_size
        out = self._run_target(torch.tensor(tokens, device=self.device)[:, None], pos,
                               [int(a) for a in self._active], torch.zeros(b, 1, dtype=torch.long, device=self.device))
        return sample_from_logits(out.logits[:, 0], params.temperature, self._u(uniforms, b)).tolist()

    def max_verify_tokens(self) -> int:
        return VERIFY_TOKENS if self.gen.draft is None else self.gen.draft.cfg.block_size

    @torch.inference_mode()
    def _target_verify(self, fed: list[list[int]], pos: list[int], params: SamplingParams,
                       uniforms) -> list[list[int]]:
        padded, count = self._padded(fed)
        ids = torch.tensor(padded, device=self.device)
        b, width = ids.shape
        out = self._run_target(ids, pos, count, torch.arange(width, device=self.device).expand(b, -1))
        tokens = sample_from_logits(out.logits, params.temperature, self._u(uniforms, b, width)).tolist()
        return [tokens[row][: len(toks)] for row, toks in enumerate(fed)]

    @torch.inference_mode()
    def stream(self, params: SamplingParams, timer: StageTimer | None = None) -> Iterator[StepEvent]:
        """Yield the tokens each engine call emits, per sequence, until every sequence stops."""
        if self.gen.draft is None:
            raise DLiteError("this generator has no draft (target_only); use generate_target_only.")
        timer = timer or StageTimer()
        b = self.batch_size
        k_props = self.gen.draft.cfg.num_proposals
        host_uniforms = self._start(params)

        def uniforms(*shape: int) -> torch.Tensor | None:
            return self._u(host_uniforms, *shape)

        if params.max_new_tokens == 0:
            return
        sampling = not is_greedy(params.temperature)
        with timer.time("prefill"):
            out = self._run_suffix()
            anchor = sample_from_logits(out.logits[:, 0], params.temperature, uniforms(b))  # [B]
            chs = out.hidden[:, 0]  # [B, S, H]
        emitted = tuple(self._emit(row, [int(anchor[row])], params) for row in range(b))
        yield StepEvent(emitted, None)
        # Finished rows stay in the batch (their results are ignored): the reference keeps the
        # batch static, as an engine with a fixed batch would; dropping rows is a scheduler's job.
        while any(self._active):
            with timer.time("draft"):
                proposal = self._draft(chs, params.temperature, uniforms(b, k_props))
            anchor_pos = [len(t) - 1 for t in self.tokens]  # active rows end with their anchor
            with timer.time("verify"):
                block = torch.cat([anchor[:, None], proposal.tokens], dim=1)  # [B, K+1]
                out = self._run_target(block, anchor_pos, [k_props + 1 if a else 0 for a in self._active],
                                       torch.arange(k_props + 1, device=self.device).expand(b, -1))
            with timer.time("accept"):
                if sampling:
                    n, anchor = rejection_accept(
                        proposal.tokens, probs_from_logits(proposal.logits, params.temperature),
                        probs_from_logits(out.logits, params.temperature), uniforms(b, k_props), uniforms(b))
                else:
                    n, anchor = greedy_accept(proposal.tokens, out.logits)
                chs = out.hidden[torch.arange(b, device=self.device), n]  # [B, S, H] at block index n
                drafts = proposal.tokens.tolist()
                event = self._finish_step(
                    drafts, n.tolist(), lambda row, n_row, d=drafts, a=anchor: d[row][:n_row] + [int(a[row])],
                    anchor_pos, params)
            yield event

    def _run_suffix(self) -> TargetOutput:
        """Target over each sequence's uncached tokens (right-padded to a batch)."""
        suffixes = [t[c:] for t, c in zip(self.tokens, self.cache_len, strict=True)]
        width = max(map(len, suffixes))
        ids = torch.zeros(self.batch_size, width, dtype=torch.long)
        for row, s in enumerate(suffixes):
            ids[row, : len(s)] = torch.tensor(s)
        last = torch.tensor([[len(s) - 1] for s in suffixes], device=self.device)  # [B, 1]
        out = self._run_target(ids.to(self.device), list(self.cache_len), [len(s) for s in suffixes], last)
        self.cache_len = [len(t) for t in self.tokens]
        return out

    def _run_target(self, ids: torch.Tensor, start: list[int], count: list[int],
                    output_index: torch.Tensor) -> TargetOutput:
        """One target forward at positions start[b].. on top of the cache; stores count[b] new entries."""
        b, t = ids.shape
        start_t = torch.tensor(start, device=self.device)
        positions = start_t[:, None] + torch.arange(t, device=self.device)  # [B, T]
        past_k, past_v = self.cache.view(max(start))
        out = self.gen.target(ids, positions, past_k, past_v, start_t, output_index)
        self.cache.write(out.new_k, out.new_v, start, count)
        return out

    def _draft(self, chs: torch.Tensor, temperature: float, u: torch.Tensor | None) -> HeadOutput:
        """Draft one block per sequence from the pivot states and the token group ending at the anchor."""
        g = self.gen.draft.cfg.anchor_group_size
        group = torch.zeros(self.batch_size, g, dtype=torch.long)
        group_len = torch.zeros(self.batch_size, dtype=torch.long)
        for row, toks in enumerate(self.tokens):
            tail = toks[-g:]
            group[row, g - len(tail):] = torch.tensor(tail)
            group_len[row] = len(tail)
        return self.gen.draft(chs, group.to(self.device), group_len.to(self.device),
                              self.gen.target.embed_weight, temperature, u)
