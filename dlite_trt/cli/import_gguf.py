"""`dlite-trt import-gguf`: convert a GGUF file into a Hugging Face model directory (dequantized)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("import-gguf")
@click.argument("file", type=click.Path(path_type=Path), metavar="FILE")  # missing or not a GGUF: exit 1
@click.option("--out", required=True, type=click.Path(path_type=Path), metavar="DIRECTORY",
              help="Model directory to write: new, empty, or a previous conversion (replaced once the new one "
                   "is complete).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="Precision of the dequantized weights.")
@click.option("--quiet", is_flag=True, help="No progress display.")
def command(file: Path, out: Path, dtype: str, quiet: bool) -> None:
    """Convert a GGUF FILE (llama, qwen2 or qwen3) into a Hugging Face model directory.

    The weights are dequantized by transformers' GGUF loader; the directory holds config.json,
    model.safetensors, generation_config.json and the tokenizer with its chat template, and can be
    passed as --target."""
    from dlite_trt.gguf_import import IMPORT_RECORD, convert_gguf

    convert_gguf(file, out, dtype=dtype, progress=not quiet)
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / IMPORT_RECORD).read_text())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    template = "with" if _has_chat_template(out) else "without"
    click.echo(f"wrote {out}: {config.get('model_type')} ({config.get('num_hidden_layers')} layers, hidden "
               f"{config.get('hidden_size')}, vocab {config.get('vocab_size')}), {dtype} weights, "
               f"{size / 2**20:.1f} MiB; tokenizer {template} a chat template; from {record['source']} "
               f"(sha256 {record['sha256'][:12]}…)")


def _has_chat_template(out: Path) -> bool:
    """transformers writes the template to chat_template.jinja, older versions into tokenizer_config.json."""
    if (out / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((out / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
