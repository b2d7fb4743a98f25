"""Cache salts: who may share a cached prompt prefix (pure: no sockets, no asyncio).

A prefix cache shared by everyone is an oracle: a request that finds a prefix cached learns
that somebody sent it (``usage.cached_tokens``, a shorter time to first token, the Stats
counters), and with small pages a secret can be read out a token at a time. A request's
``cache_salt`` (the OpenAI request's field as vLLM accepts it; ``GenerateRequest.cache_salt``
on the client protocol) is mixed into the root of its page hashes on every node that caches
it (decoder and prefiller alike: the salt travels in the decoder's ``PrefillRequest``) and
into the routing keys that choose a node for it (``disagg.engine.cache.page_root``,
``disagg.serving.routing.route_root``), so that a salted prefix never matches an unsalted or
differently salted one. No salt (None) hashes as before.

Salting by tenant (``--cache-salt-by-tenant``, ``auto`` = on where CURVE keys authenticate
clients): a frame whose CURVE key is a client key gets ``tenant_salt(its key id, its own
salt)`` as its salt, so one client key never shares a cached prefix with another whatever
salts they send; node keys (the router, a node's HTTP gateway) pass their salt on as it is,
having salted their own clients' requests already. The same clients see 0 for the Stats
prefix counters (``redact_stats``): only node keys (operators, the router, the gateway's
metrics) get them.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from disagg.protocol import MAX_CACHE_SALT, GenerateRequest, Stats

SaltByTenant = Literal["auto", "on", "off"]
SALT_BY_TENANT_MODES: tuple[SaltByTenant, ...] = ("auto", "on", "off")
TENANT_PREFIX = "tenant:"  # what a derived salt starts with (its digest follows, hex)
# the Stats fields a tenant client sees as 0: cumulative prefix-cache counters of the node
REDACTED_STATS = ("prefix_query_tokens", "prefix_hit_tokens", "tier_hits_device",
                  "tier_hits_host", "tier_hits_disk", "tier_hit_tokens_device",
                  "tier_hit_tokens_host", "tier_hit_tokens_disk")


def tenant_salt(tenant: str, salt: str | None) -> str:
    """The salt of a request from ``tenant`` (its CURVE key id) that asked for ``salt``: a
    digest of both, so two tenants never get the same one and no tenant can pick another's
    (it would need a preimage)."""
    h = hashlib.blake2b(msgspec.msgpack.encode((tenant, salt)), digest_size=16,
                        person=b"disagg.tenant")  # a pair of lengths: no two read the same
    return TENANT_PREFIX + h.hexdigest()


def salt_by_tenant(mode: SaltByTenant, curve_clients: bool) -> bool:
    """Whether a client front salts by tenant: ``on``, or ``auto`` with CURVE keys in use
    (``on`` without them is refused: tenants are client keys)."""
    if mode not in SALT_BY_TENANT_MODES:
        raise ValueError(f"--cache-salt-by-tenant must be one of {SALT_BY_TENANT_MODES}, "
                         f"got {mode!r}")
    if mode == "on" and not curve_clients:
        raise ValueError("--cache-salt-by-tenant on needs --curve-keys: the tenants are the "
                         "CURVE client keys")
    return mode == "on" or (mode == "auto" and curve_clients)


def salted(req: GenerateRequest, tenant: str) -> GenerateRequest:
    """``req`` with its salt replaced by ``tenant``'s (a salt too long is kept: admission
    refuses it by name)."""
    if req.cache_salt is not None and len(req.cache_salt) > MAX_CACHE_SALT:
        return req
    return msgspec.structs.replace(req, cache_salt=tenant_salt(tenant, req.cache_salt))


def redact_stats(stats: Stats) -> Stats:
    """``stats`` as a tenant client sees it: the prefix-cache counters 0."""
    return msgspec.structs.replace(stats, **{name: 0 for name in REDACTED_STATS})


class TenantSalting:
    """A client front's policy: ``tenant`` is the CURVE client key id of a frame's sender
    (None: a node key, or no CURVE)."""

    def __init__(self, mode: SaltByTenant = "auto", curve_clients: bool = False):
        self.enabled = salt_by_tenant(mode, curve_clients)

    def request(self, req: GenerateRequest, tenant: str | None) -> GenerateRequest:
        return salted(req, tenant) if self.enabled and tenant is not None else req

    def stats(self, stats: Stats, tenant: bool) -> Stats:
        return redact_stats(stats) if self.enabled and tenant else stats
