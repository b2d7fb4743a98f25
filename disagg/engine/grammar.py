"""Grammar-constrained decoding on the host (xgrammar): compiling a request's constraint
(``disagg.protocol.structured.StructuredOutput``) and one matcher per constrained request.

Only the node that samples (mixed or decode) holds these: the scheduler process compiles a
request's constraint when it admits it (``Grammars.compile_bounded``, off the event loop with
a time bound, fairly between tenants: ``disagg.actors.scheduler.intake``), keeps the request's
``GrammarState`` on its ``Sequence`` and, each step the sequence samples in, sends the packed
bitmask of the tokens its grammar admits next (``GrammarState.mask``, ``SeqChunk.allowed``);
the executor applies it to the row's logits on the device (``disagg.engine.constraints``) and
the sampled token advances the matcher when the step's result comes back
(``BatchScheduler.update``; with overlapped decoding ahead of it, on threads, with the next
masks: ``disagg.engine.grammar_pass``). The first output token is constrained like the others (its mask
is the initial state's), on either node.

xgrammar is an optional dependency (the ``structured`` extra): without it ``Grammars`` refuses
every constrained request by name, never serving one unconstrained.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
import threading
from typing import TYPE_CHECKING, Any

from disagg.protocol.structured import StructuredOutput

if TYPE_CHECKING:
    from disagg.model.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0  # a constraint whose compilation takes longer is refused
# compiles within their time at once, a tenant's at most one fewer (so one tenant's slow ones
# never hold them all); one past its time gives its slot up and goes on in the background
COMPILE_THREADS = 2
MAX_STUCK = 2  # compiles past their time still running; at this many, new ones are refused
CACHE_ENTRIES = 256  # compiled grammars kept, by salt + constraint (least recently used dropped)
EXTRA = "structured"  # the pip extra that installs xgrammar


class GrammarError(ValueError):
    """A constraint that cannot be served; the message names the request parameter."""


class GrammarBusy(GrammarError):
    """A constraint not compiled because the node is busy compiling others (retry later)."""


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask: token t is bit ``t % 32`` of word ``t // 32``."""
    return -(-vocab_size // 32)


def tokenizer_info(tok: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's ``TokenizerInfo`` from the node's own tokenizer: its encoded vocabulary (by
    id; ids the tokenizer lacks and special tokens other than ``stop_ids`` are empty, never
    admitted), the vocabulary type and prefix-space
    rule read from its ``tokenizer.json`` (byte-level BPE for SmolLM2, Llama 3, Qwen; byte
    fallback for SentencePiece ones), ``vocab_size`` the model's logits (may exceed the
    tokenizer's) and ``stop_ids`` the model's EOS tokens (what ends a complete output)."""
    import xgrammar as xgr

    backend = tok.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab_size, max(vocab.values(), default=-1) + 1)
    encoded = [""] * size
    for text, i in vocab.items():
        encoded[i] = text
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i not in stop_ids and i < size:
            encoded[i] = ""  # a special token (BOS, pad, tool markers) is never text to admit
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=size,
                             stop_token_ids=list(stop_ids),
                             add_prefix_space=meta["add_prefix_space"])


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # EBNF string literals escape as JSON's


# a compiled constraint's: the request's cache salt ("" for none) and StructuredOutput.key.
# Salted like the prefix cache (disagg.serving.salting): a request finding a constraint compiled
# (sooner, or waiting on a compile under way) would learn that another client sent it, so
# differently salted requests never share a compile, a cached one or a refusal of a slow one.
Key = tuple[str, tuple[str, str, tuple[str, ...]]]


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, caching them by cache salt and
    constraint (``Key``).
    ``compile`` may run on worker threads (xgrammar releases the GIL); it raises
    ``GrammarError`` for a constraint that is invalid or admits no output."""

    def __init__(self, tok: Tokenizer | None, vocab_size: int, stop_ids: tuple[int, ...],
                 refuse: str | None = None):
        """``refuse``: why this node serves no constraint at all (e.g. speculative decoding),
        said in every refusal."""
        self.tok, self.vocab_size, self.stop_ids = tok, vocab_size, stop_ids
        self.refuse = refuse
        self._compiler: Any = None
        self._info: Any = None
        self._lock = threading.Lock()  # the cache's (held briefly: the event loop takes it)
        self._ensuring = threading.Lock()  # building the compiler (slow: a thread's)
        self._cache: collections.OrderedDict[Key, Any] = collections.OrderedDict()
        # the event loop's (compile_bounded): compiles running by constraint, those within
        # their time by tenant, the constraints of those past it, requests awaiting a slot
        self._running: dict[Key, asyncio.Future[Any]] = {}
        self._within: collections.Counter[bytes] = collections.Counter()
        self._past: set[Key] = set()
        self._waiting: list[tuple[bytes, asyncio.Future[None]]] = []

    @functools.cached_property
    def threads(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads compiles run on (off the event loop): one each, as ``compile_bounded``
        starts none past ``COMPILE_THREADS`` within their time and ``MAX_STUCK`` past it."""
        return concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS + MAX_STUCK,
                                                     thread_name_prefix="grammar")

    def unavailable(self, param: str) -> str | None:
        """Why a constraint from ``param`` cannot be served here at all, or None."""
        if self.refuse is not None:
            return f"{param}: {self.refuse}"
        if self.tok is None:
            return f"{param}: this model has no tokenizer, so its output cannot be constrained"
        if not xgrammar_available():
            return (f"{param}: constrained decoding needs xgrammar, which is not installed on "
                    f"this node (pip install 'disagg[{EXTRA}]')")
        return None

    def _ensure(self) -> Any:
        with self._ensuring:
            if self._compiler is None:
                import xgrammar as xgr

                assert self.tok is not None
                self._info = tokenizer_info(self.tok, self.vocab_size, self.stop_ids)
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2,
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutput, salt: str | None = None) -> GrammarState:
        """A fresh matcher for ``so`` (compiled once per distinct constraint and salt)."""
        why = self.unavailable(so.param) or so.validate()
        if why is not None:
            raise GrammarError(why)
        key = (salt or "", so.key())
        compiled = self._cached(key)
        return GrammarState(self._compiled(so, key) if compiled is None else compiled,
                            self._info.vocab_size)

    async def compile_bounded(self, so: StructuredOutput, tenant: bytes,
                              salt: str | None = None) -> GrammarState:
        """``compile`` for a request of ``tenant``, on the event loop: cached, or waiting on the
        same constraint's compile under way, or compiled on a thread of its own within
        ``COMPILE_TIMEOUT_S`` (a slot waited for included). Fair: a tenant's compiles within
        their time hold at most ``COMPILE_THREADS - 1`` slots (at least one), so its slow ones
        never hold every slot. One past its time goes on (cached when it ends) without its
        slot; while ``MAX_STUCK`` do, an uncached constraint is refused at once
        (``GrammarBusy``, as is one that got no slot in time). ``salt``: the request's cache
        salt; only requests of the same salt share a compile (``Key``)."""
        why = self.unavailable(so.param) or so.validate()
        if why is not None:
            raise GrammarError(why)
        key, waited = (salt or "", so.key()), False
        try:
            async with asyncio.timeout(COMPILE_TIMEOUT_S):
                while (compiled := self._cached(key)) is None:
                    if key in self._past:  # this one's compile already took too long
                        raise TimeoutError
                    running = self._running.get(key)
                    if running is None:
                        if len(self._past) >= MAX_STUCK:
                            raise GrammarBusy(
                                f"{so.param}: not compiled: the node is busy compiling slow "
                                f"constraints ({len(self._past)} past {COMPILE_TIMEOUT_S:g} s);"
                                " try again later")
                        waited = True
                        await self._slot(tenant)
                        waited = False
                        if (key in self._running or self._cached(key) is not None
                                or len(self._past) >= MAX_STUCK):
                            self._release(tenant)  # done, started or refused meanwhile
                            continue
                        running = self._start(so, key, tenant)
                    compiled = await asyncio.shield(running)  # a waiter's timeout leaves it
        except TimeoutError:
            if waited:
                raise GrammarBusy(f"{so.param}: no compile slot came free within "
                                  f"{COMPILE_TIMEOUT_S:g} s: the node is busy compiling other "
                                  "constraints; try again later") from None
            raise GrammarError(f"{so.param}: compiling the {so.kind} constraint took longer "
                               f"than {COMPILE_TIMEOUT_S:g} s; simplify it") from None
        return GrammarState(compiled, self._info.vocab_size)

    async def _slot(self, tenant: bytes) -> None:
        """Wait for a compile slot of ``tenant`` (given in order of asking, to a tenant below
        its share)."""
        got: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((tenant, got))
        self._grant()
        try:
            await got
        except BaseException:  # timed out: the slot, if given meanwhile, goes to the next
            if got.done() and not got.cancelled():
                self._release(tenant)
            else:
                self._waiting.remove((tenant, got))
            raise

    def _grant(self) -> None:
        share = max(1, COMPILE_THREADS - 1)
        for tenant, got in list(self._waiting):
            if sum(self._within.values()) >= COMPILE_THREADS:
                return
            if self._within[tenant] < share:
                self._waiting.remove((tenant, got))
                self._within[tenant] += 1
                got.set_result(None)

    def _release(self, tenant: bytes) -> None:
        self._within[tenant] -= 1
        if self._within[tenant] <= 0:
            del self._within[tenant]
        self._grant()

    def _start(self, so: StructuredOutput, key: Key, tenant: bytes) -> asyncio.Future[Any]:
        """Compile ``so`` on a thread, holding ``tenant``'s slot until it ends or its time is
        past (then it counts in ``_past`` until it ends)."""
        loop = asyncio.get_running_loop()
        running = self._running[key] = loop.run_in_executor(self.threads, self._compiled, so, key)

        def past() -> None:
            self._past.add(key)
            self._release(tenant)

        timer = loop.call_later(COMPILE_TIMEOUT_S, past)

        def ended(_: asyncio.Future[Any]) -> None:
            timer.cancel()
            del self._running[key]
            if key in self._past:
                self._past.discard(key)
            else:
                self._release(tenant)
            if not running.cancelled():
                running.exception()  # retrieved: its waiters may all have timed out

        running.add_done_callback(ended)
        return running

    def vocab_json(self) -> bytes:
        """The tokenizer's ``TokenizerInfo`` serialized (what an executor's copies of the
        matchers compile against: ``disagg.engine.grammar_mirror``); built on first use."""
        self._ensure()
        return str(self._info.serialize_json()).encode()

    def _cached(self, key: Key) -> Any:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _compiled(self, so: StructuredOutput, key: Key) -> Any:
        """``so`` compiled now and cached under ``key`` (checked: one admitting no output is
        refused)."""
        compiled = self._compile(self._ensure(), so)
        if not GrammarState(compiled, self._info.vocab_size).satisfiable():
            raise GrammarError(f"{so.param}: the {so.kind} constraint admits no output")
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, compiler: Any, so: StructuredOutput) -> Any:
        try:
            if so.kind == "json":
                try:
                    schema = json.loads(so.spec)
                except ValueError as e:
                    raise GrammarError(f"{so.param}: the JSON schema is not valid JSON: {e}"
                                       ) from None
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"{so.param}: a JSON schema is an object or a boolean")
                return compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "grammar":
                return compiler.compile_grammar(so.spec)
            alternatives = " | ".join(_ebnf_literal(c) for c in so.choices)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise GrammarError(f"{so.param}: invalid {_WHAT[so.kind]}: {_strip_location(reason)}"
                               ) from None


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "grammar": "grammar", "choice": "choice"}


def _strip_location(reason: str) -> str:
    """xgrammar's message without its ``[time] source.cc:line:`` prefix."""
    if reason.startswith("[") and ": " in reason:
        head, _, rest = reason.partition("] ")
        if ".cc:" in rest.split(" ", 1)[0]:
            return rest.split(": ", 1)[-1]
    return reason


class GrammarState:
    """One request's matcher: the bitmask of what it admits next, advanced token by token."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self.compiled = compiled  # (its identity keys the executors' copies: grammar_mirror)
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.failed = False  # a token the grammar does not admit was fed (not expected)
        # a token accepted ahead of the scheduler's update (``GrammarPass``), with whether it
        # was admitted: the update's ``accept`` of that token takes it instead of feeding it
        self._ahead: tuple[int, bool] | None = None
        # whether the output is complete, as the pass's thread saw it after the token it
        # accepted ahead (None: ask the matcher): that thread may still be filling this
        # matcher's next mask, so nothing calls into it then
        self._ended: bool | None = None

    def mask(self) -> bytes:
        """The packed bitmask (``bitmask_words(vocab_size)`` little-endian int32 words) of the
        tokens admitted next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return bytes(self._bitmask.numpy().tobytes())

    def satisfiable(self) -> bool:
        """Some token is admitted at the start (a grammar admitting nothing is refused)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return bool(self._bitmask.any().item())

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not admit it (the matcher stays
        where it was, ``failed`` is set). A token already accepted ahead is taken as it was
        (another token than that one: RuntimeError, the matcher would be a token ahead)."""
        if self._ahead is not None:
            (ahead, ok), self._ahead = self._ahead, None
            if ahead != token:
                raise RuntimeError(f"grammar: token {token} applied where {ahead} was "
                                   "accepted ahead")
            return ok
        self._ended = None
        ok = bool(self._matcher.accept_token(token))
        if not ok:
            self.failed = True
        return ok

    def accepted_ahead(self, token: int, ok: bool) -> None:
        """``token`` was fed to the matcher ahead of the update that applies it (a
        ``GrammarPass``, on its thread), which admitted it or not (``ok``)."""
        if not ok:
            self.failed = True
        self._ahead = (token, ok)
        self._ended = self.failed or bool(self._matcher.is_terminated())

    @property
    def terminated(self) -> bool:
        """The output is complete (the grammar accepted a stop token, or failed); after a
        token accepted ahead, as it was then (no call into the matcher, which the pass may
        be filling a mask from)."""
        if self.failed:
            return True
        if self._ended is not None:
            return self._ended
        return bool(self._matcher.is_terminated())
