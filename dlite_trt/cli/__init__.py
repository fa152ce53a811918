"""The `dlite-trt` command: one click group, one module per subcommand, imported on use."""

from __future__ import annotations

import importlib

import click

from dlite_trt import __version__
from dlite_trt.errors import DLiteError

# subcommand name -> (module under dlite_trt.cli, one-line help shown by --help without importing it)
SUBCOMMANDS = {
    "bench": ("bench", "Benchmark DLite against target-only decoding and n-gram lookup, side by side."),
    "bench-serve": ("bench_serve", "Replay multi-turn agent sessions through the OpenAI server (TTFT, reuse, tok/s)."),
    "build": ("build", "Compile a target (Qwen3, Llama, Qwen2) and a DLite draft into an engine directory."),
    "calibrate": ("calibrate", "Choose how many drafts an engine's step verifies, from costs measured here."),
    "import-gguf": ("import_gguf", "Convert a GGUF file into a Hugging Face model directory (dequantized)."),
    "generate": ("generate", "Generate with a target and a DLite draft (speculative decoding)."),
    "serve": ("serve", "Serve an engine: an OpenAI-compatible API (in-flight batching, prefix reuse) or Triton."),
    "triton-repo": ("triton_repo", "Write a Triton model repository that serves an engine."),
    "train": ("train", "Train DLite drafts with the two-stage recipe (data, teacher, student)."),
}


class LazyGroup(click.Group):
    """Imports a subcommand's module only when it runs, so `--help` stays instant."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module = importlib.import_module(f"dlite_trt.cli.{SUBCOMMANDS[name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)])

    def invoke(self, ctx: click.Context):
        # Exit codes, the same in every subcommand; each message names the problem and the fix:
        #   2 (click.UsageError, click.BadParameter): the command line itself is wrong, seen without opening
        #     any path: a malformed or out-of-range value (--seed, --temperature inf, --input-ids ""), options
        #     that need or exclude each other (--threads without --engine), an option the loaded engine cannot
        #     honour (--dtype on an engine built for another).
        #   1 (DLiteError -> click.ClickException, below): a path given is not what it should be, found by
        #     opening it: a --target, --draft or --engine that is missing, a file, not a model, checkpoint or
        #     engine directory (no manifest.json), corrupt or built from other models; and anything that fails
        #     later at run time (a prompt past the engine's --max-seq-len, a tokenizer without a chat template).
        try:
            return super().invoke(ctx)
        except DLiteError as exc:  # bad input: a clear message, no traceback
            raise click.ClickException(str(exc)) from exc


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="dlite-trt")
def main() -> None:
    """dlite-trt: compile a target (Qwen3, Llama, Qwen2) and a DLite draft into one speculative-decoding engine."""
