"""The transfer backends by ``--transfer-backend`` name: one line each.

Each line names the module that implements the backend; that module defines
``create(options: BackendOptions)``, which returns an engine satisfying
``disagg.fabric.backend.TransferBackend``. Modules are imported only when their backend is
built, so a host without libfabric (or without CUDA) still builds the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing the package stays light (no asyncio, numpy): see __init__
    from disagg.fabric.backend import TransferBackend

BACKENDS: dict[str, str] = {
    "fabric": "disagg.fabric.striped",  # libfabric: one endpoint, or striped over lanes
    "cuda-ipc": "disagg.fabric.cuda_ipc",  # GPUs of one host
}


def make_backend(name: str = "fabric", provider: str | None = "tcp",
                 **options: Any) -> TransferBackend:
    """Build a transfer engine by name (not started); ``options``: the fields of
    ``BackendOptions`` (a wrong one raises ``TypeError``)."""
    module = BACKENDS.get(name)
    if module is None:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
    from disagg.fabric.backend import BackendOptions

    create = importlib.import_module(module).create
    engine: TransferBackend = create(BackendOptions(provider=provider, **options))
    return engine
