"""`CompositionController.log`: the controller's latest evaluations as strict JSON (what
`GET /v1/controller` and `eval.load_shift` answer)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from serving.policy.composition import DECISIONS_KEPT
from tests.serving.policy.test_composition_target import run_70


def test_log_of_a_simulated_run():
    # The evaluations of item 26's case (70 req/s on [8, 8], 40 s): `log` copies the latest,
    # oldest first, with NaN / infinite figures as None; `changes_only` keeps those with a
    # change; `decisions` itself is unchanged.
    ctl, _ = run_70()
    assert len(ctl.decisions) >= 3
    kept = copy.deepcopy(list(ctl.decisions))
    last = ctl.log(2)
    assert [d["time"] for d in last] == [d["time"] for d in ctl.decisions[-2:]]
    for got, d in zip(last, ctl.decisions[-2:]):
        assert got["candidates"] == [[k, v if math.isfinite(v) else None]
                                     for k, v in d["candidates"]]
        assert {k: v for k, v in got.items() if k != "candidates"} == {
            k: v for k, v in d.items() if k != "candidates"}
    made = ctl.log(changes_only=True)
    assert made and [d["time"] for d in made] == [d["time"] for d in ctl.decisions
                                                   if d.get("kind")]
    assert len(ctl.log()) == len(ctl.decisions) and ctl.log(0) == []
    json.dumps(ctl.log(), allow_nan=False)
    assert list(ctl.decisions) == kept
    made[0]["old"].append(99)  # (a deep copy)
    assert list(ctl.decisions) == kept
    for bad in (-1, DECISIONS_KEPT + 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"limit must be an integer in \[0, "
                                             rf"{DECISIONS_KEPT}\], got {bad!r}"):
            ctl.log(bad)
