"""The HTTP API of the prefill pool (FastAPI), OpenAI-compatible where it can be.

Endpoints: `POST /v1/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`,
`POST /tokenize`, `POST /detokenize`, `GET /version` (as vLLM's, `serving.api_tokens`),
`GET` / `DELETE /v1/kv/{request_id}` (the P/D hand-off's KV read API, `serving.api_kv`),
`GET /v1/workers`, `GET /v1/controller` (the split/merge controller's latest evaluations,
`serving.api_controller`), and the admin ones `POST /v1/workers/split`, `POST /v1/workers/merge`,
`POST /reset_prefix_cache` (as vLLM's). Errors use OpenAI's
body `{"error": {"message", "type", "param", "code"}}`; every validation error is a 400 naming
the field (`param`; `body` when the body itself cannot be parsed). With an API key, every
endpoint wants `Authorization: Bearer <key>`; the admin endpoints want the admin key (and are
refused with 403 when the server has none). Keys, the body size limit (413, whatever the
framing) and the body deadline (408) are `serving.http_gate.RequestGate`'s.

Status codes: 200; 400 a bad request (named field); 401 / 403 keys; 404 unknown model or path;
408 body too slow; 409 a split or merge refused (waiting requests need the workers it would
remove) or a prefix-cache reset while busy; 413 body too large; 429 overloaded (`Retry-After`);
503 shutting down, no worker of the current composition can hold a valid prompt, or the host
running the prefill was lost (`Retry-After`); 500 a failed prefill. A client that disconnects
while its prompt waits has it withdrawn (`vertumnus:request_aborted_total`); one already
running finishes unseen.

A completion's response carries the first token (greedy), `usage` with
`prompt_tokens_details.cached_tokens`, where it ran (`worker_id`, `cp_degree`, `epoch`), its
timings in seconds, and `kv_transfer_params` naming the worker, devices and KV blocks that hold
the prompt (as vLLM's disaggregated prefill returns them for the decode side); with
`kv_transfer_params.do_remote_decode` the blocks stay pinned until the decode side pulls them
(`serving.api_kv`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api_models import CompletionRequest, MergeRequest, SplitRequest
from serving.engine import (RECONFIG_LOG_LIMIT, ClientDisconnected, Completion, Engine,
                            Overloaded, ShuttingDown)
from serving.api_chat import (CHATML_TEMPLATE, ChatCompletionRequest, ChatTemplate, chat_answer,
                              chat_chunks, chat_prompt_ids)
from serving.api_controller import add_controller_routes
from serving.api_kv import add_kv_routes, hold_ids, kv_transfer_params
from serving.api_stream import streaming_response
from serving.api_tokens import add_token_routes, check_token_ids
from serving.http_gate import RequestGate, error_field, error_response
from serving.kv_hold import HoldExists
from serving.policy.reconfiguration import StrandedRequests
from serving.prom import ServingMetrics

_log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


_error = error_response
# Unknown request fields named in the warning log line, each cut to `_FIELD_CHARS` characters.
_LOGGED_FIELDS, _FIELD_CHARS = 8, 64
# `GET /v1/workers` lists this many of the latest finished splits and merges by default.
WORKERS_RECONFIGURATIONS = 32


def create_app(engine: Engine, *, tokenizer, model_name: str, vocab_size: int,
               served_model_names: Sequence[str] = (), chat_template: str = CHATML_TEMPLATE,
               api_key: str | None = None, admin_api_key: str | None = None,
               shutdown_timeout: float | None = None,
               max_body_bytes: int = 16 << 20, body_timeout: float = 30.0) -> FastAPI:
    """The FastAPI application over a built (not yet started) `Engine`.

    Args:
      engine: the pool; started and shut down by the app's lifespan.
      tokenizer: `encode(text) -> list[int]`, `decode(ids) -> str` (`serving.tokenizer`).
      model_name: the name `/v1/models` reports and `model` fields must match.
      served_model_names: names to serve under instead (vLLM's `--served-model-name`): a
        request's `model` may be any of them and is echoed; the first is the default.
      chat_template: the jinja2 chat template of `/v1/chat/completions` (`serving.api_chat`).
      vocab_size: token ids must be in `[0, vocab_size)`.
      api_key: when set, every endpoint wants `Authorization: Bearer <api_key>`.
      admin_api_key: the key of `/v1/workers/split` and `/merge` (disabled when None).
      shutdown_timeout: seconds to wait for in-flight requests at shutdown (None: no limit);
        those still unfinished then get 503.
      max_body_bytes: larger request bodies get 413 as soon as the limit is passed.
      body_timeout: seconds a request's body may take to arrive after its headers (408 after).

    Raises:
      ValueError: `max_body_bytes < 1` or `body_timeout` not a finite number > 0.
    """
    names = list(served_model_names) or [model_name]
    metrics = ServingMetrics(engine, model_name=names[0])
    template = ChatTemplate(chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()
        yield
        await engine.shutdown(shutdown_timeout)

    app = FastAPI(title="Vertumnus-JAX prefill pool", lifespan=lifespan)
    app.add_middleware(RequestGate, api_key=api_key, admin_api_key=admin_api_key,
                       max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                       on_refused=lambda reason: metrics.rejected.labels(reason).inc())
    app.state.engine, app.state.metrics = engine, metrics
    engine.record_hooks.append(metrics.observe)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid request"}
        field = error_field(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return _error(400, f"request body is not valid JSON: {first.get('msg')}", "body")
        if field == "body" and first.get("type") in ("model_attributes_type", "dict_type"):
            return _error(400, "request body must be a JSON object (send it with Content-Type: "
                               "application/json)", "body")
        msgs = "; ".join(dict.fromkeys(  # (each once: a union's branches repeat them)
            f"{error_field(e.get('loc', ()), indexed=True)}: "
            f"{str(e.get('msg')).removeprefix('Value error, ')}" for e in errs[:5]))
        return _error(400, msgs, field)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        _log.exception("unexpected error serving %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None:  # FastAPI could not parse the body
            what = str(cause)[:200]
            return _error(400, f"request body could not be parsed: {type(cause).__name__}: "
                               f"{what}", "body")
        return _error(exc.status_code, str(exc.detail), None,
                      "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    def _tokens(prompt, index: int, batch: bool, param: str | None = None) -> list[int]:
        param = param or (f"prompt[{index}]" if batch else "prompt")
        try:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except UnicodeError as e:
            raise ApiError(400, f"{param} is not valid Unicode text ({e})", param) from None
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        limit = engine.max_prompt_len  # checked first: it bounds the vocabulary check's cost
        if len(ids) > limit:
            raise ApiError(400, f"{param} has {len(ids)} tokens, more than the maximum of "
                                f"{limit} (max_model_len, and the KV blocks of the largest "
                                "worker the pool can form)", param)
        check_token_ids(ids, vocab_size, param, ApiError)
        return ids

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.max_tokens > 1:
            raise ApiError(400, f"max_tokens={body.max_tokens}: this is a prefill pool, it "
                                "produces the first token only (max_tokens=1); decode runs in a "
                                "separate pool", "max_tokens")
        ignored = body.ignored_fields()
        if ignored:
            more = f" and {len(ignored) - _LOGGED_FIELDS} more" if len(ignored) > _LOGGED_FIELDS \
                else ""
            _log.warning("ignored request fields: %s%s", ", ".join(
                repr(f[:_FIELD_CHARS]) for f in ignored[:_LOGGED_FIELDS]), more)
        prompts = body.prompts()
        batch = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(
            body.prompt[0], (str, list))
        if len(prompts) > engine.config.max_in_flight:  # before any of them is tokenized
            raise ApiError(400, f"prompt holds a batch of {len(prompts)} prompts, more than "
                                f"the server ever admits at once (max_in_flight="
                                f"{engine.config.max_in_flight})", "prompt")
        token_lists = [_tokens(p, i, batch) for i, p in enumerate(prompts)]
        rid = request.headers.get("x-request-id")  # checked by the gate, echoed by it
        completion_id = f"cmpl-{rid}" if rid else f"cmpl-{uuid.uuid4().hex}"
        holds = _hold_ids(completion_id, len(token_lists)) if _holds(body) else None
        results = await run_prompts(token_lists, request, holds)
        answer = _response(results, body.model or names[0], tokenizer, completion_id,
                           kv_params(request))
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return streaming_response(answer, include)
        return answer

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = chat_prompt_ids(template, tokenizer, messages, body.add_generation_prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        holds = _hold_ids(f"chatcmpl-{rid}", 1, chat=True) if _holds(body) else None
        results = await run_prompts([_tokens(ids, 0, False, "messages")], request, holds)
        completion = _response(results, body.model or names[0], tokenizer, "",
                               kv_params(request))
        answer = chat_answer(completion, rid)
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return streaming_response(chat_chunks(answer), include)
        return answer

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "owned_by": "vertumnus", "root": names[0],
            "max_model_len": engine.config.max_model_len, "vocab_size": vocab_size,
            "block_size": engine.config.block_size, "created": 0} for name in names]}

    @app.get("/health")
    async def health():
        if engine.scheduler is None:
            raise ApiError(503, "the engine is not started", None, "service_unavailable")
        if not engine.scheduler.workers:  # (every worker lost: no prompt can be served)
            raise ApiError(503, "the pool has no worker left (every one was lost)", None,
                           "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/workers")
    async def workers(reconfigurations: int = WORKERS_RECONFIGURATIONS):
        if not 0 <= reconfigurations <= RECONFIG_LOG_LIMIT:
            raise ApiError(400, f"reconfigurations must be in [0, {RECONFIG_LOG_LIMIT}], got "
                                f"{reconfigurations}", "reconfigurations")
        s, cfg = engine.scheduler, engine.config
        return {"composition": s.composition, "epoch": s.epoch, "workers": engine.workers(),
                "policy": {"name": cfg.policy, "description": cfg.describe_policy(),
                           "router": type(s.router).__name__},
                "reconfigurations_in_progress": [
                    {"epoch": r.epoch, "kind": r.kind, "old": list(r.old_ids),
                     "new": [x.worker_id for x in r.new_specs]}
                    for r in s.reconfig.in_progress.values()],
                "reconfigurations_total": s.reconfig.num_finished,
                "reconfigurations": engine.reconfigurations(reconfigurations)}

    @app.post("/v1/workers/split")
    async def split(body: SplitRequest, request: Request):
        try:
            rec = engine.split(body.worker_id, body.parts)
        except StrandedRequests as e:
            into = f" into parts {body.parts}" if body.parts is not None else ""
            raise ApiError(409, f"split of worker {body.worker_id}{into} refused: {e}",
                           "worker_id" if body.parts is None else "parts",
                           "conflict_error") from None
        except ValueError as e:
            raise ApiError(400, str(e), "parts" if body.parts is not None and not str(
                e).startswith("worker_id") else "worker_id") from None
        return reconfiguration_started(rec)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        try:
            freed = engine.reset_prefix_cache()
        except ValueError as e:
            raise ApiError(409, str(e), None, "conflict_error") from None
        return {"freed_blocks": freed}

    @app.post("/v1/workers/merge")
    async def merge(body: MergeRequest, request: Request):
        try:
            rec = engine.merge(body.worker_ids)
        except StrandedRequests as e:
            raise ApiError(409, f"merge of workers {body.worker_ids} refused: {e}",
                           "worker_ids", "conflict_error") from None
        except ValueError as e:
            raise ApiError(400, str(e), "worker_ids") from None
        return reconfiguration_started(rec)

    def kv_params(request: Request):
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        return lambda record, live: kv_transfer_params(
            record, live, host=url.hostname, port=port,
            hold_seconds=engine.config.kv_hold_seconds)

    async def run_prompts(token_lists: list[list[int]], request: Request,
                          holds: list[str] | None = None) -> list[Completion]:
        """Prefills validated prompts (holding their KV under `holds` when given); maps the
        engine's refusals and failures to ApiError."""
        if holds is not None and engine.handoff is None:
            raise ApiError(400, "kv_transfer_params.do_remote_decode=true needs a backend that "
                                "holds KV for a decode side (the JAX backend)",
                           "kv_transfer_params")
        try:
            results = await engine.prefill_many(
                token_lists, disconnected=lambda: _disconnected(request.receive),
                hold_ids=holds)
        except HoldExists as e:
            metrics.rejected.labels("kv_hold_conflict").inc(len(token_lists))
            raise ApiError(409, str(e), "X-Request-Id", "conflict_error") from None
        except Overloaded as e:
            metrics.rejected.labels("overloaded").inc(len(token_lists))
            raise ApiError(429, str(e), None, "rate_limit_error",
                           {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown as e:
            metrics.rejected.labels("shutting_down").inc(len(token_lists))
            raise ApiError(503, str(e), None, "service_unavailable") from None
        except ClientDisconnected as e:  # nobody reads this answer; 499 as nginx logs it
            raise ApiError(499, str(e), None, "client_closed_request") from None
        for c in results:
            if not c.record.ok:
                if c.record.worker_id is None:  # valid, but no worker of this composition fits
                    raise ApiError(503, f"{c.record.error}; retry when the pool has merged "
                                        "workers", "prompt", "service_unavailable",
                                   {"Retry-After": "1"})
                if c.record.retryable:  # its worker's host was lost while it ran
                    raise ApiError(503, f"{c.record.error}; retry", None, "service_unavailable",
                                   {"Retry-After": "1"})
                raise ApiError(500, c.record.error, None, "server_error")
        return results

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, names))}", "model", "not_found_error")

    add_kv_routes(app, engine=engine, model_name=names[0], error=ApiError)
    add_controller_routes(app, engine=engine, error=ApiError)
    add_token_routes(app, tokenizer=tokenizer, vocab_size=vocab_size,
                     max_model_len=engine.max_prompt_len, check_model=check_model,
                     error=ApiError, chat_ids=lambda messages, generation, special:
                     chat_prompt_ids(template, tokenizer, messages, generation, special))
    return app


async def _disconnected(receive) -> None:
    """Returns when the ASGI connection reports `http.disconnect` (the body was read already,
    so nothing else arrives; the server answers it only when the client has gone)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def reconfiguration_started(rec) -> dict:
    """The admin split / merge answer: the change's epoch, the workers it drains (`old`) and
    the ids the new workers will have (`new`; ACTIVE once re-carved, see `/v1/workers`)."""
    return {"epoch": rec.epoch, "status": "draining", "old": list(rec.old_ids),
            "new": [spec.worker_id for spec in rec.new_specs]}


def _hold_ids(completion_id: str, n: int, chat: bool = False) -> list[str]:
    try:
        return hold_ids(completion_id, n, chat)
    except ValueError as e:
        raise ApiError(400, str(e), "X-Request-Id") from None


def _holds(body) -> bool:
    """Whether the request asks for its KV to be held (vLLM's `do_remote_decode`)."""
    params = body.kv_transfer_params
    return params is not None and params.do_remote_decode


def _response(results: list[Completion], model_name: str, tokenizer, completion_id: str,
              kv_params) -> dict:
    choices, prompt_tokens, cached = [], 0, 0
    for i, c in enumerate(results):
        r, live = c.record, c.prefill
        choices.append({
            "index": i, "text": tokenizer.decode([r.first_token]), "token_ids": [r.first_token],
            "finish_reason": "length", "logprobs": None,
            "worker_id": r.worker_id, "cp_degree": r.cp_degree, "epoch": r.epoch,
            "timings": {"queue_seconds": c.queue_seconds, "prefill_seconds": c.prefill_seconds,
                        "ttft_seconds": c.ttft_seconds},
            "prompt_tokens": r.request.input_len, "cached_tokens": r.cached_len,
            "kv_transfer_params": kv_params(r, live)})
        prompt_tokens += r.request.input_len
        cached += r.cached_len
    first = choices[0]
    return {
        "id": completion_id, "object": "text_completion", "created": int(time.time()),
        "model": model_name, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(choices),
                  "total_tokens": prompt_tokens + len(choices),
                  "prompt_tokens_details": {"cached_tokens": cached}},
        "worker_id": first["worker_id"], "cp_degree": first["cp_degree"], "epoch": first["epoch"],
        "timings": first["timings"], "kv_transfer_params": first["kv_transfer_params"]}

