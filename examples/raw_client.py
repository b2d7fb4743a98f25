"""A client of the disagg client protocol with only pyzmq and msgspec: no disagg import.

Proof that the protocol documented in the README is complete. Usage:

    python examples/raw_client.py --connect tcp://127.0.0.1:5555 --prompt-token-ids 1,2,3
    python examples/raw_client.py --connect tcp://127.0.0.1:5555 --prompt "Hello"

Prints one JSON object: the streamed token ids, the text, the finish reason and usage, and the
node's stats before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

import msgspec
import zmq


def request(sock: zmq.Socket, msg: dict, timeout_s: float) -> dict:
    sock.send(msgspec.msgpack.encode(msg))
    return receive(sock, timeout_s)


def receive(sock: zmq.Socket, timeout_s: float) -> dict:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no reply within {timeout_s}s")
    reply = msgspec.msgpack.decode(sock.recv())
    if not isinstance(reply, dict) or "type" not in reply:
        raise ValueError(f"not a protocol message: {reply!r}")
    return reply


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connect", required=True)
    ap.add_argument("--prompt")
    ap.add_argument("--prompt-token-ids")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.connect)
    before = request(sock, {"type": "stats"}, args.timeout)

    rid = uuid.uuid4().hex
    gen: dict = {"type": "generate", "request_id": rid,
                 "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0,
                              "ignore_eos": True}}
    if args.prompt_token_ids:
        gen["prompt_token_ids"] = [int(t) for t in args.prompt_token_ids.split(",")]
    else:
        gen["prompt"] = args.prompt or "Hello"
    sock.send(msgspec.msgpack.encode(gen))

    token_ids: list[int] = []
    text = []
    while True:
        msg = receive(sock, args.timeout)
        if msg.get("request_id") != rid:
            continue
        if msg["type"] == "token":
            token_ids += msg["token_ids"]
            text.append(msg["text"])
        elif msg["type"] == "finished":
            break
        elif msg["type"] == "error":
            print(json.dumps({"error": msg}), file=sys.stderr)
            return 1
    after = request(sock, {"type": "stats"}, args.timeout)
    print(json.dumps({"token_ids": token_ids, "text": "".join(text), "finish_reason": msg["reason"],
                      "usage": msg["usage"], "stats_before": before, "stats_after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
