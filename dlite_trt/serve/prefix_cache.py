"""Prefix (KV) reuse across requests: finished sequences keep their KV entries, within a byte budget.

An agent's every turn re-sends its whole context, which starts with the previous turn's prompt
and answer. When a sequence leaves the running batch, its cached entries (every token but the
last, which the next call feeds) are kept here with their token ids. A new request looks up
the kept sequence sharing the longest prefix with its prompt (a follow-up extends it; a
request that diverges inside it shares its start) and prefills only the rest. At least the
prompt's last token is always recomputed: its hidden states are DLite's pivot, so reuse never
changes what the draft sees, and the draft itself keeps nothing (history-free).

A kept sequence that is a prefix of a newly kept one is dropped (the new one serves every
lookup it served). Memory is bounded: the kept entries plus the running batch's cache stay
within ``budget_bytes``; least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Kept:
    tokens: np.ndarray  # [n] int64: the ids whose entries are kept
    k: torch.Tensor  # [L, kvH, n, D]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class PrefixStats:
    queries: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0


@dataclass
class PrefixCache:
    budget_bytes: int
    enabled: bool = True
    stats: PrefixStats = field(default_factory=PrefixStats)

    def __post_init__(self) -> None:
        self._kept: OrderedDict[int, Kept] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.peak_bytes = 0  # the most kept + live bytes seen (the budget's check)
        self._bytes = 0

    @property
    def kept_bytes(self) -> int:
        return self._bytes  # a running total: /metrics reads it from another thread

    def __len__(self) -> int:
        return len(self._kept)

    def lookup(self, prompt: Sequence[int]) -> tuple[Kept | None, int]:
        """The kept sequence sharing the longest prefix with ``prompt`` and how many entries of it
        to reuse (at most len(prompt) - 1: the last prompt token is always recomputed)."""
        if not self.enabled:
            return None, 0
        self.stats.queries += 1
        ids = np.asarray(prompt, np.int64)
        best, best_n, best_key = None, 0, None
        for key, kept in self._kept.items():
            n = min(len(kept.tokens), len(ids) - 1)
            if n <= best_n:
                continue
            differ = np.flatnonzero(kept.tokens[:n] != ids[:n])
            common = int(differ[0]) if differ.size else n
            if common > best_n:
                best, best_n, best_key = kept, common, key
        if best is None:
            return None, 0
        self._kept.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        return best, best_n

    def keep(self, tokens: Sequence[int], nbytes: int, save: Callable[[], tuple[torch.Tensor, torch.Tensor]],
             live_bytes: int) -> bool:
        """Keep a finished sequence's entries (``save()`` copies them: ``tokens[i]``'s at k[:, :, i];
        ``nbytes`` of them) while the running batch holds ``live_bytes``. Room is made first (least
        recently used out), so the copy never takes the total past the budget; a sequence that
        cannot fit is not kept. Kept sequences it extends are dropped. Returns whether it was kept."""
        if not self.enabled or len(tokens) == 0:
            return False
        if nbytes + live_bytes > self.budget_bytes:
            return False  # the kept sequences it would supersede stay
        ids = np.asarray(tokens, np.int64)
        for key in [key for key, e in self._kept.items()
                    if len(e.tokens) <= len(ids) and np.array_equal(e.tokens, ids[: len(e.tokens)])]:
            self._bytes -= self._kept.pop(key).nbytes  # superseded, not evicted: the new one serves its lookups
        self.fit(live_bytes + nbytes)
        k, v = save()
        self._kept[self._next_id] = kept = Kept(ids, k, v)
        self._bytes += kept.nbytes
        self._next_id += 1
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes + live_bytes)
        return True

    def fit(self, live_bytes: int) -> None:
        """Evict least recently used sequences until kept + ``live_bytes`` is within the budget."""
        while self._kept and self._bytes + live_bytes > self.budget_bytes:
            _, gone = self._kept.popitem(last=False)
            self._bytes -= gone.nbytes
            self.stats.evictions += 1
        self.peak_bytes = max(self.peak_bytes, self._bytes + live_bytes)
