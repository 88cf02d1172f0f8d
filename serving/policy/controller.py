"""Cluster-level reconfiguration controller: when to split and merge (paper section 6).

Demand is measured as the *predicted prefill GPU-seconds arriving per second* (each arrival
weighs `C_min * T(C_min, L, h)`, so long prompts count by their work, i.e. token-weighted),
divided by the pool's capacity (its GPU count), and smoothed over a sliding window:

    load(t) = max(sum_{arrivals in (t - window, t]} C_min * T(C_min, L_i, h_i) / (window * num_gpus),
                  sum_w C_w * Q_w(t) / (window * num_gpus))

with h_i the prefix the chosen worker is expected to hold and Q_w the reserved, unfinished work
of worker w (the second term keeps a backlog from looking like low demand).

- load above `upper` for `hold_s` -> **split** one worker of degree 2C into two of degree C
  (more, smaller workers: more parallel queues, less GPU time lost to small prompts), but only
  when the split adds capacity for the current mix: `split_gain` (GPU-seconds at 2C over those
  at C, from the cost model over the window's arrivals) at least `1 + min_split_gain`;
- load below `lower` for `hold_s` -> **merge** two buddy workers of degree C into one 2C
  (fewer, faster workers: lower TTFT when queues are short);
- load stable (within `stable_band` of the load when the long-request share was last reset),
  not above `upper`, and the token share of long requests (`>= long_threshold` tokens) rising
  by more than `long_share_rise` -> **merge**;
- load below `upper - merge_margin` for `hold_s` and a merge that costs at most
  `min_split_gain` of capacity for the current mix -> **merge** (larger degrees cut TTFT; when
  CP scales well for the mix they cost nothing, and the pool returns to large workers as soon
  as the load allows, the state `initial_composition` also prefers).

Candidates are ranked by predicted drain interval (the outstanding work of the workers
concerned, seconds), then by the KV reconciliation traffic the change implies (cached blocks
of the workers concerned). One reconfiguration at a time, then a `cooldown_s` pause.

`initial_composition` picks the starting mix from historical demand: among compositions of the
allowed degrees with enough capacity, the one with the most large-degree workers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence

from serving.policy.checks import is_power_of_two, require_finite
from serving.policy.request import Request
from serving.policy.reconfiguration import StrandedRequests
from serving.policy.worker import (WorkerStatus, are_buddies, host_degree_cap, merge_buddies,
                                   split_halves)


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Thresholds of the controller (see the module docstring); times in seconds.

    Raises:
      ValueError: naming the field, for a value out of range (0 <= lower < upper, positive
        window, non-negative hold and cooldown, long_share_rise in (0, 1]).
    """

    upper: float = 0.85
    lower: float = 0.35
    window_s: float = 30.0
    hold_s: float = 10.0
    cooldown_s: float = 10.0
    long_threshold: int = 16384
    long_share_rise: float = 0.2
    stable_band: float = 0.15
    min_degree: int = 1
    max_degree: int = 8
    min_split_gain: float = 0.03
    merge_margin: float = 0.1

    def __post_init__(self) -> None:
        require_finite(self, ("upper", "lower", "window_s", "hold_s", "cooldown_s", "long_share_rise",
                     "stable_band", "min_split_gain", "merge_margin"))
        for name in ("min_degree", "max_degree"):
            c = getattr(self, name)
            if not is_power_of_two(c):
                raise ValueError(f"{name} must be a power of two >= 1, got {c!r}")
        if (self.long_threshold < 1 or self.stable_band < 0 or self.min_split_gain < 0
                or self.merge_margin < 0):
            raise ValueError("long_threshold >= 1 and stable_band, min_split_gain, merge_margin "
                             ">= 0 required")
        if not 0 <= self.lower < self.upper:
            raise ValueError(f"need 0 <= lower < upper, got lower={self.lower}, upper={self.upper}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {self.window_s}")
        if self.hold_s < 0 or self.cooldown_s < 0:
            raise ValueError(f"hold_s and cooldown_s must be >= 0, got {self.hold_s}, {self.cooldown_s}")
        if not 0 < self.long_share_rise <= 1:
            raise ValueError(f"long_share_rise must be in (0, 1], got {self.long_share_rise}")
        if not 1 <= self.min_degree <= self.max_degree:
            raise ValueError(f"need 1 <= min_degree <= max_degree, got {self.min_degree}, {self.max_degree}")


class ReconfigurationController:
    """Splits and merges workers as load changes; a `Scheduler` tick hook.

    Args:
      config: `ControllerConfig`.
      num_gpus: the pool's GPU count (capacity in GPU-seconds per second).
      max_input_len: `cp_degree -> tokens` for the workers it creates.

    Use: `controller.attach(scheduler)` registers its submit and tick hooks, and a membership
    hook: when workers are lost or added (`Scheduler.lose_workers` / `add_workers`) `num_gpus`
    follows the pool. `decisions` logs every decision with its load figures. A merge never
    makes a worker span hosts (`are_buddies` needs one host; degrees are capped at
    `host_degree_cap`).
    """

    def __init__(self, config: ControllerConfig, num_gpus: int,
                 max_input_len: Callable[[int], int]) -> None:
        if not isinstance(num_gpus, int) or num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {num_gpus!r}")
        self.config = config
        self.num_gpus = num_gpus
        self.max_input_len = max_input_len
        self.decisions: list[dict] = []
        # (t, gpu_s, tokens, long, cached tokens) per arrival in the window
        self._arrivals: deque[tuple[float, float, int, bool, int]] = deque()
        self._gpu_s = 0.0
        self._tokens = 0
        self._long_tokens = 0
        self._high_since: float | None = None
        self._calm_since: float | None = None
        self._gain_memo: dict[tuple, float] = {}
        self._first_seen: float | None = None
        self._low_since: float | None = None
        self._quiet_until = 0.0
        self._ref_share: float | None = None
        self._ref_load = 0.0
        self._scheduler = None
        self.longest = 0  # longest prompt seen (tokens): a split never leaves none to hold it

    def attach(self, scheduler) -> None:
        self._scheduler = scheduler
        scheduler.placement_hooks.append(self.observe)
        scheduler.tick_hooks.append(self.tick)
        membership = getattr(scheduler, "membership", None)
        if membership is not None:
            membership.hooks.append(self.on_membership)

    def on_membership(self, lost, added, now: float) -> None:
        """Workers left or joined the pool (specs): plans with the GPUs it has now."""
        self.num_gpus += sum(s.cp_degree for s in added) - sum(s.cp_degree for s in lost)

    # ------------------------------------------------------------------------- demand
    def observe(self, request: Request, cached_len: int, now: float) -> None:
        """Counts a placed request's predicted GPU-seconds at the smallest degree.

        `cached_len` is the prefix the chosen worker is expected to hold (cached or promised
        by its queue), so demand counts the work the pool will really do, not what an
        unbounded cache would save. A request placed again (`Scheduler.rerouting`: re-routed
        when its worker drained for a change, or was lost) is no new arrival and not counted.
        """
        if getattr(self._scheduler, "rerouting", False):
            return
        cfg, n = self.config, request.input_len
        c = cfg.min_degree
        gpu_s = c * self._scheduler.cost_model.predict(c, n, cached_len)
        is_long = n >= cfg.long_threshold
        self._arrivals.append((now, gpu_s, n, is_long, cached_len))
        if self._first_seen is None:
            self._first_seen = now
        if n > self.longest:
            self.longest = n
        self._gpu_s += gpu_s
        self._tokens += n
        if is_long:
            self._long_tokens += n

    def _expire(self, now: float) -> None:
        horizon = now - self.config.window_s
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= horizon:
            _, g, n, is_long, _ = arrivals.popleft()
            self._gpu_s -= g
            self._tokens -= n
            self._long_tokens -= n if is_long else 0
        if not arrivals:
            self._gpu_s, self._tokens, self._long_tokens = 0.0, 0, 0

    def load(self, now: float) -> float:
        """Smoothed demand over capacity (dimensionless; 1 = every GPU busy).

        Until a full window has passed since the first placement, the demand is averaged over
        the time elapsed (at least one second), not over the whole window.
        """
        self._expire(now)
        if self._first_seen is None:
            return 0.0
        span = min(self.config.window_s, max(now - self._first_seen, 1.0))
        return self._gpu_s / (span * max(self.num_gpus, 1))

    def backlog(self, scheduler, now: float) -> float:
        """Outstanding reserved work as a load: `sum_w C_w * Q_w / (window_s * num_gpus)`.

        Arrivals alone miss a queue that built up earlier (a burst, or the end of an overload):
        the pool must not merge, and may need to split, while that work is waiting.
        """
        work = sum([w.spec.cp_degree * w.outstanding_seconds(now)
                    for w in scheduler.workers.values()])
        return work / (self.config.window_s * max(self.num_gpus, 1))

    def long_share(self, now: float) -> float:
        """Token share of long requests among the window's arrivals."""
        self._expire(now)
        return self._long_tokens / self._tokens if self._tokens else 0.0

    # ------------------------------------------------------------------------- decisions
    def tick(self, scheduler, now: float) -> None:
        """Decides at most one split or merge (the scheduler's periodic hook)."""
        cfg = self.config
        load, share = max(self.load(now), self.backlog(scheduler, now)), self.long_share(now)
        self._high_since = (self._high_since if self._high_since is not None else now) \
            if load > cfg.upper else None
        self._low_since = (self._low_since if self._low_since is not None else now) \
            if load < cfg.lower else None
        self._calm_since = (self._calm_since if self._calm_since is not None else now) \
            if load < cfg.upper - cfg.merge_margin else None
        if self._ref_share is None or abs(load - self._ref_load) > cfg.stable_band:
            self._ref_share, self._ref_load = share, load
        if scheduler.reconfig.in_progress or now < self._quiet_until or not scheduler.workers:
            return
        reason = None
        if self._high_since is not None and now - self._high_since >= cfg.hold_s:
            op, reason = self._split(scheduler, now), "load above upper threshold"
        elif self._low_since is not None and now - self._low_since >= cfg.hold_s:
            op, reason = self._merge(scheduler, now), "load below lower threshold"
        elif share - self._ref_share > cfg.long_share_rise and load <= cfg.upper:
            op, reason = self._merge(scheduler, now), "long-request share rising"
        elif self._calm_since is not None and now - self._calm_since >= cfg.hold_s:
            op = self._merge(scheduler, now, max_loss=cfg.min_split_gain)
            reason = "merging costs no capacity at this load"
        else:
            return
        if op is None:
            return
        try:
            rec = scheduler.begin_reconfiguration(*op, now)
        except StrandedRequests:
            return  # waiting requests need the workers this would remove
        self._quiet_until = now + cfg.cooldown_s
        self._high_since = self._low_since = self._calm_since = None
        self._ref_share, self._ref_load = share, load
        self.decisions.append({"time": now, "kind": rec.kind, "reason": reason, "load": load,
                               "long_share": share, "old": list(rec.old_ids),
                               "new": [s.worker_id for s in rec.new_specs], "epoch": rec.epoch})

    def _cost(self, scheduler, workers, now) -> tuple[float, int]:
        drain = max(w.outstanding_seconds(now) for w in workers)
        traffic = sum(scheduler.prefix_index.num_blocks(w.worker_id) for w in workers)
        return drain, traffic

    def split_gain(self, scheduler, cp_degree: int, max_samples: int = 128) -> float:
        """Capacity gained by serving the window's requests at C/2 instead of C.

        `sum_i C * T(C, L_i, h_i) / sum_i (C/2) * T(C/2, L_i, h_i)` over (up to `max_samples`
        evenly spaced) arrivals of the window: > 1 when the smaller degree spends fewer
        GPU-seconds on this mix. Splitting only adds queues; it adds capacity only when this
        ratio is above 1 (short prompts, where fixed costs dominate). 1.0 with no arrivals.
        """
        arrivals = self._arrivals
        if not arrivals or cp_degree < 2:
            return 1.0
        key = (cp_degree, len(arrivals), arrivals[0][0], arrivals[-1][0])
        if key in self._gain_memo:  # same window, same answer (called per candidate per tick)
            return self._gain_memo[key]
        step = max(1, len(arrivals) // max_samples)
        predict, half = scheduler.cost_model.predict, cp_degree // 2
        big = small = 0.0
        for k in range(0, len(arrivals), step):
            _, _, n, _, h = arrivals[k]
            big += cp_degree * predict(cp_degree, n, h)
            small += half * predict(half, n, h)
        gain = big / small if small > 0 else 1.0
        if len(self._gain_memo) > 64:
            self._gain_memo.clear()
        self._gain_memo[key] = gain
        return gain

    def _split(self, scheduler, now):
        cands = [w for w in scheduler.workers.values()
                 if w.status is WorkerStatus.ACTIVE and w.cp_degree > self.config.min_degree]
        # The longest prompt seen that the largest allowed degree could hold.
        target = min(self.longest, self.max_input_len(self.config.max_degree))
        if self.max_input_len(self.config.min_degree) < target:
            holders = [w for w in scheduler.workers.values() if w.status is WorkerStatus.ACTIVE
                       and w.spec.max_input_len >= target]
            if len(holders) == 1 and self.max_input_len(holders[0].cp_degree // 2) < target:
                cands = [w for w in cands if w is not holders[0]]  # the last one stays whole
        cands = [w for w in cands if self.split_gain(scheduler, w.cp_degree) >= 1 + self.config.min_split_gain]
        if not cands:
            return None
        w = min(cands, key=lambda w: (self._cost(scheduler, [w], now), w.spec.first_device))
        new = split_halves(w.spec, scheduler.new_worker_ids(2), self.max_input_len)
        return "split", [w.worker_id], list(new)

    def _merge(self, scheduler, now, max_loss: float | None = None):
        top = min(self.config.max_degree,  # never above what one host holds
                  host_degree_cap(w.spec for w in scheduler.workers.values()))
        active = [w for w in scheduler.workers.values()
                  if w.status is WorkerStatus.ACTIVE and 2 * w.cp_degree <= top
                  and (max_loss is None
                       or self.split_gain(scheduler, 2 * w.cp_degree) <= 1 + max_loss)]
        pairs = [(a, b) for a, b in itertools.combinations(active, 2) if are_buddies(a.spec, b.spec)]
        if not pairs:
            return None
        a, b = min(pairs, key=lambda p: (self._cost(scheduler, p, now),
                                         min(p[0].spec.first_device, p[1].spec.first_device)))
        [new_id] = scheduler.new_worker_ids(1)
        return "merge", [a.worker_id, b.worker_id], [merge_buddies(a.spec, b.spec, new_id,
                                                                   self.max_input_len)]


def compositions(num_gpus: int, degrees: Sequence[int]) -> list[list[int]]:
    """Every multiset of the given degrees that uses exactly `num_gpus` devices.

    Raises:
      ValueError: no degree, or a degree that is not a power of two >= 1.
    """
    if not degrees or not all(map(is_power_of_two, degrees)):
        raise ValueError(f"degrees must be powers of two >= 1, got {list(degrees)}")
    ds = sorted(set(degrees), reverse=True)
    out: list[list[int]] = []

    def rec(i: int, left: int, acc: list[int]) -> None:
        if i == len(ds) - 1:
            if left % ds[i] == 0:
                out.append(acc + [ds[i]] * (left // ds[i]))
            return
        for n in range(left // ds[i], -1, -1):
            rec(i + 1, left - n * ds[i], acc + [ds[i]] * n)

    rec(0, num_gpus, [])
    return out


def initial_composition(num_gpus: int, degrees: Sequence[int], rate: float,
                        mean_prefill_seconds: Callable[[int], float], target_load: float,
                        min_largest_degree: int = 1, tolerance: float = 0.03) -> list[int]:
    """The starting composition from historical demand (paper section 6).

    A composition's capacity is `sum_w 1 / mean_prefill_seconds(C_w)` requests per second
    (each worker serves one prefill at a time). Among compositions whose capacity times
    `target_load` covers `rate`, pick the one with the most large-degree workers (compared
    largest degree first). When none has enough, compositions within `tolerance` of the most
    capacity count as having enough (capacity differences that small are inside the cost
    model's error, while a larger degree cuts every request's prefill time).

    Args:
      num_gpus: devices to fill.
      degrees: allowed CP degrees (powers of two).
      rate: historical request rate, req/s (> 0).
      mean_prefill_seconds: degree -> mean predicted prefill time of the historical mix (s).
      target_load: in (0, 1]: the utilisation the composition may run at.
      min_largest_degree: only compositions with a worker of at least this degree (one that
        can hold the longest prompts) are considered.
      tolerance: relative capacity difference treated as equal when overloaded.

    Raises:
      ValueError: no composition of `degrees` fills `num_gpus`, or a bad rate / target_load.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    if not 0 < target_load <= 1:
        raise ValueError(f"target_load must be in (0, 1], got {target_load}")
    options = [c for c in compositions(num_gpus, degrees) if max(c) >= min_largest_degree]
    if not options:
        raise ValueError(f"no composition of degrees {list(degrees)} fills num_gpus={num_gpus} "
                         f"with a worker of degree >= {min_largest_degree}")
    t = {c: mean_prefill_seconds(c) for c in set(degrees)}
    if not all(math.isfinite(v) and v > 0 for v in t.values()):
        raise ValueError(f"mean_prefill_seconds must be finite and > 0 per degree, got {t}")

    def capacity(comp):
        return sum(1.0 / t[c] for c in comp)

    best = max(capacity(c) for c in options)
    # Overloaded (no composition has enough): capacities within `tolerance` of the largest
    # count as equal, as they are within the cost model's error, and larger degrees win on TTFT.
    need = min(rate / target_load, best / (1 + tolerance))
    enough = [c for c in options if capacity(c) >= need]
    ds = sorted(set(degrees), reverse=True)
    return max(enough, key=lambda comp: tuple(comp.count(d) for d in ds))
