"""The head's records of the multi-host pool's hosts and workers (`serving.ray_backend`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class HostState:
    """The head's view of one host agent.

    Attributes:
      host_id: the host's index; its devices are `[host_id * M, (host_id + 1) * M)` pool-wide.
      agent: the Ray actor handle.
      composition: the CP degrees its workers start with (and restart with).
      state: "starting", "alive", "dead" or "rejoining".
      worker_ids: its current workers (pool-wide ids).
      info: the agent's `info()` (pid, node id, device platform and count).
      lost_at: seconds (head clock) when it was found dead, or None.
    """

    host_id: int
    agent: object
    composition: tuple[int, ...]
    state: str = "starting"
    worker_ids: set[int] = dataclasses.field(default_factory=set)
    info: dict = dataclasses.field(default_factory=dict)
    lost_at: float | None = None
    ping_in_flight: bool = False
    last_ping: float = float("-inf")


@dataclasses.dataclass
class RemoteWorker:
    """The head's record of a worker on a host agent (for `GET /v1/workers`)."""

    host_id: int
    cp_degree: int
    device_ids: tuple[int, ...]
    kv_blocks_cached: int = 0
    prefill_executables: int = 0
