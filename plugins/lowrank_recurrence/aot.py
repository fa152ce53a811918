"""Ahead-of-time compilation of the fused head kernel to PTX (what the TensorRT plugin embeds in
an engine, so the engine runs without Python). Works without a GPU: Triton compiles for a given
CUDA architecture with the ptxas it ships."""

from __future__ import annotations

import re
from typing import Any

from dlite_trt.export.recurrence import INPUT_NAMES, TRT_ABI_SLOTS
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


def entry_parameters(ptx: str) -> int:
    """How many parameters the PTX's kernel entry declares."""
    entry = re.search(r"\.entry\s+[\w$]+\s*\(([^)]*)\)", ptx)
    if entry is None:
        raise ValueError("the PTX has no kernel entry")
    return entry.group(1).count(".param")


def check_launch_abi(kernel: Any) -> None:
    """TensorRT launches the kernel with one argument per plugin input, scalar and output. OpenAI
    Triton appends hidden scratch pointers to the parameters (two in Triton 3.x); the plugin's
    ABI slot outputs cover up to ``len(TRT_ABI_SLOTS)`` of them, and the kernel must need no
    scratch memory (nothing allocates it)."""
    declared = len(KERNEL_INPUTS) + len(KERNEL_SCALARS) + len(KERNEL_OUTPUTS)
    hidden = entry_parameters(kernel.asm["ptx"]) - declared
    if not 0 <= hidden <= len(TRT_ABI_SLOTS):
        raise RuntimeError(f"this OpenAI Triton version gives the kernel {hidden} hidden parameters; the TensorRT "
                           f"plugin passes {len(TRT_ABI_SLOTS)} (install the Triton version of dlite-trt[trt])")
    for what in ("global_scratch_size", "profile_scratch_size"):
        if getattr(kernel.metadata, what, 0):
            raise RuntimeError(f"the kernel needs {what} = {getattr(kernel.metadata, what)} bytes, which TensorRT "
                               "does not allocate for it")


def driver_ptx_version() -> int | None:
    """The newest PTX ISA the installed CUDA driver can load (None without a driver): Triton's
    bundled ptxas may be newer than the driver, and a plan's PTX is JIT-compiled by the driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    from triton.backends.nvidia.compiler import ptx_get_version

    return ptx_get_version(f"{version.value // 1000}.{version.value % 1000 // 10}")


def compile_kernel(model_dtype: str, *, rank: int, seeded: bool, sampling: bool, tactic: int = DEFAULT_TACTIC,
                   capability: tuple[int, int] | None = None, ptx_version: int | None = None) -> Any:
    """Compile ``tactic`` for ``capability`` (default: the current GPU's) -> Triton's compiled kernel:
    ``.metadata.name``, ``.asm["ptx"]``, ``.metadata.num_warps``, ``.metadata.shared``. The PTX ISA
    version is ``ptx_version``, else the installed driver's newest, else Triton's default; the
    launch ABI is checked (``check_launch_abi``)."""
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
    options: dict[str, Any] = {"num_warps": TACTICS[tactic][1]}
    ptx_version = ptx_version or driver_ptx_version()
    if ptx_version:
        options["ptx_version"] = ptx_version
    kernel = triton.compile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32), options=options)
    check_launch_abi(kernel)
    return kernel
