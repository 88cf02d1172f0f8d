"""Tests for pallas_kernels.flash_attention against the pure-jnp reference.

`FlashAttentionTest` compiles the kernel for the GPU (Triton) and is skipped elsewhere;
`FlashAttentionInterpretTest` runs the same cases in Pallas interpret mode on CPU. Most cases share
one shape (batch 2, 128 queries, 1024 keys, 8 query heads, head_dim 64) and differ only in the
position arrays, so the interpreter compiles once for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels import (
    BlockSizes,
    attention_reference,
    bench,
    flash_attention,
    merge_attention_states,
)
from pallas_kernels.flash_attention import _block_schedule, _flash_attention_call

BATCH, Q_LEN, KV_LEN, Q_HEADS, HEAD_DIM = 2, 128, 1024, 8, 64
BLOCKS = BlockSizes(block_q=64, block_k=64)


def _qkv(seed, *, q_len=Q_LEN, kv_len=KV_LEN, q_heads=Q_HEADS, kv_heads=2, head_dim=HEAD_DIM,
         batch=BATCH, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_len, q_heads, head_dim))
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _pad_to(x, length):
    return np.concatenate([x, -np.ones(length - len(x), np.int64)])


def _cached_prefix(h, n_new, kv_len=KV_LEN):
    """Queries at h .. h+n_new-1 over a cached prefix of h tokens: (q_pos, kv_pos) 1-D."""
    return h + np.arange(n_new), _pad_to(np.arange(h + n_new), kv_len)


def _zigzag(h, n_new, cp_degree, rank, kv_len=KV_LEN):
    """Rank `rank`'s queries (chunks r and 2C-1-r of the new tokens) and the keys it attends:
    the cached prefix, then every rank's new tokens in all-gather (rank) order."""
    chunks = np.split(h + np.arange(n_new), 2 * cp_degree)
    per_rank = [np.concatenate([chunks[r], chunks[2 * cp_degree - 1 - r]])
                for r in range(cp_degree)]
    return per_rank[rank], _pad_to(np.concatenate([np.arange(h), *per_rank]), kv_len)


def _positions(pairs):
    q_pos, kv_pos = zip(*pairs)
    return jnp.asarray(np.stack(q_pos), jnp.int32), jnp.asarray(np.stack(kv_pos), jnp.int32)


def _layout(name):
    """Named position layouts at the shared shape: (q_positions, kv_positions) [BATCH, ...]."""
    if name == "prefix_aligned":
        return _positions([_cached_prefix(512, Q_LEN), _cached_prefix(768, Q_LEN)])
    if name == "prefix_unaligned":
        return _positions([_cached_prefix(700, Q_LEN), _cached_prefix(333, Q_LEN)])
    if name == "padding":
        # Row 0: 100 new tokens after h=300, padding queries at the end and in the middle, and a
        # padding page between prefix and new keys. Row 1: 64 new tokens after h=837.
        q0 = _pad_to(300 + np.arange(100), Q_LEN)
        q0[[5, 50]] = -1
        kv0 = _pad_to(np.concatenate([np.arange(300), -np.ones(64, np.int64),
                                      300 + np.arange(100)]), KV_LEN)
        q1 = _pad_to(837 + np.arange(64), Q_LEN)
        return _positions([(q0, kv0), (q1, _pad_to(np.arange(901), KV_LEN))])
    raise ValueError(name)


class FlashAttentionTest(parameterized.TestCase):
    INTERPRET = False

    def setUp(self):
        super().setUp()
        if not self.INTERPRET and jax.default_backend() != "gpu":
            self.skipTest("compiled kernel needs a GPU; FlashAttentionInterpretTest runs on CPU")

    def attend(self, *args, **kwargs):
        kwargs.setdefault("block_sizes", BLOCKS)
        return flash_attention(*args, interpret=self.INTERPRET, **kwargs)

    def assert_matches_reference(self, q, k, v, q_pos, kv_pos, reference_inputs=None):
        out, lse = self.attend(q, k, v, q_pos, kv_pos)
        ref_out, ref_lse = attention_reference(*(reference_inputs or (q, k, v)), q_pos, kv_pos)
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
        self.assertFalse(np.isnan(out).any() or np.isnan(lse).any(), "NaN in kernel output")
        if q.dtype == jnp.float32:
            np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=0)
            np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=0)
        else:
            self.assertLessEqual(np.abs(out - ref_out).max() / np.abs(ref_out).max(), 1e-2)
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-2)
        return out, lse

    def test_contiguous_causal(self):
        q, k, v = _qkv(0, q_len=256, kv_len=256)
        pos = jnp.tile(jnp.arange(256, dtype=jnp.int32), (BATCH, 1))
        self.assert_matches_reference(q, k, v, pos, pos)

    @parameterized.named_parameters(
        ("prefix_aligned", "prefix_aligned"),
        ("prefix_unaligned", "prefix_unaligned"),
        ("padding", "padding"),
    )
    def test_layouts(self, layout):
        seed = {"prefix_aligned": 1, "prefix_unaligned": 2, "padding": 3}[layout]
        self.assert_matches_reference(*_qkv(seed), *_layout(layout))

    @parameterized.parameters(2, 4, 8)
    def test_zigzag(self, cp_degree):
        n_new = Q_LEN * cp_degree  # each rank holds 128 new tokens
        h = min(700, KV_LEN - n_new)  # cached prefix, unaligned where it fits
        for first_rank in range(0, cp_degree, BATCH):
            q_pos, kv_pos = _positions(
                [_zigzag(h, n_new, cp_degree, first_rank + i) for i in range(BATCH)])
            self.assert_matches_reference(*_qkv(10 * cp_degree + first_rank), q_pos, kv_pos)

    @parameterized.parameters(1, 2, 4, 8)
    def test_gqa_ratio(self, ratio):
        qkv = _qkv(20 + ratio, kv_heads=Q_HEADS // ratio)
        self.assert_matches_reference(*qkv, *_layout("prefix_unaligned"))

    def test_head_dim_128(self):
        self.assert_matches_reference(*_qkv(30, head_dim=128), *_layout("prefix_unaligned"))

    def test_bfloat16(self):
        q_pos, kv_pos = _positions([_zigzag(300, 512, 4, r) for r in (0, 3)])
        self.assert_matches_reference(*_qkv(31, dtype=jnp.bfloat16), q_pos, kv_pos)

    def test_ragged_lengths_and_head_dim(self):
        # Lengths off the block grid and a non-power-of-two head_dim take the padding path.
        qkv = _qkv(32, q_len=100, kv_len=1000, head_dim=80)
        q_pos, kv_pos = _positions([(h + np.arange(100), np.arange(1000)) for h in (0, 900)])
        self.assert_matches_reference(*qkv, q_pos, kv_pos)

    def test_row_without_visible_key_is_zero_with_neg_inf_lse(self):
        # Keys at 600..1023 only; queries at 500..627: those below 600 (and padding) see nothing.
        q, k, v = _qkv(40)
        q_pos = np.tile(500 + np.arange(Q_LEN), (BATCH, 1))
        q_pos[1, -8:] = -1
        kv_pos = np.tile(_pad_to(600 + np.arange(424), KV_LEN), (BATCH, 1))
        out, lse = self.assert_matches_reference(q, k, v, *_positions(zip(q_pos, kv_pos)))
        empty = (q_pos < 600)
        self.assertEqual(int(empty.sum()), 2 * 100 + 8)
        np.testing.assert_array_equal(out[empty], 0.0)
        self.assertTrue(np.isneginf(lse[empty]).all())
        self.assertTrue(np.isfinite(lse[~empty]).all())

    def test_unseen_keys_are_never_read(self):
        # NaN in padding K/V and in key blocks no query can see: only correct if the padding is
        # masked on read and invisible blocks are skipped (the causal saving).
        q, k, v = _qkv(41)
        # Row 0: queries at 300..427 over keys 0..1023; key blocks 7..15 (keys >= 448) are valid
        # but no query sees them. Row 1: h=700, padding keys from 828 on, partly inside block 12,
        # which the last query block visits.
        q_pos, kv_pos = _positions(
            [(300 + np.arange(Q_LEN), np.arange(KV_LEN)), _cached_prefix(700, Q_LEN)])
        kv_np = np.asarray(kv_pos)
        poison = np.stack([kv_np[0] >= 448, kv_np[1] < 0])
        bad_k = jnp.where(poison[:, :, None, None], jnp.nan, k)
        bad_v = jnp.where(poison[:, :, None, None], jnp.nan, v)
        self.assert_matches_reference(q, bad_k, bad_v, q_pos, kv_pos, reference_inputs=(q, k, v))

    def test_merge_of_key_halves_equals_whole(self):
        q, k, v = _qkv(50)
        rng = np.random.default_rng(51)
        q_pos = np.sort(rng.choice(KV_LEN, size=(BATCH, Q_LEN), replace=False), axis=1)
        q_pos[0, :3] = -1  # padding rows: -inf on both sides
        q_pos, kv_pos = _positions([(qp, np.arange(KV_LEN)) for qp in q_pos])
        half = KV_LEN // 2
        out_a, lse_a = self.attend(q, k[:, :half], v[:, :half], q_pos, kv_pos[:, :half])
        out_b, lse_b = self.attend(q, k[:, half:], v[:, half:], q_pos, kv_pos[:, half:])
        self.assertTrue(np.isneginf(np.asarray(lse_b)).any())  # queries below `half`
        out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
        ref_out, ref_lse = attention_reference(q, k, v, q_pos, kv_pos)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=0)

    def test_output_fully_written(self):
        # Outputs aliased to NaN-poisoned buffers: every row, padding included, must be written.
        q, k, v = _qkv(60)
        q_pos, kv_pos = _layout("padding")
        schedule = _block_schedule(q_pos, kv_pos, BLOCKS.block_q, BLOCKS.block_k)
        poison = (jnp.full(q.shape, jnp.nan, q.dtype),
                  jnp.full((BATCH, Q_LEN, Q_HEADS), jnp.nan, jnp.float32))
        out, lse = _flash_attention_call(
            q, k, v, q_pos, kv_pos, schedule, sm_scale=HEAD_DIM ** -0.5, block_sizes=BLOCKS,
            interpret=self.INTERPRET, out_init=poison)
        ref_out, ref_lse = attention_reference(q, k, v, q_pos, kv_pos)
        self.assertFalse(np.isnan(np.asarray(out)).any() or np.isnan(np.asarray(lse)).any())
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=0)

    def test_shard_map_zigzag_on_four_devices(self):
        cp, h, n_new = 4, 200, 512
        if len(jax.devices()) < cp:
            self.skipTest(f"needs {cp} devices")
        mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
        chunk = n_new // (2 * cp)
        q_all, k_all, v_all = _qkv(70, batch=1, q_len=n_new, kv_len=h + n_new)
        # Rank-major (zigzag) order of the new tokens: rank r holds chunks r and 2C-1-r.
        order = np.concatenate([_zigzag(0, n_new, cp, r)[0] for r in range(cp)])
        new_pos = jnp.asarray(h + order, jnp.int32)[None]  # [1, n_new]
        q_new = q_all[:, order]
        k_new, v_new = k_all[:, h + order], v_all[:, h + order]
        prefix_pos = jnp.arange(h, dtype=jnp.int32)[None]

        def rank_prefill(q, k, v, pos, k_pre, v_pre, pre_pos):
            gather = functools.partial(jax.lax.all_gather, axis_name="cp", axis=1, tiled=True)
            kv_pos = jnp.concatenate([pre_pos, gather(pos)], axis=1)
            k = jnp.concatenate([k_pre, gather(k)], axis=1)
            v = jnp.concatenate([v_pre, gather(v)], axis=1)
            return self.attend(q, k, v, pos, kv_pos)

        sharded = P(None, "cp")
        fn = jax.jit(jax.shard_map(
            rank_prefill, mesh=mesh, in_specs=(sharded,) * 4 + (P(),) * 3,
            out_specs=(sharded, sharded), check_vma=False))
        out, lse = fn(q_new, k_new, v_new, new_pos, k_all[:, :h], v_all[:, :h], prefix_pos)
        all_pos = jnp.arange(h + n_new, dtype=jnp.int32)[None]
        ref_out, ref_lse = attention_reference(q_all, k_all, v_all, all_pos[:, h:], all_pos)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out)[:, order], atol=1e-5,
                                   rtol=0)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse)[:, order], atol=1e-5,
                                   rtol=0)


class FlashAttentionInterpretTest(FlashAttentionTest):
    INTERPRET = True


class FlashAttentionApiTest(parameterized.TestCase):
    """Backend-independent checks: merge edge cases, validation, defaults, GPU lowering."""

    def test_merge_edge_cases(self):
        out_a = jnp.asarray([[1.0, 2.0], [np.nan, np.nan], [0.0, 0.0], [3.0, -1.0]])
        lse_a = jnp.asarray([0.5, -np.inf, -np.inf, np.log(3.0)])
        out_b = jnp.asarray([[5.0, 6.0], [7.0, 8.0], [0.0, 0.0], [-1.0, 3.0]])
        lse_b = jnp.asarray([0.5, 1.25, -np.inf, np.log(1.0)])
        out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
        expected = [[3.0, 4.0], [7.0, 8.0], [0.0, 0.0], [0.75 * 3 - 0.25, -0.75 + 0.25 * 3]]
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(lse), [0.5 + np.log(2.0), 1.25, -np.inf, np.log(4.0)], rtol=1e-6)

    def test_merge_rejects_mismatched_shapes(self):
        with self.assertRaisesRegex(ValueError, "lse_a and lse_b"):
            merge_attention_states(jnp.ones((2, 4)), jnp.ones(3), jnp.ones((2, 4)), jnp.ones(2))

    def test_invalid_inputs(self):
        q, k, v = _qkv(80, q_len=16, kv_len=16, kv_heads=3, q_heads=8)
        pos = jnp.zeros((BATCH, 16), jnp.int32)
        with self.assertRaisesRegex(ValueError, "num_q_heads"):
            flash_attention(q, k, v, pos, pos)
        q, k, v = _qkv(81, q_len=16, kv_len=16)
        with self.assertRaisesRegex(ValueError, "kv_positions"):
            flash_attention(q, k, v, pos, pos[:, :8])
        with self.assertRaisesRegex(ValueError, "q_positions"):
            flash_attention(q, k, v, pos.astype(jnp.float32), pos)
        with self.assertRaisesRegex(ValueError, "q_len"):
            flash_attention(q[:, :0], k, v, pos[:, :0], pos)
        with self.assertRaisesRegex(ValueError, "block_k"):
            BlockSizes(block_q=64, block_k=48)
        with self.assertRaisesRegex(ValueError, "backend"):
            BlockSizes.get_default("tpu")

    def test_zero_heads_rejected_naming_the_field(self):
        pos = jnp.zeros((1, 16), jnp.int32)
        for name, q_heads, kv_heads in (("num_kv_heads", 4, 0), ("num_q_heads", 0, 2)):
            q = jnp.ones((1, 16, q_heads, 16))
            k = jnp.ones((1, 16, kv_heads, 16))
            for fn in (flash_attention, attention_reference):
                with self.assertRaisesRegex(ValueError, f"{name} must be >= 1; got 0"):
                    fn(q, k, k, pos, pos)

    def test_unsigned_positions_rejected(self):
        # uint32 2**32 - 1 would become -1 (padding) in the int32 cast and silently vanish.
        q, k, v = _qkv(83, q_len=16, kv_len=16, batch=1)
        pos = jnp.arange(16, dtype=jnp.int32)[None]
        big = jnp.full((1, 16), 2**32 - 1, jnp.uint32)
        for fn in (flash_attention, attention_reference):
            with self.assertRaisesRegex(ValueError, "kv_positions must be a signed integer"):
                fn(q, k, v, pos, big)
            with self.assertRaisesRegex(ValueError, "q_positions must be a signed integer"):
                fn(q, k, v, pos.astype(jnp.uint8), pos)

    def test_non_finite_sm_scale_rejected(self):
        q, k, v = _qkv(84, q_len=16, kv_len=16, batch=1)
        pos = jnp.arange(16, dtype=jnp.int32)[None]
        for scale in (float("nan"), float("inf"), -float("inf"), np.float32("nan")):
            for fn in (flash_attention, attention_reference):
                with self.assertRaisesRegex(ValueError, "sm_scale must be a finite number"):
                    fn(q, k, v, pos, pos, sm_scale=scale)

    def test_interpret_chosen_automatically_on_cpu(self):
        if jax.default_backend() != "cpu":
            self.skipTest("checks the CPU default")
        q, k, v = _qkv(82, q_len=32, kv_len=64, head_dim=16)
        q_pos, kv_pos = _positions([(32 + np.arange(32), np.arange(64))] * BATCH)
        out, _ = flash_attention(q, k, v, q_pos, kv_pos)
        ref_out, _ = attention_reference(q, k, v, q_pos, kv_pos)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=0)

    def test_bench_counts_causal_pairs_exactly(self):
        n = 300
        pos = np.arange(n)[None]
        self.assertEqual(bench.causal_pairs(pos, pos), n * (n + 1) // 2)
        # Queries 5, 7 and a padding row over keys 0..7 with key 3 padded: 5 + 7 + 0 pairs.
        q_pos = np.array([[5, 7, -1]])
        kv_pos = np.array([[0, 1, 2, -1, 4, 5, 6, 7]])
        self.assertEqual(bench.causal_pairs(q_pos, kv_pos), 12)

    @parameterized.parameters((jnp.bfloat16, 128, 8), (jnp.float32, 80, 1))
    def test_lowers_to_triton_for_gpu(self, dtype, head_dim, ratio):
        # Cross-lowering on any host: the kernel must become a Triton custom call for CUDA.
        q = jax.ShapeDtypeStruct((1, 1024, 8, head_dim), dtype)
        k = jax.ShapeDtypeStruct((1, 4096, 8 // ratio, head_dim), dtype)
        q_pos = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
        kv_pos = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
        fn = jax.jit(functools.partial(flash_attention, interpret=False))
        text = fn.trace(q, k, k, q_pos, kv_pos).lower(lowering_platforms=("cuda",)).as_text()
        self.assertIn("__gpu$xla.gpu.triton", text)


if __name__ == "__main__":
    absltest.main()
