"""Reading JSON Lines files written by users: each record with where it came from (``file:line``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlite_trt.errors import ConfigError


def json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``("path:line", record)`` for each non-blank line; a line that is not JSON is a
    ConfigError naming it."""
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not valid JSON ({exc.msg}); each line must be one JSON object.") from exc
