"""Systems compared by `eval.replay`: a pool composition, a router and periodic hooks.

A system is built by name from a `PoolConfig` (GPU budget, KV blocks per GPU, the longest prompt
per degree, the fitted cost model). Built in here:

- `homogeneous-cpN`: every worker of CP degree N over the GPU budget, with cache-aware
  least-cost routing (`serving.policy.cost_router.VertumnusRouter`; the paper's homogeneous baseline);
- `leastwork-cpN`: the same pool routed by least outstanding work, blind to the cache;
- `vertumnus`: the full system: the composition and router rule of least mean TTFT when the
  demand sample is simulated through each (`vertumnus_system`), the placement cost charging
  the live context it evicts (`serving.policy.live_set`), the what-if split/merge controller
  (`serving.policy.composition.CompositionController`) and the global prefix-cache manager;
  ablations `vertumnus-nocache`, `vertumnus-static` (no controller, no cache manager),
  `vertumnus-fetch` (`serving.policy.fetch_router.FetchingVertumnusRouter` forced) and
  `vertumnus-fcfs` (queued prefills start first come, first served instead of shortest
  predicted first, `serving.policy.queue_order`) and `vertumnus-gated-sjf` (shortest first
  within a gate: no request placed after the gate closed passes those in it);
- `vertumnus-paper`: the policy as the paper describes it (initial composition with the most
  large-degree workers that has enough capacity, G against the cheapest worker, the threshold
  controller `serving.policy.controller.ReconfigurationController`); `vertumnus-paper+replay`
  adds the replayed initial choice alone (ablation);
- `static-threshold`: two fixed pools, half the GPUs at the largest of `--degrees` and half at
  the smallest, inputs of >= 8192 tokens to the large-degree pool (FlexLB's rule,
  `serving.baselines.StaticThresholdRouter`);
- `vllm-tp4`: tensor-parallel TP-4 workers (`System.parallelism == "tp"`: the run charges and
  predicts TP prefill times) with production-stack's prefix-aware routing;
- `sglang-cp4`, `dynamo-cp4`, `mooncake-cp4`: CP-4 workers with SGLang's cache-aware router,
  Dynamo's KV-router cost and Mooncake's Conductor (`serving.baselines`).

The data a system is made of and from (`Demand`, `PoolConfig`, `System`) is in
`eval.system_types`, re-exported here. Research users add their own, either with
`register_system(name, factory)` (`factory(pool) -> System`) or, with no registration, by
naming `module:attribute` (see `build_system`): a factory of that form, or a router class built
with no arguments on `mixed_degrees(num_gpus, degrees)`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence

from eval.system_types import INITIAL_CANDIDATES_KEPT, PARALLELISMS, Demand, PoolConfig, System
from eval.whatif_sim import replay_choice
from serving.baselines import (DynamoKvRouter, MooncakeConductorRouter, SglangCacheAwareRouter,
                               StaticThresholdRouter, VllmPrefixAwareRouter)
from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.composition_search import EXHAUSTIVE_LIMIT, count_compositions
from serving.policy.whatif import choose_initial
from serving.policy.controller import (ControllerConfig, ReconfigurationController, compositions,
                                       initial_composition)
from serving.policy.cost_router import VertumnusRouter
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.live_set import DEFAULT_HORIZON_S
from serving.policy.plugins import call_plugin, construct_router, guard_system, import_spec
from serving.policy.prefix_index import PrefixIndex
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.queue_order import FCFS, SJF, QueueOrder
from serving.policy.router import LeastWorkRouter, Router
from serving.policy.scheduler import Scheduler
from serving.policy.worker import homogeneous_degrees

__all__ = ["PARALLELISMS", "Demand", "PoolConfig", "System", "build_system", "expand_systems",
           "mixed_degrees", "register_system", "vertumnus_system"]

_REGISTRY: dict[str, Callable[[PoolConfig], System]] = {}
_PATTERNS: list[tuple[re.Pattern, Callable[[re.Match, PoolConfig], System]]] = []


def register_system(name: str, factory: Callable[[PoolConfig], System]) -> None:
    """Makes `name` buildable by `build_system` (overrides an earlier registration)."""
    _REGISTRY[name] = factory


def _homogeneous(m: re.Match, pool: PoolConfig) -> System:
    c = int(m.group(1))
    return System(m.group(0), pool.workers(homogeneous_degrees(pool.num_gpus, c)), VertumnusRouter())


def _least_work(m: re.Match, pool: PoolConfig) -> System:
    c = int(m.group(1))
    return System(m.group(0), pool.workers(homogeneous_degrees(pool.num_gpus, c)), LeastWorkRouter())


_PATTERNS.append((re.compile(r"homogeneous-cp(\d+)"), _homogeneous))
_PATTERNS.append((re.compile(r"leastwork-cp(\d+)"), _least_work))


def mixed_degrees(num_gpus: int, degrees: Sequence[int]) -> list[int]:
    """A static mixed composition: the GPU budget split evenly between the given degrees.

    Each degree gets `num_gpus // len(degrees)` GPUs rounded down to a multiple of it; the
    remainder goes to the smallest degree. E.g. 40 GPUs, degrees (2, 4): five CP-4 and ten CP-2.

    Raises:
      ValueError: an empty or non-power-of-two degree list, or a budget the degrees cannot fill.
    """
    if not degrees:
        raise ValueError("degrees must name at least one CP degree")
    ds = sorted(set(degrees), reverse=True)
    share = num_gpus // len(ds)
    out: list[int] = []
    for c in ds:
        out += homogeneous_degrees(share - share % c, c) if share >= c else []
    rest = num_gpus - sum(out)
    small = ds[-1]
    if rest % small:
        raise ValueError(f"num_gpus={num_gpus} cannot be split over degrees {list(degrees)}")
    out += [small] * (rest // small)
    return out


def vertumnus_system(pool: PoolConfig, controller: bool = True, cache_manager: bool = True,
                     name: str = "vertumnus", beta: float = 1.0, lam: float = 1.0,
                     controller_config: ControllerConfig | None = None,
                     cache_config: CacheManagerConfig | None = None,
                     fetch: bool | None = None, gpu_cost: str = "worker", initial: str = "replay",
                     control: str = "whatif",
                     composition_config: CompositionConfig | None = None,
                     live_horizon_s: float | None = DEFAULT_HORIZON_S,
                     congestion_price: bool = True, queue_order: QueueOrder = SJF) -> System:
    """Vertumnus: placement-cost router, split/merge controller and prefix-cache manager.

    `initial`: "replay" starts from the composition and router rule of least mean TTFT when the
    demand sample is simulated through each (`eval.whatif_sim`, the router's cost model as the
    clock); "whatif" from the best in the queueing replay (`choose_initial`); "paper" from the
    one with the most large-degree workers and enough capacity (`initial_composition`);
    `mixed_degrees` when no demand is known. `control`: "whatif" (`CompositionController`) or
    "paper" (`ReconfigurationController`). `gpu_cost`, `beta`, `lam`, `live_horizon_s` (None:
    no eviction cost) and `congestion_price` (lambda grows with the backlog) are the router's;
    `fetch` forces `FetchingVertumnusRouter` (True) or not. `queue_order`: the order in which
    a worker's queued prefills start (`serving.policy.queue_order`; shortest predicted prefill
    first by default, FCFS for the paper's policy).
    """
    degrees = sorted(set(pool.degrees))
    ctl_cfg = dataclasses.replace(controller_config or ControllerConfig(),
                                  min_degree=degrees[0], max_degree=degrees[-1])
    d = pool.demand
    if d is not None:  # keep a worker able to hold the longest prompt seen
        need = next((c for c in degrees if pool.max_input_len(c) >= d.max_input_len), degrees[-1])
    knobs = dict(beta=beta, lam=lam, live_horizon_s=live_horizon_s,
                 congestion_price=congestion_price, queue_order=queue_order)

    def make_router(fetching: bool, g: str) -> VertumnusRouter:
        if fetching:
            return FetchingVertumnusRouter(pool.kv_bytes_per_token, pool.kv_transfer_gb_per_s,
                                           scaleout_gb_per_s=pool.scaleout_gb_per_s, **knobs)
        return VertumnusRouter(gpu_cost=g, **knobs)

    if d is not None and initial == "replay" and d.requests:
        large = count_compositions(pool.num_gpus, degrees) > EXHAUSTIVE_LIMIT  # (searched)
        options = [] if large else [c for c in compositions(pool.num_gpus, degrees)
                                    if max(c) >= need]
        routers = {"cost": lambda: make_router(False, "worker"),
                   "cost-degree": lambda: make_router(False, "degree"),
                   "fetch": lambda: make_router(True, gpu_cost)}
        if fetch is not None:  # the router is given: choose the composition only
            routers = {k: v for k, v in routers.items() if (k == "fetch") == fetch}
        if large or len(options) > MAX_REPLAYED:  # keep the queueing replay's best few
            _, scores = choose_initial(pool.num_gpus, degrees, d.sample, pool.cost_model.predict,
                                       lam, pool.max_input_len, min_largest_degree=need)
            options = options or [list(c) for c in scores if max(c) >= need]
            options = sorted(options, key=lambda c: scores[tuple(c)])[:MAX_REPLAYED]
        comp, chosen, scores = replay_choice(
            options, routers, d.requests, pool.workers, pool.cost_model, pool.kv_bytes_per_token,
            tag=(beta, lam, pool.num_gpus, pool.kv_blocks_per_gpu, pool.kv_transfer_gb_per_s,
                 live_horizon_s, congestion_price, queue_order), kv_share=d.replay_kv_share)
        fetch = chosen == "fetch"
        gpu_cost = "degree" if chosen == "cost-degree" else gpu_cost
        choice = _ranked("replay", comp, chosen, scores)
    elif d is not None and initial == "whatif" and d.sample:
        comp, scores = choose_initial(pool.num_gpus, degrees, d.sample, pool.cost_model.predict,
                                      lam, pool.max_input_len, min_largest_degree=need)
        rule = _rule(bool(fetch), gpu_cost)
        choice = _ranked("whatif", comp, rule, {(c, rule): (None, v) for c, v in scores.items()})
    elif d is not None:
        comp = initial_composition(pool.num_gpus, degrees, d.rate, d.mean_prefill_seconds,
                                   ctl_cfg.upper, min_largest_degree=need)
        choice = {"method": "paper", "composition": list(comp),
                  "router": _rule(bool(fetch), gpu_cost)}
    else:
        comp = mixed_degrees(pool.num_gpus, degrees)
        choice = {"method": "mixed", "composition": list(comp),
                  "router": _rule(bool(fetch), gpu_cost)}
    setup: list[Callable[[Scheduler], None]] = []
    if controller and control == "whatif":
        cfg = dataclasses.replace(composition_config or CompositionConfig(), lam=lam,
                                  min_degree=degrees[0], max_degree=degrees[-1])
        longest = d.max_input_len if d is not None else 0
        setup.append(CompositionController(cfg, pool.max_input_len, longest).attach)
    elif controller:
        setup.append(ReconfigurationController(ctl_cfg, pool.num_gpus, pool.max_input_len).attach)
    if cache_manager:
        setup.append(PrefixCacheManager(cache_config or CacheManagerConfig(),
                                        pool.kv_transfer_gb_per_s, pool.scaleout_gb_per_s).attach)
    return System(name, pool.workers(comp), make_router(bool(fetch), gpu_cost), setup=setup,
                  make_prefix_index=GlobalPrefixTrie if cache_manager else PrefixIndex,
                  initial_choice=choice)


def _rule(fetching: bool, gpu_cost: str) -> str:
    """The replay's name of a placement rule: "fetch", "cost-degree" or "cost"."""
    return "fetch" if fetching else "cost-degree" if gpu_cost == "degree" else "cost"


def _ranked(method: str, comp: Sequence[int], router: str,
            scores: dict[tuple[tuple[int, ...], str], tuple[int | None, float]]) -> dict:
    """`System.initial_choice` of a replay: how many options it compared, and the chosen one
    followed by the best of the others (fewer failed requests first, then the predicted mean
    TTFT in seconds; ties in the replay's order), `INITIAL_CANDIDATES_KEPT` in all. `failed`
    is None where the replay does not report it (the queueing replay), the prediction None
    where no request of the sample was served (no mean)."""
    chosen = (tuple(comp), router)
    others = sorted((kv for kv in scores.items() if kv[0] != chosen),
                    key=lambda kv: (kv[1][0] or 0, kv[1][1]))
    ranked = ([(chosen, scores[chosen])] if chosen in scores else []) + others
    return {"method": method, "composition": list(comp), "router": router,
            "compared": len(scores),
            "candidates": [{"composition": list(c), "router": r, "failed": f,
                            "predicted_mean_ttft_s": t if math.isfinite(t) else None}
                           for (c, r), (f, t) in ranked[:INITIAL_CANDIDATES_KEPT]]}


MAX_REPLAYED = 16  # compositions the simulated replay tries at most (40 GPUs, {1..8}: 286)


def _paper(name: str, **kw) -> Callable[[PoolConfig], System]:
    """The paper's policy, with `kw` switching this project's changes on one at a time."""
    base = dict(gpu_cost="worker", initial="paper", control="paper", live_horizon_s=None,
                congestion_price=False, queue_order=FCFS)
    return lambda pool: vertumnus_system(pool, name=name, **{**base, **kw})


def _static_threshold(pool: PoolConfig) -> System:
    big, small = max(pool.degrees), min(pool.degrees)
    return System("static-threshold", pool.workers(mixed_degrees(pool.num_gpus, (big, small))),
                  StaticThresholdRouter(threshold_tokens=8192))


def _homogeneous4(name: str, router_factory: Callable[[PoolConfig], Router],
                  parallelism: str = "cp") -> Callable[[PoolConfig], System]:
    def factory(pool: PoolConfig) -> System:
        return System(name, pool.workers(homogeneous_degrees(pool.num_gpus, 4)),
                      router_factory(pool), parallelism=parallelism)
    return factory


register_system("vertumnus", vertumnus_system)
register_system("vertumnus-paper", _paper("vertumnus-paper"))
register_system("vertumnus-paper+replay", _paper("vertumnus-paper+replay", initial="replay"))
register_system("vertumnus-static", lambda pool: vertumnus_system(
    pool, controller=False, cache_manager=False, name="vertumnus-static"))
register_system("vertumnus-nocache", lambda pool: vertumnus_system(
    pool, cache_manager=False, name="vertumnus-nocache"))
register_system("vertumnus-fetch", lambda pool: vertumnus_system(
    pool, fetch=True, name="vertumnus-fetch"))
register_system("vertumnus-fcfs", lambda pool: vertumnus_system(
    pool, queue_order=FCFS, name="vertumnus-fcfs"))
register_system("vertumnus-gated-sjf", lambda pool: vertumnus_system(
    pool, queue_order=QueueOrder("gated-sjf"), name="vertumnus-gated-sjf"))
register_system("static-threshold", _static_threshold)
register_system("vllm-tp4", _homogeneous4("vllm-tp4", lambda p: VllmPrefixAwareRouter(), "tp"))
register_system("sglang-cp4", _homogeneous4("sglang-cp4", lambda p: SglangCacheAwareRouter()))
register_system("dynamo-cp4", _homogeneous4("dynamo-cp4", lambda p: DynamoKvRouter()))
register_system("mooncake-cp4", _homogeneous4("mooncake-cp4", lambda p: MooncakeConductorRouter(
    p.kv_bytes_per_token, p.kv_transfer_gb_per_s)))


def _from_spec(spec: str, pool: PoolConfig) -> System:
    """Builds a system named `module:attribute` (see `build_system`), the plug-in's code that a
    run calls guarded (`serving.policy.plugins.guard_system`)."""
    obj = import_spec(spec, "system")
    attr = spec.partition(":")[2]
    if inspect.isclass(obj) and callable(getattr(obj, "choose", None)):
        router = construct_router(spec, "system", obj)
        workers = pool.workers(mixed_degrees(pool.num_gpus, pool.degrees))
        return guard_system(spec, "system", System(spec, workers, router))
    if callable(getattr(obj, "choose", None)):
        raise ValueError(f"system {spec!r}: {attr!r} is a router instance; name its class (a "
                         f"fresh router per run) or a factory(pool) -> System")
    if not callable(obj):
        raise ValueError(f"system {spec!r}: {attr!r} is neither a router class nor a "
                         f"factory(pool) -> System")
    system = call_plugin(spec, "system", f"factory {attr!r}", obj, pool)
    if not isinstance(system, System):
        raise ValueError(f"system {spec!r}: factory {attr!r} returned "
                         f"{type(system).__name__}, not eval.systems.System")
    return guard_system(spec, "system", system)


def build_system(name: str, pool: PoolConfig) -> System:
    """Builds the system called `name` (see the module docstring).

    Names, in order: a registered name (`register_system`); a pattern (`homogeneous-cpN`,
    `leastwork-cpN`); or a plug-in `module:attribute` (e.g. `my_pkg.routers:MyRouter`), whose
    module is imported and whose attribute is either
      * a router class (it has a `choose` method): built with no arguments and run on the mixed
        composition `mixed_degrees(pool.num_gpus, pool.degrees)`, named `name`; or
      * a system factory: called as `factory(pool)`, it must return a `System`.
    A plug-in's router, hooks and setup raise `PluginError`, naming the spec, when they fail
    during a run (`serving.policy.plugins.guard_system`).

    Raises:
      ValueError: an unknown name (the message lists the known ones), a plug-in that cannot be
        imported, is neither form or raises anything but a plain ValueError while imported,
        built or called (a `PluginError` naming the spec and the exception's type, message and
        line: `serving.policy.plugins.call_plugin`), or a composition that does not fit.
    """
    if name in _REGISTRY:
        return _REGISTRY[name](pool)
    for pattern, factory in _PATTERNS:
        m = pattern.fullmatch(name)
        if m:
            return factory(m, pool)
    if ":" in name:
        return _from_spec(name, pool)
    known = sorted(_REGISTRY) + ["homogeneous-cpN", "leastwork-cpN (N a power of two)",
                                 "module:RouterClass", "module:system_factory"]
    raise ValueError(f"unknown system {name!r}; known: {', '.join(known)}")


def expand_systems(names: Sequence[str], degrees: Sequence[int]) -> list[str]:
    """Expands the shorthand `homogeneous` into `homogeneous-cpN` for each N in `degrees`."""
    out = []
    for n in names:
        if n == "homogeneous":
            out.extend(f"homogeneous-cp{c}" for c in degrees)
        else:
            out.append(n)
    return out
