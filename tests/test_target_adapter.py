"""The target adapter against transformers' own Qwen3 forward. Tier: fp32 end to end ~1e-5."""

from __future__ import annotations

import pytest
import torch
from helpers import make_target

from dlite_trt.config import select_target_layer_ids
from dlite_trt.model.target import TargetAdapter
from dlite_trt.runtime.kv_cache import KVCache

ATOL = 2e-5


@pytest.mark.parametrize("layers,s", [(4, 3), (6, 4), (5, 2)])
def test_logits_and_layer_semantics_match_transformers(layers, s):
    hf, spec = make_target(97, num_hidden_layers=layers, seed=layers)
    ids_sel = select_target_layer_ids(layers, s)
    adapter = TargetAdapter(hf, spec, ids_sel)
    ids = torch.randint(0, 97, (2, 11))
    ref = hf(ids, output_hidden_states=True)
    empty = torch.zeros(layers, 2, spec.num_key_value_heads, 0, spec.head_dim)
    out = adapter(ids, torch.arange(11).expand(2, -1), empty, empty, torch.zeros(2, dtype=torch.long),
                  torch.arange(11).expand(2, -1))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    for j, k in enumerate(ids_sel):
        # layer id k = output of decoder layer k = hidden_states[k + 1]; for k = N-1 after the final norm
        torch.testing.assert_close(out.hidden[:, :, j], ref.hidden_states[k + 1], atol=ATOL, rtol=0)
    assert ids_sel[-1] == layers - 1  # so the post-norm case (hidden_states[N]) was checked above


def test_incremental_blocks_with_cache_match_one_pass():
    """Prefill, then blocks of different sizes per sequence on the cache == one full forward."""
    hf, spec = make_target(97, seed=3)
    adapter = TargetAdapter(hf, spec, (0, 1, 3))
    seq = torch.randint(0, 97, (2, 20))
    full = hf(seq).logits  # [2, 20, V]
    cache = KVCache(spec.num_hidden_layers, 2, spec.num_key_value_heads, spec.head_dim, 32, torch.float32)
    lens = [5, 8]  # each sequence at its own position
    chunk = torch.stack([torch.cat([seq[0, :5], seq[0, :3]]), seq[1, :8]])  # row 0 right-padded with junk
    k, v = cache.view(0)
    out = adapter(chunk, torch.arange(8).expand(2, -1), k, v, torch.zeros(2, dtype=torch.long),
                  torch.tensor([[4], [7]]))
    cache.write(out.new_k, out.new_v, [0, 0], lens)
    torch.testing.assert_close(out.logits[:, 0], full[[0, 1], [4, 7]], atol=ATOL, rtol=0)
    # garbage written past a sequence's length (rejected drafts) must be invisible
    junk = torch.randn_like(out.new_k)
    cache.write(junk, junk, [5, 8], [3, 3])
    block = torch.stack([seq[0, 5:9], seq[1, 8:12]])
    start = torch.tensor(lens)
    k, v = cache.view(max(lens))
    out = adapter(block, start[:, None] + torch.arange(4), k, v, start, torch.arange(4).expand(2, -1))
    torch.testing.assert_close(out.logits[0], full[0, 5:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[1], full[1, 8:12], atol=ATOL, rtol=0)
