"""One logging setup for every process, tagged with role and rank."""

from __future__ import annotations

import logging
import sys

from disagg.config import env


def setup_logging(role: str, rank: int | None = None, level: str | None = None) -> None:
    tag = role if rank is None else f"{role}:{rank}"
    lvl = (level or env("LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
