"""ZeroMQ CURVE authentication and encryption for client and node-to-node sockets.

``disagg-node keygen DIR`` writes one cluster key set: the server keypair (``server.key``,
``server.key_secret``) that every listening socket uses, and a client keypair
(``client.key``, ``client.key_secret``) that every connecting socket uses; the client's public
certificate is copied into ``DIR/authorized/``, the only keys a listening socket accepts. With
``--curve-keys DIR`` (or ``DISAGG_CURVE_KEYS=DIR`` for clients), every client-protocol and
node-to-node socket is authenticated and encrypted; a peer without the keys cannot complete the
handshake, so it can submit neither requests nor PrefillRequests. Executor sockets are
``ipc://`` in a private (0700) directory and are not affected.

Sockets are secured through their context: ``install(ctx, keys)`` once, then ``server(sock)``
or ``client(sock)`` where a socket is created; both do nothing on a context without keys.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth

from disagg.config import env

_KEYS: dict[int, tuple[CurveKeys, Any]] = {}  # id(context) -> (keys, authenticator)


@dataclass(frozen=True)
class CurveKeys:
    directory: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def authorized(self) -> Path:
        return self.directory / "authorized"


def keygen(directory: str | Path) -> CurveKeys:
    """Create a cluster key set in ``directory`` (refuses to overwrite one)."""
    d = Path(directory)
    if (d / "server.key_secret").exists():
        raise FileExistsError(f"{d} already holds keys; remove them first to make new ones")
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "client")
    (d / "authorized").mkdir(exist_ok=True)
    shutil.copy(d / "client.key", d / "authorized" / "client.key")
    return load(d)


def load(directory: str | Path) -> CurveKeys:
    d = Path(directory)
    try:
        spub, ssec = zmq.auth.load_certificate(str(d / "server.key_secret"))
        cpub, csec = zmq.auth.load_certificate(str(d / "client.key_secret"))
    except OSError as e:
        raise FileNotFoundError(f"--curve-keys {d}: {e}; create keys with `disagg-node keygen DIR`") from None
    if not (d / "authorized").is_dir():
        raise FileNotFoundError(f"--curve-keys {d}: no authorized/ directory")
    assert ssec is not None and csec is not None
    return CurveKeys(d, spub, ssec, cpub, csec)


def keys_from_env() -> CurveKeys | None:
    directory = env("CURVE_KEYS")
    return load(directory) if directory else None


def install(ctx: zmq.Context, keys: CurveKeys | None) -> None:
    """Secure every socket later passed to ``server``/``client`` on this context; starts the
    ZAP authenticator that admits only the authorized client keys."""
    if keys is None or id(ctx) in _KEYS:
        return
    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth: Any = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized))
    _KEYS[id(ctx)] = (keys, auth)


def uninstall(ctx: zmq.Context) -> None:
    entry = _KEYS.pop(id(ctx), None)
    if entry is not None:
        entry[1].stop()


def _keys(sock: zmq.Socket) -> CurveKeys | None:
    entry = _KEYS.get(id(sock.context))
    return None if entry is None else entry[0]


def server(sock: zmq.Socket) -> None:
    """A listening socket: CURVE server with the cluster server key (before bind)."""
    keys = _keys(sock)
    if keys is not None:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True


def client(sock: zmq.Socket, keys: CurveKeys | None = None) -> None:
    """A connecting socket: CURVE client trusting the cluster server key (before connect).
    ``keys`` overrides the context's (clients need no authenticator of their own)."""
    keys = keys or _keys(sock)
    if keys is not None:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public
