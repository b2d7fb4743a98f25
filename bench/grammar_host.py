"""Host costs of a decode step's grammar masks at batch 64 (the late-mask path of overlapped
decoding): matchers advanced (one by one / xgrammar's batch), masks filled (one by one /
batch), the Masks message encoded and decoded, and on a CUDA device the masks applied
(staged through pinned memory) while the device is busy with queued work, so that a copy
which waits for the device shows.

    python3 bench/grammar_host.py MODEL_DIR [SCHEMA.json]   (MODEL_DIR: tokenizer.json)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from disagg.engine.constraints import apply_masks
from disagg.engine.grammar import Grammars, fill_masks
from disagg.model.tokenizer import Tokenizer
from disagg.protocol.executor import Masks, SeqChunk
from disagg.protocol.structured import StructuredOutput

VOCAB, ROWS, STEPS = 151936, 64, 60


def ms(samples: list[float]) -> str:
    return f"{1e3 * statistics.median(samples):.3f} ms"


def main() -> None:
    tok = Tokenizer.from_dir(Path(sys.argv[1]))
    schema = Path(sys.argv[2] if len(sys.argv) > 2 else "bench/data/surface_schema.json")
    g = Grammars(tok, VOCAB, (2,))
    so = StructuredOutput("json", schema.read_text())
    states = [g.compile(so) for _ in range(ROWS)]
    rng = random.Random(0)
    t_fill, t_one, t_acc, t_enc, t_dec = [], [], [], [], []
    masks: list[bytes] = []
    for _ in range(STEPS):
        t = time.perf_counter()
        masks = fill_masks(states)
        t_fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        one = [s.mask() for s in states[:8]]
        t_one.append((time.perf_counter() - t) * ROWS / 8)
        assert one == masks[:8]
        msg = Masks(1, dict(enumerate(masks)))
        t = time.perf_counter()
        wire = msgspec.msgpack.encode(msg)
        t_enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        msgspec.msgpack.decode(wire, type=Masks)
        t_dec.append(time.perf_counter() - t)
        picks = []
        for m in masks:
            w = np.frombuffer(m, dtype="<u4")
            word = int(rng.choice(np.flatnonzero(w)))
            bits = [b for b in range(32) if int(w[word]) >> b & 1]
            picks.append(word * 32 + rng.choice(bits))
        t = time.perf_counter()
        for s, p in zip(states, picks, strict=True):
            s.accept(p)
        t_acc.append(time.perf_counter() - t)
    print(f"{ROWS} rows, vocab {VOCAB}: fill batch {ms(t_fill)}, fill one by one {ms(t_one)}, "
          f"accept {ms(t_acc)}, Masks encode {ms(t_enc)} / decode {ms(t_dec)} "
          f"({len(wire) / 2**20:.2f} MiB)")
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda")
    logits = torch.randn(ROWS, VOCAB, device=dev)
    chunks = [SeqChunk(i, [0], 0, [0], True, allowed=m) for i, m in enumerate(masks)]
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for busy in (False, True):
        host = []
        for _ in range(20):
            if busy:
                for _ in range(20):  # ~10 ms of queued work
                    x @ x
            t = time.perf_counter()
            apply_masks(logits, chunks)
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        print(f"apply_masks host time, device {'busy' if busy else 'idle'}: {ms(host)}")


if __name__ == "__main__":
    main()
