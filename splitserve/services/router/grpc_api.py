"""RouterService: the router's gRPC front door (same pipeline as the HTTP API).

Generate validates the request (INVALID_ARGUMENT), runs it with the caller's deadline (each hop gets
the time left; an expired deadline is DEADLINE_EXCEEDED and aborts the work on every service; a call
without a deadline gets none) and streams text deltas. A cancelled call closes the pipeline, which
aborts the request on the prefill and decode workers. No field of the request names a worker or a KV
transfer endpoint; unknown fields are ignored by protobuf and never consulted. Strings that are not
valid UTF-8 never reach a handler (the strict decoder answers INVALID_ARGUMENT). Tokenization runs in
worker threads (:class:`splitserve.frontend.offload.Offload`), and a text prompt that cannot fit the
context is refused before it is tokenized.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.deadline import deadline_after
from splitserve.errors import InvalidRequest, PdError
from splitserve.frontend.backend import GenerationBackend
from splitserve.frontend.offload import Offload
from splitserve.frontend.pipeline import generate_text
from splitserve.frontend.prompt_limit import PromptLimit
from splitserve.rpc.convert import FINISH_TO_PROTO, sampling_from_proto
from splitserve.rpc.status import abort_with
from splitserve.telemetry.requests import observe_request

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self, backend: GenerationBackend, tokenizer, max_model_len: int, model_name: str = "", offload: Offload | None = None
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.offload = offload or Offload()
        self.prompt_limit = PromptLimit(tokenizer, max_model_len)
        self.vocab_size = tokenizer.hf.get_vocab_size(with_added_tokens=True)
        self.streams_open = 0
        self.model_name = model_name  # for telemetry

    def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (runs in a worker thread). Raises InvalidRequest."""
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidRequest("the prompt is empty")
            if not self.prompt_limit.fits(request.prompt):
                raise InvalidRequest(
                    f"the prompt ({len(request.prompt)} characters) cannot fit the context ({self.max_model_len} tokens)"
                )
            ids = self.tokenizer.encode(request.prompt)
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise InvalidRequest("set prompt or prompt_token_ids")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        return ids

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        request_id = f"gen-{uuid.uuid4().hex}"
        self.streams_open += 1
        try:
            prompt_ids = await self.offload.run(request.ByteSize(), self._prompt_ids, request)  # off the event loop
            params = sampling_from_proto(request.sampling, default_max_tokens=DEFAULT_MAX_TOKENS)
            if len(prompt_ids) + params.max_tokens > self.max_model_len:
                raise InvalidRequest(
                    f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context ({self.max_model_len})"
                )
            if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
                raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
            bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
            if bad_stop:
                raise InvalidRequest(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})")
            deadline = deadline_after(context.time_remaining())
            completion_tokens = 0
            cached = 0
            deltas = observe_request(
                generate_text(self.backend, self.tokenizer, request_id, prompt_ids, params, list(request.stop), deadline),
                model=self.model_name, request_id=request_id, prompt_tokens=len(prompt_ids), params=params,
            )
            async with contextlib.aclosing(deltas):  # closed (aborting the request) even if this handler is dropped
                async for delta in deltas:
                    completion_tokens += len(delta.token_ids)
                    cached = max(cached, delta.cached_tokens)
                    msg = router_pb2.GenerateResponse(
                        request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                        finish_reason=FINISH_TO_PROTO[delta.finish_reason],
                    )
                    if delta.finish_reason is not None:
                        msg.usage.CopyFrom(router_pb2.Usage(
                            prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens, cached_tokens=cached))
                    yield msg
        except PdError as exc:
            await abort_with(context, exc)
        finally:
            self.streams_open -= 1

    async def GetStats(self, request: common_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> common_pb2.GetStatsResponse:
        stats = getattr(self.backend, "stats", None)
        counters = dict(stats()) if callable(stats) else {}
        counters["grpc_streams_open"] = self.streams_open
        return common_pb2.GetStatsResponse(counters=counters)
