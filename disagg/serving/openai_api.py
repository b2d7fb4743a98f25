"""The OpenAI-compatible HTTP API as pure functions: request validation and translation into the
client protocol, response and SSE chunk shapes (prompts in ``openai_prompts``, stop strings in
``stop_strings``, logprobs shapes in ``openai_logprobs``).

No sockets and no asyncio here; ``disagg/actors/http/http.py`` drives these. Every problem with a
request raises ``ApiError`` carrying the HTTP status and the OpenAI error body.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from disagg.protocol import MAX_CACHE_SALT, MAX_TOP_LOGPROBS, SamplingParams, Usage
from disagg.protocol.structured import StructuredOutput
from disagg.serving.api_error import ApiError
from disagg.serving.openai_logprobs import MAX_COMPLETION_LOGPROBS
from disagg.serving.openai_prompts import TokenizerLike, check_text_size
from disagg.serving.openai_prompts import completion_prompts as _completion_prompts
from disagg.serving.stop_strings import StopMatcher
from disagg.serving.structured import CONSTRAINT_FIELDS, StructuredError, structured_output
from disagg.serving.tool_calls import (
    ToolError,
    ToolPlan,
    check_history,
    plan_tools,
    template_messages,
)

__all__ = ["ApiError", "StopMatcher", "TokenizerLike"]  # (defined apart, part of this API)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


# Node error codes (client protocol) -> HTTP status. ``overloaded`` (this client is over its
# bounds on the node; retry later) is 429 as OpenAI's rate limits; ``prefill_failed`` (the
# prefill node this request went to failed) is 502, an upstream failure; the node stopping or
# unreachable is 503; a deadline that passed (the node's or the gateway's) is 504.
NODE_ERROR_STATUS = {
    "bad_request": 400,
    "bad_frame": 400,
    "duplicate_request": 409,
    "unknown_request": 404,
    "overloaded": 429,
    "internal": 500,
    "prefill_failed": 502,
    "shutting_down": 503,
    "unavailable": 503,
    "timeout": 504,
}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def node_error(code: str, message: str, prompt_param: str = "prompt") -> ApiError:
    """A node's ``Error`` as the HTTP error to answer (unknown codes: 500), ``param`` the
    request parameter its message names (``node_param``)."""
    status = NODE_ERROR_STATUS.get(code, 500)
    param = node_param(message, prompt_param) if status == 400 else None
    return ApiError(status, message, error_type(status), param=param, code=code)


# The node's messages name the field they refuse first (``SamplingParams.validate``,
# ``prepare_prompt``, a constraint's ``StructuredOutput.param`` when it fails to compile):
# ``NAME: ...`` or ``NAME must ...``. Its fields as the request parameters they come from
# (a constraint's param is the parameter itself); the prompt's problems name the prompt.
_NODE_FIELDS = {name: name for name in (
    "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "cache_salt", *CONSTRAINT_FIELDS, "tool_choice")} | {"prompt_logprobs": "logprobs"}
_LEADING_NAME = re.compile(r"([a-z_]+)(?::|\s+must\b)")
_PROMPT_PROBLEM = re.compile(r"(token id -?\d+ is outside the vocabulary|the prompt\b|give "
                             r"exactly one of prompt)")


def node_param(message: str, prompt_param: str = "prompt") -> str | None:
    """The request parameter a node's refusal names (``prompt_param``: the prompt's, ``prompt``
    or ``messages``), or None where it names none the request has."""
    m = _LEADING_NAME.match(message)
    if m is not None and m.group(1) in _NODE_FIELDS:
        return _NODE_FIELDS[m.group(1)]
    if _PROMPT_PROBLEM.match(message):
        return prompt_param
    return None


# ------------------------------------------------------------------ request bodies
# Fields not listed are ignored (clients send many optional ones); listed ones are type-checked.


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    n: int | None = None  # null = 1 (OpenAI allows null for n, stream, echo)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None  # extension (vLLM): share cached prefixes only within a salt
    # output constraints (disagg.serving.structured): OpenAI's, then vLLM's extra-body keys
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None


class CompletionBody(_Common):
    prompt: str | list[Any] | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (disagg.serving.tool_calls)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatBody(_Common):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", "function": ...}
    parallel_tool_calls: bool | None = None


def decode_body(data: bytes, kind: type[msgspec.Struct]) -> Any:
    """JSON bytes -> a body struct; bad JSON or a wrong type -> 400 naming the field."""
    if not data.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


def _param_of(msg: str) -> str | None:
    marker = "at `$."
    i = msg.find(marker)
    if i < 0:
        return None
    return msg[i + len(marker):].rstrip("`").split("[")[0].split(".")[0] or None


# ------------------------------------------------------------------ translation


@dataclass
class Prepared:
    """A validated request, ready to send as a ``GenerateRequest``."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    # ---- choices and logprobs (disagg.serving.openai_logprobs)
    # every prompt of a batched /v1/completions, in order (prompts[0] is prompt_token_ids);
    # empty: just prompt_token_ids
    prompts: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)  # as sent, for echo
    n: int = 1  # choices per prompt: choice index = prompt index * n + j
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    tools: ToolPlan | None = None  # chat with tools: how its output becomes tool_calls
    prompt_param: str = "prompt"  # the parameter holding the prompt (chat: messages)
    tenant: str | None = None  # the gateway's: GenerateRequest.tenant (disagg.serving.tenants)
    traceparent: str | None = None  # the caller's HTTP traceparent header (disagg.trace)

    @property
    def all_prompts(self) -> list[list[int]]:
        return self.prompts or [self.prompt_token_ids]


def prepare_completion(body: CompletionBody, tok: TokenizerLike | None, model_name: str,
                       max_model_len: int, max_n: int = 16) -> Prepared:
    check_model(body.model, model_name)
    if body.best_of not in (None, 1):
        raise ApiError(400, f"best_of is not supported (got {body.best_of}); use n",
                       param="best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got "
                       f"{body.logprobs}", param="logprobs")
    prompts = _completion_prompts(body.prompt, tok, max_model_len)
    _check_common(body, max_n, len(prompts), tok)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    for ids, _ in prompts[1:]:
        _check_context(ids, max_tokens, max_model_len, "prompt")
    prep = _finish(body, prompts[0][0], max_tokens, max_model_len, "prompt",
                   logprobs=body.logprobs, echo=bool(body.echo))
    if len(prompts) > 1:
        prep.prompts = [ids for ids, _ in prompts]
    prep.prompt_texts = [text for _, text in prompts]
    return prep


def prepare_chat(body: ChatBody, tok: TokenizerLike | None, model_name: str,
                 max_model_len: int, max_n: int = 16, default_max_tokens: int = 0) -> Prepared:
    """``default_max_tokens``: the output cap of a request naming none (``--default-max-tokens``;
    0: up to the context limit)."""
    check_model(body.model, model_name)
    _check_common(body, max_n, 1, tok)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                       f"{body.top_logprobs}", param="top_logprobs")
    if not body.messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    if tok is None:
        raise ApiError(400, "this model has no tokenizer, so chat is unavailable; "
                       "use /v1/completions with token ids", param="messages")
    messages: list[dict[str, Any]] = [
        {"role": _message_role(m, i), "content": _message_text(m, i)}
        | {k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id),
                             ("name", m.name)) if v is not None}
        for i, m in enumerate(body.messages)]
    check_text_size(sum(len(m["content"]) for m in messages), tok, max_model_len, "messages")
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          getattr(tok, "chat_template", None))
        check_history(messages)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    try:
        text = tok.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                       **({"tools": plan.tools} if plan is not None else {}))
    except ValueError as e:  # no template
        raise ApiError(400, f"cannot build the chat prompt: {e}", param="messages") from None
    except Exception as e:  # a template error raised for this conversation (jinja2)
        raise ApiError(400, f"the chat template failed on these messages: {e}",
                       param="messages") from None
    ids = tok.encode(text)
    if not ids:
        raise ApiError(400, "the chat prompt is empty", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:  # up to the context limit (as OpenAI), capped by the default
        max_tokens = max(1, max_model_len - len(ids))
        if default_max_tokens > 0:
            max_tokens = min(max_tokens, default_max_tokens)
    forced = plan.structured() if plan is not None else None
    if forced is not None and _constraint(body) is not None:
        raise ApiError(400, f"tool_choice {body.tool_choice!r} forces the output; it cannot "
                       "have another output constraint", param="tool_choice")
    prep = _finish(body, ids, max_tokens, max_model_len, "messages",
                   logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                   structured=forced)
    prep.tools = plan
    prep.prompt_param = "messages"
    return prep


def _constraint(body: _Common) -> StructuredOutput | None:
    """The body's output constraint (``disagg.serving.structured``), 400 naming a bad one."""
    try:
        return structured_output({name: getattr(body, name) for name in CONSTRAINT_FIELDS})
    except StructuredError as e:
        raise ApiError(400, str(e), param=e.param) from None


def check_model(requested: str | None, model_name: str) -> None:
    if requested is not None and requested != model_name:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves "
                       f"`{model_name}` (see /v1/models).", param="model", code="model_not_found")


def _check_common(body: _Common, max_n: int, prompts: int, tok: TokenizerLike | None) -> None:
    """``n`` within ``--max-n`` (counting every prompt's choices) and ``logit_bias``' keys
    (token ids as strings, in the vocabulary when the gateway knows it)."""
    n = 1 if body.n is None else body.n
    if not 1 <= n or n * prompts > max_n:
        raise ApiError(400, f"n must be in [1, {max_n // max(1, prompts)}] (--max-n {max_n}"
                       + (f" over {prompts} prompts" if prompts > 1 else "") + f"), got {n}",
                       param="n")
    for key in body.logit_bias or {}:
        if not key.strip().lstrip("-").isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias")
        if tok is not None and not 0 <= int(key) < tok.vocab_size:
            raise ApiError(400, f"logit_bias: token id {key} is outside the vocabulary "
                           f"[0, {tok.vocab_size})", param="logit_bias")


def _message_role(m: ChatMessage, i: int) -> str:
    if m.role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                       f"got {m.role!r}", param=f"messages[{i}].role")
    return m.role


def _message_text(m: ChatMessage, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for p in m.content:
        if p.type != "text" or p.text is None:
            raise ApiError(400, f"messages[{i}]: only text content parts are supported, "
                           f"got {p.type!r}", param="messages")
        parts.append(p.text)
    return "".join(parts)


def _check_context(ids: list[int], max_tokens: int, max_model_len: int,
                   prompt_param: str) -> None:
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if len(ids) >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens, "
                       f"but the prompt has {len(ids)} tokens.", param=prompt_param,
                       code="context_length_exceeded")
    if len(ids) + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in "
                       f"the prompt, {max_tokens} for the completion). Reduce the prompt or "
                       "max_tokens.", param="max_tokens", code="context_length_exceeded")


def _finish(body: _Common, ids: list[int], max_tokens: int, max_model_len: int,
            prompt_param: str, logprobs: int | None = None, echo: bool = False,
            structured: StructuredOutput | None = None) -> Prepared:
    _check_context(ids, max_tokens, max_model_len, prompt_param)
    if structured is None:
        structured = _constraint(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                       param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop strings must have 1-{MAX_STOP_CHARS} characters",
                       param="stop")
    top_k = body.top_k if body.top_k is not None else 0
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_k=top_k,
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=(1.0 if body.repetition_penalty is None
                                else float(body.repetition_penalty)),
            logit_bias={int(k): float(v) for k, v in (body.logit_bias or {}).items()},
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            structured=structured,
        )
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"invalid sampling parameters: {e}") from None
    problem = sampling.validate()
    if problem is not None:
        raise ApiError(400, problem, param=problem.split()[0].rstrip(":"))
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= MAX_CACHE_SALT:
        raise ApiError(400, f"cache_salt must be a string of 1-{MAX_CACHE_SALT} characters",
                       param="cache_salt")
    return Prepared(ids, sampling, stop, bool(body.stream),
                    body.stream_options is not None and body.stream_options.include_usage,
                    body.cache_salt, n=1 if body.n is None else body.n, echo=echo,
                    logprobs=logprobs)


# ------------------------------------------------------------------ responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_dict(u: Usage) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens not recomputed (prefix cache)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None,
                        usage: Usage, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason}],
            "usage": usage_dict(usage)}


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, usage: Usage,
                  created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created or int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                 "content": text},
                                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_dict(usage)}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, include_usage: bool = False
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [{"index": 0, "text": text,
                                                        "logprobs": None,
                                                        "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [{"index": 0, "delta": delta,
                                                        "logprobs": None,
                                                        "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, model: str, created: int, object: str, usage: Usage) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": object, "created": created, "model": model, "choices": [],
            "usage": usage_dict(usage)}


_json = msgspec.json.Encoder()


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse("[DONE]")
