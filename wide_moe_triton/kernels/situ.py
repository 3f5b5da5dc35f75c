"""SiTU in FP32 for the kernels that apply it (the routed experts, the shared expert):
one definition, so both stages evaluate the activation with the same operations."""

import triton
import triton.language as tl


@triton.jit
def tanh_f32(x):
    """tanh in FP32 to about an ulp, from exp only (libdevice is not in the interpreter):
    an odd Taylor polynomial below 0.5 (error < 1e-8 relative) where (1 - e)/(1 + e)
    would cancel, that quotient with e = exp(-2|x|) above."""
    a = tl.abs(x)
    a2 = a * a
    p = -929569.0 / 638512875.0
    p = p * a2 + 21844.0 / 6081075.0
    p = p * a2 - 1382.0 / 155925.0
    p = p * a2 + 62.0 / 2835.0
    p = p * a2 - 17.0 / 315.0
    p = p * a2 + 2.0 / 15.0
    p = p * a2 - 1.0 / 3.0
    small = a + a * a2 * p
    e = tl.exp(-2.0 * a)
    large = tl.math.div_rn(1.0 - e, 1.0 + e)
    t = tl.where(a < 0.5, small, large)
    t = tl.where(x < 0, -t, t)
    return tl.where(x != x, x, t)


@triton.jit
def situ(g, u, beta, linear_beta, HAS_LINEAR_BETA: tl.constexpr):
    """SiTU in FP32, in ``reference.situ``'s order of operations:
    beta * tanh(g / beta) * sigmoid(g) * u', u' = linear_beta * tanh(u / linear_beta)."""
    if HAS_LINEAR_BETA:
        u = linear_beta * tanh_f32(tl.math.div_rn(u, linear_beta))
    sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + tl.exp(-g))
    return beta * tanh_f32(tl.math.div_rn(g, beta)) * sig * u
