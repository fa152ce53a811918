"""Feeds for ``polygraphy run <graph>.onnx --data-loader-script tests/polygraphy_data.py``.

Polygraphy's default loader fills every dynamic dim with 1 and draws token ids and lengths
at random, which can be out of range (token >= vocab, past_len past the cache). Here the
feeds come from the contract's own ``dummy_inputs`` instead: the test writes a JSON file
(``write_request``) and points ``DLITE_POLYGRAPHY_REQUEST`` at it; ``load_data`` yields one
feed per requested size set. The test builds its eager reference from ``feeds`` so both
sides see the same arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from dlite_trt.export.contract import GraphSpec, dummy_inputs

ENV_VAR = "DLITE_POLYGRAPHY_REQUEST"


def write_request(path: Path, graph: GraphSpec, cases: Sequence[Mapping[str, int]], *, vocab_size: int,
                  seed: int) -> Path:
    """Save what ``load_data`` needs: the graph's contract, the dim sizes per iteration, vocab, seed."""
    path.write_text(json.dumps({"graph": graph.name, "contract": graph.to_dict(), "cases": [dict(c) for c in cases],
                                "vocab_size": vocab_size, "seed": seed}, indent=1))
    return path


def feeds(request_path: str | Path) -> list[dict[str, np.ndarray]]:
    """One feed per case, deterministic for a given request file."""
    req = json.loads(Path(request_path).read_text())
    graph = GraphSpec.from_dict(req["graph"], req["contract"])
    rng = np.random.default_rng(req["seed"])
    return [dummy_inputs(graph, sizes, vocab_size=req["vocab_size"], rng=rng) for sizes in req["cases"]]


def load_data() -> Iterator[dict[str, np.ndarray]]:
    path = os.environ.get(ENV_VAR)
    if not path:
        raise RuntimeError(f"{ENV_VAR} is not set: point it at a request written by write_request()")
    yield from feeds(path)
