"""`dlite-trt bench` end to end on a tiny engine: every method side by side, the JSON report
(checked against its schema), the plots, the workloads and request records; and bad input."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from dlite_trt.bench.report import MIN_ROUNDS
from dlite_trt.bench.suite import default_workloads
from dlite_trt.bench.workloads import read_jsonl
from dlite_trt.cli import main
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.export.contract import EngineLimits

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "engine"
    build_engine(*tiny_pair, out, BuildSettings(limits=EngineLimits(max_batch=4, max_seq_len=8192, max_chunk=256)),
                 progress=False)
    return out


@pytest.fixture(scope="module")
def run(engine, tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-run")
    dataset = tmp / "mine.jsonl"
    dataset.write_text(json.dumps({"task_id": "mt", "input_ids": list(range(20, 60)), "output_tokens": 12,
                                   "turns": [{"input_ids": [7, 8, 9] * 5, "output_tokens": 10},
                                             {"prompt": "def main():\n", "output_tokens": 9}]}) + "\n")
    out = tmp / "out"
    result = CliRunner().invoke(main, [
        "bench", "--engine", str(engine), "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
        "--out", str(out), "--quick", "--workloads", "chat,agentic", "--dataset", str(dataset),
        "--methods", "ar,dlite,ngram,reference", "--batch-sizes", "1,2,8", "--contexts", "64,512", "--threads", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    return out, result, json.loads((out / "bench.json").read_text())


def test_report_matches_its_schema(run):
    _, _, report = run
    schema = json.loads(resources.files("dlite_trt.bench").joinpath("report.schema.json").read_text())
    jsonschema.validate(report, schema)
    assert set(report["workloads"]) == {"chat", "agentic", "mine"}
    assert report["settings"]["quick"] is True
    # --quick's generated agentic workload has enough tasks for its goals to be judged
    assert report["goals"]["agentic"]["noise"]["dlite"]["rounds"] >= MIN_ROUNDS
    assert report["machine"]["threads"] >= 1  # one count for every method


def test_every_method_is_lossless_and_measured(run):
    _, _, report = run
    for name, w in report["workloads"].items():
        methods = w["methods"]
        assert list(methods) == ["ar", "dlite", "ngram", "reference"]
        for method, s in methods.items():
            assert s["lossless"] == {"checked": s["requests"], "mismatches": 0, "first": [], "expected_identical": True,
                                     "divergence_index": {}}, (name, method)
            assert s["output_tokens"] == methods["ar"]["output_tokens"]  # EOS ignored: same lengths
        assert methods["ar"]["mean_acceptance_length"] == 1.0 and methods["ar"]["speedup_over_ar"] == 1.0
        assert methods["ar"]["draft_tokens_proposed"] == 0
        # the engine and the reference run the same draft: identical acceptance
        assert methods["dlite"]["acceptance_histogram"] == methods["reference"]["acceptance_histogram"]
        assert methods["dlite"]["draft_context_tokens"] == 0  # history-free
        assert methods["ngram"]["draft_context_tokens"] > 0  # it indexes every prompt and turn
        assert methods["dlite"]["draft_share"] is not None
    mine = report["workloads"]["mine"]
    assert mine["requests"] == 3 and mine["methods"]["ar"]["output_tokens"] == 12 + 10 + 9


def test_sweep_and_context_cost(run):
    _, result, report = run
    assert list(report["batch_sweep"]) == ["1", "2"] and report["batch_sweep_skipped"] == [8]  # max batch 4
    assert set(report["batch_sweep"]["2"]) == {"ar", "dlite", "ngram"}
    cost = report["context_cost"]
    assert cost["contexts"] == [64, 512] and cost["skipped"] == []
    assert set(cost["step_profile"]) == {"64", "512"}
    assert all(row["draft_ms"] > 0 and row["target_ms"] > 0 for row in cost["step_profile"].values())
    assert "draft_time_flat" in report["goals"]
    assert "output tokens/s" in result.output and "batch sweep" in result.output


def test_a_report_without_a_kernel_profile(run, tmp_path):
    """A TensorRT engine's report has no ONNX Runtime kernel profile: the tables and plots still
    render, and say why the kernel columns are empty."""
    import copy
    import io

    from rich.console import Console

    from dlite_trt.bench.report import goals, print_tables, write_plots

    report = copy.deepcopy(run[2])
    del report["context_cost"]["step_profile"]
    report["context_cost"]["step_profile_skipped"] = "this is a tensorrt engine"
    report["goals"] = goals(report)
    assert "draft_time_flat" not in report["goals"]
    buffer = io.StringIO()
    print_tables(report, Console(file=buffer, width=200))
    assert "kernels not profiled: this is a tensorrt engine" in buffer.getvalue()
    assert [p.name for p in write_plots(report, tmp_path)] == ["speedup.png", "acceptance.png", "context_cost.png"]


def test_plots_workloads_and_records_are_written(run, tiny_pair):
    out, _, report = run
    for name in ("speedup.png", "acceptance.png", "context_cost.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    generated = default_workloads(("chat", "agentic"), tok, seed=0, quick=True)
    for name, tasks in generated.items():
        assert read_jsonl(out / "workloads" / f"{name}.jsonl") == tasks  # what ran, re-readable
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * sum(w["requests"] for w in report["workloads"].values())
    assert {"ttft_s", "total_s", "step_tokens", "draft_context_tokens"} <= set(lines[0])


def _bench(*args: str):
    return CliRunner().invoke(main, ["bench", *args])


def test_a_prompt_longer_than_the_engine_allows(engine, tmp_path):
    dataset = tmp_path / "long.jsonl"
    dataset.write_text(json.dumps({"task_id": "too-long", "input_ids": [5] * 8000, "output_tokens": 300}) + "\n")
    result = _bench("--engine", str(engine), "--workloads", "", "--dataset", str(dataset), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0
    assert "too-long" in result.output and "--max-seq-len 8192" in result.output and "8300" in result.output
    assert not (tmp_path / "o" / "bench.json").exists()


def test_malformed_dataset_and_options(engine, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x", "prompt": "a", "output_tokens": 0}\n')
    result = _bench("--engine", str(engine), "--workloads", "", "--dataset", str(bad), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "bad.jsonl:1" in result.output and "output_tokens" in result.output
    result = _bench("--engine", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert result.exit_code == 1 and "not an engine directory" in result.output  # as in every command
    result = _bench("--engine", str(engine), "--methods", "ar,eagle")
    assert result.exit_code == 2 and "eagle" in result.output
    result = _bench("--engine", str(engine), "--batch-sizes", "1,x")
    assert result.exit_code == 2 and "--batch-sizes" in result.output
    result = _bench("--engine", str(engine), "--target", "somewhere")
    assert result.exit_code == 2 and "--draft" in result.output


@pytest.mark.parametrize("methods", ["ar,ngram", "reference"])
def test_any_subset_of_methods(engine, tiny_pair, tmp_path, methods):
    """Without DLite or without target-only decoding the report still completes, with what applies."""
    out = tmp_path / "o"
    result = _bench("--engine", str(engine), "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                    "--out", str(out), "--quick", "--workloads", "chat", "--methods", methods,
                    "--batch-sizes", "1", "--contexts", "64")
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "bench.json").read_text())
    jsonschema.validate(report, json.loads(resources.files("dlite_trt.bench").joinpath("report.schema.json")
                                           .read_text()))
    assert list(report["workloads"]["chat"]["methods"]) == methods.split(",")
    assert (out / "speedup.png").is_file()
    if methods == "reference":  # nothing runs on the engine: no sweep; nothing to compare tokens with
        assert "batch_sweep" not in report and report["batch_sweep_skipped"] == [1]
        assert report["workloads"]["chat"]["methods"]["reference"]["lossless"]["mismatches"] is None


def test_dataset_name_clash_and_ngram_sizes(engine, tmp_path):
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text('{"task_id": "x", "input_ids": [1, 2, 3], "output_tokens": 4}\n')
    result = _bench("--engine", str(engine), "--workloads", "chat", "--dataset", str(dataset), "--out", str(tmp_path))
    assert result.exit_code != 0 and "two workloads are named 'chat'" in result.output
    result = _bench("--engine", str(engine), "--ngram-min", "4", "--ngram-max", "3")
    assert result.exit_code == 2 and "--ngram-min 4 is above --ngram-max 3" in result.output


def test_step_profile_at_the_longest_context_the_engine_allows(engine):
    """The kernel profile's cache stays within the engine's largest (its max_seq_len plus a
    block): the bench measures contexts up to max_seq_len - steps - 2 blocks."""
    from dlite_trt.bench.context_cost import step_profile

    longest = 8192 - 2 * 8 - 16  # as the bench's longest: max_seq_len - steps - 2 blocks (here 16 steps)
    rows = step_profile(engine, [longest], runs=2)
    assert rows[str(longest)]["runs"] == 2 and rows[str(longest)]["target_ms"] > 0
