"""Finalize: bf16(sum_k w[t,k] * rows[t*K+k]) as an FP32 FMA chain, one rounding."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, forbid_launches, poison
from wide_moe_triton import reference
from wide_moe_triton.kernels import finalize as finalize_module
from wide_moe_triton.kernels.finalize import finalize

U32 = 2.0 ** -24
# Weights a router can produce and ones it cannot: zeros of both signs, negatives, BF16
# subnormals, huge values (products overflow FP32, sums meet inf - inf); rows with the
# same, and NaN.
EDGE_WEIGHTS = [0.0, -0.0, 1.0, -1.0, 2.827, -0.5, 2.0 ** -133, -(2.0 ** -126), 1e30, -1e30,
                3.0e38, -3.0e38, 1e-30]
EDGE_ROWS = [0.0, -0.0, 2.0 ** -133, -(2.0 ** -130), 1e30, -1e30, 65504.0, -1.0,
             float("nan")]
CONFIGS = [None, dict(BLOCK_T=1, BLOCK_L=128, num_warps=4),
           dict(BLOCK_T=2, BLOCK_L=256, num_warps=2), dict(BLOCK_T=4, BLOCK_L=128, num_warps=1)]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at |v| (FP64): 2^(e - 7), subnormal spacing 2^-133 below 2^-126."""
    e = torch.floor(torch.log2(v.abs())).clamp(min=-126)
    return torch.exp2(e - 7)


def sprinkle(t: torch.Tensor, values, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``t`` (FP32) with about ``fraction`` of its elements replaced by ``values``."""
    table = torch.tensor(values, dtype=torch.float32)
    pick = torch.rand(t.shape, generator=gen) < fraction
    which = torch.randint(len(values), t.shape, generator=gen)
    return torch.where(pick, table[which], t)


def make_inputs(b, K, L, seed, edge_weights=0.0, edge_rows=0.0):
    gen = torch.Generator().manual_seed(seed)
    rows = sprinkle(torch.randn(b * K, L, generator=gen), EDGE_ROWS, edge_rows, gen)
    weights = sprinkle(torch.rand(b, K, generator=gen) * (2.827 / K), EDGE_WEIGHTS,
                       edge_weights, gen)
    return rows.to(torch.bfloat16).to(DEVICE), weights.to(torch.bfloat16).to(DEVICE)


def run(rows, weights, config=None, **kwargs):
    out = poison(torch.empty(weights.shape[0], rows.shape[1], dtype=torch.bfloat16,
                             device=DEVICE))
    result = finalize(rows, weights, out=out, config=config, **kwargs)
    assert result is out
    return out


def assert_same_bits(out, ref):
    """Bitwise equal, except that NaN only has to be NaN (its bits are the backend's)."""
    nan = torch.isnan(out)
    assert torch.equal(nan, torch.isnan(ref)), "NaN in different places"
    same = out.view(torch.int16) == ref.view(torch.int16)
    assert (same | nan).all(), f"{(~(same | nan)).sum().item()} elements differ"


@given(b=st.integers(1, 40), K=st.sampled_from([1, 2, 4, 16]), L=st.sampled_from([256, 96]),
       config=st.sampled_from(CONFIGS), edge=st.sampled_from([0.0, 0.05, 0.3]),
       seed=st.integers(0, 2 ** 16))
def test_finalize_bitwise_vs_reference(b, K, L, config, edge, seed):
    rows, weights = make_inputs(b, K, L, seed, edge_weights=edge, edge_rows=edge)
    out = run(rows, weights, config)
    assert_same_bits(out, reference.finalize(rows, weights))


@given(b=st.integers(1, 40), K=st.sampled_from([1, 4, 16]), L=st.sampled_from([256, 96]),
       edge=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2 ** 16))
def test_finalize_within_one_ulp_of_float64(b, K, L, edge, seed):
    rows, weights = make_inputs(b, K, L, seed, edge_weights=edge, edge_rows=edge / 2)
    out = run(rows, weights).double()
    terms = weights.double()[:, :, None] * rows.double().reshape(b, K, L)
    exact, magnitude = terms.sum(1), terms.abs().sum(1)
    # Where no partial sum can leave FP32's range: the chain's own error bound (K
    # roundings, negligible unless terms cancel) plus one BF16 ulp for the final rounding.
    ok = magnitude < 1e38
    assert ok.any()
    bound = bf16_ulp(exact) + K * U32 * magnitude + K * 2.0 ** -149
    err = (out - exact).abs()
    assert (err[ok] <= bound[ok]).all(), f"max excess {(err - bound)[ok].max().item():.3g}"


@given(b=st.integers(1, 64), L=st.sampled_from([256, 96]), seed=st.integers(0, 2 ** 16))
def test_single_expert_is_one_rounding_of_the_product(b, L, seed):
    # K = 1: an FP32 product of two BF16 values is exact, so the result is the exact
    # product rounded once to BF16.
    rows, weights = make_inputs(b, 1, L, seed)
    out = run(rows, weights)
    exact = (weights.double() * rows.double()).to(torch.float32).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), exact.view(torch.int16))


def test_production_latent_width():
    # L = 3584, K = 16 with the default config: 7 column chunks a token, no masking.
    rows, weights = make_inputs(3, 16, 3584, seed=7)
    assert_same_bits(run(rows, weights), reference.finalize(rows, weights))


def test_zero_weights_give_positive_zero():
    rows, _ = make_inputs(4, 4, 96, seed=1)
    weights = torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE)
    weights[1] = -0.0
    out = run(rows, weights)
    assert torch.equal(out.view(torch.int16), torch.zeros_like(out).view(torch.int16))


def test_generation_advances_once_per_call():
    rows, weights = make_inputs(5, 4, 96, seed=2)
    generation = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    first = run(rows, weights, generation=generation)
    assert generation.item() == 42
    second = run(rows, weights, config=dict(BLOCK_T=4, BLOCK_L=64, num_warps=1),
                 generation=generation)
    assert generation.item() == 43
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))


def test_empty_batch_launches_nothing(monkeypatch):
    forbid_launches(monkeypatch, finalize_module, "_finalize_kernel")
    generation = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    rows = torch.empty(0, 96, dtype=torch.bfloat16, device=DEVICE)
    weights = torch.empty(0, 4, dtype=torch.bfloat16, device=DEVICE)
    out = finalize(rows, weights, generation=generation)
    assert out.shape == (0, 96) and out.dtype == torch.bfloat16
    assert generation.item() == 3


def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    rows, weights = torch.zeros(8, 64, **bf16), torch.zeros(2, 4, **bf16)
    gen = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    return [
        (lambda: finalize(rows.float(), weights), TypeError, "rows must be torch.bfloat16"),
        (lambda: finalize(rows[:7], weights), ValueError, "rows must have shape"),
        (lambda: finalize(torch.zeros(64, 8, **bf16).t(), weights), ValueError,
         "rows must be contiguous"),
        (lambda: finalize(rows, weights.float()), TypeError, "weights must be torch.bfloat16"),
        (lambda: finalize(rows, weights[0]), ValueError, "weights must have shape"),
        (lambda: finalize(rows, weights[:, :0]), ValueError, "weights must have at least one"),
        (lambda: finalize(rows.to("meta"), weights), ValueError, "rows must be on"),
        (lambda: finalize(rows, weights, out=torch.zeros(2, 65, **bf16)), ValueError,
         "out must have shape"),
        (lambda: finalize(rows, weights, generation=gen.long()), TypeError, "generation"),
        (lambda: finalize(rows, weights, generation=torch.zeros(2, dtype=torch.int32)),
         ValueError, "generation must have shape"),
        (lambda: finalize(rows, weights, config=dict(BLOCK_T=3, BLOCK_L=64, num_warps=1)),
         ValueError, "BLOCK_T"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()
