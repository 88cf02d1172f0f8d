"""The synthetic stand-in workloads (`eval.traces.synthetic`)."""

from __future__ import annotations

import numpy as np
import pytest

from eval.traces.synthetic import SYNTHETIC, SyntheticConfig, synthetic_workload


def test_lengths_and_gaps_follow_the_config():
    c = SyntheticConfig(num_requests=20_000, median_input_len=800, sigma=0.7, min_input_len=200,
                        max_input_len=5000, arrival_cv=2.5)
    reqs = synthetic_workload(c, seed=3)
    lens = np.array([r.input_len for r in reqs])
    gaps = np.diff([r.arrival_time for r in reqs])
    assert reqs[0].arrival_time == 0.0 and np.all(gaps >= 0)
    # the median is untouched by clipping on both sides (both tails are < 50 %)
    assert abs(np.median(lens) / 800 - 1) < 0.03
    assert lens.min() == 200 and lens.max() == 5000  # clipped: P(L < 200) 2.4 %, P(L > 5000) 0.4 %
    # gamma gaps of mean 1 s and CV 2.5 (standard errors about 1.8 % and 4 % at n = 20,000)
    assert abs(gaps.mean() - 1) < 0.06
    assert abs(gaps.std() / gaps.mean() - 2.5) < 0.3
    assert all(r.output_len == 64 and r.block_size == 512 for r in reqs)


def test_prompts_are_new_content_except_the_shared_system_prompt():
    c = SyntheticConfig(num_requests=50, median_input_len=300, sigma=0.5, min_input_len=16,
                        max_input_len=2000, shared_prefix_len=4096 + 100)
    reqs = synthetic_workload(c, seed=0, block_size=512)
    assert all(r.input_len >= 4196 and len(r.block_hashes) == -(-r.input_len // 512)
               for r in reqs)
    # the 8 full blocks of the system prompt are the same in every request; the 9th mixes in
    # the request's own tokens, so from there on nothing is shared
    assert len({r.block_hashes[:8] for r in reqs}) == 1
    assert len({r.block_hashes[8] for r in reqs}) == 50
    plain = synthetic_workload(SyntheticConfig(num_requests=50), seed=0)
    assert len({r.block_hashes[0] for r in plain}) == 50


def test_the_seed_fixes_the_workload_and_no_two_workloads_share_content():
    c = SYNTHETIC["short prompts (bursty)"]
    a, b = synthetic_workload(c, seed=1)[:100], synthetic_workload(c, seed=1)[:100]
    assert a == b
    other = synthetic_workload(c, seed=2)[:100]
    assert [r.input_len for r in other] != [r.input_len for r in a]
    # Poisson and bursty draw the same lengths from one seed (the gaps come after), but their
    # content is named by the config too: merged, they would share no block
    poisson = synthetic_workload(SYNTHETIC["short prompts (Poisson)"], seed=1)[:100]
    assert [r.input_len for r in poisson] == [r.input_len for r in a]
    assert not {h for r in poisson for h in r.block_hashes} & {h for r in a
                                                               for h in r.block_hashes}
    assert not {h for r in other for h in r.block_hashes} & {h for r in a for h in r.block_hashes}


@pytest.mark.parametrize("field, value", [
    ("num_requests", 1), ("num_requests", 2.5), ("num_requests", "10"), ("num_requests", None),
    ("median_input_len", 0), ("median_input_len", True), ("median_input_len", 10**19),
    ("sigma", -0.1), ("sigma", float("nan")), ("sigma", True), ("sigma", "1"),
    ("min_input_len", 0), ("min_input_len", 1.5), ("max_input_len", float("nan")),
    ("max_input_len", 2**70), ("arrival_cv", 0.0), ("arrival_cv", 1e-170),
    ("arrival_cv", 1e10), ("shared_prefix_len", -1), ("shared_prefix_len", 2.5),
    ("shared_prefix_len", float("inf")), ("output_len", -1), ("output_len", True),
    ("output_len", 2.5)])
def test_bad_configs_name_the_field_and_its_range(field, value):
    with pytest.raises(ValueError, match=rf"SyntheticConfig\.{field} must be an? (integer|finite "
                                         rf"number) in \["):
        SyntheticConfig(**{field: value})


def test_bad_bounds_seeds_and_block_sizes():
    with pytest.raises(ValueError, match="min_input_len must be <= max_input_len, got 10 > 5"):
        SyntheticConfig(min_input_len=10, max_input_len=5)
    c = SyntheticConfig(num_requests=2)
    for bad in (0, True, 16.0):
        with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
            synthetic_workload(c, block_size=bad)
    for bad in (-1, None, 1.5, 2**64):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            synthetic_workload(c, seed=bad)
    # numpy integers are integers, and an equal config (sigma 1 or 1.0) gives the same requests
    one = SyntheticConfig(num_requests=3, sigma=1)
    assert synthetic_workload(one) == synthetic_workload(SyntheticConfig(num_requests=3,
                                                                         sigma=1.0))
    assert synthetic_workload(c, seed=np.int64(3), block_size=np.int64(16)) == \
        synthetic_workload(c, seed=3, block_size=16)
