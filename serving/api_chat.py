"""`POST /v1/chat/completions`: OpenAI's chat API over the prefill pool.

The messages are rendered to one prompt with the model's chat template, as Hugging Face's
`apply_chat_template` does (jinja2 in an `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, `raise_exception` and `tojson` available, `add_generation_prompt` true by
default): the checkpoint's `tokenizer_config.json` `chat_template`, or `CHATML_TEMPLATE` (the
Qwen3 family's ChatML layout) for the built-in models. As there, the tokenizer's named special
tokens (`bos_token`, `eos_token`, ...) are template variables and the rendered text is tokenized
without adding special tokens again (`chat_prompt_ids`), so a template that writes `bos_token`
yields one BOS. The prompt then goes through the same path as a completion: `max_tokens` /
`max_completion_tokens` of 1, the same usage, timings and `kv_transfer_params`; the answer is a
`chat.completion` whose message holds the first token (`chat.completion.chunk` events with
`stream: true`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from serving.api_models import OpenAIRequest
from serving.tokenizer import read_tokenizer_config

# The ChatML layout of the Qwen3 family (without its tool and thinking branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatMessage(BaseModel):
    """One message: a role and text content (a string, or OpenAI's list of text parts)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text; parts other than `{"type": "text"}` are refused.

        Raises:
          ValueError: a non-text content part.
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r}: only text parts "
                                 "are supported")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(OpenAIRequest):
    """`POST /v1/chat/completions` (OpenAI's fields the pool can honour; the shared ones in
    `OpenAIRequest`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, le=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=1)
    add_generation_prompt: StrictBool = True


def load_chat_template(model_dir: str | None) -> str:
    """The chat template of a checkpoint directory (`tokenizer_config.json`'s `chat_template`,
    the "default" one of a list), else `CHATML_TEMPLATE`.

    Raises:
      ValueError: a `tokenizer_config.json` that is not a JSON object.
    """
    template = read_tokenizer_config(model_dir or None).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else CHATML_TEMPLATE


class ChatTemplate:
    """A compiled chat template.

    Args:
      source: the jinja2 template text.

    Raises:
      ValueError: the template does not compile.
    """

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool,
               special_tokens: Mapping[str, str] | None = None) -> str:
        """The prompt text of `messages` (each `{"role", "content"}`).

        Args:
          messages: the conversation.
          add_generation_prompt: end with the assistant's header.
          special_tokens: template variables such as `{"bos_token": "<s>"}` (the tokenizer's
            `special_tokens`, as Hugging Face's `special_tokens_map`); absent ones are undefined
            and render as "".

        Raises:
          ValueError: the template raised (e.g. `raise_exception` for an unsupported order).
        """
        try:
            return self._template.render(**dict(special_tokens or {}), messages=messages,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None


def chat_prompt_ids(template: ChatTemplate, tokenizer, messages: list[dict],
                    add_generation_prompt: bool, add_special_tokens: bool = False) -> list[int]:
    """The prompt token ids of `messages`, as `apply_chat_template(tokenize=True)`: rendered with
    the tokenizer's special tokens, then encoded with `add_special_tokens=False` (the template
    writes the BOS it wants; the tokenizer adds none).

    Args:
      template: the compiled chat template.
      tokenizer: `serving.tokenizer`'s (`special_tokens`, `encode(text, add_special_tokens)`).
      messages: the conversation, each `{"role", "content"}`.
      add_generation_prompt: end with the assistant's header.
      add_special_tokens: let the tokenizer add its special tokens too (vLLM's `/tokenize`
        option; a chat request never does).

    Raises:
      ValueError: the template raised, or the rendered text is not valid Unicode (a
        `UnicodeError`, e.g. a lone surrogate in a message).
    """
    text = template.render(messages, add_generation_prompt,
                           getattr(tokenizer, "special_tokens", None))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _raise(message: str):
    raise jinja2.TemplateError(message)


def chat_answer(completion: dict, request_id: str | None) -> dict:
    """A `chat.completion` body from the completion body of the rendered prompt."""
    choices = []
    for c in completion["choices"]:
        extra = {k: v for k, v in c.items() if k not in ("text", "logprobs", "index",
                                                         "finish_reason")}
        choices.append({"index": c["index"], "message": {"role": "assistant",
                                                         "content": c["text"]},
                        "finish_reason": c["finish_reason"], "logprobs": None, **extra})
    return {**completion, "id": f"chatcmpl-{request_id or uuid.uuid4().hex}",
            "object": "chat.completion", "created": int(time.time()), "choices": choices}


def chat_chunks(answer: dict) -> dict:
    """The `chat.completion` answer re-shaped for `serving.api_stream.sse_events`: each choice a
    `chat.completion.chunk` with a `delta` instead of a `message`."""
    choices = [{**{k: v for k, v in c.items() if k != "message"},
                "delta": c["message"]} for c in answer["choices"]]
    return {**answer, "object": "chat.completion.chunk", "choices": choices}
