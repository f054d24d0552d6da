"""One ``--help`` look for every ``splitserve`` command: each flag with its description and its default.

Every command's parser comes from :func:`new_parser`. Its :class:`HelpFormatter` appends
``(default: VALUE)`` to a flag's help when the flag has a default worth showing (see :func:`shows_default`);
the value shown is the effective one, ``PD_*`` environment variables applied. A flag whose help already says
``(default: ...)`` (e.g. a secret such as ``--api-key``, whose value is never printed) is left as written.
Descriptions and epilogs keep their line breaks.
"""

from __future__ import annotations

import argparse
from typing import Any

SECRET_DEFAULT = "(default: $PD_API_KEY; its value is never shown)"


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` states ``action``'s default: not for positionals, ``--help``/``--version``, flags
    without a default (None, empty list) or an off switch (``store_true`` defaulting to False)."""
    if not action.option_strings or action.default in (None, argparse.SUPPRESS) or action.default == []:
        return False
    return not (action.nargs == 0 and action.default is False)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """:class:`argparse.RawDescriptionHelpFormatter` that states each flag's default (``(default: VALUE)``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default:" in text or not shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def new_parser(prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """An :class:`argparse.ArgumentParser` for ``splitserve <command>`` with :class:`HelpFormatter`."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)
