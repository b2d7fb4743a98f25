"""The host work on a remote prefill request's way from the decoder's scheduler to the
prefiller's queue, by prompt length: what the TTFT breakdown's exposed transfer holds beyond
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

from disagg.protocol.inproc import SendPrefill
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest
from disagg.remote.requests import request_problem
from disagg.serving.routing import prefix_keys

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
    print("| tokens | request size | decoder: SendPrefill encode + decode | prefix keys "
          "| PrefillRequest encode | decoder total | prefiller: decode | checks | prefiller total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = [random.randrange(VOCAB) for _ in range(n - 1)]
        pages = list(range(-(-(n - 1) // LAYOUT.page_size)))
        send = SendPrefill("r", 1, ids, pages, 60.0)
        req = PrefillRequest(request_id="r", key=1, prompt_ids=ids, dst_pages=pages,
                             dst_layout=LAYOUT, dst_kv=b"x" * 64, dst_ctx=b"x" * 64,
                             ctx_offset=0, timeout_s=60.0, deadline_unix=time.time() + 60)
        raw = enc.encode(req)
        hop = ms(lambda: send_dec.decode(enc.encode(send)))  # noqa: B023
        keys = ms(lambda: prefix_keys(ids, None))  # noqa: B023
        out = ms(lambda: enc.encode(req))  # noqa: B023
        dec = ms(lambda: req_dec.decode(raw))  # noqa: B023
        chk = ms(lambda: request_problem(LAYOUT, VOCAB, req))  # noqa: B023
        print(f"| {n} | {len(raw) >> 10} KiB | {hop:.2f} | {keys:.2f} | {out:.2f} | "
              f"{hop + keys + out:.2f} | {dec:.2f} | {chk:.2f} | {dec + chk:.2f} |")


if __name__ == "__main__":
    main()
