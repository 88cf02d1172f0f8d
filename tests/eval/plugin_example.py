"""A user-written router and system factory, plugged into `eval.replay` by name.

    python -m eval.replay --systems=tests.eval.plugin_example:ExampleRouter
    python -m eval.replay --systems=tests.eval.plugin_example:example_system

Used by tests/eval/test_systems.py (the README's extension-point example). The other
attributes are deliberately wrong plug-ins for the error tests.
"""

from __future__ import annotations

from collections.abc import Sequence

from eval.systems import PoolConfig, System
from serving.baselines.common import argmin_rotating
from serving.policy.request import Request
from serving.policy.worker import WorkerState, homogeneous_degrees


class ExampleRouter:
    """Fewest outstanding requests; among those, the most cached leading blocks; remaining
    ties by a rotating start (no bias toward worker 0)."""

    name = "example-fewest-requests"

    def __init__(self) -> None:
        self._rotation = 0

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        keys = [(w.outstanding_requests, -m) for w, m in zip(candidates, matched_blocks)]
        i = argmin_rotating(keys, self._rotation)
        self._rotation += 1
        return i


def example_system(pool: PoolConfig) -> System:
    """Every GPU in workers of the smallest degree of `--degrees`, routed by `ExampleRouter`."""
    c = min(pool.degrees)
    return System("example-smallest", pool.workers(homogeneous_degrees(pool.num_gpus, c)),
                  ExampleRouter())


def bad_factory(pool: PoolConfig) -> str:
    """Not a valid plug-in: returns something other than a `System`."""
    return "not a system"


NOT_A_SYSTEM = 3
ROUTER_INSTANCE = ExampleRouter()


class CrashingRouter(ExampleRouter):
    """Not a valid plug-in: its constructor has a bug (a programming error, not a ValueError)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = {}["missing"]


def crashing_factory(pool: PoolConfig) -> System:
    """Not a valid plug-in: the factory has a bug."""
    return System("crash", [], ExampleRouter()) if pool.num_gpus < 0 else 1 / 0


def no_arg_factory() -> System:
    """Not a valid plug-in: a factory must take the pool."""
    raise AssertionError("never called")
