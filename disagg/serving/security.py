"""ZeroMQ CURVE authentication and encryption for client and node-to-node sockets.

Keys are split by role (``disagg-node keygen DIR`` writes them; ``LAYOUT`` says what goes
where): every node holds the cluster's server keypair, the node keypair and the authorised
public keys (``DIR/node/``); a client holds only the server's public key and its own keypair
(``DIR/client/``). A client therefore cannot act as a node: it cannot serve as one (no server
secret, so a connecting node or client refuses the handshake) and cannot reach a prefiller's
peer socket, which admits node keys only (ZAP domain ``node``; client-protocol sockets use
``client``, which admits client and node keys). Secret key files readable by other users are
refused (as OpenSSH does): whoever reads the server secret can pass for every node.

Sockets are secured through their context: ``install(ctx, keys)`` once, then ``server(sock)``
or ``client(sock)`` where a socket is created; both do nothing on a context without keys.
Executor sockets are ``ipc://`` in a private (0700) directory and are not affected.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth

from disagg.config import env

log = logging.getLogger(__name__)

LAYOUT = """\
Key layout (files 0600, directories 0700):
  DIR/node/                 copy to every node: disagg-node --curve-keys DIR/node
    server.key_secret         the cluster's server keypair (every listening socket)
    server.key                its public half
    node.key_secret           the node keypair (decoders -> prefillers, router -> decoders)
    clients/*.key             client public keys admitted on client-protocol sockets
    nodes/*.key               node public keys, admitted everywhere (the only ones a
                              prefill node's peer socket admits)
  DIR/client/               give to a client: disagg-client --curve-keys DIR/client
    server.key                the server's public key (no secret: it cannot act as a node)
    client.key_secret         this client's keypair
    client.key                its public half
  DIR/client-NAME/          more clients: disagg-node keygen DIR --add-client NAME
Nodes re-read clients/ and nodes/ when a file is added or removed there: to authorise a
client on a running cluster copy its DIR/node/clients/*.key to every node; to revoke it,
delete that file (connections already open stay until they reconnect).
"""

SECRET_MODE = 0o600
DIR_MODE = 0o700
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEYS: dict[int, tuple[CurveKeys, Any]] = {}  # id(context) -> (keys, authenticator or None)


class KeyFileError(ValueError):
    """A key directory or file is missing, malformed or not private; the message names it."""


@dataclass(frozen=True)
class CurveKeys:
    """One holder's keys: a node's (``server_secret`` set) or a client's."""

    directory: Path
    server_public: bytes
    public: bytes  # this holder's own keypair: the node key or a client key
    secret: bytes
    server_secret: bytes | None = None

    @property
    def is_node(self) -> bool:
        return self.server_secret is not None

    @property
    def clients(self) -> Path:
        return self.directory / "clients"

    @property
    def nodes(self) -> Path:
        return self.directory / "nodes"


# ---------------------------------------------------------------------------- making keys


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    path.chmod(DIR_MODE)
    return path


def _keypair(directory: Path, name: str) -> Path:
    """``name.key`` (public) and ``name.key_secret`` in ``directory``, both 0600."""
    public, secret = zmq.auth.create_certificates(str(directory), name)
    for f in (public, secret):
        os.chmod(f, SECRET_MODE)
    return Path(public)


def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    dst.chmod(SECRET_MODE)


def keygen(directory: str | Path) -> Path:
    """Create a cluster key set (``LAYOUT``) with one client, ``DIR/client``; refuses to
    overwrite one. Returns the directory."""
    d = Path(directory)
    if (d / "node").exists():
        raise FileExistsError(f"{d} already holds keys; remove them first to make new ones")
    if not d.exists():
        _private_dir(d)
    node = _private_dir(d / "node")
    _keypair(node, "server")
    _copy(_keypair(node, "node"), _private_dir(node / "nodes") / "node.key")
    _private_dir(node / "clients")
    add_client(d, None)
    (d / "README.txt").write_text(LAYOUT)
    (d / "README.txt").chmod(SECRET_MODE)
    return d


def client_dir_name(name: str | None) -> str:
    """``client`` for the first client, ``client-NAME`` for the ones added later."""
    if name is None:
        return "client"
    if not _NAME.fullmatch(name):
        raise ValueError(f"client name {name!r}: use letters, digits, '_', '.', '-' (max 64)")
    return f"client-{name}"


def add_client(directory: str | Path, name: str | None) -> Path:
    """Mint a client keypair in ``DIR/client-NAME/`` (with the server's public key) and
    authorise it in ``DIR/node/clients/``. Returns the client directory."""
    d = Path(directory)
    node = d / "node"
    if not (node / "server.key").is_file():
        raise KeyFileError(f"{node / 'server.key'} not found: make the key set first with "
                           f"`disagg-node keygen {d}`")
    label = client_dir_name(name)
    out = d / label
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    _private_dir(out)
    _copy(node / "server.key", out / "server.key")
    _copy(_keypair(out, "client"), _private_dir(node / "clients") / f"{label}.key")
    return out


# ---------------------------------------------------------------------------- loading keys


def _check_private(path: Path) -> None:
    """Refuse a secret file other users can read or write: a warning in a log is easily
    missed, while the leaked key lets them pass for this holder; the fix is one chmod."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(f"{path} is accessible by other users (mode {mode:04o}); "
                           f"run `chmod 600 {path}`")


def _check_not_shared_writable(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o022:
        raise KeyFileError(f"{path} is writable by other users (mode {mode:04o}), who could "
                           f"authorise their own keys; run `chmod 700 {path}`")


def _load(path: Path, secret: bool, hint: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"{path} not found; {hint}")
    if secret:
        _check_private(path)
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: {e}") from None
    if secret and not sec:
        raise KeyFileError(f"{path} holds no secret key")
    return public, sec


def load_node(directory: str | Path) -> CurveKeys:
    """A node's keys (``DIR/node``): server and node keypairs, the authorised key folders."""
    d = Path(directory)
    if (d / "authorized").is_dir() and not (d / "node.key_secret").exists():
        raise KeyFileError(f"{d} is the old single-directory layout, which gave clients the "
                           f"server's secret; make a new key set with `disagg-node keygen NEWDIR`")
    hint = "nodes take the node/ directory that `disagg-node keygen DIR` writes (DIR/node)"
    if (d / "client.key_secret").exists() and not (d / "server.key_secret").exists():
        hint = f"{d} is a client's key set; " + hint
    spub, ssec = _load(d / "server.key_secret", True, hint)
    npub, nsec = _load(d / "node.key_secret", True, hint)
    for sub in ("clients", "nodes"):
        if not (d / sub).is_dir():
            raise KeyFileError(f"{d / sub}/ not found; {hint}")
        _check_not_shared_writable(d / sub)
    assert ssec is not None and nsec is not None
    return CurveKeys(d, spub, npub, nsec, ssec)


def load_client(directory: str | Path) -> CurveKeys:
    """A client's keys (``DIR/client``): the server's public key and the client keypair. A
    node's directory also works (its node keypair): in-process clients of a node use it."""
    d = Path(directory)
    if (d / "node.key_secret").exists() and not (d / "client.key_secret").exists():
        return load_node(d)
    hint = "clients take a client/ directory that `disagg-node keygen DIR` writes (DIR/client)"
    if (d / "client").is_dir():
        hint = f"did you mean {d / 'client'}?"
    spub, _ = _load(d / "server.key", False, hint)
    cpub, csec = _load(d / "client.key_secret", True, hint)
    assert csec is not None
    return CurveKeys(d, spub, cpub, csec)


def load(directory: str | Path) -> CurveKeys:
    """A node's keys if ``directory`` holds the server secret, else a client's."""
    d = Path(directory)
    return load_node(d) if (d / "server.key_secret").exists() else load_client(d)


def keys_from_env() -> CurveKeys | None:
    """The keys in ``$DISAGG_CURVE_KEYS`` (a client's or a node's directory), or None."""
    directory = env("CURVE_KEYS")
    if not directory:
        return None
    try:
        return load(directory)
    except KeyFileError as e:
        raise KeyFileError(f"DISAGG_CURVE_KEYS={directory}: {e}") from None


# ---------------------------------------------------------------------------- handshakes

# a failed ZMTP/CURVE handshake (a missing, wrong or unauthorised key; a plain socket)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_refusal(event: int, value: int) -> str | None:
    """What a connecting socket's monitor ``event`` (with its ``value``) tells its user: the
    reason a handshake failed, or None for any other event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"not authorised: the node refused this client's CURVE key (ZAP status {value}); "
                "a node admits the keys in its DIR/node/clients/ (`disagg-node keygen DIR "
                "--add-client NAME`)")
    if event & HANDSHAKE_FAILED:
        return ("the CURVE handshake with the node failed: the client has no keys, or the "
                "wrong server key (--curve-keys DIR/client, $DISAGG_CURVE_KEYS), or the node "
                "runs without --curve-keys while the client has keys")
    return None


class RefusalLog:
    """Warnings of refused handshakes, rate-limited: the first at once, then at most one per
    ``interval`` seconds, counting the refusals it did not log. Time is passed in."""

    def __init__(self, interval: float = 10.0, logger: logging.Logger = log):
        self.interval = interval
        self.logger = logger
        self.total = 0
        self._last: float | None = None
        self._unlogged = 0

    def note(self, what: str, now: float | None = None) -> bool:
        """Count one refusal; True when it was logged."""
        now = time.monotonic() if now is None else now
        self.total += 1
        if self._last is not None and now - self._last < self.interval:
            self._unlogged += 1
            return False
        more = f" (and {self._unlogged} more refused since the last warning)" if self._unlogged else ""
        self.logger.warning("refused a handshake: %s%s", what, more)
        self._last, self._unlogged = now, 0
        return True


REFUSALS = RefusalLog()  # this process's refused handshakes (the ZAP handler and monitors)


# ---------------------------------------------------------------------------- sockets


class AuthorizedKeys:
    """ZAP credentials: the public keys in ``directories`` (``*.key``, read with
    ``zmq.auth.load_certificates``), re-read when a file is added to or removed from one."""

    RACY_NS = 2_000_000_000  # a directory changed this recently may change again unseen

    def __init__(self, *directories: Path, refusals: RefusalLog | None = None):
        self.directories = directories
        self.refusals = refusals  # where a refused key is noted (the ZAP handler's)
        self._cache: dict[Path, tuple[int, dict[bytes, bool]]] = {}

    def keys(self, directory: Path) -> dict[bytes, bool]:
        try:
            mtime = directory.stat().st_mtime_ns
        except OSError:
            return {}
        cached = self._cache.get(directory)
        # timestamps are coarse: a change in the same tick as the last read keeps the mtime,
        # so a recently changed directory is always re-read (as git does for its index)
        if cached is None or cached[0] != mtime or time.time_ns() - mtime < self.RACY_NS:
            cached = (mtime, zmq.auth.load_certificates(str(directory)))
            self._cache[directory] = cached
        return cached[1]

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = any(key in self.keys(d) for d in self.directories)
        if not allowed and self.refusals is not None:
            self.refusals.note(f"key {key.decode(errors='replace')} is not authorised for "
                               f"{domain} sockets")
        return allowed


class ClientKeyIds:
    """Which client key sent a frame on a client-protocol socket of ``ctx`` (its ZAP
    ``User-Id``: the z85 public key): the tenant a request is salted by
    (``disagg.serving.salting``). None for a node key (the router, a node's HTTP gateway:
    they salt their own clients' requests) and on a context without a node's keys."""

    def __init__(self, ctx: zmq.Context):
        keys = _KEYS.get(id(ctx), (None, None))[0]
        self.nodes = AuthorizedKeys(keys.nodes) if keys is not None and keys.is_node else None
        self.directory = keys.nodes if keys is not None else None

    @property
    def active(self) -> bool:
        """CURVE authenticates this context's clients."""
        return self.nodes is not None

    def tenant(self, frame: zmq.Frame) -> str | None:
        if self.nodes is None or self.directory is None:
            return None
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:  # not a CURVE connection
            return None
        if not isinstance(user, str) or not user:
            return None
        return None if user.encode() in self.nodes.keys(self.directory) else user


def install(ctx: zmq.Context, keys: CurveKeys | None) -> None:
    """Secure every socket later passed to ``server``/``client`` on this context. With a node's
    keys, start the ZAP authenticator: domain ``client`` admits client and node keys, domain
    ``node`` node keys only."""
    if keys is None or id(ctx) in _KEYS:
        return
    auth: Any = None
    if keys.is_node:
        if isinstance(ctx, zmq.asyncio.Context):
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(ctx)
        else:
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(
            "client", AuthorizedKeys(keys.clients, keys.nodes, refusals=REFUSALS))
        auth.configure_curve_callback("node", AuthorizedKeys(keys.nodes, refusals=REFUSALS))
    _KEYS[id(ctx)] = (keys, auth)


def uninstall(ctx: zmq.Context) -> None:
    entry = _KEYS.pop(id(ctx), None)
    if entry is not None and entry[1] is not None:
        entry[1].stop()


def _keys(sock: zmq.Socket) -> CurveKeys | None:
    entry = _KEYS.get(id(sock.context))
    return None if entry is None else entry[0]


def server(sock: zmq.Socket, nodes_only: bool = False) -> None:
    """A listening socket (before bind): CURVE server with the cluster server key, admitting
    authorised clients and nodes, or with ``nodes_only`` (a prefiller's peer socket) nodes."""
    keys = _keys(sock)
    if keys is None:
        return
    if keys.server_secret is None:
        raise KeyFileError(f"{keys.directory} is a client's key set: it cannot serve")
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = b"node" if nodes_only else b"client"


def client(sock: zmq.Socket, keys: CurveKeys | None = None) -> None:
    """A connecting socket (before connect): CURVE client with the holder's own keypair, that
    completes the handshake only with a holder of the cluster's server secret. ``keys``
    overrides the context's (clients need no authenticator of their own)."""
    keys = keys or _keys(sock)
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server_public
