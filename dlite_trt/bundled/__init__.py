"""The bundled small models: a Qwen3 target (with its BPE tokenizer) trained on the Python
standard library, and a DLite draft trained for it with the two-stage recipe.

They are the defaults of `dlite-trt build` / `generate` without --target/--draft and of the
README's main command. `build_scripts/train_bundled_models.py` reproduces both from scratch;
``acceptance.json`` here records how they were trained and what they measured.
"""

from __future__ import annotations

from pathlib import Path

from dlite_trt.errors import CheckpointError

_HERE = Path(__file__).resolve().parent


def bundled_pair() -> tuple[Path, Path]:
    """(target directory, draft directory) of the bundled models."""
    target, draft = _HERE / "target", _HERE / "draft"
    for what, path in (("target", target), ("draft", draft)):
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise CheckpointError(f"the bundled {what} is missing from {path} (an incomplete install?); reinstall "
                                  "dlite-trt, or rebuild it with build_scripts/train_bundled_models.py --out "
                                  f"{_HERE}")
    return target, draft


def check_pair_options(target: object | None, draft: object | None) -> None:
    """--target and --draft come together or not at all (a click usage error otherwise)."""
    if (target is None) != (draft is None):
        import click

        raise click.UsageError("pass both --target and --draft, or neither (the bundled models; with --engine, "
                               "the engine's own)")


def pair_or_bundled(target: str | Path | None, draft: Path | None) -> tuple[str | Path, Path]:
    """--target/--draft as given, or the bundled pair when neither is."""
    check_pair_options(target, draft)
    return bundled_pair() if target is None else (target, draft)
