"""Compare two engine directories built from the same target and draft (in the manner of
``polygraphy run --trt --onnxrt``): a TensorRT engine against an ONNX Runtime one, or two
precisions or builds of one backend.

Two comparisons:
- ``compare_graphs``: every graph on the same random valid inputs (``export.contract.dummy_inputs``)
  and the same random KV cache; per output, the max and mean absolute difference of float
  outputs and the number of differing entries of integer outputs (tokens, counts);
- ``compare_generation``: greedy speculative decoding of the same prompts; the tokens must be
  identical wherever both engines compute the target's argmax at the same precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dlite_trt.errors import EngineError
from dlite_trt.export.contract import GRAPH_NAMES, dummy_inputs, kv_input, present_output


def check_same_models(a: Any, b: Any) -> None:
    """Both generators run the same target and draft, or a clear error."""
    ma, mb = a.manifest, b.manifest
    if (ma.target_sha256, ma.draft_sha256) != (mb.target_sha256, mb.draft_sha256):
        raise EngineError(f"the engines were built from different models (target {ma.target_name} "
                          f"{ma.target_sha256[:12]} / draft {ma.draft_sha256[:12]} against "
                          f"{mb.target_name} {mb.target_sha256[:12]} / {mb.draft_sha256[:12]}); "
                          "compare engines built from one target and draft.")


def graph_sizes(a: Any, b: Any, *, batch: int = 2, chunk: int = 8) -> dict[str, int]:
    """Dim sizes inside both engines' limits: a small batch and chunk on a cache with room left."""
    limits = [g.manifest.limits for g in (a, b)]
    batch = min(batch, *(lim.max_batch for lim in limits))
    chunk = min(chunk, *(lim.max_chunk for lim in limits), *(lim.max_seq_len for lim in limits))
    cache = min(chunk + a.manifest.block_size + 16, *(lim.max_seq_len for lim in limits))
    return {"batch": batch, "chunk": chunk, "outputs": chunk, "cache": cache}


def compare_graphs(a: Any, b: Any, *, graphs: Sequence[str] = GRAPH_NAMES, seed: int = 0) -> dict[str, dict]:
    """{graph: {output: differences}} for generators ``a`` and ``b`` (``runtime.engine.open_engine``)."""
    check_same_models(a, b)
    sizes = graph_sizes(a, b)
    report = {}
    for name in graphs:
        spec = a.manifest.contract[name]
        feeds = dummy_inputs(spec, sizes, vocab_size=a.manifest.target_spec.vocab_size,
                             rng=np.random.default_rng(seed))
        outputs = [_run(gen, name, feeds, sizes) for gen in (a, b)]
        report[name] = {t.name: _difference(outputs[0][t.name], outputs[1][t.name]) for t in spec.outputs
                        if present_output(t.name) is None}  # the cache written in place (attention "gqa")
    return report


def compare_generation(a: Any, b: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """Greedy speculative decoding of each prompt on both engines: how many outputs are identical,
    and where the first difference is."""
    from dlite_trt.runtime.session import SamplingParams

    check_same_models(a, b)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    equal, first_difference = 0, None
    for i, prompt in enumerate(prompts):
        ta, tb = (gen.generate([list(prompt)], params).output_ids[0] for gen in (a, b))
        if ta == tb:
            equal += 1
        elif first_difference is None:
            at = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),  # lengths may differ
                      min(len(ta), len(tb)))
            first_difference = {"prompt": i, "token": at}
    return {"prompts": len(prompts), "identical": equal, "first_difference": first_difference}


def _run(gen: Any, graph: str, feeds: dict[str, np.ndarray], sizes: dict[str, int]) -> dict[str, np.ndarray]:
    import torch

    cache = gen.runner.new_cache(sizes["batch"])
    cache.ensure_capacity(sizes["cache"])
    host = {}
    for name, value in feeds.items():
        kv = kv_input(name)
        if kv is None:
            host[name] = value
        else:
            (cache.k if kv[0] == "key" else cache.v)[kv[1]].copy_(torch.from_numpy(value))
    return {name: _host(value) for name, value in gen.runner.infer(graph, host, cache).items()}


def _host(value: Any) -> np.ndarray:
    """numpy, from numpy, an ONNX Runtime OrtValue or a (CUDA) torch tensor."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).numpy()
    return value.numpy()


def _difference(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    if x.shape != y.shape:
        raise EngineError(f"the engines' outputs have different shapes: {x.shape} and {y.shape}")
    if np.issubdtype(x.dtype, np.floating):
        d = np.abs(x.astype(np.float64) - y.astype(np.float64))
        return {"max_abs_diff": float(d.max(initial=0.0)), "mean_abs_diff": float(d.mean()) if d.size else 0.0}
    return {"differing": int((x != y).sum()), "of": int(x.size)}
