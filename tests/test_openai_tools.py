"""Tool calls through `dlite-trt serve` (issue 30), with the real server and the real openai client.

The target is made here so that its greedy output is a tool call: a Llama whose next token
depends on the current token alone (attention and MLP outputs zero; the LM head maps each
token to a scripted successor), with a tokenizer whose pieces of the call are tokens of their
own, and a chat template that takes ``tools`` (the bundled tools template, as its own). So
every answer after the generation prompt is ``<tool_call>{"name": "get_weather", "arguments":
{"city": "Paris"}}</tool_call>`` and the end token, as transformers' greedy decoding of the
rendered prompt confirms."""

from __future__ import annotations

import json
import string

import pytest
import torch
from helpers import draft_config, hf_greedy, random_draft

from dlite_trt.bundled import tools_template
from dlite_trt.serve.openai_process import OpenAIServerProcess

openai = pytest.importorskip("openai", reason="the tests drive the server with the real openai client")

MODEL = "scripted"
CALL = ['{"name": "get_weather", "arguments": ', '{"city": "Paris"}', "}"]
NAMED = 'get_weather", "arguments": '  # what follows the forced opening of tool_choice required
ADDED = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", *CALL, NAMED]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(["<unk>", *chars])}, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    tok.add_tokens(ADDED[2:])
    tok.add_special_tokens({"additional_special_tokens": ADDED[:2]})
    tok.chat_template = tools_template().read_text()
    return tok


def _scripted_target(tok):
    """A Llama whose greedy next token is ``successor[current]``: the generation prompt's last
    token ("\\n") -> the call's pieces -> the end token; a named call's opening continues too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = {t: tok.convert_tokens_to_ids(t) for t in [*ADDED, "\n", '"']}
    chain = ["\n", "<tool_call>", *CALL, "</tool_call>", "<|im_end|>"]
    successor = {ids[a]: ids[b] for a, b in zip(chain, chain[1:])}
    successor[ids['"']] = ids[NAMED]  # tool_choice required: the opening ends in '{"name": "'
    successor[ids[NAMED]] = ids[CALL[1]]
    vocab = len(tok)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=vocab + (-vocab % 8), intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=ids["<|im_end|>"], bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for t in range(vocab):
            model.lm_head.weight[successor.get(t, ids["<|im_end|>"]), t] = 10.0
    return model


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """(engine directory, tokenizer, transformers target)."""
    from dlite_trt.checkpoint import save_draft
    from dlite_trt.config import TargetSpec
    from dlite_trt.engine.build import BuildSettings, build_engine
    from dlite_trt.export.contract import EngineLimits

    tmp = tmp_path_factory.mktemp("tools")
    tok = _tokenizer()
    hf = _scripted_target(tok)
    hf.save_pretrained(tmp / "target")
    tok.save_pretrained(tmp / "target")
    spec = TargetSpec.from_hf_config(hf.config.to_dict())
    save_draft(random_draft(draft_config(spec, block_size=4, anchor_group_size=2)), tmp / "draft")
    build_engine(tmp / "target", tmp / "draft", tmp / "engine", BuildSettings(limits=EngineLimits(
        max_batch=2, max_seq_len=2048, max_chunk=64)), progress=False)
    return tmp / "engine", tok, hf


@pytest.fixture(scope="module")
def server(scripted):
    with OpenAIServerProcess(scripted[0], "--tool-call-parser", "hermes", "--enable-auto-tool-choice", model=MODEL,
                             threads=1, start_timeout=120) as server:
        server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield server


def _greedy(scripted, messages, tools=None) -> tuple[str, list[int]]:
    """transformers' greedy answer of the rendered prompt: its text (without the end token) and ids."""
    _, tok, hf = scripted
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    out = hf_greedy(hf, tok.encode(text, add_special_tokens=False), 12)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = out[: out.index(end) + 1] if end in out else out
    return tok.decode(out[:-1] if out[-1] == end else out), out


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_scripted_target_answers_with_a_call(scripted):
    assert _greedy(scripted, ASK, TOOLS)[0] == "<tool_call>" + "".join(CALL) + "</tool_call>"


def test_a_tools_request_returns_parsed_tool_calls(server, scripted):
    r = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0,
                                              extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == _greedy(scripted, ASK, TOOLS)[1]  # the target's own greedy output
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_call_is_reassembled_by_the_client(server):
    with server.client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12,
                                               temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the agent loop as the openai client's docs write it: the message object itself goes back
    # (with the fields the helper adds: parsed, parsed_arguments, annotations)
    r = server.client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=12, temperature=0,
        messages=[*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert r.choices[0].message.tool_calls and r.usage.prompt_tokens_details.cached_tokens > 0


def test_the_result_continues_the_conversation_reusing_the_prefix(server, scripted):
    first = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12,
                                                  temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r = server.client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=12,
                                              temperature=0, extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    rendered = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        history[-1]]  # as templates take a call: its arguments an object
    assert r.choices[0].model_extra["token_ids"] == _greedy(scripted, rendered, TOOLS)[1]
    got = r.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_tool_choice_none_gives_content_only(server, scripted):
    """The tools stay in the prompt (as OpenAI keeps them visible); the output is not parsed."""
    _, tok, _ = scripted
    r = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    rendered = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert r.model_extra["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    message = r.choices[0].message
    assert not message.tool_calls and r.choices[0].finish_reason == "stop"
    assert message.content == "<tool_call>" + "".join(CALL) + "</tool_call>"  # the text, unparsed


def test_tool_choice_required_forces_the_call(server, scripted):
    r = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=12, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    named = server.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "share a name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18 C"}]}, "messages.1.tool_call_id",
     "no earlier assistant message"),
    ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id", "needs the tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "[1, 2]"}}]}]}, "messages.1.tool_calls.0.function.arguments",
     "JSON object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "\ud800"}}}]},
     "tools", "lone surrogate"),
])
def test_malformed_tools_requests_are_openai_400s(server, body, param, fragment):
    status, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["param"] == param and fragment in reply["error"]["message"], reply


def test_a_server_refuses_a_broken_chat_template_or_host_at_startup(scripted, tmp_path):
    """The operator's errors, before the engine loads: not a 400 blamed on every client later."""
    from click.testing import CliRunner

    from dlite_trt.cli import main

    broken, binary = tmp_path / "broken.jinja", tmp_path / "binary.jinja"
    broken.write_text("{% for m in messages %}{{ m.content ")
    binary.write_bytes(b"\xff\xfe{{ x }}")
    serve = ["serve", "--engine", str(scripted[0]), "--threads", "1"]
    for template, fragment in [(broken, "not a valid Jinja template"), (binary, "not UTF-8 text")]:
        result = CliRunner().invoke(main, [*serve, "--chat-template", str(template)])
        assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output, result.output
    result = CliRunner().invoke(main, [*serve, "--host", "999.1.1.1"])
    assert result.exit_code == 1 and "--host 999.1.1.1: cannot listen there" in result.output, result.output


def test_a_server_without_a_parser_says_which_flags(scripted):
    with OpenAIServerProcess(scripted[0], model=MODEL, threads=1, start_timeout=120) as plain:
        status, reply = plain.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS})
        assert status == 400 and "--tool-call-parser" in reply["error"]["message"], reply
        status, reply = plain.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                            "tool_choice": "none", "max_tokens": 12})
        assert status == 200 and reply["choices"][0]["message"]["content"].startswith("<tool_call>")


def test_bench_serve_replays_a_tool_using_agent(scripted, tmp_path):
    """`dlite-trt bench-serve --tools` on the scripted target: every request is answered with a
    call, so the instruction runs CALLS_PER_ASK calls and then an answer asked for with
    tool_choice none; DLite and target-only give the same tokens, and later requests reuse the
    conversation's prefix."""
    from click.testing import CliRunner

    from dlite_trt.bench.serve_replay import CALLS_PER_ASK
    from dlite_trt.cli import main

    result = CliRunner().invoke(main, ["bench-serve", "--engine", str(scripted[0]), "--tools", "--sessions", "1",
                                       "--turns", "1", "--concurrency", "1", "--speculative", "dlite,none",
                                       "--reuse", "on", "--threads", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["workload"] == "tool-using agent" and report["greedy_mismatches"] == 0
    turns = report["configs"]["dlite/reuse"]["by_concurrency"]["1"]["turns"]
    assert len(turns) == CALLS_PER_ASK + 1 == report["turns"] and report["turns_cut_to_fit_the_engine"] == 0
    assert [t["tool_calls"] for t in turns] == [1] * CALLS_PER_ASK + [0]  # calls, then the answer (tool_choice none)
    assert report["configs"]["dlite/reuse"]["by_concurrency"]["1"]["tool_calls"] == CALLS_PER_ASK
    assert all(t["cached_tokens"] > 0 for t in turns[1:]) and turns[-1]["prompt_tokens"] > turns[0]["prompt_tokens"]
    assert set(report["configs"]) == {"dlite/reuse", "none/reuse"}
