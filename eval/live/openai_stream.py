"""The client of any OpenAI-compatible server (vLLM, SGLang, this project's): `/v1/models` and
streamed `/v1/completions`, timed as `vllm bench serve` times them.

`post_stream` sends one completion with token ids as the prompt (`"prompt": [ints]`, which
vLLM and SGLang accept), `max_tokens`, `stream: true` and `stream_options: {"include_usage":
true}`, and reads the server-sent events from httpx's streamed response
(`vllm/benchmarks/lib/endpoint_request_func.py` does the same over aiohttp):

- TTFT is the time from sending to the first `data:` event whose `choices` carry a token (a
  `text`, possibly empty for a special token, or `token_ids`); each later token-carrying event
  adds an inter-token latency; the latency ends at the last one;
- a usage event (`"choices": []`) gives `completion_tokens` and, when the server reports them,
  `prompt_tokens_details.cached_tokens`; `data: [DONE]` ends the stream;
- an HTTP error status, a connection error, the client's timeout passing for the whole request
  (not only between reads), a malformed event, an `error` event (vLLM sends one mid-stream) or
  a stream without a token make a failed request with the reason (`HTTP 500: ...`), never an
  exception.

Events are parsed by `httpx-sse` (the SSE standard: fields per line, `:` comments skipped, a
blank line ends an event, multi-line `data` joined with newlines).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from httpx_sse import aconnect_sse

from eval.live.bench_result import RequestOutput
from serving.policy.request import Request, RequestRecord


def _error_message(status: int, body: bytes) -> str:
    """`HTTP <status>: <the error's message, or the body's first 200 characters>`."""
    text = body.decode("utf-8", "replace")
    try:  # OpenAI's {"error": {"message"}}, or vLLM's older {"object": "error", "message"}
        obj = json.loads(text)
        err = obj.get("error", obj)
        msg = str(err.get("message", text)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = text
    return f"HTTP {status}: {msg[:200]}"


async def post_stream(client: httpx.AsyncClient, t0: float, sent: float, request: Request,
                      tokens: list[int], headers: dict, model: str | None,
                      max_tokens: int = 1) -> tuple[RequestRecord, RequestOutput]:
    """Streams one completion of `tokens`, sent at `sent` (seconds after `t0`, a
    `time.perf_counter` reading), from `client`'s `/v1/completions`.

    Returns:
      Its `RequestRecord` in client time (for `eval.metrics.summarize`: started at `sent`,
      prefill finished and first token at `sent + ttft`; `cp_degree` 0 and no worker, as the
      client cannot see them; `cached_len` the reported cached tokens, else 0) and its
      `RequestOutput` (module doc). Failures are returned, never raised.
    """
    payload = {"prompt": tokens, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}}
    if model:
        payload["model"] = model
    out = RequestOutput(prompt_len=len(tokens), start_time=sent)
    st = t0 + sent
    last = st
    text: list[str] = []
    first_id = chunks = 0
    completion_tokens = None
    try:
        # the client's timeout bounds the whole request, not only each read (a server that
        # sends keep-alive comments and never a token must not hold a request forever)
        async with asyncio.timeout(client.timeout.read), aconnect_sse(
                client, "POST", "/v1/completions", json=payload, headers=headers) as source:
            resp = source.response
            if resp.status_code != 200:
                out.error = _error_message(resp.status_code, await resp.aread())
            else:
                async for sse in source.aiter_sse():
                    data = sse.data
                    if data.strip() == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):  # vLLM's mid-stream error event
                        err = event["error"]
                        out.error = "error event: " + str(
                            err.get("message", err) if isinstance(err, dict) else err)[:200]
                        break
                    choices = event.get("choices") or []
                    choice = choices[0] if choices else {}
                    if isinstance(choice.get("text"), str) or choice.get("token_ids"):
                        now = time.perf_counter()
                        if chunks == 0:
                            out.ttft = now - st
                            first_id = (choice.get("token_ids") or [None])[0]
                        else:
                            out.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        text.append(choice.get("text") or "")
                    usage = event.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        completion_tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        out.cached_tokens = int(details["cached_tokens"])
                if chunks == 0 and not out.error:
                    out.error = "no token in the stream (cannot time the first token)"
    except Exception as e:  # noqa: BLE001 (a broken server must not end the run)
        out.error = f"{type(e).__name__}: {e}"
    if out.error:
        out.ttft, out.itl = 0.0, []
        return RequestRecord(request, finish_time=time.perf_counter() - t0,
                             error=out.error), out
    out.success = True
    out.latency = last - st
    out.generated_text = "".join(text)
    out.output_tokens = completion_tokens if completion_tokens is not None else chunks
    first = sent + out.ttft
    return RequestRecord(request, None, 0, None, sent, first, first, out.cached_tokens or 0,
                         first_token=first_id), out


def model_entry(url: str, headers: dict | None, model: str | None,
                transport: httpx.BaseTransport | None = None) -> dict:
    """The `/v1/models` entry of `model` (or the first entry when `model` is None).

    Returns:
      The entry (`id`, and the server's extras such as `vocab_size`, `max_model_len`,
      `block_size` when it reports them); `{"id": model}` when `model` is given but the server
      does not list it or has no `/v1/models`.

    Raises:
      ValueError: `model` is None and the server lists no model (names `--model`).
    """
    try:
        with httpx.Client(base_url=url, timeout=10.0, transport=transport) as c:
            r = c.get("/v1/models", headers=headers)
            r.raise_for_status()
            data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        if model is None:
            raise ValueError(f"{url}/v1/models did not list a model ({type(e).__name__}: {e}); "
                             "pass --model=NAME") from e
        return {"id": model}
    if model is None:
        if not data:
            raise ValueError(f"{url}/v1/models lists no model; pass --model=NAME")
        return dict(data[0])
    return next((dict(d) for d in data if d.get("id") == model), {"id": model})


def vocab_size(flag: int | None, entry: dict) -> int:
    """The vocabulary size prompts are drawn from: `flag` (`--vocab_size`) when given, else the
    server's `vocab_size` in its `/v1/models` entry.

    Raises:
      ValueError: neither is there (or it is below 2); the message names `--vocab_size`.
    """
    v = flag if flag else entry.get("vocab_size")
    if not isinstance(v, int) or isinstance(v, bool) or v < 2:
        raise ValueError(f"the vocabulary size of model {entry.get('id')!r} is unknown: its "
                         "/v1/models entry reports no vocab_size (vLLM and SGLang do not); pass "
                         "--vocab_size=N (N >= 2, the model's vocabulary size: prompt token ids "
                         "are drawn from [0, N))")
    return v
