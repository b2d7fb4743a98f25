"""The executor actor and its parts (docs/ARCHITECTURE.md)."""
