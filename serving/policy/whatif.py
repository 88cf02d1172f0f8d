"""What-if replay: the predicted mean TTFT of a composition on a window of recent requests.

The controller (`serving.policy.composition`) and the initial composition compare candidate
compositions by replaying the same sample of requests through each, with the placement rule of
`serving.policy.cost_router.VertumnusRouter` (least `Q + T + lam * G`, G the GPU-seconds beyond
the cheapest degree at the same cached prefix) and the router's fitted cost model as the clock:

    for each request (t, L, h) in arrival order:
        w   = argmin over workers able to hold L of  max(free_w - t, 0) + T(C_w, L, h) + lam * G_w
        TTFT = max(free_w - t, 0) + T(C_w, L, h);   free_w = t + TTFT

Each worker serves one prefill at a time (FIFO, whatever the router's `queue_order`: the replay
compares compositions under one order, not orders). `h` is the prefix the request was expected to
find cached when it was placed (the controller records it), the same for every candidate: the
replay models queueing and degree efficiency, not how a composition changes cache locality.
A worker can start busy (`free_at`: outstanding work, or a transition's drain and re-carve), so
a candidate that needs a split or merge is charged the time its workers are unavailable.

`choose_initial` picks a pool's starting composition this way, over every composition of the
allowed degrees, on a sample of historical demand.

Cost: the predictions once per window (`Window.of`: one per request and degree), then one pass
per candidate, `O(len(sample) x degrees x log workers)`. Plain Python over plain data; no clock
is read.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

from serving.policy.composition_search import EXHAUSTIVE_LIMIT, count_compositions, pattern_search
from serving.policy.controller import compositions

# One sampled request: (arrival time in s, input tokens, cached tokens).
Sample = tuple[float, int, int]


@dataclasses.dataclass(frozen=True)
class Window:
    """A sample of requests with their predicted prefill seconds per degree, computed once and
    replayed through any number of candidate compositions.

    Attributes:
      arrivals: arrival times (seconds), sorted.
      seconds: per degree, per request, the predicted prefill seconds `T(C, L, h)`; None where
        a worker of that degree cannot hold the request.
      cheapest: per request, `min_C C * T(C, L, h)` over the degrees that hold it (GPU-s).
    """

    arrivals: tuple[float, ...]
    seconds: dict[int, tuple[float | None, ...]]
    cheapest: tuple[float, ...]

    @classmethod
    def of(cls, sample: Sequence[Sample], degrees: Sequence[int],
           predict: Callable[[int, int, int], float],
           max_input_len: Callable[[int], int] | None = None) -> Window:
        """Predicts every request of `sample` (sorted by time) at every degree.

        Raises:
          ValueError: the sample is not sorted by arrival time.
        """
        ts = [t for t, _, _ in sample]
        if any(b < a for a, b in zip(ts, ts[1:])):
            raise ValueError("sample must be sorted by arrival time")
        kinds = sorted(set(degrees))
        limit = {c: (max_input_len(c) if max_input_len else math.inf) for c in kinds}
        seconds = {c: tuple(predict(c, n, h) if n <= limit[c] else None for _, n, h in sample)
                   for c in kinds}
        cheapest = tuple(min((c * seconds[c][i] for c in kinds if seconds[c][i] is not None),
                             default=math.inf) for i in range(len(sample)))
        return cls(tuple(ts), seconds, cheapest)


def replay_ttft(degrees: Sequence[int], window: Window, lam: float = 1.0,
                free_at: Sequence[float] | None = None) -> tuple[float, int]:
    """Replays `window` through workers of the given degrees (module doc).

    Within one degree the earliest-free worker always has the least cost (the same T and G), so
    each request compares one worker per degree (a heap per degree): `O(len(window) x degrees x
    log workers)`.

    Args:
      degrees: CP degree of each worker; each must be one `window` was predicted for.
      window: the requests (`Window.of`).
      lam: weight of the GPU-time cost (as `VertumnusRouter.lam`), >= 0.
      free_at: per worker, the time (on the window's clock) it becomes free; 0 by default.

    Returns:
      `(mean TTFT in seconds over the requests some worker could hold, number of requests no
      worker of these degrees could hold)`; `(0.0, n)` when none could be held.

    Raises:
      ValueError: no worker, `free_at` of another length, a degree the window lacks, or a
        negative lam.
    """
    if not degrees:
        raise ValueError("degrees must name at least one worker")
    if free_at is not None and len(free_at) != len(degrees):
        raise ValueError(f"free_at must give one time per worker ({len(degrees)}), "
                         f"got {len(free_at)}")
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    missing = sorted(set(degrees) - set(window.seconds))
    if missing:
        raise ValueError(f"the window has no predictions for degrees {missing}")
    free = list(free_at) if free_at is not None else [0.0] * len(degrees)
    heaps: dict[int, list[float]] = {}
    for c, f in zip(degrees, free):
        heaps.setdefault(c, []).append(f)
    for h in heaps.values():
        heapq.heapify(h)
    per = [(c, window.seconds[c], heaps[c]) for c in sorted(heaps)]  # (hot loop below)
    cheapest, heapreplace, inf = window.cheapest, heapq.heapreplace, math.inf
    total, served, unheld = 0.0, 0, 0
    for i, t in enumerate(window.arrivals):
        best_heap, best_cost, best_ttft = None, inf, 0.0
        for c, seconds, heap in per:
            s = seconds[i]
            if s is None:
                continue
            wait = heap[0] - t
            ttft = (wait if wait > 0 else 0.0) + s
            cost = ttft + lam * (c * s - cheapest[i])
            if cost < best_cost:
                best_heap, best_cost, best_ttft = heap, cost, ttft
        if best_heap is None:
            unheld += 1
            continue
        heapreplace(best_heap, t + best_ttft)
        total += best_ttft
        served += 1
    return (total / served if served else 0.0), unheld


def best_composition(options: Sequence[Sequence[int]], window: Window, lam: float = 1.0
                     ) -> tuple[list[int], dict[tuple[int, ...], float]]:
    """The option of least predicted mean TTFT on `window` (`replay_ttft` from idle workers).

    An option that leaves more requests unheld loses to one that holds more; among equal
    predictions (within 0.1 %) the one listed first wins.

    Returns:
      `(the composition, {composition: predicted mean TTFT in seconds})`.

    Raises:
      ValueError: no option, or an empty window.
    """
    if not options:
        raise ValueError("options must name at least one composition")
    if not window.arrivals:
        raise ValueError("window must hold at least one request")
    scored = {}
    for comp in options:
        ttft, unheld = replay_ttft(comp, window, lam)
        scored[tuple(comp)] = (unheld, ttft)
    best = min(scored.values())
    near = [c for c in scored if scored[c][0] == best[0] and scored[c][1] <= best[1] * 1.001]
    return list(near[0]), {c: v[1] for c, v in scored.items()}


def choose_initial(num_gpus: int, degrees: Sequence[int], sample: Sequence[Sample],
                   predict: Callable[[int, int, int], float], lam: float = 1.0,
                   max_input_len: Callable[[int], int] | None = None,
                   min_largest_degree: int = 1, exhaustive_limit: int = EXHAUSTIVE_LIMIT
                   ) -> tuple[list[int], dict[tuple[int, ...], float]]:
    """The starting composition: of every composition of `degrees` filling `num_gpus` with a
    worker of at least `min_largest_degree`, the one of least predicted mean TTFT when `sample`
    (historical demand: `(t, L, h)` sorted by t) is replayed through it
    (`serving.policy.whatif.best_composition`). Above `exhaustive_limit` compositions they are
    searched (`composition_search.pattern_search`, from the most large-degree workers that
    fill the pool): the best found, and the figures only of those visited.

    Returns:
      `(composition, {composition: predicted mean TTFT in seconds})`, every composition
      listed, or those the search visited that hold every request of the sample (where none
      does, every composition is listed after all).

    Raises:
      ValueError: no composition fills `num_gpus`, or an empty sample.
    """
    start, left = [], num_gpus  # (the most large-degree workers: one composition, if any)
    for c in sorted(set(degrees), reverse=True):
        start += [c] * (left // c)
        left %= c
    if not left and count_compositions(num_gpus, degrees) > exhaustive_limit:
        window = Window.of(sample, degrees, predict, max_input_len)
        if not window.arrivals:
            raise ValueError("window must hold at least one request")
        scores: dict[tuple[int, ...], float] = {}

        def ttft(comp):
            t, unheld = replay_ttft(comp, window, lam)
            if not unheld:
                scores[tuple(comp)] = t
            return math.inf if unheld else t
        found, comp = pattern_search(start, degrees, min_largest_degree, ttft)
        if math.isfinite(found):  # (else no composition visited holds every request: list)
            return list(comp), scores
    options = [c for c in compositions(num_gpus, degrees) if max(c) >= min_largest_degree]
    if not options:
        raise ValueError(f"no composition of degrees {list(degrees)} fills num_gpus={num_gpus} "
                         f"with a worker of degree >= {min_largest_degree}")
    window = Window.of(sample, degrees, predict, max_input_len)
    return best_composition(options, window, lam)


def target_composition(current: Sequence[int], spread: float, window: Window, lam: float,
                       degrees: Sequence[int], need: int, exhaustive_limit: int = EXHAUSTIVE_LIMIT
                       ) -> tuple[tuple[int, ...], float, float, float]:
    """The best composition of the pool's GPUs when every worker of each one starts with the
    pool's backlog (the composition controller's comparison "on equal terms").

    Args:
      current: the pool's CP degrees, one per worker.
      spread: the pool's backlog `B`, its outstanding prefill work now in seconds of the whole
        pool (`serving.policy.pool_load.pool_backlog`).
      window: the recent requests, replayed from now (`Window`).
      lam: the placement cost's lambda.
      degrees: the degrees a composition may use.
      need: the smallest largest degree a composition must have (a worker for the longest
        prompt).
      exhaustive_limit: the most compositions replayed one by one; a pool with more is searched.

    Returns:
      `(composition, its predicted mean TTFT, the current one's, the backlog)`: TTFTs in
      seconds with every worker starting at the backlog `B` (outstanding GPU-seconds per GPU);
      the last figure is what every composition pays alike, each request's wait for `B` to
      clear (mean over the window, s). The current composition when none is faster. Every
      composition is replayed up to `exhaustive_limit` of them; a larger pool's are searched
      (`composition_search.pattern_search`: the best found, not proven the best).
    """
    gpus = sum(current)
    backlog = sum(max(spread - t, 0.0) for t in window.arrivals) / len(window.arrivals)
    now = sorted(current)
    now_ttft, _ = replay_ttft(now, window, lam, [spread] * len(now))
    if count_compositions(gpus, degrees) > exhaustive_limit:  # a large pool: search
        def ttft(comp):
            t, unheld = replay_ttft(comp, window, lam, [spread] * len(comp))
            return math.inf if unheld else t
        found, comp = pattern_search(now, degrees, need, ttft)
        return (comp, found, now_ttft, backlog) if found < now_ttft else (
            tuple(now), now_ttft, now_ttft, backlog)
    best = (now_ttft, tuple(now))
    for comp in compositions(gpus, degrees):
        if max(comp) < need:
            continue
        ttft, unheld = replay_ttft(comp, window, lam, [spread] * len(comp))
        if not unheld and ttft < best[0]:
            best = (ttft, tuple(comp))
    return best[1], best[0], now_ttft, backlog


def steps_between(a: Sequence[int], b: Sequence[int]) -> int:
    """Splits and merges from composition `a` to `b` (same GPUs): the change in worker count
    (exact when one refines the other), at least 1 when they differ."""
    if sorted(a) == sorted(b):
        return 0
    return max(1, abs(len(a) - len(b)))


def moves_toward(current: Sequence[int], removed: Sequence[int], added: Sequence[int],
                 target: Sequence[int]) -> bool:
    """Whether replacing workers of degrees `removed` by workers of degrees `added` takes the
    composition `current` (CP degrees) fewer `steps_between` from `target`."""
    after = list(current) + list(added)
    for c in removed:
        after.remove(c)
    return steps_between(after, target) < steps_between(current, target)
