"""The standard gRPC health protocol and server reflection, as every segserve gRPC server serves them.

Every service may import it (grpc and common/tls.py only). `add_health_and_reflection`
registers grpc.health.v1.Health and reflection on a server; `Serving` sets the overall status ("")
and each named service's together: NOT_SERVING while a worker loads its model or any server shuts
down, SERVING in between. Kubernetes probes (`grpc:` probes) and grpcurl read these. `start_serving`
does what every service's server does before its first call: health and reflection, the port
(over TLS when given), the start. `status_errors` ends a unary call that raised with the status its
service's `abort` picks.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.ports import bind_free
from common.tls import TlsFiles, add_port

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Serving:
    """The health status of one server's services."""

    def __init__(self, service_names: Sequence[str]):
        self.service_names = list(service_names)
        self.servicer = health.aio.HealthServicer()

    async def set(self, is_serving: bool) -> None:
        """The overall status and every named service's."""
        for name in ("", *self.service_names):
            await self.servicer.set(name, _status(is_serving))

    async def set_services(self, is_serving: bool) -> None:
        """The named services' status alone (the overall one says the server is up; these, that it can serve)."""
        for name in self.service_names:
            await self.servicer.set(name, _status(is_serving))


def _status(is_serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING


def add_health_and_reflection(server: grpc.aio.Server, serving: Serving) -> None:
    """Serve `serving`'s health and reflection of its services (plus health and reflection themselves)."""
    health_pb2_grpc.add_HealthServicer_to_server(serving.servicer, server)
    reflection.enable_server_reflection((*serving.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)


async def start_serving(server: grpc.aio.Server, serving: Serving, address: str, tls: TlsFiles | None,
                        what: str) -> int:
    """Add health and reflection to `server` (its services already added), bind `address` (port 0: any free one,
    common/ports.py's bind_free; over TLS with `tls`, common/tls.py's add_port) and start it; returns the bound
    port. OSError naming `what` when the address cannot be bound."""
    add_health_and_reflection(server, serving)
    host, _, port_text = address.rpartition(":")
    if port_text == "0" and not address.startswith("unix"):  # any free one, bound where it is found (common/ports.py)
        port = bind_free(lambda candidate: add_port(server, f"{host}:{candidate}", tls))
    else:
        port = add_port(server, address, tls)
    if port == 0:
        raise OSError(f"cannot bind {what} to {address}")
    await server.start()
    return port


Abort = Callable[[grpc.aio.ServicerContext, str, Exception], Awaitable[None]]
"""abort(context, the method's name, what it raised): ends the call with a status (context.abort)."""


def status_errors(abort: Abort) -> Callable:
    """A decorator of unary servicer methods: whatever one raises ends its call through `abort`."""

    def decorate(method):
        @functools.wraps(method)
        async def wrapper(self, request, context: grpc.aio.ServicerContext):
            try:
                return await method(self, request, context)
            except Exception as exc:
                await abort(context, method.__name__, exc)

        return wrapper

    return decorate
