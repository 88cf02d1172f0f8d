"""The soak test's pure logic on hand-made cases: request accounting, first-token consistency,
the choice of splits and merges, the result's verdict and table (no server)."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import types

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from eval.live.soak_config import PromptSet, SoakConfig, rss_mib
from eval.live.soak_ledger import FirstTokens, Ledger, Outcome, classify_completion, distribution
from eval.live.soak_ops import Operation, choose_operation, next_kind
from eval.live.soak_report import (EXIT_STATUS, assemble, failures, server_log_errors, table,
                                   verdict)
from eval.live.soak_server import check_counts, metric_counts, pool_idle


def _body(cid="cmpl-1", token=7, prompt_tokens=12, degree=2):
    return {"id": cid, "choices": [{"token_ids": [token]}], "worker_id": 3, "cp_degree": degree,
            "usage": {"prompt_tokens": prompt_tokens}}


def test_classify_completion():
    assert classify_completion(200, _body(), 12) == Outcome("answered", 200, "cmpl-1")
    assert classify_completion(429, {"error": {"message": "busy"}}, 12).kind == "refused"
    assert classify_completion(503, None, 12) == Outcome("refused", 503, "shutting down")
    fits = {"error": {"message": "input_len=40 tokens cannot be held by any worker (...); retry"}}
    assert classify_completion(503, fits, 40) == Outcome("refused", 503, "no worker fits")
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
    p = PromptSet(vocab_size=100, lengths=(12, 40), repeated=4, repeat_fraction=0.5, seed=1,
                  disconnect_fraction=0.1)
    assert all(12 <= len(x) <= 40 for x in p.repeated)
    picks = [p.pick(n) for n in range(200)]
    assert picks == [p.pick(n) for n in range(200)]  # deterministic
    repeated = [i for i, _ in picks if i is not None]
    assert 60 < len(repeated) < 140 and set(repeated) == {0, 1, 2, 3}
    assert all(toks == p.repeated[i] for i, toks in picks if i is not None)
    unique = [tuple(t) for i, t in picks if i is None]
    assert len(set(unique)) == len(unique)
    lengths = {len(t) for t in unique}  # drawn from the range: a swap shows in prompt_tokens
    assert len(lengths) > 20 and min(lengths) >= 12 and max(lengths) <= 40
    assert {1 << max(4, (n - 1).bit_length()) for n in lengths} == {16, 32, 64}  # padded
    assert all(0 <= t < 100 for _, toks in picks for t in toks)
    gone = [n for n in range(2000) if p.abandons(n)]
    assert 120 < len(gone) < 280 and gone == [n for n in range(2000) if p.abandons(n)]
    assert not any(PromptSet(100, (5, 5), 1, 0.0, 1).abandons(n) for n in range(100))
    assert {len(PromptSet(100, (5, 5), 1, 0.0, 1).pick(n)[1]) for n in range(20)} == {5}
    assert rss_mib(None) is None
    if os.path.exists(f"/proc/{os.getpid()}/status"):
        assert rss_mib(os.getpid()) > 1.0
    for bad in ({"repeat_fraction": 1.5}, {"prompt_lengths": (40, 12)},
                {"prompt_lengths": (12,)}, {"max_refused_fraction": -0.1},
                {"disconnect_fraction": 2.0}, {"disconnect_after_s": -1.0},
                {"degrees": (3, 5)}, {"degrees": ()}, {"degrees": (2, 128)}):
        with pytest.raises(ValueError):
            SoakConfig(url="u", admin_api_key="k", **bad)


def _run(ops, lost=0, mismatch=False, refused=0, answered=5, abandoned=0):
    """A finished run's state: `answered` answers (the first `lost` of them lost instead),
    `refused` 503s, `abandoned` abandoned requests."""
    cfg = SoakConfig(url="http://x", admin_api_key="secret", operations=3)
    led, ft = Ledger(), FirstTokens()
    for k in range(answered + refused + abandoned):
        led.sent(str(k))
        if k < lost:
            led.lost(str(k), "ConnectError: refused")
        elif k < answered:
            led.answered(str(k), f"cmpl-{k}")
        elif k < answered + refused:
            led.refused(str(k), 503, "input_len=9 tokens cannot be held by any worker")
        else:
            led.abandoned(str(k))
    ft.record(0, 1, 2)
    ft.record(0, 2 if mismatch else 1, 4)
    return types.SimpleNamespace(
        cfg=cfg, ops=ops, ledger=led, tokens=ft, latencies_ms=[10.0, 20.0],
        op_refused=collections.Counter({409: 1}), op_refusal_examples=[], op_errors=[],
        stuck=None, rss=[(0.0, 500.0), (5.0, 520.0)], rss_warm=510.0,
        poll_errors=collections.Counter(), elapsed=lambda: 12.0)


def _counters(success=0, failure=0, aborted=0, rejected=0):
    return {"success": success, "failure": failure, "aborted": aborted, "rejected": rejected,
            "rejected_by_reason": {"no_worker_fits": rejected}}


def _result(run, reason="done", **server):
    """`assemble` with the server counters `server` (default: consistent with the ledger)."""
    s = run.ledger.summary()
    server = server or {"success": s["answered"] + s["abandoned"], "rejected": s["refused"]}
    counts = check_counts(_counters(), _counters(**server), s)
    state = {"composition": [4, 4], "epoch": 2}
    return assemble(run, reason, state, state, 0.1, counts)


_OPS = [{"epoch": 1, "kind": "split", "old": [0], "new": [2, 3], "started": 1.0, "drained": 1.2,
         "finished": 1.5, "composition": [2, 2, 4], "client_s": 0.6, "at_s": 0.9},
        {"epoch": 2, "kind": "merge", "old": [2, 3], "new": [4], "started": 3.0, "drained": 3.1,
         "finished": 3.4, "composition": [4, 4], "client_s": 0.5, "at_s": 2.9}]


def test_result_verdict_and_table(tmp_path):
    good = _result(_run(_OPS, abandoned=2))
    assert "admin_api_key" not in good["config"] and failures(good) == []
    assert verdict(good) == "passed" and EXIT_STATUS["passed"] == 0
    assert good["reconfigurations"]["time_s"]["server_total"]["max"] == pytest.approx(0.5)
    assert (good["reconfigurations"]["splits"], good["reconfigurations"]["merges"]) == (1, 1)
    assert good["rss_mib"] == {"start": 500.0, "after_10pct_operations": 510.0, "end": 520.0,
                               "max": 520.0, "samples": [(0.0, 500.0), (5.0, 520.0)]}
    text = table(good)
    assert "| requests sent" in text and "500 / 510 / 520 / 520" in text and "409: 1" in text
    assert "7 / 0 / 0 / 0 (sum 7, expected 7, consistent; abandoned: 2 completed" in text
    bad = _result(_run(_OPS, lost=2, mismatch=True), "stuck")
    bad["reconfigurations"]["stuck"] = {"kind": "merge", "epoch": 3}
    bad["server_exit_status"] = 1
    why = failures(bad)
    assert len(why) == 4 and "2 requests lost" in why[0] and "first tokens" in why[1]
    assert verdict(bad) == "failed" and EXIT_STATUS["failed"] == 1
    # max_duration_s passed first: not passed, exit 2; a Ctrl-C: 130
    assert verdict(_result(_run(_OPS), "deadline")) == "incomplete" == \
        {v: k for k, v in EXIT_STATUS.items()}[2]
    assert verdict(_result(_run(_OPS), "interrupted")) == "interrupted"
    assert verdict({**good, "stop_reason": "operations refused", "failures": []}) == "failed"
    assert failures(_result(_run(_OPS), "operations refused")) == [
        "the operations stopped early: operations refused"]
    # error lines in the launched server's log fail the run
    log = tmp_path / "server.log"
    log.write_text("I0101 fine\nE0101 12:00:00 engine.py:1] scheduler tick failed\n"
                   "Traceback (most recent call last):\nINFO ok\n")
    assert server_log_errors(str(log))["lines"] == 2
    assert server_log_errors(str(tmp_path / "absent"))["lines"] is None
    for errors, what in ((server_log_errors(str(log)), "2 error lines"),
                         ({"lines": None, "examples": []}, "cannot be read")):
        logged = {**good, "server_log": str(log), "server_log_errors": errors}
        assert len(failures(logged)) == 1 and what in failures(logged)[0]
    assert failures({**good, "server_log_errors": {"lines": 0, "examples": []}}) == []


def test_refusals_and_silence_fail():
    """A server refusing every completion (503) or answering none fails; one refusal in a
    thousand (max_refused_fraction 0.001) does not."""
    all_503 = failures(_result(_run(_OPS, answered=0, refused=900)))
    assert len(all_503) == 2 and "900 of 900 requests refused ({'no worker fits': 900})" in \
        all_503[0] and "no request was answered (900 sent)" in all_503[1]
    assert failures(_result(_run(_OPS, answered=999, refused=1))) == []
    assert "2 of 1001 requests refused" in failures(_result(_run(_OPS, answered=999,
                                                                 refused=2)))[0]
    text = table(_result(_run(_OPS, answered=3, refused=1)))
    assert "| 1 (no worker fits: 1) |" in text


def test_server_counters_against_the_ledger():
    req = {"answered": 10, "refused": 1, "abandoned": 3, "lost": 0}
    zero = _counters()

    def problems(**end):
        return check_counts(zero, _counters(**end), req)["problems"]

    ok = check_counts(zero, _counters(success=12, aborted=1, rejected=1), req)
    assert ok["problems"] == [] and (ok["counted"], ok["expected"]) == (14, 14)
    assert ok["abandoned_completed"] == 2 and ok["rejected_by_reason"] == {"no_worker_fits": 1}
    assert "a request ran twice" in problems(success=13, aborted=1, rejected=1)[0]
    uncounted = problems(success=9, aborted=3, rejected=1)  # an answer it never counted
    assert "answered requests it did not count" in uncounted[0] and "1 never" in uncounted[1]
    assert "failed server-side" in problems(success=12, failure=1, rejected=1)[0]
    assert "only 3 were abandoned" in problems(success=10, aborted=4, rejected=1)[0]
    assert "for 1 refused" in problems(success=13, aborted=1)[0]
    # a lost request may or may not have reached the server
    lost = {**req, "lost": 2}
    assert check_counts(zero, _counters(success=14, aborted=1, rejected=1), lost)["problems"] == []
    assert check_counts(None, zero, req) == {
        "read": False, "problems": ["GET /metrics could not be read at the start"]}
    assert failures(_result(_run(_OPS), success=6)) == [
        "server counters: the server counted 6 requests ended (success + aborted + rejected + "
        "failure) for 5 sent that reached it: a request ran twice"]


def test_metric_counts_and_idle_pool():
    r = CollectorRegistry()
    success = Counter("vertumnus:request_success", "x",
                      ["model_name", "engine", "finished_reason"], registry=r)
    success.labels("m", "0", "length").inc(7)
    Counter("vertumnus:request_failure", "x", ["model_name"], registry=r).labels("m")
    Counter("vertumnus:request_aborted", "x", ["model_name", "reason"], registry=r).labels(
        "m", "client_disconnected").inc(2)
    rejected = Counter("vertumnus:request_rejected", "x", ["model_name", "reason"], registry=r)
    rejected.labels("m", "overloaded").inc(3)
    rejected.labels("m", "no_worker_fits").inc()
    text = generate_latest(r).decode()
    assert metric_counts(text) == {"success": 7, "failure": 0, "aborted": 2, "rejected": 4,
                                   "rejected_by_reason": {"overloaded": 3, "no_worker_fits": 1}}
    with pytest.raises(ValueError, match="request_aborted_total"):
        metric_counts(text.replace("vertumnus:request_aborted", "other"))
    idle = {"reconfigurations_in_progress": [],
            "workers": [{"queued_requests": 0, "running": False}] * 2}
    assert pool_idle(idle) and not pool_idle(None)
    assert not pool_idle({**idle, "workers": [{"queued_requests": 1, "running": False}]})
    assert not pool_idle({**idle, "workers": [{"queued_requests": 0, "running": True}]})
    assert not pool_idle({**idle, "reconfigurations_in_progress": [{"epoch": 3}]})


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


def test_output_dir_is_another_name_of_out_dir():
    # (a fresh process: eval.soak's flags share names with other tools' module-level ones)
    code = ("import sys; from absl import flags; import eval.soak\n"
            "flags.FLAGS(['soak', '--output_dir=/tmp/soak-out']); print(flags.FLAGS.out_dir)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__))))))
    assert proc.returncode == 0 and proc.stdout.strip() == "/tmp/soak-out", proc.stderr[-2000:]


def test_bad_folders_and_an_unreachable_server_fail_with_a_message(tmp_path):
    # rc 1 and one line naming the cause, no traceback (nothing listens on port 1)
    (tmp_path / "file").write_text("x")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    url = ["--url=http://127.0.0.1:1", "--admin_api_key=k", "--operations=1",
           "--request_timeout_s=5", "--reconfig_timeout_s=5"]
    for args, said in (
            ([f"--out_dir={tmp_path}/a", f"--output_dir={tmp_path}/b"],
             "give the output folder once: --out_dir or its alias --output_dir"),
            (url + [f"--out_dir={tmp_path}/file/sub"], f"error: --out_dir='{tmp_path}/file/sub'"),
            (url + [f"--out_dir={tmp_path}/out"], "error: http://127.0.0.1:1: ConnectError")):
        proc = subprocess.run([sys.executable, "-m", "eval.soak", *args], capture_output=True,
                              text=True, timeout=120, cwd=root)
        assert proc.returncode == 1 and said in proc.stderr + proc.stdout, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
