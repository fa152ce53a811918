"""Run one job per engine graph (export, then optimize or build a plan), two at a time where
that is safe.

Exporting a graph is mostly single-threaded work (the TorchScript tracer, ONNX shape inference,
protobuf serialization): on SmolLM2-135M one graph takes 25-33 s and uses about one core. Jobs
run in forked workers, which share the loaded weights with the parent copy-on-write, so two
cores export two graphs in about the time of one. Only where it is safe and pays: a platform
with fork, an ONNX Runtime build (a TensorRT build holds a CUDA context, which does not survive
fork), more than one core, and a model small enough that a second graph's protobuf (about the
weights' size) fits beside the first (``PARALLEL_MAX_WEIGHT_BYTES``).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PARALLEL_MAX_WEIGHT_BYTES = 4 << 30
MAX_WORKERS = 2

_JOB: Callable[[str], Any] | None = None  # the job of the current run, inherited by forked workers


def workers_for(backend: str, weight_bytes: int) -> int:
    """How many graph jobs to run at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if backend != "onnxruntime" or weight_bytes > PARALLEL_MAX_WEIGHT_BYTES or \
            "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(MAX_WORKERS, cores))


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)  # the cores are shared between the workers


def _run(name: str) -> Any:
    assert _JOB is not None, "graph job started outside run_jobs"
    return _JOB(name)


def run_jobs(job: Callable[[str], Any], names: Sequence[str], workers: int) -> Iterator[tuple[str, Any]]:
    """``(name, job(name))`` for each name, in order. With ``workers`` > 1 the jobs run in forked
    processes (a job's exception is raised here); its results must pickle."""
    if workers <= 1 or len(names) <= 1:
        for name in names:
            yield name, job(name)
        return
    import torch

    global _JOB
    _JOB = job
    threads = max(1, torch.get_num_threads() // workers)
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init, initargs=(threads,)) as pool:
            yield from zip(names, pool.imap(_run, names), strict=True)
    finally:
        _JOB = None
