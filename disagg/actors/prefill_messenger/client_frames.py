"""What a prefill node answers a client pointed at it (pure): its peer socket serves decoders,
and a client's ``ping`` gets a ``Pong``, its ``generate`` or ``abort`` ``bad_request`` naming
the node's role, instead of silence."""

from __future__ import annotations

import msgspec

from disagg.protocol import Error
from disagg.protocol import Ping as ClientPing
from disagg.protocol import Pong as ClientPong

NOT_SERVED = "this is a prefill node: send requests to a decode or mixed node"


class _ClientGenerate(msgspec.Struct, tag="generate"):
    """A client's ``generate`` (any fields: only its id is read, to name it in the refusal)."""

    request_id: str | None = None


class _ClientAbort(msgspec.Struct, tag="abort"):
    request_id: str | None = None


def client_reply(frame: bytes) -> Error | ClientPong | None:
    """The answer to a client-protocol frame that is no peer message (a client pointed at this
    node: ``stats`` is the peers' own and served as theirs): a ``Pong`` to a client's ``ping``,
    ``bad_request`` naming this node's role to a ``generate`` (its id) or an ``abort``; None
    for anything else (garbage, logged as a bad frame)."""
    try:
        msg = _client_dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if isinstance(msg, ClientPing):
        return ClientPong()
    if isinstance(msg, _ClientGenerate):
        return Error("bad_request", NOT_SERVED, msg.request_id)
    return Error("bad_request", f"abort of {msg.request_id!r} not taken: {NOT_SERVED}")


_client_dec = msgspec.msgpack.Decoder(_ClientGenerate | _ClientAbort | ClientPing)
