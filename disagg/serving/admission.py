"""Per-client admission and fairness, as pure classes (no sockets, no asyncio, no clock), and
the validation of a client's request into prompt token ids (``prepare_prompt``).

``ClientBook`` is the frontend's view of each client connection: frames it sent that the
scheduler has not finished handling (bounded in count and bytes: past either bound a frame is
answered ``overloaded`` at once), replies a slow reader has not taken yet (bounded: past
``max_backlog`` the client counts as stalled, its requests are ended and only terminal replies
are kept for it), the connection (file descriptor) each client's frames arrived on, so a
disconnect names the clients to forget, and the connections open per peer address (at most
``max_conns_per_address`` carry frames: a client without a key is one connection, so more
connections would be more shares).

``FairQueue`` is the scheduler's queue of admitted requests that have not started: one FIFO
per client, served round robin, so one client's 20,000 queued requests do not delay another
client's one; every entry carries its deadline. A *client* here is the scheduler's unit of
fairness, its tenant: the CURVE client key when keys are in use (however many connections it
opens), else the connection (``Limits`` bounds both).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from disagg.protocol import ErrorCode, GenerateRequest

if TYPE_CHECKING:  # a type only: this policy imports without the tokenizers library
    from disagg.model.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class Reply:
    payload: bytes
    terminal: bool  # ends a request (Finished, or Error naming a request)


@dataclass
class ClientState:
    inflight: int = 0  # frames forwarded, not yet handled by the scheduler
    inflight_bytes: int = 0
    sizes: collections.deque[int] = field(default_factory=collections.deque)  # in order
    backlog: collections.deque[Reply] = field(default_factory=collections.deque)
    stalled: bool = False  # stopped reading: requests ended, non-terminal replies dropped
    fd: int | None = None  # the connection its last frame came on


class ClientBook:
    def __init__(self, max_inflight: int = 8192, max_backlog: int = 4096,
                 max_inflight_bytes: int = 64 << 20, max_conns_per_address: int = 1024):
        if (max_inflight < 1 or max_backlog < 1 or max_inflight_bytes < 1
                or max_conns_per_address < 1):
            raise ValueError("max_inflight, max_backlog, max_inflight_bytes and "
                             "max_conns_per_address must be >= 1")
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.max_backlog = max_backlog
        self.max_conns_per_address = max_conns_per_address
        self.clients: dict[bytes, ClientState] = {}
        self.by_fd: dict[int, set[bytes]] = {}
        self.address_of: dict[int, str] = {}  # connection (fd) -> its peer's address
        self.conns_of: dict[str, set[int]] = {}  # peer address -> its connections admitted
        self.dropped = 0  # replies dropped for stalled or vanished clients

    def _get(self, identity: bytes) -> ClientState:
        state = self.clients.get(identity)
        if state is None:
            state = self.clients[identity] = ClientState()
        return state

    # ------------------------------------------------------------------ frames in

    def arrived(self, identity: bytes, fd: int | None, nbytes: int = 0) -> bool:
        """A frame of ``nbytes`` from ``identity`` came in on connection ``fd``. True: forward
        it to the scheduler (counted in flight); False: answer ``overloaded`` (too many frames
        or bytes in flight; one frame alone always fits)."""
        state = self._get(identity)
        if fd is not None and state.fd != fd:
            if state.fd is not None:
                self.by_fd.get(state.fd, set()).discard(identity)
            state.fd = fd
            self.by_fd.setdefault(fd, set()).add(identity)
        if state.inflight >= self.max_inflight or (
                state.inflight and state.inflight_bytes + nbytes > self.max_inflight_bytes):
            return False
        state.inflight += 1
        state.inflight_bytes += nbytes
        state.sizes.append(nbytes)
        return True

    def connection_allowed(self, fd: int | None, address: str | None) -> bool:
        """Whether frames on connection ``fd`` from peer ``address`` may be handled: its
        address has fewer than ``max_conns_per_address`` connections carrying frames, or this
        is one of them (no fd or no address known: always)."""
        if fd is None or not address:
            return True
        if fd in self.address_of:
            if self.address_of[fd] == address:
                return True
            self._drop_conn(fd)  # a reused fd: the monitor's close came first (frontend)
        conns = self.conns_of.setdefault(address, set())
        if len(conns) >= self.max_conns_per_address:
            return False
        conns.add(fd)
        self.address_of[fd] = address
        return True

    def _drop_conn(self, fd: int) -> None:
        address = self.address_of.pop(fd, None)
        if address is not None:
            conns = self.conns_of.get(address, set())
            conns.discard(fd)
            if not conns:
                self.conns_of.pop(address, None)

    def fd_of(self, identity: bytes) -> int | None:
        """The connection ``identity``'s frames came on so far (None: none yet)."""
        state = self.clients.get(identity)
        return None if state is None else state.fd

    def handled(self, identity: bytes, frames: int) -> None:
        state = self.clients.get(identity)
        if state is not None:
            for _ in range(min(frames, len(state.sizes))):  # handled in arrival order
                state.inflight_bytes -= state.sizes.popleft()
            state.inflight = len(state.sizes)

    def is_stalled(self, identity: bytes) -> bool:
        state = self.clients.get(identity)
        return state is not None and state.stalled

    # ------------------------------------------------------------------ replies out

    def must_queue(self, identity: bytes) -> bool:
        """True when replies to ``identity`` already wait: a new one goes behind them."""
        state = self.clients.get(identity)
        return state is not None and bool(state.backlog)

    def queue(self, identity: bytes, reply: Reply) -> bool:
        """Keep a reply the client's connection would not take now. Returns True when this
        reply made the client stalled (the caller ends its requests)."""
        state = self._get(identity)
        if state.stalled:
            if reply.terminal:
                state.backlog.append(reply)
            else:
                self.dropped += 1
            return False
        state.backlog.append(reply)
        if len(state.backlog) <= self.max_backlog:
            return False
        state.stalled = True
        kept = [r for r in state.backlog if r.terminal]
        self.dropped += len(state.backlog) - len(kept)
        state.backlog = collections.deque(kept)
        return True

    def pending(self) -> Iterator[tuple[bytes, collections.deque[Reply]]]:
        """Clients with queued replies, and their queues (pop from the left once sent)."""
        return ((i, s.backlog) for i, s in list(self.clients.items()) if s.backlog)

    def drained(self, identity: bytes) -> None:
        """Its backlog emptied: a stalled client that caught up is served normally again."""
        state = self.clients.get(identity)
        if state is not None and not state.backlog:
            state.stalled = False

    @property
    def backlog_size(self) -> int:
        return sum(len(s.backlog) for s in self.clients.values())

    # ------------------------------------------------------------------ connections

    def disconnected(self, fd: int) -> list[bytes]:
        """Connection ``fd`` went down: the clients whose frames came on it, forgotten."""
        gone = sorted(self.by_fd.pop(fd, set()))
        self._drop_conn(fd)
        for identity in gone:
            state = self.clients.pop(identity, None)
            if state is not None:
                self.dropped += len(state.backlog)
        return gone

    def forget(self, identity: bytes) -> None:
        """The client cannot be reached (unknown route): drop what waits for it."""
        state = self.clients.pop(identity, None)
        if state is not None:
            self.dropped += len(state.backlog)
            if state.fd is not None:
                self.by_fd.get(state.fd, set()).discard(identity)


@dataclass(eq=False)
class Queued(Generic[T]):
    client: Hashable
    item: T
    deadline: float
    removed: bool = False


class FairQueue(Generic[T]):
    """Admitted, not yet started work: a FIFO per client, popped round robin. Removal is
    O(1) (entries are marked and skipped), so a client aborting thousands at once is cheap."""

    def __init__(self) -> None:
        self.queues: collections.OrderedDict[Hashable, collections.deque[Queued[T]]] = \
            collections.OrderedDict()
        self.entries: dict[int, Queued[T]] = {}  # id(item) -> its live entry
        self.counts: collections.Counter[Hashable] = collections.Counter()

    def __len__(self) -> int:
        return len(self.entries)

    def push(self, client: Hashable, item: T, deadline: float) -> None:
        q = self.queues.get(client)
        if q is None:
            q = self.queues[client] = collections.deque()
        entry = Queued(client, item, deadline)
        q.append(entry)
        self.entries[id(item)] = entry
        self.counts[client] += 1

    def _head(self, client: Hashable) -> Queued[T] | None:
        """The client's first live entry (dropping removed ones); its FIFO goes when empty."""
        q = self.queues[client]
        while q and q[0].removed:
            q.popleft()
        if not q:
            del self.queues[client]
            return None
        return q[0]

    def _take(self, client: Hashable) -> T:
        entry = self.queues[client].popleft()
        del self.entries[id(entry.item)]
        self.counts[client] -= 1
        if not self.counts[client]:
            del self.counts[client]
        return entry.item

    def pop(self) -> T | None:
        """The head of the next client's FIFO in turn; that client moves to the back."""
        while self.queues:
            client = next(iter(self.queues))
            if self._head(client) is None:
                continue
            item = self._take(client)
            if self._head(client) is not None:
                self.queues.move_to_end(client)
            return item
        return None

    def remove(self, client: Hashable, item: T) -> bool:
        entry = self.entries.get(id(item))
        if entry is None or entry.item is not item or entry.client != client:
            return False
        entry.removed = True
        del self.entries[id(item)]
        self.counts[client] -= 1
        if not self.counts[client]:
            del self.counts[client]
        return True

    def expired(self, now: float) -> list[T]:
        """Take out every entry whose deadline has passed (each client's FIFO is in deadline
        order when pushed with one timeout, so only heads are looked at)."""
        out: list[T] = []
        for client in list(self.queues):
            while (head := self._head(client)) is not None and head.deadline <= now:
                out.append(self._take(client))
        return out

    def next_deadline(self) -> float | None:
        heads = [h.deadline for c in list(self.queues) if (h := self._head(c)) is not None]
        return min(heads) if heads else None

    def count(self, client: Hashable) -> int:
        return self.counts.get(client, 0)

    def clients(self, also: Hashable | None = None) -> int:
        """Clients with queued work, ``also`` counted as one of them."""
        return len(self.counts) + (also is not None and also not in self.counts)

    def largest(self) -> int:
        """How many the client with the most queued holds."""
        return max(self.counts.values(), default=0)

    def newest_of_largest(self) -> T | None:
        """The entry pushed last by the client with the most queued (the one to give way
        when the queue is full: ``Limits.admission``), or None when empty."""
        if not self.counts:
            return None
        client = max(self.counts, key=self.counts.__getitem__)
        q = self.queues[client]
        while q[-1].removed:  # a live entry exists: counts says so
            q.pop()
        return q[-1].item


MAX_REQUEST_ID = 256


@dataclass(frozen=True)
class Limits:
    """Admission bounds (``--max-requests-per-client``, ``--max-queued-requests``,
    ``--queue-timeout``): live requests per client (its key, or its connection without keys),
    requests admitted but not started, and how long one may wait to start.

    The queue bound is shared fairly: with ``n`` clients queueing each one's share is
    ``queued // n``. A full queue still admits a client below its share: the newest request
    of the client holding the most gives way (``overloaded``), never the newcomer."""

    per_client: int = 4096
    queued: int = 16384
    queue_timeout_s: float = 600.0

    def share(self, clients: int) -> int:
        return max(1, self.queued // max(1, clients))

    def admission(self, client_live: int, queued: int, client_queued: int = 0,
                  clients: int = 1, largest: int = 0) -> tuple[str | None, bool]:
        """(why one more request of a client is refused or None, whether the newest request
        of the largest client must give way first), for a client with ``client_live`` live
        requests of which ``client_queued`` are queued, ``queued`` queued in all by
        ``clients`` clients (this one included), the largest of them holding ``largest``."""
        if client_live >= self.per_client:
            return (f"this client has {self.per_client} live requests "
                    "(--max-requests-per-client); wait for some to finish"), False
        if queued < self.queued:
            return None, False
        share = self.share(clients)
        # below its share: another client holds more (unless the queue is smaller than the
        # clients; then only one holding two more than this one gives way, no ping-pong)
        if client_queued < share and largest > client_queued + 1:
            return None, True
        return (f"{self.queued} requests are queued (--max-queued-requests) and this client "
                f"holds {client_queued}, its share of {share} among {clients} clients; "
                "retry later"), False


@dataclass
class Counters:
    started: int = 0
    finished: int = 0
    aborted: int = 0
    errored: int = 0
    rejected: int = 0


def too_long_to_fit(chars: int, tokenizer: Any, max_tokens: int) -> bool:
    """True when a text of ``chars`` characters surely needs more than ``max_tokens`` tokens:
    each token spells at most ``tokenizer.max_token_chars`` of them (judged without
    tokenizing; False for tokenizers that do not say)."""
    per_token = getattr(tokenizer, "max_token_chars", None)
    return per_token is not None and chars > max_tokens * per_token


def prompt_size_problem(prompt: str, tokenizer: Tokenizer | None, max_model_len: int) -> str | None:
    """Why a prompt text cannot fit the context, judged from its length alone (no
    tokenizing): every token covers at most ``tokenizer.max_token_chars`` characters."""
    if tokenizer is None or not too_long_to_fit(len(prompt), tokenizer, max_model_len):
        return None
    return (f"the prompt has {len(prompt)} characters, more than {max_model_len} tokens can "
            f"hold (at most {tokenizer.max_token_chars} characters per token)")


class RequestRejected(ValueError):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def prepare_prompt(req: GenerateRequest, tokenizer: Tokenizer | None, vocab_size: int,
                   max_model_len: int, raise_hint: str = "--max-model-len",
                   ids_in_vocab: bool = False) -> list[int]:
    """Validate a GenerateRequest and return its prompt token ids (pure; raises RequestRejected).
    ``ids_in_vocab``: its ``prompt_token_ids`` were decoded for it alone and checked against the
    vocabulary on the way (taken as they are: a 32k-id scan costs ~0.7 ms on the 2-core box)."""
    if not 1 <= len(req.request_id) <= MAX_REQUEST_ID:
        raise RequestRejected("bad_request", f"request_id must have 1-{MAX_REQUEST_ID} characters")
    problem = req.validate()
    if problem:
        raise RequestRejected("bad_request", problem)
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise RequestRejected("bad_request", "give exactly one of prompt and prompt_token_ids")
    bad_stop = next((t for t in req.sampling.stop_token_ids if t >= vocab_size), None)
    if bad_stop is not None:
        raise RequestRejected("bad_request", f"stop_token_ids: token id {bad_stop} is outside "
                              f"the vocabulary [0, {vocab_size})")
    bad_bias = next((t for t in req.sampling.logit_bias if t >= vocab_size), None)
    if bad_bias is not None:
        raise RequestRejected("bad_request", f"logit_bias: token id {bad_bias} is outside "
                              f"the vocabulary [0, {vocab_size})")
    if req.prompt is not None:
        if tokenizer is None:
            raise RequestRejected("bad_request", "this model has no tokenizer; send prompt_token_ids")
        ids, checked = tokenizer.encode(req.prompt), False
    else:
        assert req.prompt_token_ids is not None  # exactly one of the two (above)
        ids, checked = ((req.prompt_token_ids, True) if ids_in_vocab
                        else (list(req.prompt_token_ids), False))
    if not ids:
        raise RequestRejected("bad_request", "the prompt is empty")
    bad = None if checked else next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected("bad_request", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestRejected(
            "bad_request",
            f"the prompt has {len(ids)} tokens but the context holds {max_model_len} "
            f"(prompt + at least one output token); shorten it or raise {raise_hint}",
        )
    if req.resume is not None:  # a stream continued here (Resume): its tokens count too
        out = req.resume.output_ids
        bad = next((t for t in out if t >= vocab_size), None)
        if bad is not None:
            raise RequestRejected("bad_request", f"resume.output_ids: token id {bad} is outside "
                                  f"the vocabulary [0, {vocab_size})")
        if len(ids) + len(out) > max_model_len:
            raise RequestRejected(
                "bad_request", f"the prompt ({len(ids)} tokens) and the resumed output "
                f"({len(out)}) exceed the context ({max_model_len}); raise {raise_hint}")
    return ids
