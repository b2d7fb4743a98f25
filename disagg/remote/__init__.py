"""Remote prefill as pure state machines, one per side of the split.

``decode``: a decode node's remote prefills: the queue waiting for pages, each attempt's
lifecycle (waiting -> draining -> fenced), the one retry rule, and every page a write may still
reach. ``prefill``: a prefill node's jobs: held back by the peer's share, computing, settling,
ended. No sockets, no asyncio, no clock of their own: the actors feed events in (with the time)
and carry the commands out. See docs/ARCHITECTURE.md for the diagrams.
"""
