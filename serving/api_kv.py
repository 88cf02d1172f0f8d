"""The P/D hand-off over HTTP: `kv_transfer_params` in vLLM's convention and the KV read API.

A decode side (or the proxy in front of both pools, as vLLM's `disagg_proxy` does) sends the
prompt with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, ...}` (vLLM's
proxy also sends `do_remote_prefill: false` and the `remote_*` keys as null: accepted). The
prompt's KV then stays pinned (`serving.kv_hold`), and the answer's `kv_transfer_params`
carry vLLM's keys for the decode side:

| key | value |
| --- | --- |
| `do_remote_prefill` | true: the decode side reads the prompt's KV from here (false without a hold) |
| `do_remote_decode` | false |
| `remote_engine_id` | `vertumnus-worker-<worker>-epoch-<epoch>` |
| `remote_block_ids` | the prompt's blocks, partial last one included |
| `remote_host`, `remote_port` | where this server was reached (the request's `Host`) |
| `remote_request_id` | the id to pull: `<completion id>-<prompt index>` (chat: the chat id) |
| `tp_size` | 1 (a worker's devices split the sequence, not the heads: `cp_degree`) |

and ours: `remote_block_ranks` (block i on rank `i % cp_degree`), `remote_device_ids`,
`block_size`, `cp_degree`, `num_tokens` (the prompt's length, the partial block's tokens
included), `kv_path` (`/v1/kv/<remote_request_id>`) and `kv_hold_seconds`.

Endpoints:
- `GET /v1/kv/{request_id}` returns the KV as safetensors (`serving.kv_format`: per layer K and
  V `[num_tokens, num_kv_heads, head_dim]`, natural token order), `application/octet-stream`.
  The pull ends the hold (`?release=false` keeps it, e.g. to retry a failed transfer).
- `DELETE /v1/kv/{request_id}` ends the hold without reading it.
Both answer 404 for an unknown id, 409 while its prefill still runs, and 410 (`gone`, with the
reason: pulled, released, expired, preempted, failed, host_lost) for a hold that ended.

Without `do_remote_decode` nothing is held: `kv_transfer_params` names the prompt's full blocks,
left unpinned in the worker's prefix cache, with `do_remote_prefill: false` (nothing to pull).

Block ids are per rank: block i lies on rank `i % cp_degree` (`remote_block_ranks`), so one id
can appear once per rank (`[0, 0, 0, 0]` on a CP-4 worker is four different blocks); a decode
side that reads the KV over HTTP never needs them.
"""

from __future__ import annotations

import asyncio
import re

from fastapi import FastAPI
from fastapi.responses import Response

from serving.kv_format import kv_to_safetensors
from serving.kv_hold import HoldGone


# Characters a hold id may have: it is a path segment of `/v1/kv/{id}` as it stands (RFC 3986
# unreserved and sub-delims, ':' and '@'); '/', '?', '#', '%' and spaces would need encoding.
_HOLD_ID = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+")


def hold_ids(completion_id: str, n: int, chat: bool = False) -> list[str]:
    """The hold ids (`remote_request_id`) of a request's `n` prompts: `<id>-<i>` as vLLM
    numbers the prompts of a completions batch; a chat request's own id.

    Raises:
      ValueError: the id (from `X-Request-Id`) holds a character a URL path segment cannot
        carry as is (`/`, `?`, `#`, `%`, ...), so the decode side could not pull it.
    """
    if not _HOLD_ID.fullmatch(completion_id):
        raise ValueError(f"X-Request-Id {completion_id!r} cannot name held KV: use only letters, "
                         "digits and ._~!$&'()*+,;=:@- (it becomes the path /v1/kv/<id>)")
    return [completion_id] if chat else [f"{completion_id}-{i}" for i in range(n)]


def kv_transfer_params(record, live, *, host: str | None, port: int | None,
                       hold_seconds: float) -> dict | None:
    """A choice's `kv_transfer_params` (see the module doc), None when the prefill failed.

    Args:
      record: the scheduler's `RequestRecord` (its epoch).
      live: the backend's `LivePrefill` (worker, devices, blocks, hold id), or None.
      host, port: where this server was reached.
      hold_seconds: the hold time (`--kv_hold_s`).
    """
    if live is None:
        return None
    c = live.cp_degree
    out = {"do_remote_prefill": live.hold_id is not None, "do_remote_decode": False,
           "remote_engine_id": f"vertumnus-worker-{live.worker_id}-epoch-{record.epoch}",
           "remote_block_ids": list(live.block_ids),
           "remote_block_ranks": [i % c for i in range(len(live.block_ids))],
           "remote_device_ids": list(live.device_ids), "block_size": live.block_size,
           "cp_degree": c, "num_tokens": live.num_tokens}
    if live.hold_id is not None:
        out.update(remote_host=host, remote_port=port, remote_request_id=live.hold_id,
                   tp_size=1, kv_path=f"/v1/kv/{live.hold_id}", kv_hold_seconds=hold_seconds)
    return out


def add_kv_routes(app: FastAPI, *, engine, model_name: str, error) -> None:
    """Adds `GET` and `DELETE /v1/kv/{request_id}` to `app`.

    Args:
      engine: the `serving.engine.Engine` (its `handoff`).
      model_name: written into the KV payload's metadata.
      error: `error(status, message, param, kind)` builds the exception the app answers.
    """

    def lookup_error(request_id: str, exc: KeyError):
        handoff = engine.handoff
        if isinstance(exc, HoldGone):
            return error(410, f"the KV of request {request_id!r} is no longer held: "
                              f"{exc.reason}", "request_id", "gone")
        if handoff is not None and handoff.holds.is_reserved(request_id):
            return error(409, f"the prefill of request {request_id!r} has not finished yet",
                         "request_id", "conflict_error")
        return error(404, f"no KV is held for request {request_id!r} (send the request with "
                          "kv_transfer_params.do_remote_decode=true)", "request_id",
                     "not_found_error")

    def handoff_or_404():
        if engine.handoff is None:
            raise error(404, "this server's backend holds no KV for a decode side",
                        "request_id", "not_found_error")
        return engine.handoff

    @app.get("/v1/kv/{request_id}")
    async def pull_kv(request_id: str, release: bool = True):
        handoff = handoff_or_404()
        try:
            k, v, hold = await asyncio.to_thread(handoff.read, request_id, release)
        except KeyError as e:
            raise lookup_error(request_id, e) from None
        data = await asyncio.to_thread(kv_to_safetensors, k, v, {
            "request_id": request_id, "model": model_name, "block_size": hold.block_size,
            "cp_degree": hold.cp_degree})
        return Response(data, media_type="application/octet-stream",
                        headers={"X-KV-Num-Tokens": str(hold.num_tokens)})

    @app.delete("/v1/kv/{request_id}")
    async def release_kv(request_id: str):
        handoff = handoff_or_404()
        try:
            hold = await asyncio.to_thread(handoff.release, request_id, "released")
        except KeyError as e:
            raise lookup_error(request_id, e) from None
        return {"request_id": request_id, "released": True, "num_tokens": hold.num_tokens,
                "num_blocks": len(hold.block_ids)}
