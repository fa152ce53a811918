"""``runtime.kv_cache.KVCache``: O(block) writes, growth that keeps what is cached, and (for
TensorRT, which takes 256-byte aligned tensor addresses) layers on an alignment boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlite_trt.runtime.kv_cache import KVCache


@pytest.mark.parametrize("layer_align", [1, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_writes_and_growth_keep_every_entry(layer_align, dtype):
    cache = KVCache(3, 2, 2, 16, 5, dtype, layer_align=layer_align)
    g = torch.Generator().manual_seed(0)
    new = torch.randn(3, 2, 2, 4, 16, generator=g).to(dtype)
    cache.write(new, -new, start=[0, 1], count=[4, 2])
    cache.ensure_capacity(11)
    assert cache.capacity == 11 and cache.batch == 2
    more = torch.randn(3, 2, 2, 4, 16, generator=g).to(dtype)
    cache.write(more, -more, start=[4, 3], count=[3, 4])
    k, v = cache.view(7)
    assert torch.equal(k[:, 0, :, :4], new[:, 0]) and torch.equal(k[:, 0, :, 4:7], more[:, 0, :, :3])
    assert torch.equal(k[:, 1, :, 1:3], new[:, 1, :, :2]) and torch.equal(k[:, 1, :, 3:7], more[:, 1])
    assert torch.equal(v[:, 0, :, :4], -new[:, 0])
    host = KVCache(3, 2, 2, 16, 8, torch.float32, layer_align=layer_align)  # numpy writes (the ORT runner's)
    host.write(new.float().numpy(), np.zeros((3, 2, 2, 4, 16), np.float32), start=[2, 0], count=[1, 4])
    assert torch.equal(host.k[:, 0, :, 2], new[:, 0, :, 0].float()) and torch.equal(host.k[:, 1, :, :4],
                                                                                     new[:, 1].float())


@pytest.mark.parametrize("capacity", [5, 6, 7, 13])
def test_layers_start_on_the_alignment_boundary(capacity):
    """Each layer's slice is what a runner binds as past_key.{i}: contiguous, and for TensorRT on a
    256-byte boundary whatever the batch, heads, capacity and head size."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cache = KVCache(4, 3, 1, 16, capacity, dtype, layer_align=256)
        for _ in range(2):
            for buf in (cache.k, cache.v):
                assert all(buf[i].is_contiguous() and buf[i].data_ptr() % 256 == 0 for i in range(4)), (dtype,
                                                                                                       buf.stride())
            cache.ensure_capacity(cache.capacity + 3)
    plain = KVCache(4, 3, 1, 16, capacity, torch.float32)
    assert plain.k.is_contiguous()  # no alignment asked: the plain layout


def test_reserve_rounds_the_need_up_to_a_granule_and_keeps_entries():
    """A reservation grows to what is needed rounded up to GRANULE (capped at the engine's
    largest cache), never shrinks, and keeps what is cached."""
    from dlite_trt.runtime.kv_cache import GRANULE

    cache = KVCache(2, 1, 1, 4, 0, torch.float32)
    cache.reserve(5, limit=1000)
    assert cache.capacity == GRANULE
    new = torch.arange(2 * 1 * 1 * 5 * 4, dtype=torch.float32).reshape(2, 1, 1, 5, 4)
    cache.write(new, -new, start=[0], count=[5])
    cache.reserve(GRANULE, limit=1000)
    assert cache.capacity == GRANULE  # it fits: no growth
    cache.reserve(GRANULE + 1, limit=1000)
    assert cache.capacity == 2 * GRANULE and torch.equal(cache.view(5)[0], new)
    cache.reserve(10, limit=1000)
    assert cache.capacity == 2 * GRANULE  # never shrinks
    cache.reserve(999, limit=1000)
    assert cache.capacity == 1000  # capped at the limit, not rounded past it
    with pytest.raises(ValueError, match="1001 KV slots needed"):
        cache.reserve(1001, limit=1000)
