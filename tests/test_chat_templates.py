"""The bundled tools template for the default target (``bundled/templates/smollm2_tools.jinja``),
rendered by transformers with SmolLM2's own tokenizer (from the demo model's GGUF): without tools
it is SmolLM2's own template; with tools, an assistant turn's calls render as the text the
model is asked to write, which the hermes parser reads back as the same calls."""

from __future__ import annotations

import json

import pytest

from dlite_trt.bundled import tools_template
from dlite_trt.serve.tool_parsers import Hermes

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"q": "café"}'}}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "A loop?"}],
])
def test_without_tools_it_is_smollm2s_own_template(tokenizer, messages):
    assert _render(tokenizer, messages, chat_template=tools_template().read_text()) == _render(tokenizer, messages)


def test_tools_calls_and_results(tokenizer):
    template = tools_template().read_text()
    asked = [{"role": "user", "content": "Weather in Paris, and search for cafés?"}]
    prompt = _render(tokenizer, asked, chat_template=template, tools=TOOLS)
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    history = [*asked, {"role": "assistant", "content": None, "tool_calls": CALLS},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
               {"role": "tool", "tool_call_id": "call_2", "content": "3 results"}]
    full = _render(tokenizer, history, chat_template=template, tools=TOOLS)
    assert full.startswith(prompt)  # the next turn extends the previous prompt: its KV entries are reused
    answer, _, after = full[len(prompt):].partition("<|im_end|>")
    parsed = Hermes().parse(answer)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("search", {"q": "café"})]
    # both results in one user turn
    assert after == ("\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n3 results\n"
                     "</tool_response><|im_end|>\n<|im_start|>assistant\n")
