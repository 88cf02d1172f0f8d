"""`EngineConfig`, the live pool's knobs (the serving binary's flags), the engine's errors, and
`Completion`, what a finished prefill reports.

Re-exported by `serving.engine`.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Real
from types import MappingProxyType

from serving.policy.cache_manager import CacheManagerConfig
from serving.policy.composition import CompositionConfig
from serving.policy.controller import ControllerConfig
from serving.policy.live_set import DEFAULT_HORIZON_S
from serving.policy.queue_order import FCFS, SJF, QueueOrder
from serving.policy.replication import SCALEOUT_GB_PER_S
from serving.policy.request import RequestRecord
from serving.policy.checks import is_power_of_two


class Overloaded(RuntimeError):
    """Too much queued work; `retry_after` is a suggested wait in whole seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(RuntimeError):
    """The engine no longer accepts requests."""


class ClientDisconnected(RuntimeError):
    """The client went away while its request waited; nobody reads the answer."""


# The named policies of the live pool: the `EngineConfig` fields each one sets (read-only).
POLICIES = MappingProxyType({
    # The simulator's default `vertumnus` (eval.systems.vertumnus_system) less its replayed
    # initial choice, which needs a demand sample the live pool does not have at start: the
    # what-if controller, live sets of DEFAULT_HORIZON_S (300 s), the congestion price, shortest
    # predicted prefill first, and prefix fetch (the replay picks the fetch rule in 33 of the
    # 48 cells of `python -m eval.paper`, eval/results/paper_results.json).
    "vertumnus": MappingProxyType(dict(
        controller_policy="whatif", live_horizon_s=DEFAULT_HORIZON_S, congestion_price=True,
        queue_order=SJF, prefix_fetch=True)),
    # The paper's policy (the simulator's `vertumnus-paper`, less its initial rule, which the
    # live pool applies to every policy from --expected_rate): `EngineConfig`'s defaults.
    "vertumnus-paper": MappingProxyType(dict(
        controller_policy="paper", live_horizon_s=None, congestion_price=False,
        queue_order=FCFS, prefix_fetch=False)),
})


def policy_parts(policy: str) -> dict[str, object]:
    """The `EngineConfig` fields of a named policy (`POLICIES`), as a new dict.

    Raises:
      ValueError: `policy` is not one of `POLICIES` (the error names them).
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return dict(POLICIES[policy])


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Knobs of the live pool (the serving binary's flags).

    The defaults of the policy's parts (`live_horizon_s`, `congestion_price`, `queue_order`,
    `prefix_fetch`, `controller_policy`) are the paper's; `EngineConfig.for_policy("vertumnus")`
    gives the simulator's default policy, as the serving binary does (`--policy`).

    Attributes:
      block_size: tokens per KV block, a power of two.
      kv_blocks_per_device: KV blocks each device holds, >= 1.
      max_model_len: longest prompt the model accepts (tokens), >= 1.
      beta, lam: the placement cost's weights (`VertumnusRouter`), >= 0.
      live_horizon_s: None (the paper's placement cost) or the window of the workers' live
        working sets whose eviction the cost charges (`serving.policy.live_set`; the
        simulator's `vertumnus` uses 300), seconds, finite and > 0.
      congestion_price: price GPU time at `lam` plus the backlog every worker carries (the
        requests queued on the least-queued worker, times the workers, per GPU;
        `VertumnusRouter`; the simulator's `vertumnus` does), or at `lam` (the paper's).
      queue_order: the order in which a worker's queued prefills start, a `QueueOrder`
        (`serving.policy.queue_order`): FCFS (the paper's) by default; the simulator's
        `vertumnus` starts the shortest predicted prefill first (SJF).
      prefix_fetch: the default router may fetch for a request the longest prefix another
        worker holds (`FetchingVertumnusRouter`; the simulator's `vertumnus` does where its
        replay chose it): copies priced at 100 GB/s within a host, `scaleout_gb_per_s`
        across; the request's prefill starts once its copy has ended, normally landed
        (`serving.fetch_wait`). Off by default: no per-request fetch, each worker priced at
        its own prefix (the paper's).
      controller: run the split/merge controller; `controller_config` its thresholds.
      controller_policy: "paper" (the threshold controller, `ReconfigurationController`) or
        "whatif" (`serving.policy.composition.CompositionController`, the simulator's default
        `vertumnus`; `composition_config` its knobs, its degree range the engine's degrees).
      cache_manager: run the prefix-cache manager; `cache_config` its scan interval and
        thresholds.
      tick_seconds: period of the scheduler's tick (seconds), > 0.
      max_in_flight: requests queued or running beyond which new ones get 429, >= 1.
      scaleout_gb_per_s: bandwidth of a KV copy between workers of different hosts (the
        prefix-cache manager, and with `prefix_fetch` the router, price cross-host copies with
        it; within a host 100 GB/s), GB/s >= 0 (0 = free).
      kv_hold_seconds: how long a prompt's KV stays pinned for the decode side when its request
        asked for it (`kv_transfer_params.do_remote_decode`, `serving.kv_hold`) and nobody
        pulls or releases it, seconds > 0.
    """

    block_size: int = 16
    kv_blocks_per_device: int = 256
    max_model_len: int = 4096
    beta: float = 1.0
    lam: float = 1.0
    live_horizon_s: float | None = None
    congestion_price: bool = False
    queue_order: QueueOrder = FCFS
    prefix_fetch: bool = False
    controller: bool = True
    controller_config: ControllerConfig = ControllerConfig()
    controller_policy: str = "paper"
    composition_config: CompositionConfig = CompositionConfig()
    cache_manager: bool = True
    cache_config: CacheManagerConfig = CacheManagerConfig()
    tick_seconds: float = 0.25
    max_in_flight: int = 256
    kv_hold_seconds: float = 60.0
    scaleout_gb_per_s: float = SCALEOUT_GB_PER_S

    def __post_init__(self) -> None:
        if self.controller_policy not in ("paper", "whatif"):
            raise ValueError(f"controller_policy must be 'paper' or 'whatif', got "
                             f"{self.controller_policy!r}")
        if not is_power_of_two(self.block_size):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        for name in ("kv_blocks_per_device", "max_model_len", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("beta", "lam"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.live_horizon_s is not None and (
                isinstance(self.live_horizon_s, bool) or not isinstance(self.live_horizon_s, Real)
                or not (math.isfinite(self.live_horizon_s) and self.live_horizon_s > 0)):
            raise ValueError(f"live_horizon_s must be None or a finite number > 0 seconds, got "
                             f"{self.live_horizon_s}")
        for name in ("congestion_price", "prefix_fetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.queue_order, QueueOrder):
            raise ValueError(f"queue_order must be a QueueOrder, got {self.queue_order!r}")
        if not (math.isfinite(self.scaleout_gb_per_s) and self.scaleout_gb_per_s >= 0):
            raise ValueError(f"scaleout_gb_per_s must be a finite number >= 0 GB/s, got "
                             f"{self.scaleout_gb_per_s}")
        if not (math.isfinite(self.kv_hold_seconds) and self.kv_hold_seconds > 0):
            raise ValueError(f"kv_hold_seconds must be a finite number > 0, got "
                             f"{self.kv_hold_seconds}")
        if not (math.isfinite(self.tick_seconds) and self.tick_seconds > 0):
            raise ValueError(f"tick_seconds must be > 0 seconds, got {self.tick_seconds}")

    @classmethod
    def for_policy(cls, policy: str, **fields) -> "EngineConfig":
        """The config of a named policy (`POLICIES`: "vertumnus" or "vertumnus-paper"), with
        `fields` set on top (a policy part given in `fields` replaces the policy's).

        Raises:
          ValueError: an unknown policy, or a field value outside its range (as the
            constructor); TypeError: an unknown field.
        """
        return cls(**{**policy_parts(policy), **fields})

    @property
    def policy(self) -> str:
        """The name of the policy (`POLICIES`) whose parts this config has, or "custom"."""
        return next((name for name, parts in POLICIES.items()
                     if all(getattr(self, k) == v for k, v in parts.items())), "custom")

    def describe_policy(self) -> str:
        """One line naming the policy's parts (the binary's start-up log, `GET /v1/workers`)."""
        order, on = self.queue_order, {True: "on", False: "off"}
        wait = "" if order.max_wait_s is None else f":{order.max_wait_s:g}"
        live = f"live sets of {self.live_horizon_s:g} s" if self.live_horizon_s else "no live sets"
        return (f"{self.controller_policy} controller{'' if self.controller else ' (off)'}, "
                f"{live}, congestion price {on[self.congestion_price]}, queue order "
                f"{order.kind}{wait}, prefix fetch {on[self.prefix_fetch]}")

    def max_input_len(self, cp_degree: int) -> int:
        """Longest prompt a worker of degree C takes: the model's limit, and its KV blocks
        (`C * kv_blocks_per_device * block_size` tokens)."""
        return min(self.max_model_len, cp_degree * self.kv_blocks_per_device * self.block_size)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished prefill as the API reports it.

    Attributes:
      record: the scheduler's `RequestRecord` (worker, epoch, times, cached tokens, token).
      prefill: the backend's `LivePrefill` (devices, block ids), None on failure.
      queue_seconds, prefill_seconds, ttft_seconds: timings in seconds.
    """

    record: RequestRecord
    prefill: object | None

    @property
    def queue_seconds(self) -> float:
        r = self.record
        return max(0.0, (r.start_time or r.request.arrival_time) - r.request.arrival_time)

    @property
    def prefill_seconds(self) -> float:
        r = self.record
        return max(0.0, (r.finish_time or 0.0) - (r.start_time or 0.0))

    @property
    def ttft_seconds(self) -> float | None:
        return self.record.ttft
