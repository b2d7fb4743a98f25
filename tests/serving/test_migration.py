"""The router's migration bookkeeping (``disagg.serving.migration``) and the resumed
detokenizer (``IncrementalDetokenizer.resumed``): what a moved request carries, its bounds,
and that the text streamed after a move is what the first node would have streamed."""

from __future__ import annotations

import random

import pytest

from disagg.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.protocol import GenerateRequest, Resume, SamplingParams
from disagg.serving.migration import MigrationPolicy, Progress, with_seed
from tinymodels import add_byte_bpe_tokenizer


def req(**sampling: object) -> GenerateRequest:
    return GenerateRequest("router-1", prompt_token_ids=[5, 6, 7],
                           sampling=SamplingParams(max_tokens=20, **sampling))  # type: ignore[arg-type]


def test_resume_carries_the_stream_and_the_detokenizers_place() -> None:
    p = Progress(MigrationPolicy())
    p.on_chunk([10], "a")
    p.on_chunk([11, 12], "")  # held back (an incomplete character): the window stays
    p.on_chunk([13], "b")
    p.on_chunk([14], "")
    first = req(prompt_logprobs=2, seed=9)
    nxt = p.resume(first, "router-1.m1")
    assert not isinstance(nxt, str)
    assert nxt.request_id == "router-1.m1" and nxt.resume == Resume([10, 11, 12, 13, 14], 1, 4)
    assert nxt.sampling.prompt_logprobs is None  # sent with the first chunk already
    assert nxt.sampling.max_tokens == 20 and nxt.sampling.seed == 9  # counted on by the node
    assert nxt.prompt_token_ids == first.prompt_token_ids and nxt.validate() is None
    # moved again later: every token since the start, whichever node streamed it
    p.on_chunk([15], "c")
    again = p.resume(nxt, "router-1.m2")
    assert not isinstance(again, str)
    assert again.resume == Resume([10, 11, 12, 13, 14, 15], 4, 6)


def test_nothing_streamed_resends_the_request_as_it_was() -> None:
    p = Progress(MigrationPolicy())
    nxt = p.resume(req(), "router-1.m1")
    assert not isinstance(nxt, str) and nxt.resume is None and p.migrations == 1


def test_the_migration_limit_and_the_length_cap_refuse_by_name() -> None:
    p = Progress(MigrationPolicy(limit=2))
    p.on_chunk([1], "x")
    assert not isinstance(p.resume(req(), "a"), str)
    assert not isinstance(p.resume(req(), "b"), str)
    why = p.resume(req(), "c")
    assert isinstance(why, str) and "--migration-limit 2" in why
    capped = Progress(MigrationPolicy(max_tokens=3))
    capped.on_chunk([1, 2], "x")
    assert not isinstance(capped.resume(req(), "a"), str)
    capped.on_chunk([3, 4], "y")
    why = capped.resume(req(), "b")
    assert isinstance(why, str) and "--migration-max-tokens" in why
    assert capped.streamed == 0  # nothing kept past the cap
    off = Progress(MigrationPolicy(limit=0))
    off.on_chunk([1], "x")
    assert off.streamed == 0 and "--migration-limit 0" in str(off.resume(req(), "a"))


def test_a_request_resumed_already_counts_its_streamed_part() -> None:
    p = Progress(MigrationPolicy(), Resume([3, 4], 0, 2))
    p.on_chunk([5], "z")
    nxt = p.resume(req(), "m")
    assert not isinstance(nxt, str) and nxt.resume == Resume([3, 4, 5], 2, 3)


def test_a_sampled_request_gets_a_seed_before_its_first_node() -> None:
    on = MigrationPolicy()
    seeded = with_seed(req(temperature=0.8), on, random.Random(1))
    assert seeded.sampling.seed is not None and seeded.sampling.seed < 2**63
    assert with_seed(req(temperature=0.8, seed=5), on).sampling.seed == 5
    assert with_seed(req(), on).sampling.seed is None  # greedy: nothing to draw
    assert with_seed(req(temperature=0.8), MigrationPolicy(limit=0)).sampling.seed is None


@pytest.mark.parametrize("bad", [Resume([]), Resume([1, -2]), Resume([1, 2], 2, 2),
                                 Resume([1, 2], 0, 3), Resume([1] * 21)])
def test_resume_validation_names_the_field(bad: Resume) -> None:
    why = GenerateRequest("r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=20),
                          resume=bad).validate()
    assert why is not None and "resume" in why


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("bpe")
    (path / "config.json").write_text("{}")
    add_byte_bpe_tokenizer(path)
    return Tokenizer.from_dir(path)


def test_a_resumed_detokenizer_streams_what_the_first_would_have(bpe: Tokenizer) -> None:
    """Random outputs (multi-byte characters split over tokens included) streamed in random
    chunks, cut at every point: the text after the cut, by a detokenizer resumed from what the
    router saw, equals the uninterrupted stream's, and the two halves are its whole text."""
    rng = random.Random(0)
    text = "caf\u00e9 \u2603 \U0001f600 {\"k\": [1, 2]} na\u00efve \u00fc\u00df " * 3
    ids = bpe.encode(text)
    prompt = ids[:5]
    for trial in range(20):
        out = [rng.choice(ids) for _ in range(24)] if trial % 2 else ids[5:40]
        chunks: list[list[int]] = []
        i = 0
        while i < len(out):
            n = rng.randint(1, 3)
            chunks.append(out[i:i + n])
            i += n
        whole = IncrementalDetokenizer(bpe, prompt)
        texts = [whole.push(c) for c in chunks]
        for cut in range(1, len(chunks)):
            p = Progress(MigrationPolicy())
            for c, t in zip(chunks[:cut], texts[:cut], strict=True):
                p.on_chunk(c, t)
            moved = p.resume(GenerateRequest("r", prompt_token_ids=prompt), "r.m1")
            assert not isinstance(moved, str) and moved.resume is not None
            r = moved.resume
            d = IncrementalDetokenizer.resumed(bpe, prompt, r.output_ids, r.text_prefix,
                                               r.text_read)
            assert [d.push(c) for c in chunks[cut:]] == texts[cut:], (trial, cut)
