"""The gRPC servicers of a worker whose role can change: PrefillService and DecodeService gated by its
:class:`~splitserve.services.worker.roles.RoleState`, and RoleService (SetRole, GetRole).

Prefill and Decode calls of a kind of work the current role does not take are refused with ABORTED
(:class:`~splitserve.errors.RoleNotServed`) before anything is allocated; admitted calls are counted for the drain.
Both services' ``GetStats`` carry the role (``role``, ``draining_role``) and every counter the worker has: the
service's own, then the other service's under the names the first does not use (one process, one engine).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import grpc
from pd.v1 import common_pb2, decode_pb2, prefill_pb2, role_pb2, role_pb2_grpc

from splitserve.errors import InvalidRequest, PdError
from splitserve.rpc.status import abort_with
from splitserve.services.decode.server import DecodeServicer
from splitserve.services.prefill.server import PrefillServicer
from splitserve.services.worker.roles import DECODE, PREFILL, ROLE_FROM_PROTO, ROLE_TO_PROTO, RoleState


def _merge(own: common_pb2.GetStatsResponse, other: dict[str, float], roles: RoleState) -> common_pb2.GetStatsResponse:
    for key, value in other.items():
        if key not in own.counters:
            own.counters[key] = value
    return roles.fill(own)


class RolePrefillServicer(PrefillServicer):
    """A :class:`PrefillServicer` that takes Prefill calls only while ``roles`` takes prefill work. ``peer``: the
    process's :class:`RoleDecodeServicer` (its counters join GetStats)."""

    def __init__(self, roles: RoleState, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.roles = roles
        self.peer: RoleDecodeServicer | None = None

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        try:
            self.roles.enter(PREFILL)
        except PdError as exc:
            await abort_with(context, exc)
        try:
            return await super().Prefill(request, context)
        finally:
            self.roles.exit(PREFILL)

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        own = await super().GetStats(request, context)
        return _merge(own, self.peer.worker.stats() if self.peer else {}, self.roles)


class RoleDecodeServicer(DecodeServicer):
    """A :class:`DecodeServicer` that opens Decode streams only while ``roles`` takes decode work; a stream admitted
    before a switch runs to its end. ``peer``: the process's :class:`RolePrefillServicer`."""

    def __init__(self, roles: RoleState, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.roles = roles
        self.peer: RolePrefillServicer | None = None

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        try:
            self.roles.enter(DECODE)
        except PdError as exc:
            await abort_with(context, exc)
        try:
            async with contextlib.aclosing(super().Decode(request, context)) as stream:  # closing it aborts the request
                async for msg in stream:
                    yield msg
        finally:
            self.roles.exit(DECODE)

    async def GetStats(self, request, context) -> common_pb2.GetStatsResponse:
        own = await super().GetStats(request, context)
        return _merge(own, self.peer.worker.stats() if self.peer else {}, self.roles)


class RoleServicer(role_pb2_grpc.RoleServiceServicer):
    """``pd.v1.RoleService`` over ``roles`` (see :mod:`splitserve.services.worker.roles` for what a switch does)."""

    def __init__(self, roles: RoleState) -> None:
        self.roles = roles

    async def SetRole(self, request: role_pb2.SetRoleRequest, context: grpc.aio.ServicerContext) -> role_pb2.SetRoleResponse:
        role = ROLE_FROM_PROTO.get(request.role)
        if role is None:
            await abort_with(context, InvalidRequest(f"role must be PREFILL, DECODE or BOTH, got {request.role}"))
        previous = self.roles.set(role, request.reason)
        if request.drain_timeout_ms:
            drained = await self.roles.wait_drained(request.drain_timeout_ms / 1000)
        else:
            drained = self.roles.draining is None
        left = self.roles.draining
        return role_pb2.SetRoleResponse(previous_role=ROLE_TO_PROTO[previous], role=ROLE_TO_PROTO[self.roles.role],
                                        drained=drained, draining_calls=self.roles.calls[left] if left else 0)

    async def GetRole(self, request: role_pb2.GetRoleRequest, context: grpc.aio.ServicerContext) -> role_pb2.GetRoleResponse:
        r = self.roles
        left = r.draining
        return role_pb2.GetRoleResponse(
            role=ROLE_TO_PROTO[r.role], draining_role=ROLE_TO_PROTO[left] if left else common_pb2.WORKER_ROLE_UNSPECIFIED,
            prefill_calls=r.calls[PREFILL], decode_calls=r.calls[DECODE], switches=r.switches,
        )
