"""No import circles in the package: no module imports, at its top or inside a function, a
module that imports it back (directly or around a longer loop). Imports under
``if TYPE_CHECKING:`` do not run and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import dlite_trt


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its code (submodules of ``from x import y`` included)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*parts, base] if base else parts)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    out = set()
    for target in found:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            out.add(target)
    return out


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """Each import circle among the package's modules, as the modules around it."""
    modules = _modules(root, package)
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    cycles, done = [], set()
    for start in sorted(graph):  # the shortest loop back to each module (breadth first)
        previous, queue = {start: None}, [start]
        for module in queue:
            if start in graph[module]:
                loop = [module]
                while previous[loop[-1]] is not None:
                    loop.append(previous[loop[-1]])
                loop = [start, *reversed(loop[:-1])] if len(loop) > 1 else [start]
                if frozenset(loop) not in done:
                    done.add(frozenset(loop))
                    cycles.append([*loop, start])
                break
            for nxt in sorted(graph[module]):
                if nxt not in previous:
                    previous[nxt] = module
                    queue.append(nxt)
    return cycles


def test_the_package_has_no_import_circles():
    root = Path(dlite_trt.__file__).resolve().parent.parent
    cycles = import_cycles(root, "dlite_trt")
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")  # a lazy import closes the loop
    (pkg / "sub" / "c.py").write_text("from ..a import y\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
