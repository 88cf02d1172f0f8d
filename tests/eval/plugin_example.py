"""A user-written router and system factory, plugged into `eval.replay` by name.

    python -m eval.replay --systems=tests.eval.plugin_example:ExampleRouter
    python -m eval.replay --systems=tests.eval.plugin_example:example_system

Used by tests/eval/test_systems.py (the README's extension-point example). The other
attributes are deliberately wrong plug-ins for the error tests.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from eval.systems import PoolConfig, System
from serving.baselines.common import argmin_rotating
from serving.policy.request import Request
from serving.policy.router import LeastWorkRouter
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


# Plug-ins that end in something other than an Exception, or fail only while the replay runs.
class Boom(BaseException):
    """Not an Exception: a plug-in's own BaseException subclass."""


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def exiting_factory(pool: PoolConfig) -> System:
    sys.exit(0)


def base_exception_factory(pool: PoolConfig) -> System:
    raise Boom("custom BaseException")


def json_factory(pool: PoolConfig) -> System:
    return json.loads("{not json")  # a ValueError subclass from a plug-in bug: wrapped


def bad_str_factory(pool: PoolConfig) -> System:
    raise BadStr()


def value_error_factory(pool: PoolConfig) -> System:
    raise ValueError("this plug-in needs --degrees=2,4")  # a user-facing message: unchanged


def interrupted_factory(pool: PoolConfig) -> System:
    raise KeyboardInterrupt


class ChooseCrashRouter(ExampleRouter):
    """Fails on the first request it routes (a bug met only while the replay runs)."""

    def choose(self, request, candidates, matched_blocks, now) -> int:
        return {}["x"]


class OutOfRangeRouter(ExampleRouter):
    def choose(self, request, candidates, matched_blocks, now) -> int:
        return len(candidates)


class TickCrashRouter(ExampleRouter):
    """Registers a tick hook when bound to the scheduler; the hook fails."""

    def bind(self, scheduler) -> None:
        scheduler.tick_hooks.append(self.on_tick)

    def on_tick(self, scheduler, now: float) -> None:
        raise ValueError("tick failed")


class SlotsCrashRouter:
    """A router whose methods cannot be replaced on the instance (`__slots__`)."""

    __slots__ = ()
    name = "slots"

    def choose(self, request, candidates, matched_blocks, now) -> int:
        raise RuntimeError("slots choose failed")


def setup_crash_system(pool: PoolConfig) -> System:
    """A built-in router, and a setup function of the plug-in's that fails."""
    def setup(scheduler) -> None:
        raise RuntimeError("setup failed")
    return System("setup-crash", pool.workers(homogeneous_degrees(pool.num_gpus, 2)),
                  LeastWorkRouter(), setup=[setup])
