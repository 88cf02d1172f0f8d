"""What every HTTP request passes before the API sees it: keys, a body size limit, a body deadline.

`RequestGate` is a pure ASGI middleware (no `BaseHTTPMiddleware`, so the endpoint's `receive`
still reports `http.disconnect`). For each HTTP request it

1. refuses a declared `Content-Length` over `max_body_bytes` with 413 before reading anything;
2. checks the bearer key: the admin key on the admin paths (403 when the server has none), the
   API key elsewhere (401), before the body is read, so a request without the right key learns
   nothing and costs nothing;
3. reads the body, whatever its framing (a `Content-Length` or chunked), counting bytes: 413 as
   soon as it passes `max_body_bytes` (nothing past the limit is kept), 408 when the whole body
   has not arrived within `body_timeout` seconds of the headers (a client that sends headers
   and part of a body holds no connection longer than that);
4. hands the app the body it read, then the connection's own `receive` (so the endpoint sees
   the client disconnect);
5. echoes a request's `X-Request-Id` on its response (as vLLM does), after checking it is at
   most `MAX_REQUEST_ID` printable ASCII characters without spaces (400 otherwise).

413 and 408 carry `Connection: close`; after a 413 the rest of what the client is still sending
is read and dropped while it keeps coming (until `linger` seconds pass without data, at most
`linger_max` seconds in all) before the connection closes, as nginx's lingering close does
(`lingering_timeout`, `lingering_time`), so a client that sends its whole body before reading
gets its 413 instead of a connection reset. If the server is torn down while a body is being
read (a second Ctrl-C), the request is answered with the JSON 503 instead of uvicorn's
plain-text 500.
Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}` (`param` is `body`
for the body's own errors).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

ADMIN_PATHS = ("/v1/workers/split", "/v1/workers/merge", "/reset_prefix_cache")
MAX_REQUEST_ID = 128  # characters of an X-Request-Id


def request_id_problem(value: str) -> str | None:
    """Why `value` cannot be an `X-Request-Id` (None when it can)."""
    if not value or len(value) > MAX_REQUEST_ID:
        return f"X-Request-Id must have 1 to {MAX_REQUEST_ID} characters, got {len(value)}"
    if not (value.isascii() and value.isprintable()) or " " in value:
        return "X-Request-Id must be printable ASCII without spaces"
    return None


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None
                   ) -> JSONResponse:
    """OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with `status`."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


# pydantic's names of a union's branches in an error's location, not request fields
_BRANCH_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def error_field(loc, indexed: bool = False) -> str:
    """The request field an error is about: its top-level name (a query or path parameter's
    own name), `body` for the body itself; with `indexed`, its full path for the message
    (`parts[1]`, `messages[0].role`), pydantic's union branch tags in it (`str`, `list[int]`, a
    model's class name) dropped."""
    loc = tuple(loc)
    if loc[:1] in (("query",), ("path",)):
        loc = loc[1:]
    parts = [p for p in loc if p != "body"]
    if not parts:
        return "body"
    out = str(parts[0])
    for p in parts[1:] if indexed else ():
        if isinstance(p, int):
            out += f"[{p}]"
        elif not ("[" in p or p in _BRANCH_TAGS or p[:1].isupper()):
            out += f".{p}"
    return out


def bearer_ok(headers: Headers, key: str) -> bool:
    """Whether `Authorization: Bearer <key>` is present (compared in constant time)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class RequestGate:
    """The ASGI middleware described in the module docstring.

    Args:
      app: the ASGI app behind the gate.
      api_key: bearer key of every endpoint but the admin ones (None: open).
      admin_api_key: bearer key of `ADMIN_PATHS` (None: they answer 403).
      max_body_bytes: largest request body accepted (bytes), >= 1.
      body_timeout: seconds from the headers to the end of the body, > 0.
      linger: after a 413, close once the client has sent nothing for this many seconds.
      linger_max: after a 413, close after this many seconds in all.
      on_refused: called with "body_too_large", "body_timeout", "unauthorized" (401) or
        "forbidden" (403) per refusal (metrics).

    Raises:
      ValueError: `max_body_bytes < 1` or a `body_timeout` that is not a finite number > 0.
    """

    def __init__(self, app, *, api_key: str | None, admin_api_key: str | None,
                 max_body_bytes: int, body_timeout: float, linger: float = 2.0,
                 linger_max: float = 30.0,
                 on_refused: Callable[[str], None] = lambda reason: None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not (0 < body_timeout < float("inf")):
            raise ValueError(f"body_timeout must be a finite number of seconds > 0, got "
                             f"{body_timeout}")
        self.app, self.api_key, self.admin_api_key = app, api_key, admin_api_key
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.linger, self.linger_max = linger, linger_max
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body_bytes:
            await self._too_large(scope, receive, send, f"{size} bytes")
            return
        denied = self._denied(scope["path"], headers)
        if denied is not None:
            self.on_refused("unauthorized" if denied.status_code == 401 else "forbidden")
            await denied(scope, receive, send)
            return
        rid = headers.get("x-request-id")
        if rid is not None:
            problem = request_id_problem(rid)
            if problem:
                await error_response(400, problem, "X-Request-Id")(scope, receive, send)
                return
            send = _echo_request_id(send, rid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        chunks, total, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.CancelledError:  # the server is being torn down (forced quit)
                await error_response(503, "the server shut down while this request's body was "
                                          "arriving", None, "service_unavailable",
                                     headers={"Connection": "close"})(scope, receive, send)
                return
            except asyncio.TimeoutError:
                self.on_refused("body_timeout")
                await error_response(
                    408, f"the request body did not arrive within {self.body_timeout:g} s "
                         f"({total} bytes received)", "body",
                    headers={"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its request was whole: nothing to answer
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_body_bytes:
                await self._too_large(scope, receive, send, f"more than {self.max_body_bytes} "
                                                            "bytes (chunked)")
                return
            chunks.append(body)
            more = message.get("more_body", False)
        whole, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _denied(self, path: str, headers: Headers) -> JSONResponse | None:
        if path in ADMIN_PATHS:
            if self.admin_api_key is None:
                return error_response(403, "admin operations are disabled: start the server "
                                           "with an admin key (--admin_api_key_file, "
                                           "VERTUMNUS_ADMIN_API_KEY or --admin_api_key)", None,
                                      "permission_error")
            if not bearer_ok(headers, self.admin_api_key):
                return error_response(401, "missing or wrong admin API key (Authorization: "
                                           "Bearer <admin key>)", None, "authentication_error")
        elif self.api_key is not None and not bearer_ok(headers, self.api_key):
            return error_response(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                  None, "authentication_error")
        return None

    async def _too_large(self, scope, receive, send, what: str) -> None:
        self.on_refused("body_too_large")
        response = error_response(413, f"request body of {what} is larger than "
                                       f"{self.max_body_bytes} bytes", "body",
                                  headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": 413,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        loop = asyncio.get_running_loop()
        end = loop.time() + self.linger_max
        try:  # lingering close: drop what the client still sends, so it reads the 413
            while (left := min(self.linger, end - loop.time())) > 0:
                message = await asyncio.wait_for(receive(), left)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        except (asyncio.TimeoutError, asyncio.CancelledError):  # quiet, or the server stops
            pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _echo_request_id(send, rid: str):
    """`send` adding `X-Request-Id: rid` to the response's headers."""
    async def echo(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"x-request-id", rid.encode())]}
        await send(message)
    return echo
