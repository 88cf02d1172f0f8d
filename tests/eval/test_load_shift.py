"""eval.load_shift: the overload case of issue 15 after a quiet phase of long prompts."""

from __future__ import annotations

import json
import types

import pytest

from eval.load_shift import controller_changes, run
from serving.policy.composition import CompositionConfig, CompositionController


def test_the_controller_splits_when_the_short_prompts_arrive():
    # Two minutes of 24K-token prompts at 0.5 req/s (large workers are best), then 40 s of
    # 2K-token prompts at 90 req/s, more than CP-8 or CP-4 workers serve (about 63 and 82 a
    # second on the 16 GPUs): the default policy splits once the heavy phase starts and is
    # faster there than a pool left at CP-8.
    data, md = run([90.0], light_rate=0.5, light_s=120.0, heavy_s=40.0,
                   systems=("homogeneous-cp8", "vertumnus"))
    at = data["90"]
    ours, cp8 = at["vertumnus"], at["homogeneous-cp8"]
    for system in (ours, cp8):
        phases = system["phases"]
        assert phases["long-light"]["num_requests"] + phases["short-heavy"]["num_requests"] \
            == system["overall"]["num_requests"]
        assert system["overall"]["failed"] == 0
    splits = [x for x in ours["reconfigurations"] if x["kind"] == "split"]
    assert splits and all(x["started"] >= 120.0 for x in splits), ours["reconfigurations"]
    assert ours["phases"]["short-heavy"]["mean_ttft_ms"] < \
        0.5 * cp8["phases"]["short-heavy"]["mean_ttft_ms"]
    assert any(line.startswith("| vertumnus |") for line in md)
    # each split's evaluation is in the JSON with the candidates it compared (the first one
    # made: the change chosen, then staying's and the change's figures)
    changes = ours["controller_changes"]
    assert changes and cp8["controller_changes"] is None
    first = changes[0]
    assert (first["time"], first["epoch"]) == (splits[0]["started"], 1) and first[
        "reason"].startswith("predicted mean TTFT"), first
    figures = dict(first["candidates"])
    assert first["chosen"] in figures and figures["stay"] > 0
    # strict JSON: NaN and infinities as None
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_controller_changes_are_strict_json():
    # a logged NaN or infinity becomes None; the evaluations that made no change are left out
    ctl = CompositionController(CompositionConfig(), lambda c: 100_000)
    made = {"time": 2.0, "kind": "split", "old": [0], "new": [2, 3], "epoch": 1,
            "further": [], "chosen": "split [0]", "reason": "r"}
    ctl.decisions += [{"time": 1.0, "chosen": "stay", "reason": "r", "candidates": [
        ("stay", 0.5)]}, {**made, "candidates": [("stay", float("nan")), ("split [0]", 0.25),
                                                 ("target", float("inf"))]}]
    got = controller_changes(types.SimpleNamespace(setup=[ctl.attach]))
    assert got == [{**made, "candidates": [["stay", None], ["split [0]", 0.25],
                                          ["target", None]]}]
    assert controller_changes(types.SimpleNamespace(setup=[lambda s: None])) is None


@pytest.mark.parametrize("kw, message", [
    (dict(light_rate=0.0), "--light_rate must be finite and > 0"),
    (dict(heavy_s=float("inf")), "--heavy_s must be finite and > 0"),
    (dict(heavy_rates=[-1.0]), "--heavy_rates must be finite and > 0"),
    (dict(heavy_rates=[]), "--heavy_rates and --systems must name at least one"),
    (dict(systems=()), "--heavy_rates and --systems must name at least one"),
    (dict(systems=("nosuch",)), "--systems: unknown system 'nosuch'"),
    # the phases draw from fixed pools of 4,000 long and 40,000 short prompts: a setting that
    # would run one dry (and cut its phase short) is refused
    (dict(light_rate=10.0, light_s=401.0), r"--light_rate x --light_s must be <= 4000"),
    (dict(heavy_rates=[500.0], heavy_s=81.0), r"--heavy_rates x --heavy_s must be <= 40000")])
def test_bad_settings_name_the_flag(kw, message):
    args = dict(heavy_rates=[90.0], light_rate=1.0, light_s=10.0, heavy_s=10.0,
                systems=("vertumnus",))
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        run(**args)
