"""SiTU in FP32 for the kernels that apply it (the routed experts, the shared expert):
one definition, so both stages evaluate the activation with the same operations.

It runs once for every hidden element of a tile, padding rows included, so its cost is
the up kernel's epilogue: at TP8, b = 1024, IEEE divisions (five an element, each a
reciprocal, its Newton steps and a range check with a slow-path branch) would be a fifth
of the up launch's instructions (Nsight Compute; NOTES: SiTU without division). Hence no
IEEE division an element: the divisions by beta and linear_beta are products with their
correctly rounded reciprocals (exact when the parameter is a power of two, as Kimi-K3's
beta = 4 is; else within an ulp), and on the GPU exp and the
reciprocals of tanh's and the sigmoid's quotients are the hardware's approximations
with subnormals flushed (``ex2.approx.ftz``, ``rcp.approx.ftz``: one instruction each,
where ``tl.exp`` and ``/`` add range fix-ups; what they flush is below 2**-126 and
moves tanh and the sigmoid by at most 2**-125). The whole stays within a few ulp of
the exact function, which the tests bound at 16 (tests/test_situ.py, tests/test_shared.py,
tests/test_experts.py), except where sigmoid(g) is below FP32's least normal number
(g < -87.34): there it is taken as 0, so SiTU is a signed zero (NaN for an infinite u'),
where an evaluation with subnormals gives at most 2**-126 |beta u'| (1.2e-36 with
Kimi-K3's parameters); and where g / beta itself is below the least normal number, whose
FP32 value (as in the stock path's division) lies on the subnormal grid, up to one grid
step carried through beta * sigmoid(g) * u'. Triton's interpreter runs no PTX:
there ``tl.exp`` and ``/``, their subnormal results flushed as the GPU's are."""

import triton
import triton.language as tl


LOG2E = tl.constexpr(1.4426950408889634)
LEAST_NORMAL = tl.constexpr(2.0 ** -126)


@triton.jit
def _flushed(y):
    """y with its subnormal values replaced by zeros (of y's sign), as ``.ftz`` does."""
    return tl.where(tl.abs(y) < LEAST_NORMAL, y * 0.0, y)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """e**x in FP32 to a few ulp for |x| up to about 10 (the product with log2 e rounds
    once, an error that grows with |x|); 0 where e**x is subnormal."""
    if INTERPRET:
        y = _flushed(tl.exp(x))
    else:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return y


@triton.jit
def _reciprocal(x, INTERPRET: tl.constexpr):
    """1 / x in FP32 within an ulp for x in [1, 2**126]; 0 above (the subnormal results)."""
    if INTERPRET:
        y = _flushed(1.0 / x)
    else:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return y


@triton.jit
def tanh_f32(x, INTERPRET: tl.constexpr):
    """tanh in FP32 to a few ulp, from exp only (libdevice is not in the interpreter):
    an odd Taylor polynomial below 0.5 (error < 1e-8 relative) where (1 - e)/(1 + e)
    would cancel, that quotient with e = exp(-2|x|) above. NaN stays NaN."""
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
    e = _exp(-2.0 * a, INTERPRET)
    t = tl.where(a < 0.5, small, (1.0 - e) * _reciprocal(1.0 + e, INTERPRET))
    # x's sign onto |tanh x|: one bitwise op rather than a compare and a select.
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (t.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def situ(g, u, beta, linear_beta, HAS_LINEAR_BETA: tl.constexpr, INTERPRET: tl.constexpr):
    """SiTU in FP32, in ``reference.situ``'s order of operations:
    beta * tanh(g / beta) * sigmoid(g) * u', u' = linear_beta * tanh(u / linear_beta);
    each division a product with the divisor's reciprocal, rounded once a call."""
    if HAS_LINEAR_BETA:
        u = linear_beta * tanh_f32(u * tl.math.div_rn(1.0, linear_beta), INTERPRET)
    sig = _reciprocal(1.0 + _exp(-g, INTERPRET), INTERPRET)
    return beta * tanh_f32(g * tl.math.div_rn(1.0, beta), INTERPRET) * sig * u
