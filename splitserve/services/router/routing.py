"""Wiring of the routing layer: RouterConfig -> RoutedBackend, and the ``GET /v1/workers`` route."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from splitserve.services.router.config import RouterConfig
from splitserve.services.router.disaggregation import DisaggregationPolicy
from splitserve.services.router.backend import RoutedBackend
from splitserve.services.router.policies import make_policy
from splitserve.services.router.registry import WorkerRegistry


def build_backend(config: RouterConfig) -> RoutedBackend:
    """The router's backend for ``config`` (call ``start()`` inside the event loop)."""
    registry = WorkerRegistry(list(config.prefill), list(config.decode), poll_interval_s=config.poll_interval_s,
                              miss_limit=config.miss_limit, tls=config.tls, workers=list(config.workers))
    disagg = DisaggregationPolicy(config.disagg, max_local_stall_s=config.disagg_max_stall_ms / 1000 or None)
    return RoutedBackend(registry, make_policy(config.policy), disagg,
                         prefill_timeout_s=config.prefill_timeout_s, prefill_attempts=config.prefill_attempts,
                         decode_attempts=config.decode_attempts, local_prefill_fallback=config.local_prefill_fallback,
                         decode_stall_timeout_s=config.decode_stall_timeout_s, decode_migrations=config.decode_migrations,
                         skip_prefill_tokens=config.skip_prefill_tokens,
                         kv_transfer_mode=config.kv_transfer_mode)


def workers_route(backend: RoutedBackend, path: str = "/v1/workers", planner=None) -> Route:
    """``GET /v1/workers``: every worker with its state (up/down), role, load and picks; the policy and the
    current disaggregation threshold and cost model; with a ``planner`` (:class:`.planner_loop.Planner`), its
    knobs, last decision and recent decisions under ``"planner"``."""

    async def workers(request: Request) -> JSONResponse:
        view = backend.workers_view()
        if planner is not None:
            view["planner"] = planner.describe()
        return JSONResponse(view)

    return Route(path, workers, methods=["GET"])
