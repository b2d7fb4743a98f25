"""The host work on a remote prefill request's way from the decoder's scheduler to the
prefiller's executor, by prompt length: what the TTFT breakdown's request trip holds beyond the
sockets (decoder side; for comparison its part as it was while it encoded the ids, before they
went on as the client's frame carried them) and what the prefiller's queue time starts with
(prefill node: the messenger's decode and checks of the request, its PrefillJob to the
scheduler and the scheduler's decode of that; before: the ids decoded and checked by the
messenger, encoded again into the job and decoded again by the scheduler; now: left encoded
by the messenger and decoded once, checked, by the scheduler). Each message is encoded and
decoded as the actors do; no sockets.

    python bench/request_hop.py [--lengths 1024,4096,16384,32768]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from disagg.protocol.inproc import PrefillJob, SendPrefill, ToScheduler, drop_last_id
from disagg.protocol.peer import (
    KVLayoutDesc,
    PeerRequestIn,
    PrefillRequest,
    PrefillRequestOut,
)
from disagg.remote.requests import PromptIds, request_problem
from disagg.serving.routing import encoded_prefix_keys, prefix_keys

LAYOUT = KVLayoutDesc(num_layers=36, num_pages=40000, num_kv_heads=8, page_size=16,
                      head_dim=128, dtype="bfloat16", element_size=2, hidden_size=4096)
VOCAB = 151936


class ListJob(msgspec.Struct, tag="job", array_like=True, frozen=True):
    """PrefillJob until 2026-12-07: the ids as a list, encoded by the messenger."""

    job: int
    prompt_ids: list[int]
    cache_salt: str | None = None


def checked_request(vocab_size: int) -> Any:
    """The prefiller's decode until 2026-12-07: the request with its ids decoded and checked."""
    ids = list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]
    return msgspec.defstruct("PrefillRequestInVocab", [("prompt_ids", ids)],
                             bases=(PrefillRequest,), tag="prefill", frozen=True,
                             forbid_unknown_fields=True)


def ms(fn: Callable[[], object], reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def prefill_node(n: int, ids: list[int], raw_before: bytes, raw_now: bytes) -> list[float]:
    """The prefill node's part, before and now (ms): decode + checks, the job's encode, the
    scheduler's decode(s), the total of each."""
    enc = msgspec.msgpack.Encoder()
    before_dec = msgspec.msgpack.Decoder(checked_request(VOCAB))
    job_dec = msgspec.msgpack.Decoder(ListJob)
    now_dec = msgspec.msgpack.Decoder(PeerRequestIn)
    sched_dec = msgspec.msgpack.Decoder(ToScheduler)
    prompt_ids = PromptIds(VOCAB)
    req_b, req_n = before_dec.decode(raw_before), now_dec.decode(raw_now)
    assert request_problem(LAYOUT, VOCAB, req_n, ids_in_vocab=True) is None
    job_b = enc.encode(ListJob(1, req_b.prompt_ids))
    job_n = enc.encode(PrefillJob(1, req_n.prompt_msgpack()))
    assert prompt_ids.decode(sched_dec.decode(job_n).prompt) == ids == job_dec.decode(
        job_b).prompt_ids
    out = [
        ms(lambda: request_problem(LAYOUT, VOCAB, before_dec.decode(raw_before),
                                   ids_in_vocab=True)),
        ms(lambda: enc.encode(ListJob(1, req_b.prompt_ids))),
        ms(lambda: job_dec.decode(job_b)),
        ms(lambda: request_problem(LAYOUT, VOCAB, now_dec.decode(raw_now), ids_in_vocab=True)),
        ms(lambda: enc.encode(PrefillJob(1, req_n.prompt_msgpack()))),
        ms(lambda: prompt_ids.decode(sched_dec.decode(job_n).prompt)),
    ]
    return out[:3] + [sum(out[:3])] + out[3:] + [sum(out[3:])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    args = ap.parse_args()
    enc = msgspec.msgpack.Encoder()
    send_dec = msgspec.msgpack.Decoder(SendPrefill)
    decoder, prefiller = [], []
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = [random.randrange(VOCAB) for _ in range(n)]
        framed = memoryview(enc.encode(prompt))  # as the frontend handed it over (FromClient)
        ids = prompt[:-1]
        pages = list(range(-(-(n - 1) // LAYOUT.page_size)))
        common = dict(request_id="r", key=1, dst_pages=pages, dst_layout=LAYOUT,
                      dst_kv=b"x" * 64, dst_ctx=b"x" * 64, ctx_offset=0, timeout_s=60.0,
                      deadline_unix=time.time() + 60)

        def encoded_here() -> None:  # until 2026-12-02
            enc.encode(ids)  # noqa: B023
            prefix_keys(ids, None)  # noqa: B023

        def client_bytes() -> None:
            out = drop_last_id(framed, n, prompt[-1])  # noqa: B023
            assert out is not None
            encoded_prefix_keys(out)

        body = drop_last_id(framed, n, prompt[-1])
        assert body is not None and body == enc.encode(ids)
        sent = SendPrefill("r", 1, memoryview(body), n - 1, encoded_prefix_keys(body), pages, 60.0)
        msg = send_dec.decode(enc.encode(sent))
        hop = ms(lambda: send_dec.decode(enc.encode(sent)))  # noqa: B023
        out = ms(lambda: enc.encode(PrefillRequestOut(prompt_ids=msg.prompt, **common)))  # noqa: B023
        raw_before = enc.encode(PrefillRequest(prompt_ids=ids, **common))  # an inline array
        raw_now = enc.encode(PrefillRequestOut(prompt_ids=msg.prompt, **common))  # a bin
        decoder.append(f"| {n} | {len(raw_now) >> 10} KiB | {ms(encoded_here):.2f} | "
                       f"{ms(client_bytes):.2f} | {hop:.2f} | {out:.2f} |")
        p = prefill_node(n, ids, raw_before, raw_now)
        prefiller.append(f"| {n} | " + " | ".join(f"{x:.2f}" for x in p) + " |")
    print("| tokens | request size | decoder before: ids encoded, keys from the ids | decoder "
          "now: the client's bytes less the last id, keys from the bytes | SendPrefill encode "
          "+ decode (the hop to the messenger) | PrefillRequest encode (the ids' bytes as they "
          "are, a bin) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(decoder))
    print()
    print("| tokens | before: messenger's decode, ids checked, + checks | PrefillJob encode (the "
          "ids' list) | scheduler's decode | **total** | now: messenger's decode, ids left "
          "encoded, + checks | PrefillJob encode (the ids' bytes) | scheduler's decode + the "
          "ids' checked decode | **total** |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(prefiller))


if __name__ == "__main__":
    main()
