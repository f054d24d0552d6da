"""Checks shared by the frozen config dataclasses (raise ValueError, as their ``__post_init__`` do)."""

from __future__ import annotations


def check_port(name: str, port: int) -> None:
    """``port`` is a TCP port number, or 0 for any free port.

    Raises:
        ValueError: outside [0, 65535] (the OS would otherwise wrap 70000 to 4464 or refuse -1 late).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port in [0, 65535] (0: any free port), got {port!r}")


def check_port_free(what: str, host: str, port: int) -> None:
    """Nothing listens on ``host:port`` now (0: any free port, always fine), so a launcher can refuse at once
    instead of starting processes that then fail to bind. Not a reservation: a race stays possible.

    Raises:
        ValueError: "cannot listen on HOST:PORT (WHAT): the port is in use or the address is not local".
    """
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError:
            raise ValueError(f"cannot listen on {host}:{port} ({what}): the port is in use or the address is not local") from None


def check_push_layer_groups(model: str, groups: int) -> None:
    """``--kv-push-layer-groups``: 0 (one group per layer) up to the number of layers of ``model`` (read without
    weights; a model that cannot be read here is left to fail when the engine loads it).

    Raises:
        ValueError: below 0, or more groups than the model has layers.
    """
    if groups < 0:
        raise ValueError(f"--kv-push-layer-groups must be >= 0 (0: one per layer), got {groups}")
    if groups == 0:
        return
    from splitserve.model import load_model

    try:
        layers = load_model(model, weights=False).config.num_layers
    except (OSError, ValueError, NotImplementedError):
        return
    if groups > layers:
        raise ValueError(f"--kv-push-layer-groups {groups} exceeds the model's {layers} layers "
                         f"(at most {layers}; 0: one group per layer)")
