r"""The serving binary: the live prefill pool behind an OpenAI-compatible HTTP API.

    python -m serving.main                       # tiny model, 8 host CPU devices, 127.0.0.1:8000
    vertumnus-serve                              # the same, as the installed console script
    python -m serving.main --composition=4,2,2 --controller=false --port=8100
    python -m serving.main --checkpoint=/models/Qwen3-0.6B --profile=gpu_profile.csv \
        --num_devices=8 --host=0.0.0.0 --api_key_file=key.txt --admin_api_key_file=admin.txt

On a CPU host, `--num_devices` host devices are created (jax_num_cpu_devices) before any device
is touched. SIGTERM or Ctrl-C: the server answers new requests with 503, finishes the prefills in
flight (until `--shutdown_timeout_s`, then 503 for the rest), and exits 0; a second Ctrl-C
answers every unfinished request with 503 at once (`serving.http_server.GracefulServer`).

Keys: `--api_key` / `--admin_api_key` are visible in `ps`; prefer `--api_key_file` /
`--admin_api_key_file` (the first line of the file) or the environment variables
`VERTUMNUS_API_KEY` / `VERTUMNUS_ADMIN_API_KEY` (as vLLM's `VLLM_API_KEY`); a flag wins over a
file, a file over the environment.
"""

from __future__ import annotations

import logging as pylogging
import math
import os
import signal
import sys

from absl import app, flags, logging

from serving.console import help_as_module
from serving.policy.cache_manager import CacheManagerConfig
from serving.policy.controller import ControllerConfig
from serving.policy.queue_order import parse_queue_order
from serving.engine import EngineConfig
from serving.engine_config import POLICIES, policy_parts
from serving.server import ServerConfig

_MODEL = flags.DEFINE_string("model", "tiny", "Built-in model with seeded random weights: tiny, "
                             "tiny-moe, qwen3-0.6b, qwen3-8b, qwen3-30b-a3b.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Local Hugging Face checkpoint directory "
                                  "(config.json, *.safetensors, tokenizer.json); overrides --model.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the built-in model's random weights.")
_SERVED_NAMES = flags.DEFINE_list("served_model_name", [], "Names the API serves the model under "
                                  "(vLLM's --served-model-name): requests may name any, the "
                                  "first is the default; empty: the model's name.")
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the pool (on CPU: host "
                                    "devices to create).", lower_bound=1)
_COMPOSITION = flags.DEFINE_string("composition", "auto", "Initial CP degrees in device order, "
                                   "e.g. 4,2,2, or 'auto' (paper section 6, from --expected_rate "
                                   "and --expected_input_len).")
_DEGREES = flags.DEFINE_list("degrees", ["1", "2", "4", "8"], "CP degrees the pool may use.")
_EXPECTED_RATE = flags.DEFINE_float("expected_rate", 4.0, "Expected request rate (req/s) for "
                                    "--composition=auto.", lower_bound=1e-9)
_EXPECTED_LEN = flags.DEFINE_integer("expected_input_len", 512, "Expected prompt length "
                                     "(tokens) for --composition=auto.", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", None, "Prefill profile CSV (cp,input_len,cached_len,"
                               "seconds) for the router's cost model; default: the built-in "
                               "CPU profile of the tiny model (vertumnus_jax.profile makes one).")
_ROUTER = flags.DEFINE_string("router", None, "A router class 'module:Class' instead of "
                              "Vertumnus's placement-cost router (the plug-ins eval.replay takes). "
                              "The router's parts of --policy (live sets, congestion price, queue "
                              "order, prefix fetch) then do not apply: queues start in the "
                              "plug-in's queue_order, FCFS if it has none; the controller stays "
                              "--policy's.")
_BETA = flags.DEFINE_float("beta", 1.0, "Router weight of the cache-aware prefill time.",
                           lower_bound=0.0)
_LAM = flags.DEFINE_float("lam", 1.0, "Router weight of the GPU-time cost.", lower_bound=0.0)
_POLICY = flags.DEFINE_enum(
    "policy", "vertumnus", sorted(POLICIES), "The pool's policy: 'vertumnus', the simulator's "
    "default less its replayed initial choice (the what-if split/merge controller, live sets "
    "of 300 s, the congestion price, shortest predicted prefill first, prefix fetch), or "
    "'vertumnus-paper', the paper's (threshold controller, its placement cost, FCFS). "
    "--controller_policy, --live_horizon_s, --congestion_price, --queue_order and "
    "--prefix_fetch, when given, replace the policy's part (serving.engine_config.POLICIES).")
_LIVE = flags.DEFINE_float("live_horizon_s", None, "Seconds a placed request's blocks stay live "
                           "for the router's eviction cost (serving.policy.live_set); 0 = off, "
                           "the paper's cost. Default: --policy's (300 for vertumnus, 0 for "
                           "vertumnus-paper).",
                           lower_bound=0.0)
_CONGESTION = flags.DEFINE_boolean(
    "congestion_price", None, "Price the router's GPU time at --lam plus the backlog every "
    "worker carries: the requests queued on the least-queued worker, times the workers, per GPU "
    "(serving.policy.cost_router); off = the paper's. Default: --policy's (on for vertumnus, "
    "off for vertumnus-paper).")
_QUEUE_ORDER = flags.DEFINE_string(
    "queue_order", None, "Which queued prefill a free worker starts: 'fcfs' (the paper's), "
    "'sjf' (shortest predicted prefill first), 'sjf:S' (SJF, but the head of a queue, its "
    "earliest placed request, starts next once it has waited S seconds since its arrival), "
    "'hrrn' (highest response ratio (wait + P) / P next, P the predicted prefill: SJF's tail "
    "cut, at a higher mean) or 'gated-sjf' (SJF among the requests queued when the last gate "
    "ran out; none placed later passes them); serving/policy/queue_order.py. Plain sjf sets no "
    "bound: under sustained overload a long prompt waits as long as shorter ones keep coming. "
    "Default: --policy's (sjf for vertumnus, fcfs for vertumnus-paper).")
_PREFIX_FETCH = flags.DEFINE_boolean(
    "prefix_fetch", None, "Let the router fetch for a request the longest prefix another "
    "worker holds when that beats recomputing it (serving.policy.fetch_router); the prefill "
    "starts once the copy has ended (normally landed). Off = no per-request fetch (each worker "
    "priced at its own prefix). Default: --policy's (on for vertumnus, off for "
    "vertumnus-paper).")
# The router's parts of a policy: a --router plug-in replaces them (the engine ignores them), so
# turning one on beside it is refused (off, or left to --policy, is not).
_ROUTER_PARTS = {k: POLICIES["vertumnus-paper"][k]
                 for k in ("live_horizon_s", "congestion_price", "queue_order", "prefix_fetch")}
for _name, _on in (("live_horizon_s", bool), ("congestion_price", bool), ("prefix_fetch", bool),
                   ("queue_order", lambda v: v not in (None, "fcfs"))):
    flags.register_multi_flags_validator(
        ["router", _name], lambda f, n=_name, on=_on: not (f["router"] and on(f[n])),
        message=f"--{_name} sets Vertumnus's own router; it does not apply with --router")
_CONTROLLER = flags.DEFINE_boolean("controller", True, "Run the split/merge controller.")
_CONTROLLER_POLICY = flags.DEFINE_enum(
    "controller_policy", None, ["paper", "whatif"], "Which split/merge controller: the paper's "
    "thresholds (--upper, --lower, ...) or the what-if controller "
    "(serving/policy/composition.py; its knobs are CompositionConfig's defaults: a 30 s "
    "interval, a 60 s window and cooldown). Default: --policy's (whatif for vertumnus, paper "
    "for vertumnus-paper).")
_UPPER = flags.DEFINE_float("upper", 0.85, "The paper's controller (--controller_policy=paper): "
                            "split above this load.")
_LOWER = flags.DEFINE_float("lower", 0.35, "The paper's controller: merge below this load.")
_HOLD = flags.DEFINE_float("hold_s", 10.0, "The paper's controller: seconds a "
                           "condition must hold.")
_COOLDOWN = flags.DEFINE_float("cooldown_s", 10.0, "The paper's controller: seconds "
                               "between operations.")
_WINDOW = flags.DEFINE_float("window_s", 30.0, "The paper's controller: demand "
                             "smoothing window (s).")
_LONG = flags.DEFINE_integer("long_threshold", 1024, "The paper's controller: a 'long' "
                             "prompt (tokens).")
# The paper's controller's knobs: refused with the what-if controller, which does not read them.
_PAPER_CONTROLLER = (_UPPER, _LOWER, _HOLD, _COOLDOWN, _WINDOW, _LONG)
_CACHE_MANAGER = flags.DEFINE_boolean("cache_manager", True, "Run the prefix-cache manager.")
_SCAN = flags.DEFINE_float("scan_interval_s", 5.0, "Prefix trie scan interval (seconds).")
_KV_BLOCKS = flags.DEFINE_integer("kv_blocks_per_device", 256, "KV blocks per device.",
                                  lower_bound=1)
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block (a power of two).",
                                   lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_model_len", 4096, "Longest prompt accepted (tokens).",
                                lower_bound=1)
_MAX_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", 256, "Queued + running requests beyond "
                                      "which new ones get 429.", lower_bound=1)
_TICK = flags.DEFINE_float("tick_s", 0.25, "Scheduler tick period (seconds).")
_KV_HOLD = flags.DEFINE_float("kv_hold_s", 60.0, "Seconds a prompt's KV stays pinned for the "
                              "decode side (kv_transfer_params.do_remote_decode) when nobody "
                              "pulls or releases it (GET / DELETE /v1/kv/{request_id}).")
_RAY_ADDRESS = flags.DEFINE_string("ray_address", None, "Serve from host agents on this Ray "
                                   "cluster ('auto' after `ray start`; one agent per node). "
                                   "Default: one process, no Ray.")
_LOCAL_HOSTS = flags.DEFINE_integer("local_hosts", 0, "Start this many host agents on this "
                                    "machine (each its own process with --devices_per_host CPU "
                                    "devices), on a local Ray instance.", lower_bound=0)
_DEVICES_PER_HOST = flags.DEFINE_integer("devices_per_host", None, "Devices per host agent "
                                         "(default on a cluster: each node's GPU count).",
                                         lower_bound=1)
_SCALEOUT = flags.DEFINE_float("scaleout_gb_per_s", 25.0, "Bandwidth of a KV copy between "
                               "hosts (GB/s; the prefix-cache manager, and with --prefix_fetch "
                               "the router, price cross-host copies with it).", lower_bound=0.0)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to bind.", lower_bound=0, upper_bound=65535)
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer key required on every endpoint "
                               "(visible in ps: prefer --api_key_file or VERTUMNUS_API_KEY).")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "File whose first line is the API key.")
_ADMIN_KEY = flags.DEFINE_string("admin_api_key", None, "Bearer key of the admin endpoints "
                                 "(split/merge); they are disabled without one (visible in ps: "
                                 "prefer --admin_api_key_file or VERTUMNUS_ADMIN_API_KEY).")
_ADMIN_KEY_FILE = flags.DEFINE_string("admin_api_key_file", None, "File whose first line is "
                                      "the admin API key.")
_SHUTDOWN = flags.DEFINE_float("shutdown_timeout_s", None, "Seconds after SIGTERM to wait for "
                               "accepted requests; those unfinished then get 503 (default: "
                               "wait until they finish).", lower_bound=0.0)
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout_s", 30.0, "Seconds a request body may take to "
                                   "arrive after its headers (408 after that); also how long a "
                                   "connection may wait with a request's headers incomplete "
                                   "before it is closed.")
flags.register_validator("shutdown_timeout_s", lambda v: v is None or math.isfinite(v),
                         "--shutdown_timeout_s must be a finite number of seconds >= 0")
flags.register_validator("body_timeout_s", lambda v: math.isfinite(v) and v > 0,
                         "--body_timeout_s must be a finite number of seconds > 0")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", "~/.cache/vertumnus-jax/xla",
                                 "JAX persistent compilation cache directory: a restarted server "
                                 "loads its prefill executables instead of compiling them; "
                                 "empty = off.")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"],
                               "Log level of the server and the HTTP access log.")


def _ints(values, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise app.UsageError(f"--{name} must be comma-separated integers, got {values}") from None


def api_key(flag: str | None, path: str | None, env_var: str) -> str | None:
    """A key from its flag, else the first line of its file, else the environment variable.

    Raises:
      app.UsageError: the file cannot be read, its first line is empty or longer than 4,096
        characters, or the key is not printable ASCII (HTTP headers carry bytes as latin-1,
        so any other key could never match).
    """
    if flag:
        key, origin = flag, "the flag"
    elif path:
        try:
            with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM is not part of the key
                line = f.readline(4097)
        except (OSError, UnicodeError) as e:
            raise app.UsageError(f"cannot read the key file {path!r}: {e}") from None
        key, origin = line.strip(), f"the key file {path!r}"
        if not key:
            raise app.UsageError(f"the key file {path!r} has an empty first line")
        if len(line.rstrip("\r\n")) > 4096:
            raise app.UsageError(f"the key file {path!r} has a first line over 4096 characters")
    else:
        key, origin = os.environ.get(env_var) or None, env_var
    if key is not None and not (key.isascii() and key.isprintable()):
        raise app.UsageError(f"the key from {origin} must be printable ASCII")
    return key


def policy_flags() -> dict[str, object]:
    """The `EngineConfig` fields of the policy: `--policy`'s parts, each replaced by its flag
    when given; with `--router`, the router's parts are the paper's (the plug-in is the
    router: the engine does not read them). Raises ValueError: a bad --queue_order, or a knob
    of the paper's controller (--upper, ...) given with the what-if controller."""
    parts = policy_parts(_POLICY.value)
    if _ROUTER.value:
        parts.update(_ROUTER_PARTS)
    if _LIVE.value is not None:
        parts["live_horizon_s"] = _LIVE.value or None  # 0 = off
    if _QUEUE_ORDER.value is not None:
        parts["queue_order"] = parse_queue_order(_QUEUE_ORDER.value)
    for name, flag in (("congestion_price", _CONGESTION), ("prefix_fetch", _PREFIX_FETCH),
                       ("controller_policy", _CONTROLLER_POLICY)):
        if flag.value is not None:
            parts[name] = flag.value
    given = [f"--{f.name}" for f in _PAPER_CONTROLLER if f.present]
    if given and parts["controller_policy"] != "paper" and _CONTROLLER.value:
        verb = "tunes" if len(given) == 1 else "tune"
        raise ValueError(f"{', '.join(given)} {verb} the paper's controller; the what-if "
                         "controller of this policy does not read them (add "
                         "--controller_policy=paper, or drop them)")
    return parts


def server_config() -> ServerConfig:
    """The `ServerConfig` the flags describe (raises `app.UsageError` on a bad value)."""
    comp = None if _COMPOSITION.value == "auto" else _ints(_COMPOSITION.value.split(","),
                                                           "composition")
    degrees = _ints(_DEGREES.value, "degrees")
    try:
        ctl = ControllerConfig(upper=_UPPER.value, lower=_LOWER.value, hold_s=_HOLD.value,
                               cooldown_s=_COOLDOWN.value, window_s=_WINDOW.value,
                               long_threshold=_LONG.value)
        engine = EngineConfig(
            **policy_flags(),
            block_size=_BLOCK_SIZE.value, kv_blocks_per_device=_KV_BLOCKS.value,
            max_model_len=_MAX_LEN.value, beta=_BETA.value, lam=_LAM.value,
            controller=_CONTROLLER.value, controller_config=ctl,
            cache_manager=_CACHE_MANAGER.value,
            cache_config=CacheManagerConfig(scan_interval_s=_SCAN.value),
            tick_seconds=_TICK.value, max_in_flight=_MAX_IN_FLIGHT.value,
            kv_hold_seconds=_KV_HOLD.value, scaleout_gb_per_s=_SCALEOUT.value)
    except ValueError as e:
        sys.exit(f"error: {e}")
    return ServerConfig(model=_MODEL.value, checkpoint=_CHECKPOINT.value, seed=_SEED.value,
                        composition=comp, degrees=degrees, expected_rate=_EXPECTED_RATE.value,
                        expected_input_len=_EXPECTED_LEN.value, profile=_PROFILE.value,
                        engine=engine,
                        api_key=api_key(_API_KEY.value, _API_KEY_FILE.value, "VERTUMNUS_API_KEY"),
                        admin_api_key=api_key(_ADMIN_KEY.value, _ADMIN_KEY_FILE.value,
                                              "VERTUMNUS_ADMIN_API_KEY"),
                        shutdown_timeout=_SHUTDOWN.value, body_timeout=_BODY_TIMEOUT.value,
                        router=_ROUTER.value,
                        served_model_names=tuple(n.strip() for n in _SERVED_NAMES.value
                                                 if n.strip()))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = server_config()
    logging.set_verbosity(_LOG_LEVEL.value)  # absl's own lines (this binary's, the engine's)
    # jax logs an INFO line per absent accelerator plugin (libtpu, ...): not news on this host.
    pylogging.getLogger("jax._src.xla_bridge").setLevel(pylogging.WARNING)
    import jax  # after flag parsing: the device count must be set before jax starts

    # Only the CPU backend reads this; it must be set before any backend starts.
    jax.config.update("jax_num_cpu_devices", _NUM_DEVICES.value)
    if _CACHE_DIR.value:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(_CACHE_DIR.value))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    multi_host = bool(_RAY_ADDRESS.value or _LOCAL_HOSTS.value)
    # The head of a multi-host pool uses no device (the host agents do); starting a jax backend
    # here would also start threads before Ray forks its processes.
    devices = [] if multi_host else jax.devices()
    if not multi_host and len(devices) < _NUM_DEVICES.value:
        raise app.UsageError(f"--num_devices={_NUM_DEVICES.value} but only {len(devices)} "
                             f"{jax.default_backend()} devices exist")
    import uvicorn

    from serving.http_server import GracefulServer
    from serving.server import build_app

    try:
        if multi_host:
            from serving.ray_pool import HostsConfig, build_ray_app
            application = build_ray_app(config, HostsConfig(
                _RAY_ADDRESS.value, _LOCAL_HOSTS.value, _DEVICES_PER_HOST.value))
        else:
            application = build_app(config, devices[:_NUM_DEVICES.value])
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    logging.info("serving %s on http://%s:%d (%d devices)", config.checkpoint or config.model,
                 _HOST.value, _PORT.value, application.state.engine.num_devices)
    logging.info("policy %s%s: %s", config.engine.policy, f" with router {_ROUTER.value}"
                 if _ROUTER.value else "", config.engine.describe_policy())
    pylogging.getLogger("uvicorn").setLevel(_LOG_LEVEL.value.upper())
    server = GracefulServer(uvicorn.Config(application, host=_HOST.value, port=_PORT.value,
                                           log_level=_LOG_LEVEL.value),
                            application.state.engine, _SHUTDOWN.value,
                            header_timeout=_BODY_TIMEOUT.value)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT (waits for open requests, which the
    # engine answers by its deadline), then re-raises the signal to the handler it found; a
    # no-op handler makes that graceful shutdown end in exit status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except SystemExit:  # uvicorn exits (status 3) when it cannot bind; say so in one line
        pass
    if not server.started:
        sys.exit(f"error: the server could not start on {_HOST.value}:{_PORT.value}")
    logging.info("server stopped")


def run() -> None:
    """The console script `vertumnus-serve` (pyproject's `[project.scripts]`): parses the flags
    of `sys.argv` and runs `main`, as `python -m serving.main` does (`--help` included)."""
    help_as_module(sys.modules[__name__])
    app.run(main)


if __name__ == "__main__":
    run()
