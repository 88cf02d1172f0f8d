"""The rules of the default split/merge controller (`serving.policy.composition`, whose module
docstring states them): which change, if any, an evaluation makes. `CompositionRules` is the
controller's base class; it reads the controller's state (`config`, `max_input_len`,
`longest`, the window's samples and the horizon, the last change) and sets `_vetoed`.

Plain Python over the pool's `WorkerState`s and `serving.policy.whatif`.
"""

from __future__ import annotations

from serving.policy.composition_changes import (candidate_changes, change_degrees, change_op,
                                                change_start, further_splits, hold_merge,
                                                target_of, target_splits)
from serving.policy.composition_horizon import replay_horizon
from serving.policy.pool_load import kv_pressure, pool_backlog, pool_load
from serving.policy.whatif import Sample, Window, moves_toward, replay_ttft
from serving.policy.worker import WorkerStatus


class CompositionRules:
    """The evaluation of `serving.policy.composition.CompositionController` (its base class):
    the refused prompt's merge, the overload rule, the comparison of single changes and the
    comparison with every composition (the step toward the target, or the splits to it)."""

    # ------------------------------------------------------------------------- candidates
    def _hold_step(self, scheduler, now: float):
        """`([op], figures)` of the merge making the largest worker while no worker holds the
        longest prompt refused (module doc), else None (also when no merge is possible)."""
        r, workers = self._unheld, scheduler.workers.values()
        if r is None or any(w.status is not WorkerStatus.ACTIVE for w in workers):
            return None
        if any(w.can_hold(r) for w in workers):
            self._unheld = None
            return None
        step = hold_merge(scheduler, now, self.config, self.longest, self.max_input_len)
        if step is None:
            return None
        label = f"merge {step[1]} (to hold {r.input_len} tokens)"
        return [step[0]], [("stay", float("nan")), (label, float("nan"))]

    def _best(self, scheduler, now: float, sample: list[Sample], early: bool = False,
              elapsed: float | None = None):
        """`(ops or None, [(label, predicted mean TTFT s), ...], overloaded)`: stay first, then
        the best; `ops` the `Scheduler.begin_reconfiguration` arguments of the change (for the
        overload rule's, the step then its further splits; for the splits to a target, one per
        worker split); `overloaded` when the next
        evaluation comes once it is done (the overload rule's step, or a full comparison's that
        goes on as one; module doc). `early`: `(None, None, False)` for a load the module doc
        keeps the schedule for. `elapsed`: seconds from the sample's first arrival to now. Sets
        `_undoing` when the change is a merge within `reverse_after_s` of a split (a step back
        toward the target; module doc)."""
        cfg = self.config
        self._vetoed, self._undoing = None, False
        active = [w for w in scheduler.workers.values() if w.status is WorkerStatus.ACTIVE]
        if not active or len(active) != len(scheduler.workers):
            return None, [("stay", float("nan"))], False
        degrees = change_degrees(scheduler, active, cfg)
        window = Window.of(sample, degrees, scheduler.cost_model.predict, self.max_input_len)
        load = pool_load([w.cp_degree for w in active], window, elapsed)
        # the overload rule starts past the margin, goes on (resumes, within `reverse_after_s`)
        # while load + clear > 1; no cached prefix in the window: clear counts once load > 1
        cached = any(h for _, _, h in sample)
        resumed = self._chain or now - self._overload_at < cfg.reverse_after_s
        clear = pool_backlog(active, now) / cfg.interval_s if resumed or (
            load > 1.0 and not cached) else 0.0
        over = 1.0 if resumed else 1.0 + cfg.min_gain
        excess = load + clear
        quiet = early and now < self._quiet_until  # (in a cooldown only the overload rule acts)
        if early and (excess <= 1.0 or (excess <= over and quiet)):  # (module doc)
            return None, None, False
        free = {w.worker_id: w.outstanding_seconds(now) for w in active}
        stay, _ = replay_ttft([w.cp_degree for w in active], window, cfg.lam,
                              [free[w.worker_id] for w in active])
        options, back = [], []  # (back: splits undoing a merge, for the overload rule only)
        last_kind, last_time = self._last
        kv_bound = kv_pressure(scheduler, active, now)
        for olds, news in candidate_changes(active, now, set(degrees), cfg, self.longest,
                                            self.max_input_len):
            kind = "split" if len(news) > len(olds) else "merge"
            undoes = last_kind not in (None, kind) and now - last_time < cfg.reverse_after_s
            if undoes and kind == "merge" and cached:
                continue  # no undoing a split that soon with cached prefixes
            if kind == "split" and kv_bound is not None and kv_bound >= 1.0:
                continue  # the caches bind, not the compute: a split costs context (module doc)
            start = change_start(olds, news, now, cfg)
            kept = [w for w in active if w not in olds]
            comp = [w.cp_degree for w in kept] + list(news)
            ttft, unheld = replay_ttft(comp, window, cfg.lam,
                                       [free[w.worker_id] for w in kept] + [start] * len(news))
            if unheld:
                continue
            label = f"{kind} {[w.worker_id for w in olds]}"
            # a split undoing a merge within `reverse_after_s`: the overload rule's only
            (back if undoes and kind == "split" else options).append(
                (ttft, label, olds, news, pool_load(comp, window, elapsed), undoes))
        figures = [("stay", stay)] + [(label, t) for t, label, *_ in sorted(
            options + back, key=lambda o: o[0])]
        if kv_bound is not None:
            figures.append(("reused live working set / KV capacity", kv_bound))
        figures.append(("load (work / capacity) staying", load))
        if clear:
            figures.append(("backlog to clear by the next evaluation / capacity", clear))
        if not options and not (back and excess > over):  # (`back`: the overload rule's)
            return None, figures, False
        # a merge undoing a split within `reverse_after_s` is only a step toward the target
        free_options = [o for o in options if not o[5]]
        if excess > over and free_options + back:  # overloaded: queues grow; add capacity
            best = min(free_options + back, key=lambda o: o[4])  # (a merge made or not)
            # cut the excess `load - 1` (the queues' growth) by a fifth of the margin, or (only
            # the backlog left) lower the load; a first step no worse than staying (module doc)
            if best[4] < min(load, load - (load - 1.0) * cfg.min_gain / 5) and (
                    self._chain or best[0] <= stay):
                ops = []
                for k, (olds, parts, after) in enumerate(further_splits(  # (module doc)
                        active, best[2], best[3], best[4], window, elapsed, now, set(degrees),
                        cfg, self.longest, self.max_input_len, clear)):
                    ops.append(change_op(scheduler, olds, self.max_input_len, parts))
                    into = f" into {parts}" if len(parts) > 2 else ""
                    if k == 0:  # the step as judged, then the parts it is made into
                        label = f"{best[1]} (load {best[4]:.2f})" + (
                            f", made{into} (load {after:.2f})" if into else "")
                    else:
                        label = f"and split {[w.worker_id for w in olds]}{into} (load {after:.2f})"
                    figures.insert(1 + k, (label, float("nan") if k else best[0]))
                return ops, figures, True
        if quiet:
            return None, figures, False
        ttft, label, olds, news, after, _ = min(free_options, key=lambda o: o[0], default=(
            stay, None, None, None, load, False))
        if not (ttft < stay * (1 - cfg.min_gain) and stay - ttft >= cfg.min_gain_s):
            # One step may gain little where several do (overload on large workers): compare
            # every composition with the current one on equal terms (each worker starting with
            # the pool's backlog B spread over the GPUs; TTFT beyond B, as B is paid either
            # way) and, when the best is better by the margin, take a step toward it that
            # itself gains a fifth of the margin or, where none does, the splits to it at once.
            target, target_ttft, now_ttft, backlog = target_of(active, window, now, cfg,
                                                               self.longest, self.max_input_len)
            figures += [("current, beyond the backlog", now_ttft - backlog),
                        (f"target {list(target)}, beyond the backlog", target_ttft - backlog)]
            # the step itself must gain too (a fifth of the margin): each one drains workers
            # (a step back from a split leaves the load plus the backlog to clear at most 1:
            # else the overload rule splits again at once)
            toward = [o for o in options if o[0] <= stay * (1 - cfg.min_gain / 5)
                      and (not o[5] or o[4] + clear <= 1.0) and moves_toward(
                          [w.cp_degree for w in active], [w.cp_degree for w in o[2]], o[3], target)]
            gain = now_ttft - target_ttft
            if not (gain > (now_ttft - backlog) * cfg.min_gain and gain >= cfg.min_gain_s):
                return None, figures, False
            if not toward:  # the splits to it at once (module doc)
                if cached or (kv_bound is not None and kv_bound >= 1.0):
                    return None, figures, False
                return self._jump(scheduler, active, target, now, stay, free, window, figures,
                                  excess, load, elapsed, len(sample))
            ttft, label, olds, news, after, self._undoing = min(toward, key=lambda o: o[0])
            figures.remove((label, ttft))  # (listed once, as the step toward the target)
            figures.insert(1, (label + " (toward the target)", ttft))
        else:  # (the change made is logged second, after stay)
            figures.remove((label, ttft))
            figures.insert(1, (label, ttft))
        horizon = self._loses_on_horizon(  # (a step back: on all of the last reverse_after_s)
            scheduler, active, olds, news, now, len(sample), figures,
            self._since if self._undoing else self._horizon)
        if horizon is not None:
            self._vetoed = (f"{label} beats staying by the margin on the window but not on "
                            f"{horizon}")
            return None, figures, False
        # made while the load (in a chain: + clear) is above 1, a step lowering it goes on as
        # the overload rule's where the window found no cached prefix (module doc)
        return [change_op(scheduler, olds, self.max_input_len)], figures, (
            excess > 1.0 and after < load and not cached)

    def _jump(self, scheduler, active, target, now, stay, free, window, figures, excess, load,
              elapsed, window_len):
        """`_best`'s answer when no single step toward `target` gains: the splits that make it,
        at once (`target_splits`), if predicted to gain a fifth of the margin over staying and,
        with the load at most 1, not to lose on the horizon (module doc); never within
        `reverse_after_s` of a merge (a step back from a split is none: `_last` stays the
        split), into more than halves without `config.deep_splits`, or
        leaving no worker able to hold `longest`. `(ops, figures, overloaded)` as `_best` (`ops`
        None, or one split per worker changed). `free`: worker id -> seconds of outstanding
        work; `window_len`: the window's arrivals."""
        cfg, (last_kind, last_time) = self.config, self._last
        made = None if last_kind == "merge" and now - last_time < cfg.reverse_after_s else \
            target_splits(active, target, now, cfg, free, window)
        if made is None:
            return None, figures, False
        plan, degrees, starts = made
        olds, parts = [w for w, _ in plan], [c for _, ps in plan for c in ps]
        holds = any(w.spec.max_input_len >= self.longest for w in active if w not in olds) or \
            any(self.max_input_len(c) >= self.longest for c in parts)
        if not holds or (not cfg.deep_splits and any(len(ps) > 2 for _, ps in plan)):
            return None, figures, False  # a worker able to hold `longest` is kept; halves only
        ttft, unheld = replay_ttft(degrees, window, cfg.lam, starts)
        label = "splits to the target: " + ", ".join(f"{[w.worker_id]} into {p}" for w, p in plan)
        figures.insert(1, (label, ttft))
        if unheld or ttft > stay * (1 - cfg.min_gain / 5):
            return None, figures, False
        if load <= 1.0:
            span = self._loses_on_horizon(scheduler, active, olds, parts, now, window_len,
                                          figures)
            if span is not None:
                self._vetoed = f"{label} beats staying on the window but not on {span}"
                return None, figures, False
        ops = [change_op(scheduler, [w], self.max_input_len, ps) for w, ps in plan]
        return ops, figures, excess > 1.0 and pool_load(degrees, window, elapsed) < load

    def _loses_on_horizon(self, scheduler, active, olds, news, now: float, window_len: int,
                          figures: list, arrivals=None) -> str | None:
        """None if the change (`olds` replaced by workers of degrees `news`) does not lose to
        staying on the arrivals of the last `reverse_after_s` (at most the `4 * max_samples`
        most recent) replayed from idle workers (`composition_horizon`; `HorizonReplay.loses`),
        else those arrivals ("the last N arrivals (S s)"). A change stands that long, and a
        passing burst's window predicts a gain later arrivals do not give (a CP-8 split for a
        burst of long documents; eval/RESULTS.md). None when the horizon holds no more
        arrivals than the window. Not for the overload rule (its queues grow regardless).
        `arrivals`: `(time s, input tokens, cached tokens)`, sorted, to weigh on instead of the
        horizon (a step back from a split: every arrival of the last `reverse_after_s` kept)."""
        current = [w.cp_degree for w in active]
        h = replay_horizon(self._horizon if arrivals is None else arrivals, current,
                           [w.cp_degree for w in active if w not in olds] + list(news), now,
                           window_len, self.config, scheduler.cost_model.predict,
                           self.max_input_len)
        if h is None:
            return None
        figures += [(f"stay, {h.span} from idle workers", h.stay),
                    ("the change, the same arrivals", h.change)]  # (both logged)
        return h.span if h.loses() else None
