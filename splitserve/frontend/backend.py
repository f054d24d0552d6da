"""The interface between the OpenAI front end and whatever produces tokens.

The front end (HTTP app, router gRPC API) only talks to a :class:`GenerationBackend`;
the colocated engine and the prefill/decode router both implement it. A model is
described to the front end by a :class:`ModelInfo` whose ``tokenizer`` follows
:class:`TokenizerLike`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from splitserve.engine.logprobs import PromptLogprobs, TokenLogprob
from splitserve.engine.sampling import SamplingParams


@dataclass(slots=True)
class TokenEvent:
    """Tokens produced by one backend step.

    Attributes:
        token_ids: newly generated token ids (usually one).
        finish_reason: set on the last event only: "stop" (EOS or a stop token id; the
            token is included in ``token_ids``), "length" (max_tokens reached) or "abort".
        cached_tokens: prompt tokens served from a prefix cache (reported as
            ``usage.prompt_tokens_details.cached_tokens``); may be set on any event.
        index: the choice these tokens belong to (0..n-1; ``params.n`` > 1 interleaves the choices'
            events, each choice ends with its own ``finish_reason``; the stream ends when all have).
        logprobs: when ``params.logprobs`` is set, one :class:`TokenLogprob` per token of ``token_ids``.
        prompt_logprobs: when ``params.prompt_logprobs`` is set, the prompt's logprobs (first entry None),
            on the first event of the stream only.
    """

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """Something that turns prompt token ids into a stream of :class:`TokenEvent`."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Start generating; returns an async generator of events.

        Closing the generator early (``aclose()``: stop string, client disconnect,
        deadline) aborts the request and frees its KV blocks. ``deadline`` is an absolute
        ``time.monotonic()`` time, passed only when the request has one; a backend that calls
        other services gives each call the time left (the caller enforces it as well).

        Raises:
            splitserve.errors.PdError subclasses (InvalidRequest, CapacityExhausted,
            WorkerUnavailable, KVTransferError, KVLayoutMismatch, DeadlineExceeded, ...), either when the
            first event is requested or later.
        """
        ...

    async def ready(self) -> bool:
        """True when the backend can accept requests (drives ``GET /health``)."""
        ...


class TokenizerLike(Protocol):
    """What the front end needs from a tokenizer wrapper.

    Attributes:
        hf: the underlying ``tokenizers.Tokenizer`` (used for incremental decoding).
        bos_token / eos_token: special token strings or None (chat templates).
        chat_template: jinja2 chat template or None.
        eos_token_ids: ids that end generation; their text is never emitted.
    """

    hf: Any
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to ids; with add_special_tokens the model's BOS (if any) is prepended."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids to text."""
        ...


class ModelInfo(Protocol):
    """The served model as the front end sees it.

    Attributes:
        name: served model name (``model`` field of requests and responses).
        tokenizer: a :class:`TokenizerLike`.
        max_model_len: context limit in tokens (prompt + completion).
    """

    name: str
    tokenizer: TokenizerLike
    max_model_len: int
