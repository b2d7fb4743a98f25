"""Node configuration: frozen structs layered by role (node -> scheduler / cache / executor /
disagg / router).

Each setting lives here once: a field, its default, and (``Annotated[T, Flag(...)]``) its
``disagg-node`` flag and help; ``disagg.cli.flags`` builds the parser from these fields (choices
from ``Literal`` types). Validation names the value and the flag to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import msgspec

from disagg.peer_specs import split_specs

ENV_PREFIX = "DISAGG_"


def env(name: str, default: str | None = None) -> str | None:
    """Read a ``DISAGG_``-prefixed environment variable (the only place they are read)."""
    return os.environ.get(ENV_PREFIX + name, default)


def env_ints(name: str, count: int, want: str) -> tuple[int, ...] | None:
    """``DISAGG_<name>`` as ``count`` comma-separated integers, None when unset or empty;
    ValueError naming the variable and ``want`` (what the integers are) otherwise."""
    raw = (env(name) or "").strip()
    if not raw:
        return None
    try:
        values = tuple(int(x) for x in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        raise ValueError(f"{ENV_PREFIX}{name}={raw!r}: want {want}")
    return values


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """A field's ``disagg-node`` flag. ``name`` defaults to ``--`` and the field's name with
    dashes, less a trailing ``_s``; ``dest`` (the argparse attribute) to the name's. A bool
    field is a switch that flips its default (``invert``: the switch sets the opposite of
    the field, ``--enforce-eager`` clears ``cuda_graphs``); a list field's flag repeats,
    unless ``sep`` joins the list into one value."""

    help: str
    name: str = ""
    dest: str = ""
    metavar: str | None = None
    invert: bool = False
    sep: str = ""


Role = Literal["mixed", "prefill", "decode", "router"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackend = Literal["auto", "torch", "triton", "flashinfer"]
SpeculativeMethod = Literal["ngram", "draft", "mtp"]
KvCacheDtype = Literal["auto", "fp8_e4m3"]
AutoOnOff = Literal["auto", "on", "off"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


def memory_available() -> int:
    """Bytes of memory this machine can still give (MemAvailable), else its physical size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _one_of(value: object, kind: object, flag: str) -> None:
    """``value`` is one of the ``Literal`` type ``kind``'s values, else a ConfigError."""
    if value not in get_args(kind):
        raise ConfigError(f"{flag} must be one of {', '.join(get_args(kind))}, got {value!r}")


class CacheConfig(msgspec.Struct, frozen=True):
    page_size: Annotated[int, Flag("tokens per KV page")] = 16
    num_pages: Annotated[int, Flag(
        "KV pages per executor (default 0: sized from --kv-cache-mb on CPU, from free memory "
        "on CUDA)")] = 0
    kv_cache_mb: Annotated[int, Flag("KV budget per executor in MiB when --num-pages is 0 "
                                     "(CPU)")] = 256
    prefix_caching: Annotated[bool, Flag(
        "do not reuse the KV of cached prompt prefixes (on by default)",
        name="--no-prefix-caching", dest="prefix_caching")] = True
    salt_by_tenant: Annotated[AutoOnOff, Flag(  # disagg.serving.salting
        "salt each CURVE client key's requests by that key, so clients never share cached "
        "prefixes nor see the prefix counters in Stats (auto: on with --curve-keys; also the "
        "router's)", name="--cache-salt-by-tenant", dest="salt_by_tenant")] = "auto"
    kv_cache_dtype: Annotated[KvCacheDtype, Flag(  # disagg.kernels.kv_quant
        "what KV pages hold: auto = the model's dtype; fp8_e4m3 = float8 with scales per "
        "layer and kv head (the checkpoint's k_scale/v_scale, else 1.0): half the bytes of "
        "bf16, shipped as such to a decoder")] = "auto"
    kv_host_cache_mb: Annotated[int, Flag(  # disagg.engine.kv_tiers
        "a host-memory KV tier behind the prefix cache, MiB per node (pinned where CUDA is; "
        "0 = off): cached pages the device lets go are kept here and reloaded on a hit")] = 0
    kv_disk_cache_dir: Annotated[str, Flag(  # disagg.engine.kv_disk
        "a local-disk KV tier under the host tier, in this directory ('' = off; needs "
        "--kv-host-cache-mb); a restart reuses what it holds for the same model")] = ""
    kv_disk_cache_mb: Annotated[int, Flag("the disk tier's bound in MiB")] = 4096

    def validate(self) -> None:
        _one_of(self.kv_cache_dtype, KvCacheDtype, "--kv-cache-dtype")
        _one_of(self.salt_by_tenant, AutoOnOff, "--cache-salt-by-tenant")
        if self.page_size < 1 or self.page_size > 1024:
            raise ConfigError(f"--page-size must be in [1, 1024], got {self.page_size}")
        if self.num_pages < 0:
            raise ConfigError(f"--num-pages must be >= 0, got {self.num_pages}")
        if self.num_pages == 0 and self.kv_cache_mb <= 0:
            raise ConfigError(f"--kv-cache-mb must be > 0, got {self.kv_cache_mb}")
        if self.kv_host_cache_mb < 0:
            raise ConfigError(f"--kv-host-cache-mb must be >= 0, got {self.kv_host_cache_mb}")
        if self.kv_host_cache_mb and (self.kv_host_cache_mb << 20) > (free := memory_available()):
            raise ConfigError(f"--kv-host-cache-mb {self.kv_host_cache_mb} MiB is more than this "
                              f"machine can hold: {free >> 20} MiB available")
        if self.kv_host_cache_mb and not self.prefix_caching:
            raise ConfigError("--kv-host-cache-mb keeps pages the prefix cache lets go: it "
                              "needs the prefix cache (drop --no-prefix-caching)")
        if self.kv_disk_cache_dir and not self.kv_host_cache_mb:
            raise ConfigError("--kv-disk-cache-dir needs a host tier above it "
                              "(--kv-host-cache-mb > 0)")
        if self.kv_disk_cache_dir and self.kv_disk_cache_mb <= 0:
            raise ConfigError(f"--kv-disk-cache-mb must be > 0, got {self.kv_disk_cache_mb}")


class SchedulerConfig(msgspec.Struct, frozen=True):
    max_batch_tokens: Annotated[int, Flag(
        "tokens per step: decode tokens plus prefill chunks (per rank with --dp)")] = 2048
    max_running: Annotated[int, Flag("sequences per step (per rank with --dp)")] = 256
    max_model_len: Annotated[int, Flag(
        "context limit in tokens (default 0: the model's max_position_embeddings; capped by "
        "the KV pool)")] = 0
    max_requests_per_client: Annotated[int, Flag(
        "live requests one client may have (its CURVE client key however many connections it "
        "opens; without keys its connection); more get 'overloaded'")] = 4096
    max_queued_requests: Annotated[int, Flag(
        "requests admitted but not started, all clients together; more get "
        "'overloaded'")] = 16384
    queue_timeout_s: Annotated[float, Flag(
        "seconds a request may wait to start before it ends with 'timeout'")] = 600.0
    max_frames_per_client: Annotated[int, Flag(
        "frames of one client being handled at once; more get 'overloaded'")] = 8192
    max_connections_per_address: Annotated[int, Flag(
        "client connections one peer address may send frames on (without keys each "
        "connection is a client of its own); frames on more get 'overloaded'")] = 1024
    speculative_method: Annotated[SpeculativeMethod | None, Flag(
        "speculative decoding on decode and mixed nodes: ngram (prompt lookup: the "
        "continuation of the latest earlier match of the last n tokens); draft: a smaller "
        "model of the same vocabulary (--draft-model); mtp: a DeepSeek-V3 checkpoint's "
        "multi-token-prediction layer (mixed nodes)")] = None  # None: off
    num_speculative_tokens: Annotated[int, Flag(
        "tokens drafted per sequence and step (verified in one forward pass)")] = 3
    prompt_lookup_max: Annotated[int, Flag("ngram: the longest n-gram looked up")] = 4
    prompt_lookup_min: Annotated[int, Flag("ngram: the shortest n-gram looked up")] = 1
    overlap_schedule: Annotated[AutoOnOff, Flag(
        "launch each decode step while the previous one runs, hiding the host's work behind "
        "the device's (auto: on CUDA devices)")] = "auto"
    grammar_threads: Annotated[int, Flag(
        "threads that accept a decode step's tokens (the scheduler's) and fill the next "
        "grammar masks of its constrained rows (each executor's); 0: half the CPUs, an "
        "executor's shared among the node's executors")] = 0

    def validate(self) -> None:
        if self.speculative_method is not None:
            _one_of(self.speculative_method, SpeculativeMethod, "--speculative-method")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("--num-speculative-tokens must be in [1, 16], got "
                              f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("--prompt-lookup-min and --prompt-lookup-max must satisfy "
                              "1 <= min <= max")
        _one_of(self.overlap_schedule, AutoOnOff, "--overlap-schedule")
        if self.grammar_threads < 0:
            raise ConfigError(f"--grammar-threads must be >= 0, got {self.grammar_threads}")
        if self.max_batch_tokens < 1:
            raise ConfigError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_running < 1:
            raise ConfigError(f"--max-running must be >= 1, got {self.max_running}")
        for name in ("max_requests_per_client", "max_queued_requests", "max_frames_per_client",
                     "max_connections_per_address"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.queue_timeout_s > 0:
            raise ConfigError("--queue-timeout must be > 0")
        if self.max_model_len < 0:
            raise ConfigError(f"--max-model-len must be >= 0, got {self.max_model_len}")


class ExecutorConfig(msgspec.Struct, frozen=True):
    model: Annotated[str | None, Flag(
        "local Hugging Face model directory (default: embedded SmolLM2-135M)")] = None
    dtype: Annotated[Dtype, Flag("the weights' and activations' dtype (auto: the "
                                 "checkpoint's)")] = "auto"
    attention_backend: Annotated[AttentionBackend, Flag("attention kernels")] = "auto"
    threads: Annotated[int, Flag(
        "torch CPU threads per executor (default 0: the usable cores less one for the node's "
        "main process, shared among the executors: 1 on a 2-core machine)")] = 0
    seed: Annotated[int, Flag("seed for --random-weights")] = 0
    random_weights: Annotated[bool, Flag(
        "draw the weights from --seed on the device; --model DIR needs only config.json (no "
        "safetensors, no tokenizer: send prompt_token_ids)")] = False
    gpu_memory_utilization: Annotated[float, Flag(
        "CUDA with --num-pages 0: fraction of GPU memory for weights, activations and the KV "
        "pool (sized after a profiling step)")] = 0.9
    cuda_graphs: Annotated[bool, Flag(
        "CUDA: run decode steps eagerly (no CUDA graphs)", name="--enforce-eager",
        invert=True)] = True
    draft_model: Annotated[str | None, Flag(
        "--speculative-method draft: the draft model's local HF directory",
        metavar="DIR")] = None
    quantization: Annotated[Literal["auto", "fp8"], Flag(
        "auto: the checkpoint's own format (FP8 checkpoints are read and dequantized); fp8: "
        "round an unquantized checkpoint's linear weights, or --random-weights', to 128x128 "
        "block FP8 (--random-weights also follows an FP8 quantization_config in "
        "config.json)")] = "auto"
    expert_parallel: Annotated[bool, Flag(
        "MoE models: spread the routed experts whole over every executor of the node (--dp x "
        "--tp ranks, E / ranks experts each; refused when that does not divide) and move each "
        "token's rows to its experts' ranks and back by all-to-all")] = False
    dp: Annotated[int, Flag(
        "data-parallel attention ranks on the node, each of --tp executors (--dp x --tp "
        "devices), each with its own batches and KV pool", metavar="N")] = 1

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization not in ("auto", "fp8"):
            raise ConfigError(f"--quantization must be auto or fp8, got {self.quantization!r}")
        if self.dp < 1:
            raise ConfigError(f"--dp must be >= 1, got {self.dp}")
        if self.random_weights and self.model is None:
            raise ConfigError("--random-weights needs --model DIR (a directory with config.json)")
        if self.dtype not in get_args(Dtype):
            raise ConfigError(
                f"--dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )


class DisaggConfig(msgspec.Struct, frozen=True):
    """Prefill/decode roles: peers, transfers, deadlines."""

    prefill_peers: Annotated[list[str], Flag(
        "decode role: a prefill node's --listen address, or dns:NAME:PORT for every address "
        "NAME resolves to, re-resolved (repeatable)", name="--prefill-peer",
        dest="prefill_peers")] = []
    peer_resolve_interval_s: Annotated[float, Flag(
        "how often dns:NAME:PORT entries of --prefill-peer and --decode-peer are resolved "
        "again (peers that appear are connected, those that vanish are treated as dead)",
        metavar="SECONDS")] = 10.0
    transfer_backend: Annotated[Literal["fabric", "cuda-ipc"], Flag(
        "how KV pages move to a decoder: libfabric writes, or CUDA IPC copies (one "
        "host)")] = "fabric"
    fabric_provider: Annotated[str, Flag("libfabric provider: tcp, shm, net, verbs, "
                                         "efa")] = "tcp"
    fabric_address: Annotated[str, Flag(
        "the local address the fabric endpoint binds and advertises to peers (default: "
        "loopback, one host; on a cluster the host or pod IP)")] = ""
    fabric_lanes: Annotated[int, Flag(
        "fabric endpoints to stripe KV writes over (one per NIC, nearest the GPU first; "
        "several on one NIC when there are fewer NICs)")] = 1
    fabric_stripe_bytes: Annotated[int, Flag(
        "with --fabric-lanes > 1: longer runs of pages are cut to this size so that every "
        "lane gets a share")] = 1 << 20
    fabric_mr_per_attempt: Annotated[AutoOnOff, Flag(
        "decode role: register the KV and context memory anew (fresh random keys) for each "
        "remote prefill attempt and revoke it when the attempt ends, so late or forged writes "
        "are refused; auto: on where registration pins nothing (tcp, shm, net), off elsewhere "
        "(verbs, efa)")] = "auto"
    local_prefill_max_tokens: Annotated[int, Flag(
        "decode role: prompts of at most this many tokens are prefilled locally")] = 0
    on_prefill_failure: Annotated[Literal["error", "retry", "local"], Flag(
        "decode role: what a failed remote prefill does to its request: error ends it, retry "
        "tries once more (disagg.remote.decode), local prefills it here")] = "error"
    prefill_timeout_s: Annotated[float, Flag(
        "seconds a remote prefill may go without progress before it fails")] = 60.0
    heartbeat_s: Annotated[float, Flag("seconds between pings to prefill peers")] = 1.0
    peer_timeout_s: Annotated[float, Flag("a peer silent this many seconds is dead")] = 5.0
    peer_share: Annotated[float, Flag(
        "prefill role: share of the job slots and of the page pool one decoder connection may "
        "hold; past it its requests get 'overloaded'", metavar="FRACTION")] = 0.5
    ownership_timeout_s: Annotated[float, Flag(
        "prefill role: a decoder must prove it owns the memory its requests name within this "
        "(challenge), else they are refused", metavar="SECONDS")] = 5.0
    # Off by default: on a slow link (tcp) it would expose the whole transfer of such a step,
    # and on one H200 it showed no gain beyond run-to-run noise (docs/BENCHMARKS.md)
    layerwise_min_tokens: Annotated[int, Flag(
        "prefill role: a step of fewer prompt tokens ships its KV in one write per "
        "destination after its last layer instead of layer by layer (fewer posts for short "
        "prompts; it exposes the whole transfer of such a step, so only for fast links); 0 "
        "(default): always layer by layer", metavar="N")] = 0

    def validate(self) -> None:
        if self.transfer_backend not in ("fabric", "cuda-ipc"):
            raise ConfigError(f"--transfer-backend must be fabric or cuda-ipc, got {self.transfer_backend!r}")
        if self.on_prefill_failure not in ("error", "retry", "local"):
            raise ConfigError(f"--on-prefill-failure must be error, retry or local, got {self.on_prefill_failure!r}")
        if not 1 <= self.fabric_lanes <= 16:
            raise ConfigError(f"--fabric-lanes must be 1..16, got {self.fabric_lanes}")
        if self.fabric_stripe_bytes < 1:
            raise ConfigError("--fabric-stripe-bytes must be >= 1")
        _one_of(self.fabric_mr_per_attempt, AutoOnOff, "--fabric-mr-per-attempt")
        if self.fabric_lanes > 1 and self.transfer_backend != "fabric":
            raise ConfigError("--fabric-lanes applies to --transfer-backend fabric only")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError("--local-prefill-max-tokens must be >= 0")
        if self.layerwise_min_tokens < 0:
            raise ConfigError("--layerwise-min-tokens must be >= 0")
        if not 0 < self.peer_share <= 1:
            raise ConfigError(f"--peer-share must be in (0, 1], got {self.peer_share}")
        _peers(self.prefill_peers, "--prefill-peer")
        for name in ("prefill_timeout_s", "heartbeat_s", "peer_timeout_s", "ownership_timeout_s",
                     "peer_resolve_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")


def _peers(specs: list[str], flag: str) -> None:
    try:
        split_specs(specs, flag)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class RouterConfig(msgspec.Struct, frozen=True):
    """``--role router``: the decode nodes it spreads requests over, and the latency
    objectives its prefill:decode advice (``/v1/disagg/advice``) plans for."""

    decode_peers: Annotated[list[str], Flag(
        "router role: a decode node's --listen address, or dns:NAME:PORT (repeatable)",
        name="--decode-peer", dest="decode_peers")] = []
    slo_ttft_ms: Annotated[float, Flag(
        "router role: time-to-first-token objective (p90) that the prefill:decode advice "
        "(/v1/disagg/advice) plans for", metavar="MS")] = 1000.0
    slo_tpot_ms: Annotated[float, Flag(
        "router role: time-per-output-token objective (p90) for the advice",
        metavar="MS")] = 50.0
    migration_limit: Annotated[int, Flag(  # disagg.serving.migration
        "router role: times a streaming request whose decode node dies or restarts is moved "
        "to another, continuing from the exact token (0: never; past it: error unavailable)",
        metavar="N")] = 3
    migration_max_tokens: Annotated[int, Flag(
        "router role: a request that streamed more tokens than this is not moved (the router "
        "keeps them, the next decoder computes them again)", metavar="N")] = 16384

    def validate(self) -> None:
        if not self.decode_peers:
            raise ConfigError("--role router needs at least one --decode-peer")
        _peers(self.decode_peers, "--decode-peer")
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ConfigError(f"SLOs must be > 0, got TTFT {self.slo_ttft_ms / 1000}s, "
                              f"TPOT {self.slo_tpot_ms / 1000}s")
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.migration_max_tokens < 1:
            raise ConfigError("--migration-max-tokens must be >= 1, got "
                              f"{self.migration_max_tokens}")


def check_devices(devices: list[str], cuda_devices: int) -> None:
    """Every ``cuda:N`` device exists on a machine with ``cuda_devices`` CUDA devices."""
    for d in devices:
        if not d.startswith("cuda"):
            continue
        index = d.partition(":")[2] or "0"
        if not index.isdigit():
            raise ConfigError(f"--devices entries must be 'cpu' or 'cuda:N', got {d!r}")
        if cuda_devices == 0:
            raise ConfigError(f"--devices {d}: no CUDA device is available here "
                              "(use --devices cpu)")
        if int(index) >= cuda_devices:
            raise ConfigError(f"--devices {d}: only {cuda_devices} CUDA device(s) here "
                              f"(cuda:0 to cuda:{cuda_devices - 1})")


class NodeConfig(msgspec.Struct, frozen=True):
    """One ``disagg-node`` process: a node (``disagg.node.Node``, any role but router) or a
    router (``disagg.actors.router.router``), and what serves beside it (HTTP, metrics)."""

    role: Annotated[Role, Flag("mixed: prefill and decode in one node; prefill or decode: "
                               "one half of a split; router: spreads requests over decode "
                               "nodes")] = "mixed"
    listen: Annotated[str, Flag("client-protocol ZeroMQ address")] = "tcp://127.0.0.1:5555"
    devices: Annotated[list[str], Flag(  # --tp repeats a lone cpu (disagg.cli.node.tp_devices)
        "comma-separated devices, one executor each: cpu or cuda:0,cuda:1",
        sep=",")] = msgspec.field(default_factory=lambda: ["cpu"])
    executor: ExecutorConfig = ExecutorConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    disagg: DisaggConfig = DisaggConfig()
    router: RouterConfig = RouterConfig()
    run_dir: str | None = None  # where ipc:// sockets live; None = a fresh temp dir
    curve_keys: Annotated[str | None, Flag(
        "authenticate and encrypt client and node-to-node sockets with the node's CURVE keys "
        "in DIR (DIR/node of `disagg-node keygen DIR`)", metavar="DIR")] = None
    step_timeout_s: Annotated[float, Flag("deadline in seconds for one executor "
                                          "step")] = 600.0
    startup_timeout_s: Annotated[float, Flag("deadline in seconds for the executors to "
                                             "load")] = 600.0
    max_restarts: Annotated[int, Flag(  # disagg.supervisor.RestartPolicy checks these two
        "when an executor dies the node stops its requests (error internal) and restarts in "
        "place on the same addresses, at most this many times within --restart-window; past "
        "that it exits with code 1 (0: never)")] = 5
    restart_window_s: Annotated[float, Flag(
        "the window --max-restarts counts restarts in", metavar="SECONDS")] = 600.0
    drain_timeout_s: Annotated[float, Flag(  # disagg.node.Node.drain
        "SIGTERM or POST /drain (--metrics-listen, from loopback) drains a mixed or decode "
        "node: it admits nothing new (new requests get 'unavailable': a router sends them "
        "elsewhere), finishes its live requests for at most this long, ends the rest "
        "'unavailable', then exits 0; SIGINT stops at once", metavar="SECONDS")] = 30.0
    http_listen: Annotated[str | None, Flag(
        "HOST:PORT for the OpenAI-compatible HTTP API (mixed, decode, router)")] = None
    served_model_name: Annotated[str | None, Flag(
        "model id in the HTTP API (default: the model directory's name)")] = None
    metrics_listen: Annotated[str | None, Flag(
        "HOST:PORT serving Prometheus /metrics (any role)")] = None
    otlp_traces_endpoint: Annotated[str | None, Flag(  # disagg.trace
        "export OpenTelemetry traces of every request over OTLP/HTTP to this URL, e.g. "
        "http://127.0.0.1:4318 (/v1/traces added to a URL without a path); needs the otel "
        "extra (any role)", metavar="URL")] = None

    def validate(self) -> None:
        _one_of(self.role, Role, "--role")
        if self.role == "router":  # the router reads these only
            self.router.validate()
            _one_of(self.cache.salt_by_tenant, AutoOnOff, "--cache-salt-by-tenant")
            if not self.disagg.peer_resolve_interval_s > 0:
                raise ConfigError("--peer-resolve-interval must be > 0")
            return
        if not self.devices:
            raise ConfigError("--devices needs at least one device")
        if not self.listen.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--listen must be a ZeroMQ address like tcp://127.0.0.1:5555, got {self.listen!r}")
        if self.role == "decode" and not self.disagg.prefill_peers:
            raise ConfigError("--role decode needs at least one --prefill-peer")
        if not self.drain_timeout_s > 0:
            raise ConfigError(f"--drain-timeout must be > 0, got {self.drain_timeout_s}")
        if self.http_listen and self.role == "prefill":
            raise ConfigError("--http-listen needs --role mixed, decode or router")
        self.disagg.validate()
        self.executor.validate()
        self.cache.validate()
        if self.cache.salt_by_tenant == "on" and not self.curve_keys:
            raise ConfigError("--cache-salt-by-tenant on needs --curve-keys: the tenants are "
                              "the CURVE client keys")
        self.scheduler.validate()
        draft = self.scheduler.speculative_method == "draft"
        if draft != (self.executor.draft_model is not None):
            raise ConfigError("--speculative-method draft and --draft-model DIR go together")
        if draft and len(self.devices) > 1:
            raise ConfigError("--speculative-method draft runs with one executor (--tp 1) for now")
        if (self.scheduler.speculative_method == "mtp" and self.role != "mixed"
                and len(self.devices) > 1):
            raise ConfigError("--speculative-method mtp on prefill and decode nodes runs with one "
                              "executor (--tp 1) for now (the MTP layer's KV moves lead rank to "
                              "lead rank)")
        dp = self.executor.dp
        if len(self.devices) % dp:
            raise ConfigError(f"--dp {dp} does not divide the {len(self.devices)} --devices "
                              "(--dp x --tp devices, one executor each)")
        if self.scheduler.speculative_method and dp > 1:
            raise ConfigError(f"--speculative-method {self.scheduler.speculative_method} is not "
                              "served with --dp > 1 yet (the ranks' steps would differ in "
                              "forwards, which expert parallelism's all-to-all cannot take)")
