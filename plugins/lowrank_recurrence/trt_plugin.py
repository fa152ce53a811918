"""The LowRankRecurrence plugin for TensorRT, through ``tensorrt.plugin`` (quickly deployable
plugins): output shapes, supported formats and tactics (``aot.TACTICS``, timed by TensorRT's
autotuner), and an ahead-of-time implementation (the Triton kernel compiled to PTX for the
chosen tactic and embedded in the engine, so the engine runs without Python).

Its id ``dlite::LowRankRecurrence`` comes from ``export.recurrence`` (PLUGIN_NAMESPACE,
PLUGIN_NAME), which the exporter's TensorRT lowering writes into the graph; TensorRT's ONNX
parser maps the node to this plugin. Written against TensorRT 10.8+'s ``tensorrt.plugin`` API;
it has never run (no TensorRT here). ``register()`` is idempotent and imports TensorRT only when
called.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the annotations of the
registered functions as types (TensorDesc, int, the return tuples), not strings.
"""

from dlite_trt.engine.tensorrt_build import INSTALL_HINT
from dlite_trt.errors import DLiteError
from dlite_trt.export.recurrence import OUTPUT_NAMES, PLUGIN_NAME, PLUGIN_NAMESPACE, TRT_ABI_SLOTS, TRT_EXTRA_OUTPUTS

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
_registered = False


def register() -> None:
    """Register the plugin with TensorRT (once per process)."""
    global _registered
    if _registered:
        return
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise DLiteError(f"TensorRT is not installed; {INSTALL_HINT}.") from exc

    from plugins.lowrank_recurrence.aot import TACTICS, compile_kernel

    model_types = "FP32|FP16|BF16"  # draft_hidden and the six weights share the model dtype
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    output_descs = tuple[(trtp.TensorDesc,) * (len(OUTPUT_NAMES) + len(TRT_EXTRA_OUTPUTS))]  # as the lowering

    @trtp.register(PLUGIN_ID)
    def describe(draft_hidden: trtp.TensorDesc, anchor: trtp.TensorDesc, seed_prev: trtp.TensorDesc,
                 temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc, prev_token_embedding: trtp.TensorDesc,
                 state_proj_weight: trtp.TensorDesc, state_proj_bias: trtp.TensorDesc,
                 state_hidden_mlp_weight: trtp.TensorDesc, state_hidden_mlp_bias: trtp.TensorDesc,
                 output_proj_weight: trtp.TensorDesc, num_steps: int, seeded: int, sampling: int,
                 rank: int) -> output_descs:
        # vocab: the head's rows (the target's V, or V_d with a draft vocabulary), never the target's V as such;
        # steps: draft_hidden's D <= num_steps (a greedy step drafts what the next one verifies)
        batch, steps, vocab = draft_hidden.shape_expr[0], draft_hidden.shape_expr[1], prev_token_embedding.shape_expr[0]
        return (trtp.from_shape_expr((batch, steps), dtype=trt.int64),
                trtp.from_shape_expr((batch, steps, vocab), dtype=trt.float32),
                trtp.from_shape_expr((batch, 2, rank), dtype=trt.float32),  # the kernel's workspace
                *(trtp.from_shape_expr((1,), dtype=trt.int8) for _ in TRT_ABI_SLOTS))  # Triton's hidden pointers

    @trtp.autotune(PLUGIN_ID)
    def formats(draft_hidden, anchor, seed_prev, temperature, uniforms, prev_token_embedding, state_proj_weight,
                state_proj_bias, state_hidden_mlp_weight, state_hidden_mlp_bias, output_proj_weight,
                outputs) -> list[trtp.AutoTuneCombination]:
        combination = trtp.AutoTuneCombination(", ".join([model_types, "INT64", "INT64", "FP32", "FP32",
                                                          *[model_types] * 6, "INT64", "FP32", "FP32",
                                                          *["INT8"] * len(TRT_ABI_SLOTS)]))
        combination.tactics(sorted(TACTICS))  # vocabulary tile x warps: TensorRT times each, keeps the fastest
        return [combination]

    @trtp.aot_impl(PLUGIN_ID)
    def ahead_of_time(draft_hidden: trtp.TensorDesc, anchor: trtp.TensorDesc, seed_prev: trtp.TensorDesc,
                      temperature: trtp.TensorDesc, uniforms: trtp.TensorDesc, prev_token_embedding: trtp.TensorDesc,
                      state_proj_weight: trtp.TensorDesc, state_proj_bias: trtp.TensorDesc,
                      state_hidden_mlp_weight: trtp.TensorDesc, state_hidden_mlp_bias: trtp.TensorDesc,
                      output_proj_weight: trtp.TensorDesc, num_steps: int, seeded: int, sampling: int, rank: int,
                      outputs: tuple[trtp.TensorDesc], tactic: int
                      ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        kernel = compile_kernel(dtype_names[draft_hidden.dtype], rank=rank, seeded=bool(seeded),
                                sampling=bool(sampling), tactic=tactic)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = draft_hidden.shape_expr[0]  # one program per sequence
        launch.block_x = kernel.metadata.num_warps * 32
        launch.shared_mem = kernel.metadata.shared
        scalars = (draft_hidden.shape_expr[1], draft_hidden.shape_expr[2], rank,
                   prev_token_embedding.shape_expr[0])  # D (steps), H, r, V
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.metadata.name.encode(), kernel.asm["ptx"].encode(), launch, extra

    _registered = True
