"""Tool-call parsers: a model's text as OpenAI tool calls, one small class per format (vLLM's
``--tool-call-parser`` names), declared once in ``PARSERS``.

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3, and the bundled tools template of the default
  target): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before
  the first call is the message's content.
- ``llama3_json`` (Llama 3.1/3.2/3.3 with JSON tool calling): the whole output is one or more
  JSON objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), separated by ``;``,
  optionally after ``<|python_tag|>``.

Text that is not a well-formed call stays content: a parse never raises. Streaming
(``ToolCallStream``) holds back text that could begin a call, sends content as soon as it cannot,
and sends each call once it is complete, in OpenAI's delta shape (the id, type and name, then the
arguments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text: OpenAI's function.arguments
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        """As an assistant message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str | None  # None when the output was calls only
    calls: tuple[ToolCall, ...] = ()


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A decoded JSON value as a call: an object with a non-empty string ``name`` and an object of
    arguments (under the first of ``argument_keys`` it has; none: no arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """One format: where calls begin (``calls_start``), the complete well-formed calls at the start
    of the text from there (``split``: they and where the rest begins), and how much of an output's
    end could still grow into a call's beginning (``may_begin``, for streaming).

    The message: the calls ``split`` finds (none when the first is malformed or cut), and as
    content the text before them plus, unless it is only whitespace, the text after the last of
    them (None when the content is only whitespace)."""

    name: ClassVar[str]
    models: ClassVar[str]

    def calls_start(self, text: str) -> int | None:
        raise NotImplementedError

    def split(self, region: str) -> tuple[list[ToolCall], int]:
        raise NotImplementedError

    def may_begin(self, text: str) -> int:
        raise NotImplementedError

    def opening(self, name: str | None) -> str:
        """What a call begins with, up to its arguments when ``name`` is given (``tool_choice``
        required or a named function: the server appends it to the prompt, so the output is a call's
        continuation)."""
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        start = self.calls_start(text)
        if start is None:
            return Parsed(text)
        calls, rest = self.split(text[start:])
        if not calls:
            return Parsed(text)
        return Parsed(content_around(text, start, rest), tuple(calls))


class Hermes(ToolParser):
    name = "hermes"
    models = "Hermes 2 Pro, Qwen2.5, Qwen3; the default target with the bundled tools template"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def calls_start(self, text: str) -> int | None:
        start = text.find(self.OPEN)
        return None if start < 0 else start

    def split(self, region: str) -> tuple[list[ToolCall], int]:
        calls, at = [], 0
        while True:
            begin = len(region) - len(region[at:].lstrip())
            if not region.startswith(self.OPEN, begin):
                return calls, at
            end = region.find(self.CLOSE, begin)
            if end < 0:
                return calls, at
            try:
                call = _call(json.loads(region[begin + len(self.OPEN): end]), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return calls, at
            calls.append(call)
            at = end + len(self.CLOSE)

    def may_begin(self, text: str) -> int:
        return max((k for k in range(1, len(self.OPEN)) if text.endswith(self.OPEN[:k])), default=0)

    def opening(self, name: str | None) -> str:
        return self.OPEN + '\n{"name": "' + ("" if name is None else name + '", "arguments": ')


class Llama3Json(ToolParser):
    name = "llama3_json"
    models = "Llama 3.1, 3.2, 3.3 (JSON tool calling)"
    TAG = "<|python_tag|>"

    def calls_start(self, text: str) -> int | None:
        """Where the tag (or else the first object) is, if the output begins with it."""
        stripped = text.lstrip()
        after_tag = stripped[len(self.TAG):].lstrip() if stripped.startswith(self.TAG) else stripped
        return len(text) - len(stripped) if after_tag.startswith("{") else None

    def split(self, region: str) -> tuple[list[ToolCall], int]:
        decoder, calls, at = json.JSONDecoder(), [], 0
        if region.startswith(self.TAG):
            at = len(self.TAG)
        while True:
            begin = len(region) - len(region[at:].lstrip())
            if calls and region.startswith(";", begin):
                begin = len(region) - len(region[begin + 1:].lstrip())
            if not region.startswith("{", begin):
                return calls, at
            try:
                value, end = decoder.raw_decode(region, begin)
            except ValueError:
                return calls, at
            call = _call(value, ("parameters", "arguments"))
            if call is None:
                return calls, at
            calls.append(call)
            at = end

    def may_begin(self, text: str) -> int:
        """Until something other than whitespace (or the tag) came, all of it: the output may be calls."""
        stripped = text.lstrip()
        return len(text) if self.TAG.startswith(stripped) or stripped.startswith(self.TAG) and \
            not stripped[len(self.TAG):].strip() else 0

    def opening(self, name: str | None) -> str:
        return '{"name": "' + ("" if name is None else name + '", "parameters": ')


def content_around(text: str, start: int, rest: int) -> str | None:
    """The content of a message whose calls begin at ``start`` and end ``rest`` characters later."""
    after = text[start + rest:]
    content = text[:start] + (after if after.strip() else "")
    return content if content.strip() else None


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json)}


class ToolCallStream:
    """A streamed output through a parser. ``add(text so far)`` returns the events it allows:
    ``("content", text)`` as soon as text cannot be part of a call (whitespace waits: the message's
    content may be None), ``("call", index, ToolCall)`` once a call is complete and well formed.
    ``finish(final text)`` returns the rest and the message (``Parsed``), which the events add up to.
    ``opening``: a forced call's opening (``ToolParser.opening``), which the output continues: then
    the message is calls only (what follows them dropped), or where none parses the output as the
    model wrote it, as ``openai_server.ToolUse.message``."""

    def __init__(self, parser: ToolParser, opening: str = "") -> None:
        self.parser = parser
        self.opening = opening
        self.sent = ""  # content sent
        self.calls: list[ToolCall] = []
        self.start: int | None = None  # where the calls begin

    def add(self, text: str) -> list[tuple]:
        text = self.opening + text
        if self.start is None:
            self.start = self.parser.calls_start(text)
        if self.start is None:
            return self._content(text[: len(text) - self.parser.may_begin(text)])
        calls, _ = self.parser.split(text[self.start:])
        return self._content(text[: self.start]) + self._calls(calls)

    def finish(self, text: str) -> tuple[list[tuple], Parsed]:
        output, text = text, self.opening + text
        parsed = self.parser.parse(text)
        if not parsed.calls and not self.calls:
            if self.opening:  # nothing was sent: the call's opening held it all back
                return self._content(output, final=True), Parsed(output or None)
            return self._content(text, final=True), parsed
        # calls already sent stay sent: the message is what the stream said (a later malformed or cut
        # call is content, as in ``parse``; none after a forced call)
        calls, rest = self.parser.split(text[self.start:])
        content = None if self.opening else content_around(text, self.start, rest)
        events = self._calls(calls) + self._content(content or "", final=True)
        return events, Parsed(content, tuple(self.calls))

    def _calls(self, calls: list[ToolCall]) -> list[tuple]:
        events = []
        for call in calls[len(self.calls):]:
            self.calls.append(call)
            events.append(("call", len(self.calls) - 1, call))
        return events

    def _content(self, upto: str, final: bool = False) -> list[tuple]:
        """Content up to ``upto`` (which extends what was sent), whitespace-only held unless final."""
        if not upto.startswith(self.sent) or len(upto) == len(self.sent) or (not upto.strip() and not final):
            return []
        piece, self.sent = upto[len(self.sent):], upto
        return [("content", piece)]
