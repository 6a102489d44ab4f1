"""The latent cache subsystem: what one token of one layer costs, and where it lives.

- `contiguous.py`: `LatentCache`, slots × max_seq_len of latents, one `lengths`
- `paged.py`: `PagedLatentCache`, pages of token rows, a block table, fp8/int8 rows
- `blocks.py`: `BlockPool`, the tensor-free pages: reference counts, free queue, prefix map, block tables
- `quant.py`: the byte layout of one cached token (exact, fp8 656 B, int8) and its (de)quantization
"""

from mlakit.cache.blocks import BlockPool, blocks_for
from mlakit.cache.contiguous import LatentCache, Slots, row_counts
from mlakit.cache.paged import PagedLatentCache
from mlakit.cache.quant import QUANTS, dequantize, quantize, token_layout

__all__ = [
    "QUANTS",
    "BlockPool",
    "LatentCache",
    "PagedLatentCache",
    "Slots",
    "blocks_for",
    "dequantize",
    "quantize",
    "row_counts",
    "token_layout",
]
