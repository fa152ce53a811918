"""What bench/methods.py's methods and bench/peers.py's peers share, in a module of its own so
that neither imports the other for it: a method's live batch (``Run``) and the thread count."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from dlite_trt.runtime.session import SamplingParams, SessionBase, StepEvent
from dlite_trt.runtime.stats import StageTimer


class Run:
    """One live batch of a method: what a multi-turn session keeps between turns."""

    def __init__(self, session: SessionBase) -> None:
        self.session = session

    def extend(self, ids: Sequence[Sequence[int]]) -> None:
        self.session.extend(ids)

    def stream(self, params: SamplingParams, timer: StageTimer) -> Iterator[StepEvent]:
        raise NotImplementedError

    @property
    def draft_context_tokens(self) -> int:
        """Context tokens the drafter has processed outside decoding steps (0: nothing to catch up on)."""
        return 0

    def draft_state_bytes(self) -> int:
        """Bytes the drafter keeps per batch between steps."""
        return 0


def default_threads() -> int:
    """The bench's thread count when --threads is not given: one per physical core this process may
    run on (ONNX Runtime's own default, what ``generate`` and ``serve`` run with), given to every
    method and peer alike (their libraries' own defaults differ: llama.cpp's bindings take half
    the CPUs, torch its own). From /proc/cpuinfo's (physical id, core id) of the CPUs in the
    affinity mask; where those are not listed, every CPU counts."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, entry = set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in [*f, ""]:
                key, _, value = line.partition(":")
                if key.strip():
                    entry[key.strip()] = value.strip()
                elif entry:
                    if int(entry.get("processor", -1)) in cpus and "core id" in entry:
                        cores.add((entry.get("physical id"), entry["core id"]))
                    entry = {}
    except OSError:  # no /proc here: count CPUs
        pass
    return len(cores) or len(cpus)
