"""The tenant of an HTTP request (pure: no sockets, no asyncio): the unit of fairness the
gateway names in ``GenerateRequest.tenant``, so that the decoders' fair queue and
``--max-requests-per-client`` tell its clients apart (the router or the gateway is one client
of each node; without a tenant all its clients would share one share).

The value of the header the operator names (``--tenant-header``, e.g. ``X-Tenant``), else the
id of the request's API key (``Authorization: Bearer KEY``: ``key:`` and 16 hex digits of its
digest; the key itself never leaves the gateway), else none (the gateway's own share). The
gateway authenticates nobody: a tenant is what the client (or the proxy in front) says.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from disagg.protocol import MAX_TENANT

KEY_PREFIX = "key:"
HEADER_PREFIX = "hdr:"  # a header value too long to pass on as it is: its digest


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"disagg.tenant").hexdigest()


def http_tenant(headers: Mapping[str, str], header: str = "") -> str | None:
    """The tenant of a request with ``headers`` (case-insensitive, as aiohttp's), ``header``
    the operator's (empty: API keys only)."""
    if header:
        value = headers.get(header, "").strip()
        if value:
            return value if len(value) <= MAX_TENANT else HEADER_PREFIX + _digest(value)
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.strip().partition(" ")
    key = key.strip()
    if scheme.lower() == "bearer" and key:
        return KEY_PREFIX + _digest(key)
    return None
