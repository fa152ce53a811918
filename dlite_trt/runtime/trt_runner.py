"""Runs an engine directory's TensorRT plans, behind the same interface as ``OrtRunner``:
``activate()`` / ``deactivate()``, ``new_cache(batch)``, ``infer(graph, feeds, cache)`` -> outputs.

Buffers live on the GPU: the KV cache is one preallocated torch CUDA buffer per K and V (as on
the CPU), each ``past_key.{i}`` input is bound to layer i's slice by address (no copy), and the
runtime stores only the accepted entries (O(block) per step). Host inputs (numpy) are copied to
the GPU; outputs come back as CUDA tensors, so ``next_block`` and ``next_draft_logits`` feed the
next step without a host round trip, and the generator reads the few small ones it needs.

The step (and decode) calls repeat with the same shapes and cache buffers from one call to the
next, so they run as CUDA graphs (``runtime.cuda_graphs.CallGraphs``): eager on a new key,
captured on its second call, replayed after that; ``cuda_graphs=False`` turns this off. Calls run
on the runner's own stream, ordered after the caller's work and synchronized before returning.

Threads: an execution context (one per graph) holds its bound shapes and addresses, and the
CUDA graphs are the runner's, so calls from several threads run one at a time (a lock);
sessions on other threads wait their turn instead of running on each other's bindings.

Written against the TensorRT 10 Python API; it has never run (no TensorRT or GPU where it was
written).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlite_trt.dtypes import TORCH
from dlite_trt.engine.manifest import Manifest
from dlite_trt.errors import EngineError
from dlite_trt.export.contract import kv_input
from dlite_trt.runtime.cuda_graphs import CallGraphs
from dlite_trt.runtime.kv_cache import KVCache
from dlite_trt.runtime.runner import RunnerBase

TENSOR_ALIGNMENT = 256  # bytes: IExecutionContext.set_tensor_address takes addresses aligned to this
GRAPHED_CALLS = frozenset({"step", "step_sampling", "decode", "decode_sampling"})  # calls that repeat with the same shapes


class TrtRunner(RunnerBase):
    def __init__(self, engine_dir: Path, manifest: Manifest, *, cuda_graphs: bool = True) -> None:
        if manifest.backend != "tensorrt":
            raise EngineError(f"{engine_dir} is a {manifest.backend} engine, not a TensorRT one.")
        from dlite_trt.engine.tensorrt_build import require_tensorrt

        require_tensorrt()
        self.engine_dir = Path(engine_dir)
        self.manifest = manifest
        self.contract = manifest.contract
        self.engines: dict[str, Any] = {}
        self.contexts: dict[str, Any] = {}
        self._calls = threading.Lock()  # one call at a time: contexts and CUDA graphs are shared
        self.graphs = CallGraphs() if cuda_graphs else None
        self._stream: Any = None  # the runner's own CUDA stream (not the legacy default stream)

    def _load(self, name: str) -> Any:
        return self._context(name)

    def loaded(self, graph: str) -> bool:
        return graph in self.contexts

    def deactivate(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        self.contexts.clear()
        self.engines.clear()

    def _context(self, name: str) -> Any:
        if name in self.contexts:
            return self.contexts[name]
        import tensorrt as trt

        from plugins.lowrank_recurrence.trt_plugin import register

        register()  # the plugin's creator must exist before a plan that uses it is deserialized
        path = self.engine_dir / self.manifest.graphs[name]["runtime"]
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineError(f"TensorRT cannot load {path}: built by another TensorRT version or for another GPU? "
                              "Rebuild it with `dlite-trt build --backend tensorrt` on this machine.")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        spec = self.contract[name]
        if sorted(names) != sorted(spec.input_names + spec.output_names):
            raise EngineError(f"{path} has tensors {names}, the manifest's contract {spec.input_names} -> "
                              f"{spec.output_names}; the engine is inconsistent. Rebuild it.")
        self.engines[name] = engine
        self.contexts[name] = engine.create_execution_context()
        return self.contexts[name]

    def new_cache(self, batch: int) -> KVCache:
        spec = self.manifest.target_spec
        return KVCache(spec.num_hidden_layers, batch, spec.num_key_value_heads, spec.head_dim, capacity=0,
                       dtype=TORCH[self.manifest.dtype], device="cuda", layer_align=TENSOR_ALIGNMENT)

    def infer(self, graph: str, feeds: Mapping[str, Any], cache: KVCache) -> dict[str, Any]:
        with self._calls:
            return self._infer(graph, feeds, cache)

    def _infer(self, graph: str, feeds: Mapping[str, Any], cache: KVCache) -> dict[str, Any]:
        import numpy as np
        import torch

        context = self._context(graph)
        engine = self.engines[graph]
        spec = self.contract[graph]
        inputs = {}  # every input but the cache's, on the GPU
        for t in spec.inputs:
            if kv_input(t.name) is None:
                value = feeds[t.name]
                if isinstance(value, np.ndarray):
                    value = torch.from_numpy(np.ascontiguousarray(value, dtype=t.dtype))
                value = value.to("cuda", dtype=getattr(torch, t.dtype)).contiguous()
                if value.data_ptr() % TENSOR_ALIGNMENT:  # a view into a larger buffer
                    value = value.clone()
                inputs[t.name] = value

        def bind(values: Mapping[str, Any]) -> dict[str, Any]:
            for t in spec.inputs:
                kv = kv_input(t.name)
                value = values[t.name] if kv is None else (cache.k if kv[0] == "key" else cache.v)[kv[1]]
                shape = tuple(value.shape)  # the cache: [B, kvH, cap, D], in place
                if not context.set_input_shape(t.name, shape):
                    lo, _, hi = spec.profile(t.name)
                    raise EngineError(f"{graph}: TensorRT refused {t.name} of shape {shape} (the engine takes "
                                      f"{lo} to {hi}; a batch or length past the build's limits?)")
                if not context.set_tensor_address(t.name, value.data_ptr()):
                    raise EngineError(f"{graph}: TensorRT refused the address of {t.name} "
                                      f"({value.data_ptr():#x}; it needs {TENSOR_ALIGNMENT}-byte alignment)")
            outputs = {}
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                if engine.get_tensor_mode(name) == _trt().TensorIOMode.OUTPUT:
                    outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), device="cuda",
                                                dtype=_torch_dtype(engine.get_tensor_dtype(name)))
                    context.set_tensor_address(name, outputs[name].data_ptr())
            return outputs

        def execute() -> None:
            if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
                raise EngineError(f"TensorRT failed to run the {graph} graph of {self.engine_dir}.")

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        started = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream())  # the inputs' copies
        with torch.cuda.stream(self._stream):
            if self.graphs is not None and graph in GRAPHED_CALLS:
                key = (tuple((n, tuple(v.shape), v.dtype) for n, v in inputs.items()),
                       *((buf.data_ptr(), tuple(buf.shape), buf.stride(), buf.dtype) for buf in (cache.k, cache.v)))
                outputs = self.graphs.run(graph, key, inputs, bind, execute)
            else:
                outputs = bind(inputs)
                execute()
        self._stream.synchronize()  # the caller reads the outputs on any stream
        cache.engine_seconds += time.perf_counter() - started
        return {t.name: outputs[t.name] for t in spec.outputs}


def _trt() -> Any:
    import tensorrt as trt

    return trt


def _torch_dtype(trt_dtype: Any) -> Any:
    import torch

    trt = _trt()
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
    return table[trt_dtype]
