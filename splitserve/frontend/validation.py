"""Turning a raw HTTP request body into a validated OpenAI request, or an :class:`APIError` (400/404/413).

Covers: the body size, malformed JSON, pydantic errors (reported as 400 with a readable message and
``param``, not FastAPI's 422), fields this server does not support, the model name, and mapping the
request to the inputs of :class:`.prepare.RequestPreparer` (which checks the prompt, the context-length
budget and the sampling parameters for every front door).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from splitserve.frontend.errors import APIError, model_not_found
from splitserve.frontend.json_body import parse_json_object
from splitserve.frontend.prepare import SamplingRequest
from splitserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, FieldError, GenerationRequest

M = TypeVar("M", bound=BaseModel)

_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


def _falsy(v: Any) -> bool:
    return not v


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is a or (type(v) is type(a) and v == a) for a in allowed)


# field -> predicate telling whether the given value is one we can honour (i.e. a default)
UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "suffix": _falsy,
}
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": _falsy,
    "function_call": _is(None, "none", "auto"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is(None),
    "prediction": _is(None),
    "reasoning_effort": _is(None),
    "web_search_options": _is(None),
}

_REASONS = {"suffix": "the served model has no fill-in-the-middle (FIM) support"}

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}

# readable messages for fields that accept several types (pydantic reports each union member)
_UNION_HINTS = {
    "prompt": "must be a string or a list of token ids (integers)",
    "content": "must be a string or a list of text content parts ({'type': 'text', 'text': ...})",
    "stop": "must be a string or a list of strings",
}


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The request body, refusing more than ``max_bytes`` (by Content-Length, or while reading).

    Raises:
        APIError: 413 when the body is too large; 400 for a malformed Content-Length.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError("Malformed Content-Length header.") from None
        if size > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"The request body is larger than {max_bytes} bytes.", status=413, code="request_too_large")


def parse_request(body: bytes, cls: type[M], unsupported: dict[str, Callable[[Any], bool]]) -> M:
    """Parse and validate a JSON request body into ``cls``.

    Raises:
        APIError: 400 for a body :func:`.json_body.parse_json_object` refuses (not UTF-8, malformed,
            NaN, duplicate keys, too deep, unpaired surrogates, not an object), an unsupported or
            unknown field, a value of the wrong JSON type, or any other validation error.
    """
    data = parse_json_object(body)
    for name, acceptable in unsupported.items():
        if name in data:
            if not acceptable(data[name]):
                reason = f": {_REASONS[name]}" if name in _REASONS else ""
                raise APIError(f"'{name}' is not supported by this server{reason}.", param=name)
            del data[name]
    for name in _IGNORED:
        data.pop(name, None)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _readable(e) from None


def _readable(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        if cause.missing:
            return APIError(f"Missing required parameter: '{cause.param}'.", param=cause.param)
        return APIError(f"Invalid value for '{cause.param}': {cause}", param=cause.param)
    parts = [
        str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or "-" in p))
    ]
    param = ".".join(parts) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param)
    if param is None:
        return APIError(f"Invalid request: {msg}")
    is_union = len(parts) < len(err["loc"])
    hint = _UNION_HINTS.get(parts[-1]) if is_union else None
    if hint is not None and not err["type"].startswith("value_error"):
        return APIError(f"'{param}' {hint}.", param=param)
    expected = _EXPECTED.get(err["type"])
    if expected is not None:
        return APIError(
            f"Invalid type for '{param}': expected {expected}, but got {_json_type(err['input'])} instead.", param=param
        )
    return APIError(f"Invalid value for '{param}': {msg}", param=param)


# pydantic type-error kinds -> the JSON type the field wants (OpenAI's "Invalid type for ..." message)
_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def check_model(requested: str | None, served: str) -> None:
    """Raise a 404 ``model_not_found`` unless the request names the served model (or none)."""
    if requested is not None and requested != served:
        raise model_not_found(requested)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request (text or token ids), for :class:`.prepare.RequestPreparer`.

    Raises:
        APIError: 400 for batched prompts (several prompts in one request).
    """
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(
                f"Batched prompts are not supported: 'prompt' holds {len(prompt)} prompts; "
                "send one prompt per request.",
                param="prompt",
            )
        prompt = prompt[0]
    return prompt


def sampling_request(req: GenerationRequest, max_tokens: int | None, *, n: int | None = None,
                     logprobs: int | None = None, prompt_logprobs: int | None = None,
                     max_tokens_param: str = "max_tokens") -> SamplingRequest:
    """The request's sampling fields with OpenAI's defaults (temperature 1, top_p 1; top_k, penalties and
    min_p off); ``max_tokens`` None: all the room the prompt leaves. ``n``, ``logprobs`` and ``prompt_logprobs``
    override what the request says (best_of and echo ask the backend for more than the client sees)."""
    options = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens,
        logit_bias=req.logit_bias_pairs(),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        logprobs=req.num_logprobs if logprobs is None else logprobs,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        n=req.n if n is None else n,
    )
    return SamplingRequest(options, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
                           stop=tuple(req.stop_list()), bad_words=tuple(req.bad_words or ()))


def completion_sampling(req: CompletionRequest, default_max_tokens: int) -> SamplingRequest:
    """Sampling of a completions request, with what the backend must produce for ``echo`` and ``best_of``:

    * ``echo`` with ``logprobs``: prompt logprobs (at least ``logprobs`` alternatives);
    * ``max_tokens: 0`` (echo only): one token is generated and dropped from the response;
    * ``best_of`` > ``n``: ``best_of`` choices, each with logprobs (their sum ranks them).
    """
    requested = default_max_tokens if req.max_tokens is None else max(req.max_tokens, 1)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    n, logprobs = req.n, req.logprobs
    if req.best_of is not None and req.best_of > req.n:
        n, logprobs = req.best_of, logprobs or 0
    return sampling_request(req, requested, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def chat_sampling(req: ChatCompletionRequest) -> SamplingRequest:
    """Sampling of a chat request (``max_completion_tokens`` wins over ``max_tokens``)."""
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return sampling_request(req, req.requested_max_tokens, max_tokens_param=param)
