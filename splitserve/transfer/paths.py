"""Which path a worker's KV bytes take between its KV cache and UCX (a pure decision, no torch, no UCX).

Paths (the ``path`` label of the ``splitserve:kv_transfer_*`` metrics, span attribute ``splitserve.kv.path``):

* ``host``   -- the KV cache is in host memory; UCX reads and writes it in place (zero staging copies).
* ``cuda``   -- the KV cache is in CUDA memory and this process's UCX has a CUDA transport (``cuda_copy``, and
  ``cuda_ipc`` / GPUDirect RDMA where the hardware allows): UCX reads and writes device memory in place.
* ``staged`` -- the bytes go through a host staging buffer (pinned when CUDA is available): the sender copies its
  blocks into it and sends that; the receiver receives into it, then copies into its blocks. Used for a CUDA
  cache when UCX lacks CUDA transports, or when forced (``staging="always"``, which also works for a host
  cache: that is how CI exercises this path without a GPU).

``staging`` (environment ``PD_KV_TRANSFER_STAGING``, vLLM-like naming): ``auto`` (stage only when needed),
``always``, ``never`` (refuse to start rather than stage). The path depends only on this process: UCX itself
converts between the memory types of the two peers, so a host-memory prefill worker can feed a CUDA decode worker
(and the other way round). It is decided once per sender / receiver when it starts, so every connection of a
worker uses the same path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from splitserve.env import env_choice

STAGING_CHOICES = ("auto", "always", "never")
PATHS = ("host", "cuda", "staged")
DEVICE_KINDS = ("cpu", "cuda")
#: UCX transports that move CUDA memory; ``cuda_copy`` is the one UCX needs to touch device memory at all
CUDA_TRANSPORTS = frozenset({"cuda_copy", "cuda_ipc", "gdr_copy"})

_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s*([A-Za-z0-9_]+)/")


def staging_from_env(environ=None) -> str:
    """``PD_KV_TRANSFER_STAGING`` (default ``auto``). Raises EnvError (a ValueError) on another value."""
    return env_choice("PD_KV_TRANSFER_STAGING", STAGING_CHOICES, "auto", environ)


def check_staging(staging: str) -> str:
    """``staging`` itself when it is one of :data:`STAGING_CHOICES`. Raises ValueError naming the choices."""
    if staging not in STAGING_CHOICES:
        raise ValueError(f"KV transfer staging {staging!r}: expected one of {', '.join(STAGING_CHOICES)}")
    return staging


def ucx_transports(context_info: str) -> frozenset[str]:
    """Transport names (``tcp``, ``sysv``, ``cuda_copy``, ...) in UCX's context description (``ucp_context_print_info``
    text, ucxx's ``UCXContext.info``): its ``resource N : md M dev D flags -- TL/DEVICE`` lines."""
    return frozenset(m.group(1) for m in _RESOURCE.finditer(context_info))


def choose_path(device_kind: str, transports: Iterable[str], staging: str = "auto") -> str:
    """The path (:data:`PATHS`) for a KV cache on ``device_kind`` ("cpu" or "cuda") given this process's UCX
    ``transports`` and the ``staging`` choice.

    Raises:
        ValueError: unknown ``staging`` or ``device_kind``; or a CUDA cache with ``staging="never"`` while UCX has no
            ``cuda_copy`` transport (the message says what to change).
    """
    check_staging(staging)
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"KV cache device {device_kind!r}: expected one of {', '.join(DEVICE_KINDS)}")
    if staging == "always":
        return "staged"
    if device_kind == "cpu":
        return "host"
    if "cuda_copy" in set(transports):
        return "cuda"
    if staging == "never":
        raise ValueError("the KV cache is in CUDA memory but UCX has no cuda_copy transport (check UCX_TLS and that "
                         "the UCX build has CUDA support), and PD_KV_TRANSFER_STAGING=never forbids staging through host memory")
    return "staged"
