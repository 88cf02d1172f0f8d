"""eval.robustness_parts: parts of the user's own traces (`--extra_parts`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.paper_setup import LOADS
from eval.robustness_parts import extra_part_loaders
from eval.traces.sessions import SessionWorkload


def _mooncake(path, n=24, seed=0):
    """A Mooncake JSONL trace of `n` one-off requests (seeded lengths, 0.5 s apart)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(600, 3000))
        blocks = -(-length // 512)
        rows.append({"timestamp": 500 * i, "input_length": length, "output_length": 8,
                     "hash_ids": list(range(1000 * i, 1000 * i + blocks))})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def _sessions(folder, ids=("s1", "s2")):
    folder.mkdir()
    for sid in ids:
        (folder / f"{sid}.json").write_text(json.dumps({
            "id": sid, "block_size": 64, "hash_id_scope": "local",
            "requests": [{"t": 0.0, "type": "n", "in": 640, "out": 4,
                          "hash_ids": list(range(10))},
                         {"t": 2.0, "type": "n", "in": 1280, "out": 4, "think_time": 1.0,
                          "hash_ids": list(range(20))}]}))
    return folder


def test_extra_parts_are_named_by_kind_and_path_and_load_lazily(tmp_path, monkeypatch):
    trace = tmp_path / "mine.jsonl"
    rows = _mooncake(trace)
    folder = _sessions(tmp_path / "agents")
    parts = extra_part_loaders([f"production:{trace}", f" agents : {folder} "])
    assert list(parts) == [f"extra production: {trace}", f"extra agents: {folder}"]
    (kind, load), (akind, aload) = parts.values()
    assert (kind, akind) == ("production", "agents")
    reqs = load()
    assert [r.input_len for r in reqs] == [r["input_length"] for r in rows]
    assert [r.arrival_time for r in reqs] == [0.5 * i for i in range(len(rows))]
    sessions = aload()
    assert isinstance(sessions, SessionWorkload) and len(sessions.roots) == 2
    monkeypatch.setattr("eval.robustness_parts.QUICK_REQUESTS", 5)  # --quick: the first ones
    quick = extra_part_loaders([f"production:{trace}"], quick=True)
    assert [r.request_id for r in next(iter(quick.values()))[1]()] == [
        r.request_id for r in reqs[:5]]
    # nothing is read until a part is built: a file that turns malformed fails then
    late = extra_part_loaders([f"code:{trace}"])
    trace.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="input_length"):
        next(iter(late.values()))[1]()


@pytest.mark.parametrize("spec, message", [
    ("production", r"expected KIND:PATH with KIND one of \['agents', "),
    ("production:", "expected KIND:PATH"),
    ("chat:{trace}", "expected KIND:PATH"),
    ("agents:{missing}", "does not exist"),
])
def test_a_bad_extra_part_is_refused_naming_the_flag(tmp_path, spec, message):
    trace, missing = tmp_path / "t.jsonl", tmp_path / "nothing-here"
    _mooncake(trace)
    with pytest.raises(ValueError, match=message) as e:
        extra_part_loaders([spec.format(trace=trace, missing=missing)])
    assert str(e.value).startswith("--extra_parts ")


def test_sessions_given_as_a_request_workload_are_refused_when_built(tmp_path):
    folder = _sessions(tmp_path / "agents")
    (_, load), = extra_part_loaders([f"production:{folder}"]).values()
    with pytest.raises(ValueError, match=rf"holds agent sessions.*give it as agents:{folder}"):
        load()
    with pytest.raises(ValueError, match="not the string"):
        extra_part_loaders(f"production:{folder}")


def test_robustness_runs_only_the_extra_parts_against_the_best_baseline(tmp_path):
    """End to end on a small trace of one's own: `--parts=extra` runs it alone, at the load
    factors of its kind, and each cell's best baseline and change are those of a sweep run
    directly (the fastest baseline failing no more requests)."""
    import eval.robustness as rb
    from eval.experiment import ReplayConfig, run_sweep
    from eval.paper_setup import SETUPS

    trace = tmp_path / "mine.jsonl"
    _mooncake(trace, n=40, seed=3)
    rows = rb.run(str(tmp_path / "no traces"), str(tmp_path / "out"), ["qwen3-30b-a3b"], [],
                  False, ["extra"], extra=[f"code:{trace}"])
    assert {r["part"] for r in rows} == {f"extra code: {trace}"}
    assert [r["load_factor"] for r in rows] == list(LOADS["code"])
    _, degrees, baselines = SETUPS[0]
    cfg = ReplayConfig(model="qwen3-30b-a3b", degrees=degrees, load_factors=LOADS["code"],
                       num_gpus=40, systems=baselines + ("vertumnus",), seed=0)
    direct = run_sweep(extra_part_loaders([f"code:{trace}"])[f"extra code: {trace}"][1](),
                       "code", cfg)[0]
    for row in rows:
        at = [r for r in direct if r["load_factor"] == row["load_factor"]]
        ours = next(r for r in at if r["system"] == "vertumnus")
        fair = [r for r in at if r["system"] != "vertumnus"
                and r.get("failed", 0) <= ours.get("failed", 0)]
        best = min(fair, key=lambda r: r["mean_ttft_ms"])
        assert row["best_baseline"] == best["system"] and row["best_ms"] == best["mean_ttft_ms"]
        assert row["change"] == pytest.approx(ours["mean_ttft_ms"] / best["mean_ttft_ms"] - 1)
    saved = json.loads((tmp_path / "out" / "robustness.json").read_text())
    assert saved["settings"]["parts"] == [f"extra code: {trace}"]
    # a bad spec is refused before the output folder is made
    with pytest.raises(ValueError, match="--extra_parts"):
        rb.run(str(tmp_path), str(tmp_path / "bad"), ["qwen3-30b-a3b"], [], False, [],
               extra=["code"])
    assert not (tmp_path / "bad").exists()
