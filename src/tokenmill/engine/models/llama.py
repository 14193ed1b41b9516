"""Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

Covers Llama 2/3, SmolLM, Mistral (no sliding window) and Qwen2 (qkv bias). The model knows
nothing about paging: attention goes through an `Attention` callable the runner binds to
the KV cache and the step's metadata, so the same weights serve paged decoding and
cache-free embedding passes.

Projections are fused for fewer, larger matmuls: q|k|v in one [(nh + 2 kvh) * hd, hidden]
weight, gate|up in one [2 * ffn, hidden] weight. Tokens of all requests in a step are
flattened into one [T, hidden] batch.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.models.layers.fused import LayerOps, TorchLayerOps
from tokenmill.engine.models.layers.norm import RMSNorm
from tokenmill.engine.models.layers.rotary import RotaryEmbedding
from tokenmill.engine.quantization.linear import QuantizedLinear
from tokenmill.engine.quantization.weights import QuantizedWeight, cat_rows


class Attention(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, nh, hd], k/v: [T, kvh, hd] (rotated) -> out [T, nh, hd]."""
        ...


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention for one sequence with no KV cache (embedding passes, reference checks)."""
    # q: [T, nh, hd], k/v: [T, kvh, hd] -> [T, nh, hd]
    # SDPA takes a much faster CPU path for 4-D [1, heads, T, hd] inputs than for 3-D.
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, ops: LayerOps) -> None:
        super().__init__()
        self.index = index
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hd, nh, kvh = config.head_dim, config.num_heads, config.num_kv_heads
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = torch.nn.Linear(
            config.hidden_size, (nh + 2 * kvh) * hd, bias=config.attention_bias
        )
        self.o_proj = torch.nn.Linear(nh * hd, config.hidden_size, bias=False)
        self.gate_up_proj = torch.nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output [T, hidden] (or the embeddings, with residual None);
        returns (this layer's output, the residual stream), the add deferred to the next norm."""
        ops, norm1, norm2 = self.ops, self.input_layernorm, self.post_attention_layernorm
        num_tokens = x.shape[0]
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            ops.add_rms_norm_(x, residual, norm1.weight, norm1.eps)  # residual += x; x = norm
            h = x
        qkv = self.qkv_proj(h).view(num_tokens, nh + 2 * kvh, hd)
        ops.rotary_(qkv, cos, sin, nh + kvh)  # q and k heads, in place
        q, k, v = qkv[:, :nh], qkv[:, nh : nh + kvh], qkv[:, nh + kvh :]
        attn = attention(self.index, q, k, v)  # [T, nh, hd]
        h = self.o_proj(attn.reshape(num_tokens, nh * hd))
        ops.add_rms_norm_(h, residual, norm2.weight, norm2.eps)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops: LayerOps = ops or TorchLayerOps()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, self.ops) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_positions)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed).
        `num_layers` runs only the first layers before the final norm (a self-draft)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions)
        residual: torch.Tensor | None = None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            x, residual = layer(x, residual, cos, sin, attention)
        assert residual is not None
        self.ops.add_rms_norm_(x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab], float32 or (float32=False) in the
        model's dtype, for a caller that fuses its own conversion."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Copy HF-named tensors in, fusing q|k|v and gate|up. Every tensor must be used."""
        remaining = dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return remaining.pop(name)

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if not self.config.tie_word_embeddings:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            else:
                remaining.pop("lm_head.weight", None)  # tied checkpoints may still ship it
            for i, module in enumerate(self.layers):
                layer = cast(DecoderLayer, module)
                p = f"model.layers.{i}."
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(p + "post_attention_layernorm.weight")
                )
                bias = None
                if layer.qkv_proj.bias is not None:
                    bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                _load_projection(layer, "qkv_proj", [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], bias)
                _load_projection(layer, "o_proj", [take(p + "self_attn.o_proj.weight")])
                _load_projection(
                    layer, "gate_up_proj", [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                )
                _load_projection(layer, "down_proj", [take(p + "mlp.down_proj.weight")])
        unused = [n for n in remaining if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(f"checkpoint has tensors the model does not use: {unused[:5]}")


def _load_projection(
    layer: torch.nn.Module, name: str, parts: list[Any], bias: torch.Tensor | None = None
) -> None:
    """Fill one (possibly fused) projection: float parts are copied into its nn.Linear;
    quantized parts (kept from a GGUF file) replace it with a QuantizedLinear. Parts that
    cannot share one QuantizedLinear (a GGUF storing q, k and v in different types) are
    all taken as float weights, which the model's quantization then requantizes."""
    if all(isinstance(part, QuantizedWeight) for part in parts):
        try:
            setattr(layer, name, QuantizedLinear(cat_rows(parts), bias))
            return
        except ValueError:
            pass
    floats = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    linear = getattr(layer, name)
    linear.weight.copy_(torch.cat(floats))
    if bias is not None:
        linear.bias.copy_(bias)
