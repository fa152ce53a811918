"""What a served engine takes and returns, declared once: the Triton config, the request parser
and the tests all read these tensors.

A request carries ``text_input`` (tokenized with the engine's tokenizer) or ``input_ids``, and
optional sampling parameters; a response carries ``text_output``, ``output_ids`` and the
request's acceptance statistics. Every tensor is per request (Triton adds the batch dim).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlite_trt.errors import DLiteError

TRITON_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "bool": "TYPE_BOOL",
                "bytes": "TYPE_STRING"}
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class ServeTensor:
    name: str
    dtype: str  # a key of TRITON_TYPES
    dims: tuple[int, ...]  # per request; -1 = any length
    doc: str
    optional: bool = True


INPUTS = (
    ServeTensor("text_input", "bytes", (1,), "prompt text (UTF-8), tokenized with the engine's tokenizer"),
    ServeTensor("input_ids", "int64", (-1,), "prompt token ids (instead of text_input)"),
    ServeTensor("max_tokens", "int32", (1,), f"tokens to generate, >= 0 [default {DEFAULT_MAX_TOKENS}, or "
                                              "what the engine's --max-seq-len leaves]"),
    ServeTensor("temperature", "float32", (1,), "0 = greedy, lossless [default]; > 0 = speculative sampling"),
    ServeTensor("seed", "int64", (1,), "sampling seed (same seed, same tokens); unused when greedy"),
    ServeTensor("stop", "bytes", (-1,), "stop strings: the output ends before the first one"),
    ServeTensor("stop_token_ids", "int64", (-1,), "extra stop token ids (the engine's end tokens always stop)"),
    ServeTensor("ignore_eos", "bool", (1,), "do not stop at the engine's end tokens [default false]"),
)
OUTPUTS = (
    ServeTensor("text_output", "bytes", (1,), "the generated text", optional=False),
    ServeTensor("output_ids", "int64", (-1,), "the generated token ids", optional=False),
    ServeTensor("mean_acceptance_length", "float32", (1,), "tokens per speculative step", optional=False),
    ServeTensor("accepted_draft_tokens", "int64", (1,), "draft tokens the target accepted", optional=False),
    ServeTensor("proposed_draft_tokens", "int64", (1,), "draft tokens the target verified", optional=False),
)
INPUTS_BY_NAME = {t.name: t for t in INPUTS}


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_request(inputs: Mapping[str, np.ndarray], *, tokenizer: Any, vocab_size: int, max_seq_len: int,
                  parameters: Mapping[str, Any] | None = None) -> Request:
    """One request's tensors (numpy, per request, a leading batch dim of 1 allowed) -> Request.

    Raises DLiteError naming the problem and the fix for anything malformed.
    """
    if parameters:
        raise DLiteError(f"unknown request parameters {sorted(parameters)}; this model takes its settings as "
                         f"inputs: {', '.join(t.name for t in INPUTS)}.")
    unknown = sorted(set(inputs) - set(INPUTS_BY_NAME))
    if unknown:
        raise DLiteError(f"unknown inputs {unknown}; this model takes {', '.join(t.name for t in INPUTS)}.")
    values = {name: _checked(name, value) for name, value in inputs.items()}
    if ("text_input" in values) == ("input_ids" in values):
        raise DLiteError("a request needs exactly one of text_input (a string) or input_ids (INT64 token ids).")
    if "text_input" in values:
        if tokenizer is None:
            raise DLiteError("this engine has no tokenizer; send input_ids instead of text_input.")
        text = _text(values["text_input"], "text_input")
        if len(text) != 1:
            raise DLiteError(f"text_input holds {len(text)} strings; send one prompt per request.")
        prompt = tokenizer.encode(text[0], add_special_tokens=False)
    else:
        prompt = [int(t) for t in values["input_ids"].reshape(-1)]
    if not prompt:
        raise DLiteError("the prompt is empty; send at least one token.")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise DLiteError(f"input_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
    # not given: the default, or what room the engine has left after the prompt
    max_tokens = _scalar(values, "max_tokens", max(0, min(DEFAULT_MAX_TOKENS, max_seq_len - len(prompt))), int)
    if max_tokens < 0:
        raise DLiteError(f"max_tokens must be >= 0, got {max_tokens}.")
    if len(prompt) + max_tokens > max_seq_len:
        raise DLiteError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is "
                         f"{len(prompt) + max_tokens} tokens, past the engine's --max-seq-len {max_seq_len}; shorten "
                         "the prompt or lower max_tokens (or rebuild the engine with a larger --max-seq-len).")
    temperature = _scalar(values, "temperature", 0.0, float)
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise DLiteError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}.")
    seed = _scalar(values, "seed", None, int)
    stops = tuple(_text(values["stop"], "stop")) if "stop" in values else ()
    if any(not s for s in stops):
        raise DLiteError("stop strings must not be empty.")
    stop_ids = tuple(int(t) for t in values["stop_token_ids"].reshape(-1)) if "stop_token_ids" in values else ()
    return Request(tuple(prompt), max_tokens, temperature, seed, stops, stop_ids,
                   _scalar(values, "ignore_eos", False, bool))


def _checked(name: str, value: np.ndarray) -> np.ndarray:
    spec = INPUTS_BY_NAME[name]
    want = np.object_ if spec.dtype == "bytes" else np.dtype(spec.dtype)
    if value.dtype != want and not (spec.dtype == "bytes" and value.dtype.kind in "SUO"):
        triton = TRITON_TYPES[spec.dtype].removeprefix("TYPE_")
        raise DLiteError(f"input {name} has datatype {value.dtype}, expected {triton} ({spec.doc}).")
    if value.ndim > 1 and value.shape[0] != 1:
        raise DLiteError(f"input {name} has shape {list(value.shape)}: one request carries one prompt (batch 1).")
    return value.reshape(-1)


def _scalar(values: Mapping[str, np.ndarray], name: str, default: Any, kind: type) -> Any:
    if name not in values:
        return default
    value = values[name]
    if value.size != 1:
        raise DLiteError(f"input {name} must hold one value, got {value.size}.")
    return kind(value.item())


def _text(value: np.ndarray, name: str) -> list[str]:
    out = []
    for item in value.reshape(-1):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DLiteError(f"input {name} is not valid UTF-8.") from exc
        out.append(str(item))
    return out
