"""The Triton Python-backend model that serves an engine (``model.py`` in the repository imports it).

Non-decoupled (``dlite``): Triton's dynamic batcher hands ``execute`` the requests that arrived
together; their greedy ones run as one engine batch. Decoupled (``dlite_stream``): ``execute``
hands each request to the in-flight scheduler (``serve.scheduler``, the OpenAI server's: requests
join the running engine batch at step boundaries, prefix KV reuse across requests) and returns;
the scheduler's thread sends one response per engine step with the text and ids it added, then
a final empty response. A malformed request gets an error response naming the problem, and a
request that fails in the engine an error of its own; the others are served. At every step a
stream asks Triton whether its client cancelled (disconnected, or stopped the stream with
cancellation): if so its row leaves the batch there.

Test-only fault hook: with ``DLITE_TRT_TEST_FAULT_PROMPT`` (comma-separated token ids) in the
server's environment, an engine run that holds a prompt of exactly those ids raises as a broken
engine would (a batch of ``dlite``; a step of ``dlite_stream``), so tests of a real server can
show one failing request leaves the rest answered. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.errors import DLiteError
from dlite_trt.runtime.session import SamplingParams
from dlite_trt.serve.generation import Reply, ReplyText, RequestRunner
from dlite_trt.serve.protocol import INPUTS, Request, parse_request
from dlite_trt.serve.scheduler import FAULT_PROMPT_ENV, Scheduler, Update


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        from dlite_trt.engine.load import load_engine

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / args["model_version"] / params["engine_dir"]
        threads = int(params.get("threads", "0")) or None
        if args.get("model_instance_kind") == "GPU":  # a TensorRT engine: this instance's GPU
            import torch

            torch.cuda.set_device(int(args["model_instance_device_id"]))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.runner = RequestRunner(load_engine(engine_dir, threads=threads, preload=("prefill", "step")))
        fault = os.environ.get(FAULT_PROMPT_ENV)
        if fault:  # tests only (see the module docstring)
            self.runner.fault_prompt = tuple(int(t) for t in fault.split(","))
            pb_utils.Logger.log_warn(f"dlite-trt: {FAULT_PROMPT_ENV} is set: the prompt {fault} fails (a test hook)")
        manifest = self.runner.generator.manifest
        self.limits = dict(vocab_size=manifest.target_spec.vocab_size, max_seq_len=manifest.limits.max_seq_len)
        self.scheduler = Scheduler(self.runner.generator).start() if self.decoupled else None

    def _parse(self, request: Any) -> Request:
        inputs = {}
        for t in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, t.name)
            if tensor is not None:
                inputs[t.name] = tensor.as_numpy()
        parameters = json.loads(request.parameters() or "{}")
        return parse_request(inputs, tokenizer=self.runner.tokenizer, parameters=parameters, **self.limits)

    def _response(self, text: str, ids: list[int], stats: Reply) -> Any:
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb.Tensor("output_ids", np.array(ids, dtype=np.int64)),
            pb.Tensor("mean_acceptance_length", np.array([stats.mean_acceptance_length], dtype=np.float32)),
            pb.Tensor("accepted_draft_tokens", np.array([stats.accepted], dtype=np.int64)),
            pb.Tensor("proposed_draft_tokens", np.array([stats.proposed], dtype=np.int64)),
        ])

    def _error(self, exc: Exception) -> Any:
        """Bad input: INVALID_ARG (HTTP 400) with our message; anything else: INTERNAL, logged in full."""
        error = self.pb.TritonError
        if isinstance(exc, DLiteError):
            return self.pb.InferenceResponse(error=error(str(exc), error.INVALID_ARG))
        self.pb.Logger.log_error("dlite-trt model failed:\n" + "".join(traceback.format_exception(exc)))
        return self.pb.InferenceResponse(error=error(f"internal error in the dlite-trt model: {exc!r}",
                                                     error.INTERNAL))

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        parsed: list[Request | None] = []
        responses: list[Any] = [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                parsed.append(self._parse(request))
            except Exception as exc:  # noqa: BLE001 - every request gets its own answer, the others go on
                parsed.append(None)
                responses[i] = self._error(exc)
        good = [i for i, p in enumerate(parsed) if p is not None]
        for i, result in zip(good, self.runner.run_each([parsed[i] for i in good]), strict=True):
            responses[i] = self._error(result) if isinstance(result, Exception) else self._reply(result)
        return responses

    def _reply(self, reply: Reply) -> Any:
        try:
            return self._response(reply.text, reply.output_ids, reply)
        except Exception as exc:  # noqa: BLE001 - this request's answer is its error, the others go on
            return self._error(exc)

    def _stream(self, request: Any) -> None:
        """Queue the request on the scheduler; its thread sends the responses (``_Stream``)."""
        sender = request.get_response_sender()
        try:
            parsed = self._parse(request)
            stream = _Stream(self, sender, parsed)
            params = SamplingParams(max_new_tokens=parsed.max_tokens, temperature=parsed.temperature,
                                    seed=parsed.seed, stop_token_ids=self.runner.stop_ids(parsed))
            stream.handle = self.scheduler.submit(parsed.prompt, params, stream.deliver)
        except Exception as exc:  # noqa: BLE001 - the client must still get an answer and the final flag
            sender.send(self._error(exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        self.runner = None


class _Stream:
    """One ``dlite_stream`` request on the scheduler: each update (an engine call) becomes a response
    with the text and ids it added; the last one, a stop string or a cancelled client ends it with
    the final flag. Runs on the scheduler's thread."""

    def __init__(self, model: TritonPythonModel, sender: Any, request: Request) -> None:
        self.model, self.sender, self.request = model, sender, request
        self.text = ReplyText(model.runner.decode, request.stop)
        self.handle = None  # set once submitted (a max_tokens = 0 request is answered before that)
        self.ended = False

    def _end(self, response: Any = None) -> None:
        self.ended = True
        self.sender.send(response, flags=self.model.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def deliver(self, update: Update) -> None:
        if self.ended:
            return
        if update.error is not None:
            return self._end(self.model._error(update.error))
        if self.sender.is_cancelled():  # the client went away: its row leaves at the next step
            self.handle.cancel()
            self.model.pb.Logger.log_info(
                f"dlite-trt: stream cancelled by its client after {len(self.text.reply.output_ids)} of max_tokens "
                f"{self.request.max_tokens} tokens; stopped there")
            return self._end()
        for text, ids in self.text.take(update.tokens, update.step, update.finish_reason is not None):
            self.sender.send(self.model._response(text, ids, self.text.reply))
        if self.text.done:
            self.handle.cancel("stop_string")
        if self.text.done or update.finish_reason is not None:
            self._end()
