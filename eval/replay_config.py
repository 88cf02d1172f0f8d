"""`ReplayConfig`: everything that defines one comparison (the flags of `eval.replay`).

Used by `eval.experiment` (and re-exported there).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from eval.sim.simulator import SimConfig
from eval.slo import SloSpec
from eval.systems import expand_systems
from serving.policy.profiles import GPUS, MODELS


# The demand sample of the replayed initial choice (`ReplayConfig.sample_size`): at least 4,000
# requests (the comparison's 40 GPUs and any pool up to 160), 25 per GPU beyond.
MIN_SAMPLE, SAMPLE_PER_GPU = 4000, 25
# Closed-loop sessions' sample (`ReplayConfig.session_sample_size`), as before item 14.
MIN_SESSION_SAMPLE = 1000

@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """Everything that defines one comparison (the flags of `eval.replay`).

    Attributes:
      gpu, model: names in `serving.policy.profiles.GPUS` / `MODELS` for the analytic profile and the
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
      sim: `SimConfig` (KV transfer bandwidth, first-token time, tick, hosts: `gpus_per_host`,
        `scaleout_gb_per_s`, `host_failures`); its kv_bytes_per_token is filled from the model.
      tpot_ms: closed-loop sessions only: decode milliseconds per output token, so a response
        ends `output_len x tpot_ms` after its first token. 30 ms: a decode pool serving a
        Qwen3-30B-A3B-class model at moderate batch runs at about 20-50 ms per output token
        (vLLM's and SGLang's published H100/H20 decode benchmarks), and chat TPOT SLOs sit at
        50-100 ms (DistServe, Mooncake); agent outputs are short (median about 150 tokens), so
        think times, not decode, dominate a session's pace.
      session_window_s: closed-loop sessions only: session instances start during this many
        seconds (`eval.traces.closed_loop.session_starts`). One hour: about the median
        session's length with think times capped, so the pool spends most of the run loaded.
      max_think_time_s: closed-loop sessions only: think times are capped here, as the source
        replayer's `--max-delay` (60 s, its default): a user away longer starts a new visit.
    """

    gpu: str = "h20"
    model: str = "qwen3-30b-a3b"
    profile_csv: str | None = None
    num_gpus: int = 40
    degrees: tuple[int, ...] = (2, 4)
    systems: tuple[str, ...] = ("homogeneous",)
    rates: tuple[float, ...] = ()
    load_factors: tuple[float, ...] = (0.8, 1.2, 1.6)
    slo: str = "scale:5"
    noise_sigma: float = 0.05
    seed: int = 0
    kv_blocks_per_gpu: int = 0
    hbm_utilization: float = 0.9
    sim: SimConfig = SimConfig()
    tpot_ms: float = 30.0
    session_window_s: float = 3600.0
    max_think_time_s: float = 60.0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"gpu={self.gpu!r} is not known; choose from {sorted(GPUS)}")
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} is not known; choose from {sorted(MODELS)}")
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if any(not (math.isfinite(r) and r > 0) for r in self.rates):
            raise ValueError(f"rates must all be > 0 req/s, got {list(self.rates)}")
        if not self.rates and (not self.load_factors or any(
                not (math.isfinite(f) and f > 0) for f in self.load_factors)):
            raise ValueError(f"load_factors must be non-empty and > 0, got {list(self.load_factors)}")
        if self.noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {self.noise_sigma}")
        if self.kv_blocks_per_gpu < 0:
            raise ValueError(f"kv_blocks_per_gpu must be >= 0 (0 = derive), got {self.kv_blocks_per_gpu}")
        if not (math.isfinite(self.session_window_s) and self.session_window_s > 0):
            raise ValueError(f"session_window_s must be a finite number > 0 s, got "
                             f"{self.session_window_s}")
        if not (math.isfinite(self.max_think_time_s) and self.max_think_time_s >= 0):
            raise ValueError(f"max_think_time_s must be a finite number >= 0 s, got "
                             f"{self.max_think_time_s}")
        if not (math.isfinite(self.tpot_ms) and self.tpot_ms >= 0):
            raise ValueError(f"tpot_ms must be a finite number >= 0 ms, got {self.tpot_ms}")
        if not 0 < self.hbm_utilization <= 1:
            raise ValueError(f"hbm_utilization must be in (0, 1], got {self.hbm_utilization}")
        SloSpec.parse(self.slo)
        self._check_hosts()

    def _check_hosts(self) -> None:
        """Hosts of `sim.gpus_per_host` GPUs must tile the pool and hold every CP degree of
        `degrees` whole (a worker never spans hosts); failed hosts must exist.

        Raises:
          ValueError: naming the flag (`--gpus_per_host`, `--degrees`, `--fail_host`).
        """
        m = self.sim.gpus_per_host
        if m and self.num_gpus % m:
            raise ValueError(f"--gpus_per_host={m} must divide --num_gpus={self.num_gpus} "
                             "(hosts of equal size)")
        spanning = [c for c in self.degrees if m and (c > m or m % c)]
        if spanning:
            raise ValueError(f"--degrees {spanning} would make workers span hosts of "
                             f"--gpus_per_host={m} GPUs: a CP degree must divide it")
        hosts = self.num_gpus // m if m else 1
        bad = [f[0] for f in self.sim.host_failures if f[0] >= hosts]
        if bad:
            raise ValueError(f"--fail_host: host(s) {bad} do not exist; the pool has hosts "
                             f"0..{hosts - 1} (--num_gpus / --gpus_per_host)")

    @property
    def sample_size(self) -> int:
        """Requests in the demand sample the replayed initial choice simulates
        (`ReplayEnv.demand`): `SAMPLE_PER_GPU` per GPU, at least `MIN_SAMPLE`. The sample is
        the trace's first requests, so it must outlast the trace's warm-up: on the tool-agent
        generator (seed 2, Qwen3-32B at 2.0) 1,000 requests are two minutes of session starts,
        before contexts grow and caches fill, and the replay ranked five CP-8 first (+7.3 %
        against `homogeneous-cp4` run), 4,000 ten CP-4 (-17.9 %). And it judges queueing on
        each worker, so a large pool needs as many requests per worker: with 1,000 on 80 GPUs
        it ranked twenty CP-4 first on bursty short prompts (+4.5 %), with 2,000 a CP-4/CP-2
        mix (-5.1 %). Both found on those cells (eval/RESULTS.md: item 14; "Other pool
        sizes"). A sweep of a request trace takes at most half of its requests (`run_sweep`):
        the replay never sees the whole run it is judged on. Closed-loop sessions use
        `session_sample_size`."""
        return max(MIN_SAMPLE, SAMPLE_PER_GPU * self.num_gpus)

    def open_loop_sample_size(self, run_requests: int) -> int:
        """Requests in the demand sample of an open-loop run of `run_requests` requests:
        `sample_size`, at most half of the run (and at least 1), so the replay never sees the
        whole run it is judged on (but for a run of one request). Every open-loop caller of
        `ReplayEnv.demand` uses it (`run_sweep`, `eval.paper`'s time-varying demand,
        `eval.load_shift`, `eval.bench_sim`).

        Raises:
          ValueError: unless run_requests is an int >= 1.
        """
        if isinstance(run_requests, bool) or not isinstance(run_requests, numbers.Integral) \
                or run_requests < 1:
            raise ValueError(f"run_requests must be an int >= 1, got {run_requests!r}")
        return max(1, min(self.sample_size, int(run_requests) // 2))

    @property
    def session_sample_size(self) -> int:
        """Requests in the demand sample of closed-loop agent sessions (`SessionLoad.
        demand_sample`): `SAMPLE_PER_GPU` per GPU, at least `MIN_SESSION_SAMPLE`. Their sample
        already stands for the run's steady state (each worker's KV cut to the share of the
        busiest working set it holds, eval/RESULTS.md item 9), and at low session rates 4,000
        requests would be the whole run (1,647 requests at 0.1 sessions/s of the comparison)."""
        return max(MIN_SESSION_SAMPLE, SAMPLE_PER_GPU * self.num_gpus)

    @property
    def system_names(self) -> list[str]:
        return expand_systems(self.systems, self.degrees)


def parse_host_failures(values) -> tuple[tuple[int, float, float | None], ...]:
    """`--fail_host` values `H@T` or `H@T:B` as `SimConfig.host_failures` entries.

    Raises:
      ValueError: a value of another form, naming the flag.
    """
    out = []
    for v in values:
        m = re.fullmatch(r"(\d+)@([0-9.eE+-]+)(?::([0-9.eE+-]+))?", v.strip())
        try:
            out.append((int(m.group(1)), float(m.group(2)),
                        float(m.group(3)) if m.group(3) else None))
        except (AttributeError, ValueError):
            raise ValueError(f"--fail_host must be H@T or H@T:B (host, seconds), got {v!r}") from None
    return tuple(out)
