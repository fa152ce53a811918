"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the in-flight scheduler.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
target tokenizer's chat template), ``GET /health``, ``GET /metrics`` (Prometheus). Each request
becomes a row of the scheduler's running batch; its updates (one per engine call) come back
through an asyncio queue. Text is cut at the first stop string (``ReplyText``: streamed pieces
always add up to the final text); a stop string or a client that went away (streamed or not,
running or still queued) cancels the row, which leaves the batch at the next step.

Tools (``ToolUse``, ``serve.tool_parsers``): rendered by the chat template, read back from the
output by --tool-call-parser, streamed as OpenAI's tool-call deltas.

Hostile input (``serve.limits``): a body over --max-body-mb is a 413 before it is read; text,
ids, types and stop strings are checked before anything expensive; the chat template and the
tokenizer run off the event loop, so /health and other clients are served meanwhile. Every
error, including a body that is not JSON, is in OpenAI's shape. The first Ctrl-C drains: new
requests get 503 (with Retry-After) while those in flight finish, then the listener closes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.serve.generation import Reply, ReplyText
from dlite_trt.serve.limits import BodySizeLimit, ServerLimits, longest_token_chars
from dlite_trt.serve.metrics import CONTENT_TYPE
from dlite_trt.serve.openai_protocol import (
    ApiError,
    COMPLETION_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
    validation_message,
)
from dlite_trt.serve.scheduler import QueueFull, Scheduler
from dlite_trt.serve.tool_parsers import PARSERS, Parsed, ToolCallStream, ToolParser

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}
RETRY_AFTER_S = 1  # what a 503 tells clients to wait


@dataclass(frozen=True)
class ToolSettings:
    """How the server takes ``tools`` (vLLM's flags): ``parser`` (--tool-call-parser: a name in
    ``tool_parsers.PARSERS``) reads calls from the output, ``auto`` (--enable-auto-tool-choice) lets
    the model decide (tool_choice auto), ``chat_template`` (--chat-template: its text) renders the
    tools where the tokenizer's own template does not."""

    parser: str | None = None
    auto: bool = False
    chat_template: str | None = None


@dataclass(frozen=True)
class ToolUse:
    """One request's tools: the parser, and the call opening appended to its prompt (tool_choice
    required or a named function; "" for auto), which its output continues."""

    parser: ToolParser
    opening: str
    single: bool  # parallel_tool_calls false: the first call only

    def message(self, text: str) -> Parsed:
        """The output ``text`` as a message. A forced call (``opening``) is calls only, as OpenAI's:
        what follows them is dropped; where none parses, the content is the output as the model
        wrote it (the server's opening left out)."""
        parsed = self.parser.parse(self.opening + text)
        if self.opening:
            parsed = Parsed(None, parsed.calls) if parsed.calls else Parsed(text or None)
        return Parsed(parsed.content, parsed.calls[:1]) if self.single else parsed


class ErrorJSON(JSONResponse):
    """Errors echo what the client sent (a field's name, a model's name), which JSON may have made
    unencodable (a lone surrogate): escaped to ASCII, they always encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


class OpenAIFrontend:
    """The app's state: the scheduler, the tokenizer and the model's name."""

    def __init__(self, loaded: Any, scheduler: Scheduler, model_name: str, default_temperature: float = 0.0,
                 limits: ServerLimits | None = None, tools: ToolSettings | None = None) -> None:
        self.scheduler, self.tokenizer, self.model_name = scheduler, loaded.tokenizer, model_name
        self.tools = tools or ToolSettings()
        self.parser = PARSERS[self.tools.parser]() if self.tools.parser else None
        self.with_tools, self.without_tools = self._templates()
        self.engine_stops = tuple(loaded.stop_token_ids)
        self.default_temperature = default_temperature
        self.max_seq_len = scheduler.limits.max_seq_len
        self.vocab_size = scheduler.spec.vocab_size
        self.limits = limits or ServerLimits()
        self.max_prompt_chars = self.limits.max_prompt_chars or (
            None if self.tokenizer is None else self.max_seq_len * longest_token_chars(self.tokenizer))
        self.created = int(time.time())
        self.in_flight = 0  # requests being answered (streams until their last event)
        self.draining = False  # Ctrl-C: new requests get 503 while those in flight finish

    def _templates(self) -> tuple[str | None, str | None]:
        """The chat template for requests with tools and without: --chat-template for both, else the
        tokenizer's (one template, or transformers' pick among named ones: ``tool_use`` with tools)."""
        if self.tools.chat_template:
            return self.tools.chat_template, self.tools.chat_template
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return None, None
        pick = self.tokenizer.get_chat_template
        try:
            without = pick(None, tools=None)
        except ValueError:  # named templates, none of them the default
            without = None
        try:
            return pick(None, tools=[{}]), without
        except ValueError:
            return None, without

    # -- cheap checks, before anything that grows with the request ------------------------------
    def screen(self, body: CompletionRequest | ChatCompletionRequest) -> ToolUse | None:
        """The request's options, its model, its stop strings and its text's length (not yet tokenized);
        its tools as the server runs them (``tool_use``)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another server.", code="server_shutting_down")
        for param, message in body.unsupported():
            raise ApiError(400, message, param=param)
        if body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models).", param="model", code="model_not_found")
        limits = self.limits
        if len(body.stop) > limits.max_stops:
            raise ApiError(400, f"{len(body.stop)} stop strings; this server takes at most {limits.max_stops} "
                                "(dlite-trt serve --max-stops).", param="stop")
        longest = max(map(len, body.stop), default=0)
        if longest > limits.max_stop_chars:
            raise ApiError(400, f"a stop string of {longest:,} characters; this server takes at most "
                                f"{limits.max_stop_chars:,} (dlite-trt serve --max-stop-chars).", param="stop")
        chat = isinstance(body, ChatCompletionRequest)
        chars = body.text_chars() if chat else \
            sum(len(p) for p in ([body.prompt] if isinstance(body.prompt, str) else body.prompt) if isinstance(p, str))
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt is {chars:,} characters, more than the engine can ever take "
                                f"({self.max_prompt_chars:,}: --max-seq-len {self.max_seq_len} tokens, or dlite-trt "
                                "serve --max-prompt-chars); shorten it.", param="messages" if chat else "prompt")
        if not chat and isinstance(body.prompt, list) and len(body.prompt) > self.max_seq_len:
            raise ApiError(400, f"the prompt is {len(body.prompt)} tokens, and the engine allows {self.max_seq_len} "
                                "(--max-seq-len) with the output; shorten it.", param="prompt")
        return self.tool_use(body) if chat else None  # refuses tools this server cannot take

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- requests -> token ids and sampling parameters ---------------------------------------
    def renders_tools(self, body: ChatCompletionRequest) -> bool:
        """Whether the request's tools go into the prompt: it has some, and the template takes them
        (with tool_choice none too, as OpenAI keeps them visible: only the output is not parsed)."""
        return bool(body.tools) and "tools" in (self.with_tools or "")

    def tool_use(self, body: ChatCompletionRequest) -> ToolUse | None:
        """The request's tools as this server reads calls back (None: no tools, or tool_choice none),
        or a 400 saying which flag of `dlite-trt serve` they need."""
        if not body.tools or body.chosen == "none":
            return None
        if self.parser is None:
            raise ApiError(400, "this server reads no tool calls: start it with --tool-call-parser NAME (" +
                                ", ".join(f"{n}: {p.models}" for n, p in PARSERS.items()) +
                                ") and --enable-auto-tool-choice, or send tool_choice none.", param="tools")
        if body.chosen in (None, "auto") and not self.tools.auto:
            raise ApiError(400, "tool_choice auto (the default with tools) needs `dlite-trt serve "
                                "--enable-auto-tool-choice`; or send tool_choice required or a named function.",
                           param="tool_choice")
        if not self.renders_tools(body):
            raise ApiError(400, "this engine's chat template does not render tools: start the server with "
                                "--chat-template FILE (for SmolLM2: the bundled "
                                "dlite_trt/bundled/templates/smollm2_tools.jinja).", param="tools")
        forced = body.chosen not in (None, "auto")
        return ToolUse(self.parser, self.parser.opening(None if body.chosen == "required" else body.chosen)
                       if forced else "", body.parallel_tool_calls is False)

    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest, use: ToolUse | None = None) -> list[int]:
        """The request's token ids (chat: rendered with its tools, ``use``'s call opening appended)."""
        if isinstance(body, ChatCompletionRequest):
            tools = self.renders_tools(body)
            template = self.with_tools if tools else self.without_tools
            if self.tokenizer is None or not template:
                raise ApiError(400, "this engine's tokenizer has no chat template; use /v1/completions with the "
                                    "prompt formatted yourself, or start the server with --chat-template FILE.",
                               param="messages")
            history = any(m.tool_calls or m.role == "tool" for m in body.messages)
            if history and "tool_calls" not in template:
                raise ApiError(400, "the history holds tool calls or tool results, and this engine's chat template "
                                    "does not render them: start the server with --chat-template FILE (for SmolLM2: "
                                    "the bundled dlite_trt/bundled/templates/smollm2_tools.jinja).", param="messages")
            kwargs = dict(body.chat_template_kwargs or {})
            if tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
            try:
                text = self.tokenizer.apply_chat_template([m.for_template() for m in body.messages],
                                                          add_generation_prompt=body.add_generation_prompt,
                                                          continue_final_message=body.continue_final_message,
                                                          tokenize=False, chat_template=template, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the template's own error (jinja raise_exception) is the reason
                raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
            text += use.opening if use else ""
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # from strings no field type checks: the tools' schemas, call ids
                raise ApiError(400, "the rendered prompt holds a lone surrogate (\\u"
                                    f"{ord(text[exc.start]):04x}), from the tools' schemas or the history's calls; "
                                    "send valid UTF-8 text.", param="tools" if body.tools else "messages") from None
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this engine has no tokenizer; send the prompt as a list of token ids.",
                               param="prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty; send at least one token.", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}.",
                           param="prompt")
        return ids

    def params(self, body: CompletionRequest | ChatCompletionRequest, prompt: list[int]) -> SamplingParams:
        chat = isinstance(body, ChatCompletionRequest)
        limit = body.token_limit if chat else COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        if len(prompt) >= self.max_seq_len:  # no room for a single output token
            raise ApiError(400, f"the prompt is {len(prompt)} tokens, and the engine allows {self.max_seq_len} "
                                "(--max-seq-len) with the output; shorten it.", param="messages"
                           if isinstance(body, ChatCompletionRequest) else "prompt")
        max_tokens = self.max_seq_len - len(prompt) if limit is None else limit
        temperature = self.default_temperature if body.temperature is None else body.temperature
        stops = (() if body.ignore_eos else self.engine_stops) + tuple(body.stop_token_ids)
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=body.seed,
                                    stop_token_ids=stops)
            self.scheduler.check(len(prompt), max_tokens)
        except DLiteError as exc:
            raise ApiError(400, str(exc), param="max_tokens") from exc
        return params

    # -- running --------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[Any, asyncio.Queue]:
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        try:
            handle = self.scheduler.submit(prompt, params, lambda u: loop.call_soon_threadsafe(updates.put_nowait, u))
        except QueueFull as exc:
            raise ApiError(503, str(exc), code="server_overloaded") from exc
        except DLiteError as exc:
            raise ApiError(400, str(exc)) from exc
        return handle, updates


def _speculative(reply: Reply) -> dict[str, Any]:
    return {"mean_acceptance_length": round(reply.mean_acceptance_length, 4),
            "accepted_draft_tokens": reply.accepted, "proposed_draft_tokens": reply.proposed,
            "steps": reply.step_count}


def _usage(prompt: list[int], reply: Reply, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(reply.output_ids),
            "total_tokens": len(prompt) + len(reply.output_ids), "prompt_tokens_details": {"cached_tokens": cached}}


def create_app(frontend: OpenAIFrontend) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        frontend.scheduler.start()
        try:
            yield
        finally:
            frontend.scheduler.stop()

    app = FastAPI(title="dlite-trt", summary="OpenAI-compatible DLite speculative decoding server",
                  lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=frontend.limits.max_body_bytes)

    def error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
        # the openai client retries 5xx twice by default: an engine failure would run three times
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else \
            {"x-should-retry": "false"} if status >= 500 else None
        return ErrorJSON(error_body(message, param=param, code=code,
                                    kind="invalid_request_error" if status < 500 else "server_error"),
                         status_code=status, headers=headers)

    @app.middleware("http")
    async def _api_key(request: Request, call_next: Any) -> Response:
        """With --api-key, the /v1 routes answer only requests that carry it (vLLM's rule): 401 else."""
        key = frontend.limits.api_key
        if key and request.url.path.startswith("/v1") and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
            return ErrorJSON(error_body("a missing or wrong API key: send the header Authorization: Bearer <the "
                                        "server's --api-key> (the openai client's api_key).", code="invalid_api_key"),
                             status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error(400, message, param=param)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """What Starlette and FastAPI raise themselves: no route, a method not allowed, and a body
        that could not be parsed at all (not UTF-8, numbers past Python's digit limit, nesting past
        its recursion limit), whose cause is what the client needs to know."""
        if exc.status_code == 404:
            return error(404, f"no route {request.method} {request.url.path}; see GET /v1/models, POST "
                              "/v1/completions, POST /v1/chat/completions.", code="not_found")
        if exc.status_code == 405:
            return error(405, f"{request.method} is not allowed on {request.url.path}.", code="method_not_allowed")
        cause = exc.__cause__
        message = str(exc.detail) if cause is None else \
            f"the body is not valid JSON in UTF-8 ({type(cause).__name__}: {str(cause)[:200]})"
        return error(exc.status_code, message, code="invalid_body" if exc.status_code == 400 else None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape, and logged
        return error(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")

    errors = {status: {"model": ErrorResponse, "description": what} for status, what in [
        (400, "A malformed request: the message names the field and the fix."), (404, "No such model or route."),
        (413, "The body is over --max-body-mb."), (503, "Full (--max-queue) or shutting down: retry after Retry-After.")]}
    generation = {**errors, 200: {"description": "The completion (JSON), or with stream: true server-sent events "
                                                 "of chunks ending with [DONE].",
                                  "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}}

    @app.get("/health", responses={503: {"description": "The scheduler stopped, or the server is shutting down."}})
    async def health() -> JSONResponse:
        status = "shutting down" if frontend.draining else "ok" if frontend.scheduler.alive else "scheduler stopped"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return PlainTextResponse(frontend.scheduler.metrics.text(), media_type=CONTENT_TYPE)

    def model() -> dict[str, Any]:
        return {"id": frontend.model_name, "object": "model", "created": frontend.created, "owned_by": "dlite-trt",
                "max_model_len": frontend.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model()]}

    @app.get("/v1/models/{name:path}", responses=errors)
    async def one_model(name: str) -> dict[str, Any]:
        if name != frontend.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {frontend.model_name!r}.",
                           param="model", code="model_not_found")
        return model()

    @app.post("/v1/completions", responses=generation)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions", responses=generation)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _serve(request, body, chat=True)

    openapi = app.openapi

    def schema_without_422() -> dict[str, Any]:
        """FastAPI lists a 422 for every body; this server answers validation errors with 400."""
        schema = openapi()
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = schema_without_422

    async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> Any:
        use = frontend.screen(body)
        frontend.in_flight += 1
        streamed = False
        try:
            response = await _answer(request, body, chat, use)
            streamed = isinstance(response, _RowStream)  # counted until it is closed
            return response
        finally:
            if not streamed:
                frontend.in_flight -= 1

    async def _answer(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                      use: ToolUse | None) -> Any:
        prompt = await asyncio.to_thread(frontend.prompt_ids, body, use)  # the template, the tokenizer: off the loop
        params = frontend.params(body, prompt)
        handle, updates = frontend.submit(prompt, params)
        text = ReplyText(frontend.decode, body.stop)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": frontend.model_name}
        run = _Run(handle, updates, text, prompt, head, chat, body.return_token_ids, use)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _RowStream(_stream(run, include_usage), frontend, handle)
        reason = None
        watcher = asyncio.create_task(_until_disconnected(request, run))
        try:
            async for _, last in _events(run):
                reason = last
        finally:
            watcher.cancel()
            handle.cancel()  # a no-op when it finished; frees the row when this task was cancelled
        if reason is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        reply = text.reply
        finish = FINISH_REASONS[reason]
        if run.tools is None:
            choice: dict[str, Any] = {"message": {"role": "assistant", "content": reply.text}} if chat else \
                {"text": reply.text}
        else:
            parsed = run.tools.message(reply.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message["tool_calls"] = [c.message() for c in parsed.calls]
                finish = "tool_calls"  # as vLLM's: whatever followed the calls
            choice = {"message": message}
        choice = {"index": 0, "finish_reason": finish, "logprobs": None, **choice}
        if run.token_ids:
            choice["token_ids"] = reply.output_ids
        out = {**head, "choices": [choice], "usage": _usage(prompt, reply, handle.cached_tokens),
               "speculative": _speculative(reply)}
        if run.token_ids:
            out["prompt_token_ids"] = prompt
        return JSONResponse(out)

    return app


class _Run:
    """One request in flight: its row's handle and updates, its reply text, what its chunks carry."""

    def __init__(self, handle: Any, updates: asyncio.Queue, text: ReplyText, prompt: list[int], head: dict,
                 chat: bool, token_ids: bool, tools: ToolUse | None = None) -> None:
        self.handle, self.updates, self.text, self.prompt = handle, updates, text, prompt
        self.head, self.chat, self.token_ids, self.tools = head, chat, token_ids, tools


async def _until_disconnected(request: Request, run: _Run) -> None:
    """A non-streamed request's watch on its client (its body is read: what comes next is the
    disconnect): the client gone, its row is cancelled (queued or running) and its wait ends."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.handle.cancel()
    run.updates.put_nowait(None)


class _RowStream(StreamingResponse):
    """A streamed answer: however it ends (its last event, its client gone, even before its first
    event was asked for), its row is cancelled and it no longer counts as in flight."""

    def __init__(self, events: AsyncIterator[str], frontend: OpenAIFrontend, handle: Any) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.frontend, self.handle = frontend, handle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # a no-op when it finished
            self.frontend.in_flight -= 1


async def _events(run: _Run) -> AsyncIterator[tuple[tuple[str, list[int]], str | None]]:
    """((new text, new ids), None) per piece, then (("", []), finish reason) once the request ends;
    nothing more when its client went away (a None update). A stop string cancels its row."""
    while True:
        update = await run.updates.get()
        if update is None:
            return
        if update.error is not None:
            run.handle.cancel()
            raise ApiError(500, f"the engine failed on this request: {update.error}", code="engine_error")
        for piece in run.text.take(update.tokens, update.step, update.finish_reason is not None):
            yield piece, None
        if run.text.done:
            run.handle.cancel("stop_string")  # a stop string ended it: its row leaves at the next step
            yield ("", []), "stop_string"
            return
        if update.finish_reason:
            yield ("", []), update.finish_reason
            return


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(run: _Run, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shapes; the client going away cancels the row."""
    kind = "chat.completion.chunk" if run.chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(delta_text: str | None, ids: list[int], finish: str | None, role: bool = False,
              delta: dict | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if run.chat:
            delta = dict(delta or {}) | ({"role": "assistant"} if role else {})
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        if run.token_ids:
            choice["token_ids"] = ids
        return {**run.head, "object": kind, "choices": [choice], **extra}

    calls = None if run.tools is None else ToolCallStream(run.tools.parser, run.tools.opening)

    def tool_chunks(events: list[tuple], ids: list[int]) -> list[str]:
        """A piece through the tool parser: its content and completed calls as deltas (the ids on the first)."""
        deltas = []
        for event in events:
            if event[0] == "content":
                deltas.append({"content": event[1]})
            elif not (run.tools.single and event[1] > 0):
                _, index, call = event
                deltas += [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]},
                           {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
        if not deltas and ids and run.token_ids:
            deltas = [{}]
        return [_sse(chunk(None, ids if i == 0 else [], None, delta=d)) for i, d in enumerate(deltas)]

    try:
        if run.chat:
            yield _sse(chunk("", [], None, role=True))
        reason = None
        try:
            async for (delta, ids), reason in _events(run):
                if reason is None and (delta or ids):
                    if calls is None:
                        yield _sse(chunk(delta, ids, None))
                    else:
                        for event in tool_chunks(calls.add(run.text.reply.text), ids):
                            yield event
        except ApiError as exc:
            yield _sse(exc.body())
            yield _sse("[DONE]")
            return
        if reason is None:
            return
        finish = FINISH_REASONS[reason]
        if calls is not None:
            events, parsed = calls.finish(run.text.reply.text)
            for event in tool_chunks(events, []):
                yield event
            if parsed.calls:
                finish = "tool_calls"
        final = chunk(None if run.chat else "", [], finish)
        final["speculative"] = _speculative(run.text.reply)
        yield _sse(final)
        if include_usage:
            yield _sse({**run.head, "object": kind, "choices": [],
                        "usage": _usage(run.prompt, run.text.reply, run.handle.cached_tokens)})
        yield _sse("[DONE]")
    finally:
        run.handle.cancel()  # a no-op when it finished; frees the row when the client went away


class DrainingServer(uvicorn.Server):
    """uvicorn whose first Ctrl-C (or SIGTERM) drains: the listener stays open, new requests and
    /health get 503 with Retry-After, and the requests in flight run to their end, for at most
    ``limits.shutdown_timeout`` seconds; then uvicorn's own shutdown (listener closed, what is left
    cancelled). A second Ctrl-C stops at once."""

    def __init__(self, config: uvicorn.Config, frontend: OpenAIFrontend) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.drain_until: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_until is None:
            self._captured_signals.append(sig)
            self.frontend.draining = True
            self.drain_until = time.monotonic() + self.frontend.limits.shutdown_timeout
            return
        super().handle_exit(sig, frame)
        self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and (self.frontend.in_flight == 0 or time.monotonic() > self.drain_until):
            self.should_exit = True
        return await super().on_tick(counter)
