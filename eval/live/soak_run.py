"""The coroutines of one soak run (`eval.live.soak`) and the state they share: `SoakRun`."""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import secrets
import time

import httpx

from eval.live.soak_config import PromptSet, SoakConfig, rss_mib
from eval.live.soak_ledger import FirstTokens, Ledger, classify_completion
from eval.live.soak_ops import OPERATION_REFUSAL_CODES, choose_operation, next_kind
from eval.live.soak_server import abandon, metric_counts


class SoakRun:
    """The state the coroutines of one soak run share, and the coroutines.

    `stream` (one closed-loop sender; run `concurrency` of them), `drive` (the splits and
    merges), `sample` (RSS) and `progress` run together on one loop; `stop` ends the senders
    after their request in flight. What they count is read by `eval.live.soak_report.assemble`.

    Args:
      cfg: the run's `SoakConfig`.
      client: an `httpx.AsyncClient` on the server's base URL.
      prompts: the run's `PromptSet`.
    """

    def __init__(self, cfg: SoakConfig, client: httpx.AsyncClient, prompts: PromptSet) -> None:
        self.cfg, self.client, self.prompts = cfg, client, prompts
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.admin = {"Authorization": f"Bearer {cfg.admin_api_key}"}
        self.ledger, self.tokens = Ledger(), FirstTokens()
        self.latencies_ms: list[float] = []
        self.ops: list[dict] = []
        self.op_refused: collections.Counter = collections.Counter()
        self.op_refusal_examples: list[dict] = []
        self.op_errors: list[dict] = []
        self.poll_errors: collections.Counter = collections.Counter()
        self.stuck: dict | None = None
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self.rss_warm: float | None = None
        self.composition: list[int] = []
        self.metrics_start: dict | None = None  # `GET /metrics` counts before the stream
        self.stop = asyncio.Event()
        self.t0 = time.monotonic()
        self._next_send = self.t0
        self._count = itertools.count()
        self._run_id = secrets.token_hex(4)

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def sample_rss(self) -> float | None:
        """Appends a sample of the server's RSS to `rss` (seconds, MiB) and returns it in MiB
        (None when not sampled)."""
        mib = rss_mib(self.cfg.server_pid)
        if mib is not None:
            self.rss.append((round(self.elapsed(), 2), round(mib, 1)))
        return mib

    async def stream(self) -> None:
        """One closed-loop sender: a request, its answer, the next one, until `stop`. The
        requests `PromptSet.abandons` are sent by `abandon` instead (the sender waits for the
        close). After a refusal it waits as `Retry-After` says (at most 5 s; 1 s without)."""
        cfg = self.cfg
        while not self.stop.is_set():
            if cfg.rate > 0:
                now = time.monotonic()
                at = max(now, self._next_send)
                self._next_send = at + 1.0 / cfg.rate
                await asyncio.sleep(at - now)
                if self.stop.is_set():
                    break
            n = next(self._count)
            rid = f"soak-{self._run_id}-{n}"
            prompt, tokens = self.prompts.pick(n)
            payload = {"prompt": tokens, "max_tokens": 1, "user": rid}
            headers = {**self.headers, "X-Request-Id": rid}
            self.ledger.sent(rid)
            if self.prompts.abandons(n):
                outcome = await abandon(cfg.url, "/v1/completions", payload, headers,
                                        cfg.disconnect_after_s, cfg.request_timeout_s)
                self.ledger.record(rid, outcome)
                if outcome.kind == "lost":
                    await asyncio.sleep(0.5)
                continue
            t = time.monotonic()
            try:
                resp = await self.client.post("/v1/completions", json=payload, headers=headers)
            except Exception as e:  # noqa: BLE001 - transport error, timeout: no answer
                self.ledger.lost(rid, f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.5)  # no hot loop against a server that is gone
                continue
            try:
                body = resp.json()
            except ValueError:
                body = None
            outcome = classify_completion(resp.status_code, body, len(tokens))
            self.ledger.record(rid, outcome)
            if outcome.kind == "answered":
                self.latencies_ms.append(1e3 * (time.monotonic() - t))
                if prompt is not None:
                    self.tokens.record(prompt, body["choices"][0]["token_ids"][0],
                                       body["cp_degree"])
            elif outcome.kind == "refused":  # wait as told (at most 5 s): no hot loop
                retry = resp.headers.get("retry-after", "1")
                await asyncio.sleep(min(5.0, float(retry) if retry.isdigit() else 1.0))

    async def workers(self) -> dict | None:
        """`GET /v1/workers` (with its latest 8 finished changes: one operation runs at a
        time), or None (counted in `poll_errors`) when it fails."""
        try:
            resp = await self.client.get("/v1/workers", params={"reconfigurations": 8},
                                         headers=self.headers, timeout=30.0)
            resp.raise_for_status()
            return resp.json()
        except Exception as e:  # noqa: BLE001 - counted; the caller retries
            self.poll_errors[type(e).__name__] += 1
            return None

    async def metrics(self) -> dict | None:
        """`GET /metrics` as `eval.live.soak_server.metric_counts`, or None (counted in
        `poll_errors`) when it fails."""
        try:
            resp = await self.client.get("/metrics", headers=self.headers, timeout=30.0)
            resp.raise_for_status()
            return metric_counts(resp.text)
        except Exception as e:  # noqa: BLE001 - counted; the caller reports it
            self.poll_errors[f"metrics {type(e).__name__}"] += 1
            return None

    async def drive(self) -> str:
        """Starts splits and merges until `operations` finished; returns why it stopped:
        "done", "deadline" (`max_duration_s` passed first), "stuck" (one did not finish in
        time), "server exited" (the process `server_pid` is gone), or, when no operation
        finished for `reconfig_timeout_s` seconds, "server unreachable" (`GET /v1/workers`
        failed meanwhile), "operations failed" (answered neither 200 nor 409), "operations
        refused" (409) or "no legal operation"."""
        cfg, last, refused = self.cfg, None, False
        rng = random.Random(cfg.seed)
        deadline = self.t0 + cfg.max_duration_s
        progress = (time.monotonic(), 0, 0, 0)  # last finish: time, poll errors, refused, errors
        while len(self.ops) < cfg.operations:
            start = time.monotonic()
            if start >= deadline:
                return "deadline"
            if cfg.server_pid is not None and rss_mib(cfg.server_pid) is None:
                return "server exited"
            if start - progress[0] > cfg.reconfig_timeout_s:  # refusals do not reset it
                now = self._counts()
                return ("server unreachable" if now[0] > progress[1] else
                        "operations failed" if now[2] > progress[3] else
                        "operations refused" if now[1] > progress[2] else "no legal operation")
            state = await self.workers()
            op = None
            if state is not None:
                self.composition = state["composition"]
                if not state["reconfigurations_in_progress"]:
                    op = choose_operation(state["workers"], cfg.degrees,
                                          next_kind(cfg.walk, last, refused, rng), rng)
            if op is None:
                await asyncio.sleep(0.2)
                continue
            last, refused = op.kind, False
            path, body = op.path_and_body()
            sent = time.monotonic()
            status, answer = None, ""
            try:
                resp = await self.client.post(path, json=body, headers=self.admin, timeout=30.0)
                status, answer = resp.status_code, resp.text
                answer = resp.json()
            except ValueError:  # not JSON: `answer` keeps the text
                status = None if status == 200 else status
            except Exception as e:  # noqa: BLE001 - no answer: recorded as a server defect
                status, answer = None, f"{type(e).__name__}: {e}"
            what = {"at_s": round(sent - self.t0, 3), "kind": op.kind,
                    "workers": list(op.worker_ids), "composition": self.composition}
            if status in OPERATION_REFUSAL_CODES:
                refused = True
                self.op_refused[status] += 1
                if len(self.op_refusal_examples) < 10:
                    self.op_refusal_examples.append({**what, "status": status, "answer": answer})
            elif status != 200 or not isinstance(answer, dict) or "epoch" not in answer:
                self.op_errors.append({**what, "status": status, "answer": answer})
            elif not await self._finished(answer["epoch"], sent):
                if cfg.server_pid is not None and rss_mib(cfg.server_pid) is None:
                    return "server exited"
                self.stuck = {**what, "epoch": answer["epoch"]}
                return "stuck"
            else:
                progress = (time.monotonic(), *self._counts())
            await asyncio.sleep(max(0.0, start + cfg.interval_s - time.monotonic()))
        return "done"

    def _counts(self) -> tuple[int, int, int]:
        """(poll errors, operations refused, operation errors) so far."""
        return (sum(self.poll_errors.values()), sum(self.op_refused.values()),
                len(self.op_errors))

    async def _finished(self, epoch: int, sent: float) -> bool:
        """Polls until `epoch` is a finished reconfiguration and records it; False when it did
        not finish within `reconfig_timeout_s` of `sent` (monotonic seconds) or the server
        process exited."""
        pid = self.cfg.server_pid
        while time.monotonic() - sent < self.cfg.reconfig_timeout_s:
            if pid is not None and rss_mib(pid) is None:
                return False
            state = await self.workers()
            done = [r for r in (state or {}).get("reconfigurations", ())[-8:]
                    if r["epoch"] == epoch]
            if done:
                r = done[0]
                self.composition = state["composition"]
                self.ops.append({**r, "client_s": round(time.monotonic() - sent, 3),
                                 "at_s": round(sent - self.t0, 3)})
                if len(self.ops) == max(1, self.cfg.operations // 10):
                    self.rss_warm = self.sample_rss()
                return True
            await asyncio.sleep(0.1)
        return False

    async def sample(self) -> None:
        """Samples the server's RSS every `rss_interval_s` until cancelled."""
        while True:
            self.sample_rss()
            await asyncio.sleep(self.cfg.rss_interval_s)

    async def progress(self) -> None:
        """Prints a progress line every `progress_interval_s` until cancelled."""
        while self.cfg.progress_interval_s > 0:
            await asyncio.sleep(self.cfg.progress_interval_s)
            s = self.ledger.summary(final=False)
            rss = f"{self.rss[-1][1]:.0f} MiB" if self.rss else "n/a"
            print(f"[{self.elapsed():6.0f} s] operations {len(self.ops)}/{self.cfg.operations} "
                  f"(refused {sum(self.op_refused.values())}), composition {self.composition}; "
                  f"requests sent {s['sent']}, answered {s['answered']}, refused "
                  f"{s['refused']}, abandoned {s['abandoned']}, lost {s['lost']}, duplicated {s['duplicated']}, in flight "
                  f"{s['in_flight']}; server RSS "
                  f"{rss}", flush=True)
