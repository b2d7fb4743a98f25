"""Host costs of a decode step's grammar work at batch 64 (the late-mask path of overlapped
decoding), per step over a replayed run (every configuration advances the same matchers by the
same tokens: random tokens each grammar admits, from one seed):

- before (the code before ``GrammarPass``): the 64 tokens accepted one by one, then the 64
  masks filled by xgrammar's batch matcher (half the machine's threads), sent in one msgpack
  ``Masks`` message (a dict of 64 byte strings) encoded and decoded;
- its parts: accept one by one, fill one by one, fill batched;
- ``GrammarPass`` (``disagg.engine.grammar_pass``, the code now) on each ``--threads`` count:
  accept and fill in one pass, each thread a share of the rows, into one buffer sent as a
  frame of its own (the control message is a few bytes);
- on a CUDA device, the masks applied (``apply_masks``) while the device is idle / busy.

    python3 bench/grammar_host.py MODEL_DIR [--schema S.json] [--threads 1,2,4,8,16]
        [--json OUT_DIR]          (MODEL_DIR: a tokenizer.json; OUT_DIR/grammar_host.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch

from disagg.engine.constraints import apply_masks
from disagg.engine.grammar import Grammars, GrammarState
from disagg.engine.grammar_pass import GrammarPass, Row, default_threads
from disagg.model.tokenizer import Tokenizer
from disagg.protocol.executor import SeqChunk
from disagg.protocol.structured import StructuredOutput

VOCAB = 151936  # Qwen3's logits (the masks' width); the tokenizer's ids are fewer


class OldMasks(msgspec.Struct, tag="masks", array_like=True, frozen=True):
    """The ``Masks`` message before: every row a byte string of a dict."""

    step_id: int
    masks: dict[int, bytes]


def median_ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 3)


def trace(states: list[GrammarState], steps: int, seed: int) -> list[list[int]]:
    """``steps`` tokens per row, each admitted by its grammar after the ones before (never a
    stop token, so every row runs the whole trace)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    stop = set(states[0]._matcher.stop_token_ids)
    for _ in range(steps):
        picks = []
        for s in states:
            ids = np.flatnonzero(np.unpackbits(np.frombuffer(s.mask(), dtype=np.uint8),
                                               bitorder="little"))
            ids = [int(i) for i in ids if int(i) not in stop]
            picks.append(rng.choice(ids))
        for s, p in zip(states, picks, strict=True):
            assert s.accept(p)
        out.append(picks)
    return out


def replay(fresh: Callable[[], list[GrammarState]], picks: list[list[int]],
           step: Callable[[list[GrammarState], list[int]], list[bytes]]
           ) -> tuple[list[float], list[bytes]]:
    """Time ``step(states, tokens)`` (accept the tokens, fill the next masks) over the
    trace; returns the samples and the last step's masks."""
    states, times, masks = fresh(), [], []
    for tokens in picks:
        t = time.perf_counter()
        masks = step(states, tokens)
        times.append(time.perf_counter() - t)
    return times, masks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="a directory with tokenizer.json")
    ap.add_argument("--schema", type=Path, default=Path("bench/data/surface_schema.json"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", default=None,
                    help="GrammarPass thread counts, comma-separated (default: 1, 2, 4, ... "
                    "up to the CPUs this process may use, and the default, half of them)")
    ap.add_argument("--json", type=Path, default=None, help="write OUT_DIR/grammar_host.json")
    args = ap.parse_args(argv)
    import xgrammar as xgr

    cpus = len(os.sched_getaffinity(0))
    if args.threads:
        counts = sorted({int(t) for t in args.threads.split(",")})
    else:
        counts = sorted({1 << i for i in range(cpus.bit_length()) if 1 << i <= cpus}
                        | {default_threads(), cpus})
    tok = Tokenizer.from_dir(args.model_dir)
    g = Grammars(tok, VOCAB, (2,))
    so = StructuredOutput("json", args.schema.read_text())
    g.compile(so)  # compiled once (cached): each configuration starts fresh matchers

    def fresh() -> list[GrammarState]:
        return [g.compile(so) for _ in range(args.rows)]

    picks = trace(fresh(), args.steps, seed=0)
    batch = xgr.BatchGrammarMatcher()  # "auto": half the machine's threads
    words = -(-VOCAB // 32)
    buf = xgr.allocate_token_bitmask(args.rows, VOCAB)

    def batch_fill(states: list[GrammarState]) -> list[bytes]:
        batch.batch_fill_next_token_bitmask([s._matcher for s in states], buf)
        host = buf.numpy()
        return [host[i].tobytes() for i in range(len(states))]

    def before(states: list[GrammarState], tokens: list[int]) -> list[bytes]:
        for s, t in zip(states, tokens, strict=True):
            s.accept(t)
        return batch_fill(states)

    def accept_only(states: list[GrammarState], tokens: list[int]) -> list[bytes]:
        for s, t in zip(states, tokens, strict=True):
            s.accept(t)
        return []

    fill_took: list[float] = []

    def fill_one_by_one(states: list[GrammarState], tokens: list[int]) -> list[bytes]:
        accept_only(states, tokens)
        t = time.perf_counter()
        out = [s.mask() for s in states]
        fill_took.append(time.perf_counter() - t)
        return out

    t_before, ref = replay(fresh, picks, before)
    t_accept, _ = replay(fresh, picks, accept_only)
    _, one = replay(fresh, picks, fill_one_by_one)
    assert one == ref
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(OldMasks)
    t_enc, t_dec = [], []
    for _ in range(20):
        t = time.perf_counter()
        wire = enc.encode(OldMasks(1, dict(enumerate(ref))))
        t_enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        dec.decode(wire)
        t_dec.append(time.perf_counter() - t)
    result: dict[str, object] = {
        "host": {"cpus": cpus, "machine": platform.machine(), "python": sys.version.split()[0],
                 "xgrammar": _version("xgrammar"), "default_threads": default_threads()},
        "rows": args.rows, "vocab": VOCAB, "mask_bytes": 4 * words, "steps": args.steps,
        "schema": args.schema.name,
        "before_ms": {"accept_then_batch_fill": median_ms(t_before),
                      "accept_one_by_one": median_ms(t_accept),
                      "fill_one_by_one": median_ms(fill_took),
                      "old_masks_encode": median_ms(t_enc), "old_masks_decode": median_ms(t_dec),
                      "old_masks_mib": round(len(wire) / 2**20, 3)},
        "grammar_pass_ms": {},
    }
    print(f"{args.rows} rows, vocab {VOCAB}, {cpus} CPUs: before: accept + batch fill "
          f"{median_ms(t_before)} ms (accept one by one {median_ms(t_accept)}, fill one by one "
          f"{median_ms(fill_took)}), Masks encode {median_ms(t_enc)} / decode "
          f"{median_ms(t_dec)} ms ({len(wire) / 2**20:.2f} MiB)")
    passes: dict[str, float] = {}
    for n in counts:
        gp = GrammarPass(n)

        def pass_step(states: list[GrammarState], tokens: list[int], gp: GrammarPass = gp
                      ) -> list[bytes]:
            block = gp.run([Row(s, t, i, True) for i, (s, t) in
                            enumerate(zip(states, tokens, strict=True))])
            for s, t in zip(states, tokens, strict=True):
                s.accept(t)  # the update's accept: takes the token accepted ahead
            return [bytes(m) for m in block.by_slot().values()]

        took, masks = replay(fresh, picks, pass_step)
        assert masks == ref, "GrammarPass masks differ from one by one"
        gp.close()
        passes[str(n)] = median_ms(took)
        print(f"GrammarPass, {n} threads: accept + fill {passes[str(n)]} ms")
    result["grammar_pass_ms"] = passes
    if torch.cuda.is_available():
        result["apply_masks_host_ms"] = cuda_apply(ref)
    if args.json is not None:
        args.json.mkdir(parents=True, exist_ok=True)
        (args.json / "grammar_host.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json / 'grammar_host.json'}")


def cuda_apply(masks: list[bytes]) -> dict[str, float]:
    """Host time of ``apply_masks`` for the masks, the device idle and busy (~10 ms queued)."""
    dev = torch.device("cuda")
    logits = torch.randn(len(masks), VOCAB, device=dev)
    chunks = [SeqChunk(i, [0], 0, [0], True, allowed=m) for i, m in enumerate(masks)]
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    out = {}
    for busy in (False, True):
        host = []
        for _ in range(20):
            if busy:
                for _ in range(20):
                    x @ x
            t = time.perf_counter()
            apply_masks(logits, chunks)
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        out["busy" if busy else "idle"] = median_ms(host)
        print(f"apply_masks host time, device {'busy' if busy else 'idle'}: "
              f"{out['busy' if busy else 'idle']} ms")
    return out


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
