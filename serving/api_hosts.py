"""`GET /v1/hosts`: the host agents of the multi-host pool (`serving.ray_backend`).

Each entry: `host_id`, `state` ("alive", "dead", "rejoining"), the Ray `node_id`, the agent's
`pid`, its device `platform` and count, its `worker_ids`, and `lost_at` (seconds since the
server started, when it was found dead). A single-host server lists one embedded host.
"""

from __future__ import annotations

import os

from fastapi import FastAPI


def add_host_routes(app: FastAPI, engine) -> None:
    """Adds `GET /v1/hosts` to `app` for `engine`'s backend."""

    @app.get("/v1/hosts")
    async def hosts():
        info = getattr(engine.backend, "hosts_info", None)
        if info is not None:
            return {"hosts": info()}
        workers = sorted(engine.scheduler.workers)
        return {"hosts": [{"host_id": 0, "state": "alive", "node_id": None, "pid": os.getpid(),
                           "platform": None, "devices": engine.num_devices,
                           "worker_ids": workers, "lost_at": None}]}
