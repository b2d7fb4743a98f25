"""disagg-node's flags come from the config structs (disagg.cli.flags): each parses into its
field, the defaults are the structs', none is missing from the README, and none changed name,
type, default or choices (node_flags.txt; `python tests/docs/test_flags.py` rewrites it after
an intended change)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from disagg.cli import flags
from disagg.cli.node import build_parser, config_from_args
from disagg.config import (
    CacheConfig,
    ConfigError,
    DisaggConfig,
    ExecutorConfig,
    NodeConfig,
    RouterConfig,
    SchedulerConfig,
)

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SNAPSHOT = Path(__file__).with_name("node_flags.txt")
LAYERS = {"executor": ExecutorConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "disagg": DisaggConfig, "router": RouterConfig}


def options(ap: argparse.ArgumentParser) -> list[str]:
    return [o for a in ap._actions for o in a.option_strings if o.startswith("--")
            and o != "--help"]


def signature(ap: argparse.ArgumentParser) -> list[str]:
    """One line per flag: everything a caller of the command line depends on but its help."""
    out = []
    for a in ap._actions:
        if "--help" in a.option_strings:
            continue
        kind = getattr(a.type, "__name__", a.type)
        choices = list(a.choices) if a.choices is not None else None
        out.append(f"{'/'.join(a.option_strings)} {type(a).__name__} type={kind} "
                   f"default={a.default!r} choices={choices} nargs={a.nargs} dest={a.dest}")
    return sorted(out)


def parse(*argv: str) -> NodeConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_every_flag_appears_in_the_readme():
    missing = [f for f in options(build_parser())
               if not re.search(re.escape(f) + r"(?![a-z0-9-])", README)]
    assert not missing, f"flags the README never names: {missing}"


def test_no_flag_changed_its_name_type_default_or_choices():
    assert signature(build_parser()) == SNAPSHOT.read_text().splitlines()


def test_the_defaults_are_the_structs():
    assert dict(flags.layers(NodeConfig)) == LAYERS
    args = build_parser().parse_args([])
    assert flags.from_flags(NodeConfig, args) == NodeConfig()
    for name, cls in LAYERS.items():
        assert flags.from_flags(cls, args) == cls() == getattr(NodeConfig(), name)
    assert config_from_args(args) == NodeConfig()


def test_flags_land_in_their_fields():
    c = parse("--page-size", "32", "--enforce-eager", "--no-prefix-caching", "--queue-timeout",
              "5", "--dtype", "float16", "--speculative-method", "ngram", "--devices", "cpu",
              "--tp", "2", "--cache-salt-by-tenant", "off", "--max-restarts", "0")
    assert (c.cache.page_size, c.cache.prefix_caching, c.cache.salt_by_tenant) == (32, False, "off")
    assert (c.executor.cuda_graphs, c.executor.dtype) == (False, "float16")
    assert (c.scheduler.queue_timeout_s, c.scheduler.speculative_method) == (5.0, "ngram")
    assert (c.devices, c.max_restarts) == (["cpu", "cpu"], 0)
    r = parse("--role", "router", "--decode-peer", "tcp://a:1", "--decode-peer", "dns:d.svc:7",
              "--slo-ttft-ms", "250", "--http-listen", "127.0.0.1:0")
    assert r.router == RouterConfig(["tcp://a:1", "dns:d.svc:7"], 250.0, 50.0)
    assert r.http_listen == "127.0.0.1:0"


def _other_value(f: flags.FieldFlag) -> tuple[list[str], Any]:
    """(argv setting ``f`` to a value that is not its default, that value)."""
    if f.kind is bool:
        return [f.name], not f.default
    if f.choices is not None:
        v = next(c for c in f.choices if c != f.default)
        return [f.name, str(v)], v
    if f.kind is list and f.flag.sep:
        return [f.name, "cuda:0,cuda:1"], ["cuda:0", "cuda:1"]
    if f.kind is list:
        return [f.name, "tcp://a:1", f.name, "tcp://b:2"], ["tcp://a:1", "tcp://b:2"]
    if f.kind is str:
        return [f.name, "some-value"], "some-value"
    v = f.kind((f.default or 0) + 3)
    return [f.name, str(v)], v


def settings(cfg: NodeConfig) -> dict[tuple[str, str], Any]:
    """(layer, field) -> value of every flag's field; layer "" for NodeConfig's own."""
    out = {("", f.field): getattr(cfg, f.field) for f in flags.field_flags(NodeConfig)}
    for name, cls in LAYERS.items():
        out |= {(name, f.field): getattr(getattr(cfg, name), f.field)
                for f in flags.field_flags(cls)}
    return out


FLAGS = [(layer, f) for layer, cls in [("", NodeConfig), *LAYERS.items()]
         for f in flags.field_flags(cls)]


@pytest.mark.parametrize("layer, f", FLAGS, ids=[f.name for _, f in FLAGS])
def test_each_flag_sets_its_field_and_no_other(layer, f):
    argv, value = _other_value(f)
    got = settings(flags.from_flags(NodeConfig, build_parser().parse_args(argv)))
    want = settings(NodeConfig()) | {(layer, f.field): value}
    assert got == want


def test_every_setting_has_one_flag():
    made = flags.all_flags(NodeConfig)
    assert len({f.name for f in made}) == len(made) == len({f.dest for f in made})
    fields = {n for cls in (NodeConfig, *LAYERS.values()) for n in cls.__struct_fields__}
    no_flag = fields - {f.field for f in made} - set(LAYERS)
    assert no_flag == {"run_dir"}, f"fields without a flag: {no_flag}"


def test_choices_come_from_the_literal_types():
    ap = build_parser()
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    by_name = {f.name: f for f in flags.all_flags(NodeConfig)}
    assert by_name["--role"].choices == ("mixed", "prefill", "decode", "router")
    assert by_name["--speculative-method"].choices == ("ngram", "draft", "mtp")


def test_router_settings_are_checked_with_the_node_config():
    with pytest.raises(ConfigError, match="--role router needs at least one --decode-peer"):
        parse("--role", "router")
    with pytest.raises(ConfigError, match="--decode-peer 'dns:d.svc:http'"):
        parse("--role", "router", "--decode-peer", "dns:d.svc:http")
    with pytest.raises(ConfigError, match="SLOs must be > 0"):
        parse("--role", "router", "--decode-peer", "tcp://a:1", "--slo-tpot-ms", "0")
    # a router runs no executor: the node's own checks do not apply to it
    assert parse("--role", "router", "--decode-peer", "tcp://a:1", "--tp", "3",
                 "--devices", "cuda:0").devices == ["cuda:0"]


def test_a_router_config_starts_no_node():
    from disagg.node import Node

    with pytest.raises(ConfigError, match="--role router runs a router"):
        Node(NodeConfig(role="router", router=RouterConfig(["tcp://127.0.0.1:1"])))


def test_the_config_imports_nothing_above_it():
    code = ("import json, sys, disagg.config; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('disagg.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert json.loads(out) == ["disagg.config", "disagg.peer_specs"]


if __name__ == "__main__":
    SNAPSHOT.write_text("\n".join(signature(build_parser())) + "\n")
