"""The KV cache's memory: preallocated block tensors for every layer, sized from a budget.

One tensor holds everything, so the budget is one allocation and a layer's K and V are
views:

    kv [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
    layer l: k_cache = kv[l, 0], v_cache = kv[l, 1]   [num_blocks, kvh, block_size, hd]

Within a block, one head's block_size x head_dim slab is contiguous, which is what the
attention kernel streams. No request owns memory here: the block pool hands out ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.config import CacheConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * block_size * model.head_dim * elem


@dataclass
class KVCacheTensors:
    kv: torch.Tensor

    @classmethod
    def allocate(
        cls, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
    ) -> KVCacheTensors:
        num_blocks = cache.kv_cache_memory_bytes // bytes_per_block(model, cache.block_size, dtype)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds no block of "
                f"{bytes_per_block(model, cache.block_size, dtype)} bytes"
            )
        shape = (model.num_layers, 2, num_blocks, model.num_kv_heads, cache.block_size, model.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]
