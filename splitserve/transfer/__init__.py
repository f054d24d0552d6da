"""KV cache transfer between prefill and decode workers (see :mod:`splitserve.transfer.base`).

Importing this package imports nothing else: each name below is loaded on first use (PEP 562), so
``from splitserve.transfer import ucx_env_defaults`` (the launcher) loads neither torch nor ucxx, and
the ``ucx`` backend is loaded only when a sender or receiver of that kind is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.lazy import lazy_exports

_EXPORTS = {
    "KVLayout": "splitserve.transfer.layout",
    "KVReceiver": "splitserve.transfer.base",
    "KVSender": "splitserve.transfer.base",
    "TransferRefused": "splitserve.transfer.base",
    "TransferStats": "splitserve.transfer.base",
    "create_receiver": "splitserve.transfer.base",
    "create_sender": "splitserve.transfer.base",
    "supported_kinds": "splitserve.transfer.base",
    "apply_ucx_env_defaults": "splitserve.transfer.ucx_runtime",
    "ucx_env_defaults": "splitserve.transfer.ucx_runtime",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from splitserve.transfer.base import (
        KVReceiver,
        KVSender,
        TransferRefused,
        TransferStats,
        create_receiver,
        create_sender,
        supported_kinds,
    )
    from splitserve.transfer.layout import KVLayout
    from splitserve.transfer.ucx_runtime import apply_ucx_env_defaults, ucx_env_defaults


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
