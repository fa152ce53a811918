"""The precisions dlite-trt knows, by their CLI names, and what each is called elsewhere."""

from __future__ import annotations

import torch

TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NUMPY_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # numpy / ONNX tensor dtype names

# Weight formats of an engine: "float", every weight in the engine's dtype; "int4", the target's
# projection matrices 4-bit weight-only (dlite_trt/export/int4.py), the rest in the engine's dtype.
WEIGHT_FORMATS = ("float", "int4")
# `dlite-trt build --dtype` values that choose a weight format: -> (activation dtype, weight format)
WEIGHT_ONLY_DTYPES = {"int4": ("fp32", "int4")}
