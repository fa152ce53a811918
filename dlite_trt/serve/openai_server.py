"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the in-flight scheduler.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
target tokenizer's chat template), ``GET /health``, ``GET /metrics`` (Prometheus). Each request
becomes a row of the scheduler's running batch; its updates (one per engine call) come back
through an asyncio queue. Text is cut at the first stop string (``ReplyText``: streamed pieces
always add up to the final text); a stop string or a client that went away cancels the row,
which leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.serve.generation import Reply, ReplyText
from dlite_trt.serve.metrics import CONTENT_TYPE
from dlite_trt.serve.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_message,
)
from dlite_trt.serve.scheduler import QueueFull, Scheduler

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class OpenAIFrontend:
    """The app's state: the scheduler, the tokenizer and the model's name."""

    def __init__(self, loaded: Any, scheduler: Scheduler, model_name: str, default_temperature: float = 0.0) -> None:
        self.scheduler, self.tokenizer, self.model_name = scheduler, loaded.tokenizer, model_name
        self.engine_stops = tuple(loaded.stop_token_ids)
        self.default_temperature = default_temperature
        self.max_seq_len = scheduler.limits.max_seq_len
        self.vocab_size = scheduler.spec.vocab_size
        self.created = int(time.time())

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- requests -> token ids and sampling parameters ---------------------------------------
    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ApiError(400, "this engine's tokenizer has no chat template; use /v1/completions with the "
                                    "prompt formatted yourself.", param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
            except Exception as exc:  # noqa: BLE001 - the template's own error (jinja raise_exception) is the reason
                raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
            return [int(t) for t in ids]
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
        for param, message in body.unsupported():
            raise ApiError(400, message, param=param)
        if body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models).", param="model", code="model_not_found")
        limit = body.token_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
        if len(prompt) >= self.max_seq_len and limit is None:
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

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        # the openai client retries 5xx twice by default: an engine failure would run three times
        headers = {"x-should-retry": "false"} if exc.status == 500 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape, and logged
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error",
                                       code="internal_error"), status_code=500)

    @app.exception_handler(404)
    async def _not_found(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}; see GET /v1/models, POST "
                                       "/v1/completions, POST /v1/chat/completions.", code="not_found"),
                            status_code=404)

    @app.exception_handler(405)
    async def _not_allowed(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}.",
                                       code="method_not_allowed"), status_code=405)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = frontend.scheduler.alive
        return JSONResponse({"status": "ok" if alive else "scheduler stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.scheduler.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": frontend.created,
                                            "owned_by": "dlite-trt", "max_model_len": frontend.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _serve(request, body, chat=True)

    async def _serve(request: Request, body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> Any:
        prompt = frontend.prompt_ids(body)
        params = frontend.params(body, prompt)
        handle, updates = frontend.submit(prompt, params)
        text = ReplyText(frontend.decode, body.stop)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": frontend.model_name}
        run = _Run(handle, updates, text, prompt, head, chat, body.return_token_ids)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(run, include_usage), media_type="text/event-stream")
        reason = None
        try:
            async for _, last in _events(run, request):
                reason = last
        finally:
            handle.cancel()  # a no-op when it finished; frees the row when this task was cancelled
        if reason is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        reply = text.reply
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS[reason], "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": reply.text}} if chat else {"text": reply.text}
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
                 chat: bool, token_ids: bool) -> None:
        self.handle, self.updates, self.text, self.prompt = handle, updates, text, prompt
        self.head, self.chat, self.token_ids = head, chat, token_ids


async def _events(run: _Run, request: Request | None) -> AsyncIterator[tuple[tuple[str, list[int]], str | None]]:
    """((new text, new ids), None) per piece, then (("", []), finish reason) once the request ends.
    A stop string cancels its row; a non-streamed request (``request`` given) polls for its client
    having gone, and cancels its row then (a streamed one is cancelled by Starlette)."""
    while True:
        try:
            if request is None:
                update = await run.updates.get()
            else:
                update = await asyncio.wait_for(run.updates.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                run.handle.cancel()
                return
            continue
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

    def chunk(delta_text: str | None, ids: list[int], finish: str | None, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if run.chat:
            delta = {"role": "assistant"} if role else {}
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        if run.token_ids:
            choice["token_ids"] = ids
        return {**run.head, "object": kind, "choices": [choice], **extra}

    try:
        if run.chat:
            yield _sse(chunk("", [], None, role=True))
        reason = None
        try:
            async for (delta, ids), reason in _events(run, None):
                if reason is None and (delta or ids):
                    yield _sse(chunk(delta, ids, None))
        except ApiError as exc:
            yield _sse(exc.body())
            yield _sse("[DONE]")
            return
        if reason is None:
            return
        final = chunk(None if run.chat else "", [], FINISH_REASONS[reason])
        final["speculative"] = _speculative(run.text.reply)
        yield _sse(final)
        if include_usage:
            yield _sse({**run.head, "object": kind, "choices": [],
                        "usage": _usage(run.prompt, run.text.reply, run.handle.cached_tokens)})
        yield _sse("[DONE]")
    finally:
        run.handle.cancel()  # a no-op when it finished; frees the row when the client went away
