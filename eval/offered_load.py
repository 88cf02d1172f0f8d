"""How a workload is offered to a simulated pool at a rate: open loop or closed loop.

- `OpenLoad`: a request trace. A rate re-times it (`eval.traces.workloads.scale_to_rate`: all
  gaps scaled uniformly); the capacity rate counts every request cold at the smallest degree.
- `SessionLoad`: agent sessions (`eval.traces.sessions`). A rate is *sessions* per second:
  session instances start as a Poisson process during a window (`session_starts`) and each
  runs closed-loop (`ClosedLoop`: a request is sent `think_time` after the previous response
  ended), so a session's own time is never compressed. Its capacity rate counts each request with the prefix an unbounded cache would
  give it (what the session itself made warm): with 96 % of blocks reused inside sessions, the
  cold count would put load factor 1 at a few per cent of the pool's real load.

`eval.experiment.run_sweep` drives both through the same steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from eval.traces.closed_loop import ClosedLoop, session_starts
from eval.traces.sessions import SessionWorkload
from eval.traces.workloads import prefix_hit_tokens, scale_to_rate
from serving.policy.request import Request


@dataclasses.dataclass(frozen=True)
class OpenLoad:
    """A request trace offered open-loop. `requests` sorted by arrival."""

    requests: Sequence[Request]

    def with_requests(self, requests: Sequence[Request]) -> OpenLoad:
        return OpenLoad(list(requests))

    def capacity_rate(self, gpu_seconds: Callable[[Request, int], float], num_gpus: int) -> float:
        """Req/s at which `num_gpus` are exactly busy when each request costs
        `gpu_seconds(request, 0)` (cold)."""
        return num_gpus * len(self.requests) / sum(gpu_seconds(r, 0) for r in self.requests)

    def request_rate(self, rate: float) -> float:
        return rate

    def at_rate(self, rate: float) -> tuple[list[Request], ClosedLoop | None]:
        """The simulator's input at `rate` req/s: the re-timed requests, no arrival source."""
        return scale_to_rate(self.requests, rate), None

    def describe(self, rate: float) -> dict:
        return {"request_rate": rate}


@dataclasses.dataclass(frozen=True)
class SessionLoad:
    """Agent sessions offered closed-loop; rates are sessions/s.

    Attributes:
      workload: the sessions.
      tpot_s: decode seconds per output token (when a response ends, `ClosedLoop`).
      window_s: sessions start during `[0, window_s)` seconds.
      max_think_s: think times are capped here (`ClosedLoop`).
      seed: seed of the session start times and of the order sessions are drawn in.
    """

    workload: SessionWorkload
    tpot_s: float
    window_s: float
    max_think_s: float
    seed: int = 0

    @property
    def requests(self) -> tuple[Request, ...]:
        return self.workload.requests

    def with_requests(self, requests: Sequence[Request]) -> SessionLoad:
        return dataclasses.replace(self, workload=self.workload.with_requests(requests))

    def capacity_rate(self, gpu_seconds: Callable[[Request, int], float], num_gpus: int) -> float:
        """Sessions/s at which `num_gpus` are exactly busy when each request costs
        `gpu_seconds(request, h)` with h its hit in an unbounded cache (module doc)."""
        hits = prefix_hit_tokens(self.requests)
        per_session = sum(gpu_seconds(r, int(h)) for r, h in zip(self.requests, hits)) / len(
            self.workload.roots)
        return num_gpus / per_session

    def working_set_tokens(self, rate: float) -> float:
        """The contexts the pool must keep for the sessions active at once in steady state at
        `rate` sessions/s (tokens): `rate x E[instance duration] x E[context]`, a duration
        being its capped think times plus its decode, a context a session's mean input."""
        w, cap = self.workload, self.max_think_s
        durations, contexts = [], []
        for root in w.roots:
            ses = w.sessions[root]
            durations.append(sum(min(t, cap) for t in ses.think_times)
                             + sum(w.requests[i].output_len * self.tpot_s for i in ses.steps))
            contexts.append(sum(w.requests[i].input_len for i in ses.steps) / len(ses.steps))
        n = len(w.roots)
        return rate * (sum(durations) / n) * (sum(contexts) / n)

    def sample_order(self, n: int) -> list[int]:
        """Indices of `n` templates for a demand sample: round-robin over the top-level
        sessions in turn (request k of every session before request k+1 of any), so a sample
        sees many sessions at once, as the replay does, each in its own order."""
        w = self.workload
        queues = [list(w.sessions[r].steps) for r in w.roots]
        out: list[int] = []
        k = 0
        while len(out) < n and any(k < len(q) for q in queues):
            out += [q[k] for q in queues if k < len(q)][:n - len(out)]
            k += 1
        return out

    def request_rate(self, rate: float) -> float:
        """The steady-state request rate of `rate` sessions/s (req/s)."""
        return rate * self.workload.requests_per_session()

    def at_rate(self, rate: float) -> tuple[list[Request], ClosedLoop]:
        """The simulator's input at `rate` sessions/s: no fixed arrivals, a closed-loop source."""
        starts = session_starts(self.workload, rate, self.window_s, self.seed)
        return [], ClosedLoop(self.workload, starts, self.tpot_s, self.max_think_s)

    def describe(self, rate: float) -> dict:
        return {"request_rate": self.request_rate(rate), "session_rate": rate,
                "session_window_s": self.window_s, "tpot_ms": self.tpot_s * 1e3,
                "max_think_time_s": self.max_think_s,
                "replay": "closed-loop"}


def offered_load(workload: Sequence[Request] | SessionWorkload, cfg) -> OpenLoad | SessionLoad:
    """The load of `workload` under `cfg` (an `eval.replay_config.ReplayConfig`): a
    `SessionLoad` for sessions, else an `OpenLoad`."""
    if isinstance(workload, SessionWorkload):
        return SessionLoad(workload, cfg.tpot_ms / 1e3, cfg.session_window_s,
                           cfg.max_think_time_s, cfg.seed)
    return OpenLoad(list(workload))
