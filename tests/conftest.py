from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target directory (with a BPE tokenizer trained on stdlib sources) and a random draft."""
    from dlite_trt.tiny_models import make_tiny_pair

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny_pair(out, vocab_size=512, max_files=40)
