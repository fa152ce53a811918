"""The Triton Python-backend model that serves an engine (``model.py`` in the repository imports it).

Non-decoupled (``dlite``): Triton's dynamic batcher hands ``execute`` the requests that arrived
together; their greedy ones run as one engine batch. Decoupled (``dlite_stream``): each request
streams one response per engine step with the text and ids it added, then a final empty response.
A malformed request gets an error response naming the problem; the others in its batch are served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.errors import DLiteError
from dlite_trt.serve.generation import Reply, Server
from dlite_trt.serve.protocol import INPUTS, Request, parse_request


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        from dlite_trt.engine.load import load_engine

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / args["model_version"] / params["engine_dir"]
        threads = int(params.get("threads", "0")) or None
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.server = Server(load_engine(engine_dir, threads=threads, preload=("prefill", "step")))
        limits = self.server.generator.manifest.limits
        self.limits = dict(vocab_size=self.server.generator.manifest.target_spec.vocab_size,
                           max_seq_len=limits.max_seq_len)

    def _parse(self, request: Any) -> Request:
        inputs = {}
        for t in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, t.name)
            if tensor is not None:
                inputs[t.name] = tensor.as_numpy()
        parameters = json.loads(request.parameters() or "{}")
        return parse_request(inputs, tokenizer=self.server.tokenizer, parameters=parameters, **self.limits)

    def _response(self, reply: Reply) -> Any:
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([reply.text.encode()], dtype=np.object_)),
            pb.Tensor("output_ids", np.array(reply.output_ids, dtype=np.int64)),
            pb.Tensor("mean_acceptance_length", np.array([reply.mean_acceptance_length], dtype=np.float32)),
            pb.Tensor("accepted_draft_tokens", np.array([reply.accepted], dtype=np.int64)),
            pb.Tensor("proposed_draft_tokens", np.array([reply.proposed], dtype=np.int64)),
        ])

    def _error(self, exc: Exception) -> Any:
        return self.pb.InferenceResponse(error=self.pb.TritonError(str(exc)))

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
            except DLiteError as exc:
                parsed.append(None)
                responses[i] = self._error(exc)
        good = [i for i, p in enumerate(parsed) if p is not None]
        try:
            replies = self.server.run([parsed[i] for i in good])
        except DLiteError as exc:  # e.g. the engine refuses a batch: every request in it learns why
            replies = [exc] * len(good)
        for i, reply in zip(good, replies, strict=True):
            responses[i] = self._error(reply) if isinstance(reply, Exception) else self._response(reply)
        return responses

    def _stream(self, request: Any) -> None:
        sender = request.get_response_sender()
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            parsed = self._parse(request)
            for text, ids, reply in self.server.stream(parsed):  # this step's text and ids, stats so far
                sender.send(self._response(Reply(ids, text, reply.steps, reply.accepted, reply.proposed)))
            sender.send(flags=final)
        except DLiteError as exc:
            sender.send(self._error(exc), flags=final)

    def finalize(self) -> None:
        self.server = None
