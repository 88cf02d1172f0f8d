"""The order in which a worker's queued prefills start.

A worker runs one prefill at a time (non-preemptive); when it frees, the scheduler starts one
of the requests queued on it. Four orders:

- `"fcfs"`: first placed, first served (vLLM's and SGLang's default `fcfs`; every baseline
  and the paper's policy).
- `"sjf"`: shortest predicted prefill first. Among the queued requests the one with the least
  predicted prefill seconds on this worker starts; equal predictions in placement order. This
  is the shortest-processing-time rule, which minimizes the mean waiting time of a set of
  non-preemptive jobs on one machine (W. E. Smith, "Various optimizers for single-stage
  production", Naval Research Logistics Quarterly 3(1-2), 1956; for Poisson arrivals, the
  M/G/1 priority queue of A. Cobham, "Priority Assignment in Waiting Line Problems", JORSA
  2(1), 1954). The prediction is the cost model's prefill time at the prefix the worker held
  when the request was placed, *without* blocks promised by prefills still queued there: a
  request that counts on a queued request's prefix is ranked as if cold, so it does not start
  before the request that computes that prefix when it extends that request (a session's next
  turn: the same prefix and more). When a prefill on the worker ends, such requests are ranked
  again at the prefix the worker then holds (`rekey_promised`), so they start while it is
  still cached. Known limit: when two queued requests share a prefix and the one that counts
  on the other's has the shorter suffix (a shared system prompt), it ranks first and computes
  the prefix itself: the same work, moved, but its reservation (made at the cached estimate)
  falls short of its time, and the other request keeps its cold rank.

`pop_next` scans the queue (O(queue) per start): draining a queue of 20,000 on one worker takes
about 30 s of Python against 0.35 s under FCFS; the comparison's queues, past saturation,
stay in the hundreds.

- `"hrrn"`: highest response ratio next (P. Brinch Hansen, "Short-term scheduling in
  multiprogramming systems", SOSP 1971): the request of the largest `(wait + S) / S` starts,
  `wait` the seconds since its arrival and `S` its SJF key above; equal ratios in placement
  order. A request's ratio grows by `1 / S` a second, so a long prompt passes shorter ones
  once it has waited long enough in proportion to its length: the tail of SJF is cut without
  a constant to choose. Measured against SJF (eval/RESULTS.md, item 10): past saturation
  the mean is higher (Tool-Agent with Qwen3-32B at 2.5: 94.2 s against 58.0 s) and P99 mostly
  far lower (323 s against 1,385 s there), so `vertumnus` keeps SJF.

- `"gated-sjf"`: SJF within a gate. When a worker frees and none of its gated requests is
  left, every request queued on it then is gated, and those start in SJF order (the same key)
  before any placed after the gate closed: a short prompt passes only requests gated with it,
  and a request waits at most for the rest of the gate open when it was placed, then for its
  own gate. This is the gated discipline of polling systems (H. Takagi, "Analysis of Polling
  Systems", MIT Press, 1986) with the frozen queue of the disk scheduler FSCAN (E. G. Coffman,
  L. A. Klimko, B. Ryan, "Analysis of Scanning Policies for Reducing Disk Seek Times", SIAM J.
  Computing 1(3), 1972), here ordered shortest-first. Measured against SJF (eval/RESULTS.md,
  "Queue order in a closed loop"): where agent sessions wait for their answers past
  saturation it is within 0.6 % of FCFS or faster, where arrivals do not wait (open-loop
  traces) it gives up 31 % to all of SJF's gain over FCFS (Tool-Agent: 2.7 % slower than
  FCFS), so `vertumnus` keeps SJF.

SJF lets a long prompt wait while shorter ones keep arriving. `max_wait_s` bounds that: when
the request at the head of the queue (the earliest placed) has waited longer than
`max_wait_s` seconds since its arrival, it starts next whatever its length. None (the
default) sets no bound; past saturation a long prompt then waits until the short ones are
served (eval/RESULTS.md reports the P99 and token-weighted SLO this costs and buys).

The order is the router's (`queue_order` attribute, read by the `Scheduler` once), so every
scheduler built on a router, live or simulated or in a replay, starts prefills in the same
order. The composition controller's queueing replay (`serving.policy.whatif`) models FIFO
queues whatever the order: it compares compositions, not orders.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections import deque
from collections.abc import Callable, Mapping
from itertools import islice

from serving.policy.placement import Placement
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request
from serving.policy.worker import WorkerState

QUEUE_ORDERS = ("fcfs", "sjf", "hrrn", "gated-sjf")


@dataclasses.dataclass(frozen=True, slots=True)
class QueueOrder:
    """Which queued request a free worker starts; see the module docstring.

    Attributes:
      kind: "fcfs", "sjf", "hrrn" or "gated-sjf".
      max_wait_s: with "sjf", seconds after its arrival past which the head of the queue
        starts next regardless of length, > 0 and finite; None: no bound. Must be None with
        "fcfs".

    Raises:
      ValueError: an unknown kind, or a max_wait_s that is not a finite number > 0 (or is
        set with "fcfs").
    """

    kind: str = "fcfs"
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in QUEUE_ORDERS:
            raise ValueError(f"queue order kind must be one of {QUEUE_ORDERS}, got {self.kind!r}")
        if self.max_wait_s is None:
            return
        if self.kind != "sjf":
            raise ValueError(f"max_wait_s bounds the wait under 'sjf'; {self.kind!r} takes None, "
                             f"got {self.max_wait_s!r}")
        w = self.max_wait_s
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (
                math.isfinite(w) and w > 0):
            raise ValueError(
                f"max_wait_s must be a finite number of seconds > 0 or None, got {w!r}")

    @property
    def reorders(self) -> bool:
        """True when a queue may start other than its head (every kind but "fcfs")."""
        return self.kind != "fcfs"

    def pop_next(self, queue: deque[Request], placements: Mapping[str | int, Placement],
                 now: float) -> Request:
        """Removes and returns the request that starts next.

        Args:
          queue: the worker's queued requests in placement order (non-empty); changed in place.
          placements: request id -> its `Placement` (`order_seconds`: the SJF key, the S of
            HRRN's ratio; `gated`: set here under "gated-sjf").
          now: current time in seconds.

        Raises:
          IndexError: `queue` is empty.
        """
        head = queue[0]
        if self.kind == "fcfs" or len(queue) == 1 or (
                self.max_wait_s is not None and now - head.arrival_time > self.max_wait_s):
            return queue.popleft()
        if self.kind == "hrrn":  # the largest wait / S: the same order as (wait + S) / S
            best_i, best = 0, -1.0
            for i, r in enumerate(queue):
                s = placements[r.request_id].order_seconds
                ratio = (now - r.arrival_time) / s if s > 0 else math.inf
                if ratio > best:
                    best_i, best = i, ratio
        else:  # sjf: the least key, the first placed among equals (of the gate: module doc)
            gate = len(queue)
            if self.kind == "gated-sjf":
                gate = gate_length(queue, placements)
            best_i, best = 0, placements[head.request_id].order_seconds
            for i, r in enumerate(islice(queue, 1, gate), 1):
                s = placements[r.request_id].order_seconds
                if s < best:
                    best_i, best = i, s
        if best_i == 0:
            return queue.popleft()
        request = queue[best_i]
        del queue[best_i]
        return request


def gate_length(queue: deque[Request], placements: Mapping[str | int, Placement]) -> int:
    """The gated requests of `queue` ("gated-sjf"), a leading run of it (requests are queued
    at its end): their number; when none is left, every request queued now is gated first.

    Args:
      queue: a worker's queued requests in placement order (non-empty).
      placements: request id -> its `Placement` (`gated` read, and set when the gate closes).
    """
    n = 0
    for r in queue:
        if not placements[r.request_id].gated:
            break
        n += 1
    if n:
        return n
    for r in queue:
        placements[r.request_id].gated = True
    return len(queue)


def rekey_promised(worker: WorkerState, placements: Mapping[str | int, Placement],
                   index: PrefixIndex, predict: Callable[[int, int, int], float]) -> None:
    """Re-ranks, after a prefill on `worker` ended, its queued requests that counted on blocks
    promised by another queued prefill (ranked above their reserved estimate): each is ranked
    again at the prefix the worker holds now, so a request whose prefix has just been computed
    starts while that prefix is still cached (issue 15: ranked cold for good, later turns of
    Tool-Agent sessions waited until their contexts were evicted: +21 % mean TTFT against the
    best baseline with Qwen3-32B at load 2.5; re-ranked, -42 %).

    Args:
      worker: the worker whose prefill ended (its `queue` is read).
      placements: request id -> its `Placement` (`order_seconds` is updated in place).
      index: the cluster's block-holder index, with the ended prefill's blocks inserted.
      predict: the cost model's `predict(cp_degree, input_len, cached_len) -> seconds`.
    """
    wid, c = (worker.worker_id,), worker.cp_degree
    for r in worker.queue:
        p = placements[r.request_id]
        if p.order_seconds > p.estimate:
            held = index.match_blocks(r.block_hashes, r.max_cacheable_blocks, wid)[0]
            p.order_seconds = predict(c, r.input_len, held * r.block_size)


FCFS = QueueOrder("fcfs")
SJF = QueueOrder("sjf")


def parse_queue_order(spec: str) -> QueueOrder:
    """A `QueueOrder` from `"fcfs"`, `"sjf"`, `"sjf:S"` (S: `max_wait_s` in seconds), `"hrrn"`
    or `"gated-sjf"`.

    Raises:
      ValueError: naming the spec and the accepted forms.
    """
    kind, sep, rest = str(spec).strip().partition(":")
    forms = ("expected 'fcfs', 'sjf', 'sjf:S' (S > 0 seconds, the longest wait), 'hrrn' or "
             "'gated-sjf'")
    if kind not in QUEUE_ORDERS or (sep and (kind != "sjf" or not rest)):
        raise ValueError(f"queue_order={spec!r}: {forms}")
    if not sep:
        return QueueOrder(kind)
    try:
        return QueueOrder(kind, float(rest))
    except ValueError as e:
        raise ValueError(f"queue_order={spec!r}: {forms} ({e})") from None
