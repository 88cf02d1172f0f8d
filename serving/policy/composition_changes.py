"""The changes the default split/merge controller weighs (`serving.policy.composition`): per
degree, the split and the merge that drain first, and the `Scheduler.begin_reconfiguration`
arguments of making one.

Plain Python over the pool's `WorkerState`s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence

from serving.policy.composition_config import CompositionConfig
from serving.policy.worker import WorkerState, are_buddies, merge_buddies, split_halves


def candidate_changes(active: Sequence[WorkerState], now: float, known: Collection[int],
                      config: CompositionConfig, longest: int,
                      max_input_len: Callable[[int], int]
                      ) -> Iterator[tuple[list[WorkerState], list[int]]]:
    """Per degree C of `active` (ascending), the split of the degree-C worker that drains first
    (`(old workers, new degrees)`: `([w], [C/2, C/2])`) and the merge of the buddy pair of
    degree C whose later one drains first (`([a, b], [2C])`; `are_buddies`: never across
    hosts), ties to the lower first device; into degrees within `config`'s
    `[min_degree, max_degree]` and in `known` only (those the cost model and the window
    predict). A split that would leave no worker able to hold `longest` tokens (the only
    holder, its halves below it by `max_input_len(C / 2)`) is not offered. `now`: seconds,
    for the workers' outstanding work. O(workers^2) per degree at worst (the pairs)."""
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


def change_op(scheduler, olds: Sequence[WorkerState], max_input_len: Callable[[int], int]):
    """`(kind, old worker ids, new WorkerSpecs)`, the `Scheduler.begin_reconfiguration`
    arguments of replacing `olds` (one worker: split into halves; two buddies: merged), with
    fresh ids from `scheduler.new_worker_ids`."""
    if len(olds) == 1:
        new = split_halves(olds[0].spec, scheduler.new_worker_ids(2), max_input_len)
        return "split", [olds[0].worker_id], list(new)
    [new_id] = scheduler.new_worker_ids(1)
    return ("merge", [olds[0].worker_id, olds[1].worker_id],
            [merge_buddies(olds[0].spec, olds[1].spec, new_id, max_input_len)])
