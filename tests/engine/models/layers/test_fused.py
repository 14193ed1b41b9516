"""The C++ fused layer ops equal the torch reference exactly (same rounding points)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.layers.fused import CpuLayerOps, TorchLayerOps, select_layer_ops

REF = TorchLayerOps()


@pytest.fixture(scope="module")
def cpu_ops() -> CpuLayerOps:
    ops = select_layer_ops(torch.device("cpu"), torch.float32)
    assert isinstance(ops, CpuLayerOps), "the fused C++ ops must build on this machine"
    return ops


DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(cpu_ops, dtype) -> None:
    x, r, w = _rand(7, 96, dtype=dtype), _rand(7, 96, dtype=dtype, seed=1), _rand(96, dtype=dtype, seed=2)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    x1, r1, x2, r2 = x.clone(), r.clone(), x.clone(), r.clone()
    cpu_ops.add_rms_norm_(x1, r1, w, 1e-5)
    REF.add_rms_norm_(x2, r2, w, 1e-5)
    assert torch.equal(r1, r2) and torch.equal(r1, (r + x))
    torch.testing.assert_close(x1, x2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_first_heads_only(cpu_ops, dtype) -> None:
    qkv = _rand(5, 7, 16, dtype=dtype)
    ang = torch.rand(5, 8, generator=torch.Generator().manual_seed(3)) * 6
    cos, sin = ang.cos(), ang.sin()
    a, b = qkv.clone(), qkv.clone()
    cpu_ops.rotary_(a, cos, sin, 5)
    REF.rotary_(b, cos, sin, 5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(a[:, 5:], qkv[:, 5:])  # v heads untouched
    assert not torch.equal(a[:, :5], qkv[:, :5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(cpu_ops, dtype) -> None:
    gu = _rand(6, 64, dtype=dtype)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gu), REF.silu_and_mul(gu), atol=1e-5, rtol=1.6e-2)
