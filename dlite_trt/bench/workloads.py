"""Benchmark workloads as JSONL datasets, and seeded generators that build them from real text.

A line follows trtllm-bench's dataset format, extended with ``turns`` for multi-turn sessions::

    {"task_id": "agentic-0", "prompt": "...", "output_tokens": 48,
     "turns": [{"prompt": "...", "output_tokens": 32}, ...]}

``prompt`` (text, tokenized with the target's tokenizer) or ``input_ids`` (token ids) is the
first turn; each later turn's text or ids is *appended* to the session's context (everything
so far, answers included), as a coding agent appends a tool result and an instruction.

The generators read the held-out split of the standard library's sources (real code that ships
on every machine with Python, and that the bundled models never trained on):

- ``agentic``: sessions over a "repository" of those files; each turn appends a tool result
  (a file view, a grep over the repository, a test log) and a short instruction, and the
  model answers briefly; the context grows and changes every turn;
- ``long-context``: one prompt of 2k to 16k tokens (several files) and a short answer;
- ``chat``: a short code prompt (a function's first lines) answered at length.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlite_trt.errors import DLiteError
from dlite_trt.jsonl import json_lines

# three prompts (tasks: the paired rounds), the fewest whose spread judges a goal (report.MIN_ROUNDS); 8192 runs at
# the longest an engine allows below it
LONG_CONTEXT_TOKENS = (2048, 3072, 8192)
QUICK_LONG_CONTEXT_TOKENS = (2048,)
LONG_CONTEXT_ANSWER_TOKENS = (32, 64)  # answer length range of a long-context task
LONG_CONTEXT_MIN_TOKENS = 512  # a "long" prompt is at least this long
_DEF = re.compile(r"^\s*def (\w+)\(", re.MULTILINE)


@dataclass(frozen=True)
class Turn:
    output_tokens: int
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None

    def ids(self, tokenizer: Any) -> list[int]:
        if self.input_ids is not None:
            return list(self.input_ids)
        if tokenizer is None:
            raise DLiteError("this workload gives text prompts, but the engine has no tokenizer; pass --target DIR "
                             "(a model directory with a tokenizer) or a dataset with input_ids.")
        return tokenizer.encode(self.prompt, add_special_tokens=False)

    def to_json(self) -> dict[str, Any]:
        text = {"prompt": self.prompt} if self.input_ids is None else {"input_ids": list(self.input_ids)}
        return text | {"output_tokens": self.output_tokens}


@dataclass(frozen=True)
class Task:
    task_id: str
    turns: tuple[Turn, ...]  # the first turn is the prompt

    def to_json(self) -> dict[str, Any]:
        line = {"task_id": self.task_id} | self.turns[0].to_json()
        if len(self.turns) > 1:
            line["turns"] = [t.to_json() for t in self.turns[1:]]
        return line


# -- JSONL ---------------------------------------------------------------------------------------
def write_jsonl(tasks: Sequence[Task], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in tasks))


def read_jsonl(path: Path) -> list[Task]:
    """Tasks from a dataset file; a malformed line is an error naming the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise DLiteError(f"no dataset file at {path}; pass a JSONL file (one task per line).")
    tasks, seen = [], set()
    for where, obj in json_lines(path):
        if not isinstance(obj, dict):
            raise DLiteError(f"{where} is a JSON {type(obj).__name__}, expected an object with task_id, prompt or "
                             "input_ids, and output_tokens.")
        unknown = set(obj) - {"task_id", "prompt", "input_ids", "output_tokens", "turns"}
        if unknown:
            raise DLiteError(f"{where} has unknown fields {sorted(unknown)}; allowed: task_id, prompt, input_ids, "
                             "output_tokens, turns.")
        task_id = str(obj.get("task_id", f"{path.stem}-{where.rsplit(':', 1)[1]}"))
        if task_id in seen:
            raise DLiteError(f"{where}: task_id {task_id!r} appears twice; task ids must be unique.")
        seen.add(task_id)
        turns = obj.get("turns", [])
        if not isinstance(turns, list):
            raise DLiteError(f"{where}: turns must be a list of objects with prompt or input_ids and output_tokens.")
        first = {k: obj[k] for k in ("prompt", "input_ids", "output_tokens") if k in obj}
        tasks.append(Task(task_id, tuple(_turn(t, f"{where} turn {i}") for i, t in enumerate([first, *turns]))))
    if not tasks:
        raise DLiteError(f"{path} holds no tasks.")
    return tasks


def _turn(obj: Any, where: str) -> Turn:
    if not isinstance(obj, dict):
        raise DLiteError(f"{where} is not an object.")
    unknown = set(obj) - {"prompt", "input_ids", "output_tokens"}
    if unknown:
        raise DLiteError(f"{where} has unknown fields {sorted(unknown)}; a turn has prompt or input_ids, "
                         "and output_tokens.")
    if ("prompt" in obj) == ("input_ids" in obj):
        raise DLiteError(f"{where} needs exactly one of prompt (text) or input_ids (a list of token ids).")
    out = obj.get("output_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise DLiteError(f"{where}: output_tokens must be an integer >= 1, got {out!r}.")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise DLiteError(f"{where}: prompt must be non-empty text.")
        return Turn(out, prompt=obj["prompt"])
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DLiteError(f"{where}: input_ids must be a non-empty list of integers.")
    return Turn(out, input_ids=tuple(ids))


# -- generators ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceFile:
    name: str
    lines: tuple[str, ...]

    @property
    def functions(self) -> list[str]:
        return sorted(set(_DEF.findall("\n".join(self.lines))))


def source_files() -> list[SourceFile]:
    """The held-out standard-library files (sorted by name), as the generators' real text."""
    from dlite_trt.tiny_models import stdlib_files

    files = [SourceFile(p.name, tuple(p.read_text(errors="replace").splitlines())) for p in stdlib_files("held_out")]
    return [f for f in files if f.functions]


def held_out_ids(tokenizer: Any, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` of held-out standard-library code (files concatenated), starting at file ``offset``."""
    from dlite_trt.tiny_models import stdlib_files

    ids: list[int] = []
    for f in stdlib_files("held_out")[offset:]:
        ids += tokenizer.encode(f.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise DLiteError(f"the held-out sources hold fewer than {n_tokens} tokens from file {offset} on.")


def agentic(files: Sequence[SourceFile], *, seed: int, sessions: int = 4, turns: int = 5,
            answer_tokens: tuple[int, int] = (24, 64)) -> list[Task]:
    """Multi-turn coding-agent sessions: each turn appends a tool result and an instruction."""
    rng = random.Random(seed)
    tools: list[Callable[[random.Random, Sequence[SourceFile]], str]] = [_cat, _grep, _test_log]
    tasks = []
    for s in range(sessions):
        repo = rng.sample(list(files), k=min(4, len(files)))
        header = "# repository: " + ", ".join(f.name for f in repo) + "\n"
        steps = []
        for t in range(turns):
            result = tools[(s + t) % len(tools)](rng, repo)
            text = (header if t == 0 else "\n") + result + f"# user: {_instruction(rng, repo)}\n# assistant:\n"
            steps.append(Turn(rng.randint(*answer_tokens), prompt=text))
        tasks.append(Task(f"agentic-{s}", tuple(steps)))
    return tasks


# The tool-using agent replay's tools (bench/serve_replay.py), as an agent declares them.
AGENT_TOOLS = (
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search the repository for a word.",
                                      "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}},
                                                     "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
                                      "parameters": {"type": "object", "properties": {}}}},
)


@dataclass(frozen=True)
class ToolSession:
    """A tool-using agent's session: a repository and one instruction per user turn."""

    task_id: str
    repo: tuple[SourceFile, ...]
    instructions: tuple[str, ...]
    seed: int

    def run_tool(self, name: str, arguments: str, calls_so_far: int) -> str:
        """What the agent's tool returns for a call (the model's own arguments), deterministically:
        the file it names (or one of the repository's), grep over it, a test log."""
        rng = random.Random(f"{self.seed}/{calls_so_far}/{name}/{arguments}")
        try:
            args = json.loads(arguments)
        except ValueError:
            args = {}
        args = args if isinstance(args, dict) else {}
        if name == "read_file":
            named = [f for f in self.repo if f.name == args.get("path")]
            return _cat(rng, named or self.repo)
        if name == "grep":
            return _grep(rng, self.repo)
        if name == "run_tests":
            return _test_log(rng, self.repo)
        return f"error: no tool named {name!r}; the tools are " + ", ".join(t["function"]["name"] for t in AGENT_TOOLS)


def tool_agentic(files: Sequence[SourceFile], *, seed: int, sessions: int = 4, turns: int = 3) -> list[ToolSession]:
    """Tool-using agent sessions: a user instruction per turn over a 4-file repository; the model
    calls the tools (AGENT_TOOLS) and their results go back until it answers."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        repo = tuple(rng.sample(list(files), k=min(4, len(files))))
        asks = tuple(f"In the repository ({', '.join(f.name for f in repo)}): {_instruction(rng, repo)}"
                     for _ in range(turns))
        out.append(ToolSession(f"tools-{s}", repo, asks, seed * 1000 + s))
    return out


def long_context(files: Sequence[SourceFile], tokenizer: Any, *, seed: int,
                 lengths: Sequence[int] = LONG_CONTEXT_TOKENS,
                 answer_tokens: tuple[int, int] = LONG_CONTEXT_ANSWER_TOKENS) -> list[Task]:
    """One prompt per length: whole files (in a seeded order) up to about ``length`` tokens, then a question."""
    rng = random.Random(seed)
    tasks = []
    for i, length in enumerate(lengths):
        order = rng.sample(list(files), k=len(files))
        question = f"# user: {_instruction(rng, order[:1])}\n# assistant:\n"
        budget = length - len(tokenizer.encode(question, add_special_tokens=False))
        parts, used = [], 0
        for f in order:
            block = f"# file: {f.name}\n" + "\n".join(f.lines) + "\n"
            n = len(tokenizer.encode(block, add_special_tokens=False))
            if used + n > budget:
                parts.append(_cut_to_tokens(block, budget - used, tokenizer))
                break
            parts.append(block)
            used += n
        else:
            raise DLiteError(f"the held-out sources hold fewer than {length} tokens; lower the long-context lengths.")
        tasks.append(Task(f"long-{length}-{i}", (Turn(rng.randint(*answer_tokens), prompt="".join(parts) + question),)))
    return tasks


def chat(files: Sequence[SourceFile], *, seed: int, count: int = 6,
         answer_tokens: tuple[int, int] = (192, 320)) -> list[Task]:
    """Short code prompts (a real function's first lines) with answers of a few hundred tokens."""
    rng = random.Random(seed)
    starts = [(f, i) for f in files for i, line in enumerate(f.lines) if _DEF.match(line)]
    tasks = []
    for i, (f, line) in enumerate(rng.sample(starts, k=min(count, len(starts)))):
        body = "\n".join(f.lines[line : line + rng.randint(3, 12)])
        prompt = f"# Complete this function from {f.name}.\n{body}\n"
        tasks.append(Task(f"chat-{i}", (Turn(rng.randint(*answer_tokens), prompt=prompt),)))
    return tasks


def build_workloads(tokenizer: Any, *, seed: int = 0) -> dict[str, list[Task]]:
    files = source_files()
    if len(files) < 2:
        raise DLiteError("the standard library's held-out sources are missing; the workloads are built from them.")
    return {"agentic": agentic(files, seed=seed), "long-context": long_context(files, tokenizer, seed=seed),
            "chat": chat(files, seed=seed)}


def _cut_to_tokens(text: str, tokens: int, tokenizer: Any) -> str:
    """The longest prefix of whole lines of ``text`` within ``tokens`` tokens."""
    lines, kept, used = text.splitlines(keepends=True), [], 0
    for line in lines:
        n = len(tokenizer.encode(line, add_special_tokens=False))
        if used + n > tokens:
            break
        kept.append(line)
        used += n
    return "".join(kept)


def _cat(rng: random.Random, repo: Sequence[SourceFile]) -> str:
    f = rng.choice(repo)
    start = rng.randrange(max(1, len(f.lines) - 60))
    shown = f.lines[start : start + rng.randint(30, 90)]
    body = "\n".join(f"{start + i + 1:5d}  {line}" for i, line in enumerate(shown))
    return f"# tool: cat -n {f.name} | sed -n {start + 1},+90p\n{body}\n"


def _grep(rng: random.Random, repo: Sequence[SourceFile]) -> str:
    word = rng.choice(rng.choice(repo).functions)
    hits = [f"{f.name}:{i + 1}:{line}" for f in repo for i, line in enumerate(f.lines) if word in line]
    return f"# tool: grep -n {word} *.py\n" + "\n".join(hits[:40]) + "\n"


def _test_log(rng: random.Random, repo: Sequence[SourceFile]) -> str:
    f = rng.choice(repo)
    funcs = rng.sample(f.functions, k=min(8, len(f.functions)))
    failed = rng.choice(funcs)
    line = next(i for i, text in enumerate(f.lines) if re.match(rf"\s*def {re.escape(failed)}\(", text))
    stem = f.name.removesuffix(".py")
    log = [f"test_{stem}.py::test_{name} {'FAILED' if name == failed else 'PASSED'}" for name in funcs]
    trace = "\n".join(f"    {text}" for text in f.lines[line : line + 6])
    return (f"# tool: python -m pytest test_{stem}.py -q\n" + "\n".join(log) + f"\n___ test_{failed} ___\n"
            f"  File \"{f.name}\", line {line + 1}, in {failed}\n{trace}\nAssertionError\n"
            f"{len(funcs) - 1} passed, 1 failed\n")


def _instruction(rng: random.Random, repo: Sequence[SourceFile]) -> str:
    f = rng.choice(repo)
    func = rng.choice(f.functions)
    return rng.choice([f"explain what {func} in {f.name} returns, briefly.",
                       f"fix the failing call to {func}; show only the changed lines.",
                       f"which function calls {func}? answer with its name.",
                       f"write a short test for {func} from {f.name}."])
