"""The disk tier's files (``--kv-disk-cache-dir``): one file per page, checksummed.

A page's file lives in ``DIR/<identity>/`` where ``identity`` digests the model's identity
salt (``ModelArch.identity``: the root of every page hash) and the page's shape, so a restart
with the same model and layout reuses what a previous run left and any other one never sees
it. The file is named by the page's chained hash (hex) and holds a header (magic, the
identity, the hash, the payload's length and its blake2b checksum) and the payload (the page,
every layer and rank, as the host tier holds it). A read checks all of it: a truncated,
corrupt or foreign file is a miss (and is removed), never wrong KV. Writes go to a temporary
file renamed into place, so a crash leaves no half file under a page's name.

``DiskStore`` does the file work (called on the tiers' worker thread, never the event loop);
what the tier holds is ``disagg.engine.kv_tiers.TierIndex`` (LRU, bounded by whole files).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"DKVP0001"
HEADER = struct.Struct("<8s32s32sQ32s")  # magic, identity, page hash (padded), length, checksum
SUFFIX = ".kvp"
FULL_RETRY_S = 30.0  # after a full disk, writes are tried again this long after


class DiskError(Exception):
    """A page file that cannot be used (missing, truncated, corrupt, foreign)."""


def identity(model_salt: bytes, page_bytes: int, shape: tuple[int, ...]) -> bytes:
    """The directory key of a model and page layout (32 bytes)."""
    return hashlib.blake2b(model_salt + b"\0" + repr((page_bytes, shape)).encode(),
                           digest_size=32, person=b"disagg.kv.disk").digest()


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskStore:
    """Page files of one identity under ``root``; ``page_bytes``: each file's payload."""

    def __init__(self, root: str | Path, ident: bytes, page_bytes: int):
        self.dir = Path(root) / ident.hex()[:32]
        self.ident = ident
        self.page_bytes = page_bytes
        self.file_bytes = HEADER.size + page_bytes
        self._full_until = 0.0  # monotonic: writes refused until then (the disk was full)

    def open(self) -> None:
        """Create the directory and prove it writable (OSError, with the path, if not)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".probe"
        probe.write_bytes(b"x")
        probe.unlink()

    def path(self, h: bytes) -> Path:
        return self.dir / (h.hex() + SUFFIX)

    def existing(self) -> list[bytes]:
        """Hashes of the page files a previous run left with the right size, oldest first
        (anything else here is removed: temporaries, wrong sizes)."""
        found: list[tuple[float, bytes]] = []
        for p in self.dir.iterdir():
            try:
                st = p.stat()
                if p.suffix == SUFFIX and st.st_size == self.file_bytes:
                    found.append((st.st_mtime, bytes.fromhex(p.stem)))
                    continue
                p.unlink()
            except (OSError, ValueError):
                continue
        return [h for _, h in sorted(found)]

    def write(self, h: bytes, payload: bytes | memoryview) -> bool:
        """Write ``h``'s page; False (logged) when the disk is full or failing: the tier
        keeps serving from the tiers above, and tries again after ``FULL_RETRY_S``."""
        now = time.monotonic()
        if now < self._full_until:
            return False
        header = HEADER.pack(MAGIC, self.ident, h.ljust(32, b"\0"), len(payload),
                             checksum(payload))
        tmp = self.dir / f".{h.hex()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(h))
            return True
        except OSError as e:
            self._full_until = now + FULL_RETRY_S
            why = "full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "failing"
            log.warning("disk KV tier %s is %s (%s): no page goes there for %.0f s; the host "
                        "and device tiers serve on", self.dir, why, e, FULL_RETRY_S)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False

    def read(self, h: bytes) -> bytes:
        """``h``'s payload, checked (``DiskError`` otherwise; the bad file is removed)."""
        p = self.path(h)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise DiskError(f"{p}: {e}") from e
        try:
            if len(data) != self.file_bytes:
                raise DiskError(f"{p}: {len(data)} bytes, not {self.file_bytes}")
            magic, ident, got, length, digest = HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER.size:]
            if (magic != MAGIC or ident != self.ident or got != h.ljust(32, b"\0")
                    or length != self.page_bytes or checksum(payload) != digest):
                raise DiskError(f"{p}: header or checksum does not match")
            return bytes(payload)
        except (DiskError, struct.error) as e:
            log.warning("disk KV tier: %s; a miss, the file is removed", e)
            self.remove(h)
            raise DiskError(str(e)) from e

    def remove(self, h: bytes) -> None:
        try:
            self.path(h).unlink()
        except OSError:
            pass
