"""RouterService.Generate: the router's gRPC front door (same pipeline as the HTTP API)."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

import grpc
from pd.v1 import router_pb2, router_pb2_grpc

from splitserve.errors import InvalidRequest, PdError
from splitserve.frontend.backend import GenerationBackend
from splitserve.frontend.pipeline import generate_text
from splitserve.rpc.convert import FINISH_TO_PROTO, sampling_from_proto
from splitserve.rpc.status import abort_with
from splitserve.telemetry.requests import observe_request


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, backend: GenerationBackend, tokenizer, max_model_len: int, model_name: str = "") -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_name = model_name  # for telemetry

    def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidRequest("the prompt is empty")
            ids = self.tokenizer.encode(request.prompt)
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
        else:
            raise InvalidRequest("set prompt or prompt_token_ids")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        return ids

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        request_id = f"gen-{uuid.uuid4().hex}"
        try:
            prompt_ids = self._prompt_ids(request)
            sampling = request.sampling
            if not request.HasField("sampling") or sampling.max_tokens == 0:
                sampling = type(sampling)()
                sampling.CopyFrom(request.sampling)
                sampling.max_tokens = sampling.max_tokens or 16
            params = sampling_from_proto(sampling)
            if len(prompt_ids) + params.max_tokens > self.max_model_len:
                raise InvalidRequest(
                    f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context ({self.max_model_len})"
                )
            if len(request.stop) > 4 or any(not s for s in request.stop):
                raise InvalidRequest("stop: at most 4 non-empty strings")
            completion_tokens = 0
            cached = 0
            deltas = generate_text(self.backend, self.tokenizer, request_id, prompt_ids, params, list(request.stop))
            async for delta in observe_request(deltas, model=self.model_name, request_id=request_id, prompt_tokens=len(prompt_ids), params=params):
                completion_tokens += len(delta.token_ids)
                cached = max(cached, delta.cached_tokens)
                msg = router_pb2.GenerateResponse(
                    request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                    finish_reason=FINISH_TO_PROTO[delta.finish_reason],
                )
                if delta.finish_reason is not None:
                    msg.usage.CopyFrom(router_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens, cached_tokens=cached))
                yield msg
        except PdError as exc:
            await abort_with(context, exc)
