"""The router actor and its parts (docs/ARCHITECTURE.md)."""
