"""TensorRT plans for an engine directory (``dlite-trt build --backend tensorrt``).

Each graph is exported with the TensorRT lowering of ``LowRankRecurrence`` (a plugin node, see
plugins/lowrank_recurrence), parsed by TensorRT's ONNX parser as a strongly typed network (the
precision is the one the graph was exported in), given one optimization profile from the I/O
contract's min/opt/max, and built into ``graphs/<name>.plan``. The plugin is registered first;
its ahead-of-time implementation embeds the kernel's PTX, so plans run without Python.

Written against the TensorRT 10 Python API. It has never run: TensorRT cannot be installed on
the machines this was written on (tests marked ``tensorrt`` run it where it can be).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlite_trt.errors import EngineError
from dlite_trt.export.contract import GraphSpec

INSTALL_HINT = "install dlite-trt[trt] on a machine with an NVIDIA GPU"


def require_tensorrt() -> dict[str, str]:
    """TensorRT and a GPU, or a clear error; returns what the manifest records about them."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise EngineError(f"--backend tensorrt needs TensorRT, which is not installed; {INSTALL_HINT}.") from exc
    import torch

    if not torch.cuda.is_available():
        raise EngineError(f"--backend tensorrt needs an NVIDIA GPU, and none is visible; {INSTALL_HINT}.")
    from dlite_trt.export.recurrence import PLUGIN_VERSION

    return {"tensorrt": trt.__version__, "gpu": torch.cuda.get_device_name(),
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "plugin_version": PLUGIN_VERSION}


def profile_shapes(graph: GraphSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) of every input with a dynamic dim: the optimization profile."""
    return {t.name: graph.profile(t.name) for t in graph.inputs if any(isinstance(d, str) for d in t.dims)}


def build_plan(onnx_path: Path, plan_path: Path, graph: GraphSpec, *, workspace_gb: float,
               timing_cache: Path | None = None) -> None:
    import tensorrt as trt

    from plugins.lowrank_recurrence.trt_plugin import register

    register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32 (TF32 is on by default): parity with ONNX Runtime
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(graph).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache: Any = config.create_timing_cache(timing_cache.read_bytes() if timing_cache and timing_cache.is_file()
                                            else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT could not build {graph.name} (see its log above); nothing was written.")
    plan_path.write_bytes(bytes(plan))
    if timing_cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
