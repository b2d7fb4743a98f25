"""The disk KV tier: page files with checksums (a truncated, corrupt or foreign file is a miss,
and is removed), a directory reused by a restart of the same model and ignored by another,
a full disk or an unwritable directory named in the log while the node serves on; and the
in-process engine with device, host and disk tiers token-exact with transformers, a corrupted
page file computed instead of read."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from disagg.engine import kv_disk
from disagg.engine.kv_disk import DiskError, DiskStore, identity
from disagg.engine.tier_copy import open_disk
from disagg.llm import LLM
from disagg.model.loader import load_model
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy

PAGE = 4
H = bytes(range(16))


def store(tmp_path, ident: bytes = b"i" * 32, page_bytes: int = 64) -> DiskStore:
    s = DiskStore(tmp_path, ident, page_bytes)
    s.open()
    return s


def test_a_page_file_round_trips_and_a_bad_one_is_a_miss_and_removed(tmp_path):
    s = store(tmp_path)
    payload = bytes(range(64))
    assert s.write(H, payload) and s.read(H) == payload
    raw = bytearray(s.path(H).read_bytes())
    raw[-1] ^= 1  # one bit of the payload
    s.path(H).write_bytes(raw)
    with pytest.raises(DiskError, match="checksum"):
        s.read(H)
    assert not s.path(H).exists()
    s.write(H, payload)
    s.path(H).write_bytes(s.path(H).read_bytes()[:-5])  # truncated
    with pytest.raises(DiskError, match="bytes"):
        s.read(H)
    with pytest.raises(DiskError):  # gone
        s.read(H)


def test_a_file_under_another_name_or_identity_is_refused(tmp_path):
    s = store(tmp_path)
    s.write(H, bytes(64))
    other = bytes(16)
    s.path(H).rename(s.path(other))  # a page's file under another page's name
    with pytest.raises(DiskError, match="header"):
        s.read(other)
    foreign = DiskStore(tmp_path, b"i" * 32, 64)
    foreign.ident = b"j" * 32  # same directory, another model's identity in the header
    foreign.write(H, bytes(64))
    with pytest.raises(DiskError, match="header"):
        s.read(H)


def test_a_restart_reuses_the_same_identity_and_ignores_another(tmp_path):
    a = store(tmp_path, b"a" * 32)
    for i in range(3):
        a.write(bytes([i]) * 16, bytes(64))
    (a.dir / ".x.tmp").write_bytes(b"half")  # a crash mid-write
    _, slots, kept = open_disk(str(tmp_path), 1 << 20, b"a" * 32, 64)
    assert kept == [bytes([i]) * 16 for i in range(3)] and slots > 3
    assert not (a.dir / ".x.tmp").exists()
    _, _, none = open_disk(str(tmp_path), 1 << 20, b"b" * 32, 64)
    assert none == []
    # a smaller bound keeps the newest
    _, slots, few = open_disk(str(tmp_path), 2 * a.file_bytes, b"a" * 32, 64)
    assert slots == 2 and few == [b"\x01" * 16, b"\x02" * 16]
    assert len(list(a.dir.iterdir())) == 2


def test_identity_covers_the_model_salt_and_the_page_shape():
    assert identity(b"m", 64, (1, 2)) != identity(b"n", 64, (1, 2))
    assert identity(b"m", 64, (1, 2)) != identity(b"m", 64, (1, 4))


def test_an_unwritable_directory_turns_the_disk_tier_off_with_a_message(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.ERROR, "disagg.engine.tier_copy"):
        got, slots, _ = open_disk(str(blocker / "kv"), 1 << 20, b"a" * 32, 64)
    assert got is None and slots == 0
    assert "not writable" in caplog.text and str(blocker / "kv") in caplog.text


def test_a_full_disk_is_named_and_writes_pause(tmp_path, caplog, monkeypatch):
    s = store(tmp_path)
    real_open = open

    def full(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING, "disagg.engine.kv_disk"):
        assert not s.write(H, bytes(64))
    assert "is full" in caplog.text and "serve on" in caplog.text
    monkeypatch.setattr("builtins.open", real_open)
    assert not s.write(H, bytes(64))  # paused: not tried again at once
    monkeypatch.setattr(kv_disk, "FULL_RETRY_S", 0.0)
    s._full_until = 0.0
    assert s.write(H, bytes(64))


def conversations(llm: LLM, path, histories: list[list[int]], turns: int,
                  g: torch.Generator) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for turn in range(turns):
        for c, hist in enumerate(histories):
            out = llm.generate([hist], params)[0]
            assert out.token_ids == hf_greedy(path, hist, 3), f"turn {turn} conversation {c}"
            hist += out.token_ids + torch.randint(3, 300, (2,), generator=g).tolist()


def test_three_tiers_are_token_exact_and_a_corrupt_page_file_is_computed_instead(
        tiny_models, tmp_path, caplog):
    """A 12-page device pool, an 8-page host tier and a disk tier: the conversations spill
    to disk and come back from it, token-exact. Then a fresh engine on the same directory
    (a restart) finds a conversation's pages on disk; one of its files is corrupted: that
    lookup computes the prompt (token-exact still), the file is gone, and later lookups
    read the sound files."""
    path = tiny_models["llama"]
    model = load_model(path, "float32")
    llm = LLM(model, num_pages=12, page_size=PAGE, kv_host_cache_pages=8,
              kv_disk_cache_dir=str(tmp_path))
    g = torch.Generator().manual_seed(9)
    histories = [torch.randint(3, 300, (2 * PAGE + 1,), generator=g).tolist() for _ in range(4)]
    conversations(llm, path, histories, 3, g)
    assert llm.tiers is not None and llm.tiers.disk is not None
    c = llm.tiers.counters
    assert c.hit_tokens["disk"] > 0 and c.bytes_to_disk > 0 and c.bytes_from_disk > 0
    assert llm.pool.num_free == 12 and llm.tiers.host.pinned() == 0
    on_disk = len(llm.tiers.disk)
    assert 0 < on_disk and llm.tiers.stats()["disk_cache_bytes_used"] > 0

    again = LLM(model, num_pages=12, page_size=PAGE, kv_host_cache_pages=8,
                kv_disk_cache_dir=str(tmp_path))
    assert again.tiers is not None and again.tiers.disk is not None
    assert len(again.tiers.disk) == on_disk  # reused
    files = sorted(next(tmp_path.iterdir()).iterdir())
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    files[0].write_bytes(raw)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = []
    with caplog.at_level(logging.WARNING, "disagg.engine.kv_disk"):
        for hist in histories:  # every conversation's history again, as after a restart
            out = again.generate([hist], params)[0]
            assert out.token_ids == hf_greedy(path, hist, 3)
            outs.append(out)
    assert f"{files[0]}: header or checksum does not match; a miss" in caplog.text
    if files[0].exists():  # its page, computed again, went back to disk: sound now
        again.tiers.mover.disk.read(bytes.fromhex(files[0].stem))
    t = again.tiers.counters
    assert t.hit_tokens["disk"] > 0  # the sound files served
    assert again.scheduler.prefix_hit_tokens == sum(o.cached_tokens for o in outs)
    assert t.hit_tokens["disk"] + t.hit_tokens["host"] + t.hit_tokens["device"] == sum(
        o.cached_tokens for o in outs)
    assert again.pool.num_free == 12 and again.tiers.host.pinned() == 0
