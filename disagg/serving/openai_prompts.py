"""The prompts of an OpenAI request as token ids: a completion's prompt or batch of prompts,
and the size check a text gets before it is tokenized (pure; ``disagg.serving.openai_api``)."""

from __future__ import annotations

from typing import Any, Protocol

from disagg.serving.admission import too_long_to_fit
from disagg.serving.api_error import ApiError

MAX_BATCHED_PROMPTS = 256


class TokenizerLike(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kw: Any) -> str: ...


def check_text_size(chars: int, tok: TokenizerLike, max_model_len: int, param: str) -> None:
    """Refuse a text that cannot fit the context from its length alone, before the chat
    template or the tokenizer spend time on it (a token spells at most ``max_token_chars``)."""
    if too_long_to_fit(chars, tok, max_model_len):
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens, "
                       f"but the prompt has {chars} characters (more than that many tokens "
                       "can spell).", param=param, code="context_length_exceeded")


def completion_prompts(prompt: str | list[Any] | None, tok: TokenizerLike | None,
                        max_model_len: int) -> list[tuple[list[int], str | None]]:
    """The prompt or the batch of prompts (a list of strings or of token-id lists, at most
    MAX_BATCHED_PROMPTS): (ids, text as sent or None) each."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) > MAX_BATCHED_PROMPTS:
            raise ApiError(400, f"at most {MAX_BATCHED_PROMPTS} prompts in a batch, got "
                           f"{len(prompt)}", param="prompt")
        return [(_completion_prompt(p, tok, max_model_len), p if isinstance(p, str) else None)
                for p in prompt]
    return [(_completion_prompt(prompt, tok, max_model_len),
             prompt if isinstance(prompt, str) else None)]


def _completion_prompt(prompt: str | list[Any] | None, tok: TokenizerLike | None,
                       max_model_len: int) -> list[int]:
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this model has no tokenizer; send the prompt as token ids",
                           param="prompt")
        check_text_size(len(prompt), tok, max_model_len, "prompt")
        ids = tok.encode(prompt)
    elif isinstance(prompt, list) and all(type(x) is int for x in prompt):
        ids = list(prompt)
        vocab = tok.vocab_size if tok is not None else None
        bad = [x for x in ids if x < 0 or (vocab is not None and x >= vocab)]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of "
                       "either", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids
