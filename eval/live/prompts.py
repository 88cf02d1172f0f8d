"""Trace requests as real token prompts for a live server, scaled to CPU-feasible lengths.

A trace request carries a chain of block hashes, not tokens. `scaled_prompt` turns block k
(hash `h_k`, `trace_block_size` tokens in the trace) into `tokens_per_block` token ids drawn
from a generator seeded by `h_k`, so two requests that share their first k block hashes get
identical first `k * tokens_per_block` tokens: prefix sharing is real on the server. The
request's length is scaled by `length_scale = tokens_per_block / trace_block_size` (the last,
partial block proportionally, at least one token). When `tokens_per_block` is a multiple of the
server's KV block size, every shared trace block is a whole number of server blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from serving.policy.request import Request, prompt_block_hashes


@dataclasses.dataclass(frozen=True)
class PromptScale:
    """How trace requests become prompts.

    Attributes:
      tokens_per_block: prompt tokens per trace block, >= 1.
      vocab_size: token ids are drawn from `[0, vocab_size)`, >= 2.
      max_len: prompts longer than this are cut to it (tokens), >= 1.
    """

    tokens_per_block: int = 16
    vocab_size: int = 256
    max_len: int = 4096

    def __post_init__(self) -> None:
        for name, low in (("tokens_per_block", 1), ("vocab_size", 2), ("max_len", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _block_tokens(block_hash: int, n: int, vocab_size: int) -> np.ndarray:
    return np.random.default_rng(block_hash).integers(0, vocab_size, n, dtype=np.int64)


def scaled_prompt(request: Request, scale: PromptScale) -> list[int]:
    """The token ids of `request` under `scale` (module doc); deterministic in its hashes.

    Returns:
      `min(max_len, (n - 1) * t + ceil(r * t / B))` ints in `[0, vocab_size)`, where `n` is the
      number of trace blocks, `t = tokens_per_block`, `B = request.block_size` and `r` the
      tokens of the last trace block.
    """
    t, b = scale.tokens_per_block, request.block_size
    n = len(request.block_hashes)
    last = request.input_len - (n - 1) * b
    parts = [_block_tokens(h, t, scale.vocab_size) for h in request.block_hashes[:-1]]
    parts.append(_block_tokens(request.block_hashes[-1], max(1, math.ceil(last * t / b)),
                               scale.vocab_size))
    tokens = np.concatenate(parts)[:scale.max_len]
    return [int(x) for x in tokens]


def scaled_requests(requests: Sequence[Request], scale: PromptScale, server_block_size: int
                    ) -> list[tuple[Request, list[int]]]:
    """Each request with its prompt, re-expressed at the server's block size.

    The returned `Request` keeps id, arrival time, output length and SLO; its `input_len` is
    the prompt's length and its hashes are the chain over the prompt's server blocks (content
    ids from the tokens), so the simulator can replay exactly what the server saw.

    Raises:
      ValueError: `server_block_size < 1`.
    """
    if server_block_size < 1:
        raise ValueError(f"server_block_size must be >= 1, got {server_block_size}")
    out = []
    for r in requests:
        tokens = scaled_prompt(r, scale)
        hashes = prompt_block_hashes(tokens, server_block_size)  # as the server hashes it
        out.append((Request(r.request_id, r.arrival_time, len(tokens), r.output_len, hashes,
                            server_block_size, r.ttft_slo, token_ids=tokens), tokens))
    return out
