"""What every engine runner shares (Polygraphy-style lifecycle): ``activate(graphs)`` loads
graphs up front (the rest load on first use), ``deactivate()`` drops them, and a ``with`` block
does both. A runner implements ``_load(graph)`` (cached), ``loaded(graph)``, ``deactivate``,
``new_cache`` and ``infer(graph, feeds, cache)``."""

from __future__ import annotations

from typing import Any, Self


class RunnerBase:
    def _load(self, graph: str) -> Any:
        raise NotImplementedError

    def loaded(self, graph: str) -> bool:
        """Whether ``graph`` is loaded (a call of it loads nothing)."""
        raise NotImplementedError

    def deactivate(self) -> None:
        raise NotImplementedError

    def activate(self, graphs: tuple[str, ...] = ("prefill", "step")) -> Self:
        """Load ``graphs`` now (the speculative path); others load on first use (``decode`` is
        only needed for target-only decoding)."""
        for name in graphs:
            self._load(name)
        return self

    def __enter__(self) -> Self:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()
