"""Request bodies to JSON objects, strictly: anything odd is a 400 :class:`APIError`, never a 500.

Rules (RFC 8259 and what every field of the OpenAI API can carry):

* The body is UTF-8 (an initial BOM is ignored). A ``charset`` parameter of the Content-Type is
  ignored, as RFC 8259 says for ``application/json``: a body in another encoding is a 400 naming
  the first bad byte.
* ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON: 400. Numbers too large for a double
  (``1e400``) are a 400, not infinity. Integers longer than Python's conversion limit are a 400.
* A key repeated in one object is a 400: which value wins differs between parsers, so a proxy
  and this server could read different requests.
* Nesting deeper than :data:`MAX_DEPTH` is a 400 (no request field nests deeper than 4 levels).
* A string (key or value) holding an unpaired UTF-16 surrogate (``"\\ud800"``; a valid escaped pair
  such as ``"\\ud83d\\ude00"`` is fine) is a 400 naming the field: such text is not Unicode and
  cannot be tokenized, rendered or echoed.

The checks that need a walk over the parsed body run only when the raw text could need them (a
surrogate escape, or more brackets than :data:`MAX_DEPTH`), so a prompt of a million token ids
parses at ``json.loads`` speed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from splitserve.frontend.errors import APIError, utf8_safe

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted (the body object itself is depth 1)."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode ``body`` (UTF-8 JSON) into a dict following the rules above.

    Raises:
        APIError: 400 for every violation, with ``param`` set when one field is to blame.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = body[e.start : e.start + 1].hex()
        raise APIError(
            f"We could not parse the JSON body of your request: it is not valid UTF-8 (byte 0x{bad} at "
            f"position {e.start}). Send the body as UTF-8."
        ) from None
    text = text.removeprefix("\ufeff")
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _too_deep() from None
    except APIError:
        raise
    except ValueError as e:  # JSONDecodeError, and int() refusing a number with too many digits
        raise APIError(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if surrogates or text.count("[") + text.count("{") > MAX_DEPTH:
        _check_tree(data, surrogates)
    return data


def _reject_constant(name: str) -> float:
    raise APIError(f"We could not parse the JSON body of your request: {name} is not a valid JSON number.")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise APIError(f"We could not parse the JSON body of your request: the number {literal[:40]} is out of range.")
    return value


def _bounded_int(literal: str) -> int:
    """JSON integers longer than Python's int-from-string limit (4,300 digits) are out of range, said plainly."""
    if len(literal.lstrip("-")) > 4000:
        raise APIError(f"We could not parse the JSON body of your request: the integer {literal[:20]}... "
                       f"({len(literal)} digits) is out of range.")
    return int(literal)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise APIError(
            f"We could not parse the JSON body of your request: the key '{utf8_safe(dup)}' appears more than once "
            "in one object.",
            param=utf8_safe(dup),
        )
    return obj


def _too_deep() -> APIError:
    return APIError(f"The JSON body of your request is nested more than {MAX_DEPTH} levels deep.")


def _check_tree(data: dict[str, Any], surrogates: bool) -> None:
    """Depth limit and (when ``surrogates``) lone surrogates in every key and string, without recursion."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for key, value in node.items():
                child = f"{path}.{key}" if path else key
                if surrogates and _LONE_SURROGATE.search(key):
                    raise _surrogate(path or None, key)
                if isinstance(value, (dict, list)):
                    stack.append((value, child, depth + 1))
                elif surrogates and isinstance(value, str) and _LONE_SURROGATE.search(value):
                    raise _surrogate(child, value)
        else:
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    stack.append((value, f"{path}.{i}", depth + 1))
                elif surrogates and isinstance(value, str) and _LONE_SURROGATE.search(value):
                    raise _surrogate(f"{path}.{i}", value)


def _surrogate(param: str | None, text: str) -> APIError:
    found = _LONE_SURROGATE.search(text)
    code = f"\\u{ord(found.group()):04x}" if found else "a surrogate"
    where = f"'{utf8_safe(param)}'" if param else "a key of the request body"
    return APIError(
        f"Invalid value for {where}: the text contains an unpaired UTF-16 surrogate ({code}), which is not valid "
        "Unicode. Escape characters outside the Basic Multilingual Plane as surrogate pairs, or send them as UTF-8.",
        param=utf8_safe(param) if param else None,
    )
