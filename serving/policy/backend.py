"""The contract between the policy core and an execution backend.

Two backends implement `Backend`: the simulated one in `eval/` (a discrete-event clock and a
ground-truth cost profile) and the live one over JAX submeshes. The `Scheduler` calls
`start_prefill` when a worker becomes free; the backend later reports the outcome by calling
`Scheduler.complete` (or `Scheduler.fail`) with a `PrefillResult` and the time it happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from serving.policy.request import Request


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillResult:
    """Outcome of one prefill on one worker, reported by the backend.

    Attributes:
      cached_len: prompt tokens read from the worker's prefix cache (a block multiple).
      finish_time: when the prefill finished on the worker (seconds); the worker is free then.
      first_token_time: when the first token is available to the client (seconds): the
        prefill's end plus, where the backend models them, the KV transfer to the decode pool
        and the first decode step. `>= finish_time`.
      inserted_blocks: block hashes the worker's prefix cache gained (its KV events).
      evicted_blocks: block hashes the worker's prefix cache dropped to make room; applied
        before `inserted_blocks`.
      first_token: the generated token id, when the backend runs a real model; else None.
    """

    cached_len: int
    finish_time: float
    first_token_time: float
    inserted_blocks: Sequence[int] = ()
    evicted_blocks: Sequence[int] = ()
    first_token: int | None = None


class Backend(Protocol):
    """What the scheduler needs from an execution backend."""

    def start_prefill(self, worker_id: int, request: Request, now: float) -> None:
        """Begins prefill of `request` on the (idle) worker at time `now` (seconds).

        Must not block for the prefill's duration. Exactly one of `Scheduler.complete` or
        `Scheduler.fail` must follow for this (worker_id, request).
        """
        ...

    def recarve(self, reconfiguration, now: float) -> None:
        """Re-carves the (idle) old workers of a `scheduler.Reconfiguration` into its new ones.

        A split may make more than two workers (the parts repeated halving makes, in one
        re-carve: `serving.policy.worker.split_parts`; the default controller plans them under
        overload unless `CompositionConfig.deep_splits` is False). Must not block. When every
        rank of the new workers has adopted the new geometry, the backend calls
        `Scheduler.finish_reconfiguration(epoch, now, cached_blocks)` with the blocks each new
        worker holds; one that could not re-carve and changed nothing calls
        `Scheduler.abandon_reconfiguration(epoch, now)` (the old workers serve again).
        Backends that never reconfigure may raise NotImplementedError.
        """
        ...

    def replicate(self, replication, now: float) -> None:
        """Copies `replication.chain[replication.start:]` from its source to its destination.

        Must not block. When the copy has completed, calls
        `scheduler.copies.finish(replication, now, inserted, evicted)` with the
        destination cache's changes. Backends without replication may raise NotImplementedError.
        """
        ...

    def reclaim(self, worker_id: int, chain, now: float) -> None:
        """Frees the worker's copy of the tail of `chain` no other cached prefix depends on.

        Calls `scheduler.copies.finish_reclaim(worker_id, chain, now, evicted)` once freed.
        """
        ...


class CostModel(Protocol):
    """Predicted prefill time in seconds of `input_len` tokens with `cached_len` of them cached,
    on a worker of CP degree `cp_degree`; `serving.policy.cost_model.PrefillCostModel`
    implements it."""

    def predict(self, cp_degree: int, input_len: int, cached_len: int) -> float: ...
