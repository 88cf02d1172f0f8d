"""The load signals the composition controller reads (`serving.policy.composition`).

`pool_load`: the work of a window of requests over what a composition serves, at its own
degrees (an estimate; above 1 the queues of a placement that balances the workers grow);
`pool_backlog`: the work queued and running now, as seconds of the whole pool; `kv_pressure`:
the pool's reused live working set over its KV capacity (above 1 the caches, not the compute,
bind the pool).

Plain Python over plain data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from serving.policy.live_set import LiveWorkingSet
from serving.policy.whatif import Window
from serving.policy.worker import WorkerState, WorkerStatus


def kv_pressure(scheduler, active: Sequence[WorkerState], now: float) -> float | None:
    """The pool's live working set that is reused, over its KV capacity (blocks over blocks):
    `p * live / capacity`, with the router's live blocks (`serving.policy.live_set.
    LiveWorkingSet.total`; contexts of workers that left the pool within the horizon counted
    once) and their observed reuse rate `p` (blocks used once never bind the caches); None
    when the router keeps no live sets."""
    live = getattr(scheduler.router, "live", None)
    if not isinstance(live, LiveWorkingSet) or not active:
        return None
    blocks = live.total(now, [w.worker_id for w in active])
    return live.reuse_rate * blocks / sum(w.spec.kv_capacity_blocks for w in active)


def pool_load(degrees: Sequence[int], window: Window,
              elapsed: float | None = None) -> float:
    """The window's work over the composition's capacity, at the degrees its workers have:
    request i keeps the whole pool busy for `1 / sum_C (G_C / (C * T_C(i)))` seconds, `G_C`
    being the GPUs of the pool's degree-C workers (so degree C serves `G_C / (C T_C)` such
    requests a second: every worker busy, the fluid limit of a placement that balances them),
    summed and divided by the span from the first arrival to now (`elapsed`). With one degree
    this is the window's GPU-seconds over (span x GPUs); with several it is not the fewest
    GPU-seconds any degree needs (a pool of CP-4 workers and two CP-2 ones would count every request
    at CP-2's cost, and so miss the overload of its CP-4 workers, which do most of the work).

    A fluid estimate, not a bound: exact with one degree; with several, the rate of a
    placement that spreads each request over every worker in proportion to its speed (where
    the degrees' relative costs differ by length, sending each length to the degree it suits
    serves more), and a request only some degrees hold is charged as if it kept the whole pool
    busy while they serve it (others could serve other requests meanwhile): mixes of lengths
    only large workers hold read high. The controller acts on it only past `1 + min_gain`, each
    step predicted no slower than staying.

    Args:
      degrees: the composition, one CP degree per worker.
      window: the requests (`serving.policy.whatif.Window`: arrivals in seconds, sorted, and
        predicted prefill seconds per degree, None where a degree cannot hold the request).
      elapsed: now, on the window's clock (seconds; the controller's windows start at their
        first arrival, 0), or None for the last arrival; the span, from the first arrival to
        the later of the two, is at least 1 s.

    Returns:
      The load, >= 0 (0 for an empty window; a request no degree of `degrees` holds counts 0).
    """
    n = len(window.arrivals)
    if not n:
        return 0.0
    gpus: dict[int, int] = {}
    for c in degrees:
        gpus[c] = gpus.get(c, 0) + c
    cols = [(g / c, window.seconds[c]) for c, g in sorted(gpus.items())]  # (workers, T_C)
    busy = []  # per request, seconds of the whole pool
    for i in range(n):
        rate = sum(k / s[i] for k, s in cols if s[i])  # such requests served a second
        busy.append(1.0 / rate if rate else 0.0)
    end = window.arrivals[-1] if elapsed is None else max(elapsed, window.arrivals[-1])
    return sum(busy) / max(end - window.arrivals[0], 1.0)


def pool_backlog(workers: Iterable[WorkerState], now: float) -> float:
    """The ACTIVE workers' outstanding prefill work (queued, and the running prefill's rest) at
    `now`, in seconds of the whole pool: `sum_w C_w * outstanding_w / sum_w C_w`, the wait a
    new request would have if the work were spread over every GPU (0 with no ACTIVE worker).
    O(workers)."""
    active = WorkerStatus.ACTIVE
    work = gpus = 0.0
    for w in workers:
        if w.status is active:
            c = w.cp_degree
            work += c * w.outstanding_seconds(now)
            gpus += c
    return work / gpus if gpus else 0.0
