"""The KV cache's memory: preallocated block tensors for every layer, sized from a budget.

One tensor holds every layer's blocks, so the budget is one allocation and a layer's K and
V are views:

    kv [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
    layer l: k_cache = kv[l, 0], v_cache = kv[l, 1]   [num_blocks, kvh, block_size, hd]

Within a block, one head's block_size x head_dim slab is contiguous, which is what the
attention kernel streams. No request owns memory here: the block pool hands out ids.

With kv_cache_dtype "fp8" or "int8", kv holds one-byte codes and a second tensor their
scales, one per block, head and K-or-V (runner/kv_quantization.py):

    scales [num_layers, 2, num_blocks, num_kv_heads]   float32
    layer l: k_scale = scales[l, 0], v_scale = scales[l, 1]   [num_blocks, kvh]

A block's bytes count both, so a budget holds num_blocks = budget // bytes_per_block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.config import KV_CACHE_DTYPES, CacheConfig, ModelConfig
from tokenmill.engine.runner.kv_quantization import is_quantized

_ONE_BYTE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_SCALE_DTYPE = torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" -> the model's dtype; "fp8" -> float8_e4m3fn; "int8" -> int8."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return _ONE_BYTE.get(kv_cache_dtype, model_dtype)


def bytes_per_block(
    model: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """K and V of one block across all layers, scales included (dtype: the model's)."""
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    elem = torch.empty((), dtype=cache_dtype).element_size()
    per_head = block_size * model.head_dim * elem
    if is_quantized(cache_dtype):
        per_head += torch.empty((), dtype=_SCALE_DTYPE).element_size()
    return 2 * model.num_layers * model.num_kv_heads * per_head


@dataclass
class KVCacheTensors:
    kv: torch.Tensor
    # float32 [num_layers, 2, num_blocks, kvh] for one-byte codes; None otherwise.
    scales: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
    ) -> KVCacheTensors:
        """As many blocks as cache.kv_cache_memory_bytes holds (dtype: the model's)."""
        per_block = bytes_per_block(model, cache.block_size, dtype, cache.kv_cache_dtype)
        num_blocks = cache.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds no block of "
                f"{per_block} bytes"
            )
        return cls.allocate_blocks(
            model, num_blocks, cache.block_size, dtype, device, cache.kv_cache_dtype
        )

    @classmethod
    def allocate_blocks(
        cls,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
    ) -> KVCacheTensors:
        """Exactly num_blocks blocks (e.g. a draft model's cache beside the target's)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        shape = (model.num_layers, 2, num_blocks, model.num_kv_heads, block_size, model.head_dim)
        scales = None
        if is_quantized(cache_dtype):
            scales = torch.zeros(shape[:4], dtype=_SCALE_DTYPE, device=device)
        return cls(torch.zeros(shape, dtype=cache_dtype, device=device), scales)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """What the blocks store: the model's dtype, int8 or float8_e4m3fn."""
        return self.kv.dtype

    @property
    def num_bytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scale_bytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]

    def layer_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (k_scale, v_scale) [num_blocks, kvh]; None for unquantized blocks."""
        if self.scales is None:
            return None
        return self.scales[index, 0], self.scales[index, 1]
