"""``disagg-bench serve``: an open-loop load generator over the client protocol.

Requests are released by an arrival process (Poisson at ``--request-rate``, or all at once)
whatever the state of earlier ones, optionally capped at ``--max-concurrency`` in flight; each
goes to the next ``--connect`` node in turn. Every request has a deadline (``--timeout``);
failures are counted and recorded, never fatal. The report (stdout, ``--json``, ``--plot``)
has TTFT, TPOT, ITL and E2E latency, tokens/s per user, throughputs and goodput; the metric
definitions are in ``disagg.bench.metrics_math``, the workloads in ``disagg.bench.workload``.

TTFT breakdown (decoder queue, prefill queue, prefill compute, exposed transfer tail, first
decode step): each record's ``breakdown`` comes from the ``timings`` a decode node puts in
``Finished`` for requests it had prefilled remotely (see ``disagg.protocol.Finished``); it is
empty for requests prefilled locally, and the summary's ``ttft_breakdown_ms`` then is ``{}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict
from typing import Any

import msgspec
import numpy as np

from disagg.bench.metrics_math import RequestRecord, aggregate, multiturn_summary
from disagg.bench.report import format_report, write_json
from disagg.bench.transport import Done, Transport, TransportError, make_transport
from disagg.bench.workload import (
    Conversation,
    RequestSpec,
    arrival_times,
    copy_workload,
    fixed_workload,
    multiturn_workload,
    random_prompt,
    sharegpt_workload,
)
from disagg.protocol import SamplingParams
from disagg.protocol.structured import StructuredOutput


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--connect", action="append", default=None, metavar="ADDR",
                    help="node address (tcp://host:port); repeat for round-robin over nodes "
                         "(default tcp://127.0.0.1:5555)")
    ap.add_argument("--http", action="append", default=None, metavar="URL",
                    help="drive the OpenAI-compatible HTTP API at URL (http://host:port) "
                         "instead; repeatable, mixes with --connect")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="mean arrival rate in req/s (Poisson); inf sends all at once")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival gaps; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="at most this many requests in flight (default: no cap)")
    ap.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    ap.add_argument("--num-turns", type=int, default=4, help="turns per conversation (multiturn)")
    ap.add_argument("--num-conversations", type=int, default=None,
                    help="conversations (multiturn; default --num-prompts): with --num-turns, "
                         "the KV the run keeps live, e.g. 64 x 8 to outgrow a device cache")
    ap.add_argument("--system-len", type=int, default=256,
                    help="system prompt tokens shared by every conversation (multiturn)")
    ap.add_argument("--user-len", type=int, default=64,
                    help="new user-message tokens per turn (multiturn)")
    ap.add_argument("--workload", choices=["fixed", "sharegpt", "multiturn", "copy"],
                    default="fixed",
                    help="fixed: --input-len/--output-len; sharegpt: synthetic ShareGPT-like "
                         "lognormal lengths clipped to --max-input-len/--max-output-len; copy: "
                         "--input-len tokens of a passage then its start again (a model "
                         "continues by copying: speculative decoding's best case)")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (fixed)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (fixed)")
    ap.add_argument("--max-input-len", type=int, default=4096, help="clip (sharegpt)")
    ap.add_argument("--max-output-len", type=int, default=1024, help="clip (sharegpt)")
    ap.add_argument("--vocab-size", type=int, default=1000,
                    help="prompt token ids are uniform in [10, vocab-size)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    ap.add_argument("--top-k", type=int, default=0, help="with --temperature > 0 (0: off)")
    ap.add_argument("--json-schema", default=None, metavar="SCHEMA",
                    help="constrain every request's output to this JSON schema (JSON text, or "
                         "@FILE): SamplingParams.structured, guided_json over --http")
    ap.add_argument("--top-logprobs", type=int, default=None, metavar="K",
                    help="ask every output token's logprob and K alternatives (0-20; --http: "
                         "completions logprobs, 0-5; then every token is an event, so TTFT is "
                         "the first token's even when its text is empty, which the gateway "
                         "sends no event for otherwise)")
    ap.add_argument("--n", type=int, default=1,
                    help="completions per request (--http only: one prefill, n decodes; TTFT "
                         "is the first token of any)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="deadline in seconds per request (also per message)")
    ap.add_argument("--wait", type=float, default=30.0,
                    help="seconds to wait for every node to answer Stats before starting")
    ap.add_argument("--warmup", type=int, default=0,
                    help="requests sent one at a time (round-robin) before the run, not counted")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    ap.add_argument("--label", default=None, help="name of this run in reports and plots")
    ap.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                    help="write the result (config, summary, per-request records) as JSON "
                         "(whole or not at all: a temporary file renamed); - writes it to "
                         "stdout, and the report to stderr")
    ap.add_argument("--plot", default=None, metavar="PATH.png",
                    help="write CDFs of TTFT/TPOT and ITL over time (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no report on stdout")


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.workload == "fixed":
        return fixed_workload(args.num_prompts, args.input_len, args.output_len,
                              args.vocab_size, args.seed)
    if args.workload == "copy":
        return copy_workload(args.num_prompts, args.input_len, args.output_len,
                             args.vocab_size, args.seed)
    return sharegpt_workload(args.num_prompts, args.vocab_size, args.seed,
                             args.max_input_len, args.max_output_len)


async def _wait_ready(transport: Transport, seconds: float) -> dict[str, Any] | None:
    """Poll the node's Stats until it answers or ``seconds`` pass (then raise TimeoutError)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await transport.stats(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"node {transport.address} did not answer in {seconds}s") from None


async def _run_one(transport: Transport, spec: RequestSpec, rec: RequestRecord, t0: float,
                   sampling: SamplingParams, timeout: float, run_id: str,
                   sem: asyncio.Semaphore | None, out_ids: list[int] | None = None) -> None:
    """Send one request and fill ``rec``; never raises (except on cancellation)."""

    async def consume() -> None:
        rec.send_time = time.perf_counter() - t0
        async for ev in transport.generate(spec, f"{run_id}-{rec.index}", sampling, timeout):
            if isinstance(ev, Done):
                rec.finish_time = ev.t - t0
                rec.finish_reason = ev.reason
                rec.prompt_tokens = ev.prompt_tokens
                rec.completion_tokens = ev.completion_tokens
                rec.breakdown = dict(ev.breakdown)
                rec.cached_tokens = ev.cached_tokens
            else:
                rec.chunk_times.append(ev.t - t0)
                rec.chunk_tokens.append(ev.num_tokens)
                rec.chunk_choices.append(ev.choice)
                if out_ids is not None:
                    out_ids.extend(ev.token_ids)

    async def guarded() -> None:
        try:
            await asyncio.wait_for(consume(), timeout)
            if rec.finish_time is None:
                rec.error = "no_finish: stream ended without finished"
            elif rec.finish_reason == "abort":
                rec.error = "aborted: the node ended the request with reason abort"
            elif not rec.chunk_times:
                rec.error = "no_tokens: finished without any token"
        except asyncio.TimeoutError:
            rec.error = f"timeout: no completion within {timeout}s"
        except TimeoutError as e:
            rec.error = f"timeout: {e}"
        except TransportError as e:
            rec.error = str(e)
        except Exception as e:  # a broken request must not stop the benchmark
            rec.error = f"exception: {type(e).__name__}: {e}"

    if sem is None:
        await guarded()
    else:
        async with sem:
            await guarded()


def warmup_specs(specs: list[RequestSpec], count: int, vocab_size: int,
                 seed: int) -> list[RequestSpec]:
    """``count`` warm-up requests of the first measured ones' lengths with other random
    prompts (never a measured prompt: with prefix caching it would make the measured one a
    cache hit)."""
    rng = np.random.default_rng([seed, 0x5eed])
    measured = {tuple(s.prompt_token_ids) for s in specs}
    out = []
    for i in range(count):
        spec = specs[i % len(specs)]
        while True:
            ids = random_prompt(rng, spec.input_len, vocab_size)
            if tuple(ids) not in measured:
                break
        out.append(RequestSpec(ids, spec.output_len))
    return out


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Every request's sampling parameters (``max_tokens`` set per request)."""
    structured = None
    if args.json_schema is not None:
        text = args.json_schema
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        try:
            json.loads(text)
        except ValueError as e:
            raise ValueError(f"--json-schema: not JSON: {e}") from None
        structured = StructuredOutput("json", text, param="--json-schema")
    if args.top_logprobs is not None and not 0 <= args.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be in [0, 20], got {args.top_logprobs}")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.n > 1 and (args.connect or not args.http):
        raise ValueError("--n > 1 needs --http (the client protocol has no n: send n requests)")
    return SamplingParams(max_tokens=1, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, ignore_eos=structured is None, structured=structured,
                          logprobs=args.top_logprobs)


async def _warmup(transports: list[Transport], specs: list[RequestSpec],
                  sampling: SamplingParams, args: argparse.Namespace) -> list[str]:
    """``--warmup`` requests shaped like the first ones (other prompts), sequentially;
    returns their errors."""
    errors = []
    t0 = time.perf_counter()
    for i, spec in enumerate(warmup_specs(specs, args.warmup, args.vocab_size, args.seed)):
        rec = RequestRecord(index=-1 - i, node=transports[i % len(transports)].address,
                            input_len=spec.input_len, output_len=spec.output_len,
                            scheduled_time=0.0)
        params = msgspec.structs.replace(sampling, max_tokens=spec.output_len)
        await _run_one(transports[i % len(transports)], spec, rec, t0, params, args.timeout,
                       f"warmup{int(time.time() * 1e3) % 10**9}", None)
        if rec.error is not None:
            errors.append(rec.error)
    return errors


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; returns the result (what ``--json`` writes)."""
    addresses = (args.connect or []) + (args.http or []) or ["tcp://127.0.0.1:5555"]
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    convs: list[Conversation] = []
    if args.workload == "multiturn":
        if args.http:
            raise ValueError("--workload multiturn needs --connect (the client protocol carries "
                             "the answers' token ids that the next turn resends)")
        if args.num_conversations is not None and args.num_conversations < 1:
            raise ValueError(f"--num-conversations must be >= 1, got {args.num_conversations}")
        convs = multiturn_workload(args.num_conversations or args.num_prompts, args.num_turns,
                                   args.system_len,
                                   args.user_len, args.output_len, args.vocab_size, args.seed)
        # warm-up prompts of a first turn's length, not sharing the system prompt
        specs = fixed_workload(max(1, args.warmup), len(convs[0].prompt(0, [])),
                               args.output_len, args.vocab_size, args.seed + 1)
    else:
        specs = build_workload(args)
    arrivals = arrival_times(len(convs or specs), args.request_rate, args.seed, args.burstiness)
    sampling = sampling_params(args)
    transports = [make_transport(a, args.n) for a in addresses]
    try:
        stats_before = {t.address: await _wait_ready(t, args.wait) for t in transports}
        warmup_errors = await _warmup(transports, specs, sampling, args)
        stats_start: dict[str, Any] = {}  # after the warm-up: what the measured run adds
        for t in transports:
            stats_start[t.address] = await _stats_or_none(t)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        run_id = f"bench{int(time.time() * 1e3) % 10**9}"
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        for i, (conv, at) in enumerate(zip(convs, arrivals, strict=False)):
            tasks.append(asyncio.create_task(_conversation(
                transports[i % len(transports)], conv, at, t0, sampling, args, run_id, sem,
                records)))
        for i, (spec, at) in enumerate(zip(specs if not convs else [], arrivals, strict=False)):
            # loop: timers (uvloop's are 1 ms) may wake a little early
            while (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tr = transports[i % len(transports)]
            rec = RequestRecord(index=i, node=tr.address, input_len=spec.input_len,
                                output_len=spec.output_len, scheduled_time=at)
            records.append(rec)
            params = msgspec.structs.replace(sampling, max_tokens=spec.output_len)
            tasks.append(asyncio.create_task(
                _run_one(tr, spec, rec, t0, params, args.timeout, run_id, sem)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0  # first arrival to last completion
        stats_after: dict[str, Any] = {}
        for t in transports:
            stats_after[t.address] = await _stats_or_none(t)
    finally:
        for t in transports:
            await t.close()
    slo_ttft = None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3
    slo_tpot = None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3
    summary = aggregate(records, max(duration, 1e-9), slo_ttft, slo_tpot)
    if convs:
        summary["multiturn"] = multiturn_summary(records) | _transfer_per_request(
            stats_before, stats_after, int(summary["completed"]))  # type: ignore[call-overload]
    summary["speculative"] = speculative_summary(stats_start, stats_after)
    # outputs (paths) and the subcommand name are not part of the run's configuration
    config = {k: v for k, v in vars(args).items()
              if not k.startswith("_") and k not in ("command", "json_path", "plot", "quiet")}
    config["connect"] = addresses
    config["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    return {
        "label": args.label or _default_label(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ("disagg-bench " + shlex.join(sys.argv[1:])
                    if sys.argv[1:2] == ["serve"] else None),
        "config": config,
        "summary": summary,
        "warmup": {"requests": args.warmup, "errors": warmup_errors},
        "node_stats": {"before": stats_before, "after": stats_after},
        "requests": [asdict(r) for r in records],
    }


async def _conversation(tr: Transport, conv: Conversation, at: float, t0: float,
                        sampling: SamplingParams, args: argparse.Namespace, run_id: str,
                        sem: asyncio.Semaphore | None, records: list[RequestRecord]) -> None:
    """One multiturn conversation: each turn sent once the previous one finished, with the
    answers so far in its prompt; a failed turn ends the conversation."""
    while (delay := t0 + at - time.perf_counter()) > 0:
        await asyncio.sleep(delay)
    answers: list[list[int]] = []
    params = msgspec.structs.replace(sampling, max_tokens=conv.output_len)
    for turn in range(len(conv.users)):
        spec = RequestSpec(conv.prompt(turn, answers), conv.output_len)
        rec = RequestRecord(index=len(records), node=tr.address, input_len=spec.input_len,
                            output_len=spec.output_len, scheduled_time=time.perf_counter() - t0,
                            conversation=conv.index, turn=turn)
        records.append(rec)
        out: list[int] = []
        await _run_one(tr, spec, rec, t0, params, args.timeout, run_id, sem, out)
        if not rec.ok:
            return
        answers.append(out)


async def _stats_or_none(t: Transport) -> dict[str, Any] | None:
    try:
        return await t.stats(timeout=5.0)
    except TimeoutError:
        return None


def _delta(before: dict[str, Any], after: dict[str, Any], field: str) -> int:
    """A cumulative Stats field's growth, summed over the nodes connected to."""
    return sum(int((after.get(a) or {}).get(field, 0)) - int((b or {}).get(field, 0))
               for a, b in before.items())


def speculative_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Speculative decoding over the measured run (node Stats deltas, warm-up excluded):
    drafted and accepted tokens and the acceptance rate; None when nothing was drafted."""
    drafted = _delta(before, after, "spec_draft_tokens")
    if drafted <= 0:
        return None
    accepted = _delta(before, after, "spec_accepted_tokens")
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted}


def _transfer_per_request(before: dict[str, Any], after: dict[str, Any],
                          completed: int) -> dict[str, object]:
    """Node-side prefix-cache hits and KV moved per completed request, from Stats deltas of
    the nodes connected to (``kv_bytes_sent`` counts on prefill nodes only)."""
    def delta(field: str) -> int:
        return _delta(before, after, field)

    query, hit = delta("prefix_query_tokens"), delta("prefix_hit_tokens")
    n = max(1, completed)
    return {"node_prefix_hit_rate": hit / query if query else 0.0,
            "kv_units_received_per_request": delta("kv_units_received") / n,
            "kv_bytes_sent_per_request": delta("kv_bytes_sent") / n,
            # KV tiers (--kv-host-cache-mb, --kv-disk-cache-dir): prompt tokens each served
            "tier_hit_tokens": {t: delta(f"tier_hit_tokens_{t}")
                                for t in ("device", "host", "disk")},
            "tier_bytes": {k: delta(f"kv_bytes_{k}") for k in ("to_host", "from_host",
                                                                "to_disk", "from_disk")}}


def _default_label(args: argparse.Namespace) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    lens = (f"{args.input_len}/{args.output_len}" if args.workload in ("fixed", "copy")
            else f"multiturn {args.num_turns}x{args.user_len}/{args.output_len}"
            if args.workload == "multiturn" else "sharegpt")
    conc = f" c{args.max_concurrency}" if args.max_concurrency else ""
    return f"{lens} @{rate} req/s{conc}"


def _run_loop(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop where installed: the generator's own overhead must stay small next to an ITL."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(args: argparse.Namespace) -> int:
    try:
        result = _run_loop(run_benchmark(args))
    except (ValueError, TimeoutError, ConnectionError) as e:  # ConnectionError: HandshakeError
        sys.stderr.write(f"disagg-bench serve: {e}\n")
        return 2
    if args.json_path:
        write_json(result, args.json_path)
    if args.plot:
        from disagg.bench.plot import plot_runs

        plot_runs([result], args.plot)
    if not args.quiet:  # with --json -, stdout holds the JSON alone
        (sys.stderr if args.json_path == "-" else sys.stdout).write(format_report(result) + "\n")
    return 0
