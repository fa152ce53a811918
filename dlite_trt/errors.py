"""Errors raised for bad user input. Each message names the problem and the fix."""

from __future__ import annotations


class DLiteError(ValueError):
    """Base class of every error dlite-trt raises for bad input."""


class ConfigError(DLiteError):
    """A config (draft config.json, target config.json, preset) is invalid."""


class CheckpointError(DLiteError):
    """A checkpoint directory or its weights cannot be loaded as they are."""


class IncompatibleDraftError(DLiteError):
    """A draft checkpoint does not fit the target it is paired with."""


class TargetNotFoundError(DLiteError):
    """A --target value names neither a directory nor a cached or random preset."""


class EngineError(DLiteError):
    """An engine directory is missing, corrupt, stale, or does not fit the request."""
