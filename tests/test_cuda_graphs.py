"""``runtime.cuda_graphs.CallGraphs``, the TensorRT runner's capture-and-replay policy, on the CPU.

CUDA graphs need a GPU; here the capture is a stand-in that does what a CUDA graph does to a
call: it bakes in the buffers the call was bound to at capture time and re-runs the call on
them. The call itself is a real computation on bound tensors (a toy engine). What is checked is
the policy: when to run eagerly, capture and replay, that feeds reach the graph's static
inputs, that outputs stay valid after later calls, and what a failed capture does.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from dlite_trt.runtime.cuda_graphs import CallGraphs


class ToyEngine:
    """y = 2 x + sum(cache), through bound buffers like a TensorRT execution context."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.bound: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.executions = 0

    def bind(self, values):
        self.bound = dict(values)
        self.outputs = {"y": torch.empty_like(values["x"])}
        return self.outputs

    def execute(self):
        self.executions += 1
        self.outputs["y"].copy_(2 * self.bound["x"] + self.cache.sum())

    def capture(self, execute):
        """The stand-in for a CUDA graph: replays ``execute`` on the buffers bound now."""
        bound, outputs = self.bound, self.outputs

        def replay():
            now = self.bound, self.outputs
            self.bound, self.outputs = bound, outputs
            try:
                execute()
            finally:
                self.bound, self.outputs = now

        return SimpleNamespace(replay=replay)


def _call(graphs, engine, x, key=("x", (3,))):
    return graphs.run("step", key, {"x": x}, engine.bind, engine.execute)["y"]


def test_a_repeated_call_runs_eagerly_then_is_captured_then_replayed():
    engine = ToyEngine(torch.ones(4))
    graphs = CallGraphs(capture=engine.capture)
    for i in range(5):
        x = torch.tensor([1.0, 2.0, 3.0]) * (i + 1)
        assert torch.equal(_call(graphs, engine, x), 2 * x + 4)
    assert (graphs.captures, graphs.replays) == (1, 3)  # call 1 eager, call 2 run + captured, calls 3-5 replayed


def test_outputs_stay_valid_after_later_calls():
    """The generator reads a step's block after the next step ran: a replay must not overwrite it."""
    engine = ToyEngine(torch.zeros(2))
    graphs = CallGraphs(capture=engine.capture)
    kept = [_call(graphs, engine, torch.full((3,), float(i))) for i in range(5)]
    assert [t.tolist() for t in kept] == [[2.0 * i] * 3 for i in range(5)]


def test_feeds_are_copied_into_the_graph_and_not_aliased():
    engine = ToyEngine(torch.zeros(2))
    graphs = CallGraphs(capture=engine.capture)
    x = torch.ones(3)
    _call(graphs, engine, x)
    _call(graphs, engine, x)  # captured on a copy of x
    x.fill_(5.0)  # the caller reuses its array: the graph must not see it
    assert _call(graphs, engine, torch.full((3,), 7.0)).tolist() == [14.0] * 3
    assert graphs.replays == 1
    assert x.tolist() == [5.0] * 3  # and a replay must not write into the caller's tensor


def test_a_new_key_drops_the_graph_and_runs_eagerly():
    """A grown cache (new addresses, new capacity) or another session's cache is a new key."""
    engine = ToyEngine(torch.ones(2))
    graphs = CallGraphs(capture=engine.capture)
    x = torch.ones(3)
    for _ in range(3):
        _call(graphs, engine, x, key="cache A")
    assert (graphs.captures, graphs.replays) == (1, 1)
    engine.cache = torch.ones(8)  # what the key stands for: the call reads other buffers now
    assert _call(graphs, engine, x, key="cache B").tolist() == [10.0] * 3
    assert (graphs.captures, graphs.replays) == (1, 1)  # eager: the old graph is gone
    assert _call(graphs, engine, x, key="cache B").tolist() == [10.0] * 3
    assert _call(graphs, engine, x, key="cache B").tolist() == [10.0] * 3
    assert (graphs.captures, graphs.replays) == (2, 2)
    engine.cache = torch.ones(2)
    assert _call(graphs, engine, x, key="cache A").tolist() == [4.0] * 3  # A's graph was dropped: eager
    assert graphs.replays == 2


def test_a_failed_capture_leaves_the_call_eager(caplog):
    engine = ToyEngine(torch.zeros(1))

    def cannot_capture(execute):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = CallGraphs(capture=cannot_capture)
    with caplog.at_level(logging.WARNING):
        results = [_call(graphs, engine, torch.full((3,), float(i))).tolist() for i in range(4)]
    assert results == [[2.0 * i] * 3 for i in range(4)]
    assert "not permitted" in graphs.failed["step"] and graphs.captures == graphs.replays == 0
    assert "runs without one" in caplog.text
    assert engine.executions == 4  # no call ran twice after the failure


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_real_cuda_graph_capture_and_replay():
    """The real capture: a torch computation on static buffers, captured and replayed."""
    x_static = torch.zeros(3, device="cuda")
    cache = torch.ones(4, device="cuda")
    state = {}

    def bind(values):
        state["x"] = values["x"]
        state["y"] = torch.empty_like(values["x"])
        return {"y": state["y"]}

    def execute():
        torch.mul(state["x"], 2, out=state["y"])
        state["y"].add_(cache.sum())

    graphs = CallGraphs()
    for i in range(4):
        x = x_static + i
        got = graphs.run("step", "k", {"x": x}, bind, execute)["y"]
        assert torch.equal(got, 2 * x + 4)
    assert (graphs.captures, graphs.replays) == (1, 2)
