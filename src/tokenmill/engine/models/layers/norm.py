"""RMSNorm weights; the math is a fused layer op (fp32 inside, as HF Llama computes it)."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
