"""The changes the default split/merge controller weighs (`serving.policy.composition`): per
degree, the split and the merge that drain first; the further splits an overload's step is
made with (a worker's halvings as one change into their parts); the degrees a change may make
and the target the changes are compared with, and the splits that make it at once; when a
change's new workers start serving; and the `Scheduler.begin_reconfiguration` arguments of
making one.

Plain Python over the pool's `WorkerState`s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence

from serving.policy.composition_config import CompositionConfig
from serving.policy.pool_load import pool_backlog, pool_load
from serving.policy.whatif import Window, target_composition
from serving.policy.worker import (WorkerState, WorkerStatus, are_buddies, host_degree_cap,
                                   merge_buddies, split_parts)


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


def further_splits(active: Sequence[WorkerState], first: Sequence[WorkerState],
                   added: Sequence[int], load: float, window: Window, elapsed: float | None,
                   now: float, known: Collection[int], config: CompositionConfig,
                   longest: int, max_input_len: Callable[[int], int], clear: float = 0.0
                   ) -> list[tuple[list[WorkerState], list[int], float]]:
    """The changes an overload's step is made as (`serving.policy.composition`), so their
    drains overlap and each worker is re-carved once: after the step replacing `first` by
    workers of degrees `added` (the window's `pool_load` then `load`), while the load plus
    `clear` (the backlog to clear by the next evaluation, as a share of capacity; 0 where the
    rule does not count it) is above 1, the halving that lowers the load most, of a worker of
    `active` not yet changed (`candidate_changes`) or of a part a planned split makes (per
    planned worker and degree, its first such part), if one does. A worker's planned halvings
    are one change into the parts they make (`serving.policy.worker.split_parts`): one drain
    and one re-carve, not one per halving (from CP-8 to CP-1 one second of re-carving, not
    three). The plan stops
    about where the rule would stop after the step (load + clear at most 1; `clear` as measured
    before it, at the old degrees, where the same backlog is a little more work), so the splits
    it would make one re-carve after another come in this one (planned to the load alone, the
    90 req/s case of the issue took five re-carve rounds, 5 s, to reach CP-1; eval/RESULTS.md
    item 24). A halving that would leave no worker able to hold `longest` tokens is not made;
    without `config.deep_splits` no part is halved (two halves a change).

    Returns:
      `(old workers, new degrees in device order, load after)` per change, the step's first
      (a merge step's is `(first, added, load)`), then in the order first planned; `load
      after` is the window's load once that change's parts were planned. `now`: seconds.
    """
    plan: dict[int, list] = {first[0].worker_id: [list(first), list(added), load]}
    merge_step = len(first) != 1 or len(added) < 2  # (its worker stays whole)
    used = list(first)
    while load + clear > 1.0:
        rest = [w for w in active if w not in used]
        parts = {wid: p[1] for wid, p in plan.items()}
        held = [c for ps in parts.values() for c in ps] + [w.cp_degree for w in rest]
        holders = sum(1 for w in rest if w.spec.max_input_len >= longest) + sum(
            1 for ps in parts.values() for c in ps if max_input_len(c) >= longest)
        more = []  # (load after, old workers, their parts after, planned worker id or None)
        for olds, news in candidate_changes(rest, now, known, config, longest, max_input_len):
            if len(news) > len(olds):
                degrees = list(held)
                degrees.remove(olds[0].cp_degree)
                more.append((pool_load(degrees + news, window, elapsed), olds, news, None))
        for wid, ps in (parts.items() if config.deep_splits else ()):
            if wid == first[0].worker_id and merge_step:
                continue
            for c in sorted(set(ps)):
                half = c // 2
                if half < config.min_degree or half not in known or (
                        max_input_len(half) < longest <= max_input_len(c) and holders <= 1):
                    continue
                k = ps.index(c)
                after = ps[:k] + [half, half] + ps[k + 1:]
                degrees = list(held)
                degrees.remove(c)
                more.append((pool_load(degrees + [half, half], window, elapsed),
                             plan[wid][0], after, wid))
        if not more or min(m[0] for m in more) >= load:
            break
        load, olds, after, wid = min(more, key=lambda m: m[0])
        if wid is None:
            used += olds
            plan[olds[0].worker_id] = [olds, after, load]
        else:
            plan[wid][1:] = [after, load]
    return [(olds, ps, after) for olds, ps, after in plan.values()]


def change_op(scheduler, olds: Sequence[WorkerState], max_input_len: Callable[[int], int],
              parts: Sequence[int] | None = None):
    """`(kind, old worker ids, new WorkerSpecs)`, the `Scheduler.begin_reconfiguration`
    arguments of replacing `olds` (one worker: split into its halves, or into `parts`, CP
    degrees in device order, `split_parts`; two buddies: merged), with fresh ids from
    `scheduler.new_worker_ids`."""
    if len(olds) == 1:
        c = olds[0].cp_degree
        parts = [c // 2, c // 2] if parts is None else list(parts)
        new = split_parts(olds[0].spec, parts, scheduler.new_worker_ids(len(parts)),
                          max_input_len)
        return "split", [olds[0].worker_id], list(new)
    [new_id] = scheduler.new_worker_ids(1)
    return ("merge", [olds[0].worker_id, olds[1].worker_id],
            [merge_buddies(olds[0].spec, olds[1].spec, new_id, max_input_len)])


def hold_merge(scheduler, now: float, config: CompositionConfig, longest: int,
               max_input_len: Callable[[int], int]):
    """`(change_op, old worker ids)` of the merge making the largest worker (`candidate_changes`'
    merges), or None when a worker of the pool is not ACTIVE (a change in progress) or no merge
    is possible: the step the controller makes while no worker holds a refused prompt. `now`:
    seconds."""
    workers = scheduler.workers.values()
    active = [w for w in workers if w.status is WorkerStatus.ACTIVE]
    if not active or len(active) != len(workers):
        return None
    merges = [(olds, news) for olds, news in candidate_changes(
        active, now, set(change_degrees(scheduler, active, config)), config, longest,
        max_input_len) if len(news) < len(olds)]
    if not merges:
        return None
    olds, _ = max(merges, key=lambda m: m[1][0])
    return change_op(scheduler, olds, max_input_len), [w.worker_id for w in olds]


def change_degrees(scheduler, active: Sequence[WorkerState],
                   config: CompositionConfig) -> list[int]:
    """The CP degrees a change may make (within `config`'s range, predicted by the scheduler's
    cost model when it names its `degrees`, within one host: `host_degree_cap`) and those
    `active` has, ascending."""
    known = getattr(scheduler.cost_model, "degrees", None)  # degrees it can predict
    top = min(config.max_degree, host_degree_cap(w.spec for w in active))  # inside one host
    return sorted({w.cp_degree for w in active} | {
        c for c in (1, 2, 4, 8, 16, 32, 64) if config.min_degree <= c <= top
        and (known is None or c in known)})


def target_of(active: Sequence[WorkerState], window: Window, now: float,
              config: CompositionConfig, longest: int, max_input_len: Callable[[int], int]):
    """`serving.policy.whatif.target_composition` for the pool `active` at `now` (s): the
    degrees the window predicts within `config`'s range, a worker able to hold `longest`
    tokens kept, every worker starting with the pool's backlog (`pool_backlog`)."""
    degrees = [c for c in window.seconds if config.min_degree <= c <= config.max_degree]
    need = min((c for c in degrees if max_input_len(c) >= longest), default=max(degrees))
    return target_composition([w.cp_degree for w in active], pool_backlog(active, now),
                              window, config.lam, degrees, need)


def change_start(olds: Sequence[WorkerState], parts: Sequence[int], now: float,
                 config: CompositionConfig, window: Window | None = None) -> float:
    """Seconds from `now` until the workers of degrees `parts` replacing `olds` (one worker, or
    buddies of one degree C) start serving: the longest running prefill's rest (the drain),
    `config.recarve_s`, and the work queued on `olds` (re-routed to the new workers) spread over
    them. Without `window`, its seconds at degree C are spread evenly (the single changes' rule,
    as measured); with it, it is served by all of them together, each at its own degree d:
    `queued / sum_d speed(C, d)` (`relative_speed`; the splits to a target, which go deep: a
    CP-8's queue re-routed to eight CP-1 takes about five times its CP-8 seconds spread over
    them)."""
    drain = max(w.running_estimate - (now - w.running_start) if w.running else 0.0 for w in olds)
    queued = sum(w.queued_seconds for w in olds)
    if queued > 0:
        if window:  # (one speed per distinct degree: a window pass each)
            c = olds[0].cp_degree
            speed = {d: relative_speed(window, c, d) for d in set(parts)}
            queued /= sum(speed[d] for d in parts)
        else:
            queued /= len(parts)
    return max(drain, 0.0) + config.recarve_s + queued


def relative_speed(window: Window, c: int, d: int) -> float:
    """Seconds of degree-`c` work a worker of degree `d` serves a second: `sum T(c) / sum
    T(d)` over the window's requests both degrees hold (1 when none, or `c == d`)."""
    if c == d:
        return 1.0
    a = b = 0.0
    for x, y in zip(window.seconds[c], window.seconds[d]):
        if x is not None and y is not None:
            a, b = a + x, b + y
    return a / b if a > 0 and b > 0 else 1.0


def target_splits(active: Sequence[WorkerState], target: Sequence[int], now: float,
                  config: CompositionConfig, free: dict[int, float], window: Window):
    """The splits that make the composition `target` (CP degrees) from `active` at once, or
    None when it needs a merge, holds other GPUs or is the current composition.

    Workers of a degree the target keeps stay whole, the busiest first (the least busy of a
    degree drain soonest); the target's other degrees fill the rest, largest first into the
    first worker with room (first-fit decreasing, exact for power-of-two degrees), each
    worker's parts in descending order (an aligned tiling: `serving.policy.worker.split_parts`).

    Args:
      active: the pool's ACTIVE workers.
      target: CP degrees (`target_of`).
      now: seconds.
      config: the controller's (`recarve_s`).
      free: worker id -> seconds until it is free (outstanding work).
      window: the evaluation's (`change_start`'s speeds).

    Returns:
      `(plan, degrees, starts)`: per worker split `(worker, its parts)`, in device order; the
      composition after (the workers kept, then the parts); per worker of it, seconds until it
      serves (`free`, or `change_start` of its split).
    """
    if sum(target) != sum(w.cp_degree for w in active):
        return None
    left = sorted(target, reverse=True)
    kept, rest = [], []
    for w in sorted(active, key=lambda w: (-free[w.worker_id], w.spec.first_device)):
        if w.cp_degree in left:
            left.remove(w.cp_degree)
            kept.append(w)
        else:
            rest.append(w)
    rest.sort(key=lambda w: w.spec.first_device)
    parts: dict[int, list[int]] = {w.worker_id: [] for w in rest}
    room = {w.worker_id: w.cp_degree for w in rest}
    for c in left:
        w = next((w for w in rest if room[w.worker_id] >= c), None)
        if w is None:
            return None
        parts[w.worker_id].append(c)
        room[w.worker_id] -= c
    if not rest or any(room.values()):
        return None
    plan = [(w, parts[w.worker_id]) for w in rest]
    kept.sort(key=lambda w: w.spec.first_device)
    degrees, starts = [w.cp_degree for w in kept], [free[w.worker_id] for w in kept]
    for w, ps in plan:
        degrees += ps
        starts += [change_start([w], ps, now, config, window)] * len(ps)
    return plan, degrees, starts
