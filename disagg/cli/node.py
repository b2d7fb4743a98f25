"""``disagg-node``: parse flags into ``NodeConfig`` and hand off to one launch function."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from disagg.config import (
    ENV_PREFIX,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    CacheConfig,
    ConfigError,
    DisaggConfig,
    ExecutorConfig,
    NodeConfig,
    SchedulerConfig,
    check_devices,
)
from disagg.serving.http_limits import HttpLimits, raise_nofile_limit

if TYPE_CHECKING:
    from disagg.node import Node
    from disagg.supervisor import RestartPolicy

log = logging.getLogger("disagg.node")


def build_parser() -> argparse.ArgumentParser:
    n, e, c, s = NodeConfig(), ExecutorConfig(), CacheConfig(), SchedulerConfig()  # defaults
    ap = argparse.ArgumentParser(prog="disagg-node", description="Run one disagg node.")
    ap.add_argument("--role", choices=["mixed", "prefill", "decode", "router"], default=n.role)
    ap.add_argument("--listen", default=n.listen, help="client-protocol ZeroMQ address")
    ap.add_argument("--model", default=e.model,
                    help="local Hugging Face model directory (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default=e.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--devices", default=",".join(n.devices),
                    help="comma-separated devices, one executor each: cpu or cuda:0,cuda:1")
    ap.add_argument("--tp", type=int, default=0,
                    help="tensor-parallel size: one executor per device (with --devices cpu, "
                         "that many CPU executors); default: the number of --devices")
    ap.add_argument("--attention-backend", default=e.attention_backend,
                    choices=["auto", "torch", "triton", "flashinfer"])
    ap.add_argument("--threads", type=int, default=e.threads,
                    help="torch CPU threads per executor (default 0: torch's default, the "
                         "usable cores, shared among the executors; on a busy or shared "
                         "machine 1 is often much faster)")
    ap.add_argument("--random-weights", action="store_true", default=e.random_weights,
                    help="draw the weights from --seed on the device; --model DIR needs only "
                         "config.json (no safetensors, no tokenizer: send prompt_token_ids)")
    ap.add_argument("--seed", type=int, default=e.seed, help="seed for --random-weights")
    ap.add_argument("--quantization", choices=["auto", "fp8"], default=e.quantization,
                    help="auto: the checkpoint's own format (FP8 checkpoints are read and "
                         "dequantized); fp8: round an unquantized checkpoint's linear weights, "
                         "or --random-weights', to 128x128 block FP8 (--random-weights also "
                         "follows an FP8 quantization_config in config.json)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization,
                    help="CUDA with --num-pages 0: fraction of GPU memory for weights, "
                         "activations and the KV pool (sized after a profiling step)")
    ap.add_argument("--enforce-eager", action="store_true", default=not e.cuda_graphs,
                    help="CUDA: run decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--page-size", type=int, default=c.page_size)
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    default=c.prefix_caching,
                    help="do not reuse the KV of cached prompt prefixes (on by default)")
    ap.add_argument("--cache-salt-by-tenant", choices=("auto", "on", "off"),
                    default=c.salt_by_tenant, dest="salt_by_tenant",
                    help="salt each CURVE client key's requests by that key, so clients never "
                         "share cached prefixes nor see the prefix counters in Stats (auto: "
                         "on with --curve-keys; also the router's)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=c.kv_cache_dtype,
                    help="what KV pages hold: auto = the model's dtype; fp8_e4m3 = float8 with "
                         "scales per layer and kv head (the checkpoint's k_scale/v_scale, else "
                         "1.0): half the bytes of bf16, shipped as such to a decoder")
    ap.add_argument("--num-pages", type=int, default=c.num_pages)
    ap.add_argument("--kv-cache-mb", type=int, default=c.kv_cache_mb)
    ap.add_argument("--max-batch-tokens", type=int, default=s.max_batch_tokens)
    ap.add_argument("--max-running", type=int, default=s.max_running)
    ap.add_argument("--overlap-schedule", choices=("auto", "on", "off"),
                    default=s.overlap_schedule,
                    help="launch each decode step while the previous one runs, hiding the "
                         "host's work behind the device's (auto: on CUDA devices)")
    ap.add_argument("--max-model-len", type=int, default=s.max_model_len)
    ap.add_argument("--max-requests-per-client", type=int, default=s.max_requests_per_client,
                    help="live requests one client may have (its CURVE client key however many "
                         "connections it opens; without keys its connection); more get "
                         "'overloaded'")
    ap.add_argument("--max-queued-requests", type=int, default=s.max_queued_requests,
                    help="requests admitted but not started, all clients together; more get "
                         "'overloaded'")
    ap.add_argument("--max-frames-per-client", type=int, default=s.max_frames_per_client,
                    help="frames of one client being handled at once; more get 'overloaded'")
    ap.add_argument("--max-connections-per-address", type=int,
                    default=s.max_connections_per_address,
                    help="client connections one peer address may send frames on (without keys "
                         "each connection is a client of its own); frames on more get "
                         "'overloaded'")
    ap.add_argument("--speculative-method", default=s.speculative_method,
                    choices=list(SPECULATIVE_METHODS),
                    help="speculative decoding on decode and mixed nodes: ngram (prompt lookup: "
                         "the continuation of the latest earlier match of the last n tokens); "
                         "draft: a smaller model of the same vocabulary (--draft-model); mtp: "
                         "a DeepSeek-V3 checkpoint's multi-token-prediction layer (mixed nodes)")
    ap.add_argument("--draft-model", default=None, metavar="DIR",
                    help="--speculative-method draft: the draft model's local HF directory")
    ap.add_argument("--num-speculative-tokens", type=int, default=s.num_speculative_tokens,
                    help="tokens drafted per sequence and step (verified in one forward pass)")
    ap.add_argument("--prompt-lookup-max", type=int, default=s.prompt_lookup_max,
                    help="ngram: the longest n-gram looked up")
    ap.add_argument("--prompt-lookup-min", type=int, default=s.prompt_lookup_min,
                    help="ngram: the shortest n-gram looked up")
    ap.add_argument("--queue-timeout", type=float, default=s.queue_timeout_s,
                    help="seconds a request may wait to start before it ends with 'timeout'")
    ap.add_argument("--step-timeout", type=float, default=n.step_timeout_s)
    ap.add_argument("--startup-timeout", type=float, default=n.startup_timeout_s)
    ap.add_argument("--max-restarts", type=int, default=5,
                    help="when an executor dies the node stops its requests (error internal) "
                         "and restarts in place on the same addresses, at most this many times "
                         "within --restart-window; past that it exits with code 1 (0: never)")
    ap.add_argument("--restart-window", type=float, default=600.0, metavar="SECONDS")
    d = DisaggConfig()
    ap.add_argument("--prefill-peer", action="append", default=[], dest="prefill_peers",
                    help="decode role: a prefill node's --listen address, or dns:NAME:PORT for "
                         "every address NAME resolves to, re-resolved (repeatable)")
    ap.add_argument("--peer-resolve-interval", type=float, default=d.peer_resolve_interval_s,
                    metavar="SECONDS", help="how often dns:NAME:PORT entries of --prefill-peer "
                    "and --decode-peer are resolved again (peers that appear are connected, "
                    "those that vanish are treated as dead)")
    ap.add_argument("--transfer-backend", default=d.transfer_backend, choices=["fabric", "cuda-ipc"])
    ap.add_argument("--fabric-provider", default=d.fabric_provider,
                    help="libfabric provider: tcp, shm, net, verbs, efa")
    ap.add_argument("--fabric-address", default=d.fabric_address,
                    help="the local address the fabric endpoint binds and advertises to "
                         "peers (default: loopback, one host; on a cluster the host or pod IP)")
    ap.add_argument("--fabric-lanes", type=int, default=d.fabric_lanes,
                    help="fabric endpoints to stripe KV writes over (one per NIC, nearest the "
                         "GPU first; several on one NIC when there are fewer NICs)")
    ap.add_argument("--fabric-stripe-bytes", type=int, default=d.fabric_stripe_bytes,
                    help="with --fabric-lanes > 1: longer runs of pages are cut to this size "
                         "so that every lane gets a share")
    ap.add_argument("--fabric-mr-per-attempt", default=d.fabric_mr_per_attempt,
                    choices=["auto", "on", "off"],
                    help="decode role: register the KV and context memory anew (fresh random "
                         "keys) for each remote prefill attempt and revoke it when the attempt "
                         "ends, so late or forged writes are refused; auto: on where "
                         "registration pins nothing (tcp, shm, net), off elsewhere (verbs, efa)")
    ap.add_argument("--layerwise-min-tokens", type=int, default=d.layerwise_min_tokens,
                    metavar="N", help="prefill role: a step of fewer prompt tokens ships its "
                    "KV in one write per destination after its last layer instead of layer by "
                    "layer (fewer posts for short prompts; it exposes the whole transfer of "
                    "such a step, so only for fast links); 0 (default): always layer by layer")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=d.local_prefill_max_tokens,
                    help="decode role: prompts of at most this many tokens are prefilled locally")
    ap.add_argument("--on-prefill-failure", default=d.on_prefill_failure,
                    choices=["error", "retry", "local"])
    ap.add_argument("--prefill-timeout", type=float, default=d.prefill_timeout_s)
    ap.add_argument("--heartbeat", type=float, default=d.heartbeat_s)
    ap.add_argument("--peer-timeout", type=float, default=d.peer_timeout_s)
    ap.add_argument("--peer-share", type=float, default=d.peer_share, metavar="FRACTION",
                    help="prefill role: share of the job slots and of the page pool one decoder "
                         "connection may hold; past it its requests get 'overloaded'")
    ap.add_argument("--ownership-timeout", type=float, default=d.ownership_timeout_s,
                    metavar="SECONDS", help="prefill role: a decoder must prove it owns the "
                    "memory its requests name within this (challenge), else they are refused")
    ap.add_argument("--http-listen", default=None,
                    help="HOST:PORT for the OpenAI-compatible HTTP API (mixed, decode, router)")
    h = HttpLimits()
    ap.add_argument("--http-max-connections", type=int, default=h.max_connections, metavar="N",
                    help="HTTP connections kept open at most (lowered so that half the fd "
                         "limit stays free); past it the oldest idle one is closed, or with "
                         "none idle the new one gets a 503")
    ap.add_argument("--http-header-timeout", type=float, default=h.header_timeout_s,
                    metavar="SECONDS", help="a connection without a complete request head this "
                    "long after it opened or after its last response is closed (idle "
                    "keep-alive included)")
    ap.add_argument("--http-body-timeout", type=float, default=h.body_timeout_s,
                    metavar="SECONDS", help="a request body not complete this long after its "
                    "head gets a 408")
    ap.add_argument("--http-write-timeout", type=float, default=h.write_timeout_s,
                    metavar="SECONDS", help="a response (an SSE stream) whose client takes no "
                    "bytes this long is dropped and its request aborted on the node")
    ap.add_argument("--http-body-buffer-mb", type=int, default=h.body_buffer_bytes >> 20,
                    metavar="MB", help="request body bytes all HTTP connections may buffer "
                    "together; past it a body gets a 503")
    ap.add_argument("--metrics-listen", default=None,
                    help="HOST:PORT serving Prometheus /metrics (any role)")
    ap.add_argument("--served-model-name", default=None,
                    help="model id in the HTTP API (default: the model directory's name)")
    ap.add_argument("--decode-peer", action="append", default=[], dest="decode_peers",
                    help="router role: a decode node's --listen address, or dns:NAME:PORT "
                         "(repeatable)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, metavar="MS",
                    help="router role: time-to-first-token objective (p90) that the "
                         "prefill:decode advice (/v1/disagg/advice) plans for")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, metavar="MS",
                    help="router role: time-per-output-token objective (p90) for the advice")
    ap.add_argument("--curve-keys", default=None, metavar="DIR",
                    help="authenticate and encrypt client and node-to-node sockets with the "
                         "node's CURVE keys in DIR (DIR/node of `disagg-node keygen DIR`)")
    ap.add_argument("--log-level", default=None)
    return ap


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The gateway's bounds from the ``--http-*`` flags (ValueError when one is out of range)."""
    return HttpLimits(max_connections=args.http_max_connections,
                      header_timeout_s=args.http_header_timeout,
                      body_timeout_s=args.http_body_timeout,
                      write_timeout_s=args.http_write_timeout,
                      body_buffer_bytes=args.http_body_buffer_mb << 20).validate()


def tp_devices(devices: str, tp: int) -> list[str]:
    """One device per tensor-parallel rank: ``--devices cpu --tp 2`` is two CPU executors."""
    out = [d.strip() for d in devices.split(",") if d.strip()]
    if tp <= 0 or tp == len(out):
        return out
    if out == ["cpu"]:
        return ["cpu"] * tp
    raise ConfigError(f"--tp {tp} needs {tp} --devices, got {len(out)}: {devices!r}")


def cuda_devices(devices: list[str]) -> int:
    """How many CUDA devices torch sees (0 without CUDA); imports torch only when asked for
    a CUDA device."""
    if not any(d.startswith("cuda") for d in devices):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    cfg = NodeConfig(
        role=args.role,
        listen=args.listen,
        devices=tp_devices(args.devices, args.tp),
        executor=ExecutorConfig(model=args.model, dtype=args.dtype,
                                attention_backend=args.attention_backend, threads=args.threads,
                                seed=args.seed, random_weights=args.random_weights,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                cuda_graphs=not args.enforce_eager,
                                draft_model=args.draft_model, quantization=args.quantization),
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages,
                          kv_cache_mb=args.kv_cache_mb, prefix_caching=args.prefix_caching,
                          salt_by_tenant=args.salt_by_tenant,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_batch_tokens=args.max_batch_tokens,
                                  max_running=args.max_running, max_model_len=args.max_model_len,
                                  max_requests_per_client=args.max_requests_per_client,
                                  max_queued_requests=args.max_queued_requests,
                                  max_frames_per_client=args.max_frames_per_client,
                                  max_connections_per_address=args.max_connections_per_address,
                                  queue_timeout_s=args.queue_timeout,
                                  speculative_method=args.speculative_method,
                                  num_speculative_tokens=args.num_speculative_tokens,
                                  prompt_lookup_max=args.prompt_lookup_max,
                                  prompt_lookup_min=args.prompt_lookup_min,
                                  overlap_schedule=args.overlap_schedule),
        disagg=DisaggConfig(
            prefill_peers=args.prefill_peers, transfer_backend=args.transfer_backend,
            peer_resolve_interval_s=args.peer_resolve_interval,
            fabric_provider=args.fabric_provider, fabric_lanes=args.fabric_lanes,
            fabric_address=args.fabric_address,
            fabric_stripe_bytes=args.fabric_stripe_bytes,
            fabric_mr_per_attempt=args.fabric_mr_per_attempt,
            local_prefill_max_tokens=args.local_prefill_max_tokens,
            on_prefill_failure=args.on_prefill_failure, prefill_timeout_s=args.prefill_timeout,
            heartbeat_s=args.heartbeat, peer_timeout_s=args.peer_timeout,
            peer_share=args.peer_share, ownership_timeout_s=args.ownership_timeout,
            layerwise_min_tokens=args.layerwise_min_tokens),
        curve_keys=args.curve_keys,
        step_timeout_s=args.step_timeout,
        startup_timeout_s=args.startup_timeout,
    )
    cfg.validate()
    return cfg


async def launch(cfg: NodeConfig, http_listen: str | None = None,
                 served_model_name: str | None = None, metrics_listen: str | None = None,
                 policy: RestartPolicy | None = None,
                 http_limits: HttpLimits | None = None) -> int:
    """Start a node (restarted in place when it fails, see ``Supervisor``), then the metrics
    endpoint and the HTTP gateway; log ``ready`` once all of them listen; serve until
    SIGINT/SIGTERM, stop every child. Returns an exit code."""
    from disagg.supervisor import Supervisor

    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signals() -> None:  # again after each start: native libraries loaded by it may
        for sig in (signal.SIGINT, signal.SIGTERM):  # have replaced the process's handlers
            loop.remove_signal_handler(sig)
            loop.add_signal_handler(sig, stop.set)

    on_signals()
    sup = Supervisor(cfg, policy)
    try:
        node = await sup.start(stop)
    except Exception as e:
        log.error("could not start: %s", e)
        return 1
    if node is None:
        return 0
    on_signals()
    address = node.address or cfg.listen
    servers: list[Any] = []  # stopped in reverse order
    what = ""
    try:
        if metrics_listen:
            from disagg.actors.metrics_server import MetricsServer

            what = "the metrics endpoint"
            servers.append(MetricsServer(address, metrics_listen, sup.metrics))
            await servers[-1].start()
        if http_listen:
            from disagg.actors.http import start_http_gateway

            what = "the HTTP gateway"
            servers.append(await start_http_gateway(
                address, http_listen, node.cfg.executor.model or "", served_model_name,
                cfg.scheduler.max_model_len or None, metrics=sup.metrics, limits=http_limits))
    except Exception as e:
        log.error("could not start %s: %s", what, e)
        code = 1
    else:
        if any(d.startswith("cuda") for d in cfg.devices):  # report compiles from here on
            from disagg.kernels.compile_watch import arm

            arm("the node")
        log.info("ready: %s (started in %.1f s)", node.summary, time.monotonic() - t0)

        def restarted(node: Node) -> None:
            on_signals()
            log.info("ready: %s (restart %d)", node.summary, sup.restarts)

        code = await sup.run(stop, restarted)
    log.info("stopping")
    for server in reversed(servers):
        await server.stop()
    await sup.stop()
    log.info("stopped")
    return code


def keygen(argv: list[str]) -> None:
    """``disagg-node keygen DIR [--add-client NAME]``: make a CURVE key set for --curve-keys,
    split by role (``security.LAYOUT``), or mint and authorise one more client keypair."""
    from disagg.serving.security import LAYOUT, KeyFileError, add_client
    from disagg.serving.security import keygen as make_keys

    ap = argparse.ArgumentParser(
        prog="disagg-node keygen", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make CURVE keys for --curve-keys: nodes get DIR/node, clients DIR/client.",
        epilog=LAYOUT)
    ap.add_argument("directory", metavar="DIR")
    ap.add_argument("--add-client", metavar="NAME", default=None,
                    help="in an existing DIR: write DIR/client-NAME and authorise it in "
                         "DIR/node/clients/")
    args = ap.parse_args(argv)
    try:
        if args.add_client is not None:
            out = add_client(args.directory, args.add_client)
            print(f"wrote client keys to {out}; authorised in "
                  f"{out.parent / 'node' / 'clients'}: copy {out.name}.key there on every node")
            return
        d = make_keys(args.directory)
    except (FileExistsError, KeyFileError, ValueError) as e:
        print(f"disagg-node keygen: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote CURVE keys to {d}: give every node --curve-keys {d / 'node'} and clients "
          f"--curve-keys {d / 'client'} (or DISAGG_CURVE_KEYS); see {d / 'README.txt'}")


def main(argv: list[str] | None = None) -> None:
    from disagg.log import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        keygen(argv[1:])
        return
    args = build_parser().parse_args(argv)
    if args.curve_keys:  # in-process clients (HTTP gateway, metrics, router) read it here
        from disagg.serving.security import KeyFileError, load_node

        try:
            load_node(args.curve_keys)
        except KeyFileError as e:
            print(f"disagg-node: --curve-keys: {e}", file=sys.stderr)
            sys.exit(2)
        os.environ[ENV_PREFIX + "CURVE_KEYS"] = args.curve_keys
    if args.log_level:  # executors read it from the environment they inherit
        os.environ[ENV_PREFIX + "LOG_LEVEL"] = args.log_level
    setup_logging(args.role, level=args.log_level)
    try:
        http_limits = http_limits_from_args(args)
    except ValueError as e:
        print(f"disagg-node: {e}", file=sys.stderr)
        sys.exit(2)
    # the fd table's room: HTTP connections take at most half of it (http_limits.fd_reserve),
    # the rest stays for ZeroMQ clients, peers and executor restarts
    soft, hard = raise_nofile_limit()
    log.debug("fd limit %d (hard %d)", soft, hard)
    if args.role == "router":
        from disagg.actors.router import run_router
        from disagg.remote.discovery import split_specs
        from disagg.serving.advice import Slo

        if not args.decode_peers:
            print("disagg-node: --role router needs at least one --decode-peer", file=sys.stderr)
            sys.exit(2)
        try:
            split_specs(args.decode_peers, "--decode-peer")
            slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
            if not args.peer_resolve_interval > 0:
                raise ValueError("--peer-resolve-interval must be > 0")
        except ValueError as e:
            print(f"disagg-node: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(asyncio.run(run_router(args.listen, args.decode_peers, args.http_listen,
                                        args.model, args.served_model_name,
                                        args.max_model_len or None,
                                        resolve_interval=args.peer_resolve_interval,
                                        slo=slo, salt_by_tenant=args.salt_by_tenant,
                                        http_limits=http_limits)))
    if args.http_listen and args.role == "prefill":
        print("disagg-node: --http-listen needs --role mixed, decode or router", file=sys.stderr)
        sys.exit(2)
    from disagg.supervisor import RestartPolicy

    try:
        cfg = config_from_args(args)
        check_devices(cfg.devices, cuda_devices(cfg.devices))
        policy = RestartPolicy(args.max_restarts, args.restart_window)
    except ConfigError as e:
        print(f"disagg-node: {e}", file=sys.stderr)
        sys.exit(2)
    main_coro = launch(cfg, args.http_listen, args.served_model_name, args.metrics_listen, policy,
                       http_limits)
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main_coro))
    sys.exit(uvloop.run(main_coro))
