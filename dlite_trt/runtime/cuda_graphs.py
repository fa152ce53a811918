"""CUDA graphs for engine calls that repeat with the same shapes (the TensorRT runner's step).

Consecutive speculative steps of a session are the same engine call: the same input shapes and
the same KV cache addresses, until the cache grows or another session's cache is bound. For such
a call ``CallGraphs`` runs eagerly the first time it sees a key (TensorRT needs one enqueue after
a shape change before a capture), runs on static buffers and captures the second time, and
replays the graph from then on. A replay copies the feeds into the graph's static inputs and the
results out of its static outputs, so a caller may keep a step's outputs while the next step runs
(the generator reads the previous block after the next call). A key that changes drops the graph.

One graph per call (per TensorRT execution context), not one per key: TensorRT applies
shape-dependent updates on the first enqueue after a shape change, outside any graph, so a
graph stays valid only while its context keeps the shapes it was captured with; any other key
runs eagerly on that context and drops the graph.

Where a capture fails (an engine TensorRT cannot capture, such as one with data-dependent
shapes), the graph runs eagerly from then on and the reason is kept in ``failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dlite_trt.errors import EngineError

log = logging.getLogger(__name__)


def capture_cuda_graph(execute: Callable[[], None]) -> Any:
    """Record ``execute`` (enqueued on the current stream) into a replayable ``torch.cuda.CUDAGraph``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        execute()
    return graph


@dataclass
class _Captured:
    key: Hashable
    inputs: dict[str, torch.Tensor]  # the graph reads these
    outputs: dict[str, torch.Tensor]  # and writes these
    graph: Any


class CallGraphs:
    """Per named call: eager on a new key, captured on its second call, replayed after that."""

    def __init__(self, capture: Callable[[Callable[[], None]], Any] = capture_cuda_graph) -> None:
        self._capture = capture
        self._seen: dict[str, Hashable] = {}
        self._graphs: dict[str, _Captured] = {}
        self.failed: dict[str, str] = {}  # call name -> why its capture failed (it then runs eagerly)
        self.captures = 0
        self.replays = 0

    def run(self, name: str, key: Hashable, feeds: Mapping[str, torch.Tensor],
            bind: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
            execute: Callable[[], None]) -> dict[str, torch.Tensor]:
        """One call. ``key`` identifies everything a graph bakes in besides ``feeds`` (their
        shapes, the addresses of buffers bound in place); ``bind(inputs)`` points the call at
        ``inputs``, allocates and binds its outputs and returns them; ``execute()`` enqueues the
        call on the current stream."""
        captured = self._graphs.get(name)
        if captured is not None and captured.key == key:
            for n, value in feeds.items():
                captured.inputs[n].copy_(value, non_blocking=True)
            captured.graph.replay()
            self.replays += 1
            return _copies(captured.outputs)
        if name in self.failed or self._seen.get(name) != key:
            self._graphs.pop(name, None)
            self._seen[name] = key
            outputs = bind(feeds)
            execute()
            return outputs
        inputs = {n: value.clone() for n, value in feeds.items()}  # the graph's static inputs
        outputs = bind(inputs)
        execute()
        result = _copies(outputs)
        try:
            graph = self._capture(execute)
        except (RuntimeError, EngineError) as exc:  # torch's CUDA capture errors; a failed enqueue
            self.failed[name] = str(exc)
            log.warning("capturing the %s call in a CUDA graph failed (%s); it runs without one", name, exc)
            return result
        self._graphs[name] = _Captured(key, inputs, outputs, graph)
        self.captures += 1
        return result

    def clear(self) -> None:
        self._seen.clear()
        self._graphs.clear()
        self.failed.clear()


def _copies(outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in outputs.items()}
