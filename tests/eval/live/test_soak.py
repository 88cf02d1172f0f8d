"""The soak test's pure logic on hand-made cases: request accounting, first-token consistency,
the choice of splits and merges, the result's verdict and table (no server)."""

from __future__ import annotations

import collections
import os
import random
import types

import pytest

from eval.live.soak_config import PromptSet, SoakConfig, rss_mib
from eval.live.soak_ledger import FirstTokens, Ledger, Outcome, classify_completion, distribution
from eval.live.soak_ops import Operation, choose_operation, next_kind
from eval.live.soak_report import assemble, failures, server_log_errors, table


def _body(cid="cmpl-1", token=7, prompt_tokens=12, degree=2):
    return {"id": cid, "choices": [{"token_ids": [token]}], "worker_id": 3, "cp_degree": degree,
            "usage": {"prompt_tokens": prompt_tokens}}


def test_classify_completion():
    assert classify_completion(200, _body(), 12) == Outcome("answered", 200, "cmpl-1")
    assert classify_completion(429, {"error": {"message": "busy"}}, 12).kind == "refused"
    assert classify_completion(503, None, 12) == Outcome("refused", 503, "shutting down")
    lost = classify_completion(500, {"error": {"message": "boom"}}, 12)
    assert lost == Outcome("lost", 500, "HTTP 500: boom")
    assert classify_completion(400, "x", 12).detail == "HTTP 400"  # our prompts are valid
    # a 200 is an answer only with a valid body
    for body, why in ((None, "not a JSON object"), (_body(cid="x"), "cmpl-"),
                      ({**_body(), "choices": []}, "token_ids"),
                      (_body(token="7"), "not an int"), (_body(token=True), "not an int"),
                      ({**_body(), "cp_degree": None}, "cp_degree"),
                      (_body(prompt_tokens=40), "prompt_tokens 40 != 12")):
        out = classify_completion(200, body, 12)
        assert out.kind == "lost" and out.detail.startswith("invalid body") and why in out.detail


def test_ledger_counts_each_request_once():
    led = Ledger()
    for rid in "abcdef":
        led.sent(rid)
    led.answered("a", "cmpl-a")
    led.answered("b", "cmpl-b")
    led.refused("c", 429)
    led.lost("d", "ReadTimeout: timed out")
    led.record("e", classify_completion(500, {"error": {"message": "x"}}, 1))
    # "f" never got an outcome: in flight during the run, lost at its end
    running = led.summary(final=False)
    assert (running["in_flight"], running["lost"]) == (1, 2)
    s = led.summary()
    assert s["in_flight"] == 0
    assert (s["sent"], s["answered"], s["refused"], s["lost"], s["duplicated"]) == (6, 2, 1, 3, 0)
    assert s["refused_by_code"] == {"429": 1}
    assert s["lost_reasons"] == {"ReadTimeout": 1, "HTTP 500": 1, "no outcome": 1}
    assert {e["request"] for e in s["lost_examples"]} == {"d", "e", "f"}
    assert led.num_sent == 6
    with pytest.raises(ValueError):
        led.sent("a")  # ids are unique
    with pytest.raises(KeyError):
        led.answered("zz", "cmpl-z")  # never sent


def test_ledger_detects_duplicates():
    led = Ledger()
    for rid in ("a", "b", "c", "d"):
        led.sent(rid)
    led.answered("a", "cmpl-1")
    led.answered("a", "cmpl-2")  # two outcomes for one request
    led.answered("b", "cmpl-3")
    led.answered("c", "cmpl-3")  # one completion answered to two requests
    led.refused("d", 503)
    s = led.summary()
    assert s["duplicated"] == 2 and s["answered"] == 3 and s["lost"] == 0
    assert {"completion_id": "cmpl-3", "requests": ["b", "c"]} in s["duplicated_examples"]
    assert any(e.get("request") == "a" and e["outcome"] == 2 and e["detail"] == "cmpl-2"
               for e in s["duplicated_examples"])
    led.answered("a", "cmpl-1")  # a third outcome: still one duplicated request
    assert led.summary()["duplicated"] == 2
    # the first outcome counts: a lost request that later got an answer is lost and duplicated
    led2 = Ledger()
    led2.sent("x")
    led2.lost("x", "RemoteProtocolError: closed")
    led2.answered("x", "cmpl-9")
    s2 = led2.summary()
    assert (s2["lost"], s2["answered"], s2["duplicated"]) == (1, 0, 1)


def test_first_tokens_consistency():
    ft = FirstTokens()
    for degree in (1, 2, 4, 8):
        ft.record(0, 11, degree)  # same token at every degree
    ft.record(1, 5, 2)
    ft.record(1, 5, 2)  # one degree only
    ft.record(2, 9, 1)
    ft.record(2, 9, 4)
    ft.record(2, 3, 8)  # differs at CP-8
    assert ft.mismatches() == [{"prompt": 2, "tokens": {"3": [8], "9": [1, 4]}}]
    s = ft.summary()
    assert (s["prompts"], s["observations"], s["multi_degree_prompts"],
            s["mismatched_prompts"]) == (3, 9, 2, 1)
    assert s["degrees_seen"] == [1, 2, 4, 8]
    assert FirstTokens().summary()["degrees_seen"] == []


def _workers(*spec):
    """(worker_id, cp_degree, first_device[, status]) tuples as `GET /v1/workers` lists them."""
    return [{"worker_id": s[0], "cp_degree": s[1], "first_device": s[2],
             "status": s[3] if len(s) > 3 else "active"} for s in spec]


def test_choose_operation_legal_and_alternating():
    rng = random.Random(0)
    two_fours = _workers((0, 4, 0), (1, 4, 4))
    assert choose_operation(two_fours, (1, 2, 4, 8), "split", rng).kind == "split"
    assert choose_operation(two_fours, (1, 2, 4, 8), "merge", rng) == Operation("merge", (0, 1))
    # no CP-8 allowed: no merge, so a split even when a merge is preferred
    assert choose_operation(two_fours, (2, 4), "merge", rng).kind == "split"
    # 2,2,2,2: buddies are (0,1) and (2,3), never (1,2)
    twos = _workers((0, 2, 0), (1, 2, 2), (2, 2, 4), (3, 2, 6))
    merges = {choose_operation(twos, (1, 2, 4), "merge", random.Random(s)).worker_ids
              for s in range(30)}
    assert merges == {(0, 1), (2, 3)}
    # draining workers are neither split nor merged
    mixed = _workers((5, 4, 0, "draining"), (6, 2, 4), (7, 1, 6), (8, 1, 7))
    picks = {choose_operation(mixed, (1, 2, 4, 8), "split", random.Random(s))
             for s in range(30)}
    assert picks == {Operation("split", (6,))}
    assert choose_operation(mixed, (1, 2, 4, 8), "merge", rng) == Operation("merge", (7, 8))
    # nothing legal: all degree 1 without CP-2, or everything draining
    ones = _workers(*[(i, 1, i) for i in range(8)])
    assert choose_operation(ones, (1,), "merge", rng) is None
    assert choose_operation(_workers((0, 8, 0, "draining")), (1, 2, 4, 8), "split", rng) is None
    assert Operation("split", (3,)).path_and_body() == ("/v1/workers/split", {"worker_id": 3})
    assert Operation("merge", (3, 4)).path_and_body() == ("/v1/workers/merge",
                                                          {"worker_ids": [3, 4]})


def test_distribution_and_prompts_and_rss():
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d == {"n": 4, "mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "max": 4.0}
    assert distribution([])["mean"] is None
    p = PromptSet(vocab_size=100, lengths=(12, 40), repeated=4, repeat_fraction=0.5, seed=1)
    assert [len(x) for x in p.repeated] == [12, 40, 12, 40]
    picks = [p.pick(n) for n in range(200)]
    assert picks == [p.pick(n) for n in range(200)]  # deterministic
    repeated = [i for i, _ in picks if i is not None]
    assert 60 < len(repeated) < 140 and set(repeated) == {0, 1, 2, 3}
    assert all(toks == p.repeated[i] for i, toks in picks if i is not None)
    unique = [tuple(t) for i, t in picks if i is None]
    assert len(set(unique)) == len(unique) and {len(t) for t in unique} == {12, 40}
    assert all(0 <= t < 100 for _, toks in picks for t in toks)
    assert rss_mib(None) is None
    if os.path.exists(f"/proc/{os.getpid()}/status"):
        assert rss_mib(os.getpid()) > 1.0
    with pytest.raises(ValueError):
        SoakConfig(url="u", admin_api_key="k", repeat_fraction=1.5)


def _run(ops, lost=0, mismatch=False):
    cfg = SoakConfig(url="http://x", admin_api_key="secret", operations=3)
    led, ft = Ledger(), FirstTokens()
    for k in range(5):
        led.sent(str(k))
        if k < lost:
            led.lost(str(k), "ConnectError: refused")
        else:
            led.answered(str(k), f"cmpl-{k}")
    ft.record(0, 1, 2)
    ft.record(0, 2 if mismatch else 1, 4)
    return types.SimpleNamespace(
        cfg=cfg, ops=ops, ledger=led, tokens=ft, latencies_ms=[10.0, 20.0],
        op_refused=collections.Counter({409: 1}), op_refusal_examples=[], op_errors=[],
        stuck=None, rss=[(0.0, 500.0), (5.0, 520.0)], rss_warm=510.0,
        poll_errors=collections.Counter(), elapsed=lambda: 12.0)


def test_result_verdict_and_table(tmp_path):
    ops = [{"epoch": 1, "kind": "split", "old": [0], "new": [2, 3], "started": 1.0,
            "drained": 1.2, "finished": 1.5, "composition": [2, 2, 4], "client_s": 0.6,
            "at_s": 0.9},
           {"epoch": 2, "kind": "merge", "old": [2, 3], "new": [4], "started": 3.0,
            "drained": 3.1, "finished": 3.4, "composition": [4, 4], "client_s": 0.5,
            "at_s": 2.9}]
    state = {"composition": [4, 4], "epoch": 2}
    good = assemble(_run(ops), "done", state, state, 0.1)
    assert "admin_api_key" not in good["config"] and failures(good) == []
    assert good["reconfigurations"]["time_s"]["server_total"]["max"] == pytest.approx(0.5)
    assert (good["reconfigurations"]["splits"], good["reconfigurations"]["merges"]) == (1, 1)
    assert good["rss_mib"] == {"start": 500.0, "after_warmup": 510.0, "end": 520.0,
                               "max": 520.0, "samples": [(0.0, 500.0), (5.0, 520.0)]}
    text = table(good)
    assert "| requests sent" in text and "500 / 510 / 520 / 520" in text and "409: 1" in text
    bad = assemble(_run(ops, lost=2, mismatch=True), "stuck", state, None, 0.1)
    bad["reconfigurations"]["stuck"] = {"kind": "merge", "epoch": 3}
    bad["server_exit_status"] = 1
    why = failures(bad)
    assert len(why) == 4 and "2 requests lost" in why[0] and "first tokens" in why[1]
    log = tmp_path / "server.log"
    log.write_text("I0101 fine\nE0101 12:00:00 engine.py:1] scheduler tick failed\n"
                   "Traceback (most recent call last):\nINFO ok\n")
    assert server_log_errors(str(log))["lines"] == 2
    assert server_log_errors(str(tmp_path / "absent"))["lines"] is None


def _sweep(workers, steps, walk="sweep", degrees=(1, 2, 4, 8)):
    """Plays `steps` operations of `walk` on a simulated pool; returns the compositions met."""
    rng, last, seen = random.Random(0), None, []
    next_id = 100
    for _ in range(steps):
        op = choose_operation(workers, degrees, next_kind(walk, last, False, rng), rng)
        last = op.kind
        ws = {w["worker_id"]: w for w in workers}
        if op.kind == "split":
            w = ws.pop(op.worker_ids[0])
            c = w["cp_degree"] // 2
            new = [(next_id, c, w["first_device"]), (next_id + 1, c, w["first_device"] + c)]
        else:
            a, b = (ws.pop(i) for i in op.worker_ids)
            new = [(next_id, 2 * a["cp_degree"], min(a["first_device"], b["first_device"]))]
        next_id += 2
        workers = sorted(list(ws.values()) + _workers(*new), key=lambda w: w["first_device"])
        seen.append(tuple(w["cp_degree"] for w in workers))
    return seen


def test_walks():
    rng = random.Random(0)
    assert next_kind("sweep", None, False, rng) == "split"
    assert next_kind("sweep", "split", False, rng) == "split"
    assert next_kind("sweep", "merge", False, rng) == "merge"
    assert next_kind("sweep", "split", True, rng) == "merge"  # refused: turn round
    assert next_kind("alternate", "split", False, rng) == "merge"
    assert next_kind("alternate", "merge", False, rng) == "split"
    assert {next_kind("random", "split", False, rng) for _ in range(50)} == {"split", "merge"}
    # from 4,4 a sweep reaches eight CP-1 workers and one CP-8 worker, and again
    seen = _sweep(_workers((0, 4, 0), (1, 4, 4)), 30)
    assert seen[5] == (1,) * 8 and seen[12] == (8,) and seen[19] == (1,) * 8
    assert seen[26] == (8,)
    # alternating from 4,4 only toggles one CP-4 worker
    assert {max(c) for c in _sweep(_workers((0, 4, 0), (1, 4, 4)), 10, "alternate")} == {4}
