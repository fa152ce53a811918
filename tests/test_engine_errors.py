"""Engine directories that are missing, corrupt, stale or asked too much: each refused with a clear message.

One engine is built per module from the tiny pair (limits below) and copied into ``tmp_path``
by every test that damages it. Every error is checked for its type (library) or exit code and
clean output (CLI), and for a message that names both the problem and the fix. The limits
under test are read from the engine's manifest and the target's config, never pasted.
The happy paths (input exactly at --max-seq-len, ``generate --engine --json --trace``) are
checked against the PyTorch reference generator, token for token (greedy fp32: exact).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlite_trt.cli import main
from dlite_trt.engine.build import BuildSettings, build_engine
from dlite_trt.engine.load import LoadedEngine, load_engine
from dlite_trt.engine.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    READ_FORMAT_VERSIONS,
    checkpoint_sha256,
    load_manifest,
)
from dlite_trt.errors import DLiteError, EngineError
from dlite_trt.export.contract import EngineLimits
from dlite_trt.runtime.session import SamplingParams

LIMITS = EngineLimits(max_batch=2, max_seq_len=64, max_chunk=16)
PROMPT = [5, 6, 7]


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def engine_dir(tiny_pair, tmp_path_factory) -> Path:
    """The module's one engine (fp32, LIMITS). Never modified: copy it (``engine_copy``) to damage it."""
    out = tmp_path_factory.mktemp("engine") / "engine"
    build_engine(*tiny_pair, out, BuildSettings(backend="onnxruntime", dtype="fp32", limits=LIMITS,
                                                random_weights=False), progress=False)
    return out


@pytest.fixture
def engine_copy(engine_dir, tmp_path) -> Path:
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    return copy


@pytest.fixture(scope="module")
def engine(engine_dir) -> LoadedEngine:
    return load_engine(engine_dir)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """The PyTorch reference generator for the tiny pair (the truth the engine must match)."""
    from dlite_trt.loading import load_pair

    return load_pair(*tiny_pair, dtype="fp32").generator


def flip_byte(path: Path) -> None:
    """Corrupt the middle byte in place; the size stays the same."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def generate_engine(runner: CliRunner, engine_dir: Path, *args: str):
    return runner.invoke(main, ["generate", "--engine", str(engine_dir), *args])


def assert_message(message: str, *fragments: str) -> None:
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def assert_clean_error(result, *fragments: str, exit_code: int) -> None:
    """A CLI run that failed with ``exit_code``, printed ``Error:`` and the fragments, and no traceback."""
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # handled by click, not crashed
    assert "Traceback" not in result.output
    assert "Error:" in result.output
    assert_message(result.output, *fragments)


def assert_engine_error(engine_dir: Path, runner: CliRunner, *fragments: str) -> None:
    """Both ``load_engine`` and ``generate --engine`` refuse the directory with the same message fragments."""
    with pytest.raises(EngineError) as excinfo:
        load_engine(engine_dir)
    assert_message(str(excinfo.value), *fragments)
    result = generate_engine(runner, engine_dir, "--input-ids", "5,6,7", "--max-new-tokens", "2")
    assert_clean_error(result, *fragments, exit_code=1)


# --------------------------------------------------------------------------- the directory and its files


def test_missing_engine_directory(runner, tmp_path):
    missing = tmp_path / "no_such_engine"
    assert_engine_error(missing, runner, str(missing), "does not exist", "dlite-trt build")


def _no_manifest(d: Path) -> None:
    (d / MANIFEST).unlink()


def _manifest_not_json(d: Path) -> None:
    (d / MANIFEST).write_text((d / MANIFEST).read_text()[:-40])  # cut off mid-object, as a crashed write would


def _missing_graph(d: Path) -> None:
    (d / "graphs" / "step.ort.onnx").unlink()


def _truncated_weights(d: Path) -> None:
    path = d / "graphs" / "weights.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flipped_graph(d: Path) -> None:
    flip_byte(d / "graphs" / "step.onnx")  # not loaded by the ORT runner: only the sha256 can catch it


def _edited_target_config(d: Path) -> None:
    path = d / "target" / "config.json"
    text = path.read_text()
    value = json.loads(text)["max_position_embeddings"]
    edited = text.replace(f'"max_position_embeddings": {value}', f'"max_position_embeddings": {value - 1}')
    assert edited != text and len(edited) == len(text)  # same size: only the hash tells
    path.write_text(edited)


CORRUPTIONS = {
    "no_manifest": (_no_manifest, ("no manifest.json", "not an engine directory", "dlite-trt build")),
    "manifest_not_json": (_manifest_not_json, ("manifest.json is not valid JSON", "corrupt", "Rebuild")),
    "missing_file": (_missing_graph, ("graphs/step.ort.onnx is missing", "incomplete", "Rebuild")),
    "truncated_file": (_truncated_weights, ("graphs/weights.bin has", "bytes", "truncated", "Rebuild")),
    "flipped_graph": (_flipped_graph, ("graphs/step.onnx does not match its sha256", "corrupt", "Rebuild")),
    "edited_config": (_edited_target_config, ("target/config.json does not match its sha256", "Rebuild")),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_damaged_engine_is_refused(runner, engine_copy, corruption):
    damage, fragments = CORRUPTIONS[corruption]
    load_manifest(engine_copy)  # the intact copy loads
    damage(engine_copy)
    assert_engine_error(engine_copy, runner, *fragments)


def test_manifest_from_incompatible_version(runner, engine_copy):
    path = engine_copy / MANIFEST
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION
    data["format_version"] = 999
    path.write_text(json.dumps(data))
    assert_engine_error(engine_copy, runner, "engine format 999", f"reads formats {READ_FORMAT_VERSIONS}",
                        "Rebuild the engine", "dlite-trt build")


def test_older_formats_are_refused_with_rebuild(engine_copy):
    """Formats 3-5 had one decode graph that sampled (temperature and uniforms in, for greedy calls
    too); format 6 splits it into "decode" (greedy) and "decode_sampling"; format 7's greedy step takes
    "next_width" (the drafts it makes). So no earlier engine has today's graphs: each is refused with
    the fix named, and a format-7 manifest reads back equal."""
    from dlite_trt.engine.manifest import Manifest

    data = json.loads((engine_copy / MANIFEST).read_text())
    assert data["format_version"] == FORMAT_VERSION == 7 and READ_FORMAT_VERSIONS == (7,)
    assert set(data["graphs"]) == set(data["contract"]) >= {"decode", "decode_sampling"}
    assert "temperature" not in [t["name"] for t in data["contract"]["decode"]["inputs"]]
    assert "next_width" in [t["name"] for t in data["contract"]["step"]["inputs"]]
    for old in (3, 4, 5, 6):
        with pytest.raises(EngineError, match=rf"engine format {old}.*Rebuild the engine"):
            Manifest.from_dict(data | {"format_version": old}, "m.json")
    built = Manifest.from_dict(data, "m.json")
    assert Manifest.from_dict(built.to_dict(), "m.json") == built
    # a manifest whose decode graph still takes a temperature (format 5's) does not pass as format 6
    stale = json.loads(json.dumps(data))
    stale["contract"]["decode"] = stale["contract"]["decode_sampling"]
    with pytest.raises(EngineError, match="I/O contract does not match"):
        Manifest.from_dict(stale, "m.json")


def _edit(data: dict, path: list, value) -> None:
    """Set data[path...] = value, or delete that key when value is DELETE."""
    for key in path[:-1]:
        data = data[key]
    if value is DELETE:
        del data[path[-1]]
    else:
        data[path[-1]] = value


DELETE = object()
MANIFEST_EDITS = {
    "unknown_dtype": (["dtype"], "bf16", ("dtype 'bf16'", "Rebuild")),
    "graph_missing": (["graphs", "step"], DELETE, ("lists graphs", "corrupt", "Rebuild")),
    "contract_missing": (["contract", "step"], DELETE, ("contracts", "corrupt", "Rebuild")),
    "block_size_edited": (["draft", "config", "block_size"], 6, ("I/O contract does not match", "Rebuild")),
    "graph_outside": (["graphs", "step", "runtime"], "../elsewhere/step.onnx", ("not among the manifest's hashed",)),
    "no_file_records": (["files"], {}, ("not among the manifest's hashed", "Rebuild")),
    "graph_without_runtime": (["graphs", "decode", "runtime"], DELETE, ("must record its 'onnx' and 'runtime'",)),
    "weights_not_recorded": (["files", "graphs/weights.bin"], DELETE, ("graphs/weights.bin", "not among")),
}


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_edited_manifest_is_refused(runner, engine_copy, edit):
    """Fields that must agree with each other (and with the files) are checked, with no traceback."""
    path, value, fragments = MANIFEST_EDITS[edit]
    data = json.loads((engine_copy / MANIFEST).read_text())
    _edit(data, path, value)
    (engine_copy / MANIFEST).write_text(json.dumps(data))
    assert_engine_error(engine_copy, runner, *fragments)


def test_file_record_outside_the_engine_is_refused(runner, engine_copy):
    data = json.loads((engine_copy / MANIFEST).read_text())
    data["files"]["../outside.bin"] = {"bytes": 1, "sha256": "0" * 64}
    (engine_copy / MANIFEST).write_text(json.dumps(data))
    assert_engine_error(engine_copy, runner, "outside the engine directory", "Rebuild")


# --------------------------------------------------------------------------- the target and draft it was built from


@pytest.fixture(scope="module")
def other_draft(tiny_pair, tmp_path_factory) -> Path:
    """The tiny draft's config with other random weights."""
    from dlite_trt.checkpoint import load_draft_config
    from dlite_trt.tiny_models import write_random_draft

    out = tmp_path_factory.mktemp("other_draft") / "draft"
    write_random_draft(out, load_draft_config(tiny_pair[1]), seed=12345)
    assert (out / "config.json").read_text() == (tiny_pair[1] / "config.json").read_text()
    assert checkpoint_sha256(out) != checkpoint_sha256(tiny_pair[1])
    return out


@pytest.fixture(scope="module")
def other_target(tiny_pair, tmp_path_factory) -> Path:
    """A copy of the tiny target with one weight changed."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("other_target") / "target"
    shutil.copytree(tiny_pair[0], out)
    (weights,) = sorted(out.glob("*.safetensors"))
    tensors = load_file(weights)
    name = min(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(1.0, dtype=tensors[name].dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    assert checkpoint_sha256(out) != checkpoint_sha256(tiny_pair[0])
    return out


def test_other_draft_is_refused(runner, engine_dir, tiny_pair, other_draft):
    with pytest.raises(EngineError) as excinfo:
        load_engine(engine_dir, draft=other_draft)
    assert_message(str(excinfo.value), "built from a different draft", "rebuild", "dlite-trt build", "--draft")
    result = generate_engine(runner, engine_dir, "--target", str(tiny_pair[0]), "--draft", str(other_draft),
                             "--input-ids", "5,6,7", "--max-new-tokens", "2")
    assert_clean_error(result, "different draft", exit_code=1)


def test_other_target_is_refused(engine_dir, tiny_pair, other_target):
    with pytest.raises(EngineError) as excinfo:
        load_engine(engine_dir, target=other_target, draft=tiny_pair[1])
    assert_message(str(excinfo.value), "built from a different target", "rebuild", "dlite-trt build", "--target")


def test_matching_target_and_draft_are_accepted(engine_dir, tiny_pair, engine):
    checked = load_engine(engine_dir, target=tiny_pair[0], draft=tiny_pair[1])
    params = SamplingParams(max_new_tokens=6)
    out = checked.generator.session([PROMPT]).generate(params).output_ids
    assert out == engine.generator.session([PROMPT]).generate(params).output_ids
    assert len(out[0]) == 6


# --------------------------------------------------------------------------- requests past the build limits


@pytest.mark.parametrize("prompt_len, over", [(3, 1), (LIMITS.max_seq_len + 1, 1), (40, 5)],
                         ids=["new-tokens", "prompt-alone", "chunked-prompt"])
def test_longer_than_max_seq_len_is_refused(engine, prompt_len, over):
    limit = engine.generator.manifest.limits.max_seq_len
    assert limit == LIMITS.max_seq_len
    max_new = limit + over - prompt_len  # prompt + max_new_tokens is `over` tokens past the limit
    with pytest.raises(EngineError) as excinfo:
        engine.generator.session([[5] * prompt_len]).generate(SamplingParams(max_new_tokens=max_new))
    assert_message(str(excinfo.value), f"reach {limit + over} tokens", f"--max-seq-len {limit}",
                   "lower max_new_tokens", "rebuild")


def test_exactly_max_seq_len_matches_reference(engine, reference):
    limits = engine.generator.manifest.limits
    prompt = [(7 * i + 3) % 500 for i in range(40)]  # three prefill chunks of at most max_chunk=16
    assert len(prompt) > 2 * limits.max_chunk
    params = SamplingParams(max_new_tokens=limits.max_seq_len - len(prompt))  # no stop tokens: all of them
    got = engine.generator.session([prompt]).generate(params)
    want = reference.session([prompt]).generate(params)
    assert len(got.output_ids[0]) == params.max_new_tokens
    assert got.output_ids == want.output_ids
    assert got.acceptance_lengths(0) == want.acceptance_lengths(0)


def test_batch_larger_than_max_batch_is_refused(engine):
    max_batch = engine.generator.manifest.limits.max_batch
    engine.generator.session([PROMPT] * max_batch).generate(SamplingParams(max_new_tokens=2))  # at the limit: fine
    with pytest.raises(EngineError) as excinfo:
        engine.generator.session([PROMPT] * (max_batch + 1))
    assert_message(str(excinfo.value), f"{max_batch + 1} sequences", f"--max-batch {max_batch}", "split the batch",
                   "rebuild")


@pytest.mark.parametrize("bad", [-1, 0, 100000], ids=["negative", "vocab", "far"])
def test_token_ids_outside_vocabulary_are_refused(engine, bad):
    vocab = engine.generator.spec.vocab_size
    bad = bad + vocab if bad >= 0 else bad  # 0 -> exactly vocab_size, the first id past the end
    with pytest.raises(DLiteError) as excinfo:
        engine.generator.session([[5, bad, 6]])
    assert_message(str(excinfo.value), "outside the target vocabulary", f"[0, {vocab})", str(bad),
                   "target's tokenizer")


# --------------------------------------------------------------------------- dlite-trt build


def build_args(tiny_pair, out: Path, *extra: str) -> list[str]:
    return ["build", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--out", str(out), "--quiet",
            *extra]


def test_build_refuses_to_overwrite_a_non_engine_directory(runner, tiny_pair, tmp_path):
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("keep me\n")
    (precious / "sub" / "data.bin").write_bytes(bytes(range(256)))
    before = tree(precious)
    result = runner.invoke(main, build_args(tiny_pair, precious))
    assert_clean_error(result, f"--out {precious}", "not an engine directory", "refusing to overwrite",
                       "new or empty directory", exit_code=1)
    assert tree(precious) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]  # no partial build left beside it


def test_rebuild_replaces_an_engine_directory(runner, tiny_pair, engine, engine_copy):
    """A rebuild replaces the whole engine directory: where it also holds files that are not the
    engine's (notes, bench results), it refuses before any work and loses nothing; else it replaces it."""
    (engine_copy / "NOTES.md").write_text("the user's\n")
    (engine_copy / "bench-results").mkdir()
    before = tree(engine_copy)
    new = EngineLimits(max_batch=LIMITS.max_batch, max_seq_len=LIMITS.max_seq_len // 2, max_chunk=LIMITS.max_chunk // 2)
    args = build_args(tiny_pair, engine_copy, "--max-batch", str(new.max_batch), "--max-seq-len", str(new.max_seq_len),
                      "--max-chunk", str(new.max_chunk))
    assert_clean_error(runner.invoke(main, args), f"--out {engine_copy}", "NOTES.md, bench-results",
                       "a rebuild would delete", "move them", exit_code=1)
    assert tree(engine_copy) == before and (engine_copy / "bench-results").is_dir()
    (engine_copy / "NOTES.md").unlink()
    (engine_copy / "bench-results").rmdir()
    result = runner.invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert sorted(p.name for p in engine_copy.parent.iterdir()) == ["engine"]  # no backup or partial left
    assert load_manifest(engine_copy, verify=True).limits == new
    rebuilt = load_engine(engine_copy)
    params = SamplingParams(max_new_tokens=8)
    assert (rebuilt.generator.session([PROMPT]).generate(params).output_ids
            == engine.generator.session([PROMPT]).generate(params).output_ids)


def test_build_where_it_cannot_write_is_refused_before_any_work(runner, tiny_pair, tmp_path):
    (tmp_path / "file").write_text("x\n")
    assert_clean_error(runner.invoke(main, build_args(tiny_pair, tmp_path / "file" / "engine")),
                       f"--out {tmp_path / 'file' / 'engine'}", "is a file, not a directory", exit_code=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_build_stopped_by_sigterm_leaves_nothing(tiny_pair, tmp_path):
    """SIGTERM (timeout, docker stop) once the partial engine exists: the build exits 143 (as a
    process killed by it), and neither it nor the engine is left."""
    import signal
    import time

    build = subprocess.Popen([sys.executable, "-m", "dlite_trt.cli", *build_args(tiny_pair, tmp_path / "engine"),
                              "--no-calibrate"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.partial-*")):
        assert build.poll() is None and time.monotonic() < deadline, "the build ended before its partial engine"
        time.sleep(0.05)
    build.send_signal(signal.SIGTERM)
    assert build.wait(timeout=120) == 128 + signal.SIGTERM, build.stdout.read()
    assert list(tmp_path.iterdir()) == []


def test_build_with_smallest_limits(tiny_pair, engine, tmp_path):
    out = tmp_path / "engine"
    build_engine(*tiny_pair, out, BuildSettings(limits=EngineLimits(max_batch=1, max_seq_len=16, max_chunk=1)),
                 progress=False)
    params = SamplingParams(max_new_tokens=8)
    assert (load_engine(out).generator.session([PROMPT]).generate(params).output_ids
            == engine.generator.session([PROMPT]).generate(params).output_ids)


def test_build_past_max_position_embeddings_is_refused(runner, tiny_pair, tmp_path):
    from dlite_trt.targets import read_target_spec

    limit = read_target_spec(tiny_pair[0]).max_position_embeddings
    out = tmp_path / "engine"
    result = runner.invoke(main, build_args(tiny_pair, out, "--max-seq-len", str(limit + 1)))
    assert_clean_error(result, f"--max-seq-len {limit + 1}", f"max_position_embeddings={limit}", "lower it",
                       exit_code=1)
    assert list(tmp_path.iterdir()) == []  # neither the engine nor a partial build


def test_default_max_seq_len_fits_a_target_with_few_positions(runner, tiny_pair, tmp_path):
    """Without --max-seq-len, a target with fewer than 4096 positions builds at its own limit."""
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 300}))
    out = tmp_path / "engine"
    args = [a if a != str(tiny_pair[0]) else str(target) for a in build_args(tiny_pair, out)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "max seq len 300" in result.output
    assert load_manifest(out).limits.max_seq_len == 300


# --------------------------------------------------------------------------- dlite-trt generate --engine


def test_generate_engine_dtype_mismatch_is_a_usage_error(runner, engine_dir):
    result = generate_engine(runner, engine_dir, "--dtype", "fp16", "--input-ids", "5,6,7", "--max-new-tokens", "2")
    assert_clean_error(result, "built for fp32", "drop --dtype", "rebuild", exit_code=2)
    assert "Usage:" in result.output


@pytest.mark.parametrize("args", [["--target", "TARGET"], ["--draft", "DRAFT"]], ids=["target", "draft"])
def test_generate_needs_both_target_and_draft(runner, tiny_pair, args):
    """(Neither at all means the bundled pair: tests/test_bundled_models.py.)"""
    args = [str(tiny_pair[0]) if a == "TARGET" else str(tiny_pair[1]) if a == "DRAFT" else a for a in args]
    result = runner.invoke(main, ["generate", *args, "--input-ids", "5,6,7", "--max-new-tokens", "2"])
    assert_clean_error(result, "--engine", "--target", "--draft", exit_code=2)
    assert "Usage:" in result.output


def test_generate_engine_past_max_seq_len_is_a_clean_error(runner, engine_dir):
    too_many = LIMITS.max_seq_len - len(PROMPT) + 1
    result = generate_engine(runner, engine_dir, "--input-ids", ",".join(map(str, PROMPT)),
                             "--max-new-tokens", str(too_many))
    assert_clean_error(result, f"--max-seq-len {LIMITS.max_seq_len}", "lower max_new_tokens", exit_code=1)


def test_generate_engine_json_trace_matches_reference(runner, engine_dir, tiny_pair):
    args = ["--input-ids", "5,6,7,100,200", "--max-new-tokens", "12", "--json", "--trace"]
    got = generate_engine(runner, engine_dir, *args)
    want = runner.invoke(main, ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), *args])
    assert got.exit_code == 0 and want.exit_code == 0, (got.output, want.output)
    got, want = json.loads(got.stdout), json.loads(want.stdout)
    assert got["output_ids"] == want["output_ids"]
    assert len(got["output_ids"]) == 12 or got["stop_reason"] == "stop_token"
    for key in ("acceptance_lengths", "steps", "stop_reason", "text"):  # integer logic: exact
        assert got[key] == want[key], key
    assert got["acceptance_lengths"] and len(got["steps"]) == len(got["acceptance_lengths"])
    assert [s["accepted"] + 1 for s in got["steps"]] == got["acceptance_lengths"]


def test_console_script_error_has_no_traceback(engine_dir):
    exe = Path(sys.executable).parent / "dlite-trt"
    exe = str(exe) if exe.exists() else shutil.which("dlite-trt")
    assert exe, "the dlite-trt console script is not installed next to the interpreter or on PATH"
    too_many = LIMITS.max_seq_len - len(PROMPT) + 1
    run = subprocess.run([exe, "generate", "--engine", str(engine_dir), "--input-ids", ",".join(map(str, PROMPT)),
                          "--max-new-tokens", str(too_many)],
                         check=False, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr + run.stdout
    assert "Error:" in run.stderr and f"--max-seq-len {LIMITS.max_seq_len}" in run.stderr
    assert run.stdout == ""


def test_missing_draft_directory_with_engine_names_it(engine_dir, tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(DLiteError, match="(?i)not exist|no config.json|missing") as info:
        load_engine(engine_dir, draft=missing)
    assert str(missing) in str(info.value), str(info.value)  # the path the user passed, named


def test_engine_files_are_readable_by_others(engine_dir):
    """The build's temporary directory is private; the installed engine follows the umask."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [engine_dir, *engine_dir.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == want, path


def test_verify_hashes_large_files(runner, engine_copy, monkeypatch):
    """Files above the hash-at-load size are only size-checked, unless --verify."""
    import dlite_trt.engine.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "HASH_AT_LOAD_MAX_BYTES", 0)  # treat every file as large
    flip_byte(engine_copy / "graphs" / "weights.bin")
    load_manifest(engine_copy)  # same size: passes without hashing
    result = generate_engine(runner, engine_copy, "--verify", "--input-ids", "5,6,7", "--max-new-tokens", "2")
    assert_clean_error(result, "graphs/weights.bin does not match its sha256", "Rebuild", exit_code=1)
    usage = runner.invoke(main, ["generate", "--verify", "--target", "x", "--draft", "y", "--input-ids", "1"])
    assert usage.exit_code == 2 and "--verify checks an engine directory" in usage.output


def test_generate_engine_cli_equals_transformers_greedy(runner, engine_dir, tiny_pair):
    """The command line end to end: `generate --engine --json` == transformers target-only greedy."""
    from helpers import hf_greedy

    prompt = [5, 6, 7, 100, 200, 300, 17]
    result = generate_engine(runner, engine_dir, "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens", "24",
                             "--ignore-eos", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["output_ids"] == hf_greedy(tiny_pair[0], prompt, 24)


def test_engine_rebuilt_while_open_is_refused_on_lazy_load(tiny_pair, engine_copy):
    """Graphs not preloaded (decode, sampling) load on first use; if the directory was rebuilt
    meanwhile they would come from another build, so that is refused."""
    from dlite_trt.engine.manifest import load_manifest as read

    opened = load_engine(engine_copy)
    session = opened.generator.session([PROMPT])
    session.generate(SamplingParams(max_new_tokens=4))  # the preloaded greedy graphs
    build_engine(*tiny_pair, engine_copy, BuildSettings(limits=read(engine_copy).limits), progress=False)
    with pytest.raises(EngineError, match="changed since it was opened"):
        session.generate_target_only(SamplingParams(max_new_tokens=4))  # decode loads now


def test_packing_weights_twice_is_refused_and_harmless(engine_copy):
    from dlite_trt.engine.weights import pack_weights

    graphs = sorted((engine_copy / "graphs").glob("*.onnx"))
    with pytest.raises(ValueError, match="packed already"):
        pack_weights(graphs)
    load_manifest(engine_copy, verify=True)  # every file as built
    out = load_engine(engine_copy).generator.session([PROMPT]).generate(SamplingParams(max_new_tokens=4))
    assert len(out.output_ids[0]) == 4


def test_every_session_stops_spinning_when_a_run_returns(engine):
    """Each graph's session has its own thread pool; workers left spinning after one graph's run
    would share the cores with the next graph's (DLite + n-gram alternates step and decode)."""
    from dlite_trt.runtime.ort_runner import SPIN_STOP

    gen = engine.generator
    gen.session([[1, 2, 3]]).generate(SamplingParams(max_new_tokens=4))  # loads prefill, step (and decode)
    assert gen.runner.sessions
    for name, session in gen.runner.sessions.items():
        assert session.get_session_options().get_session_config_entry(SPIN_STOP) == "1", name
