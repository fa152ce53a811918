"""dlite_v1 draft checkpoints: bit-exact round trips and one clear error per way a checkpoint is bad."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlite_trt.checkpoint import INDEX_NAME, WEIGHTS_NAME, load_draft, load_draft_config, save_draft
from dlite_trt.errors import CheckpointError, IncompatibleDraftError
from helpers import (
    assert_bit_exact,
    draft_config,
    edit_config,
    make_target,
    raises_with,
    random_draft,
    rewrite_weights,
)


@pytest.fixture(scope="module")
def spec():
    _, spec = make_target(64, hidden_size=64)
    return spec


@pytest.fixture(scope="module")
def cfg(spec):
    return draft_config(spec)


@pytest.fixture
def draft(cfg):
    return random_draft(cfg, seed=3)


@pytest.fixture
def ckpt(draft, tmp_path) -> Path:
    """A good single-file checkpoint in tmp_path, to be broken by each test."""
    return save_draft(draft, tmp_path / "draft")


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------

def test_round_trip_single_file_is_bit_exact(draft, ckpt):
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", WEIGHTS_NAME]
    loaded = load_draft(ckpt, dtype=None)
    assert_bit_exact(loaded, draft)
    assert loaded.cfg == draft.cfg
    assert loaded.cfg.to_dict() == draft.cfg.to_dict()
    assert json.loads((ckpt / "config.json").read_text()) == draft.cfg.to_dict()
    assert load_draft_config(ckpt) == draft.cfg
    assert not loaded.training


def test_round_trip_sharded_is_bit_exact(draft, tmp_path):
    total = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
    max_shard = 100_000
    assert total > 3 * max_shard
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=max_shard)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) >= 3
    assert INDEX_NAME in names and WEIGHTS_NAME not in names
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(draft.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == total
    for shard in shards:
        assert shard.endswith(f"-of-{len(shards):05d}.safetensors")
    loaded = load_draft(out, dtype=None)
    assert_bit_exact(loaded, draft)
    assert loaded.cfg == draft.cfg


def test_round_trip_bf16_is_bit_exact(draft, tmp_path):
    bf16 = draft.to(torch.bfloat16)
    out = save_draft(bf16, tmp_path / "bf16")
    with open(out / WEIGHTS_NAME, "rb") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
    assert b'"BF16"' in header and b'"F32"' not in header
    loaded = load_draft(out, dtype=None)
    assert all(t.dtype == torch.bfloat16 for t in loaded.state_dict().values())
    assert_bit_exact(loaded, bf16)
    # the default dtype (fp32) upcasts exactly
    up = load_draft(out)
    for name, tensor in bf16.state_dict().items():
        assert up.state_dict()[name].dtype == torch.float32
        assert torch.equal(up.state_dict()[name], tensor.float()), name


def test_round_trip_sharded_bf16(draft, tmp_path):
    bf16 = draft.to(torch.bfloat16)
    out = save_draft(bf16, tmp_path / "bf16s", max_shard_bytes=50_000)
    assert (out / INDEX_NAME).is_file()
    assert_bit_exact(load_draft(out, dtype=None), bf16)


def test_resave_replaces_stale_shards(draft, tmp_path):
    out = save_draft(draft, tmp_path / "d", max_shard_bytes=100_000)
    save_draft(draft, out)  # now single-file: old shards and index must not linger
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_NAME]
    assert_bit_exact(load_draft(out, dtype=None), draft)


def test_load_with_matching_target(draft, ckpt, spec):
    assert_bit_exact(load_draft(ckpt, dtype=None, target=spec), draft)


# ---------------------------------------------------------------------------------------------
# bad checkpoints: one test per case, type + message fragment
# ---------------------------------------------------------------------------------------------

def test_path_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    with raises_with(CheckpointError, str(missing), "does not exist"):
        load_draft(missing)


def test_path_is_a_file(ckpt):
    with raises_with(CheckpointError, "is a file", "draft's directory", WEIGHTS_NAME):
        load_draft(ckpt / WEIGHTS_NAME)


def test_weights_only_as_a_pickle_are_named_and_never_opened(ckpt):
    (ckpt / WEIGHTS_NAME).unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not opened")  # not even a pickle: opening it would fail otherwise
    with raises_with(CheckpointError, "pytorch_model.bin", "never loads", "safetensors"):
        load_draft(ckpt)


def test_no_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with raises_with(CheckpointError, "has no config.json"):
        load_draft(ckpt)


def test_config_json_not_valid_json(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 64, "vocab_size": ')
    with raises_with(CheckpointError, "config.json is not valid JSON", "corrupt"):
        load_draft(ckpt)


def test_no_weights_file(ckpt):
    (ckpt / WEIGHTS_NAME).unlink()
    with raises_with(CheckpointError, f"has no {WEIGHTS_NAME} and no {INDEX_NAME}", "no weights"):
        load_draft(ckpt)


def test_missing_weight(ckpt):
    rewrite_weights(ckpt, lambda s: s.pop("layers.1.mlp.up_proj.weight"))
    with raises_with(CheckpointError, "missing 1 weight(s)", "layers.1.mlp.up_proj.weight"):
        load_draft(ckpt)


def test_unexpected_weight(ckpt):
    def add(state):
        state["embed_tokens.weight"] = torch.zeros(64, 64)
    rewrite_weights(ckpt, add)
    with raises_with(CheckpointError, "1 unexpected weight(s)", "embed_tokens.weight"):
        load_draft(ckpt)


def test_prefixed_state_dict_is_rejected(ckpt):
    rewrite_weights(ckpt, lambda s: s.update({f"model.{k}": s.pop(k) for k in list(s)}))
    with raises_with(CheckpointError, "is missing", "weight(s)", "no prefix"):
        load_draft(ckpt)


def test_wrong_shape(ckpt):
    def shrink(state):
        state["sequential_head.state_proj.weight"] = torch.zeros(64, 64)
    rewrite_weights(ckpt, shrink)
    with raises_with(CheckpointError, "shape does not match config.json",
                     "sequential_head.state_proj.weight: file (64, 64), config needs (128, 128)"):
        load_draft(ckpt)


def test_integer_weight(ckpt):
    rewrite_weights(ckpt, lambda s: s.update({"norm.weight": s["norm.weight"].to(torch.int32)}))
    with raises_with(CheckpointError, "non-floating-point weights", "norm.weight", "torch.int32"):
        load_draft(ckpt)


def test_nan_or_infinite_weights_are_refused_by_name(ckpt):
    """A diverged run's checkpoint would build and run, proposing nothing useful, without a word."""
    def poison(state):
        state["norm.weight"][3] = float("nan")
        state["sequential_head.output_proj.weight"][0, 0] = float("inf")
    rewrite_weights(ckpt, poison)
    with raises_with(CheckpointError, "NaN or infinite values in", "norm.weight", "sequential_head.output_proj.weight",
                     "an earlier snapshot"):
        load_draft(ckpt)


def test_mixed_dtypes_need_a_cast(ckpt):
    rewrite_weights(ckpt, lambda s: s.update({"norm.weight": s["norm.weight"].to(torch.bfloat16)}))
    with raises_with(CheckpointError, "mixes weight dtypes", "torch.bfloat16", "torch.float32", "load it with a dtype"):
        load_draft(ckpt, dtype=None)
    assert load_draft(ckpt, dtype=torch.float32).norm.weight.dtype == torch.float32


def test_wrong_architecture_version(ckpt):
    edit_config(ckpt, lambda r: r["dlite_config"].update(architecture_version="dlite_v2"))
    with raises_with(CheckpointError, str(ckpt), "architecture_version is 'dlite_v2'", "dlite_v1"):
        load_draft(ckpt)


def test_wrong_model_role(ckpt):
    edit_config(ckpt, lambda r: r["dlite_config"].update(model_role="history_aware_teacher"))
    with raises_with(CheckpointError, "model_role is 'history_aware_teacher'", "pivot_q_student"):
        load_draft(ckpt)


def test_target_layer_ids_differ_from_fixed_selection(ckpt):
    edit_config(ckpt, lambda r: r["dlite_config"].update(target_layer_ids=[0, 2, 3]))
    with raises_with(CheckpointError, "target_layer_ids [0, 2, 3] differ from the fixed dlite_v1 selection",
                     "[0, 1, 3]"):
        load_draft(ckpt)


def test_missing_dlite_config(ckpt):
    edit_config(ckpt, lambda r: r.pop("dlite_config"))
    with raises_with(CheckpointError, "no dlite_config"):
        load_draft(ckpt)


def test_mask_token_id_outside_target_embedding(ckpt, spec):
    edit_config(ckpt, lambda r: r["dlite_config"].update(mask_token_id=spec.vocab_size))
    assert load_draft_config(ckpt).mask_token_id == 64  # fine on its own...
    with raises_with(IncompatibleDraftError, "mask_token_id=64 is outside the target's embedding", "64 rows"):
        load_draft(ckpt, target=spec)  # ...but not for this target


@pytest.mark.parametrize(("target_change", "fragments"), [
    ({"hidden_size": 128}, ["draft hidden_size=64", "the target has 128"]),
    ({"vocab_size": 96}, ["draft vocab_size=64", "the target has 96"]),
    ({"num_hidden_layers": 6}, ["draft num_target_layers=4", "the target has 6"]),
], ids=["hidden_size", "vocab_size", "num_target_layers"])
def test_draft_does_not_fit_target(ckpt, spec, target_change, fragments):
    other = dataclasses.replace(spec, **target_change)
    with raises_with(IncompatibleDraftError, "the draft does not fit the target", *fragments):
        load_draft(ckpt, target=other)


def test_truncated_safetensors(ckpt):
    path = ckpt / WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with raises_with(CheckpointError, WEIGHTS_NAME, "not a readable safetensors file", "truncated or corrupt"):
        load_draft(ckpt)


def _garbage(data: bytes) -> bytes:
    return bytes((i * 131 + 7) % 256 for i in range(len(data)))


def _junk_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[:8] + b"!" * n + data[8 + n:]


def _huge_header_length(data: bytes) -> bytes:
    return (2**62).to_bytes(8, "little") + data[8:]


def _inconsistent_header(data: bytes) -> bytes:
    return data.replace(b'"F32"', b'"F64"', 1)  # valid JSON, offsets no longer fit the dtype


@pytest.mark.parametrize("corrupt", [_garbage, _junk_header, _huge_header_length, _inconsistent_header,
                                     lambda d: b"", lambda d: d[:-1], lambda d: d + b"\0" * 16],
                         ids=["garbage", "junk_header", "huge_header_length", "inconsistent_header",
                              "empty", "last_byte_cut", "trailing_bytes"])
def test_corrupt_safetensors(ckpt, corrupt):
    path = ckpt / WEIGHTS_NAME
    path.write_bytes(corrupt(path.read_bytes()))
    with raises_with(CheckpointError, "not a readable safetensors file", "truncated or corrupt"):
        load_draft(ckpt)


def test_sharded_index_names_missing_shard(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    shards[1].unlink()
    with raises_with(CheckpointError, f"names shard {shards[1].name}", "missing", "incomplete"):
        load_draft(out)


def test_sharded_index_corrupt(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=100_000)
    (out / INDEX_NAME).write_text('{"metadata": {}}')
    with raises_with(CheckpointError, INDEX_NAME, "is corrupt", "weight_map"):
        load_draft(out)


def test_sharded_shard_lacks_assigned_weight(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((out / INDEX_NAME).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    state = load_file(str(out / shard))
    del state[name]
    save_file(state, str(out / shard), metadata={"format": "pt"})
    with raises_with(CheckpointError, shard, repr(name), "assigns to it"):
        load_draft(out)


def test_sharded_truncated_shard(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=100_000)
    shard = sorted(out.glob("model-*-of-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with raises_with(CheckpointError, shard.name, "truncated or corrupt"):
        load_draft(out)


# ---------------------------------------------------------------------------------------------
# a failed load loses nothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["truncated", "wrong_shape", "bad_config", "incompatible_target"])
def test_failed_load_leaves_files_unchanged(ckpt, spec, case):
    if case == "truncated":
        data = (ckpt / WEIGHTS_NAME).read_bytes()
        (ckpt / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
        exc, kwargs = CheckpointError, {}
    elif case == "wrong_shape":
        rewrite_weights(ckpt, lambda s: s.update({"norm.weight": torch.ones(32)}))
        exc, kwargs = CheckpointError, {}
    elif case == "bad_config":
        edit_config(ckpt, lambda r: r["dlite_config"].update(model_role="teacher"))
        exc, kwargs = CheckpointError, {}
    else:
        exc, kwargs = IncompatibleDraftError, {"target": dataclasses.replace(spec, hidden_size=128)}
    before = files_of(ckpt)
    with pytest.raises(exc):
        load_draft(ckpt, **kwargs)
    assert files_of(ckpt) == before


def test_failed_sharded_load_leaves_files_unchanged(draft, tmp_path):
    out = save_draft(draft, tmp_path / "sharded", max_shard_bytes=100_000)
    sorted(out.glob("model-*-of-*.safetensors"))[0].unlink()
    before = files_of(out)
    with pytest.raises(CheckpointError):
        load_draft(out)
    assert files_of(out) == before
