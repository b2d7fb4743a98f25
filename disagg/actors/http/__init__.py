"""The http actor and its parts (docs/ARCHITECTURE.md)."""
