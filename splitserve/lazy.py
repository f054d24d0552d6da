"""Lazy package exports (PEP 562): a package's public names are imported on first use, not with the package.

The control plane (router, launcher, store master) imports ``splitserve.model`` and ``splitserve.transfer`` for
value types; their torch- and ucxx-backed names must not load until something uses them.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: dict[str, Any], exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose ``globals()`` is ``package``: ``exports`` maps a public name
    to the module that defines it; the first access imports that module and caches the name in the package.

    Raises (from ``__getattr__``):
        AttributeError: a name not in ``exports``.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*package, *exports])

    return getattr_, dir_
