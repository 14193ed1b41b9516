"""Paged attention: the model's attention over the block-table KV cache, for one step.

Every layer of a step attends with the same batch geometry, so everything derived from it
(the C++ kernel's tile schedule, the torch fallback's gather indices and masks) is planned
on the first layer, memoized in the step's AttentionMetadata, and reused by the other
layers.

    q, out        [T, num_heads, head_dim]        T = tokens of all requests this step
    k, v          [T, num_kv_heads, head_dim]     this step's new tokens
    k/v_cache     [num_blocks, num_kv_heads, block_size, head_dim]
    k/v_scale     [num_blocks, num_kv_heads]      float32, only for one-byte caches
    request r     query rows qsl[r]:qsl[r+1], the last n_r of its seq_lens[r] positions

The caches hold the model's dtype, or one-byte codes (int8, float8_e4m3fn) with a scale
per block and head (runner/kv_quantization.py): write_kv quantizes the new tokens into
them, and both backends dequantize inside attention (the kernel as it loads each K/V row
into fp32, the torch backend on the gathered blocks).

Backends:
  * cpu kernel (csrc/paged_attention.cpp, built on first use): reads K/V straight from the
    blocks, no gather. Used on the CPU for float32/bfloat16 queries (over caches of their
    own dtype, int8 or fp8) whenever it builds.
  * torch: gathers each request's blocks into a contiguous tensor and calls
    F.scaled_dot_product_attention with the causal offset; runs on any device. Decodes are
    batched into one padded call, prefill chunks go one call per request.

If the kernel fails to build, a warning is logged once and the torch backend is used.
Fresh prompts (no cached prefix) of at least `dense_prefill_min_len` tokens can be routed
to SDPA on their contiguous K/V instead of the kernel; benchmarks/attention_kernel.py
measures where that pays (see DEFAULT_DENSE_PREFILL_MIN_LEN).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.engine.cpu_extension import CSRC, build_extension
from tokenmill.engine.runner.kv_cache_tensors import KVCacheTensors
from tokenmill.engine.runner.kv_quantization import dequantize, is_quantized, write_quantized

if TYPE_CHECKING:
    from tokenmill.engine.models.llama import Attention

logger = logging.getLogger(__name__)

_CSRC = CSRC / "paged_attention.cpp"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# A layer's (k_scale, v_scale), each [num_blocks, kvh] float32, for one-byte caches.
KVScales = tuple[torch.Tensor, torch.Tensor]

# Fresh prompts this long or longer go to SDPA on contiguous K/V instead of the kernel;
# None keeps every request on the kernel. Measured by benchmarks/attention_kernel.py:
# the kernel stays faster than contiguous SDPA at every prefill length measured (256-2048
# tokens, fp32 and bf16) on this machine, so nothing is routed by default.
DEFAULT_DENSE_PREFILL_MIN_LEN: int | None = None


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """Build (once per source + flags + CPU) and import the C++ kernel; None if it fails."""
    try:
        return build_extension(_CSRC)
    except Exception as exc:  # any build/import failure means "use the fallback"
        logger.warning("paged attention C++ kernel unavailable, using the torch fallback: %s", exc)
        return None


@dataclass
class AttentionMetadata:
    """The batch geometry of one step, shared by all layers (built once per step)."""

    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R], context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [R + 1]
    slot_mapping: torch.Tensor  # int64 [T], slot of each new token (< 0: skip)
    max_query_len: int
    block_size: int
    # Host copies, read by the planners.
    seq_lens_host: list[int] = field(default_factory=list)
    query_start_host: list[int] = field(default_factory=list)
    # (backend, group size) -> plan; filled by the first layer, reused by the others.
    plans: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        *,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
        max_query_len: int,
        block_size: int,
    ) -> AttentionMetadata:
        return cls(
            block_table=block_table.to(torch.int32).contiguous(),
            seq_lens=seq_lens.to(torch.int32).contiguous(),
            query_start_loc=query_start_loc.to(torch.int32).contiguous(),
            slot_mapping=slot_mapping.to(torch.int64).contiguous(),
            max_query_len=max_query_len,
            block_size=block_size,
            seq_lens_host=seq_lens.tolist(),
            query_start_host=query_start_loc.tolist(),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    def query_len(self, req: int) -> int:
        return self.query_start_host[req + 1] - self.query_start_host[req]

    def block_ids(self, req: int) -> torch.Tensor:
        """The blocks holding request req's context, in order."""
        num_blocks = -(-self.seq_lens_host[req] // self.block_size)
        return self.block_table[req, :num_blocks].long()


@dataclass(frozen=True)
class _DensePrefill:
    """A request attended by SDPA: `causal_from` is None for a fresh prompt, else a mask."""

    req: int
    start: int
    end: int
    block_ids: torch.Tensor  # int64 [num_blocks]
    mask: torch.Tensor | None  # bool [n, seq_len] (True = attend), None = plain causal


@dataclass(frozen=True)
class _DecodeGroup:
    """All single-token requests of the step, attended in one padded SDPA call."""

    rows: torch.Tensor  # int64 [Rd], their rows of q
    block_ids: torch.Tensor  # int64 [Rd, max_blocks]
    mask: torch.Tensor  # bool [Rd, 1, 1, max_blocks * block_size]


@dataclass(frozen=True)
class _KernelPlan:
    work: torch.Tensor  # int32 [W, 3] kernel tiles, costliest first
    dense: tuple[_DensePrefill, ...]


@dataclass(frozen=True)
class _TorchPlan:
    decodes: _DecodeGroup | None
    prefills: tuple[_DensePrefill, ...]
    slot_blocks: torch.Tensor  # int64 [T'], block of each token with a slot
    slot_offsets: torch.Tensor  # int64 [T'], row within the block
    slot_rows: torch.Tensor | None  # int64 [T'] rows of k/v to write; None = all


class PagedAttention:
    """write_kv + forward over the paged cache; one instance serves every layer."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        scale: float | None = None,
        dense_prefill_min_len: int | None = DEFAULT_DENSE_PREFILL_MIN_LEN,
    ) -> None:
        """backend: "auto" (kernel on the CPU when it builds, else torch), "kernel" (raise
        if it cannot build) or "torch". scale: softmax scale, default 1/sqrt(head_dim)."""
        if backend not in ("auto", "kernel", "torch"):
            raise ValueError(f"backend must be auto, kernel or torch, got {backend!r}")
        self.device = torch.device(device)
        self.scale = scale
        self.dense_prefill_min_len = dense_prefill_min_len
        self._kernel: ModuleType | None = None
        if backend != "torch" and self.device.type == "cpu":
            self._kernel = load_cpu_kernel()
        if backend == "kernel" and self._kernel is None:
            raise RuntimeError("the paged attention C++ kernel is unavailable on this device")

    @property
    def backend(self) -> str:
        return "kernel" if self._kernel is not None else "torch"

    def _uses_kernel(self, x: torch.Tensor, cache: torch.Tensor) -> bool:
        """x (q or the new k/v) in fp32/bf16 on the CPU, over a cache of x's dtype or codes."""
        return (
            self._kernel is not None
            and x.device.type == "cpu"
            and x.dtype in _KERNEL_DTYPES
            and (cache.dtype == x.dtype or is_quantized(cache.dtype))
        )

    # ------------------------------------------------------------------ write
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scales: KVScales | None = None,
    ) -> None:
        """Store this step's k/v [T, kvh, hd] at metadata.slot_mapping in the caches
        (quantized, updating `scales`, when the caches hold one-byte codes)."""
        _check_scales(k_cache, scales)
        if self._kernel is not None and self._uses_kernel(k, k_cache):
            extra = () if scales is None else scales
            self._kernel.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, *extra)
            return
        plan = self._torch_plan(metadata)
        if plan.slot_rows is not None:
            k, v = k[plan.slot_rows], v[plan.slot_rows]
        if scales is not None:
            write_quantized(k, k_cache, scales[0], plan.slot_blocks, plan.slot_offsets)
            write_quantized(v, v_cache, scales[1], plan.slot_blocks, plan.slot_offsets)
            return
        # Indexing dims 0 and 2 puts the token dim first: [T', kvh, hd] like k.
        k_cache[plan.slot_blocks, :, plan.slot_offsets] = k
        v_cache[plan.slot_blocks, :, plan.slot_offsets] = v

    # ------------------------------------------------------------------ attend
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Causal attention of q [T, nh, hd] over each request's cached context -> [T, nh, hd]."""
        _check_scales(k_cache, scales)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        group = q.shape[1] // k_cache.shape[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._kernel is not None and self._uses_kernel(q, k_cache):
            plan = self._kernel_plan(metadata, group)
            self._kernel.paged_attention(
                out,
                q,
                k_cache,
                v_cache,
                metadata.block_table,
                metadata.seq_lens,
                metadata.query_start_loc,
                scale,
                plan.work,
                *(() if scales is None else scales),
            )
            dense = plan.dense
        else:
            tplan = self._torch_plan(metadata)
            if tplan.decodes is not None:
                _attend_decodes(out, q, k_cache, v_cache, tplan.decodes, scale, scales)
            dense = tplan.prefills
        for prefill in dense:
            _attend_prefill(out, q, k_cache, v_cache, prefill, scale, scales)
        return out

    # ------------------------------------------------------------------ plans
    def _kernel_plan(self, md: AttentionMetadata, group: int) -> _KernelPlan:
        key = ("kernel", group)
        if key not in md.plans:
            assert self._kernel is not None
            work = self._kernel.plan_work(md.seq_lens, md.query_start_loc, group)
            dense = tuple(
                _dense_prefill(md, r) for r in range(md.num_reqs) if self._routes_dense(md, r)
            )
            if dense:
                routed = torch.zeros(md.num_reqs, dtype=torch.bool)
                routed[[d.req for d in dense]] = True
                work = work[~routed[work[:, 0].long()]].contiguous()
            md.plans[key] = _KernelPlan(work=work, dense=dense)
        plan = md.plans[key]
        assert isinstance(plan, _KernelPlan)
        return plan

    def _routes_dense(self, md: AttentionMetadata, req: int) -> bool:
        n = md.query_len(req)
        limit = self.dense_prefill_min_len
        return limit is not None and n >= limit and n == md.seq_lens_host[req]

    def _torch_plan(self, md: AttentionMetadata) -> _TorchPlan:
        key = ("torch", 0)  # the same for every group size
        if key not in md.plans:
            md.plans[key] = _build_torch_plan(md)
        plan = md.plans[key]
        assert isinstance(plan, _TorchPlan)
        return plan


def _check_scales(cache: torch.Tensor, scales: KVScales | None) -> None:
    if is_quantized(cache.dtype) != (scales is not None):
        raise ValueError(
            f"a {cache.dtype} KV cache needs "
            + ("its scales" if scales is None else "no scales")
        )


def _dense_prefill(md: AttentionMetadata, req: int) -> _DensePrefill:
    n, seq_len = md.query_len(req), md.seq_lens_host[req]
    start = md.query_start_host[req]
    mask = None
    if n != seq_len:
        # Query row j sees positions 0 .. seq_len - n + j.
        rows = torch.arange(n, device=md.block_table.device)[:, None]
        cols = torch.arange(seq_len, device=md.block_table.device)[None, :]
        mask = cols <= rows + (seq_len - n)
    return _DensePrefill(req, start, start + n, md.block_ids(req), mask)


def _build_torch_plan(md: AttentionMetadata) -> _TorchPlan:
    device = md.block_table.device
    decode_reqs = [r for r in range(md.num_reqs) if md.query_len(r) == 1]
    decodes = None
    if decode_reqs:
        idx = torch.tensor(decode_reqs, dtype=torch.long, device=device)
        seq_lens = md.seq_lens[idx].long()
        max_blocks = -(-max(md.seq_lens_host[r] for r in decode_reqs) // md.block_size)
        positions = torch.arange(max_blocks * md.block_size, device=device)
        # Entries past a request's last block may be anything: point them at block 0, and
        # the mask hides those positions.
        block_ids = md.block_table[idx, :max_blocks].long()
        used = (seq_lens + md.block_size - 1) // md.block_size
        in_use = torch.arange(max_blocks, device=device)[None, :] < used[:, None]
        decodes = _DecodeGroup(
            rows=md.query_start_loc[idx].long(),
            block_ids=torch.where(in_use, block_ids, 0),
            mask=(positions[None, :] < seq_lens[:, None])[:, None, None, :],
        )
    prefills = tuple(_dense_prefill(md, r) for r in range(md.num_reqs) if md.query_len(r) > 1)
    slots = md.slot_mapping
    valid = slots >= 0
    slot_rows = None
    if not bool(valid.all()):
        slot_rows = torch.nonzero(valid).flatten()
        slots = slots[slot_rows]
    return _TorchPlan(
        decodes=decodes,
        prefills=prefills,
        slot_blocks=slots // md.block_size,
        slot_offsets=slots % md.block_size,
        slot_rows=slot_rows,
    )


def _gather(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # cache[block_ids]: [..., nb, kvh, bs, hd] -> [..., kvh, nb * bs, hd]; codes are
    # dequantized to `dtype` with their blocks' scales [num_blocks, kvh].
    blocks = cache[block_ids]
    if scale is not None:
        assert dtype is not None
        blocks = dequantize(blocks, scale[block_ids], dtype)
    blocks = blocks.transpose(-3, -4)
    return blocks.reshape(*blocks.shape[:-3], -1, blocks.shape[-1])


def _attend_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
    scales: KVScales | None,
) -> None:
    # q rows [Rd, nh, hd] -> [Rd, nh, 1, hd] against K/V [Rd, kvh, max_blocks * bs, hd].
    ks, vs = scales if scales is not None else (None, None)
    k = _gather(k_cache, group.block_ids, ks, q.dtype)
    v = _gather(v_cache, group.block_ids, vs, q.dtype)
    qd = q[group.rows].unsqueeze(2)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
    out[group.rows] = o.squeeze(2)


def _attend_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill: _DensePrefill,
    scale: float,
    scales: KVScales | None,
) -> None:
    # One request: q [n, nh, hd] -> [1, nh, n, hd] against K/V [1, kvh, seq_len, hd]. The
    # leading batch dim matters: 3-D inputs take SDPA's math path on the CPU (~8x slower).
    seq_len = prefill.mask.shape[1] if prefill.mask is not None else prefill.end - prefill.start
    ks, vs = scales if scales is not None else (None, None)
    k = _gather(k_cache, prefill.block_ids, ks, q.dtype)[None, :, :seq_len]
    v = _gather(v_cache, prefill.block_ids, vs, q.dtype)[None, :, :seq_len]
    qr = q[prefill.start : prefill.end].transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(
        qr,
        k,
        v,
        attn_mask=prefill.mask,
        is_causal=prefill.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    out[prefill.start : prefill.end] = o[0].transpose(0, 1)


def bind_paged_attention(
    kv: KVCacheTensors, attention: PagedAttention
) -> Callable[[AttentionMetadata], Attention]:
    """metadata -> the model's Attention over `kv`'s paged blocks for that step: each layer
    writes its new K/V (quantized with their scales for one-byte caches), then attends."""

    def bind(metadata: AttentionMetadata) -> Attention:
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = kv.layer(layer)
            scales = kv.layer_scales(layer)  # one-byte blocks' scales, else None
            attention.write_kv(k, v, k_cache, v_cache, metadata, scales)
            return attention.forward(q, k_cache, v_cache, metadata, scales)

        return attend

    return bind
