"""``disagg-bench SUBCOMMAND ...``: a dispatcher; each benchmark registers one subcommand.

A subcommand is a module with ``add_arguments(parser)`` and ``main(args) -> int``; add it to
``SUBCOMMANDS`` (imported lazily, so one benchmark's dependencies never load for another).
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "fabric": ("disagg.bench.fabric", "page-write bandwidth over libfabric vs. a plain C loop"),
    "serve": ("disagg.bench.serve", "open-loop serving load: TTFT, TPOT, ITL, throughput, goodput"),
    "plot": ("disagg.bench.plot", "compare disagg-bench serve runs (JSON) in one PNG"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="disagg-bench", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added from the module itself, so --help shows them.
        importlib.import_module(module).add_arguments(p)
    args = ap.parse_args(argv)
    return int(importlib.import_module(args._module).main(args))


if __name__ == "__main__":
    raise SystemExit(main())
