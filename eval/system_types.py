"""What a system of `eval.systems` is made of and from: the workload's `Demand`, the `PoolConfig`
every system of one comparison shares, and the built `System` (workers, router, hooks).

Plain data; `eval.systems` builds systems from them (and re-exports them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from serving.policy.prefix_index import PrefixIndex
from serving.policy.replication import SCALEOUT_GB_PER_S
from serving.policy.request import Request
from serving.policy.router import Router
from serving.policy.scheduler import CostModel, Scheduler
from serving.policy.worker import WorkerSpec, layout_workers


@dataclasses.dataclass(frozen=True)
class Demand:
    """Historical demand of a workload.

    Attributes:
      rate: requests per second.
      mean_prefill_seconds: CP degree -> mean predicted prefill time of a request (seconds).
      max_input_len: the longest prompt seen (tokens).
      sample: requests `(arrival s, input tokens, expected cached tokens)` at `rate`, sorted,
        for what-if replays (`serving.policy.whatif`); empty when unknown.
      requests: the same sample as `Request`s (block hashes included), for simulated what-if
        replays (`eval.whatif_sim`); empty when unknown.
      replay_kv_share: the share of each worker's KV capacity the simulated what-if replays
        give it, in (0, 1] (closed-loop sessions, `SessionLoad.replay_kv_share`: the sample is
        the run's ramp, whose contexts are a share of the busiest part's); 1 otherwise.

    Raises:
      ValueError: replay_kv_share outside (0, 1].
    """

    rate: float
    mean_prefill_seconds: Callable[[int], float]
    max_input_len: int
    sample: tuple[tuple[float, int, int], ...] = ()
    requests: tuple[Request, ...] = ()
    replay_kv_share: float = 1.0

    def __post_init__(self) -> None:
        share = self.replay_kv_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"Demand.replay_kv_share must be in (0, 1], got {share!r}")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """What every system of one comparison shares.

    Attributes:
      num_gpus: the GPU budget (devices), >= 1.
      kv_blocks_per_gpu: KV blocks one device holds, >= 1.
      max_input_len: `cp_degree -> tokens`, the longest prompt a worker of that degree takes.
      cost_model: the routers' prefill-time estimate (`predict(cp, input_len, cached_len)`).
      degrees: the CP degrees of the comparison (`--degrees`), for mixed compositions.
      kv_bytes_per_token: K and V bytes of one token, all layers (the model's KV size); routers
        that price KV copies between workers use it.
      kv_transfer_gb_per_s, scaleout_gb_per_s: bandwidth of a KV copy between workers of one
        host / of two hosts, GB/s (0 = free); `ReplayEnv` passes the simulator's here.
      parallelism: what a worker's degree means in this pool, "cp" (context parallel) or "tp"
        (tensor parallel); `cost_model` and `max_input_len` are for that parallelism.
      demand: the workload's historical `Demand`, for systems that size their initial
        composition from it; None when unknown.
    """

    num_gpus: int
    kv_blocks_per_gpu: int
    max_input_len: Callable[[int], int]
    cost_model: CostModel
    degrees: tuple[int, ...] = (2, 4)
    kv_bytes_per_token: int = 0
    kv_transfer_gb_per_s: float = 100.0
    parallelism: str = "cp"
    demand: Demand | None = None
    scaleout_gb_per_s: float = SCALEOUT_GB_PER_S

    def workers(self, degrees: Sequence[int]) -> list[WorkerSpec]:
        """Aligned workers of the given degrees; each accepts at most `max_input_len(C)` tokens.

        Raises:
          ValueError: the degrees need more devices than `num_gpus`.
        """
        if sum(degrees) > self.num_gpus:
            raise ValueError(f"composition {list(degrees)} needs {sum(degrees)} GPUs, "
                             f"more than num_gpus={self.num_gpus}")
        specs = layout_workers(degrees, self.kv_blocks_per_gpu, 1)
        return [dataclasses.replace(s, max_input_len=self.max_input_len(s.cp_degree)) for s in specs]


PARALLELISMS = ("cp", "tp")
INITIAL_CANDIDATES_KEPT = 8  # options of an initial choice a System keeps, best first


@dataclasses.dataclass
class System:
    """A built system: its workers, router and periodic hooks (controller, cache manager).

    Attributes:
      name: the system's own name (a built-in system is named so in results; a plug-in
        given as `module:attribute` is named by that spec instead).
      workers: the initial pool composition.
      router: the routing policy (`serving.policy.router.Router`).
      tick_hooks: periodic hooks `(scheduler, now)`.
      parallelism: "cp" (a worker's `cp_degree` devices run context-parallel prefill) or "tp"
        (they run tensor-parallel prefill, `cp_degree` = TP ways); `eval.experiment` charges and
        predicts prefill times from the profile of that parallelism.
      setup: called with the `Scheduler` before a run (attach a controller or cache manager).
      make_prefix_index: builds the scheduler's index of cached blocks (a `PrefixIndex` by
        default; the `GlobalPrefixTrie` for the prefix-cache manager).
      initial_choice: how the starting composition was chosen, or None (a fixed pool): a
        dict with "method" ("replay", "whatif", "paper" or "mixed"), the chosen "composition"
        and "router" rule, and, for the two replays, "compared" (how many options) and
        "candidates", `INITIAL_CANDIDATES_KEPT` options: the chosen one, then the best of the
        others, each `{"composition", "router", "failed", "predicted_mean_ttft_s"}` ("failed"
        None where the replay does not count failures, the prediction None where no request
        was served) (`eval.systems.vertumnus_system`; `eval.experiment.run_sweep` copies it
        into each result).

    Raises:
      ValueError: an unknown parallelism.
    """

    name: str
    workers: list[WorkerSpec]
    router: Router
    tick_hooks: list[Callable[[Scheduler, float], None]] = dataclasses.field(default_factory=list)
    parallelism: str = "cp"
    setup: list[Callable[[Scheduler], None]] = dataclasses.field(default_factory=list)
    make_prefix_index: Callable[[], PrefixIndex] = PrefixIndex
    initial_choice: dict | None = None

    def __post_init__(self) -> None:
        if self.parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism={self.parallelism!r} must be one of {PARALLELISMS}")

    @property
    def composition(self) -> list[int]:
        """CP degrees of the workers in device order."""
        return [w.cp_degree for w in self.workers]
