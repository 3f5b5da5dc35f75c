"""The tail's RMSNorm: bf16(x * rsqrt(mean(x^2) + eps) * weight) in FP32."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, poison
from wide_moe_triton import reference
from wide_moe_triton.kernels import tail
from wide_moe_triton.kernels.tail import rms_norm

EPS = 1e-6
CONFIGS = [None, dict(BLOCK_T=1, num_warps=1), dict(BLOCK_T=2, num_warps=4),
           dict(BLOCK_T=4, num_warps=8)]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at |v| (FP64): 2^(e - 7), subnormal spacing 2^-133 below 2^-126."""
    e = torch.floor(torch.log2(v.abs())).clamp(min=-126)
    return torch.exp2(e - 7)


def make_inputs(b, L, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, L, generator=gen, dtype=torch.float64) * scale).to(torch.bfloat16)
    weight = (torch.randn(L, generator=gen) * 0.5 + 1.0).to(torch.bfloat16)
    return x.to(DEVICE), weight.to(DEVICE)


def run(x, weight, eps=EPS, config=None):
    out = poison(torch.empty_like(x))
    result = rms_norm(x, weight, eps, out=out, config=config)
    assert result is out
    return out


def exact_rms_norm(x, weight, eps):
    xd = x.double()
    return xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps) * weight.double()


def assert_within_one_ulp(out, exact):
    err = (out.double() - exact).abs()
    # One BF16 ulp, and relatively: the FP32 value before the one rounding is within a
    # few FP32 ulps of exact, so the rounding is the whole error (at most half an ulp of
    # BF16's 8 significant bits, i.e. 2^-8 relative, plus slack for the FP32 part).
    assert (err <= bf16_ulp(exact)).all(), f"max excess {(err - bf16_ulp(exact)).max():.3g}"
    assert (err <= 2.0 ** -8 * exact.abs() * (1 + 1e-5) + 2.0 ** -134).all()


# Scales from BF16 subnormals (x^2 underflows FP32: eps alone sets the norm) to values
# whose squares sum to ~1e37, just inside FP32 (the stock path overflows beyond).
@given(b=st.integers(1, 64), L=st.sampled_from([256, 96, 200]),
       scale=st.sampled_from([2.0 ** -130, 1e-20, 1e-3, 1.0, 1e6, 2.0 ** 56]),
       config=st.sampled_from(CONFIGS), seed=st.integers(0, 2 ** 16))
def test_rms_norm_vs_float64(b, L, scale, config, seed):
    x, weight = make_inputs(b, L, scale, seed)
    out = run(x, weight, config=config)
    assert torch.isfinite(out).all()
    exact = exact_rms_norm(x, weight, EPS)
    assert_within_one_ulp(out, exact)
    # The stock path differs only in its sum order and rsqrt: never by more than an ulp.
    ref = reference.rms_norm(x, weight, EPS).double()
    assert ((out.double() - ref).abs() <= bf16_ulp(exact)).all()


@given(b=st.integers(1, 16), L=st.sampled_from([256, 96]), seed=st.integers(0, 2 ** 16),
       eps=st.sampled_from([1e-6, 1e-2, 0.5]))
def test_zero_rows_stay_zero_and_finite(b, L, seed, eps):
    x, weight = make_inputs(b, L, 1.0, seed)
    zero = torch.arange(b, device=DEVICE) % 2 == 0
    x[zero] = 0.0
    out = run(x, weight, eps=eps)
    assert torch.isfinite(out).all()
    assert (out[zero] == 0).all()
    assert_within_one_ulp(out, exact_rms_norm(x, weight, eps))


def test_mixed_magnitudes_in_a_row():
    # A few huge entries dominate the mean; the small ones land near BF16's bottom.
    x, weight = make_inputs(4, 256, 1.0, seed=5)
    x[:, ::37] = 3.0e15
    x[:, 1::53] = -1e-30
    out = run(x, weight)
    assert_within_one_ulp(out, exact_rms_norm(x, weight, EPS))


def test_production_width_and_in_place():
    x, weight = make_inputs(3, 3584, 1.0, seed=9)
    expected = run(x, weight)
    assert_within_one_ulp(expected, exact_rms_norm(x, weight, EPS))
    same = x.clone()
    assert rms_norm(same, weight, EPS, out=same) is same
    assert torch.equal(same.view(torch.int16), expected.view(torch.int16))


def test_empty_batch_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for an empty batch")

    monkeypatch.setattr(tail, "_rms_norm_kernel", NoLaunch())
    x = torch.empty(0, 96, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(96, dtype=torch.bfloat16, device=DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.shape == (0, 96) and out.dtype == torch.bfloat16


def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.zeros(4, 64, **bf16), torch.ones(64, **bf16)
    return [
        (lambda: rms_norm(x.float(), w, EPS), TypeError, "x must be torch.bfloat16"),
        (lambda: rms_norm(x[0], w, EPS), ValueError, "x must have shape"),
        (lambda: rms_norm(torch.zeros(64, 4, **bf16).t(), w, EPS), ValueError,
         "x must be contiguous"),
        (lambda: rms_norm(x[:, :0], w[:0], EPS), ValueError, "x must have between"),
        (lambda: rms_norm(x, w[:63], EPS), ValueError, "weight must have shape"),
        (lambda: rms_norm(x, w.float(), EPS), TypeError, "weight must be torch.bfloat16"),
        (lambda: rms_norm(x, w.to("meta"), EPS), ValueError, "weight must be on"),
        (lambda: rms_norm(x, w, -1e-6), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, float("nan")), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, "1e-6"), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, EPS, out=torch.zeros(4, 64, device=DEVICE)), TypeError,
         "out must be torch.bfloat16"),
        (lambda: rms_norm(x, w, EPS, config=dict(BLOCK_T=3, num_warps=4)), ValueError,
         "BLOCK_T"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()
