"""The frontend actor and its parts (docs/ARCHITECTURE.md)."""
