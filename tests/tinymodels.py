"""Test helpers shared by the suites: tiny random HF models, the HF oracle, node processes.

(Not in conftest.py: ``tests/kernels`` has its own conftest, and two modules named
``conftest`` shadow each other on sys.path.)"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


# MoE / MLA families: a few experts, yarn rope on DeepSeek (its mscale on the softmax scale)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_shared_experts=1)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def make_tiny_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF model of ``kind`` (one of ``FAMILIES``) as float32 safetensors;
    ``overrides`` change its config (e.g. ``norm_topk_prob``, ``q_lora_rank``)."""
    import transformers

    cfg_kw = dict(TINY, **overrides)
    if kind in ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
        return _make_sparse(kind, path, seed, overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **cfg_kw,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**cfg_kw)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **cfg_kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():  # break symmetry so greedy paths are not trivially constant
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    return path


def _make_sparse(kind: str, path: Path, seed: int, overrides: dict) -> Path:
    """MoE and MLA families, with weights drawn wider than Hugging Face's default (std 0.02
    leaves routers and latents nearly uniform) and a random V3 correction bias."""
    import transformers

    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**{**TINY, **MOE, "shared_expert_intermediate_size": 48,
                                             **overrides})
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**TINY, **MOE, "head_dim": 16, "norm_topk_prob": True,
                                             **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**{**TINY, **DEEPSEEK, "q_lora_rank": None,
                                               "rope_parameters": dict(YARN), **overrides})
        cls = transformers.DeepseekV2ForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(**{**TINY, **DEEPSEEK, "q_lora_rank": 24, "n_group": 4,
                                               "topk_group": 2, "rope_parameters": dict(YARN),
                                               **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    cfg.initializer_range = 0.08
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    return path


def add_mtp_layer(path: Path, seed: int = 0, copy_last: bool = False) -> Path:
    """Give a tiny DeepSeek-V3 checkpoint one multi-token-prediction layer
    (``model.layers.{L}.*``, as DeepSeek ships it; transformers' model ignores it): random
    tensors shaped like the last layer's, or (``copy_last``) its copies, plus ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``; ``num_nextn_predict_layers`` 1."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = f"model.layers.{layers - 1}."
    tensors = {}
    for name, file in index["weight_map"].items():
        if name.startswith(last):
            with safe_open(str(path / file), "pt") as f:
                t = f.get_tensor(name)
            new = name.replace(last, f"model.layers.{layers}.")
            tensors[new] = t.clone() if copy_last or t.dim() == 1 else (
                torch.randn(t.shape, generator=gen) * 0.08)
    mtp = f"model.layers.{layers}."
    tensors[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[mtp + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.08
    tensors[mtp + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"),
              metadata={"format": "pt"})
    index["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    index_path.write_text(json.dumps(index))
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt):].tolist()


def add_word_tokenizer(path: Path, vocab_size: int = TINY["vocab_size"]) -> None:
    """A word-level tokenizer (``w0 .. wN``) so text prompts work on tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


class NodeProcess:
    """A real ``disagg-node`` process; ``stop()`` checks that no child outlives it."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 entry: Sequence[str] = ("-m", "disagg")):
        import os
        import subprocess
        import sys

        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, *entry, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready" in self.log_path.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        raise TimeoutError(f"node not ready:\n{self.log_path.read_text()}")

    def children(self) -> list[int]:
        out = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("PPid:") and int(line.split()[1]) == self.proc.pid:
                    out.append(int(status.parent.name))
        return out

    def stop(self, sig: int | None = None) -> list[int]:
        """Signal the node (SIGINT: stop at once; SIGTERM would drain it first), wait for it;
        returns the pids of children still alive (want [])."""
        import os
        import signal
        import time

        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGINT)
            self.proc.wait(timeout=30)
        self.log.close()
        deadline = time.monotonic() + 10
        alive = kids
        while alive and time.monotonic() < deadline:
            alive = [k for k in kids if Path(f"/proc/{k}").exists()
                     and "State:\tZ" not in Path(f"/proc/{k}/status").read_text()]
            time.sleep(0.05)
        for k in alive:
            os.kill(k, signal.SIGKILL)
        return alive


_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, below the kernel's ephemeral range: a port the
    kernel handed out (bind to 0) can be taken as the local port of some outgoing connection
    before the node binds it ("Address already in use"); one below the range cannot."""
    import random
    import socket
    from pathlib import Path

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    # pytest-xdist workers (gw0, gw1, ...) draw from disjoint slices: their picks cannot meet
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % count if worker[2:].isdigit() else 0
    base = max(1024, low - 12000)
    span = (low - base) // count
    first = base + index * span
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(first, first + span)
        if port in _PORTS:  # handed out to an earlier node of this test process
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def node_pid(addr: str) -> int:
    """The pid of the node process started with ``--listen addr``."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--listen" in args and args[args.index(b"--listen") + 1:][:1] == [addr.encode()]:
            return int(cmdline.parent.name)
    raise LookupError(f"no node listens on {addr}")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process and its direct children (a node and its
    executors) have used so far."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def tree_rss_kb(pid: int) -> int:
    """VmRSS (kB) of a process plus its direct children (a node and its executors)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        me = int(status.parent.name)
        if me == pid or int(fields.get("PPid", "0").strip() or 0) == pid:
            total += int(fields.get("VmRSS", "0 kB").split()[0])
    return total


def listening_tcp(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket (v4 and v6) a process holds open."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = str(ipaddress.IPv6Address(raw))
            else:
                addr = str(ipaddress.IPv4Address(raw[::-1]))
            out.append((addr, int(hexport, 16)))
    return out


def add_byte_bpe_tokenizer(path: Path, vocab_size: int = TINY["vocab_size"],
                           chat_template: str | None = None) -> None:
    """A byte-level BPE tokenizer (as SmolLM2's, Llama 3's, Qwen's) trained on a little JSON,
    ``<pad>`` ``<s>`` ``</s>`` at ids 0-2 (the tiny models' EOS is 2): every text encodes, so
    grammar-constrained decoding works on tiny models. ``chat_template`` goes into its
    ``tokenizer_config.json``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [json.dumps({"name": f"item{i}", "count": i, "tags": ["a", "b"], "ok": i % 2 == 0,
                          "nested": {"x": i * 1.5, "y": None}}) for i in range(200)]
    corpus += ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
               "<tool_call>\n</tool_call> the weather in Paris is sunny"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
