"""``runtime.compare``: two engine directories on the same inputs (what gpu_check runs for a
TensorRT engine against ONNX Runtime), here with two real ONNX Runtime builds: fp32 and fp16."""

from __future__ import annotations

import dataclasses

import pytest

from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.errors import EngineError
from dlite_trt.export.contract import GRAPH_NAMES, EngineLimits, present_output
from dlite_trt.runtime.compare import compare_generation, compare_graphs
from dlite_trt.runtime.engine import open_engine

FLOAT_KEYS, INT_KEYS = {"max_abs_diff", "mean_abs_diff"}, {"differing", "of"}
LIMITS = EngineLimits(max_batch=2, max_seq_len=96, max_chunk=16)


@pytest.fixture(scope="module")
def engines(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    for dtype in ("fp32", "fp16"):  # fp32 attends through GroupQueryAttention (its default), fp16 through ops
        build_engine(*tiny_pair, out / dtype, BuildSettings(dtype=dtype, limits=LIMITS), progress=False)
    # fp32 over the standard ops too: its graphs return the call's keys (new_key), as fp16's and TensorRT's do
    build_engine(*tiny_pair, out / "fp32-ops", BuildSettings(attention="ops", limits=LIMITS), progress=False)
    return out


def test_an_engine_against_itself_differs_nowhere(engines):
    a, b = open_engine(engines / "fp32", preload=()), open_engine(engines / "fp32", preload=())
    report = compare_graphs(a, b)
    assert sorted(report) == sorted(GRAPH_NAMES)
    for graph, outputs in report.items():
        spec = a.manifest.contract[graph]
        # every output compared but the cache buffers written in place (attention "gqa"), none dropped
        assert list(outputs) == [n for n in spec.output_names if present_output(n) is None], graph
        for t in (t for t in spec.outputs if t.name in outputs):
            diff = outputs[t.name]
            if t.dtype.startswith(("float", "bfloat")):
                assert set(diff) == FLOAT_KEYS, (graph, t.name, diff)
                assert diff["max_abs_diff"] == 0.0 and diff["mean_abs_diff"] == 0.0, (graph, t.name, diff)
            else:
                assert set(diff) == INT_KEYS, (graph, t.name, diff)
                assert diff["differing"] == 0 and diff["of"] > 0, (graph, t.name, diff)
    generation = compare_generation(a, b, [[5, 6, 7, 8], [9, 10]], max_new_tokens=12)
    assert generation == {"prompts": 2, "identical": 2, "first_difference": None}


def test_fp16_against_fp32_differs_by_rounding(engines):
    a, b = open_engine(engines / "fp32-ops", preload=()), open_engine(engines / "fp16", preload=())
    report = compare_graphs(a, b, graphs=("decode", "prefill"))
    for graph in ("decode", "prefill"):
        kv = report[graph]["new_key"]
        assert 0.0 < kv["max_abs_diff"] < 0.05, (graph, kv)  # fp16 rounding of the keys, no more
    assert report["decode"]["next_tokens"]["of"] == 2 * 8
    pivot = report["prefill"]["pivot_hidden"]
    assert 0.0 < pivot["mean_abs_diff"] <= pivot["max_abs_diff"]


def test_the_random_cache_reaches_the_graphs(engines):
    """The comparison's KV cache is part of its inputs: other cache contents give other outputs
    (so two engines that read their cache differently cannot compare equal)."""
    import numpy as np

    from dlite_trt.export.contract import dummy_inputs, kv_input
    from dlite_trt.runtime.compare import _run, graph_sizes

    gen = open_engine(engines / "fp32-ops", preload=())
    sizes = graph_sizes(gen, gen)
    feeds = dummy_inputs(gen.manifest.contract["prefill"], sizes, vocab_size=gen.manifest.target_spec.vocab_size,
                         rng=np.random.default_rng(0))
    assert feeds["past_len"].max() > 0  # a row attends to cached entries
    other = {n: (2.0 * v if kv_input(n) else v) for n, v in feeds.items()}
    first, second = _run(gen, "prefill", feeds, sizes), _run(gen, "prefill", other, sizes)
    assert np.array_equal(first["new_key"][0], second["new_key"][0])  # layer 0's keys: the tokens alone
    assert not np.allclose(first["pivot_hidden"], second["pivot_hidden"])  # attention read the cache


def test_engines_of_different_models_are_refused(engines):
    a, b = open_engine(engines / "fp32", preload=()), open_engine(engines / "fp16", preload=())
    b.manifest = dataclasses.replace(b.manifest, draft_sha256="0" * 64)
    with pytest.raises(EngineError, match="built from different models"):
        compare_graphs(a, b)
