"""Fault injection for tests of the KV transfer path. Off unless ``PD_KV_FAULTS`` is set; never set it in
production.

``PD_KV_FAULTS=corrupt``: the KV sender flips one byte of the first block of every transfer it serves,
*after* computing the transfer's checksum and before posting the data, and restores the byte once the
sends have completed. The receiver gets corrupted KV; with ``verify_checksum`` it detects it
(:class:`splitserve.errors.KVChecksumMismatch`), without it the corruption goes unnoticed.
"""

from __future__ import annotations

import logging

from splitserve.env import env_str

logger = logging.getLogger(__name__)

KNOWN = ("corrupt",)


def sender_fault_options(env: dict[str, str] | None = None) -> dict[str, bool]:
    """Keyword options for :func:`splitserve.transfer.create_sender` from ``PD_KV_FAULTS``.

    Raises:
        ValueError: an unknown fault name.
    """
    value = env_str("PD_KV_FAULTS", "", env)
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names - set(KNOWN)
    if unknown:
        raise ValueError(f"PD_KV_FAULTS: unknown fault(s) {sorted(unknown)}; known: {', '.join(KNOWN)}")
    if names:
        logger.warning("KV transfer fault injection is ON: %s (tests only)", ",".join(sorted(names)))
    return {"corrupt_sends": True} if "corrupt" in names else {}
