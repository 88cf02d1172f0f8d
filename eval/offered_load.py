"""How a workload is offered to a simulated pool at a rate: open loop or closed loop.

- `OpenLoad`: a request trace. A rate re-times it (`eval.traces.workloads.scale_to_rate`: all
  gaps scaled uniformly); the capacity rate counts every request cold at the smallest degree.
- `SessionLoad`: agent sessions (`eval.traces.sessions`). A rate is *sessions* per second:
  session instances start as a Poisson process during a window (`session_starts`) and each
  runs closed-loop (`ClosedLoop`: a request is sent `think_time` after the previous response
  ended), so a session's own time is never compressed. Its capacity rate counts each request
  with the prefix an unbounded cache would give it (what the session itself made warm): with
  96 % of blocks reused inside sessions, the cold count would put load factor 1 at a few per
  cent of the pool's real load. Its demand sample for what-if replays is the run's own start on
  an idle pool (`demand_sample`), replayed at the KV share its working set has of the run's
  busiest (`replay_kv_share`).

`eval.experiment.run_sweep` drives both through the same steps.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Iterator, Sequence

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

    Raises:
      ValueError: tpot_s not finite and >= 0, window_s not finite and > 0, or max_think_s
        not >= 0 (inf allowed).
    """

    workload: SessionWorkload
    tpot_s: float
    window_s: float
    max_think_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        for name, v, ok in (("tpot_s", self.tpot_s, lambda v: math.isfinite(v) and v >= 0),
                            ("window_s", self.window_s, lambda v: math.isfinite(v) and v > 0),
                            ("max_think_s", self.max_think_s, lambda v: v >= 0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"SessionLoad.{name} must be a number of seconds "
                                 f"({'> 0' if name == 'window_s' else '>= 0'}"
                                 f"{', finite' if name != 'max_think_s' else ''}), got {v!r}")

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

    def instance_seconds(self) -> list[float]:
        """Per top-level session, how long an instance of it runs on an idle pool (seconds):
        from its start to the end of its last response, each response ending `output_len x
        tpot_s` after its request was sent and the next one sent its capped think time later;
        its sub-agents run inside it (`ClosedLoop`: the parent's next step waits for them).
        Computed once per load (it does not depend on the rate)."""
        return list(self._instance_seconds)

    @functools.cached_property
    def _instance_seconds(self) -> tuple[float, ...]:
        n = len(self.workload.roots)
        out = [0.0] * n
        # one instance of every session, all started at 0 (instance i runs root i)
        loop = ClosedLoop(self.workload, [(0.0, i) for i in range(n)], self.tpot_s,
                          self.max_think_s)
        for request, end in _idle_replay(loop, self.tpot_s):
            i = int(request.request_id.rpartition("@")[2])
            out[i] = max(out[i], end)
        return tuple(out)

    def replay_kv_share(self, sample: Sequence[Request]) -> float:
        """The share of each worker's KV a what-if replay of `sample` (`demand_sample`) gives
        it, so that the sample's sessions press on the caches as the run's do at its busiest.

        With Poisson starts during `[0, W)` (W = `window_s`), the instances active at time
        t <= W number `rate x E[min(D, t)]` (D an instance's duration, `instance_seconds`;
        Little's law for t >= every D): most at t = W. The sample spans the run's first t
        seconds (its first to its last arrival), so its working set is `E[min(D, t)] /
        E[min(D, W)]` of the run's busiest (the rate and the mean context cancel), and so is
        the share returned (1 once t >= W, or t >= every D). Without it a replay of the ramp
        ranks compositions as if contexts were never evicted (eval/RESULTS.md, item 9).

        Returns:
          A share in (0, 1]; 1 for fewer than two requests or sessions that take no time.
        """
        if len(sample) < 2:
            return 1.0
        times = [r.arrival_time for r in sample]
        t = min(max(times) - min(times), self.window_s)
        durations = self.instance_seconds()
        busiest = sum(min(d, self.window_s) for d in durations)
        if busiest <= 0 or t <= 0:
            return 1.0
        return min(1.0, max(sum(min(d, t) for d in durations) / busiest, 1e-9))

    def demand_sample(self, rate: float, n: int) -> list[Request]:
        """The first `n` requests of the closed-loop replay at `rate` sessions/s, timed as if
        the pool were idle (each first token at its request's arrival, so a response ends
        `output_len x tpot_s` after it was sent): the demand sample of the what-if replays.

        The same instances, start times, think times and ids as `at_rate` gives the simulator
        (`session_starts` with this load's seed), so the sample mixes first turns (cold, at the
        session rate) and later turns (warm, paced by their sessions) as the run does. Ordering
        templates round-robin over sessions instead puts every session's first turn at the
        request rate (12x the session rate at 0.3 sessions/s of the shared sessions): a cold
        burst the replay then ranks compositions by (eval/RESULTS.md, item 9).

        Returns:
          Up to `n` requests sorted by arrival (seconds from the first instance's start).
        """
        _, loop = self.at_rate(rate)
        out = []
        for request, _ in _idle_replay(loop, self.tpot_s):
            if len(out) >= n:
                break
            out.append(request)
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


def _idle_replay(loop: ClosedLoop, tpot_s: float) -> Iterator[tuple[Request, float]]:
    """`loop`'s requests in arrival order, with when each response ends, on an idle pool: each
    first token at its request's arrival, the response `output_len x tpot_s` later."""
    heap = [(t, k, r) for k, (t, r) in enumerate(loop.start())]
    heapq.heapify(heap)
    k = len(heap)
    while heap:
        t, _, r = heapq.heappop(heap)
        end = t + r.output_len * tpot_s
        yield r, end
        for arrival in loop.on_end(r.request_id, end):
            heapq.heappush(heap, (arrival[0], k, arrival[1]))
            k += 1
