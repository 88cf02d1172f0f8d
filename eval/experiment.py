"""One comparison: a workload replayed through several systems at several request rates.

The library behind `eval.replay`, importable for research:

    cfg = ReplayConfig(num_gpus=40, degrees=(2, 4))
    env = ReplayEnv.build(cfg, block_size=512)
    results = run_sweep(requests, "toolagent", cfg, env)

Ground truth and router estimate are kept apart (DESIGN.md): the simulator charges prefill time
from a profile table (`GroundTruthProfile`, with seeded lognormal noise), the routers predict it
with the cost model fitted to the same table (`PrefillCostModel`), which is exact only up to its
fit error and knows nothing of the noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from eval.ground_truth import GroundTruthProfile
from eval.metrics import summarize
from eval.simulator import SimConfig, simulate
from eval.slo import SloSpec, assign_slos
from eval.systems import PoolConfig, build_system, expand_systems
from eval.workloads import scale_to_rate
from serving.cost_model import PrefillCostModel
from serving.profiles import GPUS, MODELS, ProfileTable, generate_profile, read_profile_csv
from serving.request import Request


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """Everything that defines one comparison (the flags of `eval.replay`).

    Attributes:
      gpu, model: names in `serving.profiles.GPUS` / `MODELS` for the analytic profile and the
        KV sizes.
      profile_csv: a measured profile (columns cp,input_len,cached_len,seconds) used instead of
        the analytic one; None for analytic.
      num_gpus: GPU budget of every system.
      degrees: CP degrees for the `homogeneous` shorthand (one system per degree).
      systems: system names (`eval.systems.build_system`).
      rates: request rates to sweep, req/s; when empty, `load_factors` set them.
      load_factors: rate = factor * capacity rate, where the capacity rate is the rate at which
        the GPU budget is exactly busy if every request ran cold at the smallest degree of the
        run: `num_gpus / mean_i(C_min * T(C_min, L_i, 0))`. Prefix hits make the real load lower.
      slo: SLO spec (`eval.slo.SloSpec.parse`).
      noise_sigma: std-dev of the lognormal noise on ground-truth prefill times (0 = none).
      seed: seeds the noise.
      kv_blocks_per_gpu: KV blocks per device; 0 derives it from HBM: `(hbm_gb * 1e9 *
        hbm_utilization - weight_bytes) / (kv_bytes_per_token * block_size)` (each device holds a
        full weight replica, DESIGN.md).
      hbm_utilization: share of HBM usable by weights and KV.
      sim: `SimConfig` (KV transfer bandwidth, first-token time, tick); its kv_bytes_per_token is
        filled from the model.
    """

    gpu: str = "h20"
    model: str = "qwen3-30b-a3b"
    profile_csv: str | None = None
    num_gpus: int = 40
    degrees: tuple[int, ...] = (2, 4)
    systems: tuple[str, ...] = ("homogeneous",)
    rates: tuple[float, ...] = ()
    load_factors: tuple[float, ...] = (0.6, 0.9, 1.2)
    slo: str = "scale:5"
    noise_sigma: float = 0.05
    seed: int = 0
    kv_blocks_per_gpu: int = 0
    hbm_utilization: float = 0.9
    sim: SimConfig = SimConfig()

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"gpu={self.gpu!r} is not known; choose from {sorted(GPUS)}")
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is not known; choose from {sorted(MODELS)}")
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must all be > 0 req/s, got {list(self.rates)}")
        if not self.rates and (not self.load_factors or any(f <= 0 for f in self.load_factors)):
            raise ValueError(f"load_factors must be non-empty and > 0, got {list(self.load_factors)}")
        if self.noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {self.noise_sigma}")
        if self.kv_blocks_per_gpu < 0:
            raise ValueError(f"kv_blocks_per_gpu must be >= 0 (0 = derive), got {self.kv_blocks_per_gpu}")
        if not 0 < self.hbm_utilization <= 1:
            raise ValueError(f"hbm_utilization must be in (0, 1], got {self.hbm_utilization}")
        SloSpec.parse(self.slo)

    @property
    def system_names(self) -> list[str]:
        return expand_systems(self.systems, self.degrees)


@dataclasses.dataclass
class ReplayEnv:
    """The profile, cost model, pool and SLO reference derived from a `ReplayConfig`."""

    table: ProfileTable
    cost_model: PrefillCostModel
    pool: PoolConfig
    sim: SimConfig
    reference_degree: int
    block_size: int

    @classmethod
    def build(cls, cfg: ReplayConfig, block_size: int, all_degrees: Iterable[int]) -> ReplayEnv:
        """Builds the environment for a run whose systems use `all_degrees`.

        Raises:
          ValueError: the model's weights leave no room for KV on the GPU, or the profile lacks
            a degree the systems use.
        """
        degrees = sorted(set(all_degrees))
        model = MODELS[cfg.model]
        if cfg.profile_csv:
            table = read_profile_csv(cfg.profile_csv)
        else:
            table = generate_profile(cfg.gpu, cfg.model, degrees=tuple(degrees))
        missing = [c for c in degrees if c not in table.degrees]
        if missing:
            raise ValueError(f"profile has no rows for CP degrees {missing} (it has {list(table.degrees)})")
        kv_blocks = cfg.kv_blocks_per_gpu
        if kv_blocks == 0:
            free = GPUS[cfg.gpu].hbm_gb * 1e9 * cfg.hbm_utilization - model.weight_bytes
            kv_blocks = int(free // (model.kv_bytes_per_token * block_size))
            if kv_blocks < 1:
                raise ValueError(
                    f"model={cfg.model} ({model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV "
                    f"room on gpu={cfg.gpu} ({GPUS[cfg.gpu].hbm_gb} GB); set kv_blocks_per_gpu")
        truth = GroundTruthProfile(table)
        cost_model = PrefillCostModel.fit(table)

        def max_input_len(c: int) -> int:
            return min(truth.max_input_len(c), kv_blocks * c * block_size)

        pool = PoolConfig(cfg.num_gpus, kv_blocks, max_input_len, cost_model, tuple(cfg.degrees))
        sim = dataclasses.replace(cfg.sim, kv_bytes_per_token=model.kv_bytes_per_token)
        return cls(table, cost_model, pool, sim, max(degrees), block_size)

    def ground_truth(self, cfg: ReplayConfig) -> GroundTruthProfile:
        """A fresh ground-truth clock (same seed, so every system draws the same noise stream)."""
        return GroundTruthProfile(self.table, noise_sigma=cfg.noise_sigma, seed=cfg.seed)

    def isolated_ttft(self, input_len: int) -> float:
        """Cold prefill alone on the reference degree, plus KV transfer and first token (s)."""
        truth = GroundTruthProfile(self.table)
        c = self.reference_degree
        n = min(input_len, truth.max_input_len(c))
        return truth.seconds(c, n, 0) + self.sim.after_prefill_seconds(input_len)

    def capacity_rate(self, requests: Sequence[Request], min_degree: int) -> float:
        """Req/s at which `num_gpus` are exactly busy running every request cold at `min_degree`."""
        truth = GroundTruthProfile(self.table)
        cap = truth.max_input_len(min_degree)
        gpu_s = [min_degree * truth.seconds(min_degree, min(r.input_len, cap), 0) for r in requests]
        return self.pool.num_gpus * len(gpu_s) / sum(gpu_s)


def run_degrees(cfg: ReplayConfig) -> set[int]:
    """CP degrees used by the initial compositions of `cfg`'s systems.

    Raises:
      ValueError: an unknown system name or a composition that does not fit `num_gpus`.
    """
    probe = PoolConfig(cfg.num_gpus, 1, lambda c: 1, None, tuple(cfg.degrees))
    return {c for n in cfg.system_names for c in build_system(n, probe).composition}


def run_sweep(requests: Sequence[Request], trace_name: str, cfg: ReplayConfig,
              progress: bool = False) -> tuple[list[dict], ReplayEnv]:
    """Replays `requests` through every system of `cfg` at every rate.

    Args:
      requests: the workload, sorted by arrival (its own rate is replaced by each swept rate).
      trace_name: a label written into each result.
      cfg: the comparison.
      progress: show a tqdm bar over (system, rate) runs.

    Returns:
      `(results, env)`: one dict per (system, rate) — `eval.metrics.summarize` keys plus
      `system`, `trace`, `request_rate`, `load_factor`, `composition`, and the run's settings.

    Raises:
      ValueError: an empty workload, or any invalid setting (see `ReplayConfig`).
    """
    if not requests:
        raise ValueError("the workload has no requests")
    degrees = run_degrees(cfg)
    env = ReplayEnv.build(cfg, requests[0].block_size, degrees)
    with_slo = assign_slos(requests, SloSpec.parse(cfg.slo), env.isolated_ttft)
    if cfg.rates:
        rates = [(r, None) for r in cfg.rates]
    else:
        cap = env.capacity_rate(requests, min(degrees))
        rates = [(f * cap, f) for f in cfg.load_factors]
    runs = [(name, rate, factor) for name in cfg.system_names for rate, factor in rates]
    if progress:
        from tqdm import tqdm
        runs = tqdm(runs, desc=f"replay {trace_name}", unit="run")
    results = []
    for name, rate, factor in runs:
        system = build_system(name, env.pool)
        workload = scale_to_rate(with_slo, rate)
        records = simulate(workload, system.workers, env.cost_model, system.router,
                           env.ground_truth(cfg).seconds, env.sim, system.tick_hooks)
        out = summarize(records)
        out.update({
            "system": name, "trace": trace_name, "request_rate": rate, "load_factor": factor,
            "composition": system.composition, "num_gpus": cfg.num_gpus, "gpu": cfg.gpu,
            "model": cfg.model, "profile": cfg.profile_csv or "analytic", "slo": cfg.slo,
            "noise_sigma": cfg.noise_sigma, "seed": cfg.seed,
            "kv_blocks_per_gpu": env.pool.kv_blocks_per_gpu, "block_size": env.block_size,
        })
        results.append(out)
    return results, env
