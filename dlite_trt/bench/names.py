"""Names of the bench's methods and generated workloads. Imports nothing heavy: `--help` reads them."""

from __future__ import annotations

from collections.abc import Iterable

from dlite_trt.errors import DLiteError

METHOD_NAMES = ("ar", "dlite", "ngram", "reference")
METHOD_TITLES = {"ar": "target-only", "dlite": "DLite", "ngram": "n-gram lookup", "reference": "DLite (PyTorch)"}
WORKLOAD_NAMES = ("agentic", "long-context", "chat")


def check_names(values: Iterable[str], allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    values = tuple(values)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise DLiteError(f"unknown {what} {unknown}; choose from {', '.join(allowed)}.")
    return values
