"""Where dlite-trt writes: checked before any work, so that a directory it cannot write in is a
clear error up front rather than a traceback after minutes of loading or measuring."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dlite_trt.errors import DLiteError


def writable_dir(path: Path, what: str) -> None:
    """Make sure ``path`` is (or can be created as) a directory this process can create files in;
    ``what`` names it for the message (an option and its value, an environment variable)."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise DLiteError(f"{what}: {existing} is a file, not a directory; pass a directory.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise DLiteError(f"{what}: cannot write in {path} ({reason.lower()}); pass a directory you can write in."
                         ) from exc


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # what torch.save writes: pickles


def pickles_in(directory: Path) -> list[str]:
    """The names of the weight files in ``directory`` that are (by their name) PyTorch pickles,
    which dlite-trt never loads: unpickling runs code."""
    return sorted(p.name for pattern in PICKLE_WEIGHTS for p in Path(directory).glob(pattern))
