"""The prefill messenger actor and its parts (docs/ARCHITECTURE.md)."""
