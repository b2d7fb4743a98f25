"""``disagg-bench serve``'s request options (pure): warm-up prompts are never measured ones,
the sampling flags map onto SamplingParams, and bad ones are refused by name."""

from __future__ import annotations

import argparse
import json

import pytest

from disagg.bench.serve import add_arguments, sampling_params, warmup_specs
from disagg.bench.workload import fixed_workload, sharegpt_workload


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(list(argv))


def test_warmup_prompts_have_the_lengths_of_measured_ones_and_never_their_content():
    for specs in (fixed_workload(10, 7, 3, 12, 0), sharegpt_workload(10, 50, 1, 64, 16)):
        warm = warmup_specs(specs, 23, 12 if specs[0].input_len == 7 else 50, 0)
        assert [w.input_len for w in warm] == [specs[i % 10].input_len for i in range(23)]
        assert [w.output_len for w in warm] == [specs[i % 10].output_len for i in range(23)]
        measured = {tuple(s.prompt_token_ids) for s in specs}
        assert not measured & {tuple(w.prompt_token_ids) for w in warm}
    # a tiny vocabulary: every prompt of that length is measured but one; the warm-up finds it
    specs = fixed_workload(3, 1, 1, 14, 0)  # ids in [10, 14): four possible prompts
    left = {(t,) for t in range(10, 14)} - {tuple(s.prompt_token_ids) for s in specs}
    assert {tuple(w.prompt_token_ids) for w in warmup_specs(specs, 5, 14, 0)} <= left


def test_sampling_flags_map_onto_sampling_params(tmp_path):
    plain = sampling_params(parse())
    assert plain.ignore_eos and plain.structured is None and plain.logprobs is None
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    for arg in (json.dumps(schema), f"@{path}"):
        p = sampling_params(parse("--json-schema", arg, "--top-logprobs", "5"))
        assert p.structured is not None and json.loads(p.structured.spec) == schema
        assert p.structured.kind == "json" and p.structured.param == "--json-schema"
        assert not p.ignore_eos  # a complete output stops
        assert p.logprobs == 5
    assert sampling_params(parse("--http", "http://h", "--n", "8")).logprobs is None


@pytest.mark.parametrize("argv, needle", [
    (["--json-schema", "{nope"], "--json-schema: not JSON"),
    (["--top-logprobs", "21"], "--top-logprobs must be in [0, 20]"),
    (["--n", "0"], "--n must be >= 1"),
    (["--n", "2"], "--n > 1 needs --http"),
    (["--n", "2", "--connect", "tcp://h:1", "--http", "http://h"], "--n > 1 needs --http"),
])
def test_bad_sampling_flags_are_refused_by_name(argv, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        sampling_params(parse(*argv))
