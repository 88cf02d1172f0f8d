"""`GET /v1/controller`: the split/merge controller and its latest decisions.

Answers `controller` ("whatif", `serving.policy.composition.CompositionController`; "paper",
`serving.policy.controller.ReconfigurationController`; None with `--nocontroller`), its
`config` (the knobs, times in seconds), `now` (the engine's clock, seconds since it was built)
and its latest `?decisions=N` decisions (default 20, at most `DECISIONS_PER_CALL` a call),
oldest first, and `decisions_kept`, how many it keeps now:

- the what-if controller logs every evaluation (every `interval_s` while requests arrive; at
  most `DECISIONS_KEPT`; `CompositionController.log`): `time` (engine clock, s), `samples`
  (the window's arrivals), `early`, the `candidates` compared as `[label, figure]`, `chosen`,
  `reason`, and for a change `kind`, `old`, `new`, `epoch`, `further`; `?changes_only=true`
  keeps those that made a change;
- the paper's threshold controller logs only its changes: `time`, `kind`, `reason`, `load`,
  `long_share`, `old`, `new`, `epoch` (`changes_only` changes nothing).

The body is strict JSON (RFC 8259): a figure that is NaN or infinite is null.
"""

from __future__ import annotations

import dataclasses
import math

from fastapi import FastAPI

from serving.policy.composition import CompositionController

DEFAULT_DECISIONS = 20  # decisions answered without `?decisions=`
# The most one call answers (as `/v1/workers`' reconfigurations): the body is built on the
# event loop that schedules the prefills (4,096 evaluations are 2.4 MB, about 0.3 s).
DECISIONS_PER_CALL = 256


def strict_json(value):
    """`value` (dicts, lists, tuples, numbers, strings, None, numpy scalars) with every float
    that is NaN or infinite replaced by None, tuples as lists and numpy scalars as Python
    numbers: what `json.dumps(..., allow_nan=False)` accepts. A new object; `value` unchanged."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def add_controller_routes(app: FastAPI, *, engine, error) -> None:
    """Adds `GET /v1/controller` to `app` for `engine`; `error(status, message, param)` is
    the app's error (400 naming `decisions` outside [0, DECISIONS_PER_CALL])."""

    @app.get("/v1/controller")
    async def controller(decisions: int = DEFAULT_DECISIONS, changes_only: bool = False):
        if not 0 <= decisions <= DECISIONS_PER_CALL:
            raise error(400, f"decisions must be in [0, {DECISIONS_PER_CALL}], got "
                             f"{decisions}", "decisions")
        ctl = engine.controller
        if ctl is None:
            return {"controller": None, "config": None, "now": engine.now(),
                    "decisions": None, "decisions_kept": 0}
        if isinstance(ctl, CompositionController):
            kind, log = "whatif", ctl.log(decisions, changes_only)
        else:  # the paper's: its changes only
            kind, log = "paper", ctl.decisions[max(0, len(ctl.decisions) - decisions):]
        return strict_json({"controller": kind, "config": dataclasses.asdict(ctl.config),
                            "now": engine.now(), "decisions": log,
                            "decisions_kept": len(ctl.decisions)})
