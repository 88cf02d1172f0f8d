"""A stand-in OpenAI-compatible server that is not ours, for the load generator's tests.

Only `GET /v1/models` (one model, `max_model_len` but no `vocab_size`, as vLLM answers) and
`POST /v1/completions` (token-id prompts; streamed as server-sent events with a usage chunk
and `[DONE]`, or not streamed); every other path is a 404 (no `/v1/workers`, no `/health`).
Each completion generates `max_tokens` tokens (`" t<k>"`), `gap_s` apart when streamed.
`fail_every=k` answers every k-th completion (1-based, in arrival order) with a 500; `api_key`
makes every path require `Authorization: Bearer <api_key>` (401 otherwise); `error_after_first`
sends an `error` event after the first token (as vLLM does mid-stream); `stall_s` sends only
keep-alive comments for that long before the first token. Everything asked
is logged in `StubLog` for the tests to compare with the load generator's result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stub-org/stub-model-7b"
MAX_MODEL_LEN = 300
VOCAB = 1000


@dataclasses.dataclass
class StubLog:
    paths: list[str] = dataclasses.field(default_factory=list)  # every request's path
    bodies: list[dict] = dataclasses.field(default_factory=list)  # completion bodies, in order
    statuses: list[int] = dataclasses.field(default_factory=list)  # their answers' statuses
    auth: list[str | None] = dataclasses.field(default_factory=list)  # Authorization headers


def make_stub(fail_every: int = 0, gap_s: float = 0.002, api_key: str | None = None,
              error_after_first: bool = False, stall_s: float = 0.0
              ) -> tuple[FastAPI, StubLog]:
    """The app and its log (module doc)."""
    app = FastAPI()
    log = StubLog()

    @app.middleware("http")
    async def record(request: Request, call_next):
        log.paths.append(request.url.path)
        log.auth.append(request.headers.get("authorization"))
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                            "owned_by": "stub", "root": MODEL,
                                            "max_model_len": MAX_MODEL_LEN}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        log.bodies.append(body)
        prompt, n = body["prompt"], int(body.get("max_tokens") or 16)
        status = 200
        if fail_every and len(log.bodies) % fail_every == 0:
            status = 500
        elif not all(isinstance(t, int) and 0 <= t < VOCAB for t in prompt):
            status = 400
        elif len(prompt) + n > MAX_MODEL_LEN:
            status = 400
        log.statuses.append(status)
        if status != 200:
            return JSONResponse({"object": "error", "message": f"stub says {status}",
                                 "code": status}, status_code=status)
        head = {"id": f"cmpl-{len(log.bodies)}", "object": "text_completion",
                "created": int(time.time()), "model": MODEL}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                 "total_tokens": len(prompt) + n}
        if not body.get("stream"):
            text = "".join(f" t{k}" for k in range(n))
            return {**head, "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": usage}

        async def events():
            yield ": stub keep-alive comment\n\n"
            end = time.monotonic() + stall_s
            while time.monotonic() < end:  # keep-alive comments, no token, for stall_s
                await asyncio.sleep(0.05)
                yield ": still here\n\n"
            for k in range(n):
                if k and error_after_first:  # as vLLM reports an error mid-stream
                    yield f"data: {json.dumps({'error': {'message': 'stub broke', 'code': 500}})}\n\n"
                    break
                if k:
                    await asyncio.sleep(gap_s)
                choice = {"index": 0, "text": f" t{k}", "logprobs": None,
                          "finish_reason": "length" if k == n - 1 else None}
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, log


class Served:
    """`app` served by uvicorn on 127.0.0.1 on a free port, in a thread; `url`, `stop()`."""

    def __init__(self, app: FastAPI):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 20
        while not self.server.started and time.monotonic() < end:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
