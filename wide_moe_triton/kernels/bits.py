"""Bit-level conversions between FP32 and BF16 that every kernel shares.

Done on the bits rather than by casts, because casts differ between backends: Triton's
interpreter flushes BF16 subnormals and does not round ties to even.
"""

import triton
import triton.language as tl


@triton.jit
def bf16_bits_to_f32(bits):
    """FP32 values of BF16 bit patterns (int16), subnormals kept: a conversion by shift,
    because the interpreter's BF16 cast flushes subnormals."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """BF16 bit patterns (int16) of FP32 ``x``: round to nearest even on the bits
    (subnormals kept, overflow to inf), NaN -> 0x7FC0. On the bits because casts differ
    between backends (the interpreter's flushes subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def round_to_bf16(x):
    """FP32 ``x`` rounded once to BF16 (nearest even), kept as FP32 values: the rounding
    a BF16 output applies, for math that goes on in FP32 afterwards."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))
