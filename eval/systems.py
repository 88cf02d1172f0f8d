"""Systems compared by `eval.replay`: a pool composition, a router and periodic hooks.

A system is built by name from a `PoolConfig` (GPU budget, KV blocks per GPU, the longest prompt
per degree, the fitted cost model). Built in here:

- `homogeneous-cpN`: every worker of CP degree N over the GPU budget, with cache-aware
  least-cost routing (`serving.cost_router.VertumnusRouter`; the paper's homogeneous baseline);
- `leastwork-cpN`: the same pool routed by least outstanding work, blind to the cache;
- `vertumnus`: a mixed composition of `--degrees` (`mixed_degrees`) with the Vertumnus router.

Research users add their own with `register_system(name, factory)`; `factory(pool) -> System`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from serving.cost_router import VertumnusRouter
from serving.router import LeastWorkRouter, Router
from serving.scheduler import CostModel, Scheduler
from serving.worker import WorkerSpec, homogeneous_degrees, layout_workers


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """What every system of one comparison shares.

    Attributes:
      num_gpus: the GPU budget (devices), >= 1.
      kv_blocks_per_gpu: KV blocks one device holds, >= 1.
      max_input_len: `cp_degree -> tokens`, the longest prompt a worker of that degree takes.
      cost_model: the routers' prefill-time estimate (`predict(cp, input_len, cached_len)`).
      degrees: the CP degrees of the comparison (`--degrees`), for mixed compositions.
    """

    num_gpus: int
    kv_blocks_per_gpu: int
    max_input_len: Callable[[int], int]
    cost_model: CostModel
    degrees: tuple[int, ...] = (2, 4)

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


@dataclasses.dataclass
class System:
    """A built system: its workers, router and periodic hooks (controller, cache manager)."""

    name: str
    workers: list[WorkerSpec]
    router: Router
    tick_hooks: list[Callable[[Scheduler, float], None]] = dataclasses.field(default_factory=list)

    @property
    def composition(self) -> list[int]:
        """CP degrees of the workers in device order."""
        return [w.cp_degree for w in self.workers]


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


def _vertumnus(pool: PoolConfig) -> System:
    return System("vertumnus", pool.workers(mixed_degrees(pool.num_gpus, pool.degrees)),
                  VertumnusRouter())


register_system("vertumnus", _vertumnus)


def build_system(name: str, pool: PoolConfig) -> System:
    """Builds the system called `name` (see the module docstring).

    Raises:
      ValueError: an unknown name (the message lists the known ones), or a composition that
        does not fit the pool.
    """
    if name in _REGISTRY:
        return _REGISTRY[name](pool)
    for pattern, factory in _PATTERNS:
        m = pattern.fullmatch(name)
        if m:
            return factory(m, pool)
    known = sorted(_REGISTRY) + ["homogeneous-cpN", "leastwork-cpN (N a power of two)"]
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
