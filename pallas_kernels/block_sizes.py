"""`BlockSizes`: the flash-attention kernel's tiling and its per-backend defaults.

Below both `pallas_kernels.flash_attention` (the kernel) and `pallas_kernels.reference` (which
takes the same arguments), so that neither imports the other. Plain Python.
"""

from __future__ import annotations

import dataclasses


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def default_num_warps(block_q: int, block_k: int) -> int:
    """Triton warps for a `block_q x block_k` tile (tokens x tokens) when
    `BlockSizes.num_warps` is None.

    8 for tiles of 128 x 128 or more, else 4: the H200 sweep of `pallas_kernels.tune`
    (jax 0.11.2, bf16, Qwen3-8B heads, head_dim 128; pallas_kernels/results/tune_h200.md) ran
    128 x 64 tiles at 406 TFLOP/s with 4 warps and 316 with 8 (causal 16K), and 128 x 128 tiles
    at 384 with 8 warps and 226 with 4. Measured only for block_q in {64, 128}, block_k in
    {32, 64, 128} at head_dim 128; other tiles (256 x 64, other head_dims) get the tile-area
    rule unmeasured. Raises ValueError for a block size below 1.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"default_num_warps: block_q and block_k must be >= 1, got "
                         f"{block_q}, {block_k}")
    return 8 if block_q * block_k >= 128 * 128 else 4


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tiling of the forward kernel.

    Attributes:
      block_q: query rows per program (tokens); a power of two >= 16.
      block_k: keys per inner-loop step (tokens); a power of two >= 16.
      num_warps: Triton warps per program; None picks `default_num_warps` of the (clipped)
        tiles. GPU only.
      num_stages: Triton software-pipelining stages of the key loop. GPU only.

    Both block sizes are clipped to the (padded) sequence lengths, so small inputs use smaller
    tiles. Raises ValueError for a block size that is not a power of two >= 16 (Triton's `dot`
    needs tiles of at least 16 and power-of-two tensor shapes).
    """

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 16 and _is_pow2(value)):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value!r}")
        if self.num_warps is not None and not (1 <= self.num_warps <= 32):
            raise ValueError(
                f"BlockSizes.num_warps must be in [1, 32] or None, got {self.num_warps}"
            )
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"BlockSizes.num_stages must be in [1, 8], got {self.num_stages}")

    @classmethod
    def get_default(cls, backend: str) -> BlockSizes:
        """Defaults per backend: "gpu"/"cuda" (H100/H200-class, Triton) or "cpu" (interpret).

        GPU: 128 x 64 tiles, 3 stages, 4 warps (`default_num_warps`): the fastest or within
        1 % of it at 16K causal and 4K new after 28K cached of the H200 sweep
        (pallas_kernels/results/tune_h200.md). CPU: 128 x 128, fewer interpreter steps.
        Raises ValueError for another backend name.
        """
        if backend in ("gpu", "cuda"):
            return cls(block_q=128, block_k=64, num_warps=None, num_stages=3)
        if backend == "cpu":
            return cls(block_q=128, block_k=128)
        raise ValueError(f"backend must be 'gpu', 'cuda' or 'cpu', got {backend!r}")
