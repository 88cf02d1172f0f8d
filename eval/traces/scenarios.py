"""Time-varying workloads for the reconfiguration experiment.

`phased_workload` concatenates phases, each a window of a source workload replayed at its own
rate: e.g. agent traffic at a moderate rate, then at a high rate, then a long-document phase.
The controller is judged on how its composition follows the phases (`summarize_phases`: the
metrics of each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from eval.metrics import summarize
from eval.traces.workloads import scale_to_rate
from serving.policy.request import Request, RequestRecord


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase: `source` requests (sorted by arrival) replayed at `rate` req/s for `duration_s`.

    Raises:
      ValueError: a non-positive rate or duration, or an empty source.
    """

    name: str
    source: Sequence[Request]
    rate: float
    duration_s: float

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError(f"phase {self.name!r}: source has no requests")
        if not (self.rate > 0 and self.duration_s > 0):
            raise ValueError(f"phase {self.name!r}: rate and duration_s must be > 0, got "
                             f"{self.rate}, {self.duration_s}")


def phased_workload(phases: Sequence[Phase]) -> list[Request]:
    """The phases back to back, each starting when the previous one's duration ends.

    A phase keeps the first `duration_s` seconds of its source scaled to `rate` (fewer requests
    if the source runs out). Request ids become `"<phase name>/<original id>"`.

    Returns:
      Requests sorted by arrival time (seconds from 0).
    """
    out: list[Request] = []
    start = 0.0
    for ph in phases:
        scaled = scale_to_rate(ph.source, ph.rate)
        t0 = scaled[0].arrival_time
        for r in scaled:
            t = r.arrival_time - t0
            if t >= ph.duration_s:
                break
            out.append(dataclasses.replace(r, request_id=f"{ph.name}/{r.request_id}",
                                           arrival_time=start + t))
        start += ph.duration_s
    return out


def phase_of(request_id: str) -> str:
    """The phase name of a request id made by `phased_workload`."""
    return str(request_id).split("/", 1)[0]


def summarize_phases(records: Sequence[RequestRecord], phases: Sequence[Phase]) -> dict[str, dict]:
    """`eval.metrics.summarize` of each phase's records (by `phase_of` their request id), by
    phase name, in the order of `phases`."""
    by_phase: dict[str, list[RequestRecord]] = {ph.name: [] for ph in phases}
    for r in records:
        got = by_phase.get(phase_of(r.request.request_id))
        if got is not None:
            got.append(r)
    return {name: summarize(rs) for name, rs in by_phase.items()}
