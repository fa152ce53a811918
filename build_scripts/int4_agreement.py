"""Teacher-forced top-1 agreement of int4 engines with the fp32 model their target dequantizes to.

Runs each engine's ``decode`` graph over 256-token chunks of four standard-library files (every
position's next token, greedy) and transformers' fp32 forward of the engine's target over the same
chunks, and prints, per engine, the share of positions whose argmax agrees. With ``--ort-genai
DIR`` also onnxruntime-genai's model of the target (its builder's ``model.onnx``, run by plain ONNX
Runtime on an empty cache). A measure of how far a weight format moves the model (docs/engine.md,
int4 weights), not of losslessness: every engine's speculative output equals its own greedy.

    python build_scripts/int4_agreement.py ENGINE [ENGINE ...] [--ort-genai DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json

import numpy as np

CHUNK = 256
OFFSET = 1000  # tokens skipped at each file's start (licence headers, imports)


def _chunks(tokenizer) -> list[list[int]]:
    import email.message
    import http.client
    import json.decoder

    import click.core

    chunks = []
    for module in (click.core, json.decoder, email.message, http.client):
        ids = tokenizer.encode(inspect.getsource(module))[OFFSET: OFFSET + CHUNK]
        if len(ids) == CHUNK:
            chunks.append(ids)
    return chunks


def _engine_argmax(engine_dir: str, chunks: list[list[int]]) -> tuple[str, list[np.ndarray]]:
    import onnxruntime as ort

    from dlite_trt.engine.manifest import load_manifest
    from dlite_trt.export.contract import dummy_inputs
    from dlite_trt.runtime.ort_runner import run_in_place

    manifest = load_manifest(engine_dir)
    spec = manifest.contract["decode"]
    session = ort.InferenceSession(f"{engine_dir}/{manifest.graphs['decode']['runtime']}",
                                   providers=["CPUExecutionProvider"])
    out = []
    for ids in chunks:
        feed = dummy_inputs(spec, {"batch": 1, "cache": CHUNK + 128, "chunk": CHUNK, "outputs": CHUNK},
                            vocab_size=manifest.target_spec.vocab_size, rng=np.random.default_rng(0))
        feed |= {"input_ids": np.array([ids], np.int64), "past_len": np.zeros(1, np.int64),
                 "output_index": np.arange(CHUNK)[None]}
        out.append(run_in_place(session, spec, feed)["next_tokens"][0])
    return manifest.weights.describe(manifest.dtype), out


def _ort_genai_argmax(model_dir: str, chunks: list[list[int]], kv_heads: int, head_dim: int) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(f"{model_dir}/model.onnx", providers=["CPUExecutionProvider"])
    out = []
    for ids in chunks:
        feed = {}
        for i in session.get_inputs():
            if i.name == "input_ids":
                feed[i.name] = np.array([ids], np.int64)
            elif i.name == "attention_mask":
                feed[i.name] = np.ones((1, CHUNK), np.int64)
            else:  # past_key_values.{i}.key/value [B, kvH, past, D]: empty
                feed[i.name] = np.zeros((1, kv_heads, 0, head_dim), np.float32)
        out.append(session.run(["logits"], feed)[0][0].argmax(-1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="+", help="int4 (or any ONNX Runtime) engine directories of one target")
    parser.add_argument("--ort-genai", help="an onnxruntime-genai model directory of the same target")
    args = parser.parse_args()

    import torch
    import transformers

    from dlite_trt.engine.load import load_engine
    from dlite_trt.engine.manifest import load_manifest
    from dlite_trt.targets import resolve_target

    first = load_manifest(args.engines[0])
    source = resolve_target(first.target_name, progress=False)
    chunks = _chunks(load_engine(args.engines[0]).tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(source.path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        truth = [model(torch.tensor([ids])).logits[0].argmax(-1).numpy() for ids in chunks]
    rows = [(engine, *_engine_argmax(engine, chunks)) for engine in args.engines]
    if args.ort_genai:
        spec = first.target_spec
        rows.append((args.ort_genai, "onnxruntime-genai model",
                     _ort_genai_argmax(args.ort_genai, chunks, spec.num_key_value_heads, spec.head_dim)))
    for where, weights, got in rows:
        agree = sum(int((g == t).sum()) for g, t in zip(got, truth, strict=True))
        positions = CHUNK * len(chunks)
        print(json.dumps({"model": where, "weights": weights, "top1_agreement_with_fp32": round(agree / positions, 4),
                          "positions": positions}))


if __name__ == "__main__":
    main()
