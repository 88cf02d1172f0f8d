"""Measures split and merge of CP workers against reloading weights from an orbax checkpoint.

    python -m vertumnus_jax.bench_recarve                      # tiny + qwen3-0.6b (4 layers)
    python -m vertumnus_jax.bench_recarve --models=tiny --output=/tmp/r.json --markdown=/tmp/r.md

Per model (seeded random weights; the larger config's layer count can be cut to fit CPU
memory): the weights are placed once on the host's devices (`mesh.ParamReplicas`), saved with
orbax, and one worker of degree 8 (all devices) caches `--num_prompts` prompts of
`--prompt_len` tokens sharing a `--shared_len`-token prefix. Then, on idle workers (the time
excludes any drain), `--passes` times (the sequence ends where it began):

  split 8 -> 4+4, split 4 -> 2+2, replicate a prefix 4 -> 2, merge 2+2 -> 4, merge 4+4 -> 8

Pass 1 includes compiling the KV gather/scatter kernels for each new shape (and each new
worker's prefill executables); later passes show the steady state, where a re-created device
set reuses its executables (they are kept per device set).

For each operation the table gives its wall seconds (`time.perf_counter`, device work
finished), the weight bytes moved (by buffer pointer: must be 0), the KV blocks and bytes moved
and kept in place, the first prefill on a new worker reusing a moved prefix (it includes
compiling the worker's executables when its device set is new) and a second, warm one, and the
time to instead reload the weights from the orbax checkpoint onto the operation's devices
(`restore_params` plus one `device_put` per device). The paper reports 1.1 to 5.1 s per
operation on GPUs (Vertumnus section 6): `speedup_vs_paper_min` is 1.1 s over our time and
`speedup_vs_reload` the reload time over ours. CPU numbers show what re-carving costs here, not
GPU times. Writes JSON (`--output`) and optionally a markdown report (`--markdown`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx

from mesh import ParamReplicas, worker_mesh
from vertumnus_jax.checkpoint import restore_params, save_params
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import init_model
from vertumnus_jax.prefill import prefill_request, release_request
from vertumnus_jax.prefix_cache import block_hashes
from vertumnus_jax.recarve import merge_workers, replicate_prefix, split_worker
from vertumnus_jax.worker import Worker

_MODELS = flags.DEFINE_list("models", ["tiny", "qwen3-0.6b"], "Named configs (seeded random "
                            "weights): tiny, tiny-moe, qwen3-0.6b, qwen3-8b, qwen3-30b-a3b.")
_LAYERS = flags.DEFINE_list("num_layers", ["0", "4"], "Per model, a layer count override (0: "
                            "the config's own), so a large config fits in CPU memory.")
_DTYPE = flags.DEFINE_string("dtype", None, "Parameter dtype override (float32, bfloat16).")
_BLOCK = flags.DEFINE_integer("block_size", 16, "KV block size (tokens), a power of two.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 64, "KV blocks per device.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts cached before the operations.")
_LEN = flags.DEFINE_integer("prompt_len", 256, "Tokens per prompt.")
_SHARED = flags.DEFINE_integer("shared_len", 128, "Leading tokens all prompts share.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and prompts.")
_PASSES = flags.DEFINE_integer("passes", 2, "Times the operation sequence runs (it ends where "
                               "it began); pass 1 includes compiling the KV move kernels.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "On CPU: host devices to create "
                                    "(jax_num_cpu_devices); 8 are needed.")
_OUTPUT = flags.DEFINE_string("output", "out/bench_recarve.json", "JSON path to write.")
_MARKDOWN = flags.DEFINE_string("markdown", None, "Optional markdown path for the table.")

PAPER_SECONDS = (1.1, 5.1)  # Vertumnus section 6: per split/merge operation
COLUMNS = ("model", "pass", "op", "seconds", "weight_bytes_moved", "kv_blocks_moved", "kv_bytes_moved",
           "kv_blocks_in_place", "dropped_blocks", "first_prefill_s", "warm_prefill_s",
           "reload_s", "speedup_vs_reload", "speedup_vs_paper_min")


def _timed_prefill(worker: Worker, prompts) -> tuple[float, float, int]:
    """(first, warm) seconds of prefill of the cached prompt with the longest hit on `worker`,
    and its cached tokens."""
    hits = [len(worker.cache.match(block_hashes(p, worker.block_size), touch=False))
            for p in prompts]
    tokens = prompts[int(np.argmax(hits))]
    times = []
    for _ in range(2):
        start = time.perf_counter()
        r = prefill_request(worker, tokens)
        times.append(time.perf_counter() - start)  # first_token is on the host
        release_request(worker, r)
    return times[0], times[1], r.cached_tokens


def _reload_seconds(config: ModelConfig, path: str, devices) -> float:
    """Seconds to restore the weights with orbax and place one replica on each device."""
    start = time.perf_counter()
    state = nnx.split(restore_params(config, path))[1]
    replicas = ParamReplicas(state, devices)
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("cp",))
    jax.block_until_ready(jax.tree_util.tree_leaves(replicas.assemble(mesh)))
    return time.perf_counter() - start


def _row(model, op, seconds, stats, prefill, reload_s) -> dict:
    first, warm, cached = prefill if prefill else (None, None, None)
    return dict(model=model, op=op, seconds=seconds,
                weight_bytes_moved=getattr(stats, "weight_bytes_moved", 0),
                kv_blocks_moved=stats.kv_blocks_moved, kv_bytes_moved=stats.kv_bytes_moved,
                kv_blocks_in_place=getattr(stats, "kv_blocks_in_place", None),
                dropped_blocks=len(getattr(stats, "dropped_hashes", ())),
                first_prefill_s=first, warm_prefill_s=warm, prefill_cached_tokens=cached,
                reload_s=reload_s, speedup_vs_reload=reload_s / seconds,
                speedup_vs_paper_min=PAPER_SECONDS[0] / seconds)


def bench_model(name: str, layers: int, ckpt_dir: str) -> list[dict]:
    """Runs the operation sequence for one model; returns the table rows."""
    overrides = {"num_layers": layers} if layers else {}
    if _DTYPE.value:
        overrides["dtype"] = _DTYPE.value
    config = ModelConfig.named(name, **overrides)
    label = f"{name}" + (f" ({layers} layers)" if layers else "")
    model = init_model(config, _SEED.value)
    path = os.path.join(ckpt_dir, name.replace("/", "_"))
    save_params(model, path)
    graphdef, state = nnx.split(model)
    devices = jax.devices()[:8]
    replicas = ParamReplicas(state, devices)
    del model, state
    exe: dict = {}
    bs = _BLOCK.value

    def mesh(first, c):
        return worker_mesh(jax.devices(), first, c)

    w8 = Worker.from_replicas(mesh(0, 8), graphdef, replicas, num_blocks=_NUM_BLOCKS.value,
                              block_size=bs, executables=exe)
    rng = np.random.default_rng(_SEED.value)
    shared = rng.integers(0, config.vocab_size, _SHARED.value)
    prompts = [np.concatenate([shared, rng.integers(0, config.vocab_size,
                                                    _LEN.value - _SHARED.value)])
               for _ in range(_PROMPTS.value)]
    for p in prompts:
        release_request(w8, prefill_request(w8, p))
    print(f"[{label}] {replicas.nbytes_per_device / 2**20:.1f} MiB of weights per device, "
          f"{len(w8.cache)} KV blocks cached", flush=True)
    rows = []

    def run(op, fn, args, prefill_on, op_devices):
        start = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - start
        worker = None if prefill_on is None else out[prefill_on]
        prefill = _timed_prefill(worker, prompts) if worker is not None else None
        reload_s = _reload_seconds(config, path, devices[op_devices[0]:op_devices[1]])
        rows.append(dict(_row(label, op, seconds, out[-1], prefill, reload_s), **{"pass": k}))
        print(" ".join(f"{c}={_fmt(rows[-1][c])}" for c in COLUMNS[1:]), flush=True)
        return out

    def replicate(src, dst, hashes):
        return (replicate_prefix(src, dst, hashes),)

    for k in range(1, _PASSES.value + 1):  # pass 1 compiles the move kernels; later ones reuse
        lo4, hi4, _ = run("split 8->4+4", split_worker, (w8, (mesh(0, 4), mesh(4, 4))), 0,
                          (0, 8))
        lo2, hi2, _ = run("split 4->2+2", split_worker, (lo4, (mesh(0, 2), mesh(2, 2))), 1,
                          (0, 4))
        chain = max((block_hashes(p, bs) for p in prompts),
                    key=lambda h, src=hi4, dst=lo2: (len(src.cache.match(h, touch=False)),
                                                     -len(dst.cache.match(h, touch=False))))
        chain = chain[:len(hi4.cache.match(chain, touch=False))]
        run("replicate 4->2", replicate, (hi4, lo2, chain), None, (0, 2))
        m4, _ = run("merge 2+2->4", merge_workers, (lo2, hi2, mesh(0, 4)), 0, (0, 4))
        w8, _ = run("merge 4+4->8", merge_workers, (m4, hi4, mesh(0, 8)), 0, (0, 8))
    return rows


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4f}" if x < 100 else f"{x:.1f}"
    return str(x)


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (COLUMNS)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def report(result: dict, table: str) -> str:
    """A markdown report: the setup, the column meanings and the table."""
    setup = ", ".join(f"{k}={result[k]}" for k in (
        "backend", "devices", "block_size", "num_blocks", "num_prompts", "prompt_len",
        "shared_len", "passes"))
    return f"""# Re-carving CP workers: measured ({result['backend']})

`python -m vertumnus_jax.bench_recarve` ({setup}; jax {jax.__version__}).

Each operation runs on idle workers (no drain in the time). Seconds are wall time with the
device work finished. `weight_bytes_moved` is counted by buffer pointer (0: the weights were
re-wrapped, not copied). KV blocks hold K and V of all layers for `block_size` tokens.
`first_prefill_s` is the first prefill on a new worker reusing a moved prefix (compilation
included when the worker's device set is new), `warm_prefill_s` the same prompt again.
`reload_s` is the alternative: orbax `restore_params` plus one `device_put` per device of the
operation. Pass 1 includes compiling the KV move kernels; pass 2 is the steady state. The paper
reports {PAPER_SECONDS[0]} to {PAPER_SECONDS[1]} s per operation on GPUs.

{table}
"""


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    if _PASSES.value < 1:
        raise app.UsageError("--passes must be >= 1")
    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    if len(jax.devices()) < 8:
        raise app.UsageError(f"needs 8 devices, found {len(jax.devices())}")
    layers = [int(x) for x in _LAYERS.value]
    if len(layers) == 1:
        layers *= len(_MODELS.value)
    if len(layers) != len(_MODELS.value) or min(layers) < 0:
        raise app.UsageError("--num_layers must give one count >= 0 per model (or one for all)")
    if not 0 <= _SHARED.value < _LEN.value:
        raise app.UsageError("--shared_len must be in [0, --prompt_len)")
    rows = []
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for name, n in zip(_MODELS.value, layers):
            rows += bench_model(name, n, ckpt_dir)
    table = markdown(rows)
    print(table)
    result = dict(paper_seconds_per_operation=list(PAPER_SECONDS), backend=jax.default_backend(),
                  devices=len(jax.devices()), block_size=_BLOCK.value,
                  num_blocks=_NUM_BLOCKS.value, num_prompts=_PROMPTS.value,
                  prompt_len=_LEN.value, shared_len=_SHARED.value, passes=_PASSES.value,
                  rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
    with open(_OUTPUT.value, "w") as f:
        json.dump(result, f, indent=1)
    if _MARKDOWN.value:
        with open(_MARKDOWN.value, "w") as f:
            f.write(report(result, table))
    print(f"wrote {_OUTPUT.value}" + (f" and {_MARKDOWN.value}" if _MARKDOWN.value else ""))


if __name__ == "__main__":
    app.run(main)
