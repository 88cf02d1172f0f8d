"""The load generator against an OpenAI-compatible server that is not ours (`openai_stub`):
`--backend=openai`, streamed TTFT, `vllm bench serve`'s result keys, errors, file names."""

from __future__ import annotations

import asyncio
import json
import time
import os
import pathlib
import subprocess
import sys

import httpx
import numpy as np
import pytest

from eval.live.bench_result import (RequestOutput, parse_metrics, parse_percentiles,
                                    result_filename, vllm_metrics, write_new)
from eval.live.client import replay, workload
from eval.live.openai_stream import model_entry, vocab_size
from eval.live.prompts import PromptScale, scaled_requests
from tests.eval.live.openai_stub import MAX_MODEL_LEN, MODEL, VOCAB, Served, make_stub

ROOT = pathlib.Path(__file__).resolve().parents[3]
# what `vllm bench serve --save-result --save-detailed` writes (vllm/benchmarks/serve.py)
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
             "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
             "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "output_throughput", "total_token_throughput", "input_lens",
             "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
             "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
             "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
             "median_itl_ms", "std_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms")
# the loadgen's own keys (README, eval.report's table, eval.metrics.summarize)
OWN_KEYS = ("system", "trace", "slo_attainment", "token_weighted_slo_attainment",
            "failure_reasons", "max_send_lag_s", "p90_ttft_ms", "tokens_per_block", "settings")
N = 8  # requests per CLI run


@pytest.fixture()
def stub():
    served = []

    def start(**kwargs):
        app, log = make_stub(**kwargs)
        served.append(Served(app))
        return served[-1].url, log
    yield start
    for s in served:
        s.stop()


def _cli(url, out, *extra, env=None):
    cmd = [sys.executable, "-m", "eval.loadgen", "--backend=openai", f"--url={url}",
           "--duration=3", "--rate=40", f"--max_requests={N}", f"--output_dir={out}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _sent_prompts(max_len):
    """The prompts the CLI above sends, rebuilt here: the same seeded workload and scale."""
    reqs, _ = workload("", "auto", duration=3.0, rate=40.0, seed=0, trace_block_size=512)
    return [t for _, t in scaled_requests(reqs[:N], PromptScale(16, VOCAB, max_len), 16)]


def test_cli_openai_backend_streams_and_writes_vllm_keys(stub, tmp_path):
    url, log = stub(api_key="sk-stub")
    proc = _cli(url, tmp_path, f"--model={MODEL}", f"--vocab_size={VOCAB}", "--max_tokens=3",
                env={"OPENAI_API_KEY": "sk-stub"})
    assert proc.returncode == 0, proc.stderr
    # nothing pool-specific asked: no /v1/workers, no /health; the key came from the env
    assert set(log.paths) == {"/v1/models", "/v1/completions"}
    assert set(log.auth) == {"Bearer sk-stub"}
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("openai-stub-model-7b-toolagent-")
    text = path.read_text()
    assert "sk-stub" not in text
    r = json.loads(text)
    assert not [k for k in VLLM_KEYS + OWN_KEYS if k not in r]
    assert r["backend"] == "openai" and r["model_id"] == MODEL and r["tokenizer_id"] is None
    assert r["settings"]["backend"] == "openai" and r["settings"]["max_tokens"] == 3
    # every body as vLLM's benchmark sends it, token-id prompts as the loadgen builds them
    assert all(b["stream"] is True and b["stream_options"] == {"include_usage": True}
               and b["max_tokens"] == 3 and b["model"] == MODEL for b in log.bodies)
    sent = [b["prompt"] for b in log.bodies]
    assert sorted(sent) == sorted(_sent_prompts(MAX_MODEL_LEN - 3))
    assert len({tuple(p[:16]) for p in sent}) < len(sent)  # shared prefixes are real
    # values against what the stub saw
    assert r["num_prompts"] == r["completed"] == len(sent) == N and r["failed"] == 0
    assert r["errors"] == [""] * N
    assert sorted(r["input_lens"]) == sorted(len(p) for p in sent)
    assert r["total_input_tokens"] == sum(len(p) for p in sent)
    assert r["output_lens"] == [3] * N and r["total_output_tokens"] == 3 * N
    assert r["generated_texts"] == [" t0 t1 t2"] * N
    ttfts, lat = np.array(r["ttfts"]), np.array(r["latencies"])
    assert (ttfts > 0).all() and (ttfts < lat).all()
    assert all(len(i) == 2 and min(i) > 0 for i in r["itls"])
    assert np.allclose(lat - ttfts, [sum(i) for i in r["itls"]])
    assert r["mean_ttft_ms"] == pytest.approx(1e3 * ttfts.mean())
    assert r["median_ttft_ms"] == pytest.approx(1e3 * np.median(ttfts))
    assert r["std_ttft_ms"] == pytest.approx(1e3 * ttfts.std())
    for p in (90, 99):
        assert r[f"p{p}_ttft_ms"] == pytest.approx(1e3 * np.percentile(ttfts, p))
    assert r["mean_e2el_ms"] == pytest.approx(1e3 * lat.mean())
    assert r["request_throughput"] == pytest.approx(N / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + 3 * N) / r["duration"])
    assert r["gpu_seconds"] is None and r["prefix_hit_rate"] is None
    # a second run never replaces the first
    proc = _cli(url, tmp_path, f"--model={MODEL}", f"--vocab_size={VOCAB}", "--api_key=sk-stub")
    assert proc.returncode == 0, proc.stderr
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_cli_records_failed_requests_and_honours_result_filename(stub, tmp_path):
    url, log = stub(fail_every=3)
    proc = _cli(url, tmp_path, f"--vocab_size={VOCAB}", "--result_filename=mine.json")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.json"]
    r = json.loads((tmp_path / "mine.json").read_text())
    assert r["model_id"] == MODEL  # the first of /v1/models
    bad = [s for s in log.statuses if s != 200]
    assert bad == [500] * (N // 3)
    assert r["failed"] == len(bad) and r["completed"] == N - len(bad)
    assert sorted(e for e in r["errors"] if e) == ["HTTP 500: stub says 500"] * len(bad)
    ok_lens = [len(b["prompt"]) for b, s in zip(log.bodies, log.statuses) if s == 200]
    assert r["total_input_tokens"] == sum(ok_lens)
    assert sorted(r["input_lens"]) == sorted(len(b["prompt"]) for b in log.bodies)
    assert r["output_lens"].count(0) == len(bad) and r["total_output_tokens"] == N - len(bad)
    ok = [t for t, e in zip(r["ttfts"], r["errors"]) if not e]
    assert r["mean_ttft_ms"] == pytest.approx(1e3 * np.mean(ok))
    # the same --result_filename again: refused before anything is sent
    sent = len(log.bodies)
    proc = _cli(url, tmp_path, f"--vocab_size={VOCAB}", "--result_filename=mine.json")
    assert proc.returncode != 0 and "--result_filename" in proc.stderr
    assert len(log.bodies) == sent


def test_cli_without_a_vocab_size_says_which_flag(stub, tmp_path):
    url, log = stub()
    proc = _cli(url, tmp_path)
    assert proc.returncode != 0 and "--vocab_size" in proc.stderr, proc.stderr
    assert "KeyError" not in proc.stderr and not log.bodies and not list(tmp_path.iterdir())
    proc = _cli(url, tmp_path, "--launch_server")
    assert proc.returncode != 0 and "--launch_server" in proc.stderr
    assert "--backend=vertumnus" in proc.stderr


def test_replay_openai_in_process_connection_error_is_recorded():
    reqs, _ = workload("", "auto", duration=2.0, rate=0.0, seed=3, trace_block_size=512)
    pairs = scaled_requests(reqs[:2], PromptScale(16, VOCAB, 256), 16)
    records, state = asyncio.run(replay("http://127.0.0.1:9", pairs, backend="openai",
                                        model=MODEL, timeout=5.0))
    assert all(not r.ok and "Error" in r.error for r in records)
    assert [o.success for o in state["outputs"]] == [False, False] and "composition" not in state


def test_replay_openai_error_event_and_a_stalled_stream_fail_the_request():
    reqs, _ = workload("", "auto", duration=2.0, rate=0.0, seed=4, trace_block_size=512)
    pairs = scaled_requests(reqs[:2], PromptScale(16, VOCAB, 256), 16)
    app, _ = make_stub(error_after_first=True)
    records, _ = asyncio.run(replay("http://stub", pairs, backend="openai", model=MODEL,
                                    max_tokens=3, transport=httpx.ASGITransport(app)))
    assert [r.error for r in records] == ["error event: stub broke"] * 2
    app, _ = make_stub(stall_s=30.0)
    t0 = time.monotonic()
    records, _ = asyncio.run(replay("http://stub", pairs[:1], backend="openai", model=MODEL,
                                    timeout=1.0, transport=httpx.ASGITransport(app)))
    assert not records[0].ok and "Timeout" in records[0].error
    assert time.monotonic() - t0 < 20  # the timeout bounds the request, not each read


def test_cli_exits_nonzero_when_every_request_fails_and_takes_a_v1_url(stub, tmp_path):
    url, log = stub(fail_every=1)
    proc = _cli(url + "/v1", tmp_path, f"--vocab_size={VOCAB}")
    assert proc.returncode != 0 and "all 8 requests failed" in proc.stderr, proc.stderr
    assert log.paths and all(p.startswith("/v1/") and not p.startswith("/v1/v1")
                             for p in log.paths)
    assert len(list(tmp_path.iterdir())) == 1  # the result is still written


def test_replay_openai_over_asgi_transport():
    app, log = make_stub()
    reqs, _ = workload("", "auto", duration=2.0, rate=0.0, seed=4, trace_block_size=512)
    pairs = scaled_requests(reqs[:3], PromptScale(16, VOCAB, 256), 16)
    records, state = asyncio.run(replay("http://stub", pairs, backend="openai", model=MODEL,
                                        max_tokens=2, transport=httpx.ASGITransport(app)))
    assert all(r.ok for r in records), [r.error for r in records]
    assert [b["prompt"] for b in log.bodies] == [t for _, t in pairs]
    out = vllm_metrics(state["outputs"], state["duration_s"])
    assert out["completed"] == 3 and out["total_output_tokens"] == 6
    assert out["total_input_tokens"] == sum(len(t) for _, t in pairs)


def test_vocab_size_model_entry_and_flag_parsers(stub):
    assert vocab_size(50, {"id": "m"}) == 50
    assert vocab_size(None, {"id": "m", "vocab_size": 151936}) == 151936
    with pytest.raises(ValueError, match="--vocab_size"):
        vocab_size(None, {"id": "m"})
    url, _ = stub()
    assert model_entry(url, None, None)["id"] == MODEL
    assert model_entry(url, None, "other") == {"id": "other"}
    assert model_entry("http://127.0.0.1:9", None, "x") == {"id": "x"}
    with pytest.raises(ValueError, match="--model"):
        model_entry("http://127.0.0.1:9", None, None)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError, match=r"--metric_percentiles.*\(0, 100\]"):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="--percentile_metrics.*ttft,tpot,itl,e2el"):
        parse_metrics("ttft,goodput")


def test_vllm_metrics_and_files(tmp_path):
    outs = [RequestOutput(10, 0.0, True, 0.1, 0.3, [0.1, 0.1], "abc", 3),
            RequestOutput(20, 0.1, False, error="HTTP 503: busy"),
            RequestOutput(30, 0.2, True, 0.2, 0.2, [], "d", 1)]
    m = vllm_metrics(outs, 2.0, percentiles=[50, 99.5])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (
        2, 1, 40, 4)
    assert m["output_lens"] == [3, 0, 1] and m["errors"] == ["", "HTTP 503: busy", ""]
    assert m["request_throughput"] == 1.0 and m["total_token_throughput"] == 22.0
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["p99.5_ttft_ms"] == pytest.approx(
        1e3 * np.percentile([0.1, 0.2], 99.5))
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["mean_itl_ms"] == pytest.approx(100.0)
    assert vllm_metrics([], 0.0)["mean_ttft_ms"] is None
    name = result_filename("openai", "Qwen/Qwen3 8B", "toolagent", now=0.0)
    assert name.startswith("openai-Qwen3_8B-toolagent-") and name.endswith(".json")
    first = write_new(str(tmp_path / name), {"a": 1})
    second = write_new(str(tmp_path / name), {"a": 2})
    assert first != second and json.loads(pathlib.Path(first).read_text()) == {"a": 1}
    with pytest.raises(FileExistsError):
        write_new(first, {"a": 3}, unique=False)
