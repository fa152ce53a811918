"""Checks of command-line values that several subcommands share.

Which failures exit 2 (usage) and which exit 1 (runtime): see ``LazyGroup.invoke`` in
dlite_trt/cli/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

import click

from dlite_trt.errors import DLiteError, EngineError


class _SamplingValue(click.ParamType):
    """A --seed or --temperature, checked by ``SamplingParams`` itself: one rule for the CLI and the API."""

    def __init__(self, name: str, field: str, parse: click.ParamType) -> None:
        self.name, self.field, self.parse = name, field, parse

    def convert(self, value, param, ctx):
        parsed = self.parse.convert(value, param, ctx)  # "'x' is not a valid integer" and the like
        from dlite_trt.runtime.session import SamplingParams

        try:
            SamplingParams(**{self.field: parsed})
        except DLiteError as exc:
            self.fail(str(exc), param, ctx)
        return parsed


MAX_THREADS = 1024  # ONNX Runtime threads: more is a typo (a pool of 100,000 threads takes minutes to start)
THREADS = click.IntRange(1, MAX_THREADS)

SEED = _SamplingValue("integer", "seed", click.INT)
TEMPERATURE = _SamplingValue("float", "temperature", click.FLOAT)


class _VerifyDrafts(click.ParamType):
    """``auto`` (the engine's calibrated width) or a number of drafts >= 1 (checked against the engine on load)."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            k = int(value)
        except ValueError:
            self.fail(f"expected 'auto' or a number of drafts like 3, got {value!r}", param, ctx)
        if k < 1:
            self.fail(f"a step verifies at least 1 draft, got {k}", param, ctx)
        return k


VERIFY_DRAFTS = click.option(
    "--verify-drafts", "verify_drafts", type=_VerifyDrafts(), default="auto", show_default=True,
    help="Drafts a greedy DLite step verifies (of the draft's K): auto = the engine's calibrated choice "
         "(verify_width.json, from `dlite-trt build` / `dlite-trt calibrate`), else a number 1..K.")


def writable_out(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """An --out directory a job writes into, checked when the command line is read (before minutes
    of loading or training): one it cannot write in is a usage error naming it."""
    if value is not None:
        from dlite_trt.paths import writable_dir

        try:
            writable_dir(value, str(value))
        except DLiteError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc
    return value


def check_engine_dir(engine: Path, hint: str = "") -> None:
    """An --engine path that is not an engine directory: the same EngineError (exit 1) from every command."""
    from dlite_trt.engine.manifest import MANIFEST

    if engine.is_dir() and (engine / MANIFEST).is_file():
        return
    if not engine.exists():
        why = "it does not exist"
    elif not engine.is_dir():
        why = "it is a file"
    else:
        why = f"it has no {MANIFEST} (or its build did not finish)"
    raise EngineError(f"--engine {engine} is not an engine directory: {why}. Build one with "
                      f"`dlite-trt build --out DIR`{hint}.")


def check_random_weights(random_weights: bool, target: str | None) -> None:
    """--random-weights gives a preset --target random weights: without --target it would do nothing."""
    if random_weights and target is None:
        raise click.UsageError("--random-weights gives a preset --target random weights of its shape; pass "
                               "--target PRESET --draft DIR, or drop --random-weights")
