"""The OpenAI-compatible HTTP API (Starlette), independent of where tokens come from.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (with ``max_model_len``),
``POST /tokenize``, ``POST /detokenize``, ``GET /version`` (vLLM's shapes, :mod:`.tokenize_api`),
``GET /health`` (200 when ``backend.ready()``, else 503).

``n`` > 1 choices are streamed interleaved, each chunk naming its ``index``; the stream (or the
non-streamed response) ends when every choice has finished.

Streaming uses SSE: ``data: {json}\\n\\n`` events ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk carries usage and empty choices (with vLLM's
``continuous_usage_stats`` every chunk also carries the usage so far). The first
pipeline delta is produced before the response starts, so backend errors raised up to
then (admission, capacity, prefill) get a real HTTP status and OpenAI error body; an
error after streaming started becomes an SSE ``data: {"error": {...}}`` event followed by
``data: [DONE]`` (as vLLM does). A client disconnect, streaming or not, closes the
pipeline and so aborts the backend request. Request ids (``cmpl-<hex>`` /
``chatcmpl-<hex>``) are made here; client-supplied ids are ignored.

Hostile input: bodies above ``max_body_bytes`` get 413 unread; no field or header can name a
worker, a KV transfer endpoint or a store (unknown fields are 400, headers are not consulted);
with ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>`` (401). Odd
JSON and text (unpaired surrogates, NaN, duplicate keys, deep nesting, wrong types) are 400s
(:mod:`.json_body`, :mod:`.protocol`).

Preparing a request (parsing, chat template, tokenization, the checks shared with the gRPC front
door in :mod:`.prepare`) runs in worker threads (:class:`.offload.Offload`), never on the event loop,
and a text prompt that cannot fit the context is refused before it is tokenized (:mod:`.prompt_limit`).

With ``token_continuity`` (:mod:`.token_continuity`), each finished choice of a text or chat request is remembered
(its prompt text + returned text -> prompt ids + output ids) once its response is complete, so a later prompt that
continues it (the next chat turn) reuses those ids. Every returned choice is remembered (with ``n`` > 1 each is a
conversation the client may continue); not remembered: ``best_of`` choices that were not returned, chat requests
with ``tools`` (their text is returned as ``tool_calls``), ``max_tokens: 0`` echoes, choices ended by ``abort``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from splitserve.deadline import deadline_after
from splitserve.frontend.auth import ApiKeyMiddleware
from splitserve.frontend.backend import GenerationBackend, ModelInfo
from splitserve.frontend.errors import APIError, error_response, to_api_error
from splitserve.frontend.logprob_format import TokenTexts
from splitserve.frontend.offload import Offload
from splitserve.frontend.pipeline import TextDelta, generate_text
from splitserve.frontend.prepare import ChatPrompt, PreparedRequest, RequestPreparer
from splitserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, ModelCard
from splitserve.frontend.responses import ChatFormatter, CompletionFormatter, Outcome, ResponseFormatter, ResponseSpec
from splitserve.frontend.sse import DONE, SSEResponse, cancel_on_disconnect, sse_event
from splitserve.frontend.token_continuity import TokenContinuity
from splitserve.frontend.tokenize_api import TokenizeAPI
from splitserve.frontend import validation as v
from splitserve.frontend.structured import with_guided
from splitserve.frontend.tools import plan_tools, template_messages
from splitserve.telemetry.requests import observe_request

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

CLIENT_CLOSED_REQUEST = 499


DEFAULT_MAX_BODY_BYTES = 16 * 2**20
"""Largest request body accepted (413 above): a prompt of a 1M-token context fits."""


def build_app(
    model_info: ModelInfo,
    backend: GenerationBackend,
    *,
    extra_routes: Sequence[BaseRoute] | None = None,
    api_key: str | None = None,
    request_timeout_s: float | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    offload: Offload | None = None,
    token_continuity: TokenContinuity | None = None,
) -> Starlette:
    """Build the ASGI app serving ``model_info`` with tokens from ``backend``.

    Args:
        model_info: ``name``, ``tokenizer`` (TokenizerLike) and ``max_model_len``.
        backend: the :class:`GenerationBackend` (colocated engine or P/D router).
        extra_routes: more Starlette routes to mount (e.g. metrics, admin).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401).
        request_timeout_s: when set, each generation request gets this deadline (504
            ``deadline_exceeded`` before the first byte, an SSE error event after); None: no deadline.
        max_body_bytes: larger request bodies get 413 without being read.
        offload: the thread pools that prepare requests (default: a new :class:`Offload`).
        token_continuity: remembers finished requests' texts and token ids and encodes prompts that continue them
            (see the module docstring); None: every prompt is encoded fresh.
    """
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    api = _OpenAIServer(model_info, backend, request_timeout_s, max_body_bytes, offload or Offload(), token_continuity)
    tokens = TokenizeAPI(model_info, api.preparer, api.offload, max_body_bytes)
    routes: list[BaseRoute] = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/tokenize", tokens.tokenize, methods=["POST"]),
        Route("/detokenize", tokens.detokenize, methods=["POST"]),
        Route("/version", tokens.version, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        *(extra_routes or ()),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _on_error, Exception: _on_error})


async def _on_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


class _OpenAIServer:
    """Request handlers bound to one model and backend."""

    def __init__(
        self, model_info: ModelInfo, backend: GenerationBackend, request_timeout_s: float | None, max_body_bytes: int,
        offload: Offload, continuity: TokenContinuity | None = None,
    ) -> None:
        self.info = model_info
        self.backend = backend
        self.tokenizer = model_info.tokenizer
        self.created = int(time.time())
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.offload = offload
        self.continuity = continuity
        self.preparer = RequestPreparer(self.tokenizer, model_info.max_model_len, continuity)
        self.texts = TokenTexts(self.tokenizer)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        try:
            body = await v.read_body(request, self.max_body_bytes)
            req, prepared, spec = await self.offload.run(len(body), self._prepare_completion, body)
        except Exception as e:
            return error_response(e)
        fmt = CompletionFormatter(id=f"cmpl-{uuid.uuid4().hex}", model=self.info.name, spec=spec, texts=self.texts)
        return await self._serve(request, req, prepared, fmt)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        try:
            body = await v.read_body(request, self.max_body_bytes)
            req, prepared, spec = await self.offload.run(len(body), self._prepare_chat, body)
        except Exception as e:
            return error_response(e)
        fmt = ChatFormatter(id=f"chatcmpl-{uuid.uuid4().hex}", model=self.info.name, spec=spec, texts=self.texts,
                            tools=plan_tools(req.tools, req.tool_choice))  # validated in _prepare_chat
        return await self._serve(request, req, prepared, fmt)

    def _prepare_completion(self, body: bytes) -> tuple[CompletionRequest, PreparedRequest, ResponseSpec]:
        """Body -> validated request, prompt ids, sampling params, what to show (a worker thread; raises APIError)."""
        req = v.parse_request(body, CompletionRequest, v.UNSUPPORTED_COMPLETION)
        v.check_model(req.model, self.info.name)
        prompt = v.completion_prompt(req)
        prepared = self.preparer.prepare(prompt, v.completion_sampling(req, COMPLETION_DEFAULT_MAX_TOKENS), "prompt")
        prepared = with_guided(prepared, req, self.tokenizer)  # structured outputs (frontend.structured)
        # the echo is the prompt's tokens' text, BOS included (vLLM's echo of token ids), so text_offset adds up
        prompt_text = self.tokenizer.decode(prepared.prompt_ids, skip_special_tokens=False) if req.echo else ""
        spec = ResponseSpec(n=req.n, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs, echo=req.echo,
                            echo_only=req.max_tokens == 0, prompt_ids=prepared.prompt_ids, prompt_text=prompt_text)
        return req, prepared, spec

    def _prepare_chat(self, body: bytes) -> tuple[ChatCompletionRequest, PreparedRequest, ResponseSpec]:
        """Body -> validated request, rendered and encoded prompt, sampling params, what to show (a worker thread)."""
        req = v.parse_request(body, ChatCompletionRequest, v.UNSUPPORTED_CHAT)
        v.check_model(req.model, self.info.name)
        plan = plan_tools(req.tools, req.tool_choice)  # --- tools and structured outputs (frontend.tools / .structured)
        messages = ChatPrompt(template_messages([m.template_dict() for m in req.messages]), plan.tools if plan else None)
        prepared = self.preparer.prepare(messages, v.chat_sampling(req), "messages")
        prepared = with_guided(prepared, req, self.tokenizer, plan.guided() if plan else None)
        spec = ResponseSpec(n=req.n, logprobs=req.num_logprobs, prompt_logprobs=req.prompt_logprobs,
                            prompt_ids=prepared.prompt_ids)
        return req, prepared, spec

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the one served model."""
        card = ModelCard(id=self.info.name, created=self.created, max_model_len=self.info.max_model_len)
        return JSONResponse({"object": "list", "data": [card.model_dump()]})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 when the backend is ready, else 503."""
        try:
            ready = await self.backend.ready()
        except Exception:
            ready = False
        if ready:
            return JSONResponse({"status": "ok"})
        return error_response(APIError("backend not ready", status=503, type="server_error", code="not_ready"))

    async def _serve(
        self, request: Request, req: GenerationRequest, prepared: PreparedRequest, fmt: ResponseFormatter
    ) -> Response:
        deadline = deadline_after(self.request_timeout_s)
        prompt_ids, params = prepared.prompt_ids, prepared.params
        deltas = observe_request(  # request span + TTFT/ITL metrics around the pipeline
            generate_text(self.backend, self.tokenizer, fmt.id, prompt_ids, params, prepared.stop, deadline),
            model=self.info.name, request_id=fmt.id, prompt_tokens=len(prompt_ids), params=params, stream=req.stream,
        )
        headers = {"x-request-id": fmt.id}
        try:
            finished, first = await cancel_on_disconnect(request.receive, deltas.__anext__)
        except StopAsyncIteration:  # pipeline contract: never happens (a finish delta always comes)
            finished, first = True, TextDelta("", [], "abort")
        except Exception as e:
            await _aclose(deltas)
            return error_response(e, fmt.id)
        if not finished:
            await _aclose(deltas)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if req.stream:
            events = _sse_events(deltas, first, fmt, len(prompt_ids), params.n, req.include_usage, req.continuous_usage,
                                 lambda outcome: self._remember(prepared, outcome, fmt))
            return SSEResponse(events, headers=headers)
        try:
            finished, outcome = await cancel_on_disconnect(request.receive, lambda: _collect(deltas, first, params.n))
        except Exception as e:
            return error_response(e, fmt.id)
        finally:
            await _aclose(deltas)
        if not finished or outcome is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            body = fmt.full(outcome, len(prompt_ids))
        except Exception as e:  # the backend broke its contract (e.g. no logprobs although asked for)
            return error_response(e, fmt.id)
        await self._remember(prepared, outcome, fmt)
        return JSONResponse(body, headers=headers)

    async def _remember(self, prepared: PreparedRequest, outcome: Outcome, fmt: ResponseFormatter) -> None:
        """Token continuity: remember each returned choice of a finished text or chat request (module docstring)."""
        continuity = self.continuity
        if (continuity is None or prepared.prompt_text is None or fmt.spec.echo_only
                or getattr(fmt, "tools", None) is not None or len(outcome.choices) != fmt.spec.n):
            return
        choices = [c for c in outcome.choices.values() if c.finish_reason not in (None, "abort") and c.token_ids]

        def remember() -> None:
            try:
                for c in choices:
                    continuity.remember(prepared.prompt_text, prepared.add_special_tokens, prepared.prompt_ids,
                                        c.token_ids, c.text)
            except Exception:  # an optimisation: never fails the request that already answered
                logger.exception("token continuity: could not remember request %s", fmt.id)

        if choices:
            await self.offload.run(len(prepared.prompt_text), remember)


async def _collect(deltas: AsyncIterator[TextDelta], first: TextDelta, n: int) -> Outcome:
    """Fold the deltas in until all ``n`` choices finished."""
    outcome = Outcome()
    outcome.add(first)
    if not outcome.finished(n):
        async for delta in deltas:
            outcome.add(delta)
            if outcome.finished(n):
                break
    return outcome


async def _sse_events(
    deltas: AsyncGenerator[TextDelta, None], first: TextDelta, fmt: ResponseFormatter, prompt_tokens: int, n: int,
    include_usage: bool, continuous_usage: bool = False, on_finished: Callable[[Outcome], Awaitable[None]] | None = None,
) -> AsyncGenerator[str, None]:
    """SSE event strings for one streamed request of ``n`` choices; always ends with ``[DONE]``. ``on_finished``
    is awaited with the outcome once every choice finished and ``[DONE]`` was sent."""
    outcome = Outcome()
    finished = False
    try:
        for chunk in fmt.start_chunks():
            yield sse_event(chunk)
        delta: TextDelta | None = first
        while delta is not None:
            outcome.add(delta)
            for chunk in fmt.delta_chunks(delta, fmt.usage(outcome, prompt_tokens) if continuous_usage else None):
                yield sse_event(chunk)
            if outcome.finished(n):
                finished = True
                break
            delta = await anext(deltas, None)
        if include_usage:
            yield sse_event(fmt.usage_chunk(fmt.usage(outcome, prompt_tokens)))
    except Exception as e:
        yield sse_event(to_api_error(e, fmt.id).body())
    finally:
        await _aclose(deltas)
    yield DONE
    if finished and on_finished is not None:
        await on_finished(outcome)


async def _aclose(gen: Any) -> None:
    with anyio.CancelScope(shield=True):
        await gen.aclose()
