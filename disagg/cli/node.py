"""``disagg-node``: parse flags into ``NodeConfig`` and hand off to one launch function."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec

from disagg.cli.flags import add_flags, from_flags
from disagg.config import ENV_PREFIX, ConfigError, NodeConfig, check_devices
from disagg.serving.http_limits import HttpLimits, raise_nofile_limit

if TYPE_CHECKING:
    from disagg.node import Node
    from disagg.supervisor import RestartPolicy

log = logging.getLogger("disagg.node")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``NodeConfig`` and its layers (``disagg.cli.flags``), and the few that
    are no config field: ``--tp``, ``--log-level``, the HTTP gateway's bounds."""
    ap = argparse.ArgumentParser(prog="disagg-node", description="Run one disagg node.")
    node = add_flags(ap, NodeConfig, "node (NodeConfig)")
    node.add_argument("--tp", type=int, default=0,
                      help="tensor-parallel size: one executor per device (with --devices cpu, "
                           "that many CPU executors); default: the number of --devices")
    node.add_argument("--log-level", default=None,
                      help="DEBUG, INFO (default), WARNING or ERROR, for the node and its "
                           "executors (also DISAGG_LOG_LEVEL)")
    h = HttpLimits()
    http = ap.add_argument_group("HTTP gateway bounds (disagg.serving.http_limits.HttpLimits)")
    http.add_argument("--http-max-connections", type=int, default=h.max_connections,
                      metavar="N", help="HTTP connections kept open at most (lowered so that "
                      "half the fd limit stays free); past it the oldest idle one is closed, "
                      "or with none idle the new one gets a 503")
    http.add_argument("--http-header-timeout", type=float, default=h.header_timeout_s,
                      metavar="SECONDS", help="a connection without a complete request head "
                      "this long after it opened or after its last response is closed (idle "
                      "keep-alive included)")
    http.add_argument("--http-body-timeout", type=float, default=h.body_timeout_s,
                      metavar="SECONDS", help="a request body not complete this long after "
                      "its head gets a 408")
    http.add_argument("--http-write-timeout", type=float, default=h.write_timeout_s,
                      metavar="SECONDS", help="a response (an SSE stream) whose client takes "
                      "no bytes this long is dropped and its request aborted on the node")
    http.add_argument("--http-body-buffer-mb", type=int, default=h.body_buffer_bytes >> 20,
                      metavar="MB", help="request body bytes all HTTP connections may buffer "
                      "together; past it a body gets a 503")
    http.add_argument("--max-n", type=int, default=h.max_n, metavar="N",
                      help="the most choices one HTTP request may ask for (n, times its "
                      "prompts in a batched /v1/completions); past it a 400 naming n")
    http.add_argument("--default-max-tokens", type=int, default=h.default_max_tokens,
                      metavar="N", help="output tokens at most of a chat request that sets "
                      "neither max_tokens nor max_completion_tokens (finish_reason length); 0: "
                      "up to the context limit, as OpenAI's API")
    http.add_argument("--tenant-header", default=h.tenant_header, metavar="NAME",
                      help="the HTTP header whose value is a request's tenant, its unit of "
                      "fairness on the decoders (their fair queue, --max-requests-per-client); "
                      "default: the id of its API key (Authorization: Bearer), if any")
    return ap


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The gateway's bounds from the ``--http-*`` flags (ValueError when one is out of range)."""
    return HttpLimits(max_connections=args.http_max_connections,
                      header_timeout_s=args.http_header_timeout,
                      body_timeout_s=args.http_body_timeout,
                      write_timeout_s=args.http_write_timeout,
                      body_buffer_bytes=args.http_body_buffer_mb << 20,
                      max_n=args.max_n,
                      default_max_tokens=args.default_max_tokens,
                      tenant_header=args.tenant_header).validate()


def tp_devices(devices: list[str], tp: int, dp: int = 1) -> list[str]:
    """One device per rank, ``--dp`` x ``--tp`` of them: ``--devices cpu --tp 2`` is two CPU
    executors, ``--devices cpu --dp 2 --tp 2`` four; ``--tp`` 0 takes the devices given over
    ``--dp`` ranks."""
    if tp <= 0:
        return devices
    if dp * tp == len(devices):
        return devices
    if devices == ["cpu"]:
        return ["cpu"] * (dp * tp)
    if dp > 1:
        raise ConfigError(f"--dp {dp} x --tp {tp} needs {dp * tp} --devices, got "
                          f"{len(devices)}: {','.join(devices)!r}")
    raise ConfigError(f"--tp {tp} needs {tp} --devices, got {len(devices)}: "
                      f"{','.join(devices)!r}")


def cuda_devices(devices: list[str]) -> int:
    """How many CUDA devices the driver sees (0 without CUDA), asked only when a CUDA device
    is: through libcuda, not torch, whose import (seconds) would delay the executors' spawn
    (``launch``)."""
    if not any(d.startswith("cuda") for d in devices):
        return 0
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    """The validated ``NodeConfig`` of the parsed flags (ConfigError naming the flag)."""
    cfg = from_flags(NodeConfig, args)
    if cfg.role != "router":  # a router runs no executor: --tp and --devices do not apply
        devices = tp_devices(cfg.devices, args.tp, cfg.executor.dp)
        if cfg.executor.dp > 1 and cfg.devices == ["cpu"] and args.tp <= 0:
            devices = ["cpu"] * cfg.executor.dp  # --devices cpu --dp N: N CPU executors
        cfg = msgspec.structs.replace(cfg, devices=devices)
    cfg.validate()
    return cfg


class Drainer:
    """SIGTERM and ``POST /drain`` drain the running node (``Node.drain``, at most
    ``timeout_s``), then set ``stop``; a second SIGTERM (or SIGINT) stops at once, as
    Kubernetes expects of SIGTERM (a graceful stop within the grace period)."""

    def __init__(self, stop: asyncio.Event, node: Callable[[], Node | None], timeout_s: float):
        self.stop, self.node, self.timeout_s = stop, node, timeout_s
        self.task: asyncio.Task[None] | None = None

    def start(self) -> float:
        """Begin draining (once); returns the drain timeout."""
        if self.task is None:
            self.task = asyncio.ensure_future(self._drain())
        return self.timeout_s

    def on_sigterm(self) -> None:
        if self.task is not None:
            log.warning("SIGTERM while draining: stopping now")
            self.stop.set()
            return
        self.start()

    async def _drain(self) -> None:
        node = self.node()
        try:
            if node is not None:
                await node.drain(self.timeout_s)
        finally:
            self.stop.set()


async def launch(cfg: NodeConfig, policy: RestartPolicy | None = None,
                 http_limits: HttpLimits | None = None) -> int:
    """Start a node (restarted in place when it fails, see ``Supervisor``), then the metrics
    endpoint (``cfg.metrics_listen``) and the HTTP gateway (``cfg.http_listen``); log
    ``ready`` once all of them listen; serve until SIGINT (stop at once) or SIGTERM (drain
    first, ``Drainer``), stop every child. Returns an exit code."""
    from disagg.actors.executor.executor_group import early_spawn

    t0 = time.monotonic()
    try:  # before this process imports torch and the rest: their imports overlap ours
        early = await asyncio.to_thread(early_spawn, cfg)
    except Exception as e:
        log.error("could not start: %s", e)
        return 1
    from disagg.supervisor import Supervisor

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    sup = Supervisor(cfg, policy, early)
    drainer = Drainer(stop, lambda: sup.node, cfg.drain_timeout_s)

    def on_signals() -> None:  # again after each start: native libraries loaded by it may
        for sig in (signal.SIGINT, signal.SIGTERM):  # have replaced the process's handlers
            loop.remove_signal_handler(sig)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, drainer.on_sigterm)

    on_signals()
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
        if cfg.metrics_listen:
            from disagg.actors.http.metrics_server import MetricsServer

            what = "the metrics endpoint"
            servers.append(MetricsServer(address, cfg.metrics_listen, sup.metrics,
                                         on_drain=drainer.start))
            await servers[-1].start()
        if cfg.http_listen:
            from disagg.actors.http.http import start_http_gateway

            what = "the HTTP gateway"
            servers.append(await start_http_gateway(
                address, cfg.http_listen, node.cfg.executor.model or "", cfg.served_model_name,
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


def drain_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg-node drain", description=drain_command.__doc__)
    ap.add_argument("address", nargs="?", default="127.0.0.1:9100", metavar="HOST:PORT",
                    help="the node's --metrics-listen (default 127.0.0.1:9100)")
    ap.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="then wait up to this long for the node to exit (0: do not wait)")
    return ap


def drain_command(argv: list[str]) -> int:
    """``disagg-node drain [HOST:PORT] [--wait SECONDS]``: POST /drain to a node's metrics
    endpoint (``--metrics-listen``, on this host), then with ``--wait`` until the node stops
    answering (it exited). For a pod's preStop hook. Returns an exit code: 1 when the node
    could not be asked, or still answers after the wait."""
    import urllib.error
    import urllib.request

    args = drain_parser().parse_args(argv)
    url = "http://" + args.address.removeprefix("http://").rstrip("/")
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/drain", method="POST"),
                                    timeout=10) as resp:
            print(f"disagg-node drain: {resp.read().decode()}")
    except (urllib.error.URLError, OSError) as e:
        print(f"disagg-node drain: could not ask {url}: {e}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            return 0  # gone: the node exited
        time.sleep(0.5)
    if args.wait > 0:
        print(f"disagg-node drain: the node still answers after {args.wait:g} s",
              file=sys.stderr)
        return 1
    return 0


def refuse(why: str) -> NoReturn:
    """Exit with code 2 (a flag is wrong), saying why."""
    print(f"disagg-node: {why}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    from disagg.log import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        keygen(argv[1:])
        return
    if argv[:1] == ["drain"]:
        sys.exit(drain_command(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.curve_keys:  # in-process clients (HTTP gateway, metrics, router) read it here
        from disagg.serving.security import KeyFileError, load_node

        try:
            load_node(args.curve_keys)
        except KeyFileError as e:
            refuse(f"--curve-keys: {e}")
        os.environ[ENV_PREFIX + "CURVE_KEYS"] = args.curve_keys
    if args.log_level:  # executors read it from the environment they inherit
        os.environ[ENV_PREFIX + "LOG_LEVEL"] = args.log_level
    setup_logging(args.role, level=args.log_level)
    try:
        http_limits = http_limits_from_args(args)
    except ValueError as e:
        refuse(str(e))
    # the fd table's room: HTTP connections take at most half of it (http_limits.fd_reserve),
    # the rest stays for ZeroMQ clients, peers and executor restarts
    soft, hard = raise_nofile_limit()
    log.debug("fd limit %d (hard %d)", soft, hard)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        refuse(str(e))
    if cfg.otlp_traces_endpoint is not None:  # before anything serves: every request traced
        try:
            from disagg import trace

            trace.configure(cfg.otlp_traces_endpoint, f"disagg-{cfg.role}")
        except ImportError as e:
            refuse(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'disagg[otel]' "
                   f"({e})")
    if cfg.role == "router":
        sys.exit(asyncio.run(run_router(cfg, http_limits)))
    from disagg.supervisor import RestartPolicy

    try:
        check_devices(cfg.devices, cuda_devices(cfg.devices))
        policy = RestartPolicy(cfg.max_restarts, cfg.restart_window_s)
    except ConfigError as e:
        refuse(str(e))
    main_coro = launch(cfg, policy, http_limits)
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(main_coro))
    sys.exit(uvloop.run(main_coro))


async def run_router(cfg: NodeConfig, http_limits: HttpLimits) -> int:
    """``--role router``: ``disagg.actors.router.router.run_router`` over ``cfg.router``'s peers."""
    from disagg.actors.router import router
    from disagg.serving.advice import Slo
    from disagg.serving.migration import MigrationPolicy

    r = cfg.router
    return await router.run_router(
        cfg.listen, r.decode_peers, cfg.http_listen, cfg.executor.model, cfg.served_model_name,
        cfg.scheduler.max_model_len or None,
        resolve_interval=cfg.disagg.peer_resolve_interval_s,
        slo=Slo(r.slo_ttft_ms / 1000, r.slo_tpot_ms / 1000),
        salt_by_tenant=cfg.cache.salt_by_tenant, http_limits=http_limits,
        migration=MigrationPolicy(r.migration_limit, r.migration_max_tokens))
