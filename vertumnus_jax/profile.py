r"""Times real zigzag CP prefill on the devices at hand and writes the prefill profile CSV.

    python -m vertumnus_jax.profile --model=tiny --cpu_devices=8 --cp_degrees=1,2,4,8 \
        --input_lens=128,256,512 --cached_fractions=0,0.5,0.9,0.99 --output=/tmp/profile.csv
    python -m vertumnus_jax.profile --checkpoint=/path/to/Qwen3-8B --input_lens=4096,16384

For every CP degree C (a worker on devices [0, C)), input length L and cached length h (the
fraction of L rounded down to whole blocks, at most `(L - 1) // bs` blocks): the prefix is
prefilled and cached once, then `prefill` of the whole prompt over that cached prefix runs
`--warmup` times (compilation included) and `--repeats` times timed; the new blocks are freed
after each run so every run sees the same cache. A run is timed from the host call to the first
token on the host (wall clock, `time.perf_counter`). The CSV has the columns the cost model reads
(`serving.policy.profiles.read_profile_csv`): `cp,input_len,cached_len,seconds`, seconds the median.
On a GPU the same command times the Triton kernel; on CPU the Pallas interpreter (so CPU numbers
only show the shape of the curves).
"""

from __future__ import annotations

import csv

import jax
import numpy as np
from absl import app, flags, logging

from mesh import worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import init_model
from vertumnus_jax.profile_timing import cached_length, time_prefill
from vertumnus_jax.worker import Worker

_MODEL = flags.DEFINE_string("model", "tiny", "Named config with seeded random weights: tiny, "
                             "tiny-moe, qwen3-0.6b, qwen3-8b, qwen3-30b-a3b.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (overrides "
                                  "--model).")
_DTYPE = flags.DEFINE_string("dtype", None, "Parameter dtype override (float32, bfloat16).")
_CP = flags.DEFINE_list("cp_degrees", ["1", "2", "4", "8"], "CP degrees to time (those larger "
                        "than the device count are skipped).")
_LENS = flags.DEFINE_list("input_lens", ["128", "256", "512"], "Prompt lengths (tokens).")
_FRACS = flags.DEFINE_list("cached_fractions", ["0", "0.5", "0.9", "0.99"], "Cached share of each "
                           "prompt, in [0, 1).")
_BLOCK = flags.DEFINE_integer("block_size", 16, "KV block size (tokens), a power of two.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed runs per grid point (>= 1: compiles).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per grid point; the median is kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and prompts.")
_OUTPUT = flags.DEFINE_string("output", "prefill_profile.csv", "CSV path to write.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "On CPU: host devices to create "
                                    "(jax_num_cpu_devices), e.g. 8 to time C up to 8.")


def main(argv):
    del argv
    if _WARMUP.value < 1 or _REPEATS.value < 1:
        raise app.UsageError("--warmup and --repeats must be >= 1")
    if _CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    if _CHECKPOINT.value:
        from vertumnus_jax.checkpoint import load_hf_checkpoint
        model = load_hf_checkpoint(_CHECKPOINT.value, dtype=_DTYPE.value)
    else:
        overrides = {"dtype": _DTYPE.value} if _DTYPE.value else {}
        model = init_model(ModelConfig.named(_MODEL.value, **overrides), _SEED.value)
    devices = jax.devices()
    lens = [int(x) for x in _LENS.value]
    fracs = [float(x) for x in _FRACS.value]
    if min(lens) < 1 or not all(0.0 <= f < 1.0 for f in fracs):
        raise app.UsageError("--input_lens must be >= 1 and --cached_fractions in [0, 1)")
    bs = _BLOCK.value
    rng = np.random.default_rng(_SEED.value)
    rows = []
    for c in sorted({int(x) for x in _CP.value}):
        if c > len(devices):
            logging.warning("skipping cp=%d: only %d devices", c, len(devices))
            continue
        # Two prompts' worth of blocks per rank: the cached prefix plus one run's new blocks.
        num_blocks = 2 * (-(-max(lens) // bs) // c + 1)
        worker = Worker(worker_mesh(devices, 0, c), model, num_blocks=num_blocks,
                        block_size=bs)
        for length in lens:
            tokens = rng.integers(0, model.config.vocab_size, length)
            for h in sorted({cached_length(length, f, bs) for f in fracs}):
                seconds = time_prefill(worker, tokens, h, _WARMUP.value, _REPEATS.value)
                rows.append((c, length, h, seconds))
                print(f"cp={c:<3d} input_len={length:<7d} cached_len={h:<7d} "
                      f"seconds={seconds:.6f}", flush=True)
                worker.cache.evict(worker.cache.num_blocks * c)  # next point starts cold
    with open(_OUTPUT.value, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["cp", "input_len", "cached_len", "seconds"])
        writer.writerows((c, length, h, repr(float(s))) for c, length, h, s in rows)
    print(f"wrote {len(rows)} rows to {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
