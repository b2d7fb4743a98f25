"""disagg-bench: benchmark entry points (one subcommand each; results go to docs/BENCHMARKS.md)."""
