"""SiTU and its tanh in FP32 (``kernels/situ.py``), element by element against float64,
over drawn values: zeros of both signs, subnormals, the 0.5 where tanh changes formula,
values past exp's range, infinities and NaN."""

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, strategies as st

from conftest import DEVICE, poison
from wide_moe_triton.kernels.situ import situ, tanh_f32

BLOCK = 64
ULP = 2.0 ** -24


@triton.jit
def _situ_kernel(g_ptr, u_ptr, out_ptr, tanh_ptr, n, beta, linear_beta,
                 HAS_LINEAR_BETA: tl.constexpr, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    u = tl.load(u_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, situ(g, u, beta, linear_beta, HAS_LINEAR_BETA, INTERPRET), mask=ok)
    tl.store(tanh_ptr + i, tanh_f32(g, INTERPRET), mask=ok)


def run(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None):
    """(situ(g, u), tanh(g)) from the kernels, FP32, through poisoned buffers."""
    n = g.numel()
    out = poison(torch.empty(n, dtype=torch.float32, device=DEVICE))
    tanh = poison(torch.empty(n, dtype=torch.float32, device=DEVICE))
    _situ_kernel[(triton.cdiv(n, BLOCK),)](
        g.to(DEVICE), u.to(DEVICE), out, tanh, n, beta,
        1.0 if linear_beta is None else linear_beta, HAS_LINEAR_BETA=linear_beta is not None,
        INTERPRET=DEVICE.type != "cuda", BLOCK=BLOCK)
    return out.cpu(), tanh.cpu()


def u_prime(u, linear_beta):
    """SiTU's u' in float64: u clamped smoothly to +-linear_beta, or u itself."""
    u = u.double()
    return u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)


def situ64(g, u, beta, linear_beta):
    g = g.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * u_prime(u, linear_beta)


def assert_close(out: torch.Tensor, exact: torch.Tensor, ulps: float, what: str,
                 argument_error: torch.Tensor | None = None):
    """NaN exactly where the exact value is NaN, the same infinities, and each finite value
    within ``ulps`` FP32 ulps of the exact one (relative), or 2**-100 of it absolutely
    (for results near FP32's underflow), plus ``argument_error`` where given (what an
    argument FP32 cannot hold exactly moves the exact value by)."""
    out = out.double()
    assert torch.equal(out.isnan(), exact.isnan()), f"{what}: NaN where none is due"
    inf = exact.isinf()
    assert torch.equal(out[inf], exact[inf]), f"{what}: infinities differ"
    fin = ~exact.isnan() & ~inf
    err = (out[fin] - exact[fin]).abs()
    bound = ulps * ULP * exact[fin].abs() + 2.0 ** -100
    if argument_error is not None:
        bound = bound + argument_error[fin]
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.2f}x its bound of {ulps} ulp"


EDGES = [0.0, -0.0, 1e-40, -1e-40, 0.5, -0.5, math.nextafter(0.5, 0), 1.0, 2.0, 20.0,
         -87.5, -87.3, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30, math.inf, -math.inf, math.nan]
values = st.one_of(st.sampled_from(EDGES), st.floats(-8, 8, width=32),
                   st.floats(width=32, allow_nan=False, allow_infinity=False))


# Where sigmoid(g) is below FP32's least normal (g < -87.34), the kernels take it as 0.
SUBNORMAL_SIGMOID = 2.0 ** -126


@given(g=st.lists(values, min_size=1, max_size=150),
       u=st.lists(values, min_size=150, max_size=150),
       beta=st.sampled_from([4.0, 1.0, 0.5, 3.0, 7.5]),
       linear_beta=st.sampled_from([None, 25.0, 0.5, 6.0]))
# A flushed sigmoid beside an infinite, a NaN and a huge u, with and without the clamp.
@example(g=[-100.0, -87.5, -100.0, 0.3], u=[math.inf, math.nan, 1e30, -1.0] + [0.0] * 146,
         beta=4.0, linear_beta=None)
@example(g=[-100.0, -87.5, -100.0, 0.3], u=[math.inf, math.nan, 1e30, -1.0] + [0.0] * 146,
         beta=4.0, linear_beta=25.0)
# g / beta below FP32's least normal, times a huge u (CI found the first, 2026-12-04).
@example(g=[1e-40, 4e-39, -1e-40], u=[1e30, 1e30, -3.0] + [0.0] * 147, beta=4.0,
         linear_beta=None)
def test_situ_is_within_a_few_ulp_of_float64(g, u, beta, linear_beta):
    g = torch.tensor(g, dtype=torch.float32)
    u = torch.tensor(u[:g.numel()], dtype=torch.float32)
    out, tanh = run(g, u, beta, linear_beta)
    assert_close(tanh, torch.tanh(g.double()), 8, "tanh")
    sig = torch.sigmoid(g.double())
    normal = sig.isnan() | (sig >= SUBNORMAL_SIGMOID * (1 + 2.0 ** -10))
    # Where g / beta is below FP32's least normal, FP32 holds it on the subnormal grid,
    # steps of 2**-149 (the stock path's division too): one step, carried through
    # beta * sigmoid(g) * u', is what that argument alone can move SiTU by. 0 elsewhere.
    tiny = (g.double() / beta).abs() < SUBNORMAL_SIGMOID
    grid = torch.where(tiny, beta * 2.0 ** -149 * sig * u_prime(u, linear_beta).abs(), 0.0)
    assert_close(out[normal], situ64(g, u, beta, linear_beta)[normal], 16, "situ",
                 grid[normal])
    # Below, SiTU is 0 * u': a signed zero, or NaN for an infinite or NaN u'.
    flushed = sig < SUBNORMAL_SIGMOID * (1 - 2.0 ** -10)
    finite_u = u_prime(u, linear_beta).isfinite()
    assert (out[flushed & finite_u] == 0).all(), "a flushed sigmoid left a nonzero SiTU"
    assert out[flushed & ~finite_u].isnan().all()
    # tanh is odd bit for bit, signed zeros included.
    neg = run(-g, u, beta, linear_beta)[1]
    same = ~g.isnan()
    assert torch.equal(neg[same].view(torch.int32), (-tanh[same]).view(torch.int32))


@pytest.mark.parametrize("linear_beta", [None, 25.0])
def test_situ_near_zero_is_swiglu(linear_beta):
    # Where g / beta and u / linear_beta are tiny, tanh(x) = x to FP32's precision, so
    # SiTU is g * sigmoid(g) * u.
    g = torch.linspace(-1e-3, 1e-3, 101, dtype=torch.float32)
    u = torch.linspace(2e-3, -2e-3, 101, dtype=torch.float32)
    out = run(g, u, 4.0, linear_beta)[0].double()
    swiglu = g.double() * torch.sigmoid(g.double()) * u.double()
    assert torch.allclose(out, swiglu, rtol=16 * ULP, atol=0)
