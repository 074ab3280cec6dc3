"""HTTPS on the router and mutual TLS on the internal hops, with certificates made per run.

A real worker (tiny model), drafter and scheduler run in process on a background event loop, every one
requiring client certificates from the test CA; a router in front of them serves HTTPS. A generation
through the router crosses every hop; each internal server refuses a client without a certificate, with
one from another CA, or in plaintext, and a client refuses a server its CA did not sign. The worker is
dialled through `dns:///localhost:PORT` with a certificate that names only `localhost`, so that hop also
shows a resolved replica checked against the DNS name. The router's public gRPC API serves TLS with the
HTTPS certificate: segserve.client generates through it, and plaintext or untrusting callers are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from drafter.config import DrafterConfig
from drafter.segments import parse_segments
from drafter.server import build_servicer, start_server as start_drafter
from protos.segserve.v1 import drafter_pb2_grpc
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server as start_scheduler, stop_server
from segserve.client import Client, RetryPolicy, SegserveError
from common.discovery import resolve_names
from common.ports import free_port
from segserve.launcher import Stack, StackConfig
from common.tls import TlsFiles, add_port, internal_tls, open_blocking_channel
from tests.support.certs import CertificateAuthority, Issued
from tests.support.devices import TEST_DEVICE
from tests.support.router_server import serve_router_and_grpc
from worker.config import WorkerConfig
from worker.server import WorkerServicer, load_runner, start_server as start_worker


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    other_ca: CertificateAuthority
    service: Issued
    """Signed by ca, for localhost and 127.0.0.1, server and client auth."""
    localhost_only: Issued
    """Signed by ca, naming localhost only (no IP address)."""
    client: Issued
    """Signed by ca, client auth only, no names."""
    stranger: Issued
    """Signed by other_ca, for localhost and 127.0.0.1."""

    def mutual(self, issued: Issued) -> TlsFiles:
        return TlsFiles(issued.cert_file, issued.key_file, self.ca.ca_file)

    def internal_fields(self, issued: Issued) -> dict[str, str]:
        return {"internal_tls_cert_file": issued.cert_file, "internal_tls_key_file": issued.key_file,
                "internal_tls_ca_file": self.ca.ca_file}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = CertificateAuthority(directory), CertificateAuthority(directory, "other-ca")
    return Pki(ca, other_ca, ca.issue("service"), ca.issue("localhost-only", ip_addresses=()),
               ca.issue("client", dns_names=(), ip_addresses=(), is_server=False), other_ca.issue("stranger"))


# --- files and settings ---------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [WorkerConfig, SchedulerConfig, DrafterConfig, RouterConfig])
def test_internal_tls_takes_all_three_files_or_none(cls, pki):
    assert internal_tls(cls()) is None
    with pytest.raises(ValueError, match="missing: internal_tls_key_file, internal_tls_ca_file"):
        cls(internal_tls_cert_file=pki.service.cert_file)
    with pytest.raises(ValueError, match="missing: internal_tls_cert_file"):
        cls(internal_tls_key_file=pki.service.key_file, internal_tls_ca_file=pki.ca.ca_file)
    assert internal_tls(cls(**pki.internal_fields(pki.service))) == pki.mutual(pki.service)


def test_the_router_takes_a_certificate_with_its_key(pki):
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        RouterConfig(tls_cert_file=pki.service.cert_file)
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        RouterConfig(tls_key_file=pki.service.key_file, is_grpc_api=False)
    assert RouterConfig(tls_cert_file=pki.service.cert_file, tls_key_file=pki.service.key_file
                        ).tls == TlsFiles(pki.service.cert_file, pki.service.key_file)
    assert RouterConfig().tls is None


def test_unreadable_or_mismatched_files_are_clear_errors(pki, tmp_path):
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match=f"cannot read the TLS certificate '{missing}'"):
        TlsFiles(missing, pki.service.key_file).check()
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="is not a PEM file"):
        TlsFiles(pki.service.cert_file, str(not_pem)).check()
    with pytest.raises(ValueError, match="do not load together"):
        TlsFiles(pki.service.cert_file, pki.client.key_file).check()
    with pytest.raises(ValueError, match="CA file"):
        TlsFiles(pki.service.cert_file, pki.service.key_file, str(not_pem)).check()
    with pytest.raises(ValueError, match="certificate needs its key"):
        TlsFiles(pki.service.cert_file)


def test_a_service_with_an_unreadable_file_stops_at_start_up_with_the_path(pki, tmp_path, capsys):
    from segserve.cli import main

    missing = str(tmp_path / "gone.key")
    argv = ["worker", "--port", "0", "--internal-tls-cert-file", pki.service.cert_file,
            "--internal-tls-key-file", missing, "--internal-tls-ca-file", pki.ca.ca_file]
    assert main(argv) == 2
    assert f"cannot read the TLS key '{missing}'" in capsys.readouterr().err


@contextlib.contextmanager
def health_server(address: str, tls: TlsFiles) -> Iterator[int]:
    """A blocking gRPC server answering grpc.health.v1 only; yields its bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = add_port(server, address, tls)
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


async def test_a_resolved_replica_is_checked_against_the_dns_name(pki):
    """A certificate naming only `localhost` is refused when dialled as 127.0.0.1, and accepted with the
    name the address was resolved from."""
    with health_server("127.0.0.1:0", pki.mutual(pki.localhost_only)) as port:
        names = await resolve_names([f"dns:///localhost:{port}", "10.0.0.1:5"])
        assert names[f"127.0.0.1:{port}"] == "localhost" and names["10.0.0.1:5"] is None
        client = pki.mutual(pki.client)
        with open_blocking_channel(f"127.0.0.1:{port}", client) as channel:
            assert health_code(channel) == grpc.StatusCode.UNAVAILABLE
        with open_blocking_channel(f"127.0.0.1:{port}", client, server_name="localhost") as channel:
            assert health_code(channel) == grpc.StatusCode.OK


def test_a_unix_socket_target_works_over_tls_checked_against_localhost(pki, tmp_path):
    target = f"unix:{tmp_path / 'service.sock'}"
    with health_server(target, pki.mutual(pki.localhost_only)):
        with open_blocking_channel(target, pki.mutual(pki.client)) as channel:
            assert health_code(channel) == grpc.StatusCode.OK
        with open_blocking_channel(target, None) as channel:
            assert health_code(channel) == grpc.StatusCode.UNAVAILABLE


def health_code(channel: grpc.Channel) -> grpc.StatusCode:
    """The status of a grpc.health.v1 Check over `channel` (OK when it answered)."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --- a stack with mutual TLS on every internal hop, HTTPS in front ---------------------------------

class LoopThread:
    """An event loop on a thread of its own, for servers that tests talk to with blocking clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class TlsStack:
    worker: str
    drafter: str
    scheduler: str
    router_url: str
    router_grpc: str
    draft_calls: list[int]
    router: RouterConfig


@pytest.fixture(scope="module")
def stack(pki, tiny_gemma3_dir):
    loop = LoopThread()
    draft_calls: list[int] = []

    async def start():
        worker_config = WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=64, block_size=4, dtype="float32",
                                     device=TEST_DEVICE, port=0, **pki.internal_fields(pki.localhost_only))
        worker = WorkerServicer()
        worker_server, worker_port = await start_worker(worker, "127.0.0.1", 0, internal_tls(worker_config))
        worker.attach(await asyncio.to_thread(load_runner, worker_config))
        await worker.serving.set(True)
        drafter = build_servicer(DrafterConfig(), parse_segments({"default": {"algorithm": "best_first"}}))
        draft = drafter.Draft

        async def counted_draft(request, context):
            draft_calls.append(len(request.queries))
            return await draft(request, context)

        drafter.Draft = counted_draft
        drafter_server, drafter_port = await start_drafter(drafter, "127.0.0.1", 0, pki.mutual(pki.service))
        scheduler_config = SchedulerConfig(
            worker_address=f"dns:///localhost:{worker_port}", drafter_addresses=[f"127.0.0.1:{drafter_port}"],
            port=0, max_num_seqs=4, draft_timeout_ms=5000, **pki.internal_fields(pki.service))
        scheduler_server, engine = await start_scheduler(scheduler_config)
        return (worker_server, drafter_server, scheduler_server, engine), (worker_port, drafter_port,
                                                                          scheduler_server.bound_port)

    servers, (worker_port, drafter_port, scheduler_port) = loop.run(start())
    router = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{scheduler_port}",
                          port=free_port(), scheduler_wait_s=60, tls_cert_file=pki.service.cert_file,
                          tls_key_file=pki.service.key_file, grpc_port=0, **pki.internal_fields(pki.client))
    try:
        with serve_router_and_grpc(router) as (url, grpc_target):
            yield TlsStack(f"127.0.0.1:{worker_port}", f"127.0.0.1:{drafter_port}", f"127.0.0.1:{scheduler_port}",
                           url.replace("http://", "https://"), grpc_target, draft_calls, router)
    finally:
        worker_server, drafter_server, scheduler_server, engine = servers

        async def stop():
            await stop_server(scheduler_server, engine)
            await drafter_server.stop(None)
            await worker_server.stop(None)

        loop.run(stop())
        loop.close()


def trusting(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki.ca.ca_file)


def test_a_generation_crosses_every_hop_over_mutual_tls(stack, pki):
    reply = httpx.post(f"{stack.router_url}/v1/completions", verify=trusting(pki), timeout=60,
                       json={"prompt": "one two three one two three one two", "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 12
    assert stack.draft_calls and sum(stack.draft_calls) > 0  # the scheduler -> drafter hop answered


def test_https_needs_a_client_that_trusts_the_ca_and_plain_http_is_refused(stack, pki):
    assert httpx.get(f"{stack.router_url}/health", verify=trusting(pki)).json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{stack.router_url}/health", verify=ssl.create_default_context(cafile=pki.other_ca.ca_file))
    with pytest.raises(httpx.HTTPError):  # the TLS port answers no plaintext request
        httpx.get(stack.router_url.replace("https://", "http://") + "/health", timeout=10)


def test_the_public_grpc_api_serves_tls_with_the_https_certificate(stack, pki):
    prompt = "one two three one two three one two"
    with Client(stack.router_grpc, ca_file=pki.ca.ca_file, timeout_s=60) as client:
        result = client.generate(prompt, max_tokens=12, temperature=0)
    https = httpx.post(f"{stack.router_url}/v1/completions", verify=trusting(pki), timeout=60,
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    assert result.usage.completion_tokens == 12
    assert result.text == https["choices"][0]["text"]
    never_retry = RetryPolicy(max_attempts=1)
    for refused in ({}, {"ca_file": pki.other_ca.ca_file}):  # plaintext; TLS not trusting the server's CA
        with Client(stack.router_grpc, retry=never_retry, timeout_s=10, **refused) as client:
            with pytest.raises(SegserveError) as failure:
                client.list_models()
        assert failure.value.code == "UNAVAILABLE", refused
    with open_blocking_channel(stack.router_grpc, TlsFiles(ca_file=pki.ca.ca_file)) as channel:
        assert health_code(channel) == grpc.StatusCode.OK  # grpc.health.v1 on the same TLS port


@pytest.mark.parametrize("hop", ["worker", "drafter", "scheduler"])
def test_each_internal_server_refuses_clients_without_a_certificate_of_its_ca(stack, pki, hop):
    address = getattr(stack, hop)
    name = "localhost" if hop == "worker" else None  # the worker's certificate names localhost only
    clients = {
        "a certificate of the CA": pki.mutual(pki.client),
        "no certificate": TlsFiles(ca_file=pki.ca.ca_file),
        "another CA's certificate": pki.mutual(pki.stranger),
        "plaintext": None,
        "a client not trusting the server's CA": TlsFiles(pki.client.cert_file, pki.client.key_file,
                                                          pki.other_ca.ca_file),
    }
    codes = {}
    for what, tls in clients.items():
        with open_blocking_channel(address, tls, server_name=name) as channel:
            codes[what] = health_code(channel)
    assert codes == {"a certificate of the CA": grpc.StatusCode.OK, "no certificate": grpc.StatusCode.UNAVAILABLE,
                     "another CA's certificate": grpc.StatusCode.UNAVAILABLE, "plaintext": grpc.StatusCode.UNAVAILABLE,
                     "a client not trusting the server's CA": grpc.StatusCode.UNAVAILABLE}


def test_the_launcher_waits_for_a_service_over_its_internal_tls(stack, pki):
    """The readiness check `segserve serve` runs on each service it starts dials it with the service's files."""
    launcher = Stack(StackConfig())
    launcher.processes["drafter"] = _Alive()
    config = DrafterConfig(**pki.internal_fields(pki.service))
    launcher._wait_grpc_ready("drafter", drafter_pb2_grpc.DrafterStub, stack.drafter, time.monotonic() + 20, config)
    with pytest.raises(TimeoutError):  # plaintext never gets an answer from it
        launcher._wait_grpc_ready("drafter", drafter_pb2_grpc.DrafterStub, stack.drafter, time.monotonic() + 2,
                                  DrafterConfig())


class _Alive:
    returncode = None

    def poll(self) -> None:
        return None
