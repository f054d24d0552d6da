"""The token continuity flags (:mod:`.token_continuity`) shared by the router, `splitserve colocated` and
`splitserve up`: ``--chat-token-continuity/--no-chat-token-continuity`` (``PD_CHAT_TOKEN_CONTINUITY``, default on)
and ``--chat-token-continuity-mb`` (``PD_CHAT_TOKEN_CONTINUITY_MB``, MiB of remembered texts and token ids)."""

from __future__ import annotations

import argparse
from typing import Any

from splitserve.env import env_bool, env_int
from splitserve.frontend.token_continuity import DEFAULT_MAX_MB, TokenContinuity


def add_continuity_args(ap: argparse.ArgumentParser) -> None:
    """Add the two flags (attributes ``chat_token_continuity``, ``chat_token_continuity_mb``)."""
    ap.add_argument("--chat-token-continuity", action=argparse.BooleanOptionalAction,
                    default=env_bool("PD_CHAT_TOKEN_CONTINUITY", True),
                    help="a chat or text prompt that continues an earlier request's prompt + completion reuses that "
                         "request's token ids (the model sees its own tokens, prefix caches hit); the same text may "
                         "tokenize differently than on a fresh server (PD_CHAT_TOKEN_CONTINUITY)")
    ap.add_argument("--chat-token-continuity-mb", type=int, default=env_int("PD_CHAT_TOKEN_CONTINUITY_MB", DEFAULT_MAX_MB),
                    help="memory for the remembered texts and token ids, MiB; least recently used go first "
                         "(PD_CHAT_TOKEN_CONTINUITY_MB)")


def check_continuity_mb(mb: int) -> None:
    """Raises ValueError unless ``mb`` >= 1."""
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ValueError(f"--chat-token-continuity-mb must be >= 1 (MiB), got {mb!r}")


def build_continuity(tokenizer: Any, enabled: bool, mb: int, metrics: bool = True) -> TokenContinuity | None:
    """A :class:`TokenContinuity` of ``mb`` MiB over ``tokenizer``, or None when not ``enabled``; with ``metrics``
    its counters are exposed on the process's /metrics as ``splitserve:chat_token_continuity_*`` (hits, misses,
    mismatches, stored, evictions; gauges entries, bytes)."""
    check_continuity_mb(mb)
    if not enabled:
        return None
    continuity = TokenContinuity(tokenizer, mb * 2**20)
    if metrics:
        from splitserve.telemetry.stats_collector import register_stats

        register_stats("chat_token_continuity", continuity.stats, {"entries", "bytes"}, doc="Token continuity")
    return continuity
