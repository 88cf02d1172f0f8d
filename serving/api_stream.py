"""`stream: true` answers of `POST /v1/completions`: server-sent events, as OpenAI and vLLM send
them (`vllm/entrypoints/openai/serving_completion.py`).

The prefill pool produces one token per prompt, so a streamed completion is, per prompt, one
chunk `{"id", "object": "text_completion", "created", "model", "choices": [{"index", "text",
"token_ids", "logprobs": null, "finish_reason": "length"}]}` carrying the first token and our
fields (worker, CP degree, epoch, timings, `kv_transfer_params`); then, with `stream_options:
{"include_usage": true}`, a chunk with `"choices": []` and `usage`; then `data: [DONE]`. Each
event is `data: <json>\\n\\n`. Errors found before the first token (bad input, 429, 503) are
answered as ordinary JSON errors with their status, as vLLM does, so a streaming client's time
to its first chunk is the time to the first token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from fastapi.responses import StreamingResponse


def sse_events(body: dict, include_usage: bool) -> Iterator[bytes]:
    """The events of a finished completion `body` (the non-streamed answer), as bytes."""
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    for choice in body["choices"]:
        yield _event({**head, "choices": [choice]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"


def streaming_response(body: dict, include_usage: bool) -> StreamingResponse:
    """`sse_events` as a `text/event-stream` response (no caching, as vLLM's)."""
    return StreamingResponse(sse_events(body, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
