"""Quantization of the decoder's projections.

    config.py            QuantConfig: method (int8 | int4 | fp8) and int4 group size
    weights.py           QuantizedWeight: codes + scales (+ zero points, + SmoothQuant
                         factors), made from float weights or taken over from GGUF
                         Q4_0/Q4_1 blocks as they are
    smoothing.py         SmoothQuant factors for int8 weights, calibrated on a fixed text
    int8_activations.py  int8 x int8 matmuls: activations quantized per token row
    linear.py            QuantizedLinear: the matmul on those codes (packed low-bit kernels)
    apply.py             quantize_linears: swap a model's float projections for quantized ones
    checkpoint.py        save_quantized: a quantized checkpoint that loads directly
    quality.py           perplexity and greedy agreement against the unquantized model
"""
