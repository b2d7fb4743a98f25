"""The host work on a remote prefill request's way from the decoder's scheduler to the
prefiller's queue, by prompt length (and, for comparison, the decoder's part as it was before
the prompt ids went through encoded once): what the TTFT breakdown's exposed transfer holds beyond
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
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest, PrefillRequestOut
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
    print("| tokens | request size | decoder: SendPrefill (ids encoded once, keys) encode + "
          "decode | PrefillRequest encode (the ids' bytes as they are) | decoder total "
          "| before: the ids as a list through both | prefiller: decode | checks "
          "| prefiller total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = [random.randrange(VOCAB) for _ in range(n - 1)]
        pages = list(range(-(-(n - 1) // LAYOUT.page_size)))
        common = dict(request_id="r", key=1, dst_pages=pages, dst_layout=LAYOUT,
                      dst_kv=b"x" * 64, dst_ctx=b"x" * 64, ctx_offset=0, timeout_s=60.0,
                      deadline_unix=time.time() + 60)

        def decoder() -> None:
            # the scheduler: the prompt but its last token, encoded once, and routing keys
            sent = SendPrefill.of("r", 1, ids, pages, 60.0,  # noqa: B023
                                  route_keys=prefix_keys(ids, None))  # noqa: B023
            msg = send_dec.decode(enc.encode(sent))  # the hop to the messenger
            enc.encode(PrefillRequestOut(prompt_ids=msgspec.Raw(msg.prompt), **common))  # noqa: B023

        def before() -> None:  # the ids decoded and encoded again at each hop
            hop = send_dec.decode(enc.encode(SendPrefill.of("r", 1, ids, pages, 60.0)))  # noqa: B023
            listed = hop.prompt_ids()
            prefix_keys(listed, None)
            enc.encode(PrefillRequest(prompt_ids=listed, **common))  # noqa: B023

        sent = SendPrefill.of("r", 1, ids, pages, 60.0, route_keys=prefix_keys(ids, None))
        msg = send_dec.decode(enc.encode(sent))
        hop = ms(lambda: send_dec.decode(enc.encode(  # noqa: B023
            SendPrefill.of("r", 1, ids, pages, 60.0, route_keys=prefix_keys(ids, None)))))  # noqa: B023
        out = ms(lambda: enc.encode(PrefillRequestOut(prompt_ids=msgspec.Raw(msg.prompt), **common)))  # noqa: B023
        total, old = ms(decoder), ms(before)
        req = PrefillRequest(prompt_ids=ids, **common)
        raw = enc.encode(req)
        dec = ms(lambda: req_dec.decode(raw))  # noqa: B023
        chk = ms(lambda: request_problem(LAYOUT, VOCAB, req))  # noqa: B023
        print(f"| {n} | {len(raw) >> 10} KiB | {hop:.2f} | {out:.2f} | {total:.2f} | {old:.2f} "
              f"| {dec:.2f} | {chk:.2f} | {dec + chk:.2f} |")

if __name__ == "__main__":
    main()
