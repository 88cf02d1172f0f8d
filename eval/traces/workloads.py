"""Workload shaping (rate scaling, re-timing), prefix-reuse statistics and the built-in Tool-Agent
workload generator. numpy only; requests are `serving.policy.request.Request`s sorted by arrival.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from eval.traces.content import segment_block_ids, segment_id
from serving.policy.request import Request, chain_block_hashes


def _sorted(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time)  # stable: ties keep input order


def _positive(value: float, field: str, unit: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{field} must be a finite number > 0 {unit}, got {value!r}")


def native_rate(requests: Sequence[Request]) -> float:
    """Mean request rate of a trace, req/s: `(n - 1) / (t_last - t_first)`.

    The n arrivals bound n - 1 inter-arrival gaps, so this is 1 / mean gap (it does not count
    idle time before the first or after the last request).

    Raises:
      ValueError: fewer than 2 requests, or all arrivals at the same time.
    """
    t = [r.arrival_time for r in requests]
    if len(t) < 2 or max(t) <= min(t):
        raise ValueError(f"the native rate needs >= 2 requests spread over time, got {len(t)} "
                         f"request(s) over {max(t, default=0) - min(t, default=0)} s")
    return (len(t) - 1) / (max(t) - min(t))


def scale_to_rate(requests: Iterable[Request], rate: float) -> list[Request]:
    """Compresses or stretches time so that the trace's mean rate becomes `rate` req/s.

    New arrival = `t * native_rate / rate` (see `native_rate`): time is scaled about 0, so order,
    ties and relative gaps are kept and `native_rate(result) == rate` (up to rounding).

    Args:
      requests: at least 2, not all at one instant.
      rate: target requests per second, finite and > 0.

    Returns:
      New `Request`s (the input is not modified), sorted by arrival.

    Raises:
      ValueError: rate out of range, or the native rate is undefined.
    """
    _positive(rate, "rate", "requests/s")
    reqs = _sorted(requests)
    factor = native_rate(reqs) / rate
    return [dataclasses.replace(r, arrival_time=r.arrival_time * factor) for r in reqs]


def retime(requests: Iterable[Request],
           arrivals_from: Iterable[Request] | Iterable[float] | np.ndarray) -> list[Request]:
    """Gives one trace's requests another trace's arrival process.

    With the source arrivals sorted, `a_0 <= ... <= a_{m-1}`, and the requests in arrival order,
    request i gets `(i // (m-1)) * (a_{m-1} - a_0) + (a_{i mod (m-1)} - a_0)`: the source's
    inter-arrival gaps in order, starting at 0, truncated when n <= m and cycled (g_0, ...,
    g_{m-2}, g_0, ...) when n > m. Lengths, hashes, ids and order of `requests` are kept.
    E.g. re-time Mooncake conversations with the Azure code trace's bursty arrivals.

    Args:
      requests: the requests to re-time.
      arrivals_from: the trace whose arrival process is used: Requests, or arrival times in
        seconds (any array-like of numbers, e.g. a list or an ndarray, read by `np.asarray` and
        flattened); at least 2 arrivals, not all at one instant.

    Raises:
      ValueError: arrivals_from has < 2 arrivals, zero span, non-finite or non-numeric times,
        or mixes Requests with numbers.
    """
    reqs = _sorted(requests)
    items = arrivals_from if isinstance(arrivals_from, np.ndarray) else list(arrivals_from)
    is_req = [isinstance(x, Request) for x in items] if isinstance(items, list) else [False]
    if any(is_req) and not all(is_req):
        raise ValueError("arrivals_from must hold only Requests or only arrival times (s), "
                         "not a mix")
    try:
        times = [r.arrival_time for r in items] if all(is_req) else items
        src = np.sort(np.asarray(times, dtype=np.float64).ravel())
    except (TypeError, ValueError):
        raise ValueError(f"arrivals_from must hold Requests or arrival times in seconds, got "
                         f"{type(arrivals_from).__name__} of non-numbers") from None
    if src.size < 2 or not np.all(np.isfinite(src)) or src[-1] <= src[0]:
        raise ValueError(f"arrivals_from must hold >= 2 finite arrival times spanning > 0 s, "
                         f"got {src.size} spanning {src[-1] - src[0] if src.size else 0} s")
    i = np.arange(len(reqs))
    period = src.size - 1
    new = (i // period) * (src[-1] - src[0]) + (src[i % period] - src[0])
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(reqs, new.tolist())]


def prefix_hit_tokens(requests: Iterable[Request]) -> np.ndarray:
    """Cached prompt tokens of each request under an unbounded cache shared by all requests.

    Requests are taken in arrival order. Request r hits its longest leading run of blocks
    whose chain hashes an earlier request left in the cache, at most `r.max_cacheable_blocks`
    (only full blocks, last token recomputed); it then leaves its `r.full_blocks` in the cache.

    Returns:
      int64 array [n], tokens (hit blocks * block_size), in arrival order.

    Raises:
      ValueError: requests with different block sizes.
    """
    reqs = _sorted(requests)
    if len({r.block_size for r in reqs}) > 1:
        raise ValueError("block_size must be the same for every request")
    cache: set[int] = set()
    hits = np.zeros(len(reqs), dtype=np.int64)
    for n, r in enumerate(reqs):
        h, k, cap = r.block_hashes, 0, r.max_cacheable_blocks
        while k < cap and h[k] in cache:
            k += 1
        hits[n] = k * r.block_size
        cache.update(h[:r.full_blocks])
    return hits


def reuse_fraction(requests: Iterable[Request]) -> float:
    """Token-level prefix reuse: `sum(prefix_hit_tokens) / sum(input_len)`, in [0, 1).

    The unbounded-cache reuse of the Mooncake paper's traces (Qin et al., FAST'25, "cache ratio"),
    counted over full blocks only; the traces README counts the last partial block too when its
    id matches, which adds < 0.1 point (conversation 37.34 % here vs 37.4 %).
    """
    reqs = list(requests)
    total = sum(r.input_len for r in reqs)
    return float(prefix_hit_tokens(reqs).sum() / total) if total else 0.0


def workload_stats(requests: Iterable[Request]) -> dict[str, float]:
    """Summary of a workload.

    Returns:
      `count`; `duration_s` (t_last - t_first); `rate` (req/s, `native_rate`, nan below 2
      requests); `input_p50`, `input_p90`, `input_p99`, `input_mean` (tokens, `np.percentile`
      linear); `output_mean` (tokens); `reuse` (`reuse_fraction`).

    Raises:
      ValueError: no requests.
    """
    reqs = _sorted(requests)
    if not reqs:
        raise ValueError("requests must be non-empty")
    inp = np.array([r.input_len for r in reqs], dtype=np.float64)
    span = reqs[-1].arrival_time - reqs[0].arrival_time
    p50, p90, p99 = np.percentile(inp, [50, 90, 99]).tolist()
    return {
        "count": len(reqs), "duration_s": span,
        "rate": (len(reqs) - 1) / span if span > 0 else float("nan"),
        "input_p50": p50, "input_p90": p90, "input_p99": p99, "input_mean": float(inp.mean()),
        "output_mean": float(np.mean([r.output_len for r in reqs])),
        "reuse": reuse_fraction(reqs),
    }


# ----------------------------------------------------------------------------- Tool-Agent

_TAG_HEAD, _TAG_TOOLS, _CATALOGUE_SEED = 0x7A0, 0x7A1, 0x7A6
MAX_AGENT_RATE = 1e4            # req/s: far above any one prefill pool
MAX_AGENT_REQUESTS = 10_000_000  # expected calls per window (duration, or warm-up) * rate


@dataclasses.dataclass(frozen=True)
class ToolAgentConfig:
    """Parameters of `tool_agent_workload` (lengths in tokens, times in seconds).

    Lengths are lognormal with the given mean and log-sd (`mu = ln(mean) - sigma^2/2`), rounded,
    at least 1. See `tool_agent_workload` for the model and the calibration.
    """

    num_templates: int = 8             # agent templates (system prompts)
    zipf_exponent: float = 1.0         # template popularity ~ 1 / rank^s
    system_tokens: tuple[int, int] = (5_500, 6_500)  # template length range (uniform)
    shared_head_tokens: tuple[int, int] = (1_792, 2_816)  # head before the session slot
    context_mean: float = 200.0        # per-session context rendered into the system prompt
    context_sigma: float = 0.5
    user_mean: float = 350.0           # the user's task message
    user_sigma: float = 0.8
    mean_steps: float = 2.0            # LLM calls per session: min(Geometric(1/mean), max)
    max_steps: int = 16
    output_mean: float = 182.0         # generated tokens per call
    output_sigma: float = 0.8
    tool_mean: float = 1_740.0         # tool output (observation) tokens per step
    tool_sigma: float = 1.0
    decode_tokens_per_s: float = 50.0  # next call arrives after decoding the output ...
    tool_latency_mean_s: float = 2.0   # ... plus an exponential tool latency
    warmup_s: float = 120.0            # sessions start this long before t = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_templates, int) or self.num_templates < 1:
            raise ValueError(f"num_templates must be an integer >= 1, got {self.num_templates!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {self.max_steps!r}")
        if not (math.isfinite(self.mean_steps) and self.mean_steps >= 1):
            raise ValueError(f"mean_steps must be a finite number >= 1, got {self.mean_steps!r}")
        lo, hi = self.shared_head_tokens
        if not 1 <= lo <= hi < self.system_tokens[0] <= self.system_tokens[1]:
            raise ValueError(f"need 1 <= shared_head_tokens (lo <= hi) < system_tokens (lo <= hi), "
                             f"got {self.shared_head_tokens} and {self.system_tokens}")
        for f in ("zipf_exponent", "context_sigma", "user_sigma", "output_sigma", "tool_sigma",
                  "tool_latency_mean_s", "warmup_s"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")
        for f in ("context_mean", "user_mean", "output_mean", "tool_mean", "decode_tokens_per_s"):
            _positive(getattr(self, f), f, "tokens/s" if f == "decode_tokens_per_s" else "tokens")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(np.int64)


def tool_agent_workload(duration_s: float = 3600.0, rate: float = 6.6, seed: int = 0,
                        block_size: int = 512, config: ToolAgentConfig | None = None
                        ) -> list[Request]:
    """The built-in Tool-Agent workload: interleaved agent sessions with shared system prompts.

    Model (the Mooncake tool-agent trace, kvcache-ai/Mooncake `FAST25-release/traces/`, is known
    here only by its published statistics, see `../shared/traces/README.md`):
    - A catalogue of `num_templates` agent templates (the same for every seed), picked per
      session with Zipf popularity. A template's ~6 K-token system prompt is
      `head | session context | tool catalogue`: the head (1.8-2.8 K) is shared by every session
      of the template; the session context (date, user profile, memory; ~200 tokens) is rendered
      into the prompt after it, so the tool catalogue that follows is re-sent verbatim each call
      but, sitting after per-session tokens, is prefix-shared only within the session (the usual
      prompt-caching pitfall of dynamic fields in system prompts).
    - A session is `min(Geometric(1 / mean_steps), max_steps)` LLM calls (mean 2). Call 1 sends
      the system prompt plus the user's task; call j+1 re-sends call j's prompt plus call j's
      output plus the tool's output (the growing history), so it extends call j's prompt.
    - Sessions start as a Poisson process at `rate / E[calls]` over `[-warmup_s, duration_s)`;
      call j+1 arrives `output/decode_tokens_per_s + Exponential(tool_latency_mean_s)` after
      call j (open loop). Calls in `[0, duration_s)` are kept, so sessions interleave and the
      request process is Poisson-like at `rate` from t = 0.
    - Prompts are concatenations of content segments `(id, length)` (template ids fixed, the
      others random 64-bit draws), block content ids by `eval.traces.loaders.segment_block_ids`, chained
      by `serving.policy.request.chain_block_hashes`: block hashes are real content-based chains.

    Calibration (targets: ~6.6 req/s, mean input 8,596, mean output 182, 59 % of tokens
    reusable under an unbounded shared cache). With a 6 K prompt shared by all requests the
    reuse would be at least 5.6 K / 8.6 K = 65 %; pure append histories give even more, so the
    target forces short sessions and cross-session sharing of only part of the system prompt.
    Output mean 182 and tool output mean 1,740 set the mean input; the head length sets the reuse.
    Measured (`workload_stats`, block_size 512): 3,600 s, seed 0: 23,777 requests, 6.60 req/s,
    input mean 8,559 (p50 7,203, p90 12,384, p99 22,663), output mean 182.0, reuse 59.0 %;
    seed 1: 6.59 req/s, input mean 8,575, output 182.7, reuse 59.0 %.

    Size guards (the generator holds every session in memory): `rate <= MAX_AGENT_RATE` (1e4
    req/s), and both `duration_s * rate` (the expected request count) and
    `config.warmup_s * rate` (calls simulated before t = 0) at most `MAX_AGENT_REQUESTS` (1e7).

    Args:
      duration_s: seconds of workload, > 0, with `duration_s * rate <= 1e7` requests.
      rate: mean request rate, req/s, in (0, 1e4].
      seed: seed of the sessions (numpy Generator); the same seed gives the same requests.
      block_size: tokens per block, >= 1.
      config: model parameters; default `ToolAgentConfig()`.

    Returns:
      Requests sorted by arrival (seconds in [0, duration_s)), ids "toolagent:<session>.<call>".

    Raises:
      ValueError: duration_s not finite and > 0, rate not in (0, 1e4], duration_s * rate or
        config.warmup_s * rate above 1e7 requests, block_size not an integer >= 1.
    """
    _positive(duration_s, "duration_s", "seconds")
    _positive(rate, "rate", "requests/s")
    if rate > MAX_AGENT_RATE:
        raise ValueError(f"rate must be in (0, {MAX_AGENT_RATE:g}] requests/s, got {rate!r}")
    if duration_s * rate > MAX_AGENT_REQUESTS:
        raise ValueError(f"duration_s * rate must be <= {MAX_AGENT_REQUESTS:g} requests, got "
                         f"{duration_s!r} s * {rate!r} req/s = {duration_s * rate:g}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 token, got {block_size!r}")
    c = config or ToolAgentConfig()
    if c.warmup_s * rate > MAX_AGENT_REQUESTS:
        raise ValueError(f"config.warmup_s * rate must be <= {MAX_AGENT_REQUESTS:g} requests "
                         f"(calls simulated before t = 0), got {c.warmup_s!r} s * {rate!r} req/s")
    # Template catalogue (the same for every seed): head | session slot | tool catalogue.
    k = c.num_templates
    cat = np.random.default_rng(_CATALOGUE_SEED)
    total = cat.integers(c.system_tokens[0], c.system_tokens[1] + 1, size=k)
    head = cat.integers(c.shared_head_tokens[0], c.shared_head_tokens[1] + 1, size=k)
    tools = np.maximum(1, total - head)
    head_seg = [segment_id(_TAG_HEAD, t) for t in range(k)]
    tools_seg = [segment_id(_TAG_TOOLS, t) for t in range(k)]
    rng = np.random.default_rng(seed)
    head_full = [int(h) // block_size for h in head]
    head_hash = [chain_block_hashes(segment_block_ids([(head_seg[t], int(head[t]))],
                                                      block_size)[:head_full[t]]) for t in range(k)]
    with np.errstate(over="ignore"):  # a huge exponent: every rank but the first gets 0
        pop = 1.0 / np.arange(1, k + 1) ** c.zipf_exponent
    # Sessions: Poisson starts over [-warmup, duration) at rate / E[steps].
    p = 1.0 / c.mean_steps
    calls_per_session = (1 - (1 - p) ** c.max_steps) / p  # E[min(Geometric(p), max_steps)]
    n_sess = int(rng.poisson(rate / calls_per_session * (duration_s + c.warmup_s)))
    starts = np.sort(rng.uniform(-c.warmup_s, duration_s, n_sess))
    tmpl = rng.choice(k, size=n_sess, p=pop / pop.sum())
    steps = np.minimum(rng.geometric(p, n_sess), c.max_steps)
    ctx = _lognormal(rng, c.context_mean, c.context_sigma, n_sess)
    user = _lognormal(rng, c.user_mean, c.user_sigma, n_sess)
    n_calls = int(steps.sum())
    out = _lognormal(rng, c.output_mean, c.output_sigma, n_calls)
    obs = _lognormal(rng, c.tool_mean, c.tool_sigma, n_calls)
    gap = (out / c.decode_tokens_per_s + rng.exponential(c.tool_latency_mean_s, n_calls)).tolist()
    # Content segment ids: random 64-bit labels (any collision: ~n^2 / 2^65, 1e-10 for an hour).
    ctx_seg, user_seg = rng.integers(0, 2**64, size=(2, n_sess), dtype=np.uint64).tolist()
    out_seg, obs_seg = rng.integers(0, 2**64, size=(2, n_calls), dtype=np.uint64).tolist()
    out, obs = out.tolist(), obs.tolist()
    first = np.concatenate([[0], np.cumsum(steps)[:-1]])
    made: list[tuple[float, int, Request]] = []
    for s in range(n_sess):
        t = int(tmpl[s])
        segs = [(head_seg[t], int(head[t])), (ctx_seg[s], int(ctx[s])),
                (tools_seg[t], int(tools[t])), (user_seg[s], int(user[s]))]
        length = int(head[t]) + int(ctx[s]) + int(tools[t]) + int(user[s])
        done, hashes = head_full[t], head_hash[t]   # full blocks already hashed, their chain
        arrival = float(starts[s])
        for j in range(int(steps[s])):
            g = int(first[s]) + j
            if j:
                segs.append((out_seg[g - 1], out[g - 1]))
                segs.append((obs_seg[g - 1], obs[g - 1]))
                length += out[g - 1] + obs[g - 1]
                arrival += gap[g - 1]
            if arrival >= duration_s:
                break
            new = chain_block_hashes(segment_block_ids(segs, block_size, done),
                                     hashes[-1] if done else 0)
            block_hashes = hashes[:done] + new
            if arrival >= 0:
                made.append((arrival, len(made), Request(
                    f"toolagent:{s}.{j}", arrival, length, out[g], block_hashes, block_size)))
            done = length // block_size
            hashes = block_hashes[:done]
    made.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in made]
