"""The splits and merges of a soak run (`eval.live.soak`): which one next, pure logic.

`next_kind` says which kind to prefer after the last one, in one of the `WALKS`;
`choose_operation` picks a legal operation of that kind (or of the other) in the pool that
`GET /v1/workers` describes; an `Operation` knows its admin endpoint.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence

from serving.policy.worker import WorkerSpec, are_buddies

# The documented refusal of the admin split / merge (serving/api.py): 409 conflict, the change
# would strand waiting requests that only the workers it removes can hold. The driver asks only
# for legal changes (`choose_operation`, on a pool with nothing in progress), so a 400 ("not a
# legal change") is a failure of the server, not a refusal.
OPERATION_REFUSAL_CODES = {409: "conflict"}


@dataclasses.dataclass(frozen=True)
class Operation:
    """A split (`worker_ids` = [the worker]) or a merge (`worker_ids` = two buddies)."""

    kind: str
    worker_ids: tuple[int, ...]

    def path_and_body(self) -> tuple[str, dict]:
        """The admin endpoint and JSON body that request this operation."""
        if self.kind == "split":
            return "/v1/workers/split", {"worker_id": self.worker_ids[0]}
        return "/v1/workers/merge", {"worker_ids": list(self.worker_ids)}


WALKS = ("sweep", "alternate", "random")


def next_kind(walk: str, last: str | None, refused: bool, rng: random.Random) -> str:
    """The kind of operation to prefer next (`choose_operation` falls back to the other).

    Args:
      walk: "sweep" (the kind of the last operation again, so the pool is split down to the
        smallest degree, merged up to the largest, and so on: every degree and device group
        is met; a refusal turns it round), "alternate" (split, merge, split, ...) or
        "random" (either, with equal chances).
      last: the kind of the last operation asked for (None: none yet).
      refused: whether the server refused that operation.
      rng: for "random".
    """
    if walk == "random":
        return rng.choice(("split", "merge"))
    other = "merge" if last == "split" else "split"
    if last is None:
        return "split"
    return other if walk == "alternate" or refused else last


def choose_operation(workers: Sequence[dict], degrees: Iterable[int], prefer: str,
                     rng: random.Random) -> Operation | None:
    """A legal split or merge of the pool, `prefer` ("split" / "merge") first if one exists.

    Args:
      workers: `GET /v1/workers`'s `workers` (dicts with `worker_id`, `cp_degree`,
        `first_device`, `status`).
      degrees: the CP degrees the pool may have (the server's `--degrees`): a split of a
        degree-2C worker needs C in it, a merge of two degree-C buddies 2C.
      prefer: the kind tried first; the other kind when `prefer` has no candidate.
      rng: picks uniformly among the candidates of the kind.

    Returns:
      The operation, or None when no ACTIVE worker can be split or merged.
    """
    allowed = set(degrees)
    active = [w for w in workers if w.get("status") == "active"]
    splits = [Operation("split", (w["worker_id"],)) for w in active
              if w["cp_degree"] >= 2 and w["cp_degree"] // 2 in allowed]
    specs = {w["worker_id"]: WorkerSpec(w["worker_id"], w["cp_degree"], w["first_device"], 1, 1)
             for w in active}
    ordered = sorted(specs.values(), key=lambda s: s.first_device)
    merges = [Operation("merge", (a.worker_id, b.worker_id))
              for a, b in zip(ordered, ordered[1:])
              if are_buddies(a, b) and 2 * a.cp_degree in allowed]
    for kind in (prefer, "merge" if prefer == "split" else "split"):
        candidates = splits if kind == "split" else merges
        if candidates:
            return rng.choice(candidates)
    return None
