"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

* ``/tokenize``: ``{model?, prompt, add_special_tokens=true, return_token_strs=false}`` or
  ``{model?, messages, add_generation_prompt=true, add_special_tokens?, return_token_strs=false}`` ->
  ``{count, max_model_len, tokens, token_strs}``. A conversation is rendered with the model's chat template
  and, unless ``add_special_tokens`` says otherwise, encoded exactly as a chat request would be (BOS unless
  the template wrote it), so ``count`` is what ``usage.prompt_tokens`` will say. ``token_strs`` (the
  vocabulary's strings of the tokens, special tokens as declared: ``"<|start_story|>"``) only with
  ``return_token_strs``, else null.
* ``/detokenize``: ``{model?, tokens}`` -> ``{prompt}`` (special tokens kept, so BOS round-trips).
* ``/version``: ``{"version": splitserve.__version__}``.

Bodies are read and checked as the completion routes' are (:mod:`.validation`: 400 naming the field,
404 for another model's name, 413 above the body limit); tokenizing runs off the event loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import splitserve
from splitserve.frontend import validation as v
from splitserve.frontend.chat import encode_chat
from splitserve.frontend.errors import error_response
from splitserve.frontend.json_body import parse_json_object
from splitserve.frontend.offload import Offload
from splitserve.frontend.prepare import RequestPreparer
from splitserve.frontend.protocol import ChatMessage

_STRICT = ConfigDict(extra="forbid", strict=True)


class TokenizeCompletionRequest(BaseModel):
    """``/tokenize`` of a text prompt."""

    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``/tokenize`` of a conversation."""

    model_config = _STRICT
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_messages(self) -> TokenizeChatRequest:
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")  # the rules of a chat request
        return self


class DetokenizeRequest(BaseModel):
    """``/detokenize``."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeAPI:
    """The handlers, bound to one model.

    Args:
        model_info: the served :class:`.backend.ModelInfo`.
        preparer: the HTTP app's :class:`.prepare.RequestPreparer` (tokenizer, vocabulary checks).
        offload: the thread pools that tokenize.
        max_body_bytes: larger bodies get 413.
    """

    def __init__(self, model_info: Any, preparer: RequestPreparer, offload: Offload, max_body_bytes: int) -> None:
        self.info = model_info
        self.preparer = preparer
        self.tokenizer = model_info.tokenizer
        self.offload = offload
        self.max_body_bytes = max_body_bytes
        # id -> content of the tokenizer file's added tokens: tokenizers' id_to_token gives an added token declared
        # "normalized" in its normalized form (SentencePiece's "▁" prefixed: "▁<|start_story|>")
        self._added = {i: t.content for i, t in self.tokenizer.hf.get_added_tokens_decoder().items()}

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``."""
        return await self._run(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``."""
        return await self._run(request, self._detokenize)

    async def version(self, request: Request) -> Response:
        """``GET /version``."""
        return JSONResponse({"version": splitserve.__version__})

    async def _run(self, request: Request, fn: Any) -> Response:
        try:
            body = await v.read_body(request, self.max_body_bytes)
            return JSONResponse(await self.offload.run(len(body), fn, body))
        except Exception as e:
            return error_response(e)

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        is_chat = "messages" in parse_json_object(body)
        req: Any = v.parse_request(body, TokenizeChatRequest if is_chat else TokenizeCompletionRequest, {})
        v.check_model(req.model, self.info.name)
        if is_chat:
            ids = encode_chat(self.tokenizer, [m.template_dict() for m in req.messages],
                              add_generation_prompt=req.add_generation_prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = [self._token_str(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids, "token_strs": strs}

    def _token_str(self, token_id: int) -> str:
        """The token's string: an added (special) token's content as the tokenizer file declares it, else the
        vocabulary's piece (``"▁time"``)."""
        added = self._added.get(token_id)
        return added if added is not None else self.tokenizer.hf.id_to_token(token_id)

    def _detokenize(self, body: bytes) -> dict[str, Any]:
        req = v.parse_request(body, DetokenizeRequest, {})
        v.check_model(req.model, self.info.name)
        self.preparer.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
