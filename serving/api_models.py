"""Request bodies of the HTTP API (pydantic), after OpenAI's completions API.

Known OpenAI fields that a prefill pool cannot honour are accepted only with their neutral value
(`n=1`, `stream=false`, `echo=false`, ...) so a client never silently gets something else than it
asked for; a known field of the wrong type is a 400 naming it. Fields this API does not know
are ignored and logged, as vLLM's OpenAI server does (its clients send sampling extras such as
`top_k`, `ignore_eos`, `min_tokens`; the first token here is greedy, so they change nothing).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


class CompletionRequest(BaseModel):
    """`POST /v1/completions`.

    Attributes:
      model: the served model's name (optional; must match when given).
      prompt: text, token ids, or a batch of either (one choice per prompt).
      max_tokens: 1 (the prefill pool produces the first token only; decode runs elsewhere).
      temperature, top_p, seed: accepted; the first token is greedy (argmax).
      kv_transfer_params: vLLM's disaggregated-prefill field, accepted and ignored on input.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, strict=True, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    seed: StrictInt | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    stream: StrictBool = False
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stream", "echo")
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


class SplitRequest(BaseModel):
    """`POST /v1/workers/split`: the worker to split into its two halves."""

    model_config = ConfigDict(extra="forbid")
    worker_id: StrictInt


class MergeRequest(BaseModel):
    """`POST /v1/workers/merge`: two buddy workers to merge."""

    model_config = ConfigDict(extra="forbid")
    worker_ids: list[StrictInt] = Field(min_length=2, max_length=2)
