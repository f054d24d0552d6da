"""Read deadlines and the connection cap of an HTTP listener (see :mod:`splitserve.frontend.http_server`)."""

from __future__ import annotations

import resource
from dataclasses import dataclass

from splitserve.env import env_float, env_int


def default_max_connections() -> int:
    """Half the soft open-file limit (the other half: gRPC channels, UCX, model files), 64..4,096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 2))


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-connection read deadlines (s) and the open-connection cap of one HTTP listener."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        """Raises ValueError naming the first setting out of range."""
        for name, value in (("PD_HTTP_HEADER_TIMEOUT_S", self.header_timeout_s), ("PD_HTTP_BODY_TIMEOUT_S", self.body_timeout_s),
                            ("PD_HTTP_KEEPALIVE_TIMEOUT_S", self.keepalive_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"PD_HTTP_MAX_CONNECTIONS must be >= 1, got {self.max_connections}")

    @classmethod
    def from_env(cls) -> HttpLimits:
        """From ``PD_HTTP_*`` (see the module docstring). Raises ValueError (EnvError) naming a bad variable."""
        limits = cls(
            header_timeout_s=env_float("PD_HTTP_HEADER_TIMEOUT_S", 10.0),
            body_timeout_s=env_float("PD_HTTP_BODY_TIMEOUT_S", 30.0),
            keepalive_timeout_s=env_float("PD_HTTP_KEEPALIVE_TIMEOUT_S", 5.0),
            max_connections=env_int("PD_HTTP_MAX_CONNECTIONS", default_max_connections()),
        )
        return limits
