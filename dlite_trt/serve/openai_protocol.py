"""The OpenAI API's request bodies and error shape, as this server takes them, declared once.

Requests are validated by these models, strictly as OpenAI's API takes them: a field of the wrong
type (no string-to-number or number-to-bool coercion), an out-of-range value, text that is not
valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can carry and no tokenizer takes)
or a field OpenAI's API does not have is a 400 in OpenAI's error shape naming the field. Fields
OpenAI has but this server does not implement are taken at their no-op values (``n`` = 1,
penalties 0, ``top_p`` 1, no logprobs) and refused otherwise, with what to do instead. Tools:
``tools``, ``tool_choice`` and the history's calls and results are checked against each other here;
the server (``openai_server.ToolUse``) renders and parses them.

Departures from OpenAI's defaults, on purpose: ``temperature`` defaults to the server's
--default-temperature (0, greedy: the target's own output, which is what this server is
for); a chat's ``max_tokens`` defaults to what the engine's --max-seq-len leaves after the prompt
(as vLLM's), a completion's to 16 (OpenAI's and vLLM's). Extensions (vLLM's names): ``ignore_eos``,
``stop_token_ids`` (more end tokens), ``return_token_ids`` (the prompt's and the output's token ids in
the response), ``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message``
(passed to the chat template); vLLM's sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``) at their no-op values. Every response carries
``speculative``: mean acceptance length, draft tokens accepted and proposed, steps.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from dlite_trt.errors import DLiteError


def _unicode(value: str) -> str:
    """Text that can be encoded as UTF-8: JSON's escapes can make a lone surrogate, which cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise ValueError(f"not valid Unicode text: a lone surrogate (\\u{ord(bad):04x}) at character {exc.start}; "
                         "send valid UTF-8 text") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # every field whose text is tokenized or matched
NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]  # a token budget: OpenAI and vLLM refuse 0
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk; taken when false


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = STRICT

    model: str
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: Text | list[Text] | None = Field(None, validate_default=True)  # -> list[str]
    stream: bool | None = False  # null (as some SDKs send for OpenAI's nullable fields): the default
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] | None = 1
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # OpenAI fields with nothing to do here: taken and ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # this server reuses cached prefixes by itself
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling extensions: taken at their no-op values, refused otherwise (``unsupported``)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegative | None = None
    ignore_eos: bool = False
    stop_token_ids: list[NonNegative] = []
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for each OpenAI feature asked for that this server does not implement."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", f"n = {self.n}: this server returns one choice per request; send n requests."))
        if self.top_p is not None and self.top_p != 1.0:
            out.append(("top_p", f"top_p = {self.top_p} is not supported (the engine samples the full "
                                 "distribution); leave top_p out or set it to 1, and use temperature."))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported; leave it out or set it to 0."))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported; leave it out."))
        for name, no_op, fix in NO_OP_EXTENSIONS:
            value = getattr(self, name)
            if value is not None and value not in no_op:
                out.append((name, f"{name} = {value} is not supported (the engine samples the full distribution, "
                                  f"or emits the target's greedy tokens); {fix}"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream: true."))
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            out.append(("stream_options.continuous_usage_stats", "usage in every chunk is not supported; the last "
                                                                 "chunk carries it (include_usage)."))
        return out


# vLLM's sampling extensions: (field, its no-op values, what to send instead)
NO_OP_EXTENSIONS = (
    ("top_k", (-1, 0), "leave top_k out or set it to -1."),
    ("min_p", (0.0,), "leave min_p out or set it to 0."),
    ("repetition_penalty", (1.0,), "leave repetition_penalty out or set it to 1."),
    ("min_tokens", (0,), "leave min_tokens out or set it to 0 (ignore_eos runs to max_tokens)."),
)


COMPLETION_TOKENS = 16  # a completion's max_tokens when it sends none: OpenAI's default, and vLLM's


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            out.append(("prompt", f"{len(self.prompt)} prompts in one request: send one prompt per request."))
        if self.echo:
            out.append(("echo", "echo is not supported; the response holds the completion only."))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported; use return_token_ids for the output's ids."))
        if self.suffix is not None:
            out.append(("suffix", "suffix (insertion) is not supported."))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of is not supported; leave it out."))
        return out


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule for a function's name


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = STRICT
    name: FunctionName
    arguments: Text  # a JSON object, as text ("" as "{}"; an object, as vLLM takes it, as its text)
    parsed_arguments: Any = None  # what the openai client adds to a call it parsed (its .parse helpers); ignored

    @field_validator("arguments", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> Any:
        """What streaming accumulators and some frameworks send for a call's arguments."""
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
        return "{}" if value == "" else value


class ToolCallItem(BaseModel):
    """A call in an assistant message of the history (as the server returned it)."""

    model_config = STRICT
    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = None  # what a streamed call reassembled by the openai client keeps: ignored


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[ToolCallItem] | None = None  # an assistant message: the calls it made
    # what clients echo back in an assistant message: taken when empty (null, []), refused otherwise
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None  # a returned message's url citations: ignored
    parsed: Any = None  # what the openai client's .parse / .stream helpers add to a message: ignored

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """As chat templates take it (transformers' convention: a call's arguments as an object;
        OpenAI's ``developer`` role is its ``system`` role, the only one open-weight templates know)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["content"] = self.text() or None
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


# what ``chat_template_kwargs`` may not set: the server sets these itself
TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                      "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None  # for reasoning models; ignored
    verbosity: str | None = None  # for reasoning models; ignored
    prediction: dict[str, Any] | None = None  # a hint of the output; ignored (it never changes the output)
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM's: passed to the chat template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            out.append(("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one."))
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported; use return_token_ids for the output's ids."))
        if self.functions:
            out.append(("functions", "functions (deprecated by OpenAI) is not supported; send them as tools."))
        if self.function_call not in (None, "none", "auto"):
            out.append(("function_call", "function_call (deprecated by OpenAI) is not supported; use tool_choice."))
        if self.modalities not in (None, ["text"]):
            out.append(("modalities", "only text output is supported."))
        if self.audio is not None:
            out.append(("audio", "audio output is not supported; leave audio out."))
        if self.web_search_options is not None:
            out.append(("web_search_options", "web search is not supported; leave web_search_options out."))
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(TEMPLATE_ARGUMENTS))
        if reserved:
            out.append(("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: send them as "
                                                "the request's own fields (messages, tools, add_generation_prompt, "
                                                "continue_final_message)."))
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            out.append(("continue_final_message", "continue_final_message continues the last message: it must be an "
                                                  "assistant message, and add_generation_prompt false."))
        for i, m in enumerate(self.messages):
            if m.role != "assistant" and m.content is None:
                out.append((f"messages.{i}.content", f"a {m.role} message needs content (text, or a list of text "
                                                     "parts)."))
            if m.function_call or m.audio:
                out.append((f"messages.{i}", "messages with function calls (deprecated by OpenAI: use tool_calls) or "
                                             "audio are not supported; send their content as text."))
        out += self._tool_errors()
        if self.response_format not in (None, {"type": "text"}):
            out.append(("response_format", "response_format other than text is not supported."))
        return out

    def text_chars(self) -> int:
        """The characters of what the template renders from this request, before tokenizing: the
        messages' text, the tools' definitions and the history's calls."""
        return (sum(len(m.text()) + sum(len(c.function.arguments) + len(c.function.name) for c in m.tool_calls or ())
                    for m in self.messages)
                + sum(len(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)) for t in self.tools or ()))

    def _tool_errors(self) -> list[tuple[str, str]]:
        """Tools, tool_choice and the calls and results of the history, consistent with each other."""
        out, names = [], [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            out.append(("tools", f"two tools share a name ({sorted(n for n in names if names.count(n) > 1)[0]!r}); "
                                 "give each its own."))
        if self.tool_choice not in (None, "none") and not names:
            out.append(("tool_choice", f"tool_choice {self.chosen!r} needs tools; send tools or leave it out."))
        elif isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            out.append(("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not among the "
                                       f"tools ({', '.join(names)})."))
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                out.append((f"messages.{i}.tool_calls", "only an assistant message has tool_calls."))
            for j, call in enumerate(m.tool_calls or ()):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    out.append((f"messages.{i}.tool_calls.{j}.function.arguments",
                                "a call's arguments must be a JSON object, as text."))
                calls.add(call.id)
            if m.role == "tool":
                if m.tool_call_id is None:
                    out.append((f"messages.{i}.tool_call_id", "a tool message needs the tool_call_id of the call it "
                                                              "answers."))
                elif m.tool_call_id not in calls:
                    out.append((f"messages.{i}.tool_call_id", f"no earlier assistant message made a call with id "
                                                              f"{m.tool_call_id!r}."))
            elif m.tool_call_id is not None:
                out.append((f"messages.{i}.tool_call_id", "only a tool message has a tool_call_id."))
        return out

    @property
    def chosen(self) -> str | None:
        """tool_choice as one word ("none", "auto", "required"), or the named function's name."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error this server answers (4xx and 5xx) has this shape, OpenAI's."""

    error: ErrorDetail


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(DLiteError):
    """An error answered with ``status`` and OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A pydantic/FastAPI validation error list as one message naming the fields, and the first field.
    A field that may take several types (``prompt``: text, ids or a list of texts) gets the errors of
    the type its value had (the value's own fault) or, when it had none of them, one line listing them."""
    groups: dict[tuple, list[tuple[str | None, dict[str, Any]]]] = {}  # by the loc before a union's branch
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":  # its loc is ("body", character offset)
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
            continue
        loc = [x for x in err.get("loc", ()) if x != "body"]
        branch = next((i for i, x in enumerate(loc) if _union_branch(x)), len(loc))
        field = ".".join(str(x) for x in loc if not _union_branch(x)) or None
        groups.setdefault(tuple(loc[:branch]), []).append((field, err))
    first = None
    for errs in groups.values():
        own = [(f, e) for f, e in errs if not e.get("type", "").endswith("_type")]  # the value's own fault
        deepest = max(len(f or "") for f, _ in errs)
        own = own or [(f, e) for f, e in errs if len(f or "") == deepest]  # the branch whose shape it had
        if len(own) > 1 and len({f for f, _ in own}) == 1:  # none of the field's types
            field = own[0][0]
            parts.append(f"{field}: " + " or ".join(dict.fromkeys(e.get("msg", "") for _, e in own))
                         .replace(" or Input should be", " or"))
        else:
            parts += [_message(f, e) for f, e in own]
        first = first or own[0][0]
    return "; ".join(parts) or "invalid request", first


def _union_branch(part: Any) -> bool:
    """Whether a pydantic error location part names a union's branch (``str``, ``list[int]``,
    ``function-after[...]``, a model's class name) rather than a field or an index."""
    return isinstance(part, str) and ("[" in part or "-" in part or part[:1].isupper()
                                      or part in {"str", "int", "float", "bool", "list", "dict", "none"})


def _message(field: str | None, err: dict[str, Any]) -> str:
    if err.get("type") == "extra_forbidden":
        return (f"{field}: unknown field (this server takes OpenAI's parameters for this endpoint and the vLLM "
                "extensions docs/serving.md lists); leave it out")
    if field is None and err.get("type") in ("missing", "model_attributes_type", "dict_type"):  # the body itself
        return ("the body must be a JSON object (send it with the header Content-Type: application/json)")
    if err.get("type") == "missing":
        return f"{field}: required"
    msg = str(err.get("msg")).removeprefix("Value error, ")
    return f"{field}: {msg}" if field else msg
