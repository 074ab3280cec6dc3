"""Tenants at the router's edge, through real HTTP and the public gRPC API in front of the fake scheduler: the
tenant id derived from the API key (never the key) reaches the GenerateRequest; without keys, a trusted tenant
header or the default tenant ""; /metrics and /status behind a key with metrics_require_key."""

from __future__ import annotations

import hashlib

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from common.ports import free_port
from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from router.config import RouterConfig
from router.tenants import tenant_for, tenant_of_key
from tests.support.fake_scheduler import start_fake_scheduler
from tests.support.router_server import serve_router, serve_router_and_grpc

MODEL = "tiny-gemma3"
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


@pytest.fixture(scope="module")
def scheduler(tiny_gemma3_dir):
    server, fake, port = start_fake_scheduler(AutoTokenizer.from_pretrained(str(tiny_gemma3_dir)), model_name=MODEL)
    yield fake, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def keyed_router(scheduler, tiny_gemma3_dir):
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{scheduler[1]}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10, api_keys=[KEY_A, KEY_B], metrics_require_key=True,
                          tenant_header="X-Segserve-Tenant")
    with serve_router_and_grpc(config) as urls:
        yield urls


def _last_tenant(fake) -> str:
    return fake.requests[-1].tenant


def _complete(url: str, headers: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      headers=headers, timeout=30)


def test_the_tenant_is_a_stable_id_of_the_key_and_not_the_key():
    tenant = tenant_of_key(KEY_A.encode())
    assert tenant == hashlib.sha256(KEY_A.encode()).hexdigest()[:16] and KEY_A not in tenant
    assert tenant_for(f"Bearer {KEY_A}".encode(), [KEY_B.encode(), KEY_A.encode()], None) == tenant
    assert tenant_for(b"Bearer other", [KEY_A.encode()], None) == ""


def test_http_requests_carry_their_keys_tenant(keyed_router, scheduler):
    fake, _ = scheduler
    url, _ = keyed_router
    for key in (KEY_A, KEY_B):  # a tenant header is ignored when keys are configured
        reply = _complete(url, {"Authorization": f"Bearer {key}", "X-Segserve-Tenant": "forged"})
        assert reply.status_code == 200, reply.text
        assert _last_tenant(fake) == tenant_of_key(key.encode())
    stream = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30,
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stream": True})
    assert stream.status_code == 200 and "[DONE]" in stream.text
    assert _last_tenant(fake) == tenant_of_key(KEY_B.encode())
    body = {"text_input": "hi", "parameters": {"max_new_tokens": 2}}
    reply = httpx.post(f"{url}/v2/models/{MODEL}/generate", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert _last_tenant(fake) == tenant_of_key(KEY_A.encode())


def test_grpc_requests_carry_their_keys_tenant(keyed_router, scheduler):
    fake, _ = scheduler
    with grpc.insecure_channel(keyed_router[1]) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerationRequest(prompt="hi", parameters=pb.GenerationParameters(max_tokens=2))
        stub.Generate(request, metadata=[("authorization", f"Bearer {KEY_B}")], timeout=30)
        assert _last_tenant(fake) == tenant_of_key(KEY_B.encode())
        list(stub.GenerateStream(request, metadata=[("authorization", f"Bearer {KEY_A}")], timeout=30))
        assert _last_tenant(fake) == tenant_of_key(KEY_A.encode())


@pytest.mark.parametrize("path", ["/metrics", "/status"])
def test_ops_pages_want_a_key_when_told(keyed_router, path):
    url, _ = keyed_router
    assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
    assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    reply = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # liveness never wants one


def test_without_keys_a_trusted_header_names_the_tenant(scheduler, tiny_gemma3_dir):
    fake, port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10, tenant_header="X-Segserve-Tenant")
    with serve_router_and_grpc(config) as (url, target):
        assert _complete(url, {"X-Segserve-Tenant": "team-7"}).status_code == 200
        assert _last_tenant(fake) == "team-7"
        assert _complete(url, {}).status_code == 200
        assert _last_tenant(fake) == ""
        bad = _complete(url, {"X-Segserve-Tenant": "a/../b"})
        assert bad.status_code == 400 and "tenant" in bad.text
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200  # open by default
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerationRequest(prompt="hi", parameters=pb.GenerationParameters(max_tokens=2))
            stub.Generate(request, metadata=[("x-segserve-tenant", "team-9")], timeout=30)
            assert _last_tenant(fake) == "team-9"
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(request, metadata=[("x-segserve-tenant", "no spaces")], timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_without_keys_or_a_trusted_header_every_request_is_the_default_tenant(scheduler, tiny_gemma3_dir):
    fake, port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          scheduler_wait_s=10)
    with serve_router(config) as url:
        assert _complete(url, {"X-Segserve-Tenant": "team-7"}).status_code == 200
        assert _last_tenant(fake) == ""


def test_metrics_require_key_needs_keys():
    with pytest.raises(ValueError, match="metrics_require_key"):
        RouterConfig(metrics_require_key=True)
