"""The what-if queueing replay on hand-computed cases."""

from __future__ import annotations

import pytest

from serving.policy.whatif import Window, best_composition, replay_ttft


def linear(c, n, h):
    """T = (L - h) * 1 ms / C + 10 ms: GPU-seconds C * T grow with C (fixed cost per rank)."""
    return (n - h) * 1e-3 / c + 0.01


def test_replay_hand_computed_fifo_and_degree_choice():
    # Two requests of 1000 tokens at t = 0 and 0.1 s. On one CP-1 worker: r0 runs [0, 1.01],
    # r1 waits 0.91 s then runs 1.01 s: mean TTFT (1.01 + 1.92) / 2 = 1.465 s.
    sample = [(0.0, 1000, 0), (0.1, 1000, 0)]
    w = Window.of(sample, [1, 2], linear)
    assert w.seconds[1] == (1.01, 1.01) and w.seconds[2] == (0.51, 0.51)
    assert w.cheapest == (1.01, 1.01)  # 1 x 1.01 < 2 x 0.51
    assert replay_ttft([1], w) == (pytest.approx(1.465), 0)
    # Two CP-1 workers: no wait. One CP-2: r0 0.51, r1 waits 0.41: (0.51 + 0.92) / 2.
    assert replay_ttft([1, 1], w) == (pytest.approx(1.01), 0)
    assert replay_ttft([2], w) == (pytest.approx(0.715), 0)
    # [2, 1] with lam = 1: r0 costs 0.51 + (1.02 - 1.01) on CP-2 < 1.01 on CP-1 -> CP-2; r1:
    # CP-2 busy 0.41 -> 0.41 + 0.51 + 0.01 = 0.93 < 1.01 -> CP-2 again, TTFT 0.92.
    assert replay_ttft([2, 1], w) == (pytest.approx((0.51 + 0.92) / 2), 0)
    # The CP-2 worker busy until 0.5 s: r0 goes to CP-1 (1.01 < 0.5 + 0.51 + 0.01), r1 to CP-2.
    assert replay_ttft([2, 1], w, free_at=[0.5, 0.0]) == (pytest.approx((1.01 + 0.91) / 2), 0)


def test_unheld_requests_and_best_composition():
    sample = [(0.0, 5000, 0), (1.0, 100, 0)]
    w = Window.of(sample, [1, 2], linear, max_input_len=lambda c: 1000 * c)
    assert w.seconds[1][0] is None and w.seconds[2][0] is None  # 5000 > 2000
    assert replay_ttft([1, 1], w) == (pytest.approx(0.11), 1)
    comp, scores = best_composition([[2], [1, 1]], Window.of([(0.0, 1000, 0), (0.0, 1000, 0)],
                                                             [1, 2], linear))
    # [2]: 0.51 and 1.02 -> 0.765; [1, 1]: 1.01 each -> [2] wins.
    assert comp == [2] and scores == {(2,): pytest.approx(0.765), (1, 1): pytest.approx(1.01)}
    with pytest.raises(ValueError, match="sorted"):
        Window.of([(1.0, 10, 0), (0.0, 10, 0)], [1], linear)
    with pytest.raises(ValueError, match="no predictions for degrees"):
        replay_ttft([4], w)
