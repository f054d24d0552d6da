"""Request preparation shared by every front door: prompt -> token ids, sampling -> :class:`SamplingParams`.

The HTTP app (OpenAI JSON) and the gRPC RouterService (``pd.v1.GenerateRequest``) each map their wire format to a
prompt and a :class:`SamplingRequest`, then call :meth:`RequestPreparer.prepare`. Every check of the prompt and of
the sampling parameters lives here, once:

* the prompt is not empty (a text prompt may be ``""`` when the tokenizer adds BOS: generation starts from BOS
  alone, as transformers, vLLM and llama.cpp do); a text prompt that cannot fit the context is refused before it is tokenized
  (:mod:`.prompt_limit`), then encoded with the model's special tokens (BOS); a chat conversation is rendered with
  the model's chat template (:mod:`.chat`); prompt token ids must lie in the vocabulary; with token continuity
  (:mod:`.token_continuity`) a text or chat prompt that continues an earlier prompt + completion reuses its ids;
* stop token ids, ``logit_bias`` keys and ``allowed_token_ids`` lie in the vocabulary; ``bad_words`` are
  tokenized the way vLLM does (:class:`.sampling_map.BadWords`); at most :data:`MAX_STOP_STRINGS`
  non-empty stop strings;
* prompt + ``max_tokens`` fits ``max_model_len`` (``max_tokens`` unset: all the room the prompt leaves);
* the values :class:`SamplingParams` accepts (temperature, top_p, top_k, seed, penalties, min_p, min_tokens,
  logprobs, n ...; the error names the field).

Tokenizing and rendering are CPU-heavy: call :meth:`RequestPreparer.prepare` off the event loop
(:class:`.offload.Offload`). Errors are :class:`.errors.APIError` 400s naming the ``param`` (``code`` is
``context_length_exceeded`` when the request cannot fit); the gRPC front door answers them with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.chat import chat_text
from splitserve.frontend.errors import APIError
from splitserve.frontend.prompt_limit import PromptLimit
from splitserve.frontend.sampling_map import BadWords, build_params

MAX_STOP_STRINGS = 4
"""Most stop strings one request may carry."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to render with the model's chat template: dicts with at least ``role`` and ``content``."""

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None = None  # chat ``tools``, the template's ``tools`` variable


SAMPLING_OPTIONS = frozenset(f.name for f in fields(SamplingParams)) - {"max_tokens", "bad_words_token_ids"}
"""The :class:`SamplingParams` fields a :class:`SamplingRequest` carries as they are (the rest need the prompt
length or the tokenizer)."""


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """Sampling as the client asked for it, each front door's defaults applied, before tokenization: the
    :class:`SamplingParams` fields that need no tokenizer as they are, and the few that do in request form.

    Attributes:
        options: :class:`SamplingParams` keyword arguments, any of :data:`SAMPLING_OPTIONS` (one left out keeps
            SamplingParams' default); their values are checked when the params are built.
        max_tokens: most tokens to generate; None: all the room the prompt leaves in the context.
        max_tokens_param: the request field ``max_tokens`` came from (named when it does not fit the context).
        stop: stop strings (the matched string is not returned).
        bad_words: words that must not be generated (tokenized here, vLLM's way).

    Raises:
        TypeError: an option that is not one of :data:`SAMPLING_OPTIONS` (a front door's bug).
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    stop: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.options) - SAMPLING_OPTIONS
        if unknown:
            raise TypeError(f"not SamplingRequest options: {sorted(unknown)} (see SAMPLING_OPTIONS)")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request ready for :func:`.pipeline.generate_text`: the prompt's token ids, the sampling parameters and the
    stop strings; for a text or chat prompt also the text that was encoded (and whether with special tokens), which
    token continuity remembers once the request finished."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    prompt_text: str | None = None  # None: the client sent token ids
    add_special_tokens: bool = True


def check_stop_strings(stop: Sequence[str]) -> None:
    """Raise ValueError unless ``stop`` holds at most :data:`MAX_STOP_STRINGS` strings, none of them empty."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stop)}")
    if any(s == "" for s in stop):
        raise ValueError("stop sequences must not be empty strings")


class RequestPreparer:
    """Prepares the requests of one model (see the module docstring).

    Args:
        tokenizer: a :class:`.backend.TokenizerLike`.
        max_model_len: the context limit in tokens (prompt + completion).
        continuity: a :class:`.token_continuity.TokenContinuity` that encodes text and chat prompts, or None
            (every prompt is encoded fresh).
    """

    def __init__(self, tokenizer: Any, max_model_len: int, continuity: Any = None) -> None:
        self.tokenizer = tokenizer
        self.continuity = continuity
        self.max_model_len = max_model_len
        self.limit = PromptLimit(tokenizer, max_model_len)
        self.vocab_size: int = tokenizer.hf.get_vocab_size(with_added_tokens=True)
        self.bad_words = BadWords(tokenizer)

    def prepare(self, prompt: str | Sequence[int] | ChatPrompt, sampling: SamplingRequest,
                param: str = "prompt") -> PreparedRequest:
        """Validate and tokenize one request; ``param`` names the prompt's field in error messages.

        Raises:
            APIError: 400 for any of the checks in the module docstring.
            ChatTemplateError: the model's chat template does not compile (a server error).
        """
        text, add_special = self._prompt_text(prompt, param)
        if text is None:
            self.check_token_ids(prompt, param)
            prompt_ids = list(prompt)
        elif self.continuity is not None:
            prompt_ids = self.continuity.encode(text, add_special)
        else:
            prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
        if not prompt_ids:  # "" on a tokenizer without BOS, or no token ids
            raise APIError("The prompt must not be empty.", param=param)
        return PreparedRequest(prompt_ids, self.sampling_params(len(prompt_ids), sampling, param), list(sampling.stop),
                               text, add_special)

    def _prompt_text(self, prompt: str | Sequence[int] | ChatPrompt, param: str) -> tuple[str | None, bool]:
        """(text to encode, with special tokens?) of a text or chat prompt, checked against the context limit;
        (None, False) for token ids. Raises APIError (400)."""
        if isinstance(prompt, ChatPrompt):
            return chat_text(self.tokenizer, prompt.messages, self.limit, tools=prompt.tools)
        if isinstance(prompt, str):
            self.limit.check(prompt, param)
            return prompt, True
        return None, False

    def sampling_params(self, prompt_len: int, sampling: SamplingRequest, param: str = "prompt") -> SamplingParams:
        """:class:`SamplingParams` for a prompt of ``prompt_len`` tokens (and a check of the stop strings).
        Raises APIError (400)."""
        try:
            check_stop_strings(sampling.stop)
        except ValueError as e:
            raise APIError(f"Invalid value for 'stop': {e}", param="stop") from None
        options = sampling.options
        self.check_token_ids(options.get("stop_token_ids") or (), "stop_token_ids")
        self.check_token_ids([t for t, _ in options.get("logit_bias") or ()], "logit_bias")
        self.check_token_ids(options.get("allowed_token_ids") or (), "allowed_token_ids")
        max_tokens = self.completion_budget(prompt_len, sampling.max_tokens, param, sampling.max_tokens_param)
        return build_params(sampling, max_tokens, self.bad_words(sampling.bad_words))

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Raise a 400 when an id is outside the tokenizer's vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"Token id {bad[0]} in '{param}' is out of range [0, {self.vocab_size}).", param=param)

    def completion_budget(self, prompt_len: int, requested: int | None, param: str,
                          budget_param: str = "max_tokens") -> int:
        """The max_tokens to use: ``requested``, or all the room left when None.

        Raises:
            APIError: 400 for ``requested`` below 1, and ``context_length_exceeded`` when prompt + completion
                does not fit, naming ``param`` (the prompt) when the prompt leaves no room for a token, else
                ``budget_param`` (the field that asked for ``requested``).
        """
        if requested is not None and requested < 1:
            raise APIError(f"{budget_param} must be at least 1, got {requested}.", param=budget_param)
        max_model_len = self.max_model_len
        max_tokens = requested if requested is not None else max_model_len - prompt_len
        if max_tokens < 1 or prompt_len + max_tokens > max_model_len:
            shown = requested if requested is not None else 1
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + shown} tokens ({prompt_len} in the prompt, {shown} in the completion). "
                "Please reduce the length of the prompt or completion.",
                param=param if prompt_len >= max_model_len else budget_param,
                code="context_length_exceeded",
            )
        return max_tokens
