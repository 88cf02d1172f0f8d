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
    with pytest.raises(ValueError, match=rf"^--extra_parts code:{trace}: .*input_length"):
        next(iter(late.values()))[1]()
    # read once: a second call returns the same object
    other = tmp_path / "b.jsonl"
    _mooncake(other, seed=1)
    (_, again), = extra_part_loaders([f"production:{other}"]).values()
    assert again() is again()


@pytest.mark.parametrize("spec, message", [
    ("production", r"expected KIND:PATH with KIND one of \['agents', "),
    ("production:", "expected KIND:PATH"),
    ("chat:{trace}", "expected KIND:PATH"),
    ("agents:{missing}", "does not exist"),
    ("production:mooncake:{missing}", "does not exist"),
    ("agents:{trace}", r"agents takes a folder of agent session files or one \.json session"),
    ("agents:mooncake:{folder}", "agents takes a folder"),
    ("production:{folder}", r"production takes a request trace file .*\(give it as agents:"),
    ("code:sessions:{folder}", "code takes a request trace file"),
])
def test_a_bad_extra_part_is_refused_naming_the_flag(tmp_path, spec, message):
    trace, missing = tmp_path / "t.jsonl", tmp_path / "nothing-here"
    _mooncake(trace)
    folder = _sessions(tmp_path / "agents")
    with pytest.raises(ValueError, match=message) as e:
        extra_part_loaders([spec.format(trace=trace, missing=missing, folder=folder)])
    assert str(e.value).startswith("--extra_parts ")


def test_format_prefixes_home_and_bad_contents(tmp_path, monkeypatch):
    named = tmp_path / "log.txt"  # a Mooncake trace whose name does not tell its format
    rows = _mooncake(named)
    (_, load), = extra_part_loaders([f"production:mooncake:{named}"]).values()
    assert [r.input_len for r in load()] == [r["input_length"] for r in rows]
    (_, load), = extra_part_loaders([f"production:{named}"]).values()
    with pytest.raises(ValueError, match=rf"^--extra_parts production:{named}: cannot tell the "
                       r"format .* as production:mooncake:PATH, "):
        load()
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is expanded
    (_, load), = extra_part_loaders(["code:mooncake:~/log.txt"]).values()
    assert len(load()) == len(rows)
    # a single session file given as a request trace, and too few requests for a rate
    one = _sessions(tmp_path / "one", ids=("x",)) / "x.json"
    (_, load), = extra_part_loaders([f"production:{one}"]).values()
    with pytest.raises(ValueError, match=r"\(a \.json session file: agents:PATH\)"):
        load()
    upper = one.with_name("Y.JSON")  # any case of .json, or any name with sessions:
    upper.write_text(one.read_text().replace('"x"', '"y"'))
    odd = one.with_name("z.log")
    odd.write_text(one.read_text().replace('"x"', '"z"'))
    for spec in (f"agents:{upper}", f"agents:sessions:{odd}"):
        (_, load), = extra_part_loaders([spec]).values()
        assert len(load().roots) == 1
    single = tmp_path / "single.jsonl"
    _mooncake(single, n=1)
    (_, load), = extra_part_loaders([f"code:{single}"]).values()
    with pytest.raises(ValueError, match=r"at least 2 requests spread over time.*got 1 over 0 s"):
        load()
    with pytest.raises(ValueError, match="not the string"):
        extra_part_loaders(f"production:{single}")


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
    assert (tmp_path / "out" / "robustness.md").read_text().startswith(
        f"Run: models qwen3-30b-a3b; parts extra code: {trace}; ")
    # a bad spec, or a trace that turns out malformed, is refused before the output folder is
    # made and before any part runs
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0}\n{"timestamp": 1}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    for extra in (["code"], [f"code:{broken}"], [f"agents:{empty}", f"code:{broken}"]):
        with pytest.raises(ValueError, match="--extra_parts '?" + extra[0][:4]):  # (in order)
            rb.run(str(tmp_path), str(tmp_path / "bad"), ["qwen3-30b-a3b"], [], False,
                   ["stand-in", "extra"], extra=extra)
        assert not (tmp_path / "bad").exists()


def test_the_run_line_names_the_extra_parts():
    from eval.robustness import settings_line
    base = {"models": ["qwen3-32b"], "seeds": [1], "quick": False}
    builtin = [f"part {i}" for i in range(14)]
    assert settings_line({**base, "parts": builtin + ["extra agents: x"], "all_parts": True}) \
        == "Run: models qwen3-32b; all 14 parts and extra agents: x; re-run under noise seeds 1."
    assert settings_line({**base, "parts": ["part 3", "extra code: y"], "all_parts": False}) \
        == "Run: models qwen3-32b; parts part 3 and extra code: y; re-run under noise seeds 1."
    assert settings_line({**base, "parts": builtin, "all_parts": True}) \
        == "Run: models qwen3-32b; all 14 parts; re-run under noise seeds 1."
