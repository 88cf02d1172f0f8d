"""The serving binary as a process: flag errors, and SIGTERM finishing in-flight prefills."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from eval.live.client import wait_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_flags_exit_with_a_message():
    out = subprocess.run([sys.executable, "-m", "serving.main", "--composition=3,5",
                          "--compilation_cache_dir="], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "composition [3, 5]" in out.stderr and "sum to" in out.stderr
    out = subprocess.run([sys.executable, "-m", "serving.main", "--queue_order=sjf:-1",
                          "--compilation_cache_dir="], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "queue_order='sjf:-1'" in out.stderr


@pytest.mark.parametrize("flag", ["--live_horizon_s=300", "--congestion_price",
                                  "--queue_order=sjf", "--prefix_fetch"])
def test_router_knobs_with_a_plugin_router_are_refused(flag):
    out = subprocess.run([sys.executable, "-m", "serving.main", flag,
                          "--router=serving.policy.router:LeastWorkRouter",
                          "--compilation_cache_dir="], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert f"{flag.split('=')[0]} sets Vertumnus's own router" in out.stderr
    assert len(out.stderr.splitlines()) < 10  # the error, not the usage text


def test_sigterm_finishes_in_flight_prefills_and_exits_0(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")  # a pipe nobody reads could fill and block it
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.main", f"--port={port}", "--composition=4,4",
         "--controller=false", "--cache_manager=false", "--log_level=warning",
         f"--compilation_cache_dir={tmp_path}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, 180, proc)
        prompts = [[i + 1] * (20 + 30 * i) for i in range(4)]  # new length buckets: compiles
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, f"{url}/v1/completions",
                                   json={"prompt": p}, timeout=300) for p in prompts]
            # SIGTERM once the server has accepted all four (later ones would get 503, rightly)
            end, accepted = time.monotonic() + 180, 0
            while time.monotonic() < end and accepted < 4:
                time.sleep(0.05)
                accepted = _accepted(url)
            assert accepted == 4, f"the server accepted {accepted} of 4 requests"
            proc.send_signal(signal.SIGTERM)
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 4
        assert [r.json()["usage"]["prompt_tokens"] for r in responses] == [len(p) for p in prompts]
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _accepted(url: str) -> int:
    """Requests the server holds (queued or running) plus those it completed."""
    workers = httpx.get(f"{url}/v1/workers").json()["workers"]
    held = sum(w["queued_requests"] + int(w["running"]) for w in workers)
    metrics = httpx.get(f"{url}/metrics").text.splitlines()
    done = next(int(float(line.split()[-1])) for line in metrics
                if line.startswith("vertumnus:request_success_total"))
    return held + done
