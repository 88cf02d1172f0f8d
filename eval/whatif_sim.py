"""Choosing a starting composition and placement rule by replaying historical demand through
the policy core, in the simulator (the default `vertumnus` system's initial choice).

Every composition of the pool's degrees (with a worker able to hold the longest prompt seen),
under each candidate router, runs the demand sample (`eval.systems.Demand.requests`: requests
with their block hashes, on arrival times at the demand's rate) through `eval.sim.simulate`
with the *router's own cost model as the clock*: the policy never sees the ground truth or its
noise, only what it would know live (a fitted profile and past requests). Unlike the
queueing replay of `serving.policy.whatif`, this one has the workers' prefix caches, so it sees
that more, smaller workers keep fewer prefixes warm, and what a prefix fetch costs and saves.
The option of least mean TTFT wins (fewer failed requests first; ties to the earlier option).
A router that prices evicting live context runs here as it is served: its `p` is the share
of placed blocks reused until a placement is predicted to push live blocks out, then the rate
at which pushed-out blocks come back (`LiveWorkingSet.victim_reuse_rate`). A replay priced
at the reuse share throughout, as before item 28 of eval/RESULTS.md, ranked a rule by a price
it would not be served with: on Tool-Agent with Qwen3-32B on H100s (caches a third of the H20's)
the cost with G against the cheapest degree kept 58 % of prefix hits in the replay and 52 % in
the run, predicted 197 ms and served 306 ms (eval/RESULTS.md, item 28).
For closed-loop sessions the sample is the run's ramp (`eval.offered_load.SessionLoad.
demand_sample`), whose sessions hold a share of the contexts the run holds at its busiest: each
worker's KV is cut to that share (`kv_share`, `SessionLoad.replay_kv_share`), so the replay sees the
evictions a composition of smaller workers will suffer (eval/RESULTS.md, item 9).

Cost: (compositions x routers) short simulations, about 1-3 s per system on one core; the
answer is remembered for the same arguments (the other Vertumnus variants of a run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

from eval.sim.simulator import SimConfig, simulate
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request, num_blocks
from serving.policy.router import Router


_CACHE: dict[tuple, tuple] = {}  # one system build's replays, reused by the next (same args)


def replay_choice(options: Sequence[Sequence[int]], routers: dict[str, Callable[[], Router]],
                  sample: Sequence[Request], workers: Callable[[Sequence[int]], list],
                  cost_model, kv_bytes_per_token: int = 0, tag: Hashable = None,
                  kv_share: float = 1.0
                  ) -> tuple[list[int], str, dict[tuple[tuple[int, ...], str], tuple[int, float]]]:
    """The (composition, router) of least mean TTFT when `sample` is simulated through each.

    Args:
      options: candidate compositions (CP degrees).
      routers: name -> a factory of a fresh router.
      sample: requests sorted by arrival (seconds).
      workers: composition -> `WorkerSpec`s (`eval.systems.PoolConfig.workers`).
      cost_model: the routers' cost model; also the replay's clock.
      kv_bytes_per_token: the model's KV size, for copy times of routers that fetch.
      tag: whatever else makes two calls differ (the routers' knobs, the pool's KV size): calls
        with equal options, router names, tag, kv_share and the same sample and cost model
        objects share one answer.
      kv_share: each worker's KV capacity in the replay is this share of its own, in (0, 1]
        (`eval.systems.Demand.replay_kv_share`), but never below the blocks of the sample's
        longest prompt it could hold (so no request fails that would not).

    Returns:
      `(composition, router name, {(composition, router name): (failed requests, mean TTFT
      in s)})`; fewer failures rank first.

    Raises:
      ValueError: no option, no router, an empty sample, or kv_share outside (0, 1].
    """
    if not options or not routers or not sample:
        raise ValueError("replay_choice needs options, routers and a non-empty sample")
    if isinstance(kv_share, bool) or not isinstance(kv_share, (int, float)) or not (
            0.0 < kv_share <= 1.0):
        raise ValueError(f"kv_share must be a number in (0, 1], got {kv_share!r}")
    # The same demand is replayed for each Vertumnus variant of a run: remember the last few
    # answers, keyed by the objects themselves (kept alive in the entry, so ids stay valid).
    key = (tuple(map(tuple, options)), tuple(routers), tag, id(sample), id(cost_model),
           kv_bytes_per_token, kv_share)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is sample:
        return list(hit[1]), hit[2], dict(hit[3])
    config = SimConfig(kv_bytes_per_token=kv_bytes_per_token, tick_interval=0.0)
    scores: dict[tuple[tuple[int, ...], str], tuple[int, float]] = {}
    for comp in options:
        specs = _shrunk(workers(comp), kv_share, sample)  # (the same for every router)
        for name, make in routers.items():
            router = make()  # (as served, its eviction price included: module doc)
            records = simulate(sample, list(specs), cost_model, router, cost_model.predict,
                               config, prefix_index=PrefixIndex())
            ok = [r.ttft for r in records if r.ok]
            scores[(tuple(comp), name)] = (len(records) - len(ok),
                                           sum(ok) / len(ok) if ok else float("inf"))
    best = min(scores.values())
    (comp, name) = next(k for k, v in scores.items() if v == best)
    if len(_CACHE) >= 8:
        _CACHE.clear()
    _CACHE[key] = (sample, comp, name, scores)
    return list(comp), name, scores


def _shrunk(specs: list, share: float, sample: Sequence[Request]) -> list:
    """`specs` with `kv_capacity_blocks` scaled by `share` (floor), kept at least at the blocks
    of the longest prompt of `sample` each one can hold whole."""
    if share == 1.0:
        return specs
    sizes = [(r.input_len, num_blocks(r.input_len, r.block_size)) for r in sample]
    out = []
    for spec in specs:
        cap = spec.kv_capacity_blocks
        longest = max((b for n, b in sizes if n <= spec.max_input_len and b <= cap), default=1)
        out.append(dataclasses.replace(spec, kv_capacity_blocks=max(int(cap * share), longest)))
    return out
