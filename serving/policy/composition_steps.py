"""The steps `serving.policy.composition.CompositionController` may take, and the credit that
lets it take a step toward its target before the step pays on the window alone.

`candidate_changes` lists, per degree, the split and the merge that drain first. `StayingRegret`
keeps the controller's ski-rental account (Karlin, Manasse, McGeoch, Owicki, "Competitive
randomized algorithms for nonuniform problems", Algorithmica 11, 1994; the deterministic
break-even rule of rent-or-buy): while a target composition is predicted better than the
current one by the margin, every arrival the pool serves staying as it is pays "rent", the
predicted TTFT the target would save it; a step whose own transition makes it worse than
staying on the window (the "purchase") is taken once the rent paid covers its cost. Paying at
most twice what the better of "never move" and "move at once" would pay is the rule's bound. The
controller keeps the account only while the window's load is above 1: with queues that grow, the
window's replay ends before the cost of staying does (`serving.policy.composition`'s module doc).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from serving.policy.composition_config import CompositionConfig
from serving.policy.worker import WorkerState, are_buddies


def candidate_changes(active: Sequence[WorkerState], now: float, known,
                      config: CompositionConfig, max_input_len: Callable[[int], int],
                      longest: int) -> Iterator[tuple[list[WorkerState], list[int]]]:
    """Per degree, the split and the merge that drain first: `(old workers, new degrees)`.

    Args:
      active: the pool's active workers.
      now: simulated or wall time (s), for each worker's outstanding work.
      known: degrees a change may make (those the cost model and the window predict).
      config: its `min_degree` and `max_degree` bound the new degrees.
      max_input_len: `cp_degree -> tokens` a worker of that degree holds.
      longest: the longest prompt seen or expected (tokens): the last worker holding it is not
        split into halves that cannot.

    A split takes the worker of its degree with the least outstanding work (then the lowest
    first device); a merge the buddy pair (`are_buddies`) whose busier worker drains first."""
    now_load = {w.worker_id: w.outstanding_seconds(now) for w in active}
    holders = [w for w in active if w.spec.max_input_len >= longest]
    for c in sorted({w.cp_degree for w in active}):
        if c // 2 >= config.min_degree and c // 2 in known:
            cands = [w for w in active if w.cp_degree == c and not (
                holders == [w] and max_input_len(c // 2) < longest)]
            if cands:
                w = min(cands, key=lambda w: (now_load[w.worker_id], w.spec.first_device))
                yield [w], [c // 2, c // 2]
        if 2 * c <= config.max_degree and 2 * c in known:
            pairs = [(a, b) for a, b in itertools.combinations(
                [w for w in active if w.cp_degree == c], 2) if are_buddies(a.spec, b.spec)]
            if pairs:
                a, b = min(pairs, key=lambda p: (
                    max(now_load[p[0].worker_id], now_load[p[1].worker_id]),
                    min(p[0].spec.first_device, p[1].spec.first_device)))
                yield [a, b], [2 * c]


class StayingRegret:
    """The rent staying has paid against the target composition (TTFT-seconds; module doc).

    `arrive()` counts each new arrival (a re-routed request is none). At each evaluation that
    compares against the target, `accrue(gain_s)` adds `gain_s` (s: the predicted mean TTFT the
    target saves per request, beyond the backlog) for every arrival since the last `accrue` or
    `reset`, and returns the total; `reset()` clears it: when the target stops beating the
    current composition by the margin or the load falls to 1 (the need has passed: a rental
    ends), and when a change is made (the pool the rent was paid for is gone). `covers(extra_s, n)`: whether a step
    predicted `extra_s` (s) worse per request than staying over a window of `n` requests is
    paid for (a step no worse than staying always is).
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.arrivals = 0
        self._counted = 0

    def arrive(self) -> None:
        self.arrivals += 1

    def accrue(self, gain_s: float) -> float:
        self.total += gain_s * (self.arrivals - self._counted)
        self._counted = self.arrivals
        return self.total

    def reset(self) -> None:
        self.total, self._counted = 0.0, self.arrivals

    def covers(self, extra_s: float, n: int) -> bool:
        return extra_s * n <= self.total
