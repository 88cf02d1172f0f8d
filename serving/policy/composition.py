"""The default split/merge controller: change the composition only when a what-if replay says
the change pays, its transition included.

Every `interval_s` the controller takes the requests placed in the last `window_s` (at most
`max_samples`, the most recent; each with the prefix it was expected to find cached) and replays
them (`serving.policy.whatif`) through candidate compositions (sooner when the plan no longer
holds: once the pool's backlog, `serving.policy.pool_load.pool_backlog`, exceeds what it was at
the last evaluation by the mean TTFT that evaluation predicted for staying, and the window's
load (below) is above 1, the demand's backlog, an evaluation comes at once (in a cooldown only
of the overload rule, below; one that changes nothing keeps the schedule), so a burst after a
quiet phase is met within seconds, not at the next interval; a backlog the load does not
explain is a burst the pool absorbs, and the schedule is kept; until an evaluation predicts a
stay (not one refused or overloaded) there is no plan, and once the window holds `max_samples`
arrivals any backlog is beyond it):

- *stay*: the current workers, each starting with its outstanding work;
- *split* one worker of degree 2C (per degree, the one that drains first) into two of C;
- *merge* two buddy workers of degree C (per degree, the pair that drains first) into one 2C.

A candidate's changed workers start unavailable for their drain (the running prefill), the work
queued on the old workers (re-routed, spread over the new ones) and `recarve_s`, so the transition
is paid inside the prediction. When the window's work exceeds the pool's capacity by the margin
(its load, `serving.policy.pool_load`: each request's prefill at the degrees the pool has that hold
it, as a share of what those workers serve a second, over the window's span, the most any set of
degrees is asked for, above `1 + min_gain`; the paper's controller weighed every request at the
smallest degree, and so missed overload on large-degree workers), queues grow whatever a short
window shows: the change that lowers the load most is made if it cuts the excess `load - 1` (the
queues' growth) by a fifth of the margin (logged as `split [id] (load L)`, L the load after it) and
its predicted mean TTFT is no worse than staying's. The next evaluation comes when the change is
done (`Scheduler.reconfigured_hooks`, not the next tick; no `cooldown_s`: a step drains one worker
for about a second while an overloaded queue grows by the second), and the rule goes on while the
load plus the backlog to clear by the next regular evaluation (`pool_backlog / interval_s`, logged)
is above 1 (a step with the load at most 1 must lower it), its later steps not held to staying's
prediction (the window holds a step's drain, not the growth it stops; a pool at exactly its
capacity never clears what queued before). Each step is made with the splits that bring that
sum to 1 (the load alone where the backlog does not count), their drains overlapping
(`composition_changes.further_splits`, logged `and split ...`), halves of a worker split again
where that lowers the load most: each worker is re-carved once, into the parts its halvings
make (`CompositionConfig.deep_splits`; logged `made into [2, 2, 4]`): CP-8 to CP-1 in one
re-carve, not three. Within `reverse_after_s` of its last step the rule resumes once that sum
is above 1, not past the margin (a load still rising then; RESULTS item 25). Where the window's
requests found no cached prefix, a pool just above its capacity is not left with what queued:
once the load is above 1 the backlog to clear counts in the rule's start too, and a change the
full comparison (below) makes while the load is above 1, if it lowers it, goes on the same way
(no `cooldown_s` after it: in one, only the overload rule acts, and the pool sat just above its
capacity with seconds queued). With no cached prefix the replay, which gives each request its
cached prefix on any worker, is exact about what a split costs; where contexts are reused it is
not, and both rules lost there (eval/RESULTS.md).
(A window a little above 1 is as often a burst the pool absorbs: split for it, large-degree
workers lose the latency they were chosen for; measured on the comparison's Qwen3-32B cells.)
The replay has no prefix caches, so it cannot see what a split costs in cached context (a re-carved
cache, workers each keeping fewer whole contexts): when the pool's reused live working set (the
router's, `serving.policy.live_set`, `kv_pressure`) is at least its KV capacity, the caches and not
the compute bind the pool, and no split is made (on the agent sessions the splits made there cost
+69 % mean TTFT; eval/RESULTS.md). Otherwise the best candidate is made only when its predicted
mean TTFT is below stay's by at least `min_gain` (relative) and `min_gain_s` (absolute); one change
at a time, then `cooldown_s` (except after an overload's step, a refused prompt's merge or a
step back from a split, below), and no change undoes the previous one (a merge after a split,
or the reverse) within `reverse_after_s`, so noisy windows cannot make it flap (but for the
steps back from a split, below, and the overload rule's splits, which a merge does not hold
back: past the margin the queues grow whatever was merged, and a merge on a light window then
kept a pool overloaded for `reverse_after_s`, eval/RESULTS.md item 29). As a change stands
that long, it is made only if it also does not lose to staying on the arrivals of the last
`reverse_after_s`, replayed from idle workers:
a window of a passing burst predicts a gain the arrivals after it do not give. With no
candidate better by the margin, every composition is compared with the current one on equal terms
(`whatif.target_composition`); toward one better by the margin, a step gaining a fifth of it is
made. Where no single step gains that, the window found no cached prefix and the caches do not
bind, the splits that make the target are made at once, one change per worker split
(`composition_changes.target_splits`, logged `splits to the target: [0] into [2, 2, 2, 2], ...`),
if the replay, their drains and re-carves included (and the queue they take over re-timed at
the new degrees, `composition_changes.change_start`), predicts a fifth of the margin over
staying and, with the load at most 1, they do not lose on the horizon (a step at a time, none
of which gains alone, a pool just above its capacity waited for the overload rule while its
queue grew: eval/RESULTS.md item 26; a burst just above capacity is split for too). Within
`reverse_after_s` of a split, where the window found no cached prefix (elsewhere no merge is
made then, as before), a merge is made only as such a step toward the target, and it must not
lose to staying on every arrival of the last `reverse_after_s` (at most `SINCE_KEPT *
max_samples`, the most recent), not only the horizon rule's last `4 * max_samples`: the burst
the split was made for, and any since, are in them (when they are more than the window's). It
must leave the load plus the backlog to clear at most 1 (else the overload rule splits again at
once), and it ends the overload: that rule starts again past its margin. These steps back
follow one another (the next evaluation when each is done, no `cooldown_s`) and do not restart
the split's `reverse_after_s`, so a split may follow them: the capacity a burst was split for
is given back once the comparison finds the composition before it better, not
`reverse_after_s` later (a burst just above capacity then a light load, the splits standing
600 s: eval/RESULTS.md item 27). Every evaluation is logged in `decisions` (the most recent
`DECISIONS_KEPT`): the candidates compared and their predicted mean TTFT, whether a change was
made and why.

A change the backend could not make (`Scheduler.abandon_reconfiguration`) stops the evaluations
for `cooldown_s`, so a refusal is not asked for again at every tick.

A prompt no worker holds is refused and never reaches the window: when one is refused (one a
worker of `max_degree` would hold), the next evaluations first make the merge making the largest
worker, a step at a time with no `cooldown_s` between them, until a worker holds it (before the
margins and `reverse_after_s`).

This replaces the paper's threshold rules (`serving.policy.controller`, kept for `vertumnus-paper`:
arrivals weighed at the smallest degree, changes under overload). `choose_initial`
(`serving.policy.whatif`) picks the starting composition by the same replay, on historical demand.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable

from serving.policy.composition_config import CompositionConfig  # (its users import it here)
from serving.policy.composition_rules import CompositionRules
from serving.policy.pool_load import pool_backlog
from serving.policy.reconfiguration import StrandedRequests
from serving.policy.request import Request

# Evaluations `CompositionController.decisions` keeps, the most recent (at one per `interval_s`
# of 30 s, about a day; a simulated run of hours keeps all of its own).
DECISIONS_KEPT = 4096
# Arrivals of the last `reverse_after_s` kept to weigh a step back from a split on
# (`CompositionRules._best`), in windows of `max_samples`: a bound on that evaluation's cost
# (25,600 arrivals by default, the whole 600 s up to about 43 req/s; about 0.1 s of replay).
# Past it the step back is weighed on the most recent arrivals only, and a burst older than
# them is not seen (a shorter bound let periodic bursts be merged away between them).
SINCE_KEPT = 64


class CompositionController(CompositionRules):
    """Splits and merges when a what-if replay predicts a gain net of the transition.

    Args:
      config: `CompositionConfig`.
      max_input_len: `cp_degree -> tokens` for the workers it creates.
      longest: the longest prompt expected (tokens; e.g. from historical demand), so a worker
        able to hold it is kept before such a prompt is seen.

    Use: `controller.attach(scheduler)` registers its placement, refusal, tick, reconfigured hooks;
    `decisions` logs every evaluation as a dict: `time` (s), `samples`, `early`, `candidates`
    (`(label, figure)` pairs: stay first, then the changes with their predicted mean TTFT in
    seconds, then the figures the rules read: the load and the backlog to clear as shares of
    capacity, the reused live working set over KV capacity, the current composition's and the
    target's TTFT beyond the backlog in seconds, the horizon's replays), `chosen`, `reason`
    (ms) and, when a change was made, `kind`, `old`, `new`, `epoch` of its first change and the
    rest in `further` (an overload step's further splits, the splits to a target: one per
    worker); the `DECISIONS_KEPT` most recent are kept (a server evaluates for weeks). It
    plans with the workers the pool has (after `Scheduler.lose_workers`); a merge
    never spans hosts (`are_buddies`; degrees capped at `host_degree_cap`).
    """

    def __init__(self, config: CompositionConfig, max_input_len: Callable[[int], int],
                 longest: int = 0) -> None:
        self.config = config
        self.max_input_len = max_input_len
        self.decisions: list[dict] = []
        self._samples: deque = deque()  # (time, input_len, cached_len)
        self._scheduler = None
        # (time, input_len, cached_len) of the last arrivals, past the window (horizon rule)
        self._horizon: deque = deque(maxlen=4 * config.max_samples)
        # the arrivals of the last `reverse_after_s`, at most `SINCE_KEPT * max_samples` (a
        # step back from a split is weighed on them)
        self._since: deque = deque(maxlen=SINCE_KEPT * config.max_samples)
        self._vetoed: str | None = None  # the change `_loses_on_horizon` refused, if any
        self._undoing = False  # the change `_best` chose merges back within `reverse_after_s`
        self._next_eval = None
        self._quiet_until = 0.0
        self._last = (None, -float("inf"))  # (kind, time) of the last change made
        self.longest = longest  # seen or expected: a split leaves a worker able to hold it
        self._unheld: Request | None = None  # the longest prompt submitted no worker held
        # evaluate before `_next_eval` once the pool's backlog reaches this (s; module doc)
        self._replan_at: float | None = None
        self._plan_stay = 0.0  # > 0 once an evaluation predicted staying: a plan (see `tick`)
        # whether the last evaluation made an overload step; when the last one was made (s)
        self._chain, self._overload_at = False, float("-inf")
        self._made: set[int] = set()  # epochs of the changes the last one made
        self._backoff_until = -float("inf")  # no evaluation before (a change was refused)

    def attach(self, scheduler) -> None:
        self._scheduler = scheduler
        scheduler.placement_hooks.append(self.observe)
        scheduler.refused_hooks.append(self.refused)
        scheduler.tick_hooks.append(self.tick)
        scheduler.reconfigured_hooks.append(self.reconfigured)

    def reconfigured(self, scheduler, now: float) -> None:
        """A change is done: evaluates now if one is due (after an overload's step; module doc)."""
        if self._next_eval is not None and now >= max(self._next_eval, self._quiet_until):
            self.tick(scheduler, now)

    def observe(self, request: Request, cached_len: int, now: float) -> None:
        """Records a placed request (its expected cached prefix) for the next evaluation, once: a
        request placed again (`Scheduler.rerouting`: its worker drained for a change, or lost)
        is no new arrival. A time before the last one recorded is taken as that (sorted)."""
        if getattr(self._scheduler, "rerouting", False):
            return
        if self._horizon and now < self._horizon[-1][0]:
            now = self._horizon[-1][0]
        sample = (now, request.input_len, cached_len)
        self._samples.append(sample)
        self._horizon.append(sample)
        self._since.append(sample)
        while self._since and self._since[0][0] <= now - self.config.reverse_after_s:
            self._since.popleft()
        if request.input_len > self.longest:
            self.longest = request.input_len
        if len(self._samples) > 4 * self.config.max_samples:
            self._samples.popleft()

    def refused(self, request: Request, now: float) -> None:
        """Notes a prompt the scheduler refused as no worker holds it, if a worker of
        `max_degree` would (module doc)."""
        n, held = request.input_len, self._unheld
        if n > (held.input_len if held else 0) and n <= self.max_input_len(self.config.max_degree):
            self._unheld, self.longest = request, max(self.longest, n)

    def tick(self, scheduler, now: float) -> None:
        """Evaluates the candidates every `interval_s`, sooner when the backlog outgrows the
        plan (module doc), and makes at most one change (or one step made of several: an
        overload step with its further splits, the splits to a target)."""
        cfg = self.config
        if self._next_eval is None:
            self._next_eval = now + cfg.interval_s
        if scheduler.reconfig.in_progress:
            return
        if self._made & scheduler.reconfig.refused:  # the backend could not make it: back off
            self._made, self._chain, self._overload_at = set(), False, float("-inf")
            self._backoff_until = now + cfg.cooldown_s
        if now < self._backoff_until:
            return
        samples = self._samples
        while samples and samples[0][0] <= now - cfg.window_s:
            samples.popleft()
        early = now < self._next_eval or now < self._quiet_until  # (module doc)
        if self._replan_at is None and not self._plan_stay and len(samples) >= cfg.max_samples:
            self._replan_at = 0.0  # no plan yet: any backlog is beyond it (module doc)
        if early and (self._replan_at is None or pool_backlog(scheduler.workers.values(), now)
                      <= self._replan_at):
            return
        hold = self._hold_step(scheduler, now)
        if not samples and hold is None:
            self._next_eval = self._next_eval if early else now + cfg.interval_s
            return
        recent = list(samples)[-cfg.max_samples:]
        t0 = recent[0][0] if recent else now
        sample = [(t - t0, n, h) for t, n, h in recent]  # replayed from now on
        self._undoing = False  # (set by `_best` when its change undoes a split)
        # urgent (refused prompts, or an overload): evaluate again once the change is done
        op, figures, urgent = (*hold, True) if hold is not None else self._best(
            scheduler, now, sample, early, now - t0)
        self._chain = bool(urgent and op is not None and hold is None)
        if figures is None:  # early, and the load calls for no evaluation: keep the schedule
            self._replan_at = pool_backlog(scheduler.workers.values(), now) + self._plan_stay
            return
        kept, self._next_eval, self._replan_at = self._next_eval, now + cfg.interval_s, None
        if early and op is None:  # (an early evaluation that changes nothing keeps it)
            self._next_eval = kept
        entry = {"time": now, "samples": len(sample), "candidates": figures,
                 "chosen": figures[0][0] if op is None else figures[1][0], "early": early}
        if op is not None:
            recs, refused = [], None
            for one in op:  # (an overload's step, then its further splits)
                try:
                    recs.append(scheduler.begin_reconfiguration(*one, now))
                except StrandedRequests as e:  # waiting requests need the workers it would remove
                    refused = e
                    break
            if not recs:
                self._chain = False
                self._next_eval = kept if early else self._next_eval  # (no change: kept)
                entry["reason"] = f"not made: {refused}"
                self._log(entry)
                return
            rec, self._made = recs[0], {r.epoch for r in recs}
            self._overload_at = now if self._chain else self._overload_at  # (made, not refused)
            if self._undoing:  # a step back ends the overload: its rule starts past the margin
                self._overload_at = float("-inf")
            # (the steps back from a split within `reverse_after_s` follow one another too)
            self._quiet_until = now if urgent or self._undoing else now + cfg.cooldown_s
            if urgent or self._undoing:
                self._next_eval = now
            if not self._undoing:  # (a split undone keeps its `reverse_after_s`: module doc)
                self._last = (rec.kind, now)
            entry.update(kind=rec.kind, old=list(rec.old_ids),
                         new=[s.worker_id for s in rec.new_specs], epoch=rec.epoch,
                         further=[{"old": list(r.old_ids), "epoch": r.epoch, "new": [
                             s.worker_id for s in r.new_specs]} for r in recs[1:]],
                         reason="no worker holds a prompt refused" if hold
                         else f"predicted mean TTFT {figures[1][1] * 1e3:.1f} ms against "
                              f"{figures[0][1] * 1e3:.1f} ms staying" + (
                                  "; overloaded: next evaluation when done" if urgent else "")
                         + (f"; {len(op) - len(recs)} of its further splits not made: "
                            f"{refused}" if refused is not None else ""))
        elif self._vetoed is not None:
            entry["reason"] = self._vetoed
        else:
            plan = "backlog beyond the plan" if self._plan_stay else "a backlog, no plan yet"
            entry["reason"] = f"early ({plan}): no change pays" if early else \
                "no candidate beats staying by the margin"
        stay = figures[0][1]
        if not urgent and stay > 0 and stay < float("inf"):  # (not NaN)
            self._plan_stay = stay
            self._replan_at = pool_backlog(scheduler.workers.values(), now) + stay
        self._log(entry)

    def log(self, limit: int = DECISIONS_KEPT, changes_only: bool = False) -> list[dict]:
        """The latest `limit` evaluations of `decisions` (with `changes_only`, of those that
        made a change), oldest first, as strict JSON (`GET /v1/controller`,
        `eval.load_shift`): each a deep copy, its `candidates` `[label, figure]` lists with a
        figure that is NaN or infinite as None (a refused prompt's merge, a composition that
        holds no request).

        Raises:
          ValueError: `limit` not an integer in [0, DECISIONS_KEPT].
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or \
                not 0 <= limit <= DECISIONS_KEPT:
            raise ValueError(f"limit must be an integer in [0, {DECISIONS_KEPT}], got {limit!r}")
        kept = [d for d in self.decisions if d.get("kind") or not changes_only]
        return [{**copy.deepcopy(d), "candidates": [[label, v if math.isfinite(v) else None]
                                     for label, v in d["candidates"]]}
                for d in kept[max(0, len(kept) - limit):]]

    def _log(self, entry: dict) -> None:
        """Appends `entry` to `decisions`, keeping the `DECISIONS_KEPT` most recent."""
        self.decisions.append(entry)
        if len(self.decisions) > DECISIONS_KEPT:
            del self.decisions[:len(self.decisions) - DECISIONS_KEPT]
