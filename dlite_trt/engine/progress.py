"""Progress display for long builds (rich), or nothing when disabled."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stages(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    """``advance(description)`` marks the start of the next of ``total`` stages."""
    if not enabled:
        yield lambda description: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<48}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("building", total=total)
        started = [False]

        def advance(description: str) -> None:
            bar.update(task, advance=1 if started[0] else 0, description=description)
            started[0] = True

        yield advance
        bar.update(task, completed=total, description="done")
