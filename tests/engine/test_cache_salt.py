"""Cache salts in the batch scheduler: a prompt cached under one salt is a hit for the same
salt only; an unsalted prompt hashes as it did before salts existed; a prefill-only job (a
prefiller's) follows the same rule."""

from __future__ import annotations

from disagg.engine.cache import PagePool, page_hashes, page_root
from disagg.engine.scheduling import BatchScheduler, Sequence
from disagg.protocol import SamplingParams

PAGE = 4
PROMPT = list(range(10, 23))  # 13 tokens: 3 full pages before the last token


def sched(page_size: int = PAGE) -> BatchScheduler:
    return BatchScheduler(PagePool(512), page_size, 64, 8, 128, prefix_caching=True,
                          cache_salt=b"model")


def seq(slot: int, salt: str | None, prompt: list[int] = PROMPT,
        prefill_only: bool = False) -> Sequence:
    return Sequence(slot, str(slot), list(prompt), SamplingParams(max_tokens=2, ignore_eos=True),
                    0, arrival=slot, cache_salt=salt, prefill_only=prefill_only)


def run(s: BatchScheduler, q: Sequence) -> int:
    """Run ``q`` to its end; its cached prompt tokens."""
    s.add(q)
    while s.has_work():
        batch = s.schedule()
        assert batch is not None
        s.update(batch, [7 for c in batch.chunks if c.sample])
        if q.prefill_only and q not in s.running and q not in s.waiting:
            break
    return q.cached_tokens


def test_same_prompt_different_salts_share_no_page_hash():
    s = sched()
    full = (len(PROMPT) - 1) // PAGE
    by_salt = {salt: s.page_hashes(seq(i, salt), full)
               for i, salt in enumerate([None, "a", "b", "tenant:a"])}
    hashes = [h for hs in by_salt.values() for h in hs]
    assert len(set(hashes)) == len(hashes) == 4 * full  # not one page hash in common
    # unsalted: the chain from the model's identity, exactly as before salts
    assert by_salt[None] == page_hashes(PROMPT, PAGE, b"model", full)
    assert page_root(b"model", None) == b"model"
    assert s.page_hashes(seq(9, "a"), full) == by_salt["a"]  # the same salt: the same hashes


def test_a_prefix_cached_under_one_salt_hits_only_for_that_salt():
    s = sched()
    assert run(s, seq(0, "a")) == 0
    assert run(s, seq(1, "b")) == 0  # another salt: computed again, nothing shared
    assert run(s, seq(2, None)) == 0  # unsalted: no hit on a salted prefix
    assert run(s, seq(3, "a")) == 3 * PAGE  # its own salt: every full page hit
    assert run(s, seq(4, "b")) == 3 * PAGE  # b's own pages are cached by now
    assert run(s, seq(5, None)) == 3 * PAGE
    assert s.prefix_hit_tokens == 3 * 3 * PAGE


def test_page_size_one_cannot_be_probed_token_by_token_across_salts():
    """With one-token pages a shared cache answers "is the next token t?" for every t: the
    attacker's probes all get the same count (its own pages), the right guess included."""
    s = sched(page_size=1)
    secret = [5, 8, 13, 21, 34, 55]
    assert run(s, seq(0, "victim", secret)) == 0
    run(s, seq(1, "attacker", secret[:2] + [99]))  # the attacker's own first two pages
    probes = {t: run(s, seq(2 + t, "attacker", secret[:2] + [t, 0])) for t in range(40)}
    assert set(probes.values()) == {2}  # secret[2] == 13 looks like every other guess
    assert run(s, seq(100, "victim", secret)) == len(secret) - 1


def test_a_prefill_job_respects_its_salt():
    s = sched()
    assert run(s, seq(0, "a", prefill_only=True)) == 0
    assert run(s, seq(1, "b", prefill_only=True)) == 0
    assert run(s, seq(2, "a", prefill_only=True)) == 3 * PAGE
