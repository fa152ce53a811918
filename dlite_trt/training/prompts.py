"""Coding prompts made from Python source files, in the three shapes agents send.

- ``file``: the file so far, to be continued (``data.prompts_from_files``);
- ``docstring``: a function's signature and docstring, raw, for the body to follow;
- ``chat``: an instruction built from the same function ("Write a Python function ..."),
  rendered with the target's chat template.

Functions come from the files' top-level and class-level ``def``s that have a docstring.
Everything is seeded and depends only on the files, so the same files give the same prompts.
"""

from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.training.data import prompts_from_files

KINDS = ("file", "docstring", "chat")


@dataclass(frozen=True)
class Documented:
    """A function with a docstring: its header (``def ...:`` line) and the docstring."""

    header: str
    docstring: str
    name: str
    code: str = ""  # the whole function's source (dedented)


def documented_functions(path: Path) -> list[Documented]:
    """The documented functions of a Python file (none when it does not parse)."""
    text = path.read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20 or node.body[0].lineno <= node.lineno:
            continue
        header = "\n".join(lines[node.lineno - 1: node.body[0].lineno - 1]).strip()
        if header.startswith(("def ", "async def ")) and header.endswith(":"):
            code = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
            found.append(Documented(header, doc, node.name, code))
    return found


def instruction(fn: Documented, rng: random.Random) -> str:
    """A chat-style request for ``fn``, built from its signature and its docstring's first paragraph."""
    summary = " ".join(fn.docstring.split("\n\n")[0].split())
    opener = rng.choice(("Write a Python function", "Implement a Python function", "Write the Python code for a "
                         "function", "Please write a Python function"))
    return f"{opener} with the signature `{fn.header}` that does the following: {summary}"


def coding_prompts(files: Sequence[Path], tokenizer: Any, *, counts: dict[str, int], max_prompt_tokens: int,
                   seed: int = 0) -> list[tuple[str, list[int]]]:
    """``counts[kind]`` prompts of each kind (as many as the files allow), shuffled together:
    [(kind, token ids)]. File prompts are cut at several seeded places in each file."""
    rng = random.Random(seed)
    out: list[tuple[str, list[int]]] = []
    if counts.get("file"):
        cuts = max(1, -(-counts["file"] // max(1, len(files))))
        file_prompts = prompts_from_files(files, tokenizer, max_prompt_tokens=max_prompt_tokens, seed=seed, cuts=cuts)
        rng.shuffle(file_prompts)
        out += [("file", p) for p in file_prompts[: counts["file"]]]
    functions = [fn for path in files for fn in documented_functions(path)]
    rng.shuffle(functions)
    pick_doc = functions[: counts.get("docstring", 0)]
    pick_chat = functions[len(pick_doc): len(pick_doc) + counts.get("chat", 0)]
    for fn in pick_doc:
        body = textwrap.indent(f'"""{fn.docstring}\n"""', " " * 4)
        text = f"{fn.header}\n{body}\n"
        out.append(("docstring", tokenizer.encode(text, add_special_tokens=False)[-max_prompt_tokens:]))
    for fn in pick_chat:
        messages = [{"role": "user", "content": instruction(fn, rng)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(("chat", list(ids)[-max_prompt_tokens:]))
    rng.shuffle(out)
    return [(kind, ids) for kind, ids in out if ids]
