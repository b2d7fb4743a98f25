"""Main process <-> executor process (``ipc://``): ``StepPlan`` -> ``StepResult``;
``ExecutorReady`` once at start-up (the KV memory fd follows over a unix socket); ``Shutdown``."""

from __future__ import annotations

import msgspec

from disagg.protocol import TokenLogprobs

# ------------------------------------------------------------------ main <-> executor


class SeqChunk(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One sequence's slice of a step: ``token_ids`` at positions ``start_pos...``.

    Pages are owned by the main process's page pool; the executor only reads/writes them."""

    slot: int  # scheduler-local sequence id (stable while the request lives)
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    block_table: list[int]  # the sequence's page ids covering positions [0, start_pos + len)
    sample: bool  # sample a token after the last position of this chunk
    want_hidden: bool = False  # return the last position's hidden state (prefill context)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # sampling seed of the request
    output_index: int = 0  # index of the output token being sampled (seeds its draw)
    # speculative decoding: the last num_draft token_ids are drafts to verify (sample is set;
    # the step emits 1 .. num_draft + 1 tokens for this chunk, disagg.engine.speculative)
    num_draft: int = 0
    # draft model: propose draft_tokens drafts after token_ids (then verified as above), having
    # first run it over draft_prefix (tokens before start_pos it has not computed) and the chunk
    draft_tokens: int = 0
    draft_prefix: list[int] = []
    # mtp: the token after an unfinished chunk (its position's MTP input), -1 when none
    next_token: int = -1
    # mtp, a decoder's first chunk after a remote prefill: the model's final hidden state at
    # start_pos - 1 (the prefiller's context row, model dtype), so the MTP layer computes
    # start_pos too (the prefiller could not: it never sees the prompt's last token)
    prev_hidden: bytes = b""
    # overlapped decoding: token_ids (one token) is a placeholder for the token this slot
    # sampled in the executor's previous step, which the scheduler had not received when it
    # sent this one; the executor fills it in on the device
    follow: bool = False
    # ---- logits processors and logprobs (SamplingParams; disagg.engine.sampling). The
    # penalties' token counts travel with each step (the executor keeps no request state):
    # penalty_ids are the output tokens so far (a follow chunk's in-flight token is added on
    # the device), seen_ids the distinct prompt tokens (repetition_penalty only); both empty
    # when the request has no penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = []  # (token id, bias)
    penalty_ids: list[int] = []
    seen_ids: list[int] = []
    logprobs: int = -1  # alternatives to return with the sampled token; -1 = no logprobs
    # prompt logprobs: the first prompt_rows positions of the chunk each get the raw logprob of
    # the token after them (token_ids[r + 1], the last one's is prompt_next) with
    # prompt_logprobs alternatives; prompt_rows 0 = none
    prompt_logprobs: int = 0
    prompt_rows: int = 0
    prompt_next: int = -1
    # grammar-constrained decoding (disagg.engine.grammar, .constraints): the packed bitmask
    # of the tokens the request's grammar admits at the sampled position (little-endian int32
    # words, token t is bit t % 32 of word t // 32, ceil(vocab / 32) words); b"" = none
    allowed: bytes = b""
    # overlapped decoding of a constrained follow chunk: its mask needs the token in flight,
    # so it arrives after the step was launched, in a ``Masks`` message for this step; the
    # executor runs the step's forward pass at once and picks its tokens when the masks come
    late_mask: bool = False
    # the executors' own masks (disagg.engine.grammar_mirror): a constrained sampling chunk's
    # grammar (a GrammarDef key) for the executor's own copy of the request's matcher, which
    # fills its mask itself (the chunk goes late_mask); -1 = none. grammar_replay: the output
    # tokens before this chunk's (the copy starts over from them: the request's first chunk,
    # or its first after a preemption); grammar_prev: the last output token the scheduler had
    # applied (-1: none; a follow chunk's in flight is not), checked against the copy's
    grammar: int = -1
    grammar_replay: list[int] | None = None
    grammar_prev: int = -1


class StepPlan(msgspec.Struct, tag="step", array_like=True, gc=False, frozen=True):
    """One forward pass. Decode chunks (one token, no prefix beyond the cache) come first."""

    step_id: int
    chunks: list[SeqChunk]
    num_decodes: int
    counter_base: int = 0  # layer counter value before this step (lead rank bumps base+layer+1)
    # overlapped decoding: reply only when the next command arrives, after launching that one
    # (so its host work overlaps this step's device work)
    defer: bool = False
    # KV tiers: a reload issued layer by layer is in flight; each layer waits on its event
    # (ExecutorReady.reload_events) first, a graph replay on the last layer's
    reload_wait: bool = False
    # slots of constrained requests that ended: the executor's grammar copies of them go
    # (the executors' own masks)
    grammar_gone: list[int] = []


class StepResult(msgspec.Struct, tag="result", array_like=True, gc=False, frozen=True):
    """Sampled tokens of the chunks with ``sample=True``, in chunk order: one each, or
    ``counts[i]`` for the i-th such chunk when ``counts`` is given (speculative decoding).

    When ``hidden_rows > 0`` a second zmq frame follows: the final hidden states of the chunks
    with ``want_hidden``, in chunk order, ``[hidden_rows, hidden_size]`` in the model dtype."""

    step_id: int
    token_ids: list[int]
    error: str | None = None  # set when the step failed; the executor keeps serving
    hidden_rows: int = 0
    counts: list[int] | None = None
    drafts: list[list[int]] | None = None  # mtp: drafts per sampled chunk for its next step
    # per slot whose chunk asked (SeqChunk.logprobs >= 0): its sampled token's logprobs
    logprobs: dict[int, TokenLogprobs] | None = None
    # per slot whose chunk had prompt_rows: one entry per such row, in order
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None
    # --expert-parallel: seconds this executor spent in the MoE all-to-alls since its last
    # result (waits for the other ranks included)
    all_to_all_s: float = 0.0


class KVMemoryInfo(msgspec.Struct, frozen=True):
    """Where an executor's KV cache lives, so the main process can map it.

    kind ``memfd``: the file descriptor arrives out of band (SCM_RIGHTS) on the executor's
    handshake socket; ``cuda``: ``handle`` is the cuMem POSIX fd, also passed by SCM_RIGHTS."""

    kind: str  # "memfd" | "cuda" | "none"
    nbytes: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]  # [num_layers, num_pages, kv_parts, num_kv_heads_local, page_size, head_dim]
    # (kv_parts: K and V, 2; the MLA latent, 1)
    device: str
    spec_shape: list[int] = []  # the speculative region after it (same form), when there is one
    # FP8 pages: their scales' identity (disagg.kernels.kv_quant.scales_identity); "" otherwise
    kv_scales: str = ""
    # the model's dtype where the pages' differs (FP8): the speculative region's and the hidden
    # rows'; "" = dtype
    model_dtype: str = ""


class ExecutorReady(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    rank: int
    num_pages: int
    kv: KVMemoryInfo
    counter: str | None = None  # LayerCounter handle (lead rank only), for the main process
    # CUDA: one interprocess event per layer (their IPC handles), recorded by the main
    # process's host-tier reloads as each layer lands (disagg.engine.tier_reload)
    reload_events: list[bytes] = []
    # seconds per start phase of this executor (disagg.engine.start_phases.PHASES: spawn,
    # imports, cuda_init, weights, triton_warmup, kv_profile, kv_alloc, graph_capture, ...)
    phases: dict[str, float] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    pass


class Collect(msgspec.Struct, tag="collect", array_like=True, frozen=True):
    """Reply the deferred step's result (if any) without launching another."""


class Masks(msgspec.Struct, tag="masks", array_like=True, frozen=True):
    """The grammar masks of the deferred step ``step_id``'s ``late_mask`` chunks. The masks
    themselves are the message's next zmq frame (bulk data never rides in a control message):
    ``len(slots)`` rows of ``row_bytes`` bytes each (as ``SeqChunk.allowed``), row ``i`` slot
    ``slots[i]``'s; a late chunk without one (its request ended meanwhile) is picked
    unconstrained and its token dropped by the scheduler. Sent once per such step, before
    any later command."""

    step_id: int
    slots: list[int]
    row_bytes: int


class GrammarDef(msgspec.Struct, tag="grammar", array_like=True, frozen=True):
    """A compiled grammar (xgrammar's ``CompiledGrammar.serialize_json``) that later chunks
    name by ``key`` (``SeqChunk.grammar``), sent once before the first plan that does
    (the executors' own masks). ``vocab``: the tokenizer's ``TokenizerInfo.serialize_json``
    with the first definition, b"" after; ``drop``: keys no later chunk will name."""

    key: int
    compiled: bytes
    vocab: bytes = b""
    drop: list[int] = []


ExecutorCommand = StepPlan | Collect | Masks | GrammarDef | Shutdown
ExecutorReply = StepResult | ExecutorReady


