"""`splitserve role ADDRESS [prefill|decode|both]`: read or switch the role of a running `splitserve worker`
(``pd.v1.RoleService``), e.g. by hand or from a script; the router follows on its next poll."""

from __future__ import annotations

import asyncio
import sys

import grpc
from pd.v1 import common_pb2, role_pb2, role_pb2_grpc

from splitserve.rpc.server import channel
from splitserve.rpc.tls import TlsConfig
from splitserve.services.worker.roles import ROLE_FROM_PROTO, ROLE_TO_PROTO, ROLES


def _name(role: int) -> str:
    return ROLE_FROM_PROTO.get(role) or "none"


async def role(address: str, new_role: str | None = None, wait_s: float = 0.0, reason: str = "",
               tls: TlsConfig | None = None, timeout_s: float = 10.0) -> str:
    """One line describing the worker's role at ``address`` after switching it to ``new_role`` (None: only read it);
    ``wait_s`` > 0: wait up to that many seconds for the role left to drain. Raises grpc.aio.AioRpcError."""
    async with channel(address, tls) as ch:
        stub = role_pb2_grpc.RoleServiceStub(ch)
        if new_role is None:
            r = await stub.GetRole(role_pb2.GetRoleRequest(), timeout=timeout_s)
            draining = f", draining {_name(r.draining_role)}" if r.draining_role != common_pb2.WORKER_ROLE_UNSPECIFIED else ""
            return (f"{address}: {_name(r.role)}{draining} ({r.prefill_calls} prefill call(s), {r.decode_calls} decode "
                    f"stream(s) running; {r.switches} switch(es) since start)")
        r = await stub.SetRole(role_pb2.SetRoleRequest(role=ROLE_TO_PROTO[new_role], drain_timeout_ms=int(wait_s * 1000),
                                                       reason=reason or "splitserve role"), timeout=timeout_s + wait_s)
        state = "drained" if r.drained else f"draining ({r.draining_calls} call(s) of the role left still running)"
        return f"{address}: {_name(r.previous_role)} -> {_name(r.role)}, {state}"


def main(argv: list[str]) -> int:
    from splitserve.cli_help import new_parser
    from splitserve.rpc.tls import add_tls_args, tls_config

    ap = new_parser("splitserve role", "Read or switch the role of a running `splitserve worker` (pd.v1.RoleService).")
    ap.add_argument("address", help="the worker's gRPC host:port")
    ap.add_argument("role", nargs="?", choices=ROLES, metavar="role", help="the new role: prefill, decode or both; omitted: print the current one")
    ap.add_argument("--wait-s", type=float, default=0.0, help="wait up to this many seconds for the role left to drain")
    ap.add_argument("--reason", default="", help="logged by the worker")
    add_tls_args(ap)
    a = ap.parse_args(argv)
    try:
        print(asyncio.run(role(a.address, a.role, max(a.wait_s, 0.0), a.reason, tls_config(a))))
    except ValueError as exc:
        print(f"splitserve role: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a prefill/decode worker born to one role, or a router
            print(f"splitserve role: {a.address} has no RoleService: only a worker started with `splitserve worker` "
                  "(or `splitserve up --elastic`) can switch roles", file=sys.stderr)
        else:
            print(f"splitserve role: {a.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
