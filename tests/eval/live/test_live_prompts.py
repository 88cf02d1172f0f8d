"""Trace requests as token prompts: deterministic, prefix-sharing, lengths as specified."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from eval.live.prompts import PromptScale, scaled_prompt, scaled_requests
from serving.policy.request import Request, chain_block_hashes


def _req(rid, ids, input_len, block_size=512, t=0.0):
    return Request(rid, t, input_len, 3, chain_block_hashes(ids), block_size)


def test_length_formula_and_range():
    r = _req("a", [11, 12, 13], 1200)  # blocks of 512, 512, 176 tokens
    tokens = scaled_prompt(r, PromptScale(tokens_per_block=16, vocab_size=50))
    assert len(tokens) == 2 * 16 + math.ceil(176 * 16 / 512)  # 38
    assert min(tokens) >= 0 and max(tokens) < 50
    assert len(set(tokens)) > 5  # not a constant fill


def test_shared_prefix_gives_equal_tokens_and_divergence_after():
    scale = PromptScale(tokens_per_block=16)
    a = scaled_prompt(_req("a", [1, 2, 3, 4], 2048), scale)
    b = scaled_prompt(_req("b", [1, 2, 9, 4], 2048), scale)
    assert a[:32] == b[:32]
    assert a[32:48] != b[32:48]
    # block 4 has the same content id but a different chain hash: different tokens
    assert a[48:] != b[48:]
    assert scaled_prompt(_req("c", [1, 2, 3, 4], 2048), scale) == a  # deterministic


def test_max_len_cuts():
    tokens = scaled_prompt(_req("a", list(range(10)), 5120), PromptScale(16, 256, max_len=100))
    assert len(tokens) == 100


def test_scaled_requests_rehash_at_server_block_size():
    reqs = [_req("a", [1, 2, 3], 1536, t=0.5), _req("b", [1, 2, 7], 1500, t=1.0)]
    (ra, ta), (rb, tb) = scaled_requests(reqs, PromptScale(16, 256), server_block_size=8)
    assert (ra.input_len, rb.input_len) == (48, 47)
    assert ra.token_ids == ta and ra.arrival_time == 0.5 and ra.output_len == 3
    ids = [int.from_bytes(hashlib.blake2b(np.asarray(ta[i:i + 8], "<i4").tobytes(),
                                          digest_size=8).digest(), "little")
           for i in range(0, 48, 8)]
    assert ra.block_hashes == chain_block_hashes(ids)
    assert ra.block_hashes[:4] == rb.block_hashes[:4] and ra.block_hashes[4] != rb.block_hashes[4]


@pytest.mark.parametrize("kw", [dict(tokens_per_block=0), dict(vocab_size=1), dict(max_len=0),
                                dict(tokens_per_block=1.5)])
def test_scale_validation(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        PromptScale(**kw)
