"""Runs an engine directory's graphs on ONNX Runtime, with the KV cache bound in place.

The runner owns the target KV cache: one preallocated buffer per K and V, [L, B, kvH, cap, D].
Each graph input ``past_key.{i}`` is bound (IOBinding) to layer i's contiguous slice of that
buffer, so no call copies the cache; ``store_kv`` writes only the entries a call keeps (the
accepted block, a prefill chunk) into their slots: O(block) per step. Rejected entries are
never written: they are discarded by the sequences' lengths (``past_len``).

Runner interface (shared with future backends, Polygraphy-style): ``activate()`` /
``deactivate()`` (or a ``with`` block), ``reserve(batch, capacity)``, ``infer(graph, feeds)``
-> outputs by name, ``store_kv(start, count)``. Outputs named in ``DEVICE_OUTPUTS`` stay
backend values and may be passed back as inputs of the next call without a host round trip.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.engine.manifest import Manifest
from dlite_trt.errors import EngineError
from dlite_trt.export.contract import kv_input

DEVICE_OUTPUTS = frozenset({"next_draft_logits"})  # fed back to the next step as ``draft_logits``
NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class OrtRunner:
    def __init__(self, engine_dir: Path, manifest: Manifest, *, threads: int | None = None) -> None:
        if manifest.backend != "onnxruntime":
            raise EngineError(f"{engine_dir} is a {manifest.backend} engine, not an ONNX Runtime one.")
        self.engine_dir = Path(engine_dir)
        self.manifest = manifest
        self.contract = manifest.contract
        self.threads = threads
        spec = manifest.target_spec
        self.cache_dtype = NUMPY_DTYPES[manifest.dtype]
        self.num_layers = spec.num_hidden_layers
        self._kv_row = (spec.num_key_value_heads, spec.head_dim)
        self.sessions: dict[str, Any] = {}
        self._bindings: dict[str, Any] = {}
        self._cache_bound: dict[str, Any] = {}  # graph -> the buffer its cache inputs are bound to
        self.k: np.ndarray | None = None  # [L, B, kvH, cap, D]
        self.v: np.ndarray | None = None
        self._last: dict[str, np.ndarray] = {}
        self.engine_seconds = 0.0  # time inside run_with_iobinding, accumulated

    # -- lifecycle ---------------------------------------------------------------------------
    def activate(self) -> OrtRunner:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            so.intra_op_num_threads = self.threads
        for name, files in self.manifest.graphs.items():
            path = self.engine_dir / files["runtime"]
            try:
                self.sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
                raise EngineError(f"ONNX Runtime cannot load {path}: {exc}. The engine is corrupt or was built by "
                                  "an incompatible version; rebuild it with `dlite-trt build`.") from exc
            self._bindings[name] = self.sessions[name].io_binding()
        return self

    def deactivate(self) -> None:
        self.sessions.clear()
        self._bindings.clear()
        self.release_cache()

    def release_cache(self) -> None:
        self.k = self.v = None
        self._last = {}
        self._cache_bound.clear()

    def __enter__(self) -> OrtRunner:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    # -- KV cache ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    def reserve(self, batch: int, capacity: int) -> None:
        """Make room for ``capacity`` slots per sequence, keeping what is cached (grows, never shrinks)."""
        if self.k is not None and self.k.shape[1] != batch:
            raise EngineError(f"the runner holds a cache for batch {self.k.shape[1]}, not {batch}; "
                              "use one runner per session.")
        if capacity <= self.capacity:
            return
        shape = (self.num_layers, batch, self._kv_row[0], capacity, self._kv_row[1])
        k, v = np.zeros(shape, self.cache_dtype), np.zeros(shape, self.cache_dtype)
        if self.k is not None:  # growth: once per generate call at most, amortised
            k[:, :, :, : self.capacity] = self.k
            v[:, :, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def store_kv(self, start: Sequence[int], count: Sequence[int]) -> None:
        """Write the last call's new entries: row b's first count[b] at slots start[b]..."""
        new_k, new_v = self._last["new_key"], self._last["new_value"]  # [L, B, kvH, T, D]
        for row, (s, n) in enumerate(zip(start, count, strict=True)):
            if n <= 0:
                continue
            if s + n > self.capacity:
                raise EngineError(f"KV write past the cache: row {row} needs {s + n} > {self.capacity} slots")
            self.k[:, row, :, s : s + n] = new_k[:, row, :, :n]
            self.v[:, row, :, s : s + n] = new_v[:, row, :, :n]

    # -- calls -----------------------------------------------------------------------------------
    def infer(self, graph: str, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run one graph. ``feeds`` holds every non-cache input (numpy arrays or values this runner returned)."""
        import onnxruntime as ort

        spec = self.contract[graph]
        io = self._bindings[graph]
        if self._cache_bound.get(graph) is not self.k:  # (re)bind the cache and outputs after reserve()
            self._bind_cache(graph)
        batch = self.k.shape[1]
        keep = []  # bound host arrays must outlive the run
        for t in spec.inputs:
            if kv_input(t.name) is not None:
                continue
            value = feeds[t.name]
            if isinstance(value, ort.OrtValue):
                io.bind_ortvalue_input(t.name, value)
                continue
            array = np.ascontiguousarray(value, dtype=t.dtype)
            if array.ndim != len(t.dims) or array.shape[0] != batch:
                raise EngineError(f"{graph}: input {t.name} has shape {array.shape}, expected dims {t.dims} "
                                  f"with batch {batch}")
            keep.append(array)
            io.bind_cpu_input(t.name, array)
        io.clear_binding_outputs()  # fresh outputs each run (shapes change; previous outputs stay valid)
        for t in spec.outputs:
            io.bind_output(t.name, "cpu")
        started = time.perf_counter()
        self.sessions[graph].run_with_iobinding(io)
        self.engine_seconds += time.perf_counter() - started
        del keep
        values = io.get_outputs()
        out = {t.name: (v if t.name in DEVICE_OUTPUTS else v.numpy()) for t, v in zip(spec.outputs, values, strict=True)}
        self._last = out
        return out

    def _bind_cache(self, graph: str) -> None:
        """Bind each past_key.{i}/past_value.{i} to layer i's slice of the cache buffer (no copy)."""
        io = self._bindings[graph]
        io.clear_binding_inputs()
        for t in self.contract[graph].inputs:
            kv = kv_input(t.name)
            if kv is not None:
                buf = (self.k if kv[0] == "key" else self.v)[kv[1]]  # contiguous [B, kvH, cap, D]
                io.bind_input(t.name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
        self._cache_bound[graph] = self.k
