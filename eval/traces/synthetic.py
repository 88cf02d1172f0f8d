"""Synthetic stand-ins for traces we do not have: one-off prompts of chosen lengths and burstiness.

The comparison's workloads are public traces and the Tool-Agent generator; the policy is also
judged on traffic it was never run on (short-prompt production traffic, most of all). These
generators make such traffic from a few chosen shapes, with nothing fitted to our traces:
prompt lengths are lognormal (heavy-tailed, as context lengths of production traces are),
arrival gaps are gamma with a chosen coefficient of variation (1 is Poisson; BurstGPT models the
arrivals of real Azure OpenAI traffic with gamma gaps, burstier than Poisson: Wang et al.,
"BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems", arXiv:2401.17644),
and every prompt is new content except an optional system prompt all requests start with (the
shared-prefix case of issue 15).

`SYNTHETIC` names the four stand-ins `eval.robustness` runs. Native rate 1 req/s: a sweep scales
the arrivals to its own rates (`eval.traces.workloads.scale_to_rate`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct

import numpy as np

from eval.traces.content import segment_block_ids, segment_id
from serving.policy.request import Request, chain_block_hashes

_TAG = 0x53594E54  # "SYNT": the segment-id namespace of these prompts


MAX_TOKENS = 10_000_000  # bound of every length field: a prompt of 10M tokens
MAX_ARRIVAL_CV = 10.0  # gamma shape 1 / CV**2 = 0.01: already 2 gaps in 3 are below 1e-16 s


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """One synthetic workload's shape.

    Attributes:
      num_requests: requests generated, an integer in [2, 10**8].
      median_input_len: median prompt length in tokens (before the shared prefix), an integer
        in [1, MAX_TOKENS].
      sigma: lognormal shape of the prompt lengths (the log's standard deviation), a finite
        number in [0, 10].
      min_input_len, max_input_len: the lengths are clipped to this range (tokens), integers
        with 1 <= min <= max <= MAX_TOKENS.
      arrival_cv: coefficient of variation of the inter-arrival gaps (gamma distributed, mean 1
        s), a finite number in [0.01, MAX_ARRIVAL_CV]; 1 is a Poisson process.
      shared_prefix_len: tokens of one system prompt every request starts with, an integer in
        [0, MAX_TOKENS].
      output_len: tokens each request decodes, an integer in [0, MAX_TOKENS].

    Raises:
      ValueError: a field of another type or outside the range above, naming it.
    """

    num_requests: int = 6000
    median_input_len: int = 600
    sigma: float = 0.8
    min_input_len: int = 32
    max_input_len: int = 8000
    arrival_cv: float = 1.0
    shared_prefix_len: int = 0
    output_len: int = 64

    def __post_init__(self) -> None:
        ints = (("num_requests", 2, 10**8), ("median_input_len", 1, MAX_TOKENS),
                ("min_input_len", 1, MAX_TOKENS), ("max_input_len", 1, MAX_TOKENS),
                ("shared_prefix_len", 0, MAX_TOKENS), ("output_len", 0, MAX_TOKENS))
        for name, lo, hi in ints:
            v = getattr(self, name)
            if not (_is_int(v) and lo <= v <= hi):
                raise ValueError(f"SyntheticConfig.{name} must be an integer in [{lo}, {hi}], "
                                 f"got {v!r}")
        for name, lo, hi in (("sigma", 0.0, 10.0), ("arrival_cv", 0.01, MAX_ARRIVAL_CV)):
            v = getattr(self, name)
            if not (_is_real(v) and lo <= v <= hi):
                raise ValueError(f"SyntheticConfig.{name} must be a finite number in [{lo}, "
                                 f"{hi}], got {v!r}")
        if self.min_input_len > self.max_input_len:
            raise ValueError(f"SyntheticConfig.min_input_len must be <= max_input_len, got "
                             f"{self.min_input_len} > {self.max_input_len}")


# The stand-ins `eval.robustness` runs (shapes chosen once from the sources above, not tuned):
# short prompts (median 600 tokens) under Poisson and bursty (CV 3) arrivals, a 4,096-token
# system prompt before short questions, and mid-length prompts (median 3,000, up to 30,000).
# Short prompts are served at hundreds of requests per second: 20,000 of them make a run of
# 44 s with Qwen3-30B-A3B at load 0.9 (6,000 ran 13 s, too short for the controller's window,
# and the initial choice's 1,000-request sample was a sixth of it).
SYNTHETIC = {
    "short prompts (Poisson)": SyntheticConfig(num_requests=20_000),
    "short prompts (bursty)": SyntheticConfig(num_requests=20_000, arrival_cv=3.0),
    "one system prompt": SyntheticConfig(num_requests=20_000, median_input_len=300, sigma=0.5,
                                         min_input_len=16, max_input_len=2000,
                                         shared_prefix_len=4096),
    "mid-length prompts": SyntheticConfig(median_input_len=3000, sigma=0.9, min_input_len=64,
                                          max_input_len=30000),
}


def synthetic_workload(config: SyntheticConfig, seed: int = 0,
                       block_size: int = 512) -> list[Request]:
    """Requests of the shape `config`, drawn with `seed` (the same seed, the same requests).

    Request i arrives at the sum of the first i gaps (the first at 0 s); its prompt is the
    shared prefix (if any) followed by `clip(round(exp(N(log(median), sigma^2))), min, max)`
    tokens of its own, whose content is named by the seed, the config and i (two stand-ins or
    seeds never share content by chance); ids are `"s<i>"` (give them new ids to merge two
    workloads).

    Raises:
      ValueError: `seed` not an integer in [0, 2**63), or `block_size` not an integer >= 1.
    """
    if not (_is_int(seed) and 0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    if not (_is_int(block_size) and block_size >= 1):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    c = config
    rng = np.random.default_rng(int(seed))
    lens = np.clip(np.rint(rng.lognormal(math.log(c.median_input_len), c.sigma,
                                         c.num_requests)), c.min_input_len, c.max_input_len)
    shape = 1.0 / (c.arrival_cv * c.arrival_cv)  # gamma: mean shape * scale = 1, CV 1/sqrt(shape)
    gaps = rng.gamma(shape, 1.0 / shape, c.num_requests - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    shared = [(segment_id(_TAG, 0, c.shared_prefix_len), c.shared_prefix_len)] \
        if c.shared_prefix_len else []
    def bits(x: float) -> int:
        return struct.unpack("<q", struct.pack("<d", float(x)))[0]

    own = segment_id(_TAG, 1, int(seed), int(c.num_requests), int(c.median_input_len),
                     bits(c.sigma), int(c.min_input_len), int(c.max_input_len),
                     bits(c.arrival_cv), int(c.shared_prefix_len), int(c.output_len))
    out = []
    for i, (n, t) in enumerate(zip(lens.astype(np.int64).tolist(), arrivals.tolist())):
        hashes = chain_block_hashes(segment_block_ids(shared + [(segment_id(own, i), n)],
                                                      int(block_size)))
        out.append(Request(f"s{i}", t, n + c.shared_prefix_len, c.output_len, hashes,
                           int(block_size)))
    return out
