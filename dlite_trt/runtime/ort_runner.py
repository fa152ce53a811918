"""Runs an engine directory's graphs on ONNX Runtime, with the KV cache bound in place.

A session's target KV cache (``runtime.kv_cache.KVCache`` on the CPU) is one preallocated
buffer per K and V, [L, B, kvH, cap, D]. Each graph input ``past_key.{i}`` is bound (IOBinding)
to layer i's contiguous slice of that buffer, so no call copies the cache; ``KVCache.write``
stores only the entries a call keeps (the accepted block, a prefill chunk): O(block) per
step. With attention "gqa" the graph itself writes all of a call's entries in place
(``present_key.{i}`` bound to the same memory); rejected ones then sit past the sequence's
length (``past_len``), which is what discards them, and the next call overwrites them.

Threads: one runner (one engine) may serve several threads at once. ONNX Runtime's
``InferenceSession`` runs concurrently; what a call binds (an IOBinding per graph) belongs to
the KV cache it runs on (``KVCache.bindings``), so sessions never share one, and graphs load
under a lock. A session (its cache) is used by one thread at a time.

Runner interface (shared with future backends, Polygraphy-style): ``activate()`` /
``deactivate()`` (or a ``with`` block), ``new_cache(batch)``, ``infer(graph, feeds, cache)`` ->
outputs by name (numpy arrays here, written by the call in place: each has its own memory, so
a step's ``next_draft_logits`` is fed back as the next call's input without a copy).

What a call costs the host: its cache buffers (inputs and, with "gqa", outputs) stay bound
across calls; each call binds only its few host inputs and its other outputs, which go into
arrays allocated at the shapes the contract gives for the inputs' sizes. Binding the 60 present
outputs of SmolLM2 every call and wrapping every output ORT returned cost about 0.7 ms a call
(of a 13 ms n-gram step at int4).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dlite_trt.dtypes import NUMPY_NAMES, TORCH
from dlite_trt.engine.manifest import Manifest
from dlite_trt.errors import EngineError
from dlite_trt.export.cache_attention import GQA_UNAVAILABLE, onnxruntime_takes_query_seqlens
from dlite_trt.export.contract import kv_input, present_output
from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.runtime.runner import RunnerBase

SPIN_STOP = "session.force_spinning_stop"  # ONNX Runtime session option: intra-op workers stop spinning when a run returns


class OrtRunner(RunnerBase):
    def __init__(self, engine_dir: Path, manifest: Manifest, *, threads: int | None = None) -> None:
        if manifest.backend != "onnxruntime":
            raise EngineError(f"{engine_dir} is a {manifest.backend} engine, not an ONNX Runtime one.")
        if manifest.attention == "gqa" and not onnxruntime_takes_query_seqlens():
            raise EngineError(f"{engine_dir} attends through GroupQueryAttention, but {GQA_UNAVAILABLE}.")
        self.engine_dir = Path(engine_dir)
        self.manifest = manifest
        self.contract = manifest.contract
        self.threads = threads
        self.sessions: dict[str, Any] = {}
        self._host_inputs: dict[str, list] = {}  # graph -> its non-cache input specs
        self._host_outputs: dict[str, list] = {}  # graph -> its outputs other than the cache's (present_*)
        self._loading = threading.Lock()  # two threads' first calls of a graph load it once
        self._identity = self._file_identity()  # graphs load lazily: they must come from this same build

    # -- lifecycle (activate / with: RunnerBase); every session holds its own prepacked weights ----
    def _load(self, name: str) -> Any:
        return self._session(name)

    def loaded(self, graph: str) -> bool:
        return graph in self.sessions

    def _session(self, name: str) -> Any:
        session = self.sessions.get(name)
        if session is not None:
            return session
        with self._loading:
            if name not in self.sessions:
                self._load_session(name)
            return self.sessions[name]

    def _load_session(self, name: str) -> None:
        import onnxruntime as ort

        self._check_unchanged()
        path = self.engine_dir / self.manifest.graphs[name]["runtime"]
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            so.intra_op_num_threads = self.threads
        # each graph's session has its own thread pool, whose workers spin after a run; a call of
        # another graph next (DLite + n-gram alternates step and decode) then shares the cores with
        # them. Stopping the spin when a run returns made those calls 25-30% faster (docs/performance.md).
        so.add_session_config_entry(SPIN_STOP, "1")
        try:
            session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise EngineError(f"ONNX Runtime cannot load {path}: {exc}. The engine is corrupt or was built by "
                              "an incompatible version; rebuild it with `dlite-trt build`.") from exc
        self._check_io(name, session, path)
        self._host_inputs[name] = [t for t in self.contract[name].inputs if kv_input(t.name) is None]
        self._host_outputs[name] = [t for t in self.contract[name].outputs if present_output(t.name) is None]
        self.sessions[name] = session  # last: other threads read it without the lock

    def _file_identity(self) -> dict[str, tuple[int, int, int]]:
        identity = {}
        for rel in self.manifest.files:
            st = (self.engine_dir / rel).stat()
            identity[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return identity

    def _check_unchanged(self) -> None:
        try:
            same = self._file_identity() == self._identity
        except FileNotFoundError:
            same = False
        if not same:
            raise EngineError(f"the engine directory {self.engine_dir} changed since it was opened (rebuilt or "
                              "edited); its graphs would come from two builds. Open the engine again.")

    def _check_io(self, name: str, session: Any, path: Path) -> None:
        spec = self.contract[name]
        got = ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
        if got != (spec.input_names, spec.output_names):
            raise EngineError(f"{path} takes {got[0]} and returns {got[1]}, but the manifest's I/O contract says "
                              f"{spec.input_names} -> {spec.output_names}; the engine is inconsistent. Rebuild it.")

    def deactivate(self) -> None:
        self.sessions.clear()  # caches keep their bindings to the old sessions: _binding rebinds them

    def new_cache(self, batch: int) -> KVCache:
        spec = self.manifest.target_spec
        return KVCache(spec.num_hidden_layers, batch, spec.num_key_value_heads, spec.head_dim, capacity=0,
                       dtype=TORCH[self.manifest.dtype])

    # -- calls -----------------------------------------------------------------------------------
    def infer(self, graph: str, feeds: Mapping[str, Any], cache: KVCache) -> dict[str, np.ndarray]:
        """Run one graph on ``cache``. ``feeds`` holds every other input (numpy arrays)."""
        session = self._session(graph)
        if self.manifest.attention == "gqa":
            _check_room(graph, feeds, cache)
        io = self._binding(graph, session, cache)
        keep, sizes = [], {}  # bound host arrays must outlive the run; the dynamic dims' sizes
        for t in self._host_inputs[graph]:
            array = np.ascontiguousarray(feeds[t.name], dtype=t.dtype)
            if array.ndim != len(t.dims) or array.shape[0] != cache.batch:
                raise EngineError(f"{graph}: input {t.name} has shape {array.shape}, expected dims {t.dims} "
                                  f"with batch {cache.batch}")
            sizes.update((d, n) for d, n in zip(t.dims, array.shape, strict=True) if isinstance(d, str))
            keep.append(array)
            io.bind_cpu_input(t.name, array)
        outputs = {}
        for t in self._host_outputs[graph]:  # rebinding a name replaces its binding: the cache's stay
            array = outputs[t.name] = np.empty(t.shape(sizes), t.dtype)
            io.bind_output(t.name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        started = time.perf_counter()
        try:
            session.run_with_iobinding(io)
        except Exception as exc:  # ORT's own error types (Fail, InvalidArgument, RuntimeException)
            raise EngineError(f"ONNX Runtime failed in the {graph} graph of {self.engine_dir}: {exc}") from exc
        cache.engine_seconds += time.perf_counter() - started
        del keep
        return outputs

    def _binding(self, graph: str, session: Any, cache: KVCache) -> Any:
        """The cache's IOBinding of ``graph``, its past_key.{i}/past_value.{i} inputs (and, attention
        "gqa", its present_key.{i}/present_value.{i} outputs: the op writes the buffer in place) bound
        to layer i's slice of the cache buffers (no copy); bound again when the cache grew (new buffers)."""
        target = (session, cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape))
        held = cache.bindings.get(graph)
        if held is not None and held[:4] == target:
            return held.io
        io = session.io_binding()
        spec = self.contract[graph]
        for t, bind in [(t, io.bind_input) for t in spec.inputs] + [(t, io.bind_output) for t in spec.outputs]:
            kv = kv_input(t.name) or present_output(t.name)
            if kv is not None:
                buf = _layer_buffer(cache, *kv)
                bind(t.name, "cpu", 0, self._kv_dtype, tuple(buf.shape), buf.data_ptr())
        cache.bindings[graph] = Binding(*target, io)
        return io

    @property
    def _kv_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_NAMES[self.manifest.dtype])


def run_in_place(session: Any, spec: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One run of a plain ``InferenceSession`` of graph ``spec`` (a ``GraphSpec``) on numpy feeds, as
    the runtime runs it: each ``present_*`` output (attention "gqa") bound to its ``past_*``
    array, which the call then updates in place. Returns the other outputs by name."""
    io = session.io_binding()
    for t in spec.inputs:
        array = feeds[t.name]
        if kv_input(t.name) is not None:
            if not array.flags.c_contiguous:
                raise ValueError(f"{t.name} must be C-contiguous: the call writes it in place")
            io.bind_input(t.name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        else:
            io.bind_cpu_input(t.name, np.ascontiguousarray(array))
    for t in spec.outputs:
        present = present_output(t.name)
        if present is None:
            io.bind_output(t.name, "cpu")
        else:
            array = feeds[f"past_{present[0]}.{present[1]}"]
            io.bind_output(t.name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
    session.run_with_iobinding(io)
    return {t.name: v.numpy() for t, v in zip(spec.outputs, io.get_outputs(), strict=True)
            if present_output(t.name) is None}


def _check_room(graph: str, feeds: Mapping[str, Any], cache: KVCache) -> None:
    """Attention "gqa" writes every row's T entries at past_len.. into the buffer: they must fit
    (callers reserve first; this is the guard that no overflow reaches the kernel)."""
    tokens = feeds["block"] if "block" in feeds else feeds["input_ids"]
    needed = int(np.max(feeds["past_len"])) + int(np.shape(tokens)[1])
    if needed > cache.capacity:
        raise EngineError(f"{graph}: a call writing up to slot {needed} of a KV cache of {cache.capacity} slots; "
                          "reserve room first (KVCache.reserve)")


def _layer_buffer(cache: KVCache, kind: str, layer: int) -> Any:
    """Layer ``layer``'s contiguous [B, kvH, cap, D] slice of the cache's K or V buffer."""
    return (cache.k if kind == "key" else cache.v)[layer]


class Binding(NamedTuple):
    """A cache's IOBinding of one graph and what its cache inputs were bound to."""

    session: Any
    k_ptr: int
    v_ptr: int
    shape: tuple[int, ...]  # [L, B, kvH, P, D]: every past_key.{i} / past_value.{i} is bound as [B, kvH, P, D]
    io: Any
