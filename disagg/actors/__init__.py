"""The node's actors: one module each. Every actor is importable and embeddable."""
