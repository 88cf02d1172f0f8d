"""What a soak run (`eval.live.soak`) does and sends: `SoakConfig` (the flags of
`python -m eval.soak`), `PromptSet` (its prompts), and `rss_mib` (a process's resident memory)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from serving.policy.checks import is_power_of_two


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """What a soak run does (the flags of `python -m eval.soak`).

    Attributes:
      url: the server's base URL.
      admin_api_key: bearer key of the admin endpoints (split / merge).
      api_key: bearer key of every endpoint (None: the server wants none).
      operations: splits and merges to finish, >= 1.
      interval_s: seconds from the start of one operation to the start of the next (the next
        starts at once when an operation takes longer).
      concurrency: requests in flight at once (closed-loop senders), >= 1.
      rate: cap on the requests sent per second, all senders together (0 = no cap).
      repeated_prompts: fixed prompts sent again and again (first-token check), >= 1.
      repeat_fraction: share of the requests that send a repeated prompt, in [0, 1].
      prompt_lengths: `(min, max)` prompt lengths in tokens: each prompt's length is drawn
        uniformly from `[min, max]` (so two requests whose answers were swapped differ in
        `usage.prompt_tokens` with probability `1 - 1/(max - min + 1)`); the server pads
        uncached tokens to powers of two from 16, so the default 12..40 compiles 3 lengths.
      degrees: CP degrees a split or merge may create (the server's `--degrees`).
      walk: how operations follow each other (`eval.live.soak_ops.next_kind`): "sweep"
        (split down to the smallest degree, merge up to the largest, again), "alternate" or
        "random".
      max_duration_s: no operation is started after this many seconds of run.
      request_timeout_s: a completion not answered within this many seconds is lost.
      reconfig_timeout_s: a split or merge not finished within this many seconds is stuck
        (the run stops).
      rss_interval_s: seconds between RSS samples of the server process.
      progress_interval_s: seconds between progress lines (0 = none).
      max_refused_fraction: largest share of the requests sent that may be refused (429, 503)
        without failing the run, in [0, 1]. With `concurrency` below the server's
        `--max_in_flight` and no shutdown, no refusal is expected: the default 0.001 tolerates
        one in a thousand.
      disconnect_fraction: share of the requests that are abandoned (`eval.live.soak_server.
        abandon`): sent, then their connection closed `disconnect_after_s` seconds after the
        server began reading them, in [0, 1].
      disconnect_after_s: seconds from the server's `100 Continue` to the close, >= 0.
      seed: seed of the prompts and of the choice of operations.
      server_pid: process whose RSS is sampled (None: not sampled).
    """

    url: str
    admin_api_key: str
    api_key: str | None = None
    operations: int = 1000
    interval_s: float = 1.5
    concurrency: int = 8
    rate: float = 0.0
    repeated_prompts: int = 8
    repeat_fraction: float = 0.5
    prompt_lengths: tuple[int, int] = (12, 40)
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    walk: str = "sweep"
    max_duration_s: float = 3600.0
    request_timeout_s: float = 300.0
    reconfig_timeout_s: float = 300.0
    rss_interval_s: float = 5.0
    progress_interval_s: float = 30.0
    max_refused_fraction: float = 0.001
    disconnect_fraction: float = 0.02
    disconnect_after_s: float = 0.005
    seed: int = 0
    server_pid: int | None = None

    def __post_init__(self) -> None:
        for name in ("operations", "concurrency", "repeated_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.walk not in ("sweep", "alternate", "random"):  # soak_ops.WALKS
            raise ValueError(f"walk must be sweep, alternate or random, got {self.walk!r}")
        for name in ("repeat_fraction", "max_refused_fraction", "disconnect_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.degrees or any(not is_power_of_two(c) or c > 64 for c in self.degrees):
            raise ValueError(f"degrees must be powers of two in [1, 64], at least one, got "
                             f"{self.degrees}")
        lengths = self.prompt_lengths
        if len(lengths) != 2 or not 1 <= lengths[0] <= lengths[1]:
            raise ValueError(f"prompt_lengths must be (min, max) with 1 <= min <= max tokens, "
                             f"got {lengths}")
        for name in ("interval_s", "rate", "max_duration_s", "request_timeout_s",
                     "reconfig_timeout_s", "rss_interval_s", "progress_interval_s",
                     "disconnect_after_s"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v}")
        if min(self.request_timeout_s, self.reconfig_timeout_s, self.rss_interval_s) <= 0:
            raise ValueError("request_timeout_s, reconfig_timeout_s and rss_interval_s must "
                             "be > 0 seconds")


class PromptSet:
    """The prompts of a run: `repeated` fixed prompts and, for the other requests, unique
    random ones; which requests are abandoned; all deterministic in `seed` and the request
    number.

    Args:
      vocab_size: token ids are drawn from `[0, vocab_size)`.
      lengths: `(min, max)` prompt lengths (tokens); every prompt's length, repeated or unique,
        is drawn uniformly from `[min, max]`.
      repeated: number of repeated prompts, >= 1.
      repeat_fraction: probability that a request sends a repeated prompt.
      seed: the seed.
      disconnect_fraction: probability that a request is abandoned (`abandons`).
    """

    def __init__(self, vocab_size: int, lengths: Sequence[int], repeated: int,
                 repeat_fraction: float, seed: int, disconnect_fraction: float = 0.0) -> None:
        self.vocab_size, self.lengths = vocab_size, (int(min(lengths)), int(max(lengths)))
        self.repeat_fraction, self.seed = repeat_fraction, seed
        self.disconnect_fraction = disconnect_fraction
        rng = np.random.default_rng([seed, 0])
        self.repeated = [self._tokens(rng) for _ in range(repeated)]

    def _tokens(self, rng: np.random.Generator) -> list[int]:
        length = int(rng.integers(self.lengths[0], self.lengths[1] + 1))
        return [int(t) for t in rng.integers(0, self.vocab_size, length)]

    def pick(self, n: int) -> tuple[int | None, list[int]]:
        """Request number `n`'s prompt: `(repeated prompt number, tokens)`, or `(None, tokens)`
        for a unique prompt."""
        rng = np.random.default_rng([self.seed, 1, n])
        if rng.random() < self.repeat_fraction:
            i = int(rng.integers(len(self.repeated)))
            return i, self.repeated[i]
        return None, self._tokens(rng)

    def abandons(self, n: int) -> bool:
        """Whether request number `n` is abandoned (sent, then its connection closed)."""
        return bool(np.random.default_rng([self.seed, 2, n]).random() < self.disconnect_fraction)


def rss_mib(pid: int | None) -> float | None:
    """Resident set size of process `pid` in MiB (`VmRSS` of `/proc/<pid>/status`); None when
    `pid` is None or the process (or /proc) is not there."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
