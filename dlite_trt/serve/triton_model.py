"""The Triton Python-backend model that serves an engine (``model.py`` in the repository imports it).

Non-decoupled (``dlite``): Triton's dynamic batcher hands ``execute`` the requests that arrived
together; their greedy ones run as one engine batch. Decoupled (``dlite_stream``): each request
streams one response per engine step with the text and ids it added, then a final empty response.
A malformed request gets an error response naming the problem; the others in its batch are served.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from dlite_trt.errors import DLiteError
from dlite_trt.serve.generation import Reply, RequestRunner
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
        if args.get("model_instance_kind") == "GPU":  # a TensorRT engine: this instance's GPU
            import torch

            torch.cuda.set_device(int(args["model_instance_device_id"]))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.runner = RequestRunner(load_engine(engine_dir, threads=threads, preload=("prefill", "step")))
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
        try:
            for i, reply in zip(good, self.runner.run([parsed[i] for i in good]), strict=True):
                responses[i] = self._response(reply.text, reply.output_ids, reply)
        except Exception as exc:  # noqa: BLE001 - the batch failed: each of its requests learns why
            for i in good:
                responses[i] = self._error(exc)
        return responses

    def _stream(self, request: Any) -> None:
        """One response per engine step (that step's text and ids, statistics so far), then a final flag."""
        sender = request.get_response_sender()
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            for text, ids, reply in self.runner.stream(self._parse(request)):
                sender.send(self._response(text, ids, reply))
        except Exception as exc:  # noqa: BLE001 - the client must still get an answer and the final flag
            sender.send(self._error(exc), flags=final)
            return
        sender.send(flags=final)

    def finalize(self) -> None:
        self.runner = None
