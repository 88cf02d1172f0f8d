"""The horizon the default split/merge controller weighs a change on (`serving.policy.composition`):
the arrivals of the last `reverse_after_s`, the time a change stands, replayed from idle workers.

A change the window picks must not lose to staying there: a passing burst's window predicts a
gain later arrivals do not give.

Plain Python over `serving.policy.whatif`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from serving.policy.composition_config import CompositionConfig
from serving.policy.whatif import Window, replay_ttft


@dataclasses.dataclass(frozen=True)
class HorizonReplay:
    """One replay of the horizon under staying and under a change.

    Attributes:
      arrivals: how many arrivals the horizon holds (> the window's).
      span_s: seconds from its first arrival to now.
      stay, change: predicted mean TTFT (s) over the arrivals each holds, staying and changed.
      unheld, unheld_after: arrivals no worker holds, staying and changed.
    """

    arrivals: int
    span_s: float
    stay: float
    change: float
    unheld: int
    unheld_after: int

    @property
    def span(self) -> str:
        """"the last N arrivals (S s)", as logged."""
        return f"the last {self.arrivals} arrivals ({self.span_s:.0f} s)"

    def loses(self) -> bool:
        """Whether the change loses to staying: holding fewer arrivals loses, then a higher mean
        TTFT over them (a tie does not)."""
        if self.unheld_after != self.unheld:
            return self.unheld_after > self.unheld
        return self.change > self.stay


def replay_horizon(horizon: Iterable[tuple[float, int, int]], current: Sequence[int],
                   changed: Sequence[int], now: float, window_len: int,
                   config: CompositionConfig, predict: Callable[[int, int, int], float],
                   max_input_len: Callable[[int], int]) -> HorizonReplay | None:
    """Replays the arrivals of `horizon` (`(time s, input tokens, cached tokens)`, sorted) after
    `now - config.reverse_after_s` from idle workers of the CP degrees `current` and `changed`;
    None when they are no more than the window's `window_len` (nothing more to weigh).
    `predict(degree, input_len, cached_len)` is the cost model's prefill time (s)."""
    recent = [(t, n, h) for t, n, h in horizon if t > now - config.reverse_after_s]
    if len(recent) <= window_len:
        return None
    t0 = recent[0][0]
    window = Window.of([(t - t0, n, h) for t, n, h in recent],
                       sorted(set(current) | set(changed)), predict, max_input_len)
    stay, unheld = replay_ttft(list(current), window, config.lam)
    change, unheld_after = replay_ttft(list(changed), window, config.lam)
    return HorizonReplay(len(recent), now - t0, stay, change, unheld, unheld_after)
