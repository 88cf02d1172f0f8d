"""vLLM's auxiliary endpoints: `POST /tokenize`, `POST /detokenize`, `GET /version`.

Bodies and answers follow vLLM's OpenAI server (`vllm/entrypoints/openai/api_server.py`):
`/tokenize` takes `{"model"?, "prompt", "add_special_tokens"?}` (default true: the BOS the
tokenizer adds, as for a completion), or vLLM's chat form `{"model"?, "messages",
"add_generation_prompt"?}` (the chat template rendered as `/v1/chat/completions` renders it, so
the ids are exactly the prompt a chat request prefills; `add_special_tokens` default false), and
answers `{"count", "max_model_len", "tokens"}`;
`/detokenize` takes `{"model"?, "tokens"}` and answers `{"prompt"}`; `/version` answers
`{"version"}` (this package's version).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, model_validator

from serving.api_chat import ChatMessage


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: text (`prompt`) or a conversation (`messages`) to token ids."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


def package_version() -> str:
    """This package's installed version (`vertumnus-jax`), or "unknown" when not installed."""
    try:
        return importlib.metadata.version("vertumnus-jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_token_routes(app: FastAPI, *, tokenizer, vocab_size: int, max_model_len: int,
                     check_model: Callable[[str | None], None],
                     error: Callable[[int, str, str], Exception],
                     chat_ids: Callable[[list[dict], bool, bool], list[int]] | None = None
                     ) -> None:
    """Adds `/tokenize`, `/detokenize` and `/version` to `app`.

    Args:
      tokenizer: `encode(text, add_special_tokens) -> list[int]`, `decode(ids) -> str`
        (`serving.tokenizer`).
      vocab_size: token ids must be in `[0, vocab_size)`.
      max_model_len: reported by `/tokenize` (tokens).
      check_model: raises the API's 404 for a `model` the server does not serve.
      error: `(status, message, param) -> exception` the app answers with OpenAI's error body.
      chat_ids: `(messages, add_generation_prompt, add_special_tokens) -> ids` of the chat
        endpoint (`serving.api_chat.chat_prompt_ids` with the server's template); without it
        `messages` is a 400.
    """

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            if chat_ids is None:
                raise error(400, "this server has no chat template", "messages")
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = chat_ids(messages, body.add_generation_prompt,
                               bool(body.add_special_tokens))  # vLLM's chat default: false
            except ValueError as e:  # a bad content part, the template, invalid Unicode
                raise error(400, str(e), "messages") from None
            return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        try:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=special)
        except UnicodeError as e:
            raise error(400, f"prompt is not valid Unicode text ({e})", "prompt") from None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        check_token_ids(body.tokens, vocab_size, "tokens", error)
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": package_version()}


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str, error) -> None:
    """Raises `error(400, "<param>[k] = t is not a token id in [0, vocab_size)", param)` for the
    first id out of range (one `min` / `max` pass when all are in range)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        k, t = next((k, t) for k, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise error(400, f"{param}[{k}] = {t} is not a token id in [0, {vocab_size})", param)
