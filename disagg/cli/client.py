"""``disagg-client``: stream a completion from a node, or print its Stats.

Exit codes (README, "Running a node"): 0 done; 1 the node answered an error (or refused the
CURVE handshake); 2 a usage error (a bad flag value, unreadable CURVE keys); 3 no reply within
``--timeout``; 4 no node answered the first ``ping`` within ``--connect-timeout`` (``--wait``
when given)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn

import msgspec
import zmq

from disagg.client import Client, HandshakeError, RequestError
from disagg.protocol import Finished, SamplingParams, TokenChunk, TokenLogprobs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg-client", description="Talk to a disagg node.")
    ap.add_argument("--connect", default="tcp://127.0.0.1:5555")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prompt")
    g.add_argument("--prompt-token-ids", help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--logit-bias", default="", metavar="ID:BIAS,...",
                    help="comma-separated token id:bias pairs, bias in [-100, 100]")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="each output token's logprob and K alternatives (0-20; with --json)")
    ap.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                    help="the prompt tokens' logprobs and K alternatives (0-20; with --json)")
    ap.add_argument("--tenant", default=None, metavar="NAME",
                    help="the tenant the request counts under in the node's fair queue and "
                         "--max-requests-per-client (1-256 characters; ignored from a CURVE "
                         "client key, which is its own tenant)")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--stats", action="store_true", help="print the node's Stats as JSON")
    ap.add_argument("--wait", type=float, default=0.0,
                    help="retry for up to this many seconds until the node answers (and "
                         "serves: not restarting); replaces --connect-timeout")
    ap.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                    help="exit 4 when nothing answers the first ping within S seconds")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="the request's per-message deadline (exit 3 past it)")
    ap.add_argument("--curve-keys", default=None, metavar="DIR",
                    help="this client's CURVE keys for nodes started with --curve-keys: "
                         "DIR/client (or DIR/client-NAME) of `disagg-node keygen DIR` "
                         "(default: $DISAGG_CURVE_KEYS)")
    return ap


NO_NODE = 4  # the exit code where nothing answers the first ping


def first_contact(client: Client, seconds: float, serving: bool) -> bool:
    """Ping until the node answers, for up to ``seconds`` (each ping bounded by 2 s: one sent
    before the node was up may be lost). ``serving``: only a ``Pong`` counts (a restarting
    node's ``unavailable`` is retried); else any answer does (the request then gets it).
    False where nothing answered in time; HandshakeError as soon as a handshake fails."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            client.ping(timeout=min(2.0, max(0.05, left)))
            return True
        except RequestError:
            if not serving:
                return True
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            pass


def usage_error(line: str) -> NoReturn:
    print(f"disagg-client: {line}", file=sys.stderr)
    sys.exit(2)


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        usage_error(f"--prompt-token-ids takes comma-separated integer token ids, got {text!r}")


def logit_biases(text: str) -> dict[int, float]:
    try:
        bias = dict(pair.split(":") for pair in text.split(",") if pair.strip())
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        usage_error("--logit-bias takes ID:BIAS pairs, comma-separated")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from disagg.serving.security import KeyFileError, keys_from_env, load_client

    try:
        keys = load_client(args.curve_keys) if args.curve_keys else keys_from_env()
    except KeyFileError as e:
        usage_error(f"CURVE keys: {e}")
    if not args.stats and args.prompt is None and args.prompt_token_ids is None:
        usage_error("give --prompt, --prompt-token-ids or --stats")
    ids = token_ids(args.prompt_token_ids) if args.prompt_token_ids is not None else None
    logit_bias = logit_biases(args.logit_bias)
    if "://" not in args.connect:
        usage_error(f"--connect takes TRANSPORT://ADDRESS (tcp://HOST:PORT, ipc://PATH), "
                    f"got {args.connect!r}")
    try:
        client = Client(args.connect, keys)
    except zmq.ZMQError as e:
        usage_error(f"--connect {args.connect!r}: {e} (give tcp://HOST:PORT or ipc://PATH)")
    try:
        connect_s = args.wait if args.wait > 0 else args.connect_timeout
        if not first_contact(client, connect_s, serving=args.wait > 0):
            print(f"disagg-client: no node answers at {args.connect} within {connect_s:g} s",
                  file=sys.stderr)
            sys.exit(NO_NODE)
        if args.stats:
            print(msgspec.json.encode(client.stats(args.timeout)).decode())
            return
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                  ignore_eos=args.ignore_eos,
                                  presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty,
                                  repetition_penalty=args.repetition_penalty,
                                  logit_bias=logit_bias,
                                  logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
        logprobs: list[TokenLogprobs] = []
        prompt_logprobs: list[TokenLogprobs] = []
        out_ids: list[int] = []
        text: list[str] = []
        start = time.perf_counter()
        first: float | None = None
        reason = ""
        for msg in client.generate(args.prompt, ids, sampling, timeout=args.timeout,
                                   tenant=args.tenant):
            if isinstance(msg, TokenChunk):
                first = first or time.perf_counter()
                out_ids.extend(msg.token_ids)
                text.append(msg.text)
                logprobs += msg.logprobs or []
                prompt_logprobs += msg.prompt_logprobs or []
                if not args.json:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
            elif isinstance(msg, Finished):
                reason = msg.reason
        end = time.perf_counter()
        if args.json:
            ttft = (first - start) if first else None
            out = {"token_ids": out_ids, "text": "".join(text), "finish_reason": reason,
                   "ttft_s": ttft, "total_s": end - start}
            if args.logprobs is not None:  # [token_id, logprob, top_ids, top_logprobs] each
                out["logprobs"] = msgspec.to_builtins(logprobs)
            if args.prompt_logprobs is not None:
                out["prompt_logprobs"] = msgspec.to_builtins(prompt_logprobs)
            print(json.dumps(out))
        else:
            sys.stdout.write("\n")
    except (RequestError, HandshakeError) as e:
        print(f"disagg-client: {e}", file=sys.stderr)
        sys.exit(1)
    except TimeoutError as e:
        print(f"disagg-client: {e}", file=sys.stderr)
        sys.exit(3)
    finally:
        client.close()
