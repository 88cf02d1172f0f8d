"""One comparison: a workload replayed through several systems at several request rates.

The library behind `eval.replay`, importable for research:

    cfg = ReplayConfig(num_gpus=40, degrees=(2, 4), systems=("homogeneous", "vllm-tp4"))
    results, env = run_sweep(requests, "toolagent", cfg)

Ground truth and router estimate are kept apart (DESIGN.md): the simulator charges prefill time
from a profile table (`GroundTruthProfile`, with seeded lognormal noise), the routers predict it
with the cost model fitted to the same table (`PrefillCostModel`), which is exact only up to its
fit error and knows nothing of the noise.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Sequence

from eval.sim.ground_truth import GroundTruthProfile
from eval.metrics import summarize
from eval.sim.simulator import SimConfig, intern_block_hashes, simulate
from eval.slo import SloSpec, assign_slos
from eval.systems import Demand, PoolConfig, System, build_system
from eval.offered_load import OpenLoad, offered_load
from eval.replay_config import ReplayConfig
from eval.traces.sessions import SessionWorkload
from eval.traces.workloads import prefix_hit_tokens, scale_to_rate
from serving.policy.cost_model import PrefillCostModel
from serving.policy.profiles import (FULL_COVERAGE_FRACTION, GPUS, MODELS, ProfileTable,
                                     coverage_gaps, generate_profile, read_profile_csv)
from serving.policy.request import Request, RequestRecord
from serving.policy.scheduler import Scheduler


# Finite per-worker caches keep part of what an unbounded shared cache would reuse (measured:
# about 0.7 of it on the conversation trace, 0.5 on the synthetic one, nearly all on
# Tool-Agent); 0.75 is the assumption of `ReplayEnv.demand`, not fitted per workload.
SHARED_HITS_KEPT = 0.75


@dataclasses.dataclass
class ReplayEnv:
    """The profiles, cost models, pools and SLO reference derived from a `ReplayConfig`.

    `table`, `cost_model` and `pool` are the context-parallel ("cp") ones; `pools` holds one
    `PoolConfig` per parallelism the run uses ("cp" always, "tp" when a TP system takes part),
    each with the cost model fitted to that parallelism's profile, and `tables` the profiles.
    A `profile_csv` replaces the analytic profile for "cp" only; "tp" is always analytic
    (`serving.policy.profiles.generate_profile(..., parallelism="tp")`).
    """

    table: ProfileTable
    cost_model: PrefillCostModel
    pool: PoolConfig
    sim: SimConfig
    reference_degree: int
    block_size: int
    tables: dict[str, ProfileTable] = dataclasses.field(default_factory=dict)
    pools: dict[str, PoolConfig] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tables.setdefault("cp", self.table)
        self.pools.setdefault("cp", self.pool)

    @classmethod
    def build(cls, cfg: ReplayConfig, block_size: int, all_degrees: Iterable[int],
              tp_degrees: Iterable[int] = ()) -> ReplayEnv:
        """Builds the environment for a run whose CP systems use `all_degrees` and whose TP
        systems (if any) use `tp_degrees`.

        KV blocks per GPU, when derived from HBM: `(hbm_gb * 1e9 * hbm_utilization - W / T) *
        min(T, kv_heads) / T / (kv_bytes_per_token * block_size)` with W the weight bytes and T
        the TP ways (T = 1 for CP: every device holds a full weight replica; TP shards weights
        and KV heads T ways, KV heads replicated beyond kv_heads); for "tp" at the smallest TP
        degree of the run (the tightest).

        Raises:
          ValueError: the model's weights leave no room for KV on the GPU, the profile lacks
            a degree the systems use, or no degree is given.
        """
        degrees = sorted(set(all_degrees))
        tp = sorted(set(tp_degrees))
        if not degrees:
            raise ValueError("all_degrees must name at least one CP degree")
        model = MODELS[cfg.model]
        if cfg.profile_csv:
            table = read_profile_csv(cfg.profile_csv)
            gaps = coverage_gaps(table)
            if gaps:
                shown = ", ".join(f"C={c} L={L} (to {f:.2%})" for c, L, f in gaps[:8])
                warnings.warn(
                    f"{cfg.profile_csv}: {len(gaps)} profile rows stop below a "
                    f"{FULL_COVERAGE_FRACTION:.0%} cached fraction: {shown}"
                    f"{', ...' if len(gaps) > 8 else ''}; prefills with more of the prompt cached "
                    f"are charged those rows' largest-fraction times (an over-charge; measure up "
                    f"to 0.99 with vertumnus_jax.profile --cached_fractions=0,0.5,0.9,0.99)",
                    stacklevel=2)
        else:  # the run's --degrees too: the SLO reference is the largest of them
            degrees = sorted(set(degrees) | set(cfg.degrees))
            table = generate_profile(cfg.gpu, cfg.model, degrees=tuple(degrees))
        missing = [c for c in degrees if c not in table.degrees]
        if missing:
            raise ValueError(f"profile has no rows for CP degrees {missing} (it has {list(table.degrees)})")
        tables = {"cp": table}
        if tp:
            tables["tp"] = generate_profile(cfg.gpu, cfg.model, degrees=tuple(tp),
                                            parallelism="tp")
        pools = {}
        for par, tab in tables.items():
            kv_blocks = cfg.kv_blocks_per_gpu or _kv_blocks_per_gpu(
                cfg, block_size, tp[0] if par == "tp" else 1)
            truth = GroundTruthProfile(tab)

            def max_input_len(c: int, truth=truth, kv_blocks=kv_blocks) -> int:
                return min(truth.max_input_len(c), kv_blocks * c * block_size)

            pools[par] = PoolConfig(
                cfg.num_gpus, kv_blocks, max_input_len, PrefillCostModel.fit(tab),
                tuple(cfg.degrees), model.kv_bytes_per_token, cfg.sim.replication_gb_per_s, par,
                scaleout_gb_per_s=cfg.sim.scaleout_gb_per_s)
        sim = dataclasses.replace(cfg.sim, kv_bytes_per_token=model.kv_bytes_per_token)
        # The SLO reference is the run's largest --degrees entry (when the profile has it), so
        # SLOs do not depend on which systems a run lists.
        listed = [c for c in cfg.degrees if c in table.degrees]
        reference = max(listed) if listed else max(degrees)
        return cls(table, pools["cp"].cost_model, pools["cp"], sim, reference, block_size,
                   tables, pools)

    def cost_model_for(self, parallelism: str = "cp") -> PrefillCostModel:
        """The router's fitted cost model for `parallelism`.

        Raises:
          ValueError: the run has no profile for that parallelism.
        """
        return self._pool_for(parallelism).cost_model

    def _pool_for(self, parallelism: str) -> PoolConfig:
        try:
            return self.pools[parallelism]
        except KeyError:
            raise ValueError(f"this run has no {parallelism!r} profile (it has "
                             f"{sorted(self.pools)}); build the env with its degrees") from None

    def build_system(self, name: str, demand=None) -> System:
        """`eval.systems.build_system` on the pool of the system's parallelism.

        Args:
          name: the system.
          demand: `PoolConfig.demand` for systems sized from demand, or None.

        Raises:
          ValueError: as `build_system`, or a parallelism this env has no profile for.
        """
        system = build_system(name, dataclasses.replace(self.pool, demand=demand))
        if system.parallelism != "cp":
            system = build_system(name, dataclasses.replace(
                self._pool_for(system.parallelism), demand=demand))
        return system

    def demand(self, requests: Sequence[Request], rate: float, sample_size: int = 1000,
               sample: Sequence[Request] | None = None) -> Demand:
        """`PoolConfig.demand` of a workload at `rate` (req/s): the cost model's mean prefill
        time per degree, with 3/4 of each request's prefix hit as an unbounded shared cache
        would give it (see the comment below), and a sample for what-if replays: `sample` when
        given (timed requests, e.g. `SessionLoad.demand_sample` for closed-loop sessions, whose
        templates have no times; its hits are counted within it), else the workload's first
        `sample_size` requests on its own arrival times scaled to `rate`.

        Raises:
          ValueError: no requests, or sample_size not an integer >= 1.
        """
        if not requests:
            raise ValueError("demand needs at least one request")
        if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1:
            raise ValueError(f"sample_size must be an integer >= 1, got {sample_size!r}")
        hits = prefix_hit_tokens(requests) * SHARED_HITS_KEPT
        memo: dict[int, float] = {}

        def mean_seconds(c: int) -> float:
            if c not in memo:
                memo[c] = sum(self.cost_model.predict(c, r.input_len, int(h))
                              for r, h in zip(requests, hits)) / len(requests)
            return memo[c]

        if sample is None:
            n = min(sample_size, len(requests))
            picked = scale_to_rate(requests[:n], rate) if n > 1 else list(requests[:1])
            picked_hits = hits[:n]
        else:
            picked = sorted(sample, key=lambda r: r.arrival_time)
            picked_hits = prefix_hit_tokens(picked) * SHARED_HITS_KEPT if picked else []
        t0 = picked[0].arrival_time if picked else 0.0
        timed = tuple((r.arrival_time - t0, r.input_len, int(h))
                      for r, h in zip(picked, picked_hits))
        return Demand(rate, mean_seconds, max(r.input_len for r in requests), timed,
                      tuple(picked))

    def ground_truth(self, cfg: ReplayConfig, parallelism: str = "cp") -> GroundTruthProfile:
        """A fresh ground-truth clock (same seed: every system draws the same noise stream) from
        the profile of `parallelism` (the CP one's table parsed once: 3 % of a simulation).

        Raises:
          ValueError: the run has no profile for that parallelism.
        """
        if parallelism not in self.tables:
            raise ValueError(f"this run has no {parallelism!r} profile (it has "
                             f"{sorted(self.tables)})")
        truth = self.exact_truth if parallelism == "cp" else GroundTruthProfile(self.tables[parallelism])
        return truth.with_noise(cfg.noise_sigma, cfg.seed)

    @functools.cached_property
    def exact_truth(self) -> GroundTruthProfile:
        """The noise-free ground truth of the CP profile (built once; for SLOs and rates)."""
        return GroundTruthProfile(self.table)

    def isolated_ttft(self, input_len: int) -> float:
        """Cold prefill alone on the reference degree, plus KV transfer and first token (s)."""
        truth = self.exact_truth
        c = self.reference_degree
        n = min(input_len, truth.max_input_len(c))
        return truth.seconds(c, n, 0) + self.sim.after_prefill_seconds(input_len)

    def capacity_rate(self, requests: Sequence[Request], min_degree: int) -> float:
        """Req/s at which `num_gpus` are exactly busy running every request cold at `min_degree`."""
        return OpenLoad(requests).capacity_rate(
            functools.partial(self.gpu_seconds, min_degree=min_degree), self.pool.num_gpus)

    def gpu_seconds(self, request: Request, cached_len: int, min_degree: int) -> float:
        """GPU-seconds of `request` at `min_degree` with `cached_len` tokens cached (noise-free
        ground truth; prompts past the profile's longest charged at that length)."""
        truth = self.exact_truth
        n = min(request.input_len, truth.max_input_len(min_degree))
        return min_degree * truth.seconds(min_degree, n, min(cached_len, n - 1))


def _kv_blocks_per_gpu(cfg: ReplayConfig, block_size: int, tp_ways: int) -> int:
    model = MODELS[cfg.model]
    free = GPUS[cfg.gpu].hbm_gb * 1e9 * cfg.hbm_utilization - model.weight_bytes / tp_ways
    # A worker's tokens: free * min(T, kv_heads) / kv_bytes_per_token; per GPU of the worker
    # (capacity = kv_blocks_per_gpu * T blocks) that is 1/T of it.
    token_bytes = model.kv_bytes_per_token * tp_ways / min(tp_ways, model.num_kv_heads)
    kv_blocks = int(free // (token_bytes * block_size)) if free > 0 else 0
    if kv_blocks < 1:
        raise ValueError(
            f"model={cfg.model} ({model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV "
            f"room on gpu={cfg.gpu} ({GPUS[cfg.gpu].hbm_gb} GB); set kv_blocks_per_gpu")
    return kv_blocks


def run_parallel_degrees(cfg: ReplayConfig) -> dict[str, set[int]]:
    """Degrees used by the initial compositions of `cfg`'s systems, per parallelism.

    Raises:
      ValueError: an unknown system name or a composition that does not fit `num_gpus`.
    """
    probe = PoolConfig(cfg.num_gpus, 1, lambda c: 1, None, tuple(cfg.degrees))
    out: dict[str, set[int]] = {}
    for n in cfg.system_names:
        system = build_system(n, probe)
        out.setdefault(system.parallelism, set()).update(system.composition)
    return out


def run_degrees(cfg: ReplayConfig) -> set[int]:
    """Degrees used by the initial compositions of `cfg`'s systems (all parallelisms).

    Raises:
      ValueError: an unknown system name or a composition that does not fit `num_gpus`.
    """
    return set().union(*run_parallel_degrees(cfg).values())


def simulate_system(env: ReplayEnv, cfg: ReplayConfig, system: System,
                    workload: Sequence[Request], arrivals=None
                    ) -> tuple[list[RequestRecord], Scheduler]:
    """Simulates one built system on a workload with the env's profile of its parallelism
    (`arrivals`: a closed-loop source, `eval.sim.simulator.ArrivalSource`, or None).

    Returns:
      `(records, scheduler)`: one record per request, and the run's scheduler (its logs:
      `reconfig.log`, `copies.log`, `copies.reclaim_log`, `composition`).
    """
    par = system.parallelism
    handle: list[Scheduler] = []
    records = simulate(workload, system.workers, env.cost_model_for(par), system.router,
                       env.ground_truth(cfg, par).seconds, env.sim, system.tick_hooks,
                       setup=[*system.setup, handle.append], prefix_index=system.make_prefix_index(),
                       arrivals=arrivals)
    return records, handle[0]


def host_results(sched: Scheduler, sim: SimConfig, num_gpus: int) -> dict:
    """Result keys of a run with hosts (none for a one-host run without failures, whose
    results stay as they were): `gpus_per_host`, `num_hosts`, `scaleout_gb_per_s`,
    `host_events` (each loss and return: `serving.policy.membership.Membership.log`),
    `requests_rerouted` and `requests_failed_by_host_loss` (running + unplaceable),
    `failed_copies` (copies given up as a worker of theirs was lost)."""
    if not (sim.gpus_per_host or sim.host_failures):
        return {}
    log = sched.membership.log
    lost = [e for e in log if e["kind"] == "lost"]
    return {"gpus_per_host": sim.gpus_per_host, "scaleout_gb_per_s": sim.scaleout_gb_per_s,
            "num_hosts": num_gpus // sim.gpus_per_host if sim.gpus_per_host else 1,
            "host_events": log, "requests_rerouted": sum(e["rerouted"] for e in lost),
            "requests_failed_by_host_loss": sum(e["failed_running"] + e["failed_unplaceable"]
                                                for e in lost),
            "failed_copies": len(sched.copies.failed)}


def run_sweep(requests: Sequence[Request] | SessionWorkload, trace_name: str, cfg: ReplayConfig,
              progress: bool = False,
              on_records: Callable[[str, float, list[RequestRecord]], None] | None = None,
              ) -> tuple[list[dict], ReplayEnv]:
    """Replays `requests` through every system of `cfg` at every rate.

    Each system is simulated with the ground truth and the router cost model of its own
    parallelism (`System.parallelism`: TP systems are charged TP prefill times). Capacity rate
    and SLO use the CP profile (TP's when no system is CP): one set of rates and SLOs per run.

    A request trace is offered open-loop (re-timed to each rate); agent sessions closed-loop,
    rates and load factors then counting sessions/s (`eval.offered_load`). The replayed initial
    choice's demand sample is the run's first requests (of a trace at most half of them).

    Args:
      requests: the workload: requests sorted by arrival (its own rate is replaced by each
        swept rate), or a `SessionWorkload`.
      trace_name: a label written into each result.
      cfg: the comparison.
      progress: show a tqdm bar over (system, rate) runs.
      on_records: called after each run as `on_records(system_name, rate, records)`.

    Returns:
      `(results, env)`: one dict per (system, rate) — `eval.metrics.summarize` keys plus
      `system`, `trace`, `request_rate`, `load_factor`, `composition`, `initial_choice`
      (`System.initial_choice`: how that composition was chosen), and the run's settings.

    Raises:
      ValueError: an empty workload, or any invalid setting (see `ReplayConfig`).
    """
    load = offered_load(requests, cfg)
    if not load.requests:
        raise ValueError("the workload has no requests")
    by_par = run_parallel_degrees(cfg)
    tp = by_par.get("tp", set())
    degrees = by_par.get("cp") or tp
    env = ReplayEnv.build(cfg, load.requests[0].block_size, degrees, tp)
    # Dense block ids (same equalities and order, cheaper to hash): see `intern_block_hashes`.
    with_slo = load.with_requests(intern_block_hashes(
        assign_slos(load.requests, SloSpec.parse(cfg.slo), env.isolated_ttft)))
    if cfg.rates:
        rates = [(r, None) for r in cfg.rates]
    else:
        cap = load.capacity_rate(functools.partial(env.gpu_seconds, min_degree=min(degrees)),
                                 cfg.num_gpus)
        rates = [(f * cap, f) for f in cfg.load_factors]
    runs = [(name, rate, factor) for name in cfg.system_names for rate, factor in rates]
    if progress:
        from tqdm import tqdm
        runs = tqdm(runs, desc=f"replay {trace_name}", unit="run")
    results = []
    demands = {}
    for name, rate, factor in runs:
        if rate not in demands:
            if isinstance(load, OpenLoad):
                demands[rate] = env.demand(load.requests, rate,
                                           cfg.open_loop_sample_size(len(load.requests)))
            else:  # closed-loop sessions: the run's first requests, at the run's busiest KV pressure
                sample = load.demand_sample(rate, cfg.session_sample_size)
                demands[rate] = dataclasses.replace(
                    env.demand(load.requests, load.request_rate(rate), sample=sample),
                    replay_kv_share=load.replay_kv_share(sample))
        system = env.build_system(name, demands[rate])
        par = system.parallelism
        records, sched = simulate_system(env, cfg, system, *with_slo.at_rate(rate))
        if on_records is not None:
            on_records(name, rate, records)
        out = summarize(records)
        busy = out["gpu_seconds"] / (cfg.num_gpus * out["duration_s"]) if out["duration_s"] else None
        out.update({
            "gpu_busy_fraction": busy,
            "system": name, "trace": trace_name, **load.describe(rate), "load_factor": factor,
            "composition": system.composition, "initial_choice": system.initial_choice,
            "parallelism": par, "num_gpus": cfg.num_gpus,
            "router": type(system.router).__name__,
            "gpu": cfg.gpu, "model": cfg.model,
            "profile": (cfg.profile_csv or "analytic") if par == "cp" else f"analytic-{par}",
            "slo": cfg.slo, "noise_sigma": cfg.noise_sigma, "seed": cfg.seed,
            "kv_blocks_per_gpu": env.pools[par].kv_blocks_per_gpu, "block_size": env.block_size,
            "final_composition": sched.composition,
            "reconfigurations": [{k: log[k] for k in ("kind", "started", "finished", "composition")}
                                 for log in sched.reconfig.log],
            "replications": len(sched.copies.log),
            "replicated_blocks": sum(log["blocks"] for log in sched.copies.log),
            "reclamations": len(sched.copies.reclaim_log),
        })
        out.update(host_results(sched, env.sim, cfg.num_gpus))
        results.append(out)
    return results, env
