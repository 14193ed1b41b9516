"""Weight-only quantization of the decoder's projections.

    config.py   QuantConfig: method (int8 | int4 | fp8) and int4 group size
    weights.py  QuantizedWeight: codes + scales (+ zero points), made from float weights or
                taken over from GGUF Q4_0/Q4_1 blocks as they are
    linear.py   QuantizedLinear: the matmul on those codes (packed low-bit kernels)
    apply.py    quantize_linears: swap a model's float projections for quantized ones
"""
