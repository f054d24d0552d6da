"""Pydantic models of the OpenAI ``/v1/completions`` and ``/v1/chat/completions`` wire format.

Requests accept the OpenAI fields (``n``, ``logprobs``, ``echo``, ``best_of``, penalties, ``logit_bias`` ...)
plus vLLM's extensions (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``bad_words``, ``allowed_token_ids``, ``prompt_logprobs``). Fields this server cannot honour
(``suffix``, ``tools`` ...) are rejected by :mod:`.validation` with a 400 naming the field; any other unknown
field is rejected as OpenAI does ("Unrecognized request argument supplied"). Responses and stream chunks have
OpenAI's shape; the logprob objects are in :mod:`.logprob_format`, vLLM's ``prompt_logprobs`` appears only
when asked for.

Requests are validated strictly for types, as OpenAI does: a string is never coerced to a number
or a boolean (``"max_tokens": "8"`` is a 400), a boolean is not an integer, an integer field takes
a JSON number only when it is integral (``8`` or ``8.0``, not ``8.5``), and a number field takes
integers too (JSON has one number type: ``"temperature": 1`` is fine).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator, model_serializer, model_validator,
)

from splitserve.engine.sampling import MAX_LOGPROBS, MAX_N, seed_from_signed
from splitserve.frontend.logprob_format import ChatLogprobs, CompletionLogprobs, PromptLogprobsJson
from splitserve.frontend.prepare import check_stop_strings
from splitserve.frontend.sampling_map import MAX_TEMPERATURE

def _integral_float_to_int(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An integer field of a strict request model: also takes an integral JSON number such as ``8.0``."""

_STRICT = ConfigDict(extra="forbid", strict=True)


class FieldError(ValueError):
    """A cross-field check failed; :mod:`.validation` reports it as a 400 naming ``param`` (``missing``: the
    parameter is required here and absent, OpenAI's "Missing required parameter")."""

    def __init__(self, param: str, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.missing = missing


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (OpenAI) and vLLM's ``continuous_usage_stats`` (usage on every chunk)."""

    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions (sampling, stop, streaming)."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: JsonInt | None = Field(default=None, ge=-1)
    seed: JsonInt | None = None  # any signed 64-bit integer (as OpenAI and vLLM); a negative one draws as seed mod 2**63
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: JsonInt = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: JsonInt = Field(default=0, ge=0)
    logit_bias: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = Field(default=None, min_length=1)
    prompt_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # --- structured outputs (validated by splitserve.frontend.structured, which names the field in a 400) ---
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([v] if isinstance(v, str) else (v or []))
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        """A signed 64-bit seed as the engine's (``seed_from_signed``; not Field(ge=..., lt=...): pydantic prints
        bounds that large as floats)."""
        return None if v is None else seed_from_signed(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdecimal():
                raise ValueError(f"keys must be token ids as strings of digits (e.g. \"50256\"), got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"the bias of token {key} must be a number, got {bias!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias!r}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        return self

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token_id, bias)`` pairs (keys already checked to be decimal ids)."""
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token when logprobs are asked for, else None."""
        return None

    def stop_list(self) -> list[str]:
        """Stop strings as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM ``continuous_usage_stats``)."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is one string or one list of token ids.

    ``max_tokens: 0`` is allowed with ``echo`` only (the prompt and its logprobs, nothing generated: how
    lm-evaluation-harness scores a text). ``best_of`` (non-streaming only) generates that many choices and
    returns the ``n`` with the highest cumulative logprob.
    """

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: JsonInt | None = Field(default=None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "0 is only allowed with echo (the prompt's logprobs, no completion)")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise FieldError("best_of", f"must be at least n ({self.n}), got {self.best_of}")
            if self.stream and self.best_of > self.n:
                raise FieldError("best_of", "cannot be used with stream (the best choices are known at the end)")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """``logprobs`` (the completions API's top alternatives per token)."""
        return self.logprobs


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part (the only kind supported)."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; extra keys (``name``, ``tool_call_id`` ...) are passed to the template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        """Content flattened to one string (text parts are concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def check(self, where: str) -> None:
        """OpenAI's per-role rules; ``where`` names the message (``messages[1]``) in the error.

        Raises:
            FieldError: no ``content`` (an assistant message may have ``tool_calls`` instead); a tool message
                without a string ``tool_call_id``; an assistant tool call whose ``function.arguments`` is not a
                JSON string.
        """
        extra = self.model_extra or {}
        calls = extra.get("tool_calls")
        if self.content is None and not (self.role == "assistant" and calls):
            raise FieldError(f"{where}.content", "missing", missing=True)
        if self.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            raise FieldError(f"{where}.tool_call_id", "a tool message needs the id of the tool call it answers",
                             missing="tool_call_id" not in extra or extra["tool_call_id"] is None)
        if self.role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise FieldError(f"{where}.tool_calls", "must be an array of tool calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if not isinstance(args, str):
                    raise FieldError(f"{where}.tool_calls[{j}].function.arguments", "must be a JSON string",
                                     missing=args is None)
                try:
                    json.loads(args)
                except json.JSONDecodeError as e:
                    raise FieldError(f"{where}.tool_calls[{j}].function.arguments", f"is not valid JSON ({e})") from None

    def template_dict(self) -> dict:
        """The message as chat templates expect it: ``{"role", "content", ...extras}``."""
        extras = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        return {**extras, "role": self.role, "content": self.text()}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # --- tools (validated by splitserve.frontend.tools.plan_tools, which names the field in a 400) ---
    tools: Any = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_messages(self) -> ChatCompletionRequest:
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")
        return self

    @model_validator(mode="after")
    def _check_chat_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "requires logprobs to be true")
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "is not available when stream is true (as vLLM)")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """``top_logprobs`` (0 when unset) when ``logprobs`` is true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for, or None (up to the context limit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """Usage with ``total_tokens`` filled in."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class _OmitsUnsetPromptLogprobs(BaseModel):
    """Drops vLLM's ``prompt_logprobs`` key unless it was asked for (OpenAI's shapes have no such key)."""

    @model_serializer(mode="wrap")
    def _omit_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_logprobs", 0) is None:
            del data["prompt_logprobs"]
        return data


class CompletionChoice(_OmitsUnsetPromptLogprobs):
    """A choice of a completion response or stream chunk (``prompt_logprobs``: vLLM's, when asked for)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsJson | None = None


class CompletionResponse(BaseModel):
    """A ``text_completion`` object: the full response, or one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a non-streamed chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    # tool calls (splitserve.frontend.tools), OpenAI's shape; the key is left out when there are none
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    """A choice of a ``chat.completion``."""

    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_OmitsUnsetPromptLogprobs):
    """A non-streamed ``chat.completion`` object (``prompt_logprobs``: vLLM's, top-level, when asked for)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsJson | None = None


class ChatChunkChoice(BaseModel):
    """A choice of a stream chunk; ``delta`` holds only the keys that are present."""

    index: int = 0
    delta: dict[str, Any]  # "role" / "content" strings, or "tool_calls" (splitserve.frontend.tools.ToolStream)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk`` object (one SSE event)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitserve"
    max_model_len: int | None = None
