"""The decode messenger actor and its parts (docs/ARCHITECTURE.md)."""
