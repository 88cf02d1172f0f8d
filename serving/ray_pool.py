"""Assembles the multi-host pool on Ray: host agents, worker specs per host, engine, app.

`build_ray_app(config, hosts_config)` is what `python -m serving.main --ray_address=...` or
`--local_hosts=N` runs. It connects to (or starts) Ray, starts one `serving.host_agent.HostAgent`
actor per host, carves each host's devices into its workers (a worker never spans hosts), and
builds the engine over a `serving.ray_backend.RayBackend`; the HTTP API is the single-host one
plus `GET /v1/hosts`.

Hosts:
- `local_hosts=N`: N agents on this machine, each its own process with `devices_per_host`
  emulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=M`, set in the
  actor's runtime environment before jax loads); for tests and demos. Ray restarts a killed
  local agent (bare), and the pool takes it back as new workers.
- a cluster (`ray_address`, e.g. "auto" after `ray start`): one agent per alive node, pinned to
  it (`NodeAffinitySchedulingStrategy`); devices per host = the node's `GPU` resource (Ray sets
  `CUDA_VISIBLE_DEVICES` for the actor), or `devices_per_host` when given; the same on every
  node (the pool is homogeneous).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from serving.host_agent import AgentConfig, HostAgent
from serving.policy.worker import WorkerSpec
from serving.ray_backend import RayBackend
from serving.ray_state import HostState


@dataclasses.dataclass(frozen=True)
class HostsConfig:
    """Where the host agents run.

    Attributes:
      ray_address: a Ray cluster address ("auto", "ray://...", "host:port"), or None to start a
        local Ray instance (with `local_hosts`).
      local_hosts: start this many agents on this machine (CPU devices), >= 0; 0 = one per node.
      devices_per_host: devices each agent owns (None: the nodes' `GPU` count; required with
        `local_hosts`).
      startup_timeout_s: seconds to wait for every agent to build its model and workers.
    """

    ray_address: str | None = None
    local_hosts: int = 0
    devices_per_host: int | None = None
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.local_hosts < 0:
            raise ValueError(f"local_hosts must be >= 0, got {self.local_hosts}")
        if self.local_hosts and not self.devices_per_host:
            raise ValueError("local_hosts needs devices_per_host (CPU devices per agent)")
        if self.devices_per_host is not None and self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be >= 1, got {self.devices_per_host}")
        if not (math.isfinite(self.startup_timeout_s) and self.startup_timeout_s > 0):
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")


def _actor_options(hosts: HostsConfig, ray) -> list[dict]:
    """Ray options of each host's agent, and the devices per host."""
    if hosts.local_hosts:
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={hosts.devices_per_host}",
               "JAX_PLATFORMS": "cpu"}
        return [dict(num_cpus=0, max_restarts=-1, max_concurrency=64,
                     runtime_env={"env_vars": env}) for _ in range(hosts.local_hosts)]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise ValueError(f"the Ray cluster at {hosts.ray_address!r} has no alive node")
    out = []
    for n in sorted(nodes, key=lambda n: n["NodeID"]):
        gpus = int(n.get("Resources", {}).get("GPU", 0))
        m = hosts.devices_per_host or gpus
        if not m:
            raise ValueError(f"node {n['NodeID'][:12]} has no GPU resource; pass "
                             "--devices_per_host to use its CPU devices")
        opts = dict(num_cpus=0, max_concurrency=64, scheduling_strategy=
                    NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
        if gpus:
            opts["num_gpus"] = m
        else:
            opts["runtime_env"] = {"env_vars": {
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={m}",
                "JAX_PLATFORMS": "cpu"}}
        out.append(opts)
    return out


def start_host_agents(hosts: HostsConfig, agent: AgentConfig, compositions: Sequence[Sequence[int]],
                      max_input_len, kv_blocks_per_device: int
                      ) -> tuple[list[HostState], list[WorkerSpec]]:
    """Starts one agent per host, sets each up with its composition, and returns the hosts and
    every worker's spec (pool-wide ids in device order; `host` set).

    Args:
      hosts: where agents run.
      agent: the model and KV settings (its `host_id` and `num_devices` are set per host).
      compositions: per host, its workers' CP degrees in device order (each sums to M).
      max_input_len: `cp_degree -> tokens` a worker of that degree accepts.
      kv_blocks_per_device: KV blocks per device.

    Raises:
      ValueError: no host, or a composition that does not fill its host.
      ray.exceptions.GetTimeoutError / RayActorError: an agent did not come up in time.
    """
    import ray

    if not ray.is_initialized():
        if hosts.ray_address:
            ray.init(address=hosts.ray_address, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(num_cpus=max(2, hosts.local_hosts), include_dashboard=False,
                     log_to_driver=True)
    options = _actor_options(hosts, ray)
    if len(compositions) != len(options):
        raise ValueError(f"{len(compositions)} host compositions for {len(options)} hosts")
    actor = ray.remote(HostAgent)
    m = hosts.devices_per_host
    states, specs, refs = [], [], []
    next_id = 0
    for h, (opts, comp) in enumerate(zip(options, compositions)):
        m_h = hosts.devices_per_host or opts.get("num_gpus")
        if m is None:
            m = m_h
        if sum(comp) != m or m_h != m:
            raise ValueError(f"host {h}: composition {list(comp)} must fill its {m_h} devices "
                             f"(every host the same: {m})")
        handle = actor.options(**opts).remote(dataclasses.replace(agent, host_id=h,
                                                                  num_devices=m))
        ids, first = list(range(next_id, next_id + len(comp))), h * m
        next_id += len(comp)
        for wid, c in zip(ids, comp):
            specs.append(WorkerSpec(wid, c, first, kv_blocks_per_device * c, max_input_len(c),
                                    host=h))
            first += c
        states.append(HostState(h, handle, tuple(comp), worker_ids=set(ids)))
        refs.append(handle.setup.remote(list(comp), ids))
    ray.get(refs, timeout=hosts.startup_timeout_s)
    for state, info in zip(states, ray.get([s.agent.info.remote() for s in states],
                                           timeout=hosts.startup_timeout_s)):
        state.info, state.state = info, "alive"
    return states, specs


def build_ray_engine(config, hosts: HostsConfig):
    """The engine over host agents, and the tokenizer, model name and vocabulary size (as
    `serving.server.build_engine` returns them). `config` is a `serving.server.ServerConfig`.

    Raises:
      ValueError: bad degrees or composition (every host gets the same composition: from
        `config.composition` when given for one host, else the paper's rule at `expected_rate`
        divided among the hosts).
    """
    from serving.server import (assemble_engine, choose_composition, fit_cost_model, model_info,
                                usable_degrees)

    ecfg = config.engine
    name, vocab, tokenizer, kv_bytes = model_info(config)
    cost_model = fit_cost_model(config)
    import ray
    if not ray.is_initialized() and not hosts.local_hosts:
        ray.init(address=hosts.ray_address, include_dashboard=False, log_to_driver=True)
    n_hosts = hosts.local_hosts or len([n for n in ray.nodes() if n.get("Alive")])
    m = hosts.devices_per_host or int(ray.cluster_resources().get("GPU", 0)) // max(1, n_hosts)
    degrees = usable_degrees(config, m)
    per_host = dataclasses.replace(config, expected_rate=config.expected_rate / n_hosts)
    comp = choose_composition(per_host, m, degrees, cost_model)
    agent = AgentConfig(0, m, model=config.model, checkpoint=config.checkpoint, seed=config.seed,
                        num_blocks=ecfg.kv_blocks_per_device, block_size=ecfg.block_size,
                        interpret=config.interpret, min_bucket=config.min_bucket,
                        kv_hold_seconds=ecfg.kv_hold_seconds)
    states, specs = start_host_agents(dataclasses.replace(hosts, devices_per_host=m), agent,
                                      [comp] * n_hosts, ecfg.max_input_len,
                                      ecfg.kv_blocks_per_device)

    def make_backend(post, clock):
        return RayBackend(states, specs, devices_per_host=m, post=post, clock=clock,
                          kv_blocks_per_device=ecfg.kv_blocks_per_device,
                          max_input_len=ecfg.max_input_len,
                          kv_hold_seconds=ecfg.kv_hold_seconds)

    engine = assemble_engine(config, make_backend, specs, cost_model, n_hosts * m, degrees,
                             kv_bytes)
    return engine, tokenizer, name, vocab


def build_ray_app(config, hosts: HostsConfig):
    """The FastAPI app of the multi-host pool (the single-host app's endpoints; `GET /v1/hosts`
    lists the agents)."""
    from serving.server import make_app

    engine, tokenizer, name, vocab = build_ray_engine(config, hosts)
    return make_app(config, engine, tokenizer, name, vocab)
