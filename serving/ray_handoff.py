"""The P/D hand-off in the multi-host pool: KV held on host agents, pulled through the head.

A held prompt's blocks stay on the host agent whose worker ran it (the agent's own
`serving.kv_handoff.KVHandOff` pins, preempts, offloads before a re-carve and expires them, as
in one process). `RemoteHandOff` is the head's side, with the interface the engine and the KV
read API use (`holds`, `wanted`, `read`, `release`, `release_quietly`): its `holds` registry
reserves ids, knows which host holds each hold, and counts how holds ended; `read` and `release`
are forwarded to that host's agent (`HostAgent.read_kv` / `release_kv`), whose answer, not the
head's registry, decides (a hold the agent expired or preempted is `HoldGone` with the agent's
reason). A lost host's holds end with reason `host_lost`. Entries the head never hears end of
are dropped `HEAD_GRACE_S` after their hold time (the agent expired them by then).

Calls block on Ray: use them from a thread (the API does, `asyncio.to_thread`).
"""

from __future__ import annotations

from collections.abc import Iterable

from serving.kv_hold import HoldGone, KVHold, KVHolds, release_each

# Seconds past its hold time after which the head forgets a hold (the agent expired it).
HEAD_GRACE_S = 5.0
# Seconds a pull or release may wait for the agent.
CALL_TIMEOUT_S = 120.0


class RemoteHandOff:
    """The head's view of KV holds kept on host agents (see the module doc).

    Args:
      holds: the head's registry (`KVHolds(hold_seconds)`).
      backend: the `serving.ray_backend.RayBackend` (its hosts, devices per host, Ray).
    """

    def __init__(self, holds: KVHolds, backend):
        self.holds, self._backend = holds, backend
        self.wanted: dict[object, str] = {}

    def _agent(self, hold: KVHold):
        host = self._backend.hosts[hold.device_ids[0] // self._backend.devices_per_host]
        return host, host.agent

    # ------------------------------------------------------------------ on the scheduler's thread
    def pinned(self, hold_id: str, worker_id: int, out: dict, device_ids, block_size: int,
               now: float) -> bool:
        """Records a hold an agent made for a prefill that asked for one; False (and the agent
        is told to drop it) when the request was withdrawn meanwhile."""
        hold = KVHold(hold_id, worker_id, out["cp_degree"], tuple(device_ids), block_size,
                      tuple(out["block_ids"]), out["num_tokens"], now,
                      now + self.holds.hold_seconds)
        try:
            self.holds.add(hold)
        except KeyError:
            self._agent(hold)[1].release_kv.remote(hold_id, "failed")
            return False
        return True

    def host_lost(self, host_id: int) -> int:
        """Ends every hold on a lost host (reason `host_lost`); returns how many."""
        m = self._backend.devices_per_host
        ids = self.holds.ids(lambda h: h.device_ids[0] // m == host_id)
        for hold_id in ids:
            self._pop(hold_id, "host_lost")
        return len(ids)

    def expire(self, now: float) -> None:
        """Forgets holds `HEAD_GRACE_S` past their time (their agent expired them)."""
        for hold_id in self.holds.expired(now - HEAD_GRACE_S):
            self._pop(hold_id, "expired")

    def _pop(self, hold_id: str, reason: str) -> None:
        try:
            self.holds.pop(hold_id, reason)
        except KeyError:  # ended meanwhile
            pass

    # ------------------------------------------------------------------ from any thread
    def _call(self, hold_id: str, method: str, *args) -> tuple[KVHold, dict]:
        hold = self.holds.get(hold_id)  # KeyError, HoldGone
        host, agent = self._agent(hold)
        ray = self._backend._ray
        try:
            out = ray.get(getattr(agent, method).remote(hold_id, *args), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            self._pop(hold_id, "host_lost")
            raise HoldGone(hold_id, "host_lost") from None
        if out["status"] == "gone":
            self._pop(hold_id, out["reason"])
            raise HoldGone(hold_id, out["reason"])
        if out["status"] != "ok":
            self._pop(hold_id, "failed")
            raise KeyError(hold_id)
        return hold, out

    def read(self, hold_id: str, release: bool):
        """`(k, v, hold)` as `KVHandOff.read`, from the agent that holds it."""
        hold, out = self._call(hold_id, "read_kv", release)
        if release:
            self._pop(hold_id, "pulled")
        return out["k"], out["v"], hold

    def release(self, hold_id: str, reason: str = "released") -> KVHold:
        """Ends the hold on its agent; raises as `read`."""
        hold, _ = self._call(hold_id, "release_kv", reason)
        self._pop(hold_id, reason)
        return hold

    def release_quietly(self, hold_ids: Iterable[str], reason: str) -> int:
        """`release` of each id still held; returns how many were."""
        return release_each(self.release, hold_ids, reason)

    def issue(self, hold_ids: Iterable[str]) -> None:
        """Marks holds answered, here and on their agents (preemptable from now on)."""
        hold_ids = list(hold_ids)
        self.holds.issue(hold_ids)
        by_agent: dict = {}
        for hold_id in hold_ids:
            try:
                host, agent = self._agent(self.holds.get(hold_id))
            except KeyError:
                continue
            by_agent.setdefault(host.host_id, (agent, []))[1].append(hold_id)
        for agent, ids in by_agent.values():
            agent.issue_kv.remote(ids)
