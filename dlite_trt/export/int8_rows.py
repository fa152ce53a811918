"""The prefill's products of an int4 engine in int8 (``--prefill-weights int8``, the default at accuracy level 4).

A prefill multiplies hundreds of rows at once, where MatMulNBits' int8 path is slow on ONNX Runtime's
CPU provider and MLAS's integer GEMM (``MatMulInteger``: AMX tiles on CPUs that have them, VNNI
elsewhere) is fast. SmolLM2's [M, 576] x [576, 1536] product on 2 cores of a Xeon with AMX: M = 512
14.2 ms on MatMulNBits (bits 4, level 4), 11.2 ms as an fp32 MatMul, 1.5 ms here; a 2,048-token
prefill of the whole int4 engine 3.9 s -> 2.2 s (docs/engine.md). Decode and verify calls keep
MatMulNBits: at one or a few rows the 4-bit weights' bytes are what the product costs, and there
MatMulNBits is the faster (0.026 against 0.095 ms at M = 1).

The form, per target matrix W [N, K] (the dequantized 4-bit blocks every other graph multiplies by):
- weights: int8 codes per output column, symmetric, round-to-nearest: ``c[n] = max_k |W[n, k]| / 127``,
  ``B[k, n] = round(W[n, k] / c[n])`` (``Int8Columns``);
- activations: int8 per row, symmetric: ``s[m] = max_k |x[m, k]| / 127``, ``q = round(x / s) + 128``
  as uint8 (the zero point 128), computed once per activation and shared by its products;
- ``y[m, n] = (sum_k (q[m, k] - 128) B[k, n]) * c[n] * s[m]``: ``MatMulIntegerToFloat`` (an exact int32
  sum, scaled by c) then the row scale.
Every row is computed from its own values alone, whatever else the call holds (no scale is shared
across rows, the sum is integer): a prompt's entries do not depend on how it is chunked or batched.
The prefill's rounding differs from the decode calls' (int8 against 4-bit weights), so the prompt's
KV entries do; speculative and target-only decoding share the prefill, so speculative output still
equals the engine's own target-only greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dlite_trt.export.cache_attention import ORT_DOMAIN

QMAX = 127
ZERO_POINT = 128  # the activations' uint8 zero point (symmetric int8 shifted into uint8, MLAS's U8S8 GEMM)
CONSTANTS = "int8_rows."  # initializer prefix of the shared constants


@dataclass(frozen=True)
class Int8Columns:
    """W^T [K, N] as int8 codes per output column and their scales [N]: ``W^T ~ codes * scales``."""

    codes: np.ndarray  # [K, N] int8, -127..127
    scales: np.ndarray  # [N] float32

    @classmethod
    def of(cls, weight: np.ndarray) -> Int8Columns:
        """Round-to-nearest int8 columns of a float [N, K] weight."""
        w = np.asarray(weight, np.float32)
        scales = (np.abs(w).max(axis=1) / np.float32(QMAX)).astype(np.float32)
        scales[scales == 0] = 1  # an all-zero column: any scale, codes 0
        codes = np.clip(np.rint(w / scales[:, None]), -QMAX, QMAX).astype(np.int8)
        return cls(np.ascontiguousarray(codes.T), scales)

    @classmethod
    def stacked(cls, parts: list[Int8Columns]) -> Int8Columns:
        """Products of one activation side by side along N (each column is computed alone)."""
        return cls(np.concatenate([p.codes for p in parts], axis=1), np.concatenate([p.scales for p in parts]))

    def reference(self, x: np.ndarray) -> np.ndarray:
        """What the graph's nodes compute for ``x`` [.., K], in float64 from the same rounded integers."""
        q, s = quantize_rows(x)
        return (q.astype(np.float64) @ self.codes.astype(np.float64)) * self.scales * s.astype(np.float64)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [.., K] as int8 per row (the graph's rounding, in numpy): codes (float, -127..127) and scales [.., 1]."""
    x = np.asarray(x, np.float32)
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True) * np.float32(1 / QMAX), np.float32(1e-30))
    return np.rint(x / s), s


def _constants(added: dict[str, onnx.TensorProto]) -> None:
    for name, value in (("axis", np.array([-1], np.int64)), ("inv_qmax", np.array(1 / QMAX, np.float32)),
                        ("tiny", np.array(1e-30, np.float32)), ("shift", np.array(ZERO_POINT, np.float32)),
                        ("zero_point", np.array(ZERO_POINT, np.uint8)), ("one", np.array(1.0, np.float32))):
        added.setdefault(CONSTANTS + name, numpy_helper.from_array(value, CONSTANTS + name))


def row_quantize_nodes(x: str, scope: str, added: dict[str, onnx.TensorProto],
                       opset: int) -> tuple[list[onnx.NodeProto], str, str]:
    """Nodes quantizing activation ``x`` to uint8 per row, in a model of standard-op ``opset``; returns them,
    the codes' name and the row scales'."""
    _constants(added)
    c = CONSTANTS
    p = f"{scope}/row_quant"
    axes = {"axes": [-1]} if opset < 18 else {}  # an input from opset 18 on, an attribute before
    nodes = [helper.make_node("Abs", [x], [f"{p}/abs"], name=f"{p}/abs"),
             helper.make_node("ReduceMax", [f"{p}/abs", *([] if axes else [c + "axis"])], [f"{p}/max"],
                              name=f"{p}/max", keepdims=1, **axes),
             helper.make_node("Mul", [f"{p}/max", c + "inv_qmax"], [f"{p}/scale0"], name=f"{p}/scale0"),
             helper.make_node("Max", [f"{p}/scale0", c + "tiny"], [f"{p}/scale"], name=f"{p}/scale"),
             helper.make_node("Div", [x, f"{p}/scale"], [f"{p}/scaled"], name=f"{p}/scaled"),
             helper.make_node("Round", [f"{p}/scaled"], [f"{p}/rounded"], name=f"{p}/rounded"),
             helper.make_node("Add", [f"{p}/rounded", c + "shift"], [f"{p}/shifted"], name=f"{p}/shifted"),
             helper.make_node("Cast", [f"{p}/shifted"], [f"{p}/codes"], name=f"{p}/codes", to=TensorProto.UINT8)]
    return nodes, f"{p}/codes", f"{p}/scale"


def product_nodes(codes: str, row_scale: str, name: str, scope: str, columns: Int8Columns, y: str,
                  added: dict[str, onnx.TensorProto]) -> list[onnx.NodeProto]:
    """``y`` = the rows (``codes``, ``row_scale`` from ``row_quantize_nodes``) times ``columns``, stored as
    ``{name}.i8`` / ``{name}.i8_scales``."""
    w, ws = f"{name}.i8", f"{name}.i8_scales"
    added[w] = numpy_helper.from_array(columns.codes, w)
    added[ws] = numpy_helper.from_array(columns.scales, ws)
    c = CONSTANTS
    return [helper.make_node("MatMulIntegerToFloat", [codes, w, c + "one", ws, c + "zero_point"],
                             [f"{scope}/MatMulInteger_output_0"], name=f"{scope}/MatMulInteger", domain=ORT_DOMAIN),
            helper.make_node("Mul", [f"{scope}/MatMulInteger_output_0", row_scale], [y], name=f"{scope}/row_scale")]
