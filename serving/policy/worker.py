"""Workers of the prefill pool as the policy core sees them: plain data, no devices.

A worker is a group of `cp_degree` devices `[first_device, first_device + cp_degree)` that
runs context-parallel prefill together (DESIGN.md, "Devices, meshes and KV"). Groups are
aligned (`first_device % cp_degree == 0`) so that split and merge keep buddy groups. Device
indices are pool-wide; a worker also carries the id of the host its devices are on (issue 19:
one host agent per host), and a CP group stays inside one host unless a layout allows spanning
(`layout_workers(..., devices_per_host=M)`: host `first_device // M`). The scheduler owns each
worker's FIFO queue; the backend runs one prefill at a time per worker.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from serving.policy.checks import is_power_of_two
from serving.policy.request import Request


class WorkerStatus(enum.Enum):
    """Lifecycle of a worker: ACTIVE takes placements; DRAINING finishes what runs, takes
    nothing new; UNAVAILABLE is not schedulable (a new epoch not yet adopted by every rank)."""

    ACTIVE = "active"
    DRAINING = "draining"
    UNAVAILABLE = "unavailable"


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Static description of one worker.

    Attributes:
      worker_id: unique non-negative int within a pool (never reused after split/merge).
      cp_degree: devices in the CP group, a power of two >= 1.
      first_device: index of the group's first device; must be a multiple of `cp_degree`.
      kv_capacity_blocks: KV blocks the worker can hold in total (all ranks together), >= 1.
      max_input_len: longest prompt (tokens) the worker accepts, >= 1.
      host: id of the host that holds the worker's devices (that host's agent runs it), >= 0;
        0 for a one-host pool. KV copies between workers of different hosts go over the
        scale-out network (`serving.policy.replication.link_gb_per_s`).
    """

    worker_id: int
    cp_degree: int
    first_device: int
    kv_capacity_blocks: int
    max_input_len: int
    host: int = 0

    def __post_init__(self) -> None:
        if self.worker_id < 0:
            raise ValueError(f"worker_id must be >= 0, got {self.worker_id}")
        if not is_power_of_two(self.cp_degree):
            raise ValueError(f"cp_degree must be a power of two >= 1, got {self.cp_degree}")
        if self.first_device < 0 or self.first_device % self.cp_degree:
            raise ValueError(
                f"first_device must be a non-negative multiple of cp_degree={self.cp_degree} "
                f"(aligned group), got {self.first_device}")
        if self.kv_capacity_blocks < 1:
            raise ValueError(f"kv_capacity_blocks must be >= 1, got {self.kv_capacity_blocks}")
        if self.max_input_len < 1:
            raise ValueError(f"max_input_len must be >= 1 token, got {self.max_input_len}")
        if isinstance(self.host, bool) or not isinstance(self.host, int) or self.host < 0:
            raise ValueError(f"host must be an integer >= 0, got {self.host!r}")

    @property
    def devices(self) -> range:
        """Device indices of the group, `[first_device, first_device + cp_degree)`."""
        return range(self.first_device, self.first_device + self.cp_degree)

    def can_hold(self, request: Request) -> bool:
        """True when a worker of this spec can ever prefill `request`: `input_len <=
        max_input_len` and its `ceil(input_len / block_size)` blocks fit the KV capacity."""
        return (request.input_len <= self.max_input_len
                and -(-request.input_len // request.block_size) <= self.kv_capacity_blocks)


@dataclasses.dataclass(eq=False, slots=True)
class WorkerState:
    """Mutable scheduling state of one worker (owned by the `Scheduler`).

    Attributes:
      spec: the static `WorkerSpec`.
      epoch: configuration epoch under which the worker was created.
      status: `WorkerStatus`.
      queue: requests placed on the worker and not yet started, FIFO.
      running: the request whose prefill runs now, or None.
      running_start: when `running` started (seconds).
      running_estimate: predicted prefill seconds of `running`.
      queued_seconds: sum of the predicted prefill seconds of `queue` (the reservation).
    """

    spec: WorkerSpec
    epoch: int = 0
    status: WorkerStatus = WorkerStatus.ACTIVE
    queue: deque = dataclasses.field(default_factory=deque)
    running: Request | None = None
    running_start: float = 0.0
    running_estimate: float = 0.0
    queued_seconds: float = 0.0

    @property
    def worker_id(self) -> int:
        return self.spec.worker_id

    @property
    def cp_degree(self) -> int:
        return self.spec.cp_degree

    def outstanding_seconds(self, now: float) -> float:
        """Predicted queueing delay `Q_w` for a request placed now, in seconds.

        The reserved work of the queue plus the predicted remainder of the running prefill
        (never negative when it overruns its estimate).
        """
        q = self.queued_seconds
        if self.running is not None:
            q += max(0.0, self.running_estimate - (now - self.running_start))
        return q

    @property
    def outstanding_requests(self) -> int:
        """Requests placed on this worker and not finished (queued + running)."""
        return len(self.queue) + (self.running is not None)

    def can_hold(self, request: Request) -> bool:
        """True when the worker can ever prefill `request` (`WorkerSpec.can_hold`)."""
        return self.spec.can_hold(request)


def layout_workers(degrees: Sequence[int], kv_blocks_per_device: int, max_input_len: int,
                   first_worker_id: int = 0, devices_per_host: int | None = None,
                   allow_span: bool = False) -> list[WorkerSpec]:
    """Lays CP groups of the given degrees onto devices 0.. in aligned groups.

    Groups are placed largest degree first, so every group is aligned (powers of two packed in
    decreasing order never straddle a boundary). Each worker's KV capacity is
    `kv_blocks_per_device * cp_degree` blocks (blocks are striped over its ranks).

    Args:
      degrees: CP degree of each worker, e.g. `[4, 2, 2]`; each a power of two >= 1.
      kv_blocks_per_device: KV blocks one device holds, >= 1.
      max_input_len: longest prompt any worker accepts (tokens).
      first_worker_id: id of the first worker; the others follow in order.
      devices_per_host: devices per host M (`assign_hosts`): worker host = `first_device // M`;
        None puts every worker on host 0 (one host).
      allow_span: with `devices_per_host`, accept a worker whose devices span hosts.

    Returns:
      `WorkerSpec`s in device order.

    Raises:
      ValueError: an empty composition, a degree that is not a power of two, or (unless
        `allow_span`) a worker that would span hosts (`assign_hosts`).
    """
    if not degrees:
        raise ValueError("degrees must name at least one worker")
    for c in degrees:
        if not is_power_of_two(c):
            raise ValueError(f"each CP degree must be a power of two >= 1, got {c!r} in {list(degrees)}")
    specs = []
    device = 0
    for i, c in enumerate(sorted(degrees, reverse=True)):
        specs.append(WorkerSpec(first_worker_id + i, c, device, kv_blocks_per_device * c, max_input_len))
        device += c
    return specs if devices_per_host is None else assign_hosts(specs, devices_per_host, allow_span)


def assign_hosts(specs: Sequence[WorkerSpec], devices_per_host: int,
                 allow_span: bool = False) -> list[WorkerSpec]:
    """The workers with `host = first_device // devices_per_host` (pool-wide device indices,
    hosts of `devices_per_host` devices each: the paper's pool is five hosts of 8 GPUs).

    Raises:
      ValueError: `devices_per_host` is not an integer >= 1, or (unless `allow_span`) a worker
        spans hosts: its degree is above `devices_per_host` or its group crosses a host
        boundary (the message names the worker, its devices and the hosts).
    """
    if isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int) \
            or devices_per_host < 1:
        raise ValueError(f"devices_per_host must be an integer >= 1, got {devices_per_host!r}")
    out = []
    for s in specs:
        first, last = s.first_device // devices_per_host, s.devices[-1] // devices_per_host
        if first != last and not allow_span:
            raise ValueError(
                f"worker {s.worker_id} (cp_degree={s.cp_degree}, devices {s.first_device}.."
                f"{s.devices[-1]}) would span hosts {first}..{last} of {devices_per_host} devices "
                "each; a CP group stays inside one host (degree <= devices per host, aligned), "
                "unless spanning is allowed")
        out.append(dataclasses.replace(s, host=first))
    return out


def homogeneous_degrees(num_devices: int, cp_degree: int) -> list[int]:
    """`num_devices // cp_degree` workers of one degree.

    Raises:
      ValueError: when `cp_degree` does not divide `num_devices` or is not a power of two.
    """
    if not is_power_of_two(cp_degree):
        raise ValueError(f"cp_degree must be a power of two >= 1, got {cp_degree}")
    if num_devices < cp_degree or num_devices % cp_degree:
        raise ValueError(
            f"num_devices={num_devices} must be a positive multiple of cp_degree={cp_degree}")
    return [cp_degree] * (num_devices // cp_degree)


def split_halves(spec: WorkerSpec, new_ids: tuple[int, int], max_input_len: Callable[[int], int]
                 ) -> tuple[WorkerSpec, WorkerSpec]:
    """The two aligned halves of a degree-2C worker (DESIGN.md: split keeps buddy groups).

    KV capacity per device and the host are kept; each half gets `max_input_len(C)`.

    Raises:
      ValueError: the worker has degree 1 (nothing to split).
    """
    if spec.cp_degree < 2:
        raise ValueError(f"worker {spec.worker_id} has cp_degree=1 and cannot be split")
    c = spec.cp_degree // 2
    return split_parts(spec, (c, c), new_ids, max_input_len)


def split_parts(spec: WorkerSpec, parts: Sequence[int], new_ids: Sequence[int],
                max_input_len: Callable[[int], int]) -> tuple[WorkerSpec, ...]:
    """The workers that splitting `spec` into CP degrees `parts` (device order) makes, in one
    re-carve: what halving it, then halving some halves, and so on, would make
    (`is_aligned_tiling`), without the re-carves in between. `split_halves` is two parts.

    KV capacity per device and the host are kept; each part gets `max_input_len(its degree)`.

    Raises:
      ValueError: fewer than two parts, not one id per part, or parts that are not an aligned
        tiling of the worker's devices.
    """
    parts, new_ids = list(parts), list(new_ids)
    if len(parts) < 2 or len(new_ids) != len(parts) or not is_aligned_tiling(spec.cp_degree,
                                                                             parts):
        raise ValueError(f"cannot split worker {spec.worker_id} (cp_degree={spec.cp_degree}) "
                         f"into parts {parts} with ids {new_ids}: need two or more parts, one "
                         "id each, that repeated halving makes (powers of two in device order "
                         "summing to its degree, each starting at a multiple of itself)")
    per_device = spec.kv_capacity_blocks // spec.cp_degree
    out, at = [], spec.first_device
    for wid, c in zip(new_ids, map(int, parts)):  # (numpy integers as int)
        out.append(WorkerSpec(wid, c, at, per_device * c, max_input_len(c), spec.host))
        at += c
    return tuple(out)


def is_aligned_tiling(cp_degree: int, parts: Sequence[int]) -> bool:
    """True when CP degrees `parts`, in device order, tile a worker of `cp_degree` devices (a
    power of two) as repeated halving does: powers of two summing to `cp_degree`, each starting
    at a multiple of itself (counted from the worker's first device). E.g. for 8: [4, 2, 2]
    and [1, 1, 2, 4] are, [2, 4, 2] is not (the 4 would start at device 2)."""
    at = 0
    for c in parts:
        if not (is_power_of_two(c) and at % c == 0):
            return False
        at += c
    return at == cp_degree and is_power_of_two(cp_degree)


def are_buddies(a: WorkerSpec, b: WorkerSpec) -> bool:
    """True when `a` and `b` are the two halves of one aligned group of degree 2C on one host
    (halves on different hosts are never buddies: a merge never makes a group span hosts)."""
    c = a.cp_degree
    if b.cp_degree != c or a.host != b.host:
        return False
    lo = min(a.first_device, b.first_device)
    return abs(a.first_device - b.first_device) == c and lo % (2 * c) == 0


def merge_buddies(a: WorkerSpec, b: WorkerSpec, new_id: int,
                  max_input_len: Callable[[int], int]) -> WorkerSpec:
    """The degree-2C worker made of buddies `a` and `b`, on their host.

    Raises:
      ValueError: `a` and `b` are on different hosts, or are not buddies (not the two halves
        of one aligned group).
    """
    if a.host != b.host:
        raise ValueError(f"workers {a.worker_id} (host {a.host}) and {b.worker_id} (host {b.host}) "
                         "are on different hosts: a merge never makes a CP group span hosts")
    if not are_buddies(a, b):
        raise ValueError(f"workers {a.worker_id} (C={a.cp_degree}, devices from {a.first_device}) "
                         f"and {b.worker_id} (C={b.cp_degree}, devices from {b.first_device}) are not "
                         "buddies: merge needs the two aligned halves of one group")
    c = 2 * a.cp_degree
    per_device = a.kv_capacity_blocks // a.cp_degree
    return WorkerSpec(new_id, c, min(a.first_device, b.first_device), per_device * c,
                      max_input_len(c), a.host)


def host_degree_cap(specs: Iterable[WorkerSpec]) -> int:
    """The largest CP degree a merge can reach without spanning hosts: the largest power of two
    <= the devices any one host has in `specs` (0 for no workers). With every worker on host 0
    (one host) it is the pool's largest power of two, no cap in practice."""
    per_host: dict[int, int] = {}
    for s in specs:
        per_host[s.host] = per_host.get(s.host, 0) + s.cp_degree
    most = max(per_host.values(), default=0)
    return 1 << (most.bit_length() - 1) if most else 0
