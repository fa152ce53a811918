"""Names of the bench's methods and generated workloads. Imports nothing heavy: `--help` reads them."""

from __future__ import annotations

from collections.abc import Iterable

from dlite_trt.errors import DLiteError

OUR_METHOD_NAMES = ("ar", "dlite", "ngram", "dlite-ngram", "reference")
# other libraries on the same target (bench/peers.py), batch 1 only
PEER_NAMES = ("hf", "hf-lookup", "ort-genai", "ort-genai-ngram", "ort-genai-int4", "ort-genai-int4-ngram",
              "llama-cpp", "llama-cpp-lookup")
METHOD_NAMES = OUR_METHOD_NAMES + PEER_NAMES
METHOD_TITLES = {"ar": "target-only", "dlite": "DLite", "ngram": "n-gram lookup", "dlite-ngram": "DLite + n-gram",
                 "reference": "DLite (PyTorch)",
                 "hf": "transformers", "hf-lookup": "transformers prompt lookup",
                 "ort-genai": "ORT GenAI fp32", "ort-genai-ngram": "ORT GenAI fp32 n-gram",
                 "ort-genai-int4": "ORT GenAI int4", "ort-genai-int4-ngram": "ORT GenAI int4 n-gram",
                 "llama-cpp": "llama.cpp (GGUF)", "llama-cpp-lookup": "llama.cpp (GGUF) lookup"}
WORKLOAD_NAMES = ("agentic", "long-context", "chat")
OURS_BY_DEFAULT = ("ar", "dlite", "ngram", "dlite-ngram")
# the peers a run compares with by default, by the engine's weights: the same numerics where a
# peer has them (fp32 weights), the 4-bit runtimes for an int4 engine
DEFAULT_PEERS = {"float": ("hf", "hf-lookup", "ort-genai", "ort-genai-ngram"),
                 "int4": ("ort-genai-int4", "ort-genai-int4-ngram", "llama-cpp", "llama-cpp-lookup")}


def default_methods(weights: str, quick: bool = False) -> tuple[str, ...]:
    """`--methods auto`: ours, and (not with --quick, to stay within minutes) the peers for an
    engine with these weights (``WeightFormat.format``)."""
    return OURS_BY_DEFAULT + (() if quick else DEFAULT_PEERS[weights])


def check_names(values: Iterable[str], allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    values = tuple(values)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise DLiteError(f"unknown {what} {unknown}; choose from {', '.join(allowed)}.")
    return values
