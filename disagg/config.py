"""Node configuration: frozen structs layered by role (node -> scheduler / cache / executor).

CLI defaults come from these defaults. Validation names the value and the flag to change.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from disagg.remote.discovery import split_specs

ENV_PREFIX = "DISAGG_"


def env(name: str, default: str | None = None) -> str | None:
    """Read a ``DISAGG_``-prefixed environment variable (the only place they are read)."""
    return os.environ.get(ENV_PREFIX + name, default)


SPECULATIVE_METHODS = ("ngram", "draft", "mtp")  # --speculative-method


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the flag."""


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # --kv-cache-dtype


class CacheConfig(msgspec.Struct, frozen=True):
    page_size: int = 16  # tokens per page (--page-size)
    num_pages: int = 0  # 0 = size from --kv-cache-mb (CPU) or free memory (CUDA)
    kv_cache_mb: int = 256  # KV budget per executor when num_pages == 0 (--kv-cache-mb)
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (--no-prefix-caching)
    # salt each client key's requests by that key (disagg.serving.salting): auto = where CURVE
    # keys authenticate clients (--cache-salt-by-tenant)
    salt_by_tenant: Literal["auto", "on", "off"] = "auto"
    # what a KV page holds (--kv-cache-dtype): auto = the model's dtype; fp8_e4m3 = float8
    # e4m3 with scales per layer and kv head (disagg.kernels.kv_quant)
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.salt_by_tenant not in ("auto", "on", "off"):
            raise ConfigError("--cache-salt-by-tenant must be auto, on or off, got "
                              f"{self.salt_by_tenant!r}")
        if self.page_size < 1 or self.page_size > 1024:
            raise ConfigError(f"--page-size must be in [1, 1024], got {self.page_size}")
        if self.num_pages < 0:
            raise ConfigError(f"--num-pages must be >= 0, got {self.num_pages}")
        if self.num_pages == 0 and self.kv_cache_mb <= 0:
            raise ConfigError(f"--kv-cache-mb must be > 0, got {self.kv_cache_mb}")


class SchedulerConfig(msgspec.Struct, frozen=True):
    max_batch_tokens: int = 2048  # tokens per step, decode + prefill chunks (--max-batch-tokens)
    max_running: int = 256  # sequences per step (--max-running)
    max_model_len: int = 0  # 0 = the model's max_position_embeddings (--max-model-len)
    max_requests_per_client: int = 4096  # live requests per client: its key, else its connection (--max-requests-per-client)
    max_queued_requests: int = 16384  # admitted, not started, all clients (--max-queued-requests)
    queue_timeout_s: float = 600.0  # a request not started within this ends with timeout (--queue-timeout)
    max_frames_per_client: int = 8192  # client frames being handled at once (--max-frames-per-client)
    max_connections_per_address: int = 1024  # client connections carrying frames, per peer address (--max-connections-per-address)
    # speculative decoding on decode and mixed nodes: ngram (prompt lookup); None = off
    speculative_method: str | None = None  # (--speculative-method)
    num_speculative_tokens: int = 3  # drafted tokens per step and sequence (--num-speculative-tokens)
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched (--prompt-lookup-max)
    prompt_lookup_min: int = 1  # ngram: shortest n-gram matched (--prompt-lookup-min)
    # decode steps launched while the previous one runs (its host work hidden behind the
    # device's): auto = on CUDA devices, on, off (--overlap-schedule)
    overlap_schedule: str = "auto"

    def validate(self) -> None:
        if self.speculative_method is not None and (
                self.speculative_method not in SPECULATIVE_METHODS):
            raise ConfigError("--speculative-method must be ngram, draft or mtp, got "
                              f"{self.speculative_method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("--num-speculative-tokens must be in [1, 16], got "
                              f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("--prompt-lookup-min and --prompt-lookup-max must satisfy "
                              "1 <= min <= max")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ConfigError("--overlap-schedule must be auto, on or off, got "
                              f"{self.overlap_schedule!r}")
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
    model: str | None = None  # local HF directory; None = the embedded default (--model)
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (--dtype)
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer (--attention-backend)
    threads: int = 0  # torch intra-op threads; 0 = torch's default / executors (--threads)
    seed: int = 0  # seed for --random-weights
    # weights drawn from `seed` on the device; --model then needs only config.json
    random_weights: bool = False  # (--random-weights)
    # CUDA with num_pages 0: GPU fraction for weights + activations + KV pool
    gpu_memory_utilization: float = 0.9  # (--gpu-memory-utilization)
    cuda_graphs: bool = True  # CUDA: decode-only steps replay captured graphs (--enforce-eager)
    draft_model: str | None = None  # --speculative-method draft: a local HF directory (--draft-model)
    # auto: the checkpoint's own (FP8 ones dequantized at load); fp8: round an unquantized
    # checkpoint's (or --random-weights') linear weights to 128x128 block FP8 (--quantization)
    quantization: str = "auto"

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization not in ("auto", "fp8"):
            raise ConfigError(f"--quantization must be auto or fp8, got {self.quantization!r}")
        if self.random_weights and self.model is None:
            raise ConfigError("--random-weights needs --model DIR (a directory with config.json)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"--dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )


class DisaggConfig(msgspec.Struct, frozen=True):
    """Prefill/decode roles: peers, transfers, deadlines."""

    # decode: prefill nodes' --listen addresses, or dns:NAME:PORT (every address NAME
    # resolves to, re-resolved every peer_resolve_interval_s) (--prefill-peer)
    prefill_peers: list[str] = []
    peer_resolve_interval_s: float = 10.0  # (--peer-resolve-interval)
    transfer_backend: str = "fabric"  # fabric | cuda-ipc (--transfer-backend)
    fabric_provider: str = "tcp"  # tcp | shm | net | verbs | efa (--fabric-provider)
    # the address the fabric endpoint binds: peers on other hosts write to it (--fabric-address)
    fabric_address: str = ""  # empty: loopback (one host)
    fabric_lanes: int = 1  # endpoints writes are striped over, NICs nearest first (--fabric-lanes)
    fabric_stripe_bytes: int = 1 << 20  # with lanes > 1, runs cut to this (--fabric-stripe-bytes)
    # decode: register KV + context memory anew for each attempt, revoked when it ends:
    # auto (on where registration is cheap: tcp, shm, net) | on | off (--fabric-mr-per-attempt)
    fabric_mr_per_attempt: str = "auto"
    local_prefill_max_tokens: int = 0  # decode: prefill prompts this short here (--local-prefill-max-tokens)
    # error | retry | local (--on-prefill-failure; the retry rule: disagg.remote.decode)
    on_prefill_failure: Literal["error", "retry", "local"] = "error"
    prefill_timeout_s: float = 60.0  # deadline for a remote prefill's KV (--prefill-timeout)
    heartbeat_s: float = 1.0  # ping period to prefill peers (--heartbeat)
    peer_timeout_s: float = 5.0  # a peer silent this long is dead (--peer-timeout)
    # prefill: share of the job slots and of the page pool one decoder connection may hold
    peer_share: float = 0.5  # (--peer-share; 1 = no per-peer bound)
    ownership_timeout_s: float = 5.0  # prefill: a decoder proves it owns its memory within this (--ownership-timeout)
    # prefill: a step of fewer prompt tokens ships its KV in one go after its last layer
    # rather than layer by layer (--layerwise-min-tokens; 0: always layer by layer). Off by
    # default: on a slow link (tcp) it would expose the whole transfer of such a step, and on
    # one H200 it showed no gain beyond run-to-run noise (docs/BENCHMARKS.md)
    layerwise_min_tokens: int = 0

    def validate(self) -> None:
        if self.transfer_backend not in ("fabric", "cuda-ipc"):
            raise ConfigError(f"--transfer-backend must be fabric or cuda-ipc, got {self.transfer_backend!r}")
        if self.on_prefill_failure not in ("error", "retry", "local"):
            raise ConfigError(f"--on-prefill-failure must be error, retry or local, got {self.on_prefill_failure!r}")
        if not 1 <= self.fabric_lanes <= 16:
            raise ConfigError(f"--fabric-lanes must be 1..16, got {self.fabric_lanes}")
        if self.fabric_stripe_bytes < 1:
            raise ConfigError("--fabric-stripe-bytes must be >= 1")
        if self.fabric_mr_per_attempt not in ("auto", "on", "off"):
            raise ConfigError("--fabric-mr-per-attempt must be auto, on or off, "
                              f"got {self.fabric_mr_per_attempt!r}")
        if self.fabric_lanes > 1 and self.transfer_backend != "fabric":
            raise ConfigError("--fabric-lanes applies to --transfer-backend fabric only")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError("--local-prefill-max-tokens must be >= 0")
        if self.layerwise_min_tokens < 0:
            raise ConfigError("--layerwise-min-tokens must be >= 0")
        if not 0 < self.peer_share <= 1:
            raise ConfigError(f"--peer-share must be in (0, 1], got {self.peer_share}")
        try:
            split_specs(self.prefill_peers, "--prefill-peer")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("prefill_timeout_s", "heartbeat_s", "peer_timeout_s", "ownership_timeout_s",
                     "peer_resolve_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")


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
    role: str = "mixed"  # mixed | prefill | decode (--role)
    listen: str = "tcp://127.0.0.1:5555"  # client protocol socket (--listen)
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu"])  # one executor each (--devices)
    executor: ExecutorConfig = ExecutorConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    disagg: DisaggConfig = DisaggConfig()
    run_dir: str | None = None  # where ipc:// sockets live; None = a fresh temp dir
    curve_keys: str | None = None  # CURVE key directory for client and peer sockets (--curve-keys)
    step_timeout_s: float = 600.0  # deadline for one executor step (--step-timeout)
    startup_timeout_s: float = 600.0  # deadline for executors to load (--startup-timeout)

    def validate(self) -> None:
        if self.role not in ("mixed", "prefill", "decode"):
            raise ConfigError(f"--role must be mixed, prefill or decode; got {self.role!r}")
        if not self.devices:
            raise ConfigError("--devices needs at least one device")
        if not self.listen.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--listen must be a ZeroMQ address like tcp://127.0.0.1:5555, got {self.listen!r}")
        if self.role == "decode" and not self.disagg.prefill_peers:
            raise ConfigError("--role decode needs at least one --prefill-peer")
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
