"""Chat ``tools`` + ``tool_choice``: the constraint to generate under, and the model's text -> OpenAI ``tool_calls``.

Modes (``tool_choice``; default ``"auto"`` with tools, ``"none"`` without):

- ``"none"``: plain text; the tools are still shown to the chat template (as vLLM does).
- ``"auto"``: unconstrained; the output is parsed for Hermes/Qwen-style blocks
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (text outside the blocks is the content).
- ``"required"`` / ``{"type": "function", "function": {"name": N}}``: the output is grammar-constrained to
  ``{"name": N, "arguments": <N's parameters schema>}`` (``required`` with several tools: an ``anyOf`` of
  them), so even a small model returns arguments that validate; the message has ``content: null``.

A tool call in a response: ``{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` a JSON string; ``finish_reason`` becomes ``"tool_calls"`` when the model finished (EOS or
stop) with at least one call. Streamed, calls arrive as OpenAI's ``delta.tool_calls`` entries with ``index``:
the first carries id, type and name (``arguments: ""``), later ones argument text (see :class:`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.engine.guided_spec import GuidedSpec
from splitserve.frontend.errors import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}, "additionalProperties": False}  # no parameters: arguments are {}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    """An OpenAI-style tool call id, ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` ask for.

    Attributes:
        tools: the validated tools (OpenAI shape), passed to the chat template as ``tools``.
        mode: "none", "auto", "required" or "named".
        name: the forced function's name in "named" mode, else None.
    """

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None

    @property
    def constrained(self) -> bool:
        """True when the output is grammar-constrained to a tool call ("required" / "named")."""
        return self.mode in ("required", "named")

    def guided(self) -> GuidedSpec | None:
        """The JSON-schema constraint for "required" / "named", else None."""
        if not self.constrained:
            return None
        funcs = [t["function"] for t in self.tools if self.mode == "required" or t["function"]["name"] == self.name]
        options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters", _EMPTY_PARAMS)},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return GuidedSpec("json_schema", json.dumps(schema, ensure_ascii=False))

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished, non-streamed message."""
        if self.constrained:
            call = _parse_constrained(text)
            if call is None:  # cut short (length, stop string): no valid call to report
                return text, [], finish_reason
            calls = [_tool_call(*call)]
            return None, calls, _finish(finish_reason, calls)
        if self.mode == "none":
            return text, [], finish_reason
        content, calls = parse_hermes(text)
        return content, calls, _finish(finish_reason, calls)

    def stream(self) -> ToolStream:
        """A :class:`ToolStream` for one streamed choice."""
        return ToolStream(self)


def _finish(finish_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def plan_tools(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """Validate ``tools`` and ``tool_choice`` (raw JSON values; None when absent); None when there are no tools.

    Raises:
        APIError: 400 naming the offending field (``tools[1].function.name``, ``tool_choice`` ...).
    """
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise APIError("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError("'tools' must be an array of {\"type\": \"function\", \"function\": {...}} objects.", param="tools")
    checked = [_check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise APIError(f"Duplicate function name in 'tools': {dup!r}.", param="tools")
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolPlan(checked, tool_choice or "auto")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                       param="tool_choice")
    if name not in names:
        raise APIError(f"'tool_choice' names function {name!r}, which is not in 'tools'.", param="tool_choice.function.name")
    return ToolPlan(checked, "named", name)


def _check_tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(f"'{param}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.", param=param)
    fn = tool["function"]
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise APIError(f"Unrecognized argument in '{param}.function': {extra[0]}", param=f"{param}.function.{extra[0]}")
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise APIError(f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-'.", param=f"{param}.function.name")
    if "description" in fn and not isinstance(fn["description"], str):
        raise APIError(f"'{param}.function.description' must be a string.", param=f"{param}.function.description")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise APIError(f"'{param}.function.parameters' must be a JSON Schema object.", param=f"{param}.function.parameters")
    return {"type": "function", "function": dict(fn)}


def _parse_constrained(text: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a ``{"name": ..., "arguments": ...}`` output, or None if incomplete."""
    m = _PREFIX.match(text)
    if m is None:
        return None
    try:
        args, end = json.JSONDecoder().raw_decode(text, m.end())
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict) or text[end:].strip() != "}":
        return None
    return name, text[m.end():end]


def _hermes_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and tool calls of a Hermes/Qwen-style output; a block that does not parse stays in the content.

    An unclosed last block (the model ended right after the JSON) counts when its JSON parses.
    """
    calls, content, pos = [], [], 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start)
        stop = len(text) if end < 0 else end + len(TOOL_CALL_CLOSE)
        call = _hermes_call(text[start + len(TOOL_CALL_OPEN): end if end >= 0 else len(text)])
        content.append(text[pos:start] if call is not None else text[pos:stop])
        if call is not None:
            calls.append(_tool_call(*call))
        pos = stop
    content.append(text[pos:])
    joined = "".join(content)
    if calls:
        joined = joined.strip()
    return (joined or None) if calls else joined, calls


class ToolStream:
    """Turns one choice's streamed text into chat deltas: ``{"content": ...}`` and ``{"tool_calls": [...]}``.

    ``feed(text)`` returns the deltas ready now; ``finish(finish_reason)`` the rest and the finish_reason to
    send. Constrained mode streams the arguments as they are generated (holding back the last character,
    which may be the wrapper's closing brace); auto mode sends text as content until ``<tool_call>`` and
    each call whole once its block closes (a partial ``<tool_call>`` tag is held back).
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.sent = 0  # constrained: argument characters sent; auto: buffer characters consumed
        self.calls = 0
        self.args_at: int | None = None  # constrained: where the arguments start in buf

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        if self.plan.mode == "none":
            out, self.buf = ([{"content": self.buf}] if self.buf else []), ""
            return out
        return self._constrained(final=False) if self.plan.constrained else self._auto(final=False)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        if self.plan.mode == "none":
            return self.feed(""), finish_reason
        out = self._constrained(final=True) if self.plan.constrained else self._auto(final=True)
        return out, ("tool_calls" if self.calls and finish_reason == "stop" else finish_reason)

    def _constrained(self, final: bool) -> list[dict[str, Any]]:
        out = []
        if self.args_at is None:
            m = _PREFIX.match(self.buf)
            if final and m is None:  # cut short before the call started: the text is all there is
                out, self.buf = ([{"content": self.buf}] if self.buf else []), ""
                return out
            if m is None or m.end() == len(self.buf) and not final:
                return []  # the name may still be growing until the arguments start
            self.args_at, self.calls = m.end(), 1
            call = _tool_call(json.loads(f'"{m.group(1)}"'), "", index=0)
            out.append({"tool_calls": [call]})
        args = self.buf[self.args_at:].rstrip()
        if final:
            parsed = _parse_constrained(self.buf)
            args = parsed[1] if parsed is not None else args
        else:
            args = args[:-1]
        if len(args) > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": args[self.sent:]}}]})
            self.sent = len(args)
        return out

    def _auto(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            rest = self.buf[self.sent:]
            start = rest.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag(rest)
                if len(rest) - keep:
                    out.append({"content": rest[: len(rest) - keep]})
                self.sent += len(rest) - keep
                return out
            if start:
                out.append({"content": rest[:start]})
            end = rest.find(TOOL_CALL_CLOSE, start)
            if end < 0 and not final:
                self.sent += start
                return out
            body_end = end if end >= 0 else len(rest)
            stop = body_end + len(TOOL_CALL_CLOSE) if end >= 0 else len(rest)
            call = _hermes_call(rest[start + len(TOOL_CALL_OPEN): body_end])
            if call is None:
                out.append({"content": rest[start:stop]})
            else:
                out.append({"tool_calls": [_tool_call(*call, index=self.calls)]})
                self.calls += 1
            self.sent += stop


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (what vLLM does): an assistant's ``tool_calls[*].function.arguments``
    JSON string becomes an object, so templates can ``tojson`` it or iterate over it."""
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            msg = {**msg, "tool_calls": [_args_as_object(c) for c in calls]}
        out.append(msg)
    return out


def _args_as_object(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
