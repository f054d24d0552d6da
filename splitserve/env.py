"""The one parser for ``PD_*`` environment variables.

Every setting read from the environment goes through these functions, so a bad value is never ignored and
never a traceback: it raises :class:`EnvError` (a ``ValueError``) whose message names the variable, the value
and what is accepted, and the CLI prints it as one usage line (``splitserve <cmd>: error: ...``, exit 2).

An unset variable, or one set to the empty string (or only spaces), gives the default. Values are stripped.
Booleans accept ``1/0``, ``true/false``, ``yes/no`` and ``on/off`` in any case.

Each function takes ``environ`` (default ``os.environ``) so that callers can read a merged mapping, e.g. the
environment a child process will be given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import TypeVar

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BOOL_SPELLINGS = "1/0, true/false, yes/no, on/off (any case)"

_D = TypeVar("_D")


class EnvError(ValueError):
    """An environment variable holds a value its parser refuses. ``name`` is the variable, ``value`` its text."""

    def __init__(self, name: str, value: str, expected: str) -> None:
        super().__init__(f"{name}={value!r}: expected {expected}")
        self.name = name
        self.value = value


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The stripped value of ``name``, or None when it is unset or empty."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def env_str(name: str, default: _D = None, environ: Mapping[str, str] | None = None) -> str | _D:
    """The text of ``name``; ``default`` when unset or empty."""
    value = _raw(name, environ)
    return default if value is None else value


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """``name`` as a boolean (:data:`TRUE_WORDS` / :data:`FALSE_WORDS`, any case).

    Raises:
        EnvError: any other spelling, e.g. ``maybe``.
    """
    value = _raw(name, environ)
    if value is None:
        return default
    if value.lower() in TRUE_WORDS:
        return True
    if value.lower() in FALSE_WORDS:
        return False
    raise EnvError(name, value, f"a boolean: {BOOL_SPELLINGS}")


def env_int(name: str, default: _D, environ: Mapping[str, str] | None = None) -> int | _D:
    """``name`` as a decimal integer (``_`` separators allowed, as Python's ``int``).

    Raises:
        EnvError: not an integer (``12.5``, ``ten``).
    """
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvError(name, value, "an integer") from None


def env_float(name: str, default: _D, environ: Mapping[str, str] | None = None) -> float | _D:
    """``name`` as a number (``inf`` allowed, ``nan`` refused).

    Raises:
        EnvError: not a number.
    """
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if math.isnan(number):
        raise EnvError(name, value, "a number")
    return number


def env_choice(name: str, choices: Iterable[str], default: _D, environ: Mapping[str, str] | None = None) -> str | _D:
    """``name`` as one of ``choices`` (exact spelling).

    Raises:
        EnvError: any other value; the message lists the choices.
    """
    choices = tuple(choices)
    value = _raw(name, environ)
    if value is None:
        return default
    if value not in choices:
        raise EnvError(name, value, "one of " + ", ".join(choices))
    return value
