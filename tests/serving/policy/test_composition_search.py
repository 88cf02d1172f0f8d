"""`serving.policy.composition_search`: the count against the listing, and the search against
the exhaustive listing it replaces on large pools (seeded windows, some built to be hard)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import serving.policy.whatif as whatif
from serving.policy.composition_search import count_compositions, pattern_search
from serving.policy.controller import compositions
from serving.policy.whatif import Window, replay_ttft, target_composition
from tests.serving.policy.test_composition import COST

HOLDS = {1: 32_000, 2: 64_000, 4: 128_000, 8: 256_000}  # tokens a worker of each degree holds


@pytest.mark.parametrize("gpus,degrees", [(16, (1, 2, 4, 8)), (40, (2, 4)), (64, (1, 2, 4, 8)),
                                          (24, (2, 8)), (0, (1, 2)), (7, (2, 4))])
def test_the_count_is_the_number_of_listed_compositions(gpus, degrees):
    assert count_compositions(gpus, degrees) == len(compositions(gpus, degrees))  # [[]] for 0
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        count_compositions(-1, degrees)
    with pytest.raises(ValueError, match="degrees must be powers of two >= 1"):
        count_compositions(gpus, (2, 3))


def _window(rng, gpus, kind):
    """400 seeded requests at a load of 0.4-2 on `gpus` GPUs of CP-8: 1-3K tokens, half cached
    ("short"); 8 % of 40-200K tokens among 200-1,500 ("mix"); half 500, half 60K ("bimodal");
    15 % of 30-120K tokens, 60 % cached ("mixcached"). Long prompts fit only larger degrees."""
    n = 400
    if kind == "short":
        lengths = rng.integers(1000, 3000, n)
        hits = (rng.random(n) < 0.5) * (lengths * rng.uniform(0, 0.9, n)).astype(int)
    elif kind == "mix":
        lengths = np.where(rng.random(n) < 0.08, rng.integers(40_000, 200_000, n),
                           rng.integers(200, 1500, n))
        hits = np.zeros(n, int)
    elif kind == "bimodal":
        lengths, hits = np.where(rng.random(n) < 0.5, 500, 60_000), np.zeros(n, int)
    else:
        lengths = np.where(rng.random(n) < 0.15, rng.integers(30_000, 120_000, n),
                           rng.integers(300, 3000, n))
        hits = np.where(rng.random(n) < 0.6, (lengths * rng.uniform(0.5, 0.99, n)).astype(int), 0)
    mean_s = np.mean([COST.predict(8, int(a), int(h)) for a, h in zip(lengths, hits)])
    arrivals = np.cumsum(rng.exponential(mean_s * 8 / gpus / rng.uniform(0.4, 2.0), n))
    sample = [(float(t), int(a), int(h)) for t, a, h in zip(arrivals, lengths, hits)]
    return Window.of(sample, (1, 2, 4, 8), COST.predict, HOLDS.__getitem__), int(max(lengths))


@pytest.mark.parametrize("gpus", [64, 96])
def test_the_search_finds_the_listings_least_ttft(gpus):
    rng = np.random.default_rng(gpus)
    degrees, found_least = (1, 2, 4, 8), 0
    for trial, kind in enumerate(["short", "mix", "bimodal", "mixcached"] * 2):
        window, longest = _window(rng, gpus, kind)
        need = min(c for c in degrees if HOLDS[c] >= longest)
        spread = float(rng.uniform(0, 2))
        calls = []

        def ttft(comp):
            calls.append(tuple(comp))
            t, unheld = replay_ttft(comp, window, 1.0, [spread] * len(comp))
            return math.inf if unheld else t
        listed = [(ttft(c), tuple(c)) for c in compositions(gpus, degrees) if max(c) >= need]
        least = min(t for t, _ in listed)
        current = [[8] * (gpus // 8), [4] * (gpus // 4), [8] * (gpus // 16) + [4] * (gpus // 8)][
            trial % 3]
        calls.clear()
        found, comp = pattern_search(current, degrees, need, ttft)
        assert sum(comp) == gpus and set(comp) <= set(degrees) and max(comp) >= need
        assert found == ttft(list(comp)) and found <= ttft(current)  # the figure is comp's
        assert least <= found <= 1.005 * least, (trial, kind, comp)
        assert len(set(calls)) < len(listed) / 2  # a fraction of the replays
        found_least += found == least
    assert found_least >= 7


def test_degrees_outside_the_allowed_ones_stay_only_in_the_current_composition():
    def ttft(comp):  # more workers are faster: the search wants CP-1 where it may
        return 10.0 / len(comp)
    assert pattern_search([8, 1], (2, 4, 8), 1, ttft) == (5.0, (8, 1))  # 9 GPUs: nothing else
    found, comp = pattern_search([8, 4, 2, 1, 1], (2, 4, 8), 1, ttft)
    assert comp == (2,) * 8 and found == 10.0 / 8
    assert pattern_search([4, 4], (1, 2, 4), 8, ttft) == (math.inf, (4, 4))  # none holds `need`
    with pytest.raises(ValueError, match="current must be powers of two"):
        pattern_search([3, 3], (2, 4), 1, ttft)


def test_a_large_pool_is_searched_and_a_small_one_listed(monkeypatch):
    rng = np.random.default_rng(3)
    window, _ = _window(rng, 32, "short")
    current = [8, 8, 8, 8]
    listed = target_composition(current, 0.5, window, 1.0, (1, 2, 4, 8), need=4)
    searched = []
    real = whatif.pattern_search
    monkeypatch.setattr(whatif, "pattern_search",
                        lambda *a: searched.append(a) or real(*a))
    assert target_composition(current, 0.5, window, 1.0, (1, 2, 4, 8), need=4) == listed
    assert not searched  # 165 compositions: listed
    comp, ttft, now_ttft, backlog = target_composition(current, 0.5, window, 1.0, (1, 2, 4, 8),
                                                       need=4, exhaustive_limit=100)
    assert len(searched) == 1 and max(comp) >= 4 and sum(comp) == 32
    assert (now_ttft, backlog) == listed[2:] and listed[1] <= ttft <= 1.005 * listed[1]


def test_the_initial_choice_of_a_large_pool_is_searched():
    # 64 GPUs of {1, 2, 4, 8} with the listing capped below their 969 compositions: the chosen
    # composition is within 0.5 % of the listing's least TTFT, and the figures returned are the
    # compositions visited (a fraction), each its own replay's.
    rng = np.random.default_rng(11)
    lengths = rng.integers(500, 6000, 400)
    hits = (rng.random(400) < 0.5) * (lengths * 0.8).astype(int)
    arrivals = np.cumsum(rng.exponential(0.02, 400))
    sample = [(float(t), int(n), int(h)) for t, n, h in zip(arrivals, lengths, hits)]
    listed, every = whatif.choose_initial(64, (1, 2, 4, 8), sample, COST.predict)
    found, visited = whatif.choose_initial(64, (1, 2, 4, 8), sample, COST.predict,
                                           exhaustive_limit=100)
    assert len(every) == 969 and 0 < len(visited) < len(every) / 2
    assert all(visited[c] == pytest.approx(every[c]) for c in visited)
    assert sum(found) == 64 and every[tuple(found)] <= 1.005 * every[tuple(listed)]
