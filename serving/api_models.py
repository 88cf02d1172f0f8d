"""Request bodies of the HTTP API (pydantic), after OpenAI's completions API.

Known OpenAI fields that a prefill pool cannot honour are accepted only with their neutral value
(`n=1`, `echo=false`, ...) so a client never silently gets something else than it
asked for; a known field of the wrong type is a 400 naming it. Fields this API does not know
are ignored and logged, as vLLM's OpenAI server does (its clients send sampling extras such as
`top_k`, `ignore_eos`, `min_tokens`; the first token here is greedy, so they change nothing).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with `usage` (and no
    choices) before `data: [DONE]`."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class KVTransferParams(BaseModel):
    """vLLM's `kv_transfer_params` on input (its disaggregated-prefill proxy sends
    `{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, ...}`).

    Attributes:
      do_remote_decode: hold the prompt's KV for a decode side (`serving.api_kv`).
      do_remote_prefill: must be false: true asks a decode engine to read a KV prefilled
        elsewhere, which a prefill pool does not do.
    Other keys (the `remote_*` ones, null on the way in) are accepted and ignored.
    """

    model_config = ConfigDict(extra="allow")
    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False

    @field_validator("do_remote_prefill")
    @classmethod
    def _prefill_only(cls, v: bool) -> bool:
        if v:
            raise ValueError("do_remote_prefill=true asks this server to decode from a KV "
                             "prefilled elsewhere; this is a prefill pool (use "
                             "do_remote_decode=true to hand its KV to a decode side)")
        return v


class OpenAIRequest(BaseModel):
    """The fields `CompletionRequest` and the chat request (`serving.api_chat`) share, as
    OpenAI's: `model`, the sampling fields (accepted; the first token is greedy), `n` (1 only),
    `stream` and `stream_options`, and vLLM's `kv_transfer_params`. Unknown fields are kept
    (`extra="allow"`) for the API to log and ignore."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, strict=True, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: KVTransferParams | None = None


class CompletionRequest(OpenAIRequest):
    """`POST /v1/completions`.

    Attributes:
      model: the served model's name (optional; must match when given).
      prompt: text, token ids, or a batch of either (one choice per prompt).
      max_tokens: 1 (the prefill pool produces the first token only; decode runs elsewhere).
      temperature, top_p, seed: accepted; the first token is greedy (argmax).
      stream: answer as server-sent events (`serving.api_stream`); `stream_options` as
        OpenAI's.
      kv_transfer_params: vLLM's disaggregated-prefill field (`KVTransferParams`): with
        `do_remote_decode` the prompt's KV is held for a decode side (`serving.api_kv`).
    """

    # str | list[int] | list[str] | list[list[int]], checked by `_prompt_shape` in one pass
    # that stops at the first bad item (a pydantic union would record an error per item and
    # branch: minutes and gigabytes for a 16 MiB body of them).
    prompt: Any
    max_tokens: StrictInt = Field(1, ge=1)
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    user: str | None = None
    stop: str | list[str] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        return check_prompt_shape(v)

    @field_validator("echo")
    @classmethod
    def _false_only(cls, v: bool, info) -> bool:
        if v:
            raise ValueError(f"{info.field_name}=true is not supported by the prefill pool")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v is not None:
            raise ValueError("logprobs is not supported by the prefill pool")
        return v

    def ignored_fields(self) -> list[str]:
        """Names of the fields the request carried that this API does not know."""
        return sorted(self.model_extra or ())

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list (a single prompt becomes a batch of one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


def _is_int(x) -> bool:
    return type(x) is int  # not bool, not float: as pydantic's StrictInt


def check_prompt_shape(v):
    """`v` if it is a prompt: text, a list of token ids, a list of texts, or a list of lists of
    token ids (OpenAI's completions `prompt`).

    One pass over the items, stopping at the first bad one (cost bounded by the body's size).

    Raises:
      ValueError: naming the first item (`prompt[i]` or `prompt[i][j]`) that does not fit the
        shape of the first.
    """
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError(f"prompt must be a string, a list of token ids, a list of strings or a "
                         f"list of lists of token ids, got {type(v).__name__}")
    if not v:
        return v
    first = v[0]
    if _is_int(first):
        bad = next((i for i, x in enumerate(v) if not _is_int(x)), None)
        kind = "a token id (an integer)"
    elif isinstance(first, str):
        bad = next((i for i, x in enumerate(v) if not isinstance(x, str)), None)
        kind = "a string (a batch of texts)"
    elif isinstance(first, list):
        bad = next((i for i, x in enumerate(v) if not isinstance(x, list)), None)
        kind = "a list of token ids (a batch of token lists)"
        if bad is None:
            for i, ids in enumerate(v):
                j = next((j for j, x in enumerate(ids) if not _is_int(x)), None)
                if j is not None:
                    raise ValueError(f"prompt[{i}][{j}] must be a token id (an integer), got "
                                     f"{type(ids[j]).__name__}")
    else:
        raise ValueError(f"prompt[0] must be a token id, a string or a list of token ids, got "
                         f"{type(first).__name__}")
    if bad is not None:
        raise ValueError(f"prompt[{bad}] must be {kind} as prompt[0] is, got "
                         f"{type(v[bad]).__name__}")
    return v


class SplitRequest(BaseModel):
    """`POST /v1/workers/split`: the worker to split into its two halves, or into `parts` (CP
    degrees in device order that repeated halving makes, e.g. [1, 1, 2] of a CP-4 worker) in
    one re-carve."""

    model_config = ConfigDict(extra="forbid")
    worker_id: StrictInt
    parts: list[StrictInt] | None = Field(default=None, min_length=2, max_length=64)


class MergeRequest(BaseModel):
    """`POST /v1/workers/merge`: two buddy workers to merge."""

    model_config = ConfigDict(extra="forbid")
    worker_ids: list[StrictInt] = Field(min_length=2, max_length=2)
