"""Cross-process prefix copies (`export_prefix` / `import_prefix`) give the cache state a
device-to-device `replicate_prefix` gives: the same hashes cached, block i on rank `i mod C` of
the destination, and that block holding the reference K/V (`full_prefill`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from mesh import ParamReplicas, worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.kv_transfer import export_prefix, import_prefix
from vertumnus_jax.model import full_prefill, init_model
from vertumnus_jax.prefill import prefill_request, release_request
from vertumnus_jax.prefix_cache import OutOfBlocksError, block_hashes
from vertumnus_jax.worker import Worker

BS, LEN = 16, 120  # 7 full blocks
CFG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def env():
    model = init_model(CFG, seed=0)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, LEN)
    _, k, v = full_prefill(model, tokens)
    return dict(graphdef=graphdef, replicas=ParamReplicas(state, jax.devices()), exe={},
                tokens=tokens, hashes=block_hashes(tokens, BS), k=np.asarray(k),
                v=np.asarray(v))


def _worker(env, first, cp, num_blocks=16):
    return Worker.from_replicas(worker_mesh(jax.devices(), first, cp), env["graphdef"],
                                env["replicas"], num_blocks=num_blocks, block_size=BS,
                                executables=env["exe"])


@pytest.mark.parametrize("src_cp,dst_cp,held", [(2, 4, 0), (4, 1, 3), (1, 2, 7)])
def test_export_import_restripes_reference_kv(env, src_cp, dst_cp, held):
    src = _worker(env, 0, src_cp)
    release_request(src, prefill_request(src, env["tokens"]))
    dst = _worker(env, 4, dst_cp)
    chain = env["hashes"]
    if held:  # dst already caches the first `held` blocks
        part = env["tokens"][:held * BS + 1]
        release_request(dst, prefill_request(dst, part))
        dst.cache.drain_events()
    k, v = export_prefix(src, chain, start=min(held, len(chain) - 1))
    start = min(held, len(chain) - 1)
    assert k.shape == (CFG.num_layers, (len(chain) - start) * BS, CFG.num_kv_heads, CFG.head_dim)
    result = import_prefix(dst, chain, start, k, v)
    assert result.kv_blocks_moved == len(chain) - held
    assert result.inserted == tuple(chain[held:])
    ids = dst.cache.match(chain, touch=False)
    assert len(ids) == len(chain)
    got_k, got_v = dst.pool.read_sequence(ids)
    n = len(chain) * BS
    np.testing.assert_allclose(got_k, env["k"][:, :n], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_v, env["v"][:, :n], atol=1e-5, rtol=0)
    # a prefill on dst now reuses the imported prefix and matches the reference
    again = prefill_request(dst, env["tokens"])
    assert again.cached_blocks == (LEN - 1) // BS
    release_request(dst, again)


def test_import_refuses_bad_input_and_leaves_dst_unchanged(env):
    src = _worker(env, 0, 2)
    release_request(src, prefill_request(src, env["tokens"]))
    chain = env["hashes"]
    k, v = export_prefix(src, chain, start=2)
    dst = _worker(env, 4, 2, num_blocks=2)  # 4 blocks in all: not enough for 7
    with pytest.raises(ValueError, match="leading blocks"):
        import_prefix(dst, chain, 2, k, v)
    with pytest.raises(ValueError, match="shape"):
        import_prefix(dst, chain, 0, k, v)
    k0, v0 = export_prefix(src, chain)
    with pytest.raises(OutOfBlocksError):
        import_prefix(dst, chain, 0, k0, v0)
    assert len(dst.cache) == 0 and dst.cache.num_free(0) == 2 and dst.cache.num_free(1) == 2
    with pytest.raises(ValueError, match="holds only"):
        export_prefix(dst, chain)
