"""`dlite-trt build --backend tensorrt`: clear errors without TensorRT or a GPU, the optimization
profile from the I/O contract, and (where TensorRT and a GPU exist) a real build."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dlite_trt.cli import main
from dlite_trt.config import DraftConfig
from dlite_trt.engine.tensorrt_build import profile_shapes
from dlite_trt.export.contract import EngineLimits, cache_capacity_max, engine_contract
from dlite_trt.tiny_models import tiny_target_spec

FLOAT_KEYS, INT_KEYS = {"max_abs_diff", "mean_abs_diff"}, {"differing", "of"}


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_tensorrt() and torch.cuda.is_available(), reason="TensorRT and a GPU are here")
def test_without_tensorrt_or_a_gpu_the_build_stops_at_once(tiny_pair, tmp_path):
    result = CliRunner().invoke(main, ["build", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                       "--out", str(tmp_path / "engine"), "--backend", "tensorrt", "--quiet"])
    assert result.exit_code != 0
    assert "install dlite-trt[trt] on a machine with an NVIDIA GPU" in result.output
    assert not (tmp_path / "engine").exists() and list(tmp_path.iterdir()) == []  # nothing half-written


def test_bf16_is_tensorrt_only(tiny_pair, tmp_path):
    result = CliRunner().invoke(main, ["build", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                       "--out", str(tmp_path / "engine"), "--dtype", "bf16", "--quiet"])
    assert result.exit_code != 0 and "the onnxruntime backend builds ('fp32', 'fp16'), not 'bf16'" in result.output


def test_optimization_profile_covers_the_limits():
    spec = tiny_target_spec(512)
    cfg = DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=3, mask_token_id=3, block_size=8,
                                 anchor_group_size=4)
    limits = EngineLimits(max_batch=6, max_seq_len=300, max_chunk=64)
    contract = engine_contract(spec, cfg, limits, "fp32")
    step = profile_shapes(contract["step"])
    assert step["block"][0] == (1, 2) and step["block"][2] == (6, 8)  # the greedy step verifies 1..K drafts
    assert profile_shapes(contract["step_sampling"])["block"][0] == (1, 8)  # sampling: all K
    assert step["group_prefix"][2] == (6, 3)
    kv = step["past_key.0"]
    assert kv[0][0] == 1 and kv[2][0] == 6 and kv[2][2] == cache_capacity_max(limits, 8) >= 300 + 8
    decode = profile_shapes(contract["decode"])
    assert decode["input_ids"][2] == (6, 64) and decode["output_index"][2] == (6, 64)
    static = [t.name for t in contract["step"].inputs if all(isinstance(d, int) for d in t.dims)]
    assert not set(static) & set(step)  # static inputs need no profile


def assert_report_within(report: dict, contract: dict, graphs: tuple[str, ...], atol: float) -> None:
    """``compare_graphs``'s report covers exactly ``graphs`` and each graph's outputs, with the
    keys of its dtype: float outputs differ by less than ``atol``, integer outputs nowhere.
    A missing graph, output or key fails (it is never read as a zero difference)."""
    assert sorted(report) == sorted(graphs), sorted(report)
    for graph in graphs:
        spec = contract[graph]
        assert list(report[graph]) == spec.output_names, (graph, list(report[graph]))
        for t in spec.outputs:
            diff = report[graph][t.name]
            if t.dtype.startswith(("float", "bfloat")):
                assert set(diff) == FLOAT_KEYS, (graph, t.name, diff)
                assert diff["max_abs_diff"] < atol and diff["mean_abs_diff"] <= diff["max_abs_diff"], \
                    (graph, t.name, diff)
            else:
                assert set(diff) == INT_KEYS, (graph, t.name, diff)
                assert diff["differing"] == 0 and diff["of"] > 0, (graph, t.name, diff)


def test_the_report_check_fails_on_a_missing_key_output_or_difference():
    """What the TensorRT comparison below relies on, run here: the check passes a complete
    report within tolerance and fails on each way a report can hide a difference."""
    import copy

    import numpy as np

    from dlite_trt.runtime.compare import _difference

    spec = tiny_target_spec(64)
    cfg = DraftConfig.for_target(spec, num_hidden_layers=2, chs_num_layers=3, mask_token_id=3, block_size=4,
                                 anchor_group_size=2)
    contract = engine_contract(spec, cfg, EngineLimits(max_batch=2, max_seq_len=64, max_chunk=8), "fp32")
    graphs = ("prefill", "step", "decode")
    rng = np.random.default_rng(0)

    def value(t, noise):
        dims = tuple(d if isinstance(d, int) else 3 for d in t.dims)
        if t.dtype.startswith("float"):
            x = rng.standard_normal(dims).astype(t.dtype)
            return x, x + np.asarray(noise, x.dtype)
        x = rng.integers(0, 64, dims).astype(t.dtype)
        return x, x.copy()

    good = {g: {t.name: _difference(*value(t, 1e-5)) for t in contract[g].outputs} for g in graphs}
    assert_report_within(good, contract, graphs, atol=1e-3)
    float_out = next(t.name for t in contract["step"].outputs if t.dtype == "float32")
    int_out = next(t.name for t in contract["step"].outputs if t.dtype == "int64")
    broken = []
    for graph, name, key in (("step", float_out, "max_abs_diff"), ("step", int_out, "differing")):
        bad = copy.deepcopy(good)
        del bad[graph][name][key]  # a difference that was never measured
        broken.append(bad)
    bad = copy.deepcopy(good)
    del bad["decode"]["next_tokens"]  # an output that was never compared
    broken.append(bad)
    bad = copy.deepcopy(good)
    del bad["prefill"]  # a graph that was never compared
    broken.append(bad)
    bad = copy.deepcopy(good)
    bad["step"][int_out]["differing"] = 1  # one differing token
    broken.append(bad)
    bad = copy.deepcopy(good)
    bad["step"][float_out]["max_abs_diff"] = 1e-2  # past the tolerance
    broken.append(bad)
    for bad in broken:
        with pytest.raises(AssertionError):
            assert_report_within(bad, contract, graphs, atol=1e-3)


@pytest.mark.tensorrt
@pytest.mark.gpu
@pytest.mark.skipif(not (_has_tensorrt() and torch.cuda.is_available()), reason="needs TensorRT and an NVIDIA GPU")
def test_real_tensorrt_build(tiny_pair, tmp_path):
    import json

    result = CliRunner().invoke(main, ["build", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                                       "--out", str(tmp_path / "engine"), "--backend", "tensorrt", "--quiet",
                                       "--max-seq-len", "256", "--timing-cache", str(tmp_path / "cache.bin")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "engine/manifest.json").read_text())
    assert manifest["backend"] == "tensorrt" and manifest["build"]["plugin_version"] == "1"
    assert all((tmp_path / "engine" / g["runtime"]).stat().st_size > 0 for g in manifest["graphs"].values())
    assert (tmp_path / "cache.bin").stat().st_size > 0


@pytest.mark.skipif(_has_tensorrt() and torch.cuda.is_available(), reason="TensorRT and a GPU are here")
def test_a_tensorrt_engine_without_tensorrt_is_a_clear_error(tiny_pair, tmp_path):
    """An engine directory whose manifest says tensorrt (built elsewhere) refuses to open here."""
    import json

    from dlite_trt.engine.build import BuildSettings, build_engine

    engine = tmp_path / "engine"
    build_engine(*tiny_pair, engine, BuildSettings(limits=EngineLimits(max_batch=1, max_seq_len=64, max_chunk=16),
                                                   attention="ops", draft_weights="float"),  # as a TensorRT build
                 progress=False)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["backend"] = "tensorrt"
    (engine / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["generate", "--engine", str(engine), "--input-ids", "5,6,7"])
    assert result.exit_code != 0
    assert "install dlite-trt[trt] on a machine with an NVIDIA GPU" in result.output


@pytest.fixture(scope="module")
def trt_and_ort_engines(tiny_pair, tmp_path_factory):
    from dlite_trt.engine.build import BuildSettings, build_engine

    out = tmp_path_factory.mktemp("trt")
    limits = EngineLimits(max_batch=2, max_seq_len=128, max_chunk=32)
    for backend in ("onnxruntime", "tensorrt"):
        build_engine(*tiny_pair, out / backend, BuildSettings(backend=backend, limits=limits), progress=False)
    return out


@pytest.mark.tensorrt
@pytest.mark.gpu
@pytest.mark.skipif(not (_has_tensorrt() and torch.cuda.is_available()), reason="needs TensorRT and an NVIDIA GPU")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_tensorrt_engine_decodes_the_target_greedy_output(trt_and_ort_engines, tiny_pair, cuda_graphs):
    """The TensorRT runner behind the generator: transformers' greedy tokens exactly, the same
    graph outputs as ONNX Runtime on the same inputs, and (with CUDA graphs) replayed steps."""
    from helpers import hf_greedy

    from dlite_trt.runtime.compare import compare_graphs
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    trt_gen = open_engine(trt_and_ort_engines / "tensorrt", cuda_graphs=cuda_graphs)
    ort_gen = open_engine(trt_and_ort_engines / "onnxruntime")
    for prompt in ([5, 6, 7, 8, 9], [11, 12], list(range(20, 60))):
        got = trt_gen.generate([prompt], SamplingParams(max_new_tokens=24)).output_ids[0]
        assert got == hf_greedy(tiny_pair[0], prompt, 24)
    graphs = ("prefill", "step", "decode")
    report = compare_graphs(ort_gen, trt_gen, graphs=graphs)
    assert_report_within(report, ort_gen.manifest.contract, graphs, atol=1e-3)
    if cuda_graphs:
        assert trt_gen.runner.graphs.replays > 0 and not trt_gen.runner.graphs.failed


@pytest.mark.tensorrt
@pytest.mark.gpu
@pytest.mark.skipif(not (_has_tensorrt() and torch.cuda.is_available()), reason="needs TensorRT and an NVIDIA GPU")
def test_generate_cli_with_a_tensorrt_engine(trt_and_ort_engines):
    import json

    args = ["generate", "--input-ids", "5,6,7,8", "--max-new-tokens", "16", "--json"]
    outputs = [CliRunner().invoke(main, [*args, "--engine", str(trt_and_ort_engines / b)])
               for b in ("tensorrt", "onnxruntime")]
    assert all(r.exit_code == 0 for r in outputs), [r.output for r in outputs]
    trt, ort = (json.loads(r.output.strip().splitlines()[-1]) for r in outputs)
    assert trt["output_ids"] == ort["output_ids"] and trt["acceptance_lengths"] == ort["acceptance_lengths"]
