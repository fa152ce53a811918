"""The Triton Python-backend model that serves an engine (``model.py`` in the repository imports it).

Non-decoupled (``dlite``): Triton's dynamic batcher hands ``execute`` the requests that arrived
together; their greedy ones run as one engine batch. Decoupled (``dlite_stream``): each request
streams one response per engine step with the text and ids it added, then a final empty response.
A malformed request gets an error response naming the problem, and a request that fails in the
engine an error of its own; the others in its batch are served. Before every engine step a stream
asks Triton whether its client cancelled (disconnected, or stopped the stream with cancellation):
if so it stops there and the instance goes on to the next request.

Test-only fault hook: with ``DLITE_TRT_TEST_FAULT_PROMPT`` (comma-separated token ids) in the
server's environment, an engine run (a batch or a stream) that holds a prompt of exactly those ids
raises as a broken engine would, so tests of a real server can show one failing request leaves
the rest of its batch answered. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.errors import DLiteError
from dlite_trt.serve.generation import Reply, RequestRunner
from dlite_trt.serve.protocol import INPUTS, Request, parse_request

FAULT_PROMPT_ENV = "DLITE_TRT_TEST_FAULT_PROMPT"


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
        """One response per engine step (that step's text and ids, statistics so far), then a final flag."""
        sender = request.get_response_sender()
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            parsed = self._parse(request)
            with closing(self.runner.stream(parsed)) as pieces:  # closed early: the engine session goes
                self._send_until_cancelled(pieces, sender, parsed)
        except Exception as exc:  # noqa: BLE001 - the client must still get an answer and the final flag
            sender.send(self._error(exc), flags=final)
            return
        sender.send(flags=final)  # a cancelled request too: Triton releases it on the final flag

    def _send_until_cancelled(self, pieces: Iterator[tuple[str, list[int], Reply]], sender: Any,
                              request: Request) -> None:
        """Send each piece; before asking for the next (the next engine step) check whether the
        client cancelled, so a client that went away does not keep the instance busy."""
        tokens = 0
        while not sender.is_cancelled():
            piece = next(pieces, None)
            if piece is None:
                return
            text, ids, reply = piece
            sender.send(self._response(text, ids, reply))
            tokens = len(reply.output_ids)
        self.pb.Logger.log_info(f"dlite-trt: stream cancelled by its client after {tokens} of max_tokens "
                                f"{request.max_tokens} tokens; stopped there")

    def finalize(self) -> None:
        self.runner = None
