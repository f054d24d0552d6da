"""KV cache transfer between prefill and decode workers (see :mod:`splitserve.transfer.base`).

Importing this package does not import ucxx; the ``ucx`` backend is loaded on first use.
"""

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

__all__ = [
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "TransferRefused",
    "TransferStats",
    "apply_ucx_env_defaults",
    "create_receiver",
    "create_sender",
    "supported_kinds",
    "ucx_env_defaults",
]
