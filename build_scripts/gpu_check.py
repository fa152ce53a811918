#!/usr/bin/env python
"""One command for a GPU machine with PyTorch and OpenAI Triton (TensorRT not needed): checks the
fused LowRankRecurrence kernel against the PyTorch reference head at Qwen3-8B sizes and times
both, and times a verify pass of K+1 tokens against a one-token decode step for a
Qwen3-8B-shaped random target (bf16). Prints ONE JSON line. Under 5 minutes on an H100/H200.

    python build_scripts/gpu_check.py             # on the GPU machine
    python build_scripts/gpu_check.py --small     # tiny sizes, runs anywhere (CPU: TRITON_INTERPRET=1)

Where TensorRT is installed it also builds the bundled pair as a TensorRT engine and as an ONNX
Runtime one, and compares them (``runtime.compare``: every graph on the same random inputs, and
greedy decoding of the same prompts), with tokens/s of each, and of TensorRT without CUDA graphs.
``--compare-with onnxruntime`` runs that part against a second ONNX Runtime build instead (a
check of the script itself where TensorRT is missing).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plugins/ beside the package

QWEN3_8B = {"hidden": 4096, "vocab": 151936, "rank": 256, "steps": 7, "layers": 36, "heads": 32, "kv_heads": 8,
            "head_dim": 128, "intermediate": 12288}
SMALL = {"hidden": 64, "vocab": 300, "rank": 16, "steps": 7, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
         "intermediate": 128}


def _timer(device: str):
    import torch

    def timed(fn, repeat: int) -> float:
        """Median milliseconds of fn() over ``repeat`` calls after 3 warm-ups."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeat):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return timed


def kernel_check(sizes: dict, batch: int, device: str, repeat: int) -> dict:
    import torch

    from dlite_trt.model.sequential_head import HeadWeights, SequentialHead, recurrence
    from plugins.lowrank_recurrence.launch import lowrank_recurrence

    torch.manual_seed(batch)
    head = SequentialHead(sizes["vocab"], sizes["rank"], sizes["hidden"]).to(device)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
    w = HeadWeights(*(t.detach() for t in head.weights()))
    hidden = torch.randn(batch, sizes["steps"], sizes["hidden"], device=device)
    anchor = torch.randint(0, sizes["vocab"], (batch,), device=device)
    zeros = torch.zeros(batch, device=device)
    with torch.no_grad():
        ref = recurrence(w, hidden, anchor, None, 0.0)
        tokens, logits = lowrank_recurrence(w, hidden, anchor, None, zeros, None, write_logits=True)
        timed = _timer(device)
        fused_ms = timed(lambda: lowrank_recurrence(w, hidden, anchor, None, zeros, None, write_logits=False), repeat)
        unfused_ms = timed(lambda: recurrence(w, hidden, anchor, None, 0.0), repeat)
    return {"batch": batch, "tokens_equal": float((tokens == ref.tokens).float().mean()),
            "logits_max_abs_diff": float((logits - ref.logits).abs().max()),
            "fused_ms": fused_ms, "unfused_pytorch_ms": unfused_ms, "fused_speedup": unfused_ms / fused_ms}


def verify_vs_decode(sizes: dict, device: str, context: int, repeat: int) -> dict:
    """One forward of K+1 tokens vs of 1 token on a KV cache of ``context`` tokens (bf16 on GPU)."""
    import torch
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3Config(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"],
                         num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
                         head_dim=sizes["head_dim"], intermediate_size=sizes["intermediate"],
                         max_position_embeddings=context + 64)
    start = time.perf_counter()
    with torch.device(device):  # random weights made in place, in the target dtype
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype).eval()
    build_s = time.perf_counter() - start
    prompt = torch.randint(0, sizes["vocab"], (1, context), device=device)
    cache = DynamicCache()
    timed = _timer(device)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)

        def forward(n: int):
            ids = torch.randint(0, sizes["vocab"], (1, n), device=device)
            model(ids, cache=cache, use_cache=True)
            cache.crop(-n)  # drop what this call added: every timed call sees the same context

        verify_ms = timed(lambda: forward(sizes["steps"] + 1), repeat)
        decode_ms = timed(lambda: forward(1), repeat)
    return {"context": context, "verify_tokens": sizes["steps"] + 1, "verify_ms": verify_ms, "decode_ms": decode_ms,
            "verify_over_decode": verify_ms / decode_ms, "dtype": str(dtype), "model_build_s": build_s}


def engine_check(work: Path, other: str, max_new_tokens: int) -> dict:
    """The bundled pair built for ONNX Runtime (fp32) and for ``other``, compared and timed."""
    from transformers import AutoTokenizer

    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits
    from dlite_trt.runtime.compare import compare_generation, compare_graphs
    from dlite_trt.runtime.engine import open_engine
    from dlite_trt.runtime.session import SamplingParams

    target, draft = bundled_pair()
    limits = EngineLimits(max_batch=4, max_seq_len=512, max_chunk=128)
    name = other if other != "onnxruntime" else "onnxruntime (second build)"
    dirs = {"onnxruntime": (work / "onnxruntime", "onnxruntime"), name: (work / "candidate", other)}
    built = {}
    for key, (out, backend) in dirs.items():
        start = time.perf_counter()
        build_engine(target, draft, out, BuildSettings(backend=backend, limits=limits), progress=False)
        built[key] = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = ["def parse_args(argv):", "class LRUCache:\n    def __init__(self, capacity):",
             "import os\nimport sys\n\n\ndef main():", "    for i, line in enumerate(lines):"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    ort, candidate = open_engine(dirs["onnxruntime"][0]), open_engine(dirs[name][0])
    result = {"compared": f"{other} fp32 against onnxruntime fp32", "build_s": built,
              "graphs": compare_graphs(ort, candidate),
              "generation": compare_generation(ort, candidate, prompts, max_new_tokens)}
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engines = {"onnxruntime": ort, name: candidate}
    if other == "tensorrt":
        engines["tensorrt_without_cuda_graphs"] = open_engine(dirs[name][0], cuda_graphs=False)
    tokens_per_s = {}
    for label, gen in engines.items():
        gen.generate([prompts[0]], params)  # warm-up (and, for TensorRT, the CUDA graph capture)
        start = time.perf_counter()
        produced = sum(len(gen.generate([p], params).output_ids[0]) for p in prompts)
        tokens_per_s[label] = produced / (time.perf_counter() - start)
    result["tokens_per_s"] = tokens_per_s
    graphs = getattr(candidate.runner, "graphs", None)
    if graphs is not None:
        result["cuda_graphs"] = {"captures": graphs.captures, "replays": graphs.replays, "failed": graphs.failed}
    return result


def _tensorrt_version() -> str | None:
    try:
        import tensorrt
    except ImportError:
        return None
    return tensorrt.__version__


@click.command()
@click.option("--small", is_flag=True, help="Tiny sizes (a smoke test that runs anywhere).")
@click.option("--repeat", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--context", default=2048, show_default=True, type=click.IntRange(min=1))
@click.option("--compare-with", type=click.Choice(["tensorrt", "onnxruntime"]), default="tensorrt", show_default=True,
              help="The engine compared with ONNX Runtime's (tensorrt: only where TensorRT is installed).")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the compared engines are built [default: a temporary directory].")
def main(small: bool, repeat: int, context: int, compare_with: str, work: Path | None) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.UsageError("no GPU here: run with TRITON_INTERPRET=1 (and --small) to check the script on a CPU")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32
    sizes = SMALL if small else QWEN3_8B
    started = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "sizes": sizes,
              "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    result["kernel"] = [kernel_check(sizes, b, device, repeat) for b in (1, 8)]
    result["verify_vs_decode"] = verify_vs_decode(sizes, device, min(context, 256) if small else context, repeat)
    result["tensorrt"] = _tensorrt_version() or "not installed"
    if compare_with == "onnxruntime" or result["tensorrt"] != "not installed":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            try:
                result["engines"] = engine_check(work or Path(tmp), compare_with, 32 if small else 64)
            except Exception as exc:  # keep what was measured above (a GPU run is scarce); the trace goes to stderr
                import traceback

                traceback.print_exc()
                result["engines"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.perf_counter() - started
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
