"""Chat prompts: render the model's chat template and encode it.

The template is rendered the way Hugging Face transformers does
(``apply_chat_template``): a jinja2 ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII text, and the globals ``raise_exception`` and
``strftime_now``; the variables are ``messages``, ``add_generation_prompt=True``,
``bos_token`` and ``eos_token``.

Fallback when the model has no chat template (e.g. TinyStories): each message becomes
``"{role}: {content}\\n"`` and the prompt ends with ``"assistant:"``, e.g.::

    system: Be brief.
    user: Tell me a story.
    assistant:

The space after ``{role}:`` is written only when the content starts with a letter or a digit (or is empty): the
model's answer to ``assistant:`` comes back with its own first character, a space (``" Once upon a time"``) or
punctuation (``': "What do you like?"'``), so the next turn's history renders ``assistant: Once upon a time`` (not
``assistant:  Once``) and ``assistant:: "What do you like?"``: exactly the prompt text + the completion text the
model saw and produced, which token continuity (:mod:`.token_continuity`) needs to reuse the answer's token ids.
A hand-written ``Hello!`` still renders as ``assistant: Hello!``.

With ``tools`` (chat ``tools``, passed to the template as transformers' ``apply_chat_template(tools=...)``
does), the fallback starts with a ``system:`` line listing them as JSON and the Hermes ``<tool_call>``
convention; an assistant message's ``tool_calls`` follow its content as ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>``, and a ``tool`` message becomes ``tool: <tool_response>...</tool_response>``.

The rendered text is encoded with the model's special tokens (BOS) unless it already
starts with ``bos_token``, so BOS is never added twice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.frontend.errors import APIError
from splitserve.frontend.prompt_limit import PromptLimit

FALLBACK_TEMPLATE = (
    # --- tools (splitserve.frontend.tools): the tool list, assistant tool calls, tool results ---
    "{% if tools %}system: You may call these tools: {{ tools | tojson }}\n"
    "To call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>.\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}tool: <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}{{ message['role'] }}:{{ ' ' if (message['content'] or 'a')[:1].isalnum() else '' }}{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Plain-text template used when the model has no ``chat_template``."""


class ChatTemplateError(Exception):
    """The model's chat template does not compile (a server configuration error, HTTP 500)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


def render_chat(
    messages: Sequence[dict[str, Any]],
    chat_template: str | None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Render ``messages`` (dicts with at least ``role`` and ``content``) to prompt text; ``tools`` (OpenAI
    tool dicts, or None) is the template's ``tools`` variable.

    Raises:
        APIError: 400 when the template rejects the conversation (``raise_exception``)
            or fails while rendering it.
        ChatTemplateError: when the template itself does not compile.
    """
    template = _compile(chat_template if chat_template else FALLBACK_TEMPLATE)
    try:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            tools=list(tools) if tools else None,
        )
    except jinja2.exceptions.TemplateError as e:
        raise APIError(f"Invalid conversation for this model's chat template: {e}", param="messages") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise APIError(f"Could not apply the chat template: {e}", param="messages") from None


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], limit: PromptLimit | None = None, *,
                add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Render with the tokenizer's template (or the fallback) and encode without a double BOS.

    CPU-heavy for long conversations: call it off the event loop. With ``limit``, a rendered prompt
    that cannot fit the context is refused before tokenizing (400 context_length_exceeded).
    ``add_special_tokens`` None: BOS is added unless the rendered text starts with it (what generation
    uses); True / False: as told (``/tokenize``).
    """
    text, add_special = chat_text(tokenizer, messages, limit, add_generation_prompt=add_generation_prompt,
                                  add_special_tokens=add_special_tokens, tools=tools)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def chat_text(tokenizer: Any, messages: Sequence[dict[str, Any]], limit: PromptLimit | None = None, *,
              add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
              tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, bool]:
    """What :func:`encode_chat` encodes: (the rendered text, whether to encode it with special tokens).
    Raises as :func:`encode_chat` does."""
    text = render_chat(messages, tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                       add_generation_prompt=add_generation_prompt, tools=tools)
    if limit is not None:
        limit.check(text, "messages")
    bos = tokenizer.bos_token
    return text, not (bos and text.startswith(bos)) if add_special_tokens is None else add_special_tokens
