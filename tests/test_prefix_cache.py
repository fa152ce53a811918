"""The prefix cache's bookkeeping (longest shared prefix, the last prompt token recomputed,
superseded sequences, LRU eviction within the byte budget) and the KV cache's row views it
relies on. The server tests check the same end to end, through real requests."""

from __future__ import annotations

import torch

from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.serve.prefix_cache import PrefixCache

ENTRY = 2 * 2 * 3 * 4 * 4  # bytes per kept token of these tensors: K and V, [2 layers, 3 heads, n, 4] fp32


def _kv(n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((2, 3, n, 4), fill), torch.full((2, 3, n, 4), -fill)


def _keep(cache: PrefixCache, tokens: list[int], live: int = 0, fill: float = 0.0) -> bool:
    return cache.keep(tokens, len(tokens) * ENTRY, lambda: _kv(len(tokens), fill), live)


def test_the_longest_shared_prefix_is_reused_but_never_the_last_prompt_token():
    cache = PrefixCache(budget_bytes=10**6)
    _keep(cache, [1, 2, 3, 4, 5, 6], fill=1.0)
    _keep(cache, [1, 2, 9, 9], fill=2.0)
    kept, n = cache.lookup([1, 2, 3, 4, 7, 8])
    assert n == 4 and kept.k[0, 0, 0, 0] == 1.0
    assert cache.lookup([1, 2, 9, 9, 9])[1] == 4  # a follow-up extends the second
    assert cache.lookup([1, 2, 3, 4, 5, 6])[1] == 5  # the same prompt again: its last token is recomputed
    assert cache.lookup([7, 1, 2])[0] is None
    s = cache.stats
    assert (s.queries, s.hits, s.reused_tokens) == (4, 3, 13)


def test_a_sequence_that_a_newer_one_extends_is_dropped_not_evicted():
    cache = PrefixCache(budget_bytes=10**6)
    _keep(cache, [1, 2, 3])
    _keep(cache, [1, 2, 3, 4, 5])
    assert len(cache) == 1 and cache.kept_bytes == 5 * ENTRY and cache.stats.evictions == 0


def test_least_recently_used_sequences_go_first_and_the_budget_holds():
    cache = PrefixCache(budget_bytes=10 * ENTRY)
    _keep(cache, [1, 1, 1, 1])
    _keep(cache, [2, 2, 2, 2])
    cache.lookup([1, 1, 1, 1, 5])  # the first is now the most recently used
    _keep(cache, [3, 3, 3, 3])  # 12 entries would not fit: the second goes
    assert cache.lookup([2, 2, 2, 2, 5])[0] is None and cache.lookup([1, 1, 1, 1, 5])[1] == 4
    assert cache.stats.evictions == 1 and cache.kept_bytes == 8 * ENTRY
    cache.fit(live_bytes=6 * ENTRY)  # the running batch grew: only one kept sequence fits beside it
    assert len(cache) == 1 and cache.peak_bytes <= cache.budget_bytes
    assert not _keep(cache, list(range(11)))  # larger than the whole budget: not kept at all


def test_reuse_off_keeps_nothing():
    cache = PrefixCache(budget_bytes=10**6, enabled=False)
    assert not _keep(cache, [1, 2, 3])
    assert cache.lookup([1, 2, 3, 4]) == (None, 0) and cache.stats.queries == 0


def test_row_views_share_the_cache_and_move_rows():
    cache = KVCache(2, 4, 3, 4, capacity=8, dtype=torch.float32)
    view = cache.rows(1, 3)
    assert view.batch == 2 and view.k.data_ptr() == cache.k[:, 1].data_ptr()
    new = torch.arange(2 * 2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 2, 3, 2, 4)
    view.write(new.numpy(), (-new).numpy(), [0, 5], [2, 1])
    assert torch.equal(cache.k[:, 1, :, 0:2], new[:, 0]) and torch.equal(cache.k[:, 2, :, 5:6], new[:, 1, :, :1])
    assert cache.rows(1, 3) is view  # bound once, reused while the buffers stay
    k, v = cache.save_row(2, 6)
    cache.copy_row(0, 2, 6)
    assert torch.equal(cache.k[:, 0, :, :6], k) and torch.equal(cache.v[:, 0, :, :6], v)
    cache.load_row(3, k[:, :, :4], v[:, :, :4])
    assert torch.equal(cache.k[:, 3, :, :4], k[:, :, :4])
    cache.reserve(200, 300)  # grown: new buffers, new views
    assert cache.rows(1, 3) is not view and torch.equal(cache.k[:, 0, :, :6], k)
