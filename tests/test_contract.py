"""The engine I/O contract: derived ranges, TensorRT profiles, serialization, dummy inputs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import draft_config, make_target

from dlite_trt.errors import ConfigError
from dlite_trt.export.contract import (
    GRAPH_NAMES,
    EngineLimits,
    GraphSpec,
    cache_capacity_max,
    dummy_inputs,
    engine_contract,
)


@pytest.fixture(scope="module")
def contract():
    _, spec = make_target(64)
    cfg = draft_config(spec, block_size=8, anchor_group_size=2)
    return spec, cfg, engine_contract(spec, cfg, EngineLimits(max_batch=6, max_seq_len=300, max_chunk=64))


def test_graphs_and_dims_follow_the_limits(contract):
    spec, cfg, graphs = contract
    assert tuple(graphs) == GRAPH_NAMES
    step = graphs["step"]
    assert (step.dim("batch").min, step.dim("batch").max) == (1, 6)
    assert step.dim("cache").max == cache_capacity_max(EngineLimits(6, 300, 64), 8) == 308
    assert graphs["prefill"].dim("chunk").max == 64
    kv = (spec.num_key_value_heads, spec.head_dim)
    assert step.profile("past_key.0") == ((1, kv[0], 1, kv[1]), (4, kv[0], 308, kv[1]), (6, kv[0], 308, kv[1]))
    assert step.profile("block") == ((1, 2), (4, 8), (6, 8))  # a greedy step verifies 1..K drafts
    assert step.dynamic_axes()["block"] == {0: "batch", 1: "verify"} == step.dynamic_axes()["emitted"]
    assert graphs["step_sampling"].profile("block") == ((1, 8), (4, 8), (6, 8))  # sampling: all K
    assert step.dynamic_axes()["past_value.3"] == {0: "batch", 2: "cache"}
    # greedy graphs take no random numbers and return no draft logits; sampling ones do
    assert "temperature" not in step.input_names and "next_draft_logits" not in step.output_names
    assert {"temperature", "draft_logits", "u_accept"} <= set(graphs["step_sampling"].input_names)


def test_round_trip(contract):
    _, _, graphs = contract
    for name, graph in graphs.items():
        assert GraphSpec.from_dict(name, graph.to_dict()) == graph


def test_dummy_inputs_are_valid(contract):
    _, _, graphs = contract
    rng = np.random.default_rng(0)
    feed = dummy_inputs(graphs["prefill"], {"batch": 3, "chunk": 10, "cache": 40}, vocab_size=64, rng=rng)
    assert feed["input_ids"].max() < 64 and feed["input_ids"].dtype == np.int64
    assert (feed["past_len"] + 10 <= 40).all() and (feed["chunk_len"] >= 1).all()
    step = dummy_inputs(graphs["step_sampling"], {"batch": 2, "cache": 20}, vocab_size=64, rng=rng)
    assert (step["past_len"] + 8 <= 20).all() and ((0 <= step["u_accept"]) & (step["u_accept"] < 1)).all()
    with pytest.raises(ConfigError, match="outside"):
        dummy_inputs(graphs["step"], {"batch": 7, "cache": 20}, vocab_size=64, rng=rng)


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="max_batch"):
        EngineLimits(max_batch=0)
    _, spec = make_target(64)
    with pytest.raises(ConfigError, match="dtype"):
        engine_contract(spec, draft_config(spec), EngineLimits(), "int8")
