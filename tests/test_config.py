"""DraftConfig / TargetSpec / the fixed layer selection, against DESIGN 1.1."""

from __future__ import annotations

import copy
import json

import pytest

from dlite_trt.config import DraftConfig, TargetSpec, select_target_layer_ids
from dlite_trt.errors import ConfigError
from dlite_trt.presets import PRESETS

# ---------------------------------------------------------------------------------------------
# select_target_layer_ids: expected values derived by hand from DESIGN 1.1:
#   {0, N-1} + {1 + round(f * (N-3)) : f = i/(S-3), i = 0..S-3}   (f = 0.5 when S-2 == 1),
#   Python round (banker's rounding: 0.5 -> 0, 2.5 -> 2, 12.5 -> 12, 16.5 -> 16).
# ---------------------------------------------------------------------------------------------
LAYER_CASES = [
    # N=36, S=5: f in {0, .5, 1}, N-3=33: 1+0, 1+round(16.5)=1+16, 1+33
    (36, 5, [0, 1, 17, 34, 35]),
    # N=28, S=4: f in {0, 1}, N-3=25: 1, 26
    (28, 4, [0, 1, 26, 27]),
    # N=4, S=3: f=.5, N-3=1: 1+round(0.5)=1+0
    (4, 3, [0, 1, 3]),
    # S=2: just the first and the last layer
    (36, 2, [0, 35]),
    (28, 2, [0, 27]),
    (4, 2, [0, 3]),
    (2, 2, [0, 1]),
    # N=28, S=5: 1+round(12.5)=1+12
    (28, 5, [0, 1, 13, 26, 27]),
    # N=40, S=5: 1+round(18.5)=1+18
    (40, 5, [0, 1, 19, 38, 39]),
    # N=64, S=5: 1+round(30.5)=1+30
    (64, 5, [0, 1, 31, 62, 63]),
    # N=8, S=5: 1+round(2.5)=1+2 (half-up would give 4)
    (8, 5, [0, 1, 3, 6, 7]),
    # N=36, S=6: f in {0, 1/3, 2/3, 1}, N-3=33: 1, 12, 23, 34
    (36, 6, [0, 1, 12, 23, 34, 35]),
    # N=28, S=6: 25/3=8.33 -> 8, 50/3=16.67 -> 17: 1, 9, 18, 26
    (28, 6, [0, 1, 9, 18, 26, 27]),
    # N=28, S=7: f=i/4, 25f = 0, 6.25, 12.5, 18.75, 25 -> 0, 6, 12, 19, 25
    (28, 7, [0, 1, 7, 13, 20, 26, 27]),
    # N=3, S=3: 1+round(0.5*0)=1
    (3, 3, [0, 1, 2]),
    # S=N selects every layer
    (4, 4, [0, 1, 2, 3]),
    (6, 6, [0, 1, 2, 3, 4, 5]),
]


@pytest.mark.parametrize(("n", "s", "expected"), LAYER_CASES)
def test_select_target_layer_ids_matches_design_formula(n, s, expected):
    got = select_target_layer_ids(n, s)
    assert isinstance(got, tuple)
    assert list(got) == expected
    assert len(got) == s


@pytest.mark.parametrize(("n", "s", "fragment"), [
    (1, 2, "at least 2 layers"),
    (36, 1, "chs_num_layers must be in [2, 36]"),
    (4, 5, "chs_num_layers must be in [2, 4]"),
])
def test_select_target_layer_ids_rejects_impossible_layouts(n, s, fragment):
    with pytest.raises(ConfigError) as ei:
        select_target_layer_ids(n, s)
    assert fragment in str(ei.value)


# ---------------------------------------------------------------------------------------------
# DraftConfig.from_dict / to_dict
# ---------------------------------------------------------------------------------------------

def official_raw() -> dict:
    """A config.json as the official Qwen3-8B-DLite release writes it (transformers 4.57.1)."""
    return {
        "architectures": ["DLiteDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 8,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": True,
        "vocab_size": 151936,
        "dlite_config": {
            "architecture_version": "dlite_v1",
            "model_role": "pivot_q_student",
            "anchor_group_size": 2,
            "chs_num_layers": 5,
            "target_layer_ids": [0, 1, 17, 34, 35],
            "sequential_head": "rnn",
            "sequential_rank": 256,
            "mask_token_id": 151669,
            "teacher_window": 16,  # a key dlite-trt does not model
        },
    }


def newer_raw() -> dict:
    """The same draft as a newer transformers writes it: rope_parameters instead of rope_theta."""
    raw = official_raw()
    del raw["rope_theta"], raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    raw["transformers_version"] = "5.24.0"
    return raw


def test_from_dict_reads_official_config():
    cfg = DraftConfig.from_dict(official_raw())
    assert cfg.hidden_size == 4096
    assert cfg.vocab_size == 151936
    assert cfg.num_hidden_layers == 5
    assert cfg.num_attention_heads == 32
    assert cfg.num_key_value_heads == 8
    assert cfg.head_dim == 128
    assert cfg.intermediate_size == 12288
    assert cfg.num_target_layers == 36
    assert cfg.target_layer_ids == (0, 1, 17, 34, 35)
    assert cfg.chs_num_layers == 5
    assert cfg.block_size == 8 and cfg.num_proposals == 7
    assert cfg.anchor_group_size == 2
    assert cfg.sequential_rank == 256
    assert cfg.sequential_head == "rnn"
    assert cfg.mask_token_id == 151669
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.attention_bias is False


def test_from_dict_accepts_rope_parameters_and_top_level_rope_theta_alike():
    old = DraftConfig.from_dict(official_raw())
    new = DraftConfig.from_dict(newer_raw())
    assert old.rope_theta == new.rope_theta == 1_000_000.0
    assert isinstance(new.rope_theta, float)
    assert old == new


def test_rope_parameters_with_a_different_theta_is_read():
    raw = newer_raw()
    raw["rope_parameters"]["rope_theta"] = 5e5
    assert DraftConfig.from_dict(raw).rope_theta == 5e5


@pytest.mark.parametrize("make_raw", [official_raw, newer_raw], ids=["official", "newer"])
def test_to_dict_from_dict_round_trip(make_raw):
    raw = make_raw()
    cfg = DraftConfig.from_dict(copy.deepcopy(raw))
    out = cfg.to_dict()
    again = DraftConfig.from_dict(out)
    assert again == cfg
    assert again.to_dict() == out
    # the whole file survives a load/save (1000000 == 1000000.0 for the int rope_theta); a newer
    # file also gets the top-level rope_theta the official layout carries (to_dict's contract)
    expected = {**raw, "rope_theta": 1_000_000.0} if "rope_parameters" in raw else raw
    assert out == expected
    # and it is JSON serialisable as is
    assert json.loads(json.dumps(out)) == out


def test_to_dict_preserves_unknown_keys():
    raw = official_raw()
    raw["my_custom_key"] = {"nested": [1, 2, 3]}
    cfg = DraftConfig.from_dict(raw)
    out = cfg.to_dict()
    for key in ("torch_dtype", "transformers_version", "use_cache", "initializer_range", "my_custom_key",
                "bos_token_id", "eos_token_id", "max_position_embeddings", "hidden_act"):
        assert out[key] == raw[key], key
    assert out["dlite_config"]["teacher_window"] == 16
    # rope_parameters read from a newer file is kept beside the top-level rope_theta
    out_new = DraftConfig.from_dict(newer_raw()).to_dict()
    assert out_new["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert out_new["rope_theta"] == 1_000_000.0


def test_to_dict_writes_official_layout():
    out = DraftConfig.from_dict(newer_raw()).to_dict()
    assert out["architectures"] == ["DLiteDraftModel"]
    assert out["model_type"] == "qwen3"
    d = out["dlite_config"]
    assert d["architecture_version"] == "dlite_v1"
    assert d["model_role"] == "pivot_q_student"
    assert d["chs_num_layers"] == 5
    assert d["target_layer_ids"] == [0, 1, 17, 34, 35]


def test_for_target_uses_fixed_selection():
    spec = PRESETS["qwen3-8b"].spec
    cfg = DraftConfig.for_target(spec, mask_token_id=151669)
    assert cfg.target_layer_ids == (0, 1, 17, 34, 35)
    assert cfg.hidden_size == 4096 and cfg.vocab_size == 151936 and cfg.num_target_layers == 36
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def _edit(raw: dict, path: tuple[str, ...], value) -> dict:
    obj = raw
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    return raw


@pytest.mark.parametrize(("path", "value", "fragments"), [
    (("dlite_config", "architecture_version"), "dlite_v2",
     ["architecture_version is 'dlite_v2'", "expected 'dlite_v1'"]),
    (("dlite_config", "architecture_version"), None, ["architecture_version is None", "dlite_v1"]),
    (("dlite_config", "model_role"), "teacher", ["model_role is 'teacher'", "pivot_q_student"]),
    (("dlite_config", "target_layer_ids"), [0, 1, 18, 34, 35],
     ["target_layer_ids [0, 1, 18, 34, 35] differ from the fixed dlite_v1 selection", "[0, 1, 17, 34, 35]"]),
    (("dlite_config", "target_layer_ids"), [0, 9, 18, 27, 35], ["differ from the fixed dlite_v1 selection"]),
    (("dlite_config", "sequential_head"), "lstm", ["sequential_head 'lstm' is not supported", "rnn"]),
    (("dlite_config", "sequential_head"), "mlp", ["sequential_head 'mlp' is not supported"]),
    (("dlite_config", "chs_num_layers"), 4, ["chs_num_layers=4", "must agree"]),
    (("rope_scaling",), {"rope_type": "yarn", "factor": 4.0}, ["rope_type 'yarn' is not supported"]),
    (("rope_scaling",), {"type": "linear", "factor": 2.0}, ["rope_type 'linear' is not supported"]),
    (("block_size",), 1, ["block_size must be an int in 2..64"]),
    (("block_size",), 10000, ["block_size must be an int in 2..64", "got 10000"]),
    (("num_key_value_heads",), 5, ["not a multiple of num_key_value_heads=5"]),
    (("dlite_config", "mask_token_id"), -1, ["mask_token_id must be a non-negative int"]),
])
def test_from_dict_rejects(path, value, fragments):
    raw = _edit(official_raw(), path, value)
    with pytest.raises(ConfigError) as ei:
        DraftConfig.from_dict(raw)
    msg = str(ei.value)
    for fragment in fragments:
        assert fragment in msg, msg


def test_from_dict_rejects_missing_dlite_config():
    raw = official_raw()
    del raw["dlite_config"]
    with pytest.raises(ConfigError, match="no dlite_config"):
        DraftConfig.from_dict(raw)


def test_from_dict_rejects_a_plain_qwen3_config():
    raw = PRESETS["qwen3-8b"].spec.to_hf_config()
    with pytest.raises(ConfigError, match="not a DLite draft checkpoint"):
        DraftConfig.from_dict(raw)


def test_from_dict_rejects_non_default_rope_parameters():
    raw = newer_raw()
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ConfigError) as ei:
        DraftConfig.from_dict(raw)
    assert "rope_type 'yarn' is not supported" in str(ei.value)
    assert "only default RoPE" in str(ei.value)


def test_from_dict_rejects_missing_rope_theta():
    raw = official_raw()
    del raw["rope_theta"]
    with pytest.raises(ConfigError, match="no rope_theta"):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize(("where", "key"), [(None, "hidden_size"), (None, "num_target_layers"),
                                            (None, "block_size"), ("dlite_config", "sequential_rank"),
                                            ("dlite_config", "mask_token_id")])
def test_from_dict_rejects_missing_required_key(where, key):
    raw = official_raw()
    del (raw[where] if where else raw)[key]
    with pytest.raises(ConfigError) as ei:
        DraftConfig.from_dict(raw)
    assert "missing required keys" in str(ei.value)
    assert repr(key) in str(ei.value)


def test_constructor_validates_too():
    cfg = DraftConfig.from_dict(official_raw())
    with pytest.raises(ConfigError, match="model_role"):
        cfg.replace(model_role="teacher")
    with pytest.raises(ConfigError, match="architecture_version"):
        cfg.replace(architecture_version="dlite_v0")
    with pytest.raises(ConfigError, match="differ from the fixed dlite_v1 selection"):
        cfg.replace(num_target_layers=40)  # ids were chosen for 36 layers
    with pytest.raises(ConfigError, match="sequential_head"):
        cfg.replace(sequential_head="gru")


def test_from_json_file_rejects_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        DraftConfig.from_json_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        DraftConfig.from_json_file(path)


# ---------------------------------------------------------------------------------------------
# TargetSpec
# ---------------------------------------------------------------------------------------------

def test_target_spec_from_hf_config_reads_qwen3():
    raw = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_sliding_window": False,
    }
    spec = TargetSpec.from_hf_config(raw)
    assert spec == PRESETS["qwen3-8b"].spec
    assert spec.stop_token_ids == (151645,)
    # the spec's own HF config reads back to the same spec (rope_parameters form too)
    assert TargetSpec.from_hf_config(spec.to_hf_config()) == spec
    newer = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    newer["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert TargetSpec.from_hf_config(newer) == spec


def test_target_spec_eos_list_becomes_tuple():
    raw = PRESETS["qwen3-0.6b"].spec.to_hf_config()
    raw["eos_token_id"] = [151645, 151643]
    spec = TargetSpec.from_hf_config(raw)
    assert spec.eos_token_id == (151645, 151643)
    assert spec.stop_token_ids == (151645, 151643)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3_moe", "gpt2", None])
def test_target_spec_rejects_unsupported_architectures(model_type):
    raw = PRESETS["qwen3-8b"].spec.to_hf_config()
    raw["model_type"] = model_type
    with pytest.raises(ConfigError) as ei:
        TargetSpec.from_hf_config(raw, where="some/dir/config.json")
    msg = str(ei.value)
    assert f"model_type is {model_type!r}" in msg
    for name in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"):  # what is supported
        assert name in msg
    assert "some/dir/config.json" in msg


def _hf_config(model_type: str, **changes) -> dict:
    """config.json as transformers writes it for a small model of ``model_type``."""
    import transformers

    from dlite_trt.architectures import ARCHITECTURES

    cls = getattr(transformers, ARCHITECTURES[model_type].config_class)
    return {**cls(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, **changes).to_dict(), "model_type": model_type}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_target_spec_reads_each_architecture_as_transformers_does(model_type):
    """head_dim and max positions default as the transformers config classes do; a round trip
    through to_hf_config keeps the spec."""
    import transformers

    from dlite_trt.architectures import ARCHITECTURES

    raw = _hf_config(model_type)
    raw.pop("head_dim", None)  # absent: Qwen3Config says 128, Llama / Qwen2 hidden // heads
    spec = TargetSpec.from_hf_config(raw)
    hf = getattr(transformers, ARCHITECTURES[model_type].config_class)(**raw)
    assert spec.architecture == model_type and spec.arch.hf_class.startswith(type(hf).__name__[:-6])
    assert spec.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert TargetSpec.from_hf_config(spec.to_hf_config()) == spec


def test_target_spec_reads_llama3_rope_scaling_in_both_layouts():
    """transformers 5 (rope_parameters) and 4.x (rope_theta + rope_scaling) configs."""
    from dlite_trt.config import RopeScaling

    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    new = _hf_config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **params})
    old = {k: v for k, v in _hf_config("llama").items() if k != "rope_parameters"}
    old |= {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **params}}
    want = RopeScaling("llama3", **params)
    for raw in (new, old):
        spec = TargetSpec.from_hf_config(raw)
        assert (spec.rope_theta, spec.rope_scaling) == (5e5, want)
        assert TargetSpec.from_hf_config(spec.to_hf_config()) == spec
    del old["rope_scaling"]["low_freq_factor"]
    with pytest.raises(ConfigError, match="low_freq_factor"):
        TargetSpec.from_hf_config(old)


@pytest.mark.parametrize(("model_type", "rope"), [("llama", "yarn"), ("llama", "dynamic"), ("qwen2", "llama3"),
                                                  ("qwen3", "linear")])
def test_target_spec_rejects_rope_types_it_does_not_compile(model_type, rope):
    raw = _hf_config(model_type)
    raw["rope_parameters"] = {"rope_type": rope, "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ConfigError, match=f"rope_type '{rope}' is not supported"):
        TargetSpec.from_hf_config(raw)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("use_sliding_window", True, "sliding-window attention is not supported"),
    ("num_key_value_heads", 5, "not a multiple of num_key_value_heads=5"),
])
def test_target_spec_rejects_unsupported(key, value, fragment):
    raw = PRESETS["qwen3-8b"].spec.to_hf_config()
    raw[key] = value
    with pytest.raises(ConfigError) as ei:
        TargetSpec.from_hf_config(raw)
    assert fragment in str(ei.value)


def test_target_spec_rejects_missing_key():
    raw = PRESETS["qwen3-8b"].spec.to_hf_config()
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="missing required keys"):
        TargetSpec.from_hf_config(raw)


def test_missing_anchor_group_size_is_an_error_that_says_what_to_add():
    raw = official_raw()
    del raw["dlite_config"]["anchor_group_size"]
    with pytest.raises(ConfigError, match='"anchor_group_size": 1'):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize(("key", "value"), [("hidden_act", "gelu"), ("model_type", "llama"),
                                            ("architectures", ["Qwen3ForCausalLM"])])
def test_from_dict_rejects_a_draft_that_is_not_a_qwen3_dlite_model(key, value):
    raw = official_raw()
    raw[key] = value
    with pytest.raises(ConfigError, match=f"{key} is"):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize("value", ["0,1,3", [0, "1", 3], None])
def test_from_dict_rejects_target_layer_ids_that_are_not_a_list_of_ints(value):
    raw = official_raw()
    raw["dlite_config"]["target_layer_ids"] = value
    with pytest.raises(ConfigError, match="target_layer_ids must be a list of ints"):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize(("key", "value"), [("head_dim", None), ("hidden_size", "abc"),
                                            ("num_key_value_heads", None), ("rms_norm_eps", [1e-6]),
                                            ("rope_theta", "big")])
def test_from_dict_rejects_fields_of_the_wrong_type(key, value):
    raw = official_raw()
    raw[key] = value
    with pytest.raises(ConfigError, match=f"{key} must be"):
        DraftConfig.from_dict(raw)
