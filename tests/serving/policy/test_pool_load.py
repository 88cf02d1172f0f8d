"""serving.policy.pool_load: the controller's load signal, on hand-computed windows."""

from __future__ import annotations

import pytest

from serving.policy.pool_load import pool_backlog, pool_load
from serving.policy.whatif import Window


def window(arrivals, t4=0.5, t2=1.0):
    n = len(arrivals)
    seconds = {2: (t2,) * n, 4: (t4,) * n}
    return Window(tuple(arrivals), seconds, tuple(min(2 * t2, 4 * t4) for _ in arrivals))


def test_each_degree_counts_at_its_own_cost():
    # [4, 2, 2]: the CP-4 serves 1 / 0.5 = 2 requests a second, the two CP-2 2 / 1.0 = 2: 4 in
    # all, so each request keeps the pool busy 0.25 s. 120 arrivals 0.2 s apart (5 a second)
    # over 23.8 s: 120 * 0.25 / 23.8 = 1.26. Counted at the cheapest degree's GPU-seconds
    # (CP-2's 2.0 against CP-4's 2.0 here: use T4 = 0.6, 2.4 GPU-s) it would read
    # 120 * 2.0 / (23.8 * 8) = 1.26 only with equal costs, and less whenever CP-4 costs more.
    w = window([0.2 * i for i in range(120)])
    assert pool_load([4, 2, 2], w) == pytest.approx(120 * 0.25 / 23.8)
    w6 = window([0.2 * i for i in range(120)], t4=0.6)  # 1 / 0.6 + 2 = 3.67 a second
    assert pool_load([4, 2, 2], w6) == pytest.approx(120 / (1 / 0.6 + 2.0) / 23.8)
    assert pool_load([4, 2, 2], w6) > 120 * 2.0 / (23.8 * 8)  # the cheapest-degree count
    # one degree: the window's GPU-seconds over (span x GPUs), here 8 CP-2 GPUs
    assert pool_load([2, 2, 2, 2], w) == pytest.approx(120 * 2 * 1.0 / (23.8 * 8))


def test_requests_a_degree_cannot_hold_and_empty_windows():
    # CP-2 cannot hold any of them: only the CP-4 serves (2 a second): 0.5 s each
    w = Window((0.0, 1.0, 2.0), {2: (None,) * 3, 4: (0.5,) * 3}, (2.0,) * 3)
    assert pool_load([4, 2, 2], w) == pytest.approx(3 * 0.5 / 2.0)
    assert pool_load([2, 2], w) == 0.0  # nothing it can hold counts
    assert pool_load([4], Window((), {4: ()}, ())) == 0.0


def test_prompts_only_some_degrees_hold_are_charged_to_those_degrees():
    # [8, 2, 2, 2, 2], 16 GPUs; over 10 s, 3 long prompts only the CP-8 holds (T8 = 2.0 s) and
    # 20 short ones both hold (T8 = 0.2, T2 = 0.5: 1 / 0.2 + 4 / 0.5 = 13 a second, b = 1/13).
    # By hand, the largest set load: {8} alone, 3 * 2.0 / 10 = 0.6 (the CP-8 must serve the
    # long ones; the CP-2 workers, 25 % busy with every short one, have room for the rest);
    # both degrees: (3 * 2.0 * 8/16 + 20/13) / 10 = 0.454; {2} alone: nothing only it holds.
    # The single sum over every request, as if each kept the whole pool busy, read 0.754.
    def mixed(shorts):
        n = 3 + shorts
        long = {0, n // 2, n - 1}
        return Window(tuple(10.0 * i / (n - 1) for i in range(n)),
                      {2: tuple(None if i in long else 0.5 for i in range(n)),
                       8: tuple(2.0 if i in long else 0.2 for i in range(n))},
                      tuple(16.0 if i in long else 1.0 for i in range(n)))
    assert pool_load([8, 2, 2, 2, 2], mixed(20)) == pytest.approx(0.6)
    # 200 short ones: both degrees together bind, (3.0 + 200 / 13) / 10 = 1.84
    assert pool_load([8, 2, 2, 2, 2], mixed(200)) == pytest.approx((3.0 + 200 / 13) / 10)
    assert pool_load([8], mixed(20)) == pytest.approx((3 * 2.0 + 20 * 0.2) / 10)  # one degree


def test_the_backlog_is_the_active_workers_work_spread_over_their_gpus():
    # CP-4 with 2 s queued and a running prefill of 3 s started 1 s ago (2 s left); CP-2 with
    # 1 s queued; a draining CP-2 with 5 s (not counted): (4 * 4 + 2 * 1) / (4 + 2) = 3 s
    from serving.policy.request import Request
    from serving.policy.worker import WorkerState, WorkerStatus, layout_workers
    a, b, c = (WorkerState(s) for s in layout_workers([4, 2, 2], 8, 10_000))
    a.queued_seconds, b.queued_seconds, c.queued_seconds = 2.0, 1.0, 5.0
    a.running, a.running_start, a.running_estimate = Request("r", 0.0, 64, 1, (1,), 64), 9.0, 3.0
    c.status = WorkerStatus.DRAINING
    assert pool_backlog([a, b, c], 10.0) == pytest.approx(18 / 6)
    assert pool_backlog([a, b, c], 20.0) == pytest.approx((4 * 2 + 2 * 1) / 6)  # overran: 0 left
    assert pool_backlog([c], 10.0) == 0.0


def test_the_span_runs_to_now():
    # 120 arrivals over 23.8 s, evaluated 10 s after the last: 120 * 0.25 / 33.8 s; never
    # shorter than the arrivals' own span
    w = window([0.2 * i for i in range(120)])
    assert pool_load([4, 2, 2], w, elapsed=33.8) == pytest.approx(120 * 0.25 / 33.8)
    assert pool_load([4, 2, 2], w, elapsed=5.0) == pytest.approx(120 * 0.25 / 23.8)
