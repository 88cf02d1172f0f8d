"""Closed-loop replay of agent sessions: session starts, and the driver that makes arrivals.

A replay starts session *instances* as a Poisson process (`session_starts`) during a window;
instance i runs the workload's top-level session `order[i mod n]` (a seeded shuffle, so every
session is used equally often; the source's replayer recycles traces the same way). Inside an
instance, request k+1 is sent `think_time` (capped) after request k's response ended, the
response ending at its first token plus `output_len x tpot_s` of decode; sub-agents run
between (`ClosedLoop`). So load is raised by starting more sessions, never by compressing a
session's own time (the source's `trace_replay_tester.py` "think-only" mode).

An instance keeps the blocks shared across sessions (`SessionWorkload.shared_blocks`: the
agent's tool + system prefix) and gets its own copy of every other block: block hash h of
instance i becomes `h + i * M`, M above every template hash, so two instances of one session
share exactly the shared prefix, and within an instance the chain structure is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from eval.traces.sessions import SessionWorkload
from serving.policy.request import Request


def session_starts(workload: SessionWorkload, rate: float, window_s: float, seed: int
                   ) -> list[tuple[float, int]]:
    """Session instances started as a Poisson process of `rate` sessions/s during
    `[0, window_s)` (at least one, at time 0): `(start time in s, index into workload.roots)`,
    sorted by time, the sessions taken round-robin in a seeded shuffled order.

    Raises:
      ValueError: rate or window_s not a finite number > 0.
    """
    for name, v in (("rate", rate), ("window_s", window_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"session {name} must be a finite number > 0, got {v!r}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(workload.roots)).tolist()
    times, t = [0.0], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= window_s:
            break
        times.append(t)
    return [(t, order[i % len(order)]) for i, t in enumerate(times)]


class ClosedLoop:
    """Drives a `SessionWorkload` closed-loop: each response's end makes the next requests.

    Used by the simulator (`eval.sim.simulator.simulate`, as its arrival source) and by the load
    generator against a live server. `start()` gives the first arrivals; after each response,
    `on_end(request_id, end_time)` gives the arrivals it makes. Within an instance of a
    session, step k+1 is sent `min(think_time, max_think_s)` after step k's response ended;
    sub-agents listed after step k start when k's response ends, and step k+1 then waits for
    the last of them to finish (its last response, and its own sub-agents). Every request of
    every instance is sent exactly once, whatever the responses' times (a failed request ends
    at its failure time). Request ids are `<template id>@<instance>`.

    Args:
      workload: the sessions.
      starts: `(start time in s, index into workload.roots)` per instance (`session_starts`).
      tpot_s: decode seconds per output token (a response of `out` tokens ends `out x tpot_s`
        after its first token).
      max_think_s: think times are capped here (the source replayer's `--max-delay`, 60 s
        there): a user away longer starts a new visit, not part of a busy window.

    Raises:
      ValueError: no starts, a root index out of range, or a time, tpot_s or max_think_s not
        a finite number >= 0.
    """

    def __init__(self, workload: SessionWorkload, starts: Sequence[tuple[float, int]],
                 tpot_s: float, max_think_s: float = math.inf) -> None:
        if not starts:
            raise ValueError("starts must name at least one session instance")
        if not all(math.isfinite(t) and t >= 0 for t, _ in starts) or not (
                math.isfinite(tpot_s) and tpot_s >= 0) or not max_think_s >= 0:
            raise ValueError("start times, tpot_s and max_think_s must be numbers >= 0 seconds")
        if not all(0 <= r < len(workload.roots) for _, r in starts):
            raise ValueError(f"root indices must be in [0, {len(workload.roots)})")
        self.workload, self.tpot_s, self.starts = workload, float(tpot_s), list(starts)
        self.max_think_s = float(max_think_s)
        self._salt = 1 + max((h for r in workload.requests for h in r.block_hashes), default=0)
        self._where: dict[str, tuple[int, int, int]] = {}  # id -> (session, step, instance)
        # (session, after step, instance) -> [sub-agents running, latest end, parent or None]
        self._waits: dict[tuple[int, int, int], list] = {}
        self._parent: dict[tuple[int, int], tuple[int, int, int]] = {}  # (sub, inst) -> wait key
        self.sent = 0

    def total_requests(self) -> int:
        """Requests of every started instance (its sub-agents' included), sent or not."""
        sizes: dict[int, int] = {}

        def size(s: int) -> int:
            if s not in sizes:
                ses = self.workload.sessions[s]
                sizes[s] = len(ses.steps) + sum(size(sub.session) for sub in ses.subagents)
            return sizes[s]

        return sum(size(self.workload.roots[root]) for _, root in self.starts)

    def start(self) -> list[tuple[float, Request]]:
        """Every instance's first arrivals (its sub-agents listed first, or its first request),
        sorted by time."""
        out: list[tuple[float, Request]] = []
        for i, (t0, root) in enumerate(self.starts):
            self._after(self.workload.roots[root], -1, i, t0, out)
        out.sort(key=lambda x: x[0])
        return out

    def response_end(self, first_token_time: float | None, finish_time: float,
                     output_len: int) -> float:
        """When a response ended: `first_token_time + output_len x tpot_s`; a failed request
        (no first token) ends at `finish_time`."""
        if first_token_time is None:
            return finish_time
        return first_token_time + output_len * self.tpot_s

    def on_record(self, record) -> list[tuple[float, Request]]:
        """`on_end` of a finished request's `serving.policy.request.RequestRecord` (the
        simulator's `ArrivalSource` call): its response ends per `response_end`."""
        end = self.response_end(record.first_token_time, record.finish_time,
                                record.request.output_len)
        return self.on_end(record.request.request_id, end)

    def on_end(self, request_id: str, end_time: float) -> list[tuple[float, Request]]:
        """The arrivals made by the end of `request_id`'s response at `end_time` (seconds).

        Raises:
          KeyError: a request id this driver did not send (or already ended).
        """
        s, k, i = self._where.pop(request_id)
        out: list[tuple[float, Request]] = []
        self._after(s, k, i, end_time, out)
        return out

    def _after(self, s: int, k: int, i: int, t: float, out: list) -> None:
        """Step k of session s (instance i) is done at t (k = -1: the session starts at t)."""
        subs = [sub.session for sub in self.workload.sessions[s].subagents if sub.after_step == k]
        if not subs:
            self._next(s, k, i, t, out)
            return
        key = (s, k, i)
        self._waits[key] = [len(subs), t]
        for sub in subs:
            self._parent[(sub, i)] = key
            self._after(sub, -1, i, t, out)

    def _next(self, s: int, k: int, i: int, t: float, out: list) -> None:
        """Everything after step k of session s is done at t: send step k+1, or finish s."""
        ses = self.workload.sessions[s]
        if k + 1 < len(ses.steps):
            think = min(ses.think_times[k + 1], self.max_think_s)
            self._send(s, k + 1, i, t + think, out)
            return
        key = self._parent.pop((s, i), None)
        if key is None:
            return  # a top-level session ended
        wait = self._waits[key]
        wait[0] -= 1
        wait[1] = max(wait[1], t)
        if wait[0] == 0:
            del self._waits[key]
            self._next(key[0], key[1], key[2], wait[1], out)

    def _send(self, s: int, k: int, i: int, t: float, out: list) -> None:
        j = self.workload.sessions[s].steps[k]
        tpl = self.workload.requests[j]
        hashes = tpl.block_hashes
        if i:
            n = self.workload.shared_blocks[j] if self.workload.shared_blocks else 0
            salt = i * self._salt
            hashes = hashes[:n] + tuple(h + salt for h in hashes[n:])
        rid = f"{tpl.request_id}@{i}"
        self._where[rid] = (s, k, i)
        out.append((t, dataclasses.replace(tpl, request_id=rid, arrival_time=t,
                                           block_hashes=hashes)))
        self.sent += 1
