"""--target resolution (directory, local Hugging Face cache, random weights) and checked target loading."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlite_trt.config import TargetSpec
from dlite_trt.errors import CheckpointError, ConfigError, TargetNotFoundError
from dlite_trt.presets import PRESETS
from dlite_trt.targets import (
    TargetSource,
    build_hf_model,
    load_tokenizer,
    read_target_spec,
    resolve_target,
    stop_token_ids,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits, like a real snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face cache in tmp_path, and no way to reach the Hub.

    huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE into huggingface_hub.constants
    at import time and snapshot_download looks up ``constants.HF_HUB_CACHE`` at call time, so the
    module attributes are patched as well as the environment.
    """
    import huggingface_hub.constants as constants
    from huggingface_hub import hf_api

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("dlite-trt must never contact the Hugging Face Hub")

    for method in ("repo_info", "model_info", "list_repo_tree", "list_repo_files"):
        monkeypatch.setattr(hf_api.HfApi, method, no_network)
    monkeypatch.chdir(tmp_path)  # a preset name is never an existing relative path here
    return cache


def fake_snapshot(cache: Path, repo: str, config: dict, commit: str = COMMIT) -> Path:
    """The layout huggingface_hub writes: models--Org--Name/{refs/main, snapshots/<commit>/...}."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def target_copy(tiny_pair, tmp_path) -> Path:
    """A private copy of the session's tiny target directory (never modify the fixture's files)."""
    target_dir, _ = tiny_pair
    return Path(shutil.copytree(target_dir, tmp_path / "target"))


# ---------------------------------------------------------------------------------------------
# resolve_target
# ---------------------------------------------------------------------------------------------

def test_resolve_existing_directory(tiny_pair):
    target_dir, _ = tiny_pair
    src = resolve_target(target_dir)
    assert isinstance(src, TargetSource)
    assert src.path == target_dir
    assert not src.is_random
    assert src.name == str(target_dir)
    raw = json.loads((target_dir / "config.json").read_text())
    assert src.spec == TargetSpec.from_hf_config(raw)
    assert src.spec == read_target_spec(target_dir)
    assert (src.spec.hidden_size, src.spec.num_hidden_layers, src.spec.vocab_size) == (
        raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"])
    # a str works as well as a Path
    assert resolve_target(str(target_dir)) == src


def test_preset_not_in_empty_cache(hf_cache):
    with pytest.raises(TargetNotFoundError) as ei:
        resolve_target("qwen3-8b")
    msg = str(ei.value)
    assert "qwen3-8b" in msg and "Qwen/Qwen3-8B" in msg
    assert "not in the local Hugging Face cache" in msg
    assert "never downloads" in msg
    assert "--random-weights" in msg
    assert list(hf_cache.iterdir()) == []  # nothing was fetched or created


def test_preset_with_random_weights(hf_cache):
    src = resolve_target("qwen3-8b", random_weights=True)
    assert src.path is None and src.is_random
    assert src.name == "qwen3-8b"
    s = src.spec
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
            s.intermediate_size, s.vocab_size, s.tie_word_embeddings) == (4096, 36, 32, 8, 12288, 151936, False)
    assert s.head_dim == 128
    assert s == PRESETS["qwen3-8b"].spec
    # preset names are case-insensitive
    assert resolve_target("Qwen3-8B", random_weights=True) == src


def test_preset_found_in_local_cache(hf_cache):
    preset = PRESETS["qwen3-0.6b"]
    config = preset.spec.to_hf_config()
    config["max_position_embeddings"] = 32768  # a value only the cached file has
    snapshot = fake_snapshot(hf_cache, preset.hf_repo, config)
    src = resolve_target("qwen3-0.6b")
    assert src.path is not None and not src.is_random
    assert src.path.resolve() == snapshot.resolve()
    assert src.name == "qwen3-0.6b"
    assert src.spec == dataclasses.replace(preset.spec, max_position_embeddings=32768)
    assert src.spec.tie_word_embeddings is True and src.spec.hidden_size == 1024


def test_cache_of_another_preset_does_not_count(hf_cache):
    fake_snapshot(hf_cache, PRESETS["qwen3-0.6b"].hf_repo, PRESETS["qwen3-0.6b"].spec.to_hf_config())
    with pytest.raises(TargetNotFoundError, match="never downloads"):
        resolve_target("qwen3-1.7b")


def test_cache_ref_without_snapshot_is_not_found(hf_cache):
    snapshot = fake_snapshot(hf_cache, PRESETS["qwen3-0.6b"].hf_repo, PRESETS["qwen3-0.6b"].spec.to_hf_config())
    shutil.rmtree(snapshot)
    with pytest.raises(TargetNotFoundError, match="not in the local Hugging Face cache"):
        resolve_target("qwen3-0.6b")


def test_unknown_name_lists_presets(hf_cache):
    with pytest.raises(TargetNotFoundError) as ei:
        resolve_target("qwen3-9000b")
    msg = str(ei.value)
    assert "'qwen3-9000b' is neither a directory, a .gguf file nor a known preset" in msg
    for name in PRESETS:
        assert name in msg


def test_unknown_name_with_random_weights_lists_presets(hf_cache):
    with pytest.raises(TargetNotFoundError, match="qwen3-8b"):
        resolve_target("llama-3-8b", random_weights=True)


def test_a_file_is_not_a_target(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(TargetNotFoundError, match="is a file"):
        resolve_target(f)


def test_directory_with_an_unsupported_architecture(tmp_path):
    d = tmp_path / "mistral"
    d.mkdir()
    raw = PRESETS["qwen3-8b"].spec.to_hf_config()
    raw.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as ei:
        resolve_target(d)
    msg = str(ei.value)
    assert "model_type is 'mistral'" in msg and "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg
    assert str(d / "config.json") in msg


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        resolve_target(tmp_path)


def test_directory_with_invalid_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        resolve_target(tmp_path)


def test_random_weights_with_a_directory(tiny_pair):
    target_dir, _ = tiny_pair
    with pytest.raises(TargetNotFoundError) as ei:
        resolve_target(target_dir, random_weights=True)
    msg = str(ei.value)
    assert "--random-weights" in msg and "preset names" in msg and str(target_dir) in msg


# ---------------------------------------------------------------------------------------------
# build_hf_model
# ---------------------------------------------------------------------------------------------

def test_build_hf_model_loads_directory_weights(target_copy):
    src = resolve_target(target_copy)
    model = build_hf_model(src, torch.float32)
    state = load_file(str(target_copy / "model.safetensors"))
    params = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(params[name], tensor), name
    assert not model.training
    assert model.config.num_hidden_layers == src.spec.num_hidden_layers


def test_build_hf_model_random_source_is_seeded():
    from dlite_trt.tiny_models import tiny_target_spec

    src = TargetSource(tiny_target_spec(64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=16, intermediate_size=64), None, "tiny")
    a, b = build_hf_model(src, torch.float32, seed=5), build_hf_model(src, torch.float32, seed=5)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name
    assert a.config.hidden_size == 32 and a.config.vocab_size == 64
    assert build_hf_model(src, torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16


def test_build_hf_model_truncated_weights(target_copy):
    path = target_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    src = resolve_target(target_copy)
    with pytest.raises(CheckpointError) as ei:
        build_hf_model(src, torch.float32)
    msg = str(ei.value)
    assert str(target_copy) in msg
    assert "truncated or corrupt" in msg


def test_build_hf_model_missing_weight(target_copy):
    path = target_copy / "model.safetensors"
    state = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight"
    del state[name]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        build_hf_model(resolve_target(target_copy), torch.float32)
    msg = str(ei.value)
    assert "do not match its config.json" in msg
    assert "missing_keys" in msg and name in msg


def test_build_hf_model_unexpected_weight(target_copy):
    path = target_copy / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(4, 4)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        build_hf_model(resolve_target(target_copy), torch.float32)
    assert "unexpected_keys" in str(ei.value) and "model.layers.9.mlp.up_proj.weight" in str(ei.value)


def test_build_hf_model_wrong_shape(target_copy):
    path = target_copy / "model.safetensors"
    state = load_file(str(path))
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        build_hf_model(resolve_target(target_copy), torch.float32)
    assert str(target_copy) in str(ei.value)
    assert "model.norm.weight" in str(ei.value)


def test_build_hf_model_nan_weights(target_copy):
    path = target_copy / "model.safetensors"
    state = load_file(str(path))
    state["model.norm.weight"][0] = float("nan")
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"NaN or infinite values in model\.norm\.weight; the file is corrupt"):
        build_hf_model(resolve_target(target_copy), torch.float32)


def test_build_hf_model_missing_weights_file(target_copy):
    (target_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no \*\.safetensors weights"):
        build_hf_model(resolve_target(target_copy), torch.float32)


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_target_spec(tmp_path)


def test_stop_tokens_are_the_union_of_config_generation_config_and_tokenizer(target_copy):
    source = resolve_target(target_copy)
    tok = load_tokenizer(source)
    from_config = set(source.spec.stop_token_ids)
    assert tok.eos_token_id in from_config
    (target_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    got = stop_token_ids(source, tok)
    assert set(got) == from_config | {3, 4} and len(got) == len(set(got))
    (target_copy / "generation_config.json").unlink()
    assert set(stop_token_ids(source, None)) == from_config


def test_stop_tokens_that_are_not_ids_are_an_error(target_copy):
    source = resolve_target(target_copy)
    (target_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(CheckpointError, match=r"end-of-sequence ids \['x'\]"):
        stop_token_ids(source, None)
