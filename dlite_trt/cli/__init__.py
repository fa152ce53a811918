"""The `dlite-trt` command: one click group, one module per subcommand, imported on use."""

from __future__ import annotations

import importlib

import click

from dlite_trt import __version__
from dlite_trt.errors import DLiteError

# subcommand name -> (module under dlite_trt.cli, one-line help shown by --help without importing it)
SUBCOMMANDS = {
    "bench": ("bench", "Benchmark DLite against target-only decoding and n-gram lookup, side by side."),
    "build": ("build", "Compile a Qwen3 target and a DLite draft into an engine directory."),
    "generate": ("generate", "Generate with a Qwen3 target and a DLite draft (speculative decoding)."),
    "serve": ("serve", "Serve an engine from a real Triton Inference Server (HTTP, gRPC, streaming)."),
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
        try:
            return super().invoke(ctx)
        except DLiteError as exc:  # bad input: a clear message, no traceback
            raise click.ClickException(str(exc)) from exc


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="dlite-trt")
def main() -> None:
    """dlite-trt: compile a Qwen3 target and a DLite draft into one speculative-decoding engine."""
