"""`GET /v1/controller` (`serving.api_controller`): the split/merge controller's latest
decisions as strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from serving.api_controller import DECISIONS_PER_CALL, strict_json
from tests.serving.api_fixtures import make_client


def _strict(text: str):
    """`text` parsed as JSON with NaN and the infinities refused (RFC 8259)."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _entry(t, kind=None, figure=0.1):
    """A `decisions` entry as `CompositionController.tick` logs one."""
    entry = {"time": t, "samples": 40, "early": False, "chosen": "stay",
             "candidates": [("stay", 0.2), ("split [0]", figure)],
             "reason": "no candidate beats staying by the margin"}
    if kind:
        entry.update(chosen="split [0]", kind=kind, old=[0], new=[5, 6], epoch=1, further=[],
                     reason="predicted mean TTFT 100.0 ms against 200.0 ms staying")
    return entry


def test_the_what_if_controllers_latest_evaluations():
    client, engine = make_client(controller_policy="whatif")
    with client:
        ctl = engine.controller
        t0 = engine.now()
        body = client.get("/v1/controller").json()
        assert body["controller"] == "whatif"
        assert t0 <= body["now"] <= engine.now()
        assert body["config"] == dataclasses.asdict(ctl.config)
        assert body["config"]["min_degree"] == 1 and body["config"]["max_degree"] == 8
        assert body["decisions"] == [] and body["decisions_kept"] == 0
        ctl.decisions += [_entry(1.0), _entry(2.0, "split", float("nan")), _entry(3.0),
                          _entry(4.0, figure=float("inf"))]
        r = client.get("/v1/controller", params={"decisions": 2})
        body = _strict(r.text)
        assert [d["time"] for d in body["decisions"]] == [3.0, 4.0]
        assert body["decisions"][1]["candidates"] == [["stay", 0.2], ["split [0]", None]]
        assert body["decisions_kept"] == 4
        body = _strict(client.get("/v1/controller?changes_only=true").text)
        [made] = body["decisions"]
        assert made["time"] == 2.0 and made["kind"] == "split" and made["new"] == [5, 6]
        assert made["candidates"][1] == ["split [0]", None]
        assert client.get("/v1/controller?decisions=0").json()["decisions"] == []
        assert len(client.get("/v1/controller").json()["decisions"]) == 4  # (default 20)
        assert ctl.decisions[1]["candidates"][1][1] != ctl.decisions[1]["candidates"][1][1]
        ctl.decisions += [_entry(10.0 + i) for i in range(DECISIONS_PER_CALL + 4)]
        body = client.get("/v1/controller", params={"decisions": DECISIONS_PER_CALL}).json()
        assert [d["time"] for d in body["decisions"]] == [
            10.0 + i for i in range(4, DECISIONS_PER_CALL + 4)]  # (the most recent)
        assert body["decisions_kept"] == DECISIONS_PER_CALL + 8
        for bad in (-1, DECISIONS_PER_CALL + 1, "many"):
            r = client.get("/v1/controller", params={"decisions": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "decisions"
        # (a query parameter that is no integer is named as such, not as `query`)
        r = client.get("/v1/workers", params={"reconfigurations": "many"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reconfigurations"


def test_the_paper_controller_and_none():
    client, engine = make_client(controller_policy="paper")
    with client:
        ctl = engine.controller
        body = client.get("/v1/controller").json()
        now = body.pop("now")
        assert 0 <= now <= engine.now()
        assert body == {"controller": "paper", "config": dataclasses.asdict(ctl.config),
                        "decisions": [], "decisions_kept": 0}
        assert body["config"]["upper"] == engine.config.controller_config.upper
        # (its changes, as `ReconfigurationController.tick` logs them)
        ctl.decisions += [{"time": 40.0 + t, "kind": "split", "reason": "load above upper "
                           "threshold", "load": 0.9 + t / 10, "long_share": float("nan"),
                           "old": [0], "new": [4, 5], "epoch": 1 + t} for t in range(3)]
        body = _strict(client.get("/v1/controller?decisions=2&changes_only=true").text)
        assert [(d["time"], d["epoch"], d["load"]) for d in body["decisions"]] == [
            (41.0, 2, pytest.approx(1.0)), (42.0, 3, pytest.approx(1.1))]
        assert body["decisions"][0]["long_share"] is None and body["decisions_kept"] == 3
        assert client.get("/v1/controller?decisions=0").json()["decisions"] == []
        assert math.isnan(ctl.decisions[1]["long_share"])
    client, engine = make_client()  # (no controller)
    with client:
        body = client.get("/v1/controller").json()
        assert 0 <= body.pop("now") <= engine.now()
        assert body == {"controller": None, "config": None, "decisions": None,
                        "decisions_kept": 0}


def test_strict_json():
    value = {"a": (1.5, float("inf")), "b": [{"c": float("nan")}, np.float32(0.25)],
             "d": np.int64(7), "e": -float("inf"), "f": "x", "g": None, "h": True}
    got = strict_json(value)
    assert got == {"a": [1.5, None], "b": [{"c": None}, 0.25], "d": 7, "e": None, "f": "x",
                   "g": None, "h": True}
    assert type(got["d"]) is int and type(got["b"][1]) is float
    assert json.loads(json.dumps(got, allow_nan=False)) == got
    assert math.isnan(value["b"][0]["c"]) and value["a"] == (1.5, float("inf"))

