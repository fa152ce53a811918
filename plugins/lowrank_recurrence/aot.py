"""Ahead-of-time compilation of the fused head kernel to PTX (what the TensorRT plugin embeds in
an engine, so the engine runs without Python). Works without a GPU: Triton compiles for a given
CUDA architecture with the ptxas it ships."""

from __future__ import annotations

from typing import Any

from dlite_trt.export.recurrence import INPUT_NAMES
from dlite_trt.runtime.sampling import GREEDY_EPS

KERNEL_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
BLOCK_V = 128  # vocabulary tile (the default tactic's)
BLOCK_C = 32  # weight columns streamed per chunk
# TensorRT tactics the plugin offers its autotuner: tactic id -> (vocabulary tile, warps). The
# kernel streams output_proj ([V, r]) once per step; wider tiles with more warps keep more loads
# in flight per program, which matters most at small batch (one program per sequence).
TACTICS = {1: (BLOCK_V, 4), 2: (256, 8), 3: (512, 16)}
DEFAULT_TACTIC = 1
# the kernel's pointer parameters, in order: the node's inputs, then its outputs and workspace
KERNEL_INPUTS = ("hidden_ptr", "anchor_ptr", "seed_ptr", "temperature_ptr", "uniforms_ptr", "emb_ptr", "ws_ptr",
                 "bs_ptr", "wm_ptr", "bm_ptr", "wo_ptr")
assert len(KERNEL_INPUTS) == len(INPUT_NAMES)
KERNEL_SCALARS = ("K", "H", "R", "V")  # int32, passed between the inputs and the outputs
KERNEL_OUTPUTS = ("tokens_ptr", "logits_ptr", "scratch_ptr")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def constants(*, rank: int, seeded: bool, sampling: bool, tactic: int = DEFAULT_TACTIC) -> dict[str, Any]:
    if tactic not in TACTICS:
        raise ValueError(f"the kernel's tactics are {sorted(TACTICS)}, not {tactic}")
    return {"GREEDY_EPS": GREEDY_EPS, "HAS_SEED": bool(seeded), "WRITE_LOGITS": bool(sampling),
            "BLOCK_R": next_power_of_2(rank), "BLOCK_C": BLOCK_C, "BLOCK_V": TACTICS[tactic][0]}


def signature(model_dtype: str) -> dict[str, str]:
    """Triton types of the pointer and scalar parameters: the draft's hidden states and the head
    weights in the model dtype, ids int64, temperature/uniforms/logits/workspace fp32."""
    if model_dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {sorted(KERNEL_DTYPES)} weights, not {model_dtype}")
    model = f"*{KERNEL_DTYPES[model_dtype]}"
    types = dict(zip(KERNEL_INPUTS, (model, "*i64", "*i64", "*fp32", "*fp32", *[model] * 6), strict=True))
    return types | dict.fromkeys(KERNEL_SCALARS, "i32") | {"tokens_ptr": "*i64", "logits_ptr": "*fp32",
                                                            "scratch_ptr": "*fp32"}


def compile_kernel(model_dtype: str, *, rank: int, seeded: bool, sampling: bool, tactic: int = DEFAULT_TACTIC,
                   capability: tuple[int, int] | None = None) -> Any:
    """Compile ``tactic`` for ``capability`` (default: the current GPU's) -> Triton's compiled kernel:
    ``.metadata.name``, ``.asm["ptx"]``, ``.metadata.num_warps``, ``.metadata.shared``."""
    import triton
    from triton.backends.compiler import GPUTarget

    from plugins.lowrank_recurrence.kernel import lowrank_recurrence_kernel as kernel

    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    consts = constants(rank=rank, seeded=seeded, sampling=sampling, tactic=tactic)
    sig = signature(model_dtype) | dict.fromkeys(consts, "constexpr")
    src = triton.compiler.ASTSource(fn=kernel, signature={name: sig[name] for name in kernel.arg_names},
                                    constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32),
                          options={"num_warps": TACTICS[tactic][1]})
