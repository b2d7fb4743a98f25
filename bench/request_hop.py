"""The host work on a remote prefill request's way from the decoder's scheduler to the
prefiller's queue, by prompt length (and, for comparison, the decoder's part as it was while it
encoded the ids, before they went on as the client's frame carried them): what the TTFT breakdown's exposed transfer holds beyond
the transfer itself (decoder side) or what the prefiller's queue time now starts with
(prefiller side). Each message is encoded and decoded as the actors do; no sockets.

    python bench/request_hop.py [--lengths 1024,4096,16384,32768]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from disagg.protocol.inproc import SendPrefill, drop_last_id
from disagg.protocol.peer import (
    KVLayoutDesc,
    PrefillRequest,
    PrefillRequestOut,
    in_vocab_requests,
)
from disagg.remote.requests import request_problem
from disagg.serving.routing import encoded_prefix_keys, prefix_keys

LAYOUT = KVLayoutDesc(num_layers=36, num_pages=40000, num_kv_heads=8, page_size=16,
                      head_dim=128, dtype="bfloat16", element_size=2, hidden_size=4096)
VOCAB = 151936


def ms(fn: Callable[[], object], reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    args = ap.parse_args()
    enc = msgspec.msgpack.Encoder()
    send_dec = msgspec.msgpack.Decoder(SendPrefill)
    req_dec = msgspec.msgpack.Decoder(PrefillRequest)
    print("| tokens | request size | decoder before: ids encoded, keys from the ids | decoder "
          "now: the client's bytes less the last id, keys from the bytes | SendPrefill encode "
          "+ decode (the hop to the messenger) | PrefillRequest encode (the ids' bytes as they "
          "are) | prefiller before: decode | checks | total | prefiller now: decode with the "
          "ids checked against the vocabulary, then the other checks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    checked_dec = msgspec.msgpack.Decoder(in_vocab_requests(VOCAB)[0])
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
        out = ms(lambda: enc.encode(PrefillRequestOut(prompt_ids=msgspec.Raw(msg.prompt), **common)))  # noqa: B023
        req = PrefillRequest(prompt_ids=ids, **common)
        raw = enc.encode(req)
        dec = ms(lambda: req_dec.decode(raw))  # noqa: B023
        chk = ms(lambda: request_problem(LAYOUT, VOCAB, req))  # noqa: B023
        now = ms(lambda: request_problem(LAYOUT, VOCAB, checked_dec.decode(raw),  # noqa: B023
                                         ids_in_vocab=True))
        print(f"| {n} | {len(raw) >> 10} KiB | {ms(encoded_here):.2f} | {ms(client_bytes):.2f} "
              f"| {hop:.2f} | {out:.2f} | {dec:.2f} | {chk:.2f} | {dec + chk:.2f} | {now:.2f} |")


if __name__ == "__main__":
    main()
