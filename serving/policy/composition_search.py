"""Searching a large pool's compositions for the one of least predicted mean TTFT.

The composition controller's comparison "on equal terms" (`serving.policy.whatif.
target_composition`) replays its window through every composition of the pool's GPUs. Their
number grows as the GPUs to the power of (degrees - 1): 969 for 64 GPUs of degrees {1, 2, 4, 8},
6,545 for 128 (2.5 s of replays per evaluation on this project's 2-core VM), 366,145 for 512
(minutes). Above `EXHAUSTIVE_LIMIT` compositions the target is searched instead, in two
stages over the workers' counts per degree: a pattern search (the exploratory moves of Hooke
and Jeeves, "Direct search solution of numerical and statistical problems", J. ACM 8(2), 1961,
on the integer lattice, without their extrapolating step): from the current composition and
each homogeneous one, move `m` workers at a time (split `m` workers of a degree into workers of
a smaller one, or merge the reverse) while some move lowers the predicted mean TTFT, then halve
`m`, down to one worker; then a polish: every composition whose count of each degree but the
smallest is within `POLISH_RADIUS` of the best found is replayed, again from each better one
(the optimum is often a pair-move away uphill, e.g. one CP-8 re-tiled as [4, 2, 1, 1]). Tens to
a few hundred replays on the windows measured (eval/RESULTS.md, "The controller's comparison
on large pools"), not a bound; the result is the best found, not proven the best. Plain Python.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

# Pools with at most this many compositions are listed (every committed evaluation: at most 21,
# 80 GPUs of {2, 4}); above it, `pattern_search`.
EXHAUSTIVE_LIMIT = 1024
# The polish's reach: each degree's count but the smallest's within this of the best found.
POLISH_RADIUS = 3


def _check_degrees(degrees: Sequence[int], name: str = "degrees") -> None:
    if not degrees or any(d < 1 or d & (d - 1) for d in degrees):
        raise ValueError(f"{name} must be powers of two >= 1, got {list(degrees)}")


def count_compositions(num_gpus: int, degrees: Sequence[int]) -> int:
    """How many multisets of `degrees` use exactly `num_gpus` devices (the number of
    `serving.policy.controller.compositions`, counted without listing them: the coin-change
    recurrence). Raises ValueError for a negative `num_gpus` or a degree that is not a power of
    two >= 1 (as `compositions`)."""
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    _check_degrees(degrees)
    ways = [1] + [0] * num_gpus
    for d in sorted(set(degrees)):
        for g in range(d, num_gpus + 1):
            ways[g] += ways[g - d]
    return ways[num_gpus]


def pattern_search(current: Sequence[int], degrees: Sequence[int], need: int,
                   ttft: Callable[[list[int]], float]) -> tuple[float, tuple[int, ...]]:
    """The composition of least `ttft` found by a pattern search over counts per degree
    (module doc), from `current` and each homogeneous composition of its GPUs.

    Args:
      current: the pool's CP degrees, one per worker (its GPUs are what every composition
        uses; it may hold degrees outside `degrees`).
      degrees: the degrees a composition may use (powers of two).
      need: the smallest largest degree a composition must have; others are not replayed.
      ttft: a composition's predicted mean TTFT (s; `math.inf` where it cannot serve the
        window), called once per composition visited.

    Returns:
      `(ttft, composition)`, the composition's degrees in descending order, every degree in
      `degrees`; `current` itself (and `math.inf` if its largest degree is below `need`)
      when nothing visited is faster.

    Raises:
      ValueError: a degree of `degrees` or `current` that is not a power of two >= 1.
    """
    _check_degrees(degrees)
    _check_degrees(current, "current")
    ds = sorted(set(degrees) | set(current))
    gpus = sum(current)
    seen: dict[tuple[int, ...], float] = {}

    def counts_of(comp: Sequence[int]) -> tuple[int, ...]:
        return tuple(list(comp).count(d) for d in ds)

    home = counts_of(current)
    outside = [k for k, d in enumerate(ds) if d not in degrees]

    def value(counts: tuple[int, ...]) -> float:
        if counts not in seen:
            comp = [d for d, n in zip(reversed(ds), reversed(counts)) for _ in range(n)]
            allowed = counts == home or not any(counts[k] for k in outside)
            seen[counts] = ttft(comp) if allowed and comp and max(comp) >= need else math.inf
        return seen[counts]

    pairs = [(i, j) for j in range(len(ds)) for i in range(j)]  # (smaller, larger) degree
    starts = [home] + [counts_of([d] * (gpus // d)) for d in ds
                       if gpus % d == 0 and d >= need and d in degrees]
    for x in sorted(set(starts), key=value):
        fx = value(x)
        m = 1 << max(0, (max(x) // 4).bit_length() - 1)
        while True:
            moves = []
            for i, j in pairs:
                per = ds[j] // ds[i]  # workers of degree ds[i] one of degree ds[j] makes
                for sign in (1, -1):  # +1: split m of ds[j]; -1: merge m * per of ds[i]
                    y = list(x)
                    y[j] -= sign * m
                    y[i] += sign * m * per
                    if min(y) >= 0 and (ds[i] in degrees or y[i] == 0) and (
                            ds[j] in degrees or y[j] == 0):
                        moves.append(tuple(y))
            best = min(moves, key=value, default=None)
            if best is not None and value(best) < fx:
                x, fx = best, value(best)
            elif m > 1:
                m //= 2
            else:
                break
    x = min(seen, key=lambda c: (seen[c], c != home))
    while math.isfinite(seen[x]):  # the polish (module doc)
        ranges = [range(max(0, x[k] - POLISH_RADIUS), x[k] + POLISH_RADIUS + 1)
                  for k in range(1, len(ds))]
        box = []
        for upper in itertools.product(*ranges):
            left = gpus - sum(n * d for n, d in zip(upper, ds[1:]))
            if left >= 0 and left % ds[0] == 0:
                box.append((left // ds[0],) + upper)
        y = min(box, key=value)
        if not value(y) < seen[x]:
            break
        x = y
    counts = min(seen, key=lambda c: (seen[c], c != home))
    comp = tuple(d for d, n in zip(reversed(ds), reversed(counts)) for _ in range(n))
    return seen[counts], comp
