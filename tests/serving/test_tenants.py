"""Tenants behind one sender (a router, a gateway): the tenant an HTTP request names
(``disagg.serving.tenants``), and the intake's fair queue and per-client bound keyed by the
tenant a request carries (``GenerateRequest.tenant``), so that one tenant flooding the router
does not lock another out of a decoder; a client key's tenant is its key whatever it names."""

from __future__ import annotations

from disagg.protocol import MAX_TENANT, Error, GenerateRequest
from disagg.protocol.inproc import FromClient
from disagg.serving.admission import Limits
from disagg.serving.tenants import HEADER_PREFIX, KEY_PREFIX, http_tenant

from .test_intake import FakeScheduler

ROUTER = b"router"  # one identity: the router's connection to this decoder


def test_the_tenant_of_an_http_request():
    assert http_tenant({}) is None
    a = http_tenant({"Authorization": "Bearer sk-alice"})
    b = http_tenant({"Authorization": "bearer  sk-bob "})
    assert a is not None and a.startswith(KEY_PREFIX) and "sk-alice" not in a
    assert b is not None and a != b and http_tenant({"Authorization": "Bearer sk-alice"}) == a
    assert http_tenant({"Authorization": "Basic xyz"}) is None
    assert http_tenant({"Authorization": "Bearer "}) is None
    named = {"X-Tenant": "team-a", "Authorization": "Bearer sk-alice"}
    assert http_tenant(named, "X-Tenant") == "team-a"  # the operator's header first
    assert http_tenant({"Authorization": "Bearer sk-alice"}, "X-Tenant") == a  # else the key
    long = http_tenant({"X-Tenant": "t" * (MAX_TENANT + 1)}, "X-Tenant")
    assert long is not None and long.startswith(HEADER_PREFIX) and len(long) <= MAX_TENANT
    assert GenerateRequest("r", prompt="x", tenant=long).validate() is None
    assert "tenant" in (GenerateRequest("r", prompt="x", tenant="").validate() or "")


async def send(s: FakeScheduler, rid: str, tenant: str | None, key: bytes | None = None,
               identity: bytes = ROUTER) -> None:
    req = GenerateRequest(rid, prompt_token_ids=[1, 2, 3], tenant=tenant)
    await s.intake.handle(FromClient.of(identity, req, key))


async def test_one_tenant_flooding_behind_the_router_leaves_another_admitted():
    s = FakeScheduler(Limits(per_client=3, queued=100))
    for i in range(10):
        await send(s, f"a{i}", "alice")
    refused = [m for m in s.replies(ROUTER) if isinstance(m, Error)]
    assert len(refused) == 7 and {m.code for m in refused} == {"overloaded"}
    await send(s, "b0", "bob")  # the same connection, another tenant: its own share
    assert (ROUTER, "b0") in s.live
    await send(s, "n0", None)  # no tenant: the router's own share
    assert (ROUTER, "n0") in s.live
    # the fair queue takes the tenants in turn, not the router's requests in arrival order
    order = [s.intake.next_queued().request_id for _ in range(5)]
    assert order == ["a0", "b0", "n0", "a1", "a2"]
    # an ended request frees its tenant's seat, not another's
    await s.end(s.live[(ROUTER, "a0")], Error("timeout", "x", "a0"))
    await send(s, "a10", "alice")
    assert (ROUTER, "a10") in s.live
    assert s.intake.per_client[b"\2alice"] == 3 and s.intake.per_client[b"\2bob"] == 1


async def test_a_client_key_is_its_own_tenant_whatever_it_names():
    s = FakeScheduler(Limits(per_client=2, queued=100))
    for i in range(3):  # a client key naming three tenants is still one
        await send(s, f"k{i}", f"t{i}", key=b"clientkey", identity=b"conn")
    [refused] = [m for m in s.replies(b"conn") if isinstance(m, Error)]
    assert refused.code == "overloaded" and refused.request_id == "k2"
    await send(s, "x0", "t0")  # the router's tenant t0 is not that key's
    assert (ROUTER, "x0") in s.live


async def test_a_draining_intake_refuses_new_requests_unavailable():
    s = FakeScheduler()
    await send(s, "r0", "alice")
    s.intake.draining = "the node is draining"
    await send(s, "r1", "alice")
    [refused] = s.replies(ROUTER)
    assert isinstance(refused, Error) and refused.code == "unavailable"
    assert refused.request_id == "r1" and "draining" in refused.message
    assert (ROUTER, "r0") in s.live and (ROUTER, "r1") not in s.live
