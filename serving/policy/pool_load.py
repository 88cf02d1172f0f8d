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

from serving.policy.cost_router import live_set_of
from serving.policy.whatif import Window
from serving.policy.worker import WorkerState, WorkerStatus


def kv_pressure(scheduler, active: Sequence[WorkerState], now: float) -> float | None:
    """The pool's live working set that is reused, over its KV capacity (blocks over blocks):
    `p * live / capacity`, with the router's live blocks (`serving.policy.live_set.
    LiveWorkingSet.total`; contexts of workers that left the pool within the horizon counted
    once) and their observed reuse rate `p` (blocks used once never bind the caches); None
    when the router keeps no live sets."""
    live = live_set_of(scheduler.router)
    if live is None or not active:
        return None
    blocks = live.total(now, [w.worker_id for w in active])
    return live.reuse_rate * blocks / sum(w.spec.kv_capacity_blocks for w in active)


def pool_load(degrees: Sequence[int], window: Window,
              elapsed: float | None = None) -> float:
    """The window's work over the composition's capacity, at the degrees its workers have.

    Request i, spread over the degrees `H_i` that can hold it in proportion to their speed
    (every one of their workers busy: the fluid limit of a placement that balances them),
    keeps them busy for `b_i = 1 / sum_{C in H_i} (G_C / (C * T_C(i)))` seconds, `G_C` being
    the GPUs of the pool's degree-C workers (degree C serves `G_C / (C T_C)` such requests a
    second), that is `b_i * G(H_i)` GPU-seconds. The load is the largest, over the sets U of
    the pool's degrees, of the work only U can serve over U's capacity in the window's span:

        load = max_U  sum_{i : H_i within U} b_i * G(H_i) / G(U)  /  span

    Taking each request's GPU-seconds as fixed, this is exact for the fluid (preemptive)
    assignment: by Hall's condition for a transportation problem (the supply-demand theorem, D.
    Gale, "A theorem on flows in networks", Pacific J. Math. 7(2), 1957) the requests fit in
    `L * span * G_C` GPU-seconds per degree if and only if no set of degrees is asked for more
    than that. With every request held by every degree it is `sum_i b_i / span` (with one
    degree, the window's GPU-seconds over span x GPUs); a set U that is not every degree counts
    only the requests no other degree holds, so long prompts only large workers hold are
    charged to those workers, not to the whole pool (the single sum over every request did:
    eval/RESULTS.md, item 11). It is not the fewest GPU-seconds any degree needs (a pool of
    CP-4 workers and two CP-2 ones would count every request at CP-2's cost, and so miss the
    overload of its CP-4 workers, which do most of the work), and where the degrees' relative
    costs differ by length, the proportional spread is not the best assignment: it over-reads
    where sending each length to the degree it suits serves more, and it can under-read where
    the degrees a shared request would spread to are full with requests only they hold and the
    rest cost more per GPU (non-nested holders, or a larger degree cheaper per GPU-second: a
    few percent on the fitted profiles). An estimate, which the controller acts on only past
    `1 + min_gain`, each step predicted no slower than staying.

    Args:
      degrees: the composition, one CP degree per worker.
      window: the requests (`serving.policy.whatif.Window`: arrivals in seconds, sorted, and
        predicted prefill seconds per degree, None where a degree cannot hold the request).
      elapsed: now, on the window's clock (seconds; the controller's windows start at their
        first arrival, 0), or None for the last arrival; the span, from the first arrival to
        the later of the two, is at least 1 s.

    Returns:
      The load, >= 0 (0 for an empty window; a request no degree of `degrees` holds counts 0;
      predicted seconds that are 0, infinite or NaN count as not held). Cost: O(requests x
      degrees + sets x unions), `sets` the distinct holder sets and `unions` their unions
      (both at most the number of degrees when, as with `max_input_len`, a larger degree
      holds whatever a smaller one does; 2 ** degrees at worst).
    """
    n = len(window.arrivals)
    if not n:
        return 0.0
    gpus: dict[int, int] = {}
    for c in degrees:
        gpus[c] = gpus.get(c, 0) + c
    kinds = sorted(gpus)
    cols = [(gpus[c] / c, window.seconds[c], 1 << k) for k, c in enumerate(kinds)]
    by_set: dict[int, float] = {}  # H_i as a bit set of `kinds` -> sum of b_i
    for i in range(n):
        rate = 0.0  # such requests served a second
        held = 0
        for k, s, bit in cols:
            r = k / s[i] if s[i] else 0.0
            if r > 0.0:  # (seconds None, 0, infinite or NaN: not held)
                rate += r
                held |= bit
        if held:
            by_set[held] = by_set.get(held, 0.0) + 1.0 / rate
    # The largest ratio is at a union of holder sets (a set U that is not one asks as much of
    # the union of the holder sets within it, which has no more GPUs): only those are tried.
    unions: set[int] = set()
    for h in by_set:
        unions |= {h | u for u in unions}
        unions.add(h)
    size = {u: sum(gpus[c] for k, c in enumerate(kinds) if u >> k & 1)
            for u in unions | by_set.keys()}  # G(U) per bit set U
    work = max((sum(b * size[h] / size[u] if h != u else b
                    for h, b in by_set.items() if h & u == h)
                for u in unions), default=0.0)
    end = window.arrivals[-1] if elapsed is None else max(elapsed, window.arrivals[-1])
    return work / max(end - window.arrivals[0], 1.0)


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
