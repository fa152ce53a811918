"""The tool-call parsers on constructed outputs: calls alone, several, with text around them,
malformed and cut ones (content, never an error), and streamed piece by piece: the events add
up to the non-streamed message, calls are sent once complete, and nothing is sent that a later
piece takes back."""

from __future__ import annotations

import json

import pytest

from dlite_trt.serve.tool_parsers import PARSERS, Hermes, Llama3Json, ToolCallStream

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
SEARCH = {"name": "search", "arguments": {"query": "ß \\ \"quoted\"", "limit": 3}}


def _hermes(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)


def _llama(*calls: dict) -> str:
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# (parser, output, content wanted, calls wanted)
CASES = [
    (Hermes, _hermes(WEATHER), None, [WEATHER]),
    (Hermes, "Let me check.\n" + _hermes(WEATHER, SEARCH), "Let me check.\n", [WEATHER, SEARCH]),
    (Hermes, _hermes(WEATHER) + "It is sunny.", "\nIt is sunny.", [WEATHER]),
    (Hermes, "No tools needed: 4.", "No tools needed: 4.", []),
    (Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par", None, []),  # cut: content
    (Hermes, "<tool_call>{not json}</tool_call>", None, []),  # malformed: content
    (Hermes, "<tool_call>{\"arguments\": {}}</tool_call>", None, []),  # no name: content
    (Hermes, "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", None, []),  # arguments not an object
    (Hermes, _hermes(WEATHER) + "<tool_call>{broken", "\n<tool_call>{broken", [WEATHER]),  # the well-formed one
    (Hermes, "<tool_call>{\"name\": \"ping\"}</tool_call>", None, [{"name": "ping", "arguments": {}}]),
    (Llama3Json, _llama(WEATHER), None, [WEATHER]),
    (Llama3Json, _llama(WEATHER, SEARCH), None, [WEATHER, SEARCH]),
    (Llama3Json, "<|python_tag|>" + _llama(SEARCH), None, [SEARCH]),
    (Llama3Json, "  \n" + json.dumps({"name": "search", "arguments": SEARCH["arguments"]}), None, [SEARCH]),
    (Llama3Json, "The answer is {x}.", "The answer is {x}.", []),  # not at the start: content
    (Llama3Json, '{"name": "get_weather", "parameters": {"city": "Pa', None, []),  # cut
    (Llama3Json, '{"answer": 42}', None, []),  # JSON, not a call
    (Hermes, "  \n", None, []),  # whitespace only: content as it is
    (Llama3Json, " \n ", None, []),
]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_parse(parser, output, content, calls):
    parsed = parser().parse(output)
    assert _calls(parsed) == [(c["name"], c["arguments"]) for c in calls]
    assert parsed.content == (content if calls else output)
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("piece", [1, 3, 17])
def test_streamed_events_add_up_to_the_message(parser, output, content, calls, piece):
    stream = ToolCallStream(parser())
    events = []
    for end in range(piece, len(output) + piece, piece):
        events += stream.add(output[:end])
    tail, message = stream.finish(output)
    events += tail
    want = parser().parse(output)
    assert _calls(message) == _calls(want) and message.content == want.content
    streamed = "".join(e[1] for e in events if e[0] == "content")
    assert streamed == (message.content or "")
    sent = [e[2] for e in events if e[0] == "call"]
    assert [e[1] for e in events if e[0] == "call"] == list(range(len(sent)))
    assert [c.id for c in sent] == [c.id for c in message.calls]  # the ids the message says


def test_a_call_is_sent_as_soon_as_it_is_complete_and_not_before():
    stream = ToolCallStream(Hermes())
    first = _hermes(WEATHER)
    assert stream.add("Checking. <tool_c") == [("content", "Checking. ")]  # the marker's start is held
    assert stream.add("Checking. " + first[:-15]) == []  # inside the call
    (event,) = stream.add("Checking. " + first)
    assert event[0] == "call" and event[2].name == "get_weather"
    stream = ToolCallStream(Llama3Json())
    assert stream.add("  ") == [] and stream.add("  <|python") == []  # could still be calls
    assert stream.add("  <|python_tag|>" + _llama(WEATHER)[:-1]) == []
    assert [e[0] for e in stream.add("  <|python_tag|>" + _llama(WEATHER))] == ["call"]


@pytest.mark.parametrize("parser", [Hermes, Llama3Json])
def test_a_forced_opening_continued_is_a_call(parser):
    """tool_choice required or named: the prompt ends with the parser's opening and the model
    writes the rest; the opening plus the rest parses as the call."""
    rest = {Hermes: '{"city": "Paris", "unit": "celsius"}}\n</tool_call>', Llama3Json: '{"city": "Paris", '
            '"unit": "celsius"}}'}[parser]
    parsed = parser().parse(parser().opening("get_weather") + rest)
    assert _calls(parsed) == [("get_weather", WEATHER["arguments"])] and parsed.content is None
    unnamed = parser().opening(None) + 'get_weather", ' + rest.replace('{"city"', '"arguments": {"city"', 1)
    assert _calls(parser().parse(unnamed.replace('"arguments"', '"parameters"') if parser is Llama3Json
                                 else unnamed)) == [("get_weather", WEATHER["arguments"])]


def test_the_registry():
    assert set(PARSERS) == {"hermes", "llama3_json"}
    for name, parser in PARSERS.items():
        assert parser.name == name and parser.models


def test_a_forced_call_is_calls_only_and_never_shows_the_servers_opening():
    """tool_choice required or a named function: the output continues the server's call opening. A
    call that parses is the whole message (what follows it dropped, content None, as OpenAI's); one
    that does not leaves the output as the model wrote it, without the opening. Streamed: the same
    message, and the events add up to it."""
    from dlite_trt.serve.openai_server import ToolUse

    parser = Hermes()
    for opening in (parser.opening(None), parser.opening("get_weather")):
        use = ToolUse(parser, opening, single=False)
        named = opening.endswith(": ")
        good = ('{"city": "Paris"}}' if named else 'get_weather", "arguments": {"city": "Paris"}}') + \
            "\n</tool_call>\n\nThe weather in Paris is Paris."
        bad = '{\n "type": ' if named else 'Paris", "arguments": {\n "type": '
        for text, calls, content in [(good, [("get_weather", {"city": "Paris"})], None), (bad, [], bad)]:
            message = use.message(text)
            assert [(c.name, json.loads(c.arguments)) for c in message.calls] == calls
            assert message.content == content
            stream, events = ToolCallStream(parser, opening), []
            for end in range(1, len(text) + 1):
                events += stream.add(text[:end])
            rest, streamed = stream.finish(text)
            events += rest
            assert [(c.name, json.loads(c.arguments)) for c in streamed.calls] == calls
            assert streamed.content == content
            assert "".join(e[1] for e in events if e[0] == "content") == (content or "")
            assert [e[2].name for e in events if e[0] == "call"] == [name for name, _ in calls]


def test_a_calls_arguments_are_taken_as_clients_send_them():
    """A history's call arguments as OpenAI's JSON text, as an object (vLLM takes it), or "" (what
    streaming accumulators leave for a call without arguments): rendered as the same object."""
    from dlite_trt.serve.openai_protocol import ChatCompletionRequest

    def rendered(arguments):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]})
        assert body.unsupported() == []
        return body.messages[1].for_template()["tool_calls"][0]["function"]["arguments"]

    assert rendered('{"a": [1, "é"]}') == rendered({"a": [1, "é"]}) == {"a": [1, "é"]}
    assert rendered("") == rendered("{}") == {}
