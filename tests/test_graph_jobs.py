"""Graph jobs run in forked workers where that is safe: results in order, errors raised in the caller."""

from __future__ import annotations

import os

import pytest

from dlite_trt.engine.graph_jobs import PARALLEL_MAX_WEIGHT_BYTES, run_jobs, workers_for
from dlite_trt.errors import ConfigError


def _square_with_pid(name: str) -> tuple[int, int]:
    return int(name) ** 2, os.getpid()


def test_jobs_run_in_workers_and_keep_their_order():
    names = [str(i) for i in range(5)]
    results = list(run_jobs(_square_with_pid, names, workers=2))
    assert [n for n, _ in results] == names
    assert [r[0] for _, r in results] == [i * i for i in range(5)]
    assert os.getpid() not in {r[1] for _, r in results}  # not run in this process
    assert [r for _, r in run_jobs(_square_with_pid, names, workers=1)] == [(i * i, os.getpid()) for i in range(5)]


def test_a_failing_job_raises_its_error_in_the_caller():
    def job(name: str) -> str:
        if name == "step":
            raise ConfigError("step cannot be exported: the reason")
        return name

    with pytest.raises(ConfigError, match="step cannot be exported: the reason"):
        list(run_jobs(job, ["prefill", "step", "decode"], workers=2))


def test_parallel_only_where_it_is_safe():
    assert workers_for("tensorrt", 1 << 20) == 1  # a CUDA context does not survive fork
    assert workers_for("onnxruntime", PARALLEL_MAX_WEIGHT_BYTES + 1) == 1  # a second protobuf would not fit
    cores = len(os.sched_getaffinity(0))
    assert workers_for("onnxruntime", 1 << 20) == min(2, cores)
