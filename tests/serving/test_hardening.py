"""Regression tests of the defects an adversarial run found in the HTTP server (issue 16).

The tests that need real sockets or real signals run the real app and `GracefulServer` over the
fake backend in a child process (`tests.serving.fake_server`, no JAX), and talk raw HTTP/1.1 to
it, so framing, partial bodies and disconnects are exactly what the test sends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eval.live.client import wait_healthy
from tests.serving.api_fixtures import make_client, wait_until

ADMIN = {"Authorization": "Bearer admin"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fake_server(tmp_path, *flags: str):
    port = _free_port()
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.serving.fake_server",
                                 f"--port={port}", *flags], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 60.0, proc)
            yield port, proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def _request(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _read_response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of one HTTP/1.1 response with a Content-Length;
    (0, {}, b"") when the connection closed before a whole response came."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(body) < need:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        body += chunk
    return int(lines[0].split()[1]), headers, body[:need]


def _metric(client, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


# ------------------------------------------------------------------------------- 1, 7: the body
def test_chunked_body_over_the_limit_is_413_before_it_is_read(tmp_path):
    with fake_server(tmp_path) as (port, proc, _):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n" % (1 << 20) + b"[" * (1 << 20) + b"\r\n"
            sent = 0
            with contextlib.suppress(OSError):  # the server may close once it has answered
                for _ in range(40):  # 40 MiB if nobody stops us
                    s.sendall(chunk)
                    sent += 1
                    if sent == 17:
                        break
            status, headers, body = _read_response(s)
        assert status == 413 and headers.get("connection") == "close"
        err = json.loads(body)["error"]
        assert err["param"] == "body" and "16777216 bytes" in err["message"]
        assert proc.poll() is None


def test_a_client_sending_its_whole_oversized_body_first_still_reads_the_413(tmp_path):
    with fake_server(tmp_path) as (port, _, _):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % (20 << 20))
            for _ in range(20):  # 20 MiB over about 3 s, longer than the 2 s quiet linger
                s.sendall(b" " * (1 << 20))
                time.sleep(0.15)
            status, headers, body = _read_response(s)
        assert status == 413 and json.loads(body)["error"]["param"] == "body"


def test_a_body_that_stops_arriving_gets_408(tmp_path):
    with fake_server(tmp_path, "--body_timeout_s=0.5") as (port, _, _):
        socks = []
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                      b'{"prompt": "')
            socks.append(s)
        t0 = time.monotonic()
        for s in socks:
            status, headers, body = _read_response(s, timeout=10)
            assert status == 408 and json.loads(body)["error"]["param"] == "body"
            assert s.recv(1) == b""  # and the connection is closed
            s.close()
        assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------------- 2: split refused
def test_split_that_strands_queued_requests_is_409_and_all_are_answered():
    c, engine = make_client(composition=(4, 4), max_model_len=4096, seconds=0.15)
    long_prompt = lambda i: [i + 1] * 3000  # noqa: E731 (CP-2 holds 2 * 64 * 16 = 2048 tokens)
    with c, concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(c.post, "/v1/completions", json={"prompt": long_prompt(i)})
                   for i in range(10)]
        wait_until(lambda: engine.scheduler.num_in_flight == 10)
        assert c.post("/v1/workers/split", json={"worker_id": 0}, headers=ADMIN).status_code == 200
        r = c.post("/v1/workers/split", json={"worker_id": 1}, headers=ADMIN)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["param"] == "worker_id" and "3000 tokens" in err["message"]
        assert "largest would hold 2048 tokens" in err["message"]
        r = c.post("/v1/workers/split", json={"worker_id": 1, "parts": [2, 1, 1]}, headers=ADMIN)
        err = r.json()["error"]  # (the parts refused: named so)
        assert r.status_code == 409 and err["param"] == "parts", r.text
        assert "into parts [2, 1, 1] refused" in err["message"]
        results = [f.result() for f in futures]
        assert [r.status_code for r in results] == [200] * 10
        assert [r.json()["cp_degree"] for r in results] == [4] * 10
        # with nothing queued the split is allowed; then a valid 3,000-token prompt fits no
        # worker of this composition: 503 with Retry-After, not a client error
        assert c.post("/v1/workers/split", json={"worker_id": 1}, headers=ADMIN).status_code == 200
        wait_until(lambda: c.get("/v1/workers").json()["composition"] == [2, 2, 2, 2])
        r = c.post("/v1/completions", json={"prompt": long_prompt(0)})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert _metric(c, "vertumnus:request_rejected_total", reason="no_worker_fits") == 1
        r = c.post("/v1/completions", json={"prompt": [1] * 4097})  # no worker ever holds it
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ------------------------------------------------------------------------------- 3, 4: signals
def test_sigterm_answers_every_request_it_read(tmp_path):
    for _ in range(3):
        with fake_server(tmp_path, "--seconds=0.05", "--composition=8",
                         "--shutdown_timeout_s=20") as (port, proc, log):
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
            body = json.dumps({"prompt": [1, 2, 3]}).encode()
            for s in socks:
                s.sendall(_request("/v1/completions", body))
            proc.send_signal(signal.SIGTERM)
            statuses = []
            for s in socks:
                statuses.append(_read_response(s)[0])
                s.close()
            assert proc.wait(30) == 0
        assert set(statuses) <= {200, 503} and len(statuses) == 30, statuses


def test_second_sigint_answers_in_flight_requests_with_json_503(tmp_path):
    with fake_server(tmp_path, "--seconds=3", "--composition=8") as (port, proc, log):
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        for i, s in enumerate(socks):
            s.sendall(_request("/v1/completions", json.dumps({"prompt": [i + 1]}).encode()))
        uploading = socket.create_connection(("127.0.0.1", port))  # its body never ends
        uploading.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100"
                          b"\r\n\r\n{")
        socks.append(uploading)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.8)
        proc.send_signal(signal.SIGINT)
        answers = [_read_response(s, timeout=10) for s in socks]
        proc.wait(30)
    for status, headers, body in answers:
        assert status == 503 and headers["content-type"] == "application/json", (status, body)
        assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert "Traceback" not in log.read_text()


# ------------------------------------------------------------------------------- 5, 6: parsing
def test_unknown_fields_log_line_is_capped(caplog):
    c, _ = make_client()
    extras = {f"field_{i:05d}_" + "x" * 200: 1 for i in range(5000)}
    with c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], **extras})
    assert r.status_code == 200
    line = next(rec.getMessage() for rec in caplog.records if "ignored request" in rec.message)
    assert len(line) < 1000 and line.endswith("and 4992 more")
    assert "'field_00000_" + "x" * 52 + "'" in line  # 64 characters of a name


@pytest.mark.parametrize("body, reason", [
    (b'{"prompt": "\xff\xfe"}', "UnicodeDecodeError"),
    (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
    (b'{"prompt": [' + b"9" * 5000 + b"]}", "ValueError"),
])
def test_body_parse_errors_name_the_body(body, reason):
    c, _ = make_client()
    with c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "body" and reason in err["message"]


# ------------------------------------------------------------------------------- 8: disconnect
def test_a_queued_request_whose_client_left_is_dropped_a_running_one_is_not(tmp_path):
    with fake_server(tmp_path, "--seconds=1.0", "--composition=8") as (port, _, _):
        running = socket.create_connection(("127.0.0.1", port))
        running.sendall(_request("/v1/completions", b'{"prompt": [1, 2]}'))
        time.sleep(0.3)  # [1, 2] runs; the next two queue behind it
        queued = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for i, s in enumerate(queued):
            s.sendall(_request("/v1/completions", json.dumps({"prompt": [3 + i]}).encode()))
        time.sleep(0.3)
        queued[0].close()  # its prefill has not started: withdrawn
        running.close()  # its prefill runs: it finishes, unseen
        status, _, body = _read_response(queued[1])
        assert status == 200 and json.loads(body)["choices"][0]["token_ids"] == [4]
        queued[1].close()
        import httpx
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["vertumnus:request_aborted_total"] == 1
    assert values["vertumnus:request_success_total"] == 2  # the running one and queued[1]


# ------------------------------------------------------------------------------- 9: counting
def test_429s_counted_and_reconfiguration_history_bounded():
    c, engine = make_client(seconds=0.3, max_in_flight=1, composition=(2, 2))
    with c, concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = [f.result().status_code for f in [
            pool.submit(c.post, "/v1/completions", json={"prompt": f"p{i}"}) for i in range(6)]]
        assert codes.count(429) >= 1
        assert _metric(c, "vertumnus:request_rejected_total", reason="overloaded") == \
            codes.count(429)
        for k in range(20):  # 40 changes: split and merge back
            first = c.get("/v1/workers").json()["workers"][0]["worker_id"]
            assert c.post("/v1/workers/split", json={"worker_id": first},
                          headers=ADMIN).status_code == 200
            wait_until(lambda: c.get("/v1/workers").json()["composition"] == [1, 1, 2])
            ids = [w["worker_id"] for w in c.get("/v1/workers").json()["workers"][:2]]
            assert c.post("/v1/workers/merge", json={"worker_ids": ids},
                          headers=ADMIN).status_code == 200
            wait_until(lambda: c.get("/v1/workers").json()["composition"] == [2, 2])
        w = c.get("/v1/workers").json()
        assert w["reconfigurations_total"] == 40 and len(w["reconfigurations"]) == 32
        assert w["reconfigurations"][-1]["epoch"] == 40
        assert len(c.get("/v1/workers?reconfigurations=3").json()["reconfigurations"]) == 3
        assert c.get("/v1/workers?reconfigurations=999").status_code == 400
        assert _metric(c, "vertumnus:reconfigurations_total", kind="split") == 20


def test_keys_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from absl import app as absl_app

    from serving.main import api_key
    path = tmp_path / "key"
    path.write_text("s3cret\nignored\n")
    monkeypatch.setenv("VERTUMNUS_API_KEY", "from-env")
    assert api_key("flag", str(path), "VERTUMNUS_API_KEY") == "flag"
    assert api_key(None, str(path), "VERTUMNUS_API_KEY") == "s3cret"
    assert api_key(None, None, "VERTUMNUS_API_KEY") == "from-env"
    monkeypatch.delenv("VERTUMNUS_API_KEY")
    assert api_key(None, None, "VERTUMNUS_API_KEY") is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(absl_app.UsageError, match="empty first line"):
        api_key(None, str(tmp_path / "empty"), "X")
    with pytest.raises(absl_app.UsageError, match="cannot read"):
        api_key(None, str(tmp_path / "missing"), "X")
    (tmp_path / "bom").write_bytes("\ufeffk3y\n".encode())
    assert api_key(None, str(tmp_path / "bom"), "X") == "k3y"
    (tmp_path / "long").write_text("k" * 5000)
    with pytest.raises(absl_app.UsageError, match="over 4096"):
        api_key(None, str(tmp_path / "long"), "X")
    with pytest.raises(absl_app.UsageError, match="printable ASCII"):
        api_key("clé", None, "X")


def test_a_form_body_says_it_must_be_json():
    c, _ = make_client()
    with c:
        r = c.post("/v1/completions", data={"prompt": "hi"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "body" and "JSON object" in err["message"]


def test_nan_shutdown_timeout_is_refused():
    out = subprocess.run([sys.executable, "-m", "serving.main", "--shutdown_timeout_s=nan"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "finite" in out.stderr


def test_headers_that_never_end_close_the_connection(tmp_path):
    with fake_server(tmp_path, "--body_timeout_s=1") as (port, _, _):
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        silent = socket.create_connection(("127.0.0.1", port))
        # a keep-alive connection that keeps working is never cut
        busy = socket.create_connection(("127.0.0.1", port))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:
            busy.sendall(_request("/v1/completions", b'{"prompt": [1]}'))
            assert _read_response(busy)[0] == 200
        for s in (partial, silent):
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the server
            s.close()
        busy.close()


def test_a_body_of_mixed_prompt_items_is_refused_at_its_first_bad_item():
    # a pydantic union recorded an error per item and branch: minutes, gigabytes for 15 MiB
    c, engine = make_client(max_in_flight=8)
    mixed = json.dumps({"prompt": ["a"] * 200_000 + [1]}).encode()
    batch = json.dumps({"prompt": [[1]] * 300_000}).encode()
    ids = json.dumps({"prompt": [1] * 2000 + [300] + [1.5]}).encode()
    with c:
        r = c.post("/v1/completions", content=mixed, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt"
        assert err["message"] == "prompt: prompt[200000] must be a string (a batch of texts) " \
                                 "as prompt[0] is, got int"
        r = c.post("/v1/completions", content=batch, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "batch of 300000 prompts" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=ids, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "prompt[2001] must be a token id" in r.text
        r = c.post("/v1/completions", json={"prompt": [1] * 5000 + [300]})  # length first
        assert r.status_code == 400 and "has 5001 tokens" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [[1, 2], [3, "x"]]})
        assert r.status_code == 400 and "prompt[1][1] must be a token id" in r.text
        assert engine.scheduler.num_submitted == 0


def test_the_prompt_limit_is_what_merges_can_reach():
    # CP-8 is allowed but unreachable from CP-1 workers without CP-2 and CP-4: 400, not 503
    c, engine = make_client(composition=(1,) * 8, degrees=(1, 8), max_model_len=4096)
    with c:
        assert engine.max_prompt_len == 1024  # one device: 64 blocks x 16 tokens
        r = c.post("/v1/completions", json={"prompt": [1] * 2000})
        assert r.status_code == 400 and "more than the maximum of 1024" in r.text
    c, engine = make_client(composition=(1,) * 8, degrees=(1, 2, 4, 8), max_model_len=4096)
    assert engine.max_prompt_len == 4096


def test_a_placement_hook_error_answers_the_request_and_is_counted(caplog):
    # the prompt is taken before a placement hook runs: it runs and is answered, the error is
    # logged and counted (before, `submit` raised: a 500 for a prefill that ran unseen)
    c, engine = make_client(seconds=0.05)
    with c:
        def hook(request, cached, now):
            raise RuntimeError("placement hook bug")

        engine.scheduler.placement_hooks.append(hook)
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7]})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [18]  # (the sum)
        assert _metric(c, "vertumnus:policy_errors_total") == 1
        assert _metric(c, "vertumnus:request_success_total") == 1
    assert "placement hook bug" in caplog.text


def test_a_record_hook_error_still_answers_the_request(caplog):
    # record hooks run inside the scheduler's completion: one that raised used to break the
    # completion halfway (the worker kept "running" it, the client never got its answer)
    c, engine = make_client(seconds=0.05)
    with c:
        def hook(completion):
            raise RuntimeError("metrics hook bug")

        engine.record_hooks.insert(0, hook)
        for prompt in ([1, 2], [3, 4]):  # the second one finds the worker free again
            r = c.post("/v1/completions", json={"prompt": prompt})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [sum(prompt)]
    assert "metrics hook bug" in caplog.text
