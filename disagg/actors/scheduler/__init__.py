"""The scheduler actor and its parts (docs/ARCHITECTURE.md)."""
