"""The tail: its RMSNorm, bf16(x * rsqrt(mean(x^2) + eps) * weight) in FP32, and its
up-projection added into the shared partial, bf16(fp32(shared) + normed @ up.T)."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, forbid_launches, poison
from gemm_cases import (LAYOUTS, REDUCTIONS, assert_mostly_equal, assert_one_rounding,
                        draw_row_and_configs, error_bound)
from gemm_cases import make_inputs as gemm_inputs
from wide_moe_triton import reference
from wide_moe_triton.kernels import tail
from wide_moe_triton.kernels.tail import add_up_projection, rms_norm

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
    forbid_launches(monkeypatch, tail, "_rms_norm_kernel")
    x = torch.empty(0, 96, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(96, dtype=torch.bfloat16, device=DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.shape == (0, 96) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------- up-projection

def shared_partial(b, H, seed, spare_rows=2):
    """A BF16 [b + spare_rows, H] shared partial of unit scale (the layer's rows are its
    first b)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b + spare_rows, H, generator=gen).bfloat16().to(DEVICE)


# (columns of this rank, L): the tiny layer at TP1 and TP4, and an L that is not a
# multiple of BLOCK_K 64 with a column count that is not a multiple of 8.
UP_SHAPES = [(256, 256), (64, 256), (37, 96)]


@given(b=st.integers(1, 64), shape=st.sampled_from(UP_SHAPES), layout=st.sampled_from(LAYOUTS),
       reduction=st.sampled_from(REDUCTIONS), rank=st.integers(0, 2),
       seed=st.integers(0, 2 ** 16))
def test_up_projection_adds_with_one_rounding(b, shape, layout, reduction, rank, seed):
    N, L = shape
    normed, up = gemm_inputs(b, N, L, seed)
    full = shared_partial(b, 3 * N, seed + 1)
    before = full.clone()
    cols = full[:b, rank * N:(rank + 1) * N]  # this rank's columns: strided rows
    assert add_up_projection(normed, up, cols, config={**layout, **reduction}) is cols
    # Only this rank's columns of the first b rows changed.
    others = torch.ones_like(full, dtype=torch.bool)
    others[:b, rank * N:(rank + 1) * N] = False
    assert torch.equal(full[others].view(torch.int16), before[others].view(torch.int16))
    # bf16(fp32(shared) + sums): the sums within their FP32-order bound of the float64
    # products, the FP32 add then monotone, and one rounding.
    start = before[:b, rank * N:(rank + 1) * N]
    exact = start.double() + normed.double() @ up.double().t()
    assert_one_rounding(cols, exact, error_bound(normed, up))
    ref = (start.float() + reference.mm_f32(normed, up)).to(torch.bfloat16)
    assert_mostly_equal(cols, ref)


@given(b=st.integers(2, 64), data=st.data(), reduction=st.sampled_from(REDUCTIONS),
       seed=st.integers(0, 2 ** 16))
def test_up_projection_batch_invariance(b, data, reduction, seed):
    normed, up = gemm_inputs(b, 64, 256, seed)
    full = shared_partial(b, 256, seed + 1)
    row, alone_cfg, wide_cfg = draw_row_and_configs(data, b, reduction)
    alone = full[row:row + 1, :64].clone()
    add_up_projection(normed[row:row + 1].contiguous(), up, alone, config=alone_cfg)
    add_up_projection(normed, up, full[:b, :64], config=wide_cfg)
    assert torch.equal(alone.view(torch.int16), full[row:row + 1, :64].view(torch.int16))
    # And through the tail's own tuning entry, whose tiles differ between 1 and b rows.
    one, many = full[row:row + 1].clone(), full[:b].clone()
    add_up_projection(normed[row:row + 1].contiguous(), up, one[:, 64:128])
    add_up_projection(normed, up, many[:, 64:128])
    assert torch.equal(one.view(torch.int16), many[row:row + 1].view(torch.int16))


def test_up_projection_nan_stays_in_its_row():
    normed, up = gemm_inputs(5, 64, 256, seed=6)
    normed[2, 7] = float("nan")
    full = shared_partial(5, 64, seed=7)
    clean = full.clone()
    add_up_projection(normed, up, full[:5])
    assert torch.isnan(full[2].float()).all()
    keep = [0, 1, 3, 4]
    clean = clean[keep]  # a copy: the rows without the NaN, on their own
    add_up_projection(normed[keep].contiguous(), up, clean)
    assert torch.equal(full[keep].view(torch.int16), clean.view(torch.int16))


def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.zeros(4, 64, **bf16), torch.ones(64, **bf16)
    up, cols = torch.zeros(32, 64, **bf16), torch.zeros(4, 96, **bf16)[:, 32:64]
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
        (lambda: add_up_projection(x.float(), up, cols), TypeError,
         "normed must be torch.bfloat16"),
        (lambda: add_up_projection(x, up[:, :32], cols), ValueError,
         "latent_up must have shape"),
        (lambda: add_up_projection(x, up.float(), cols), TypeError,
         "latent_up must be torch.bfloat16"),
        (lambda: add_up_projection(x, up, cols[:3]), ValueError, "shared must have shape"),
        (lambda: add_up_projection(x, up, cols.float()), TypeError,
         "shared must be torch.bfloat16"),
        (lambda: add_up_projection(x, up, torch.zeros(4, 96, **bf16)[:, ::3]), ValueError,
         "out must have adjacent columns"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()
