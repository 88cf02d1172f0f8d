"""Simulator fidelity: the same scaled workload, live on the devices and in the simulator.

    python -m eval.live.fidelity                     # tiny model, 8 host CPU devices, ~3 minutes

1. Measure a prefill profile on the serving devices (`python -m vertumnus_jax.profile`), unless
   `--profile` names one.
2. Start the server (`python -m serving.main`) with that profile, a fixed composition, the
   controller and cache manager off and the paper's placement cost, FCFS and no fetch
   (`--policy=vertumnus-paper`; so both sides run the same fixed pool and router), warm it up with
   the same workload (compiles the prefill buckets it needs) and empty its prefix cache
   (`/reset_prefix_cache`), then replay the workload with
   `eval.live.loadgen` and keep the TTFT the *server* measured (arrival at the engine to first
   token: what the simulator models; the client-side TTFT adds HTTP time and is reported too).
3. Simulate the identical requests (same token blocks, hashes, arrival times, composition, KV
   blocks, router and cost model) with the profile as noise-free ground truth and no KV transfer
   or decode step.
4. Report the relative error `(sim - live) / live` of mean and P90 TTFT (target: within 10 %;
   Vidur, MLSys 2024, reports under 9 % for its simulator) as a table and JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import httpx
import numpy as np
from absl import app, flags

from eval.sim.ground_truth import GroundTruthProfile
from eval.live.prompts import PromptScale, scaled_requests
from eval.live.client import launched_server, replay, workload
from eval.sim.simulator import SimConfig, simulate
from serving.policy.cost_model import PrefillCostModel
from serving.policy.cost_router import VertumnusRouter
from serving.policy.profiles import read_profile_csv
from serving.policy.worker import layout_workers

_DURATION = flags.DEFINE_float("duration", 30.0, "Seconds of the built-in workload.",
                               lower_bound=1.0)
_RATE = flags.DEFINE_float("rate", 6.0, "Request rate (req/s).", lower_bound=0.01)
_COMPOSITION = flags.DEFINE_list("composition", ["4", "2", "2"], "Fixed composition.")
_TOKENS_PER_BLOCK = flags.DEFINE_integer("tokens_per_block", 32, "Prompt tokens per trace "
                                         "block of 512.", lower_bound=1)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Server KV block size.", lower_bound=1)
_KV_BLOCKS = flags.DEFINE_integer("kv_blocks_per_device", 512, "Server KV blocks per device.",
                                  lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Longest prompt (tokens).", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", None, "Profile CSV; default: measure one now.")
_PORT = flags.DEFINE_integer("port", 8123, "Port of the launched server.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_OUT = flags.DEFINE_string("output_dir", "out/fidelity", "Where the profile, JSON and table go.")


def relative_error(sim: float, live: float) -> float:
    """`(sim - live) / live`."""
    return (sim - live) / live


def measure_profile(path: str, degrees: list[int], max_len: int, block_size: int) -> None:
    """Runs `vertumnus_jax.profile` for `degrees` on 8 host devices, lengths up to `max_len`."""
    lens = [n for n in (32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= max_len]
    cmd = [sys.executable, "-m", "vertumnus_jax.profile", "--model=tiny", "--cpu_devices=8",
           f"--cp_degrees={','.join(map(str, degrees))}", f"--input_lens={','.join(map(str, lens))}",
           "--cached_fractions=0,0.5,0.9", "--repeats=5", f"--block_size={block_size}",
           f"--output={path}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    comp = [int(c) for c in _COMPOSITION.value]
    os.makedirs(_OUT.value, exist_ok=True)
    profile = _PROFILE.value
    if profile is None:
        profile = os.path.join(_OUT.value, "profile.csv")
        print(f"measuring the prefill profile -> {profile}")
        measure_profile(profile, sorted(set(comp)), _MAX_LEN.value, _BLOCK_SIZE.value)
    table = read_profile_csv(profile)
    scale = PromptScale(_TOKENS_PER_BLOCK.value, 256, _MAX_LEN.value)
    reqs, name = workload("", "auto", _DURATION.value, _RATE.value, _SEED.value, 512)
    pairs = scaled_requests(reqs, scale, _BLOCK_SIZE.value)
    url = f"http://127.0.0.1:{_PORT.value}"
    server_flags = (f"--port={_PORT.value} --composition={','.join(map(str, comp))} "
                    f"--controller=false --cache_manager=false --profile={profile} "
                    f"--block_size={_BLOCK_SIZE.value} --kv_blocks_per_device={_KV_BLOCKS.value} "
                    f"--max_model_len={_MAX_LEN.value} --num_devices={sum(comp)} "
                    f"--degrees={','.join(map(str, sorted(set(comp))))} "
                    "--policy=vertumnus-paper --log_level=warning")  # the sim's router below
    admin = {"Authorization": "Bearer fidelity"}
    with launched_server(server_flags + " --admin_api_key=fidelity", url):
        # Warm-up: the same requests (so the same prefill buckets compile), then an empty cache.
        print(f"warm-up: the same {len(pairs)} requests, then /reset_prefix_cache")
        asyncio.run(replay(url, pairs))
        httpx.post(f"{url}/reset_prefix_cache", headers=admin, timeout=60).raise_for_status()
        print(f"measured: {len(pairs)} requests at {_RATE.value} req/s")
        records, state = asyncio.run(replay(url, pairs))
    failed = [r for r in records if not r.ok]
    if failed:
        sys.exit(f"error: {len(failed)} live requests failed, e.g. {failed[0].error}")
    live_server = np.array([state["server_ttft_s"][r.request.request_id] for r in records])
    live_client = np.array([r.ttft for r in records])

    cost = PrefillCostModel.fit(table)
    truth = GroundTruthProfile(table)
    specs = layout_workers(comp, _KV_BLOCKS.value, _MAX_LEN.value)
    sim_reqs = sorted((r for r, _ in pairs), key=lambda r: r.arrival_time)
    sim = simulate(sim_reqs, specs, cost, VertumnusRouter(), truth.seconds,
                   SimConfig(kv_transfer_gb_per_s=0.0, first_token_seconds=0.0, tick_interval=0.0))
    sim_ttft = np.array([r.ttft for r in sim if r.ok])
    rows = []
    for label, live in (("server-side TTFT", live_server), ("client-side TTFT", live_client)):
        for stat, fn in (("mean", np.mean), ("P90", lambda x: np.percentile(x, 90))):
            lv, sv = float(fn(live)), float(fn(sim_ttft))
            rows.append({"measure": f"{stat} {label}", "live_ms": 1e3 * lv, "sim_ms": 1e3 * sv,
                         "relative_error": relative_error(sv, lv)})
    live_prefill = np.array([r.finish_time - r.start_time for r in records])
    sim_prefill = np.array([r.finish_time - r.start_time for r in sim if r.ok])
    rows.append({"measure": "mean prefill time", "live_ms": 1e3 * float(live_prefill.mean()),
                 "sim_ms": 1e3 * float(sim_prefill.mean()), "relative_error": relative_error(
                     float(sim_prefill.mean()), float(live_prefill.mean()))})
    result = {"workload": name, "requests": len(pairs), "rate": _RATE.value, "composition": comp,
              "tokens_per_block": _TOKENS_PER_BLOCK.value, "profile": profile, "rows": rows,
              "live_prefix_hit_tokens": int(sum(r.cached_len for r in records)),
              "sim_prefix_hit_tokens": int(sum(r.cached_len for r in sim if r.ok)),
              "max_send_lag_s": state["max_send_lag_s"]}
    with open(os.path.join(_OUT.value, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| measure | live (ms) | simulated (ms) | relative error |", "|---|---|---|---|"]
    lines += [f"| {r['measure']} | {r['live_ms']:.1f} | {r['sim_ms']:.1f} | "
              f"{r['relative_error']:+.1%} |" for r in rows]
    text = "\n".join(lines)
    with open(os.path.join(_OUT.value, "fidelity.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"prefix-hit tokens: live {result['live_prefix_hit_tokens']}, simulated "
          f"{result['sim_prefix_hit_tokens']}; results in {_OUT.value}/")


if __name__ == "__main__":
    app.run(main)
