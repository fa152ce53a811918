"""The precisions dlite-trt knows, by their CLI names, and what each is called elsewhere."""

from __future__ import annotations

import torch

TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NUMPY_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # numpy / ONNX tensor dtype names
