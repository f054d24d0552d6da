"""RouterService: the gRPC front door, beside the HTTP one (:mod:`.http_app`) and sharing its request checks.

Generate maps the ``pd.v1.GenerateRequest`` to a prompt and a :class:`.prepare.SamplingRequest` and prepares it
with :class:`.prepare.RequestPreparer`, the same checks and tokenization as the HTTP API (a failed check is
INVALID_ARGUMENT). The sampling fields beyond those (penalties, min_p, min_tokens, logit_bias, bad words, allowed
token ids, logprobs, prompt_logprobs, n, guided) are taken from the request as they are, their token ids checked
against the vocabulary. It runs the request with the caller's deadline (each hop gets the time left; an expired
deadline is DEADLINE_EXCEEDED and aborts the work on every service; a call without a deadline gets none) and streams
text deltas per choice (:func:`.pipeline.generate_text`, as the HTTP API: ``index``, logprobs, the prompt's logprobs
on the first message; usage on the last message, once every choice has finished). A cancelled call closes the pipeline, which aborts the request
on the backend (the prefill and decode workers, or the colocated engine). No field of the request names a worker or
a KV transfer endpoint; unknown fields are ignored by protobuf and never consulted. Strings that are not valid UTF-8
never reach a handler (the strict decoder answers INVALID_ARGUMENT). Preparation runs in worker threads
(:class:`.offload.Offload`), and a text prompt that cannot fit the context is refused before it is tokenized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.deadline import deadline_after
from splitserve.errors import InvalidRequest, PdError
from splitserve.frontend.backend import GenerationBackend
from splitserve.frontend.errors import APIError
from splitserve.frontend.offload import Offload
from splitserve.frontend.pipeline import TextDelta, generate_text
from splitserve.frontend.prepare import PreparedRequest, RequestPreparer, SamplingRequest
from splitserve.rpc.convert import (
    FINISH_TO_PROTO, extra_sampling_fields, logprobs_to_proto, prompt_logprobs_to_proto, sampling_fields,
)
from splitserve.rpc.status import abort_with
from splitserve.telemetry.requests import observe_request

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of a request that leaves ``sampling.max_tokens`` unset."""


def sampling_request(msg: common_pb2.SamplingParams, stop: list[str]) -> SamplingRequest:
    """The request's sampling fields with the proto's defaults (temperature 0 = greedy; top_p and top_k off;
    ``max_tokens`` :data:`DEFAULT_MAX_TOKENS`)."""
    options = sampling_fields(msg, DEFAULT_MAX_TOKENS)
    max_tokens = options.pop("max_tokens")
    return SamplingRequest(options, max_tokens=max_tokens, stop=tuple(stop))


def response_of(request_id: str, delta: TextDelta) -> router_pb2.GenerateResponse:
    """One choice's delta as a GenerateResponse (usage left for the caller)."""
    msg = router_pb2.GenerateResponse(
        request_id=request_id, text=delta.text, token_ids=delta.token_ids, finish_reason=FINISH_TO_PROTO[delta.finish_reason],
        index=delta.index, logprobs=logprobs_to_proto(delta.logprobs),
    )
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(delta.prompt_logprobs))
    return msg


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """``pd.v1.RouterService`` over a :class:`GenerationBackend` (see the module docstring).

    Args:
        backend: where tokens come from (the router's RoutedBackend or the colocated engine).
        tokenizer: a :class:`.backend.TokenizerLike`.
        max_model_len: the context limit in tokens.
        model_name: the served model's name (telemetry).
        offload: the thread pools that prepare requests (default: a new :class:`Offload`).
    """

    def __init__(
        self, backend: GenerationBackend, tokenizer, max_model_len: int, model_name: str = "", offload: Offload | None = None
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.offload = offload or Offload()
        self.preparer = RequestPreparer(tokenizer, max_model_len)
        self.streams_open = 0
        self.model_name = model_name  # for telemetry

    def _prepare(self, request: router_pb2.GenerateRequest) -> PreparedRequest:
        """Prompt ids and sampling params of ``request`` (runs in a worker thread). Raises InvalidRequest."""
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequest("set prompt or prompt_token_ids")
        prompt = request.prompt if which == "prompt" else list(request.prompt_token_ids.ids)
        try:
            prepared = self.preparer.prepare(prompt, sampling_request(request.sampling, list(request.stop)))
            extra = extra_sampling_fields(request.sampling)
            for name, ids in (("logit_bias", [t for t, _ in extra["logit_bias"]]),
                              ("bad_words_token_ids", [t for w in extra["bad_words_token_ids"] for t in w]),
                              ("allowed_token_ids", extra["allowed_token_ids"] or [])):
                self.preparer.check_token_ids(ids, f"sampling.{name}")
            params = dataclasses.replace(prepared.params, **extra)
        except APIError as exc:
            raise InvalidRequest(exc.message) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return PreparedRequest(prepared.prompt_ids, params, prepared.stop)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        request_id = f"gen-{uuid.uuid4().hex}"
        self.streams_open += 1
        try:
            prepared = await self.offload.run(request.ByteSize(), self._prepare, request)  # off the event loop
            prompt_ids, params = prepared.prompt_ids, prepared.params
            deadline = deadline_after(context.time_remaining())
            completion_tokens = 0
            cached = 0
            open_choices = params.n
            deltas = observe_request(
                generate_text(self.backend, self.tokenizer, request_id, prompt_ids, params, prepared.stop, deadline),
                model=self.model_name, request_id=request_id, prompt_tokens=len(prompt_ids), params=params,
            )
            async with contextlib.aclosing(deltas):  # closed (aborting the request) even if this handler is dropped
                async for delta in deltas:
                    completion_tokens += len(delta.token_ids)
                    cached = max(cached, delta.cached_tokens)
                    msg = response_of(request_id, delta)
                    open_choices -= delta.finish_reason is not None
                    if open_choices == 0:
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
