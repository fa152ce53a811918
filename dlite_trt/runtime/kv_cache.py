"""A preallocated target KV cache written O(block) per step.

Layout: k, v [L, B, kvH, capacity, D]; with ``layer_align`` each layer's slice starts on that
byte boundary (TensorRT takes tensor addresses aligned to 256 bytes), the layers padded apart
in one allocation. A forward reads a view of the first P entries and
returns only its new entries; ``write`` copies those into each sequence's slots. Entries past
a sequence's valid length (rejected drafts, padding) are never read: the attention mask
stops at ``past_len``, and the next write overwrites them. (An ONNX Runtime engine with
attention "gqa" writes all of a call's entries there itself, in place, and returns none: ``store``
then has nothing to copy; the same holds.)

Engines bind each layer's whole [B, kvH, capacity, D] slice (a prefix of the capacity axis is
not contiguous), so a call over attention "ops" attends over the capacity (one over "gqa"
reads each row up to its length, but must have room for its T new entries past it):
``reserve`` keeps it at what the
sequences hold rounded up to a granule of 128 slots, instead of what they may reach. Growing
copies the cache once per granule of tokens: at a context of C slots that is C / 128 slots'
worth of copying per token, under 1% of a step's memory traffic for the models served here,
where a larger headroom would make every step attend over the waste instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

GRANULE = 128  # KV slots are reserved in multiples of this


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", *, layer_align: int = 1) -> None:
        self.layer_align = layer_align
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = self._zeros(shape, dtype, device)
        self.v = self._zeros(shape, dtype, device)
        self.bindings: dict[str, object] = {}  # a runner's per-graph state bound to these buffers
        self.engine_seconds = 0.0  # time the runner spent in engine calls on this cache
        self._row_views: dict[tuple[int, ...], KVRows] = {}

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed [L, B, kvH, cap, D] buffer whose layers start ``layer_align`` bytes apart (or more)."""
        size = torch.empty((), dtype=dtype).element_size()
        layer = shape[1] * shape[2] * shape[3] * shape[4]
        per_align = max(1, self.layer_align // size)
        stride = -(-layer // per_align) * per_align
        n = shape[0] * stride + per_align - 1
        if _on_host(dtype, device):  # calloc'd pages: no fill on torch's thread pool (see _copy)
            flat = torch.from_numpy(np.zeros(n, dtype=torch.empty((), dtype=dtype).numpy().dtype))
        else:
            flat = torch.zeros(n, dtype=dtype, device=device)
        offset = (-flat.data_ptr() // size) % per_align  # the first layer on the boundary too
        return flat.as_strided(shape, (stride, *torch.empty(shape[1:], device="meta").stride()), offset)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def ensure_capacity(self, needed: int, max_capacity: int | None = None) -> None:
        """Grow (doubling, up to ``max_capacity``) when a session outgrows its buffer; amortised
        O(1) per token. What is cached is kept."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        if max_capacity is not None:
            new_cap = max(needed, min(new_cap, max_capacity))
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = self._zeros((*old.shape[:3], new_cap, old.shape[4]), old.dtype, old.device)
            _copy(grown[:, :, :, : old.shape[3]], old)
            setattr(self, name, grown)

    def reserve(self, needed: int, limit: int) -> None:
        """Make room for ``needed`` slots (at most ``limit``, the engine's largest cache): grow to
        ``needed`` rounded up to a granule; never shrinks."""
        if needed > limit:
            raise ValueError(f"{needed} KV slots needed, past the engine's {limit}")
        if needed > self.capacity:
            grown = min(-(-needed // GRANULE) * GRANULE, limit)
            self.ensure_capacity(grown, max_capacity=grown)

    def rows(self, start: int, stop: int) -> KVRows:
        """Sequences start..stop-1 as a cache of their own (the same buffers, no copy): each layer's
        slice of consecutive rows is contiguous, so an engine binds it as it binds a whole cache.
        A scheduler runs a call on the rows that take part in it (``serve.scheduler``)."""
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"rows {start}..{stop - 1} of a cache of {self.batch}")
        key = (start, stop, self.k.data_ptr(), self.capacity)
        held = self._row_views.get(key)
        if held is None:
            self._row_views = {k: v for k, v in self._row_views.items() if k[2:] == key[2:]}  # grown: old views go
            held = self._row_views[key] = KVRows(self, start, stop)
        return held

    def copy_row(self, dst: int, src: int, length: int) -> None:
        """Sequence src's first ``length`` entries into sequence dst's slots (moving a row)."""
        for buf in (self.k, self.v):
            _copy(buf[:, dst, :, :length], buf[:, src, :, :length])

    def load_row(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries [L, kvH, n, D] (kept from an earlier sequence) into sequence ``row``'s first n slots."""
        n = k.shape[2]
        _copy(self.k[:, row, :, :n], k)
        _copy(self.v[:, row, :, :n], v)

    def save_row(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of sequence ``row``'s first ``length`` entries, [L, kvH, length, D] each."""
        out = []
        for buf in (self.k, self.v):
            kept = torch.empty(buf[:, row, :, :length].shape, dtype=buf.dtype, device=buf.device)
            _copy(kept, buf[:, row, :, :length])
            out.append(kept)
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def view(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` slots of every sequence, [L, B, kvH, length, D], without copying."""
        return self.k[:, :, :, :length], self.v[:, :, :, :length]

    def store(self, out: Mapping[str, Any], start: list[int], count: list[int]) -> None:
        """Keep an engine call's new entries (``write``), where it returns them: a graph with attention
        "gqa" has written them into the bound buffers itself (export/contract.py)."""
        if "new_key" in out:
            self.write(out["new_key"], out["new_value"], start, count)

    def write(self, new_k: torch.Tensor | np.ndarray, new_v: torch.Tensor | np.ndarray, start: list[int],
              count: list[int]) -> None:
        """Store new_k/new_v [L, B, kvH, T, D]: row b's first count[b] entries at start[b].

        Host engines pass numpy arrays: the copy then goes through numpy views of the same (CPU)
        buffers, whose slicing costs microseconds where torch's costs tens per call.
        """
        k, v = self.k, self.v
        if isinstance(new_k, np.ndarray):
            k, v = k.numpy(), v.numpy()
        for b, (s, n) in enumerate(zip(start, count, strict=True)):
            if n <= 0:
                continue
            if s + n > self.capacity:
                raise ValueError(f"KV write past capacity: row {b} needs {s + n} > {self.capacity} slots")
            k[:, b, :, s : s + n] = new_k[:, b, :, :n]
            v[:, b, :, s : s + n] = new_v[:, b, :, :n]


def _on_host(dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float16)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src; on the host through numpy views, in the calling thread. Right after an ONNX
    Runtime call its pool's threads still spin, and a copy split over torch's thread pool waits
    for them: measured 30 ms for a cache that numpy copies in under 1 ms."""
    if _on_host(src.dtype, src.device):
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)


class KVRows(KVCache):
    """Rows start..stop-1 of a ``KVCache``, sharing its buffers (``KVCache.rows``). It cannot grow:
    the owner reserves room for every row first; ``reserve`` only checks."""

    def __init__(self, owner: KVCache, start: int, stop: int) -> None:  # noqa: D107 - no buffers of its own
        self.layer_align = owner.layer_align
        self.k, self.v = owner.k[:, start:stop], owner.v[:, start:stop]
        self.bindings = {}
        self.engine_seconds = 0.0
        self._row_views = {}

    def reserve(self, needed: int, limit: int) -> None:
        if needed > self.capacity:
            raise ValueError(f"{needed} KV slots needed, but these rows' cache holds {self.capacity}: reserve on "
                             "the whole cache first")

    def ensure_capacity(self, needed: int, max_capacity: int | None = None) -> None:
        self.reserve(needed, needed)
