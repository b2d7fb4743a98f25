"""Grammar masks on the device: the rows of a step whose chunk carries ``SeqChunk.allowed``
(the packed bitmask its request's grammar admits next, ``disagg.engine.grammar``) get every
other token's logit set to -inf before any token is picked, batched over those rows and
without waiting for the device. Plain torch (no xgrammar in the executor)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from disagg.protocol.executor import SeqChunk

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``host`` on ``dev`` without the host waiting for the device: a CUDA copy goes through
    pinned memory (a ~1 MB copy from pageable memory waits for the work queued before it,
    which for a step's late masks is its forward pass)."""
    if dev.type != "cuda":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def masked_rows(chunks: Sequence[SeqChunk]) -> list[int]:
    """The rows (chunk indices) that carry a grammar mask."""
    return [i for i, c in enumerate(chunks) if c.allowed]


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``words [R, W]`` int32 bitmasks (token t: bit t % 32 of word t // 32) -> ``[R, vocab]``
    bool, True where admitted (bits past ``W * 32`` are not admitted)."""
    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(32, dtype=torch.int32,
                                                      device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=torch.bool,
                      device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_masks(logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> bool:
    """Mask (in place, to -inf) what each row's grammar does not admit, for the rows of float32
    ``logits [N, V]`` whose chunk carries a mask; True when some row did. Raises ValueError for
    a mask of the wrong size (it crossed a process boundary)."""
    rows = masked_rows(chunks)
    if not rows:
        return False
    vocab = logits.shape[-1]
    width = -(-vocab // 32)
    for i in rows:
        if len(chunks[i].allowed) != 4 * width:
            raise ValueError(f"slot {chunks[i].slot}: a grammar mask of "
                             f"{len(chunks[i].allowed)} bytes, expected {4 * width}")
    dev = logits.device
    # a pageable copy: measured faster here than staging through pinned buffers (docs/NOTES.md);
    # joined into a bytearray, writable, so torch takes it without another copy
    host = np.frombuffer(bytearray().join(chunks[i].allowed for i in rows),
                         dtype="<i4").reshape(len(rows), width)
    words = torch.from_numpy(host).to(dev, non_blocking=True)
    keep = unpack(words, vocab)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~keep, float("-inf"))
        return True
    idx = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    sub = logits.index_select(0, idx).masked_fill_(~keep, float("-inf"))
    logits.index_copy_(0, idx, sub)
    return True
